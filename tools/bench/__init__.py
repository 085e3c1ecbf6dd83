"""Benchmarks spmd_torch against eager PyTorch and hand-written JAX on the same math.

Workloads:
  W1  tracing overhead: 2000 cheap elementwise ops on a 256x256 tensor, host µs per op; the
      spmd_torch child also times the chain through an empty __torch_dispatch__ wrapper subclass
      (tracing's floor in Python) and reports the ratio.
  W2  MLP 784-1024-1024-10 (ReLU), batch 256, cross-entropy, SGD lr 0.01 momentum 0.9.
  W3  GPT decoder, 4 layers, d_model 256, 4 heads, seq 128, batch 8, vocab 1024, AdamW.
  W4  FSDP: the W3 GPT at batch 16, AdamW, every 2-D param and the batch sharded on dim 0 over
      an 8-device mesh with axis 'fsdp' (8 virtual CPU devices; --gpu: min(8, GPUs)), the rest
      replicated. Implementations jax and spmd_torch only; also reports param bytes per device.
  W2mp  W2's MLP data parallel over 8 devices (8 virtual CPU devices; --gpu: every local GPU), two
      ways: ``mp``, a per-device multiprocessing script (``spmd_torch.launch``, batch 32 per
      replica, ``xm.optimizer_step`` all-reducing the gradients) against ``spmd_torch``, one SPMD
      program (global batch 32 x devices sharded over a 1-D 'data' mesh). Batches are uploaded
      once before the loop with .to(device), as in W2 (no MpDeviceLoader). Steps/s is the median
      of timed windows of pipelined steps; then one window of blocked steps breaks the host time
      per step down. Compiles count UncachedCompile.
  W3amp  W3 under bfloat16 autocast: eager ``torch.autocast('cpu', torch.bfloat16)`` with
      torch.optim.AdamW against spmd_torch's ``spmd_torch.amp.autocast`` with
      ``spmd_torch.amp.syncfree.AdamW`` (same hyperparameters). spmd_torch also reports the
      device-to-host transfers counted inside its steps (TransferFromDevice; 0 expected);
      ``--check`` compares losses to bfloat16 tolerance.
  W5  checkpoints: W4's model and AdamW state after 2 steps (8-device 'fsdp' mesh), saved and
      restored by spmd_torch.experimental.distributed_checkpoint against orbax used directly on
      the same jax arrays (PyTreeCheckpointHandler, compression off), alternated rep by rep in one
      process: save, save_async (the time it blocks the loop, and until written), restore onto the
      same layout and onto a (4,2) mesh; seconds, MB/s, bytes on disk, and the peak growth of the
      process's RSS during each (sampled every ms) against the state's bytes.
  W6  Llama-style decoder from plain PyTorch modules (tools/bench/llama.py): 4 layers, d_model
      256, nn.RMSNorm, rotary embeddings (rotate-half), SwiGLU MLP (hidden 768), grouped-query
      attention through F.scaled_dot_product_attention (8 query heads, 2 kv heads, is_causal,
      enable_gqa), vocab 1024, seq 256, batch 8, W3's AdamW. As W3: steps/s, host time per step,
      compiles (target at most 2); spmd_torch also counts the CPU fallbacks (``aten::<op>``
      counters) of its steps, naming each op (target 0).
  W7cpu  GPT-2 small's structure at tiny widths (tools/bench/cpu.py, W7gpu's model): 12 layers,
      tied embedding, F.scaled_dot_product_attention(is_causal=True), GELU, LayerNorm, d_model
      64, 4 heads, seq 64, batch 2, vocab 512, float32, torch.optim.AdamW with its default
      foreach/fused choice: a step that is host work on any machine. Implementations eager, jax,
      spmd_torch, spmd_compile. Beside the timings, each spmd_torch run reports its host time per
      step (main thread CPU and wall), nodes per program (TensorsGraphSize), ops recorded
      (``xla::<op>`` counters) and traced (LazyTracing) per step, compiles in the timed steps, and
      one more step's program by part: the optimizer's nodes (and ops), the attention nodes per
      call forward and backward. Targets (issue 32): at most 1,300 nodes per program, AdamW at
      most 12 nodes per step, one node per attention call each way, host CPU per step at most
      half of 132f57f's (--against a checkout of it); a figure the checkout cannot give is n/a.
      ``--tiny``: 2 layers.
  Wattn  one attention layer's training step at a long sequence (tools/bench/attention.py): W7's
      attention layer (qkv projection, causal SDPA, output projection), batch 1, 8 heads x 64,
      loss and SGD update; ms/step and peak memory. --gpu: seq 8192 in bf16; eager and inductor
      on CUDA, jax (cuDNN attention), jax_plain (XLA's plain attention), spmd_torch; peak device
      memory as W7gpu's. CPU: seq 4096 in fp32 (jax skipped); memory by XLA's memory analysis of
      the compiled step for JAX and spmd_torch, the RSS growth of one step for eager. Target: on
      CPU, spmd_torch's peak memory at most a tenth of jax_plain's. ``--tiny``: seq 256.
  W7gpu  GPT-2 small (124M params, tied embedding; tools/bench/gpu.py), seq 1024, batch 8, bf16
      autocast, AdamW: ms/step, tokens/s and peak device memory (torch.cuda.max_memory_allocated
      for torch, memory_stats()['peak_bytes_in_use'] for JAX and spmd_torch). Implementations
      eager and ``inductor`` (torch.compile's default backend) on CUDA, spmd_torch, spmd_compile
      and hand-written JAX with donation twice: ``jax`` with cuDNN's fused attention
      (``implementation='cudnn'``; a skipped row, saying why, where JAX has no CUDA device) and
      ``jax_plain`` with XLA's plain attention. Only with --gpu (refused otherwise); ``--tiny``
      runs a small config (2 layers, d_model 64, seq 64, batch 2) on any device, CPU included, as
      a smoke test of every implementation. Not in the default workloads without --gpu. The
      report reads off issue 32's GPU targets (pipelined tokens/s): spmd_capture at least 0.9x
      jax and 1.0x inductor, spmd_compile at least 1.0x inductor, the lazy loop twice 132f57f's
      lazy figure on an H100, peak memory at most JAX's.
  Wlong  a Llama trained at a sequence plain attention cannot fit (tools/bench/long.py): W6's
      model at 8 layers, d_model 2048, 32 heads / 8 kv heads, SwiGLU 5632, vocab 32000, seq
      8192, batch 4 (about 490M params), bf16 autocast, AdamW. Implementations eager (CUDA), jax
      (cuDNN attention), jax_plain (XLA's plain attention: its probabilities take 137 GB, so its
      row reads "out of memory"), spmd_torch and spmd_capture. As W7gpu: ms/step, tokens/s, peak
      memory, and the loss before and after (it trains). Only with --gpu; ``--tiny``: 2 layers,
      d_model 64, seq 128.
  spmd_compile  (W2, W3, W6, W7cpu, W7gpu; tools/bench/compiled.py) the spmd_torch
      implementation with the model's forward under ``torch.compile(model,
      backend='spmd_torch')`` (--compile-backend picks another name) and backward, optimizer
      step and sync lazy as usual. Opt-in: it runs
      only where --impls names it; where that backend is not registered, its child fails before
      its first step (a reported error row).
  spmd_capture  (W2, W3, W6, W7cpu, W7gpu, Wlong) the spmd_torch implementation, unchanged, with automatic
      capture on (SPMD_TORCH_AUTO_CAPTURE=1: once the step repeats, the model's forward and the
      optimizer's step run through the spmd_torch backend by themselves); at least 5 warm-up
      steps, so the timed ones are captured. Opt-in, as spmd_compile.
  Wscan4, Wscan16, Wscan64  depth against compile time (tools/bench/scan.py): a Llama-style
      decoder at width 128 (W6's block; 4 heads, 2 kv heads, seq 64, batch 2, vocab 512), 4, 16
      or 64 layers, W3's AdamW; implementations ``spmd_torch`` (a Python loop over the layers),
      ``spmd_scan`` (``scan_layers``), ``jax`` (a Python loop under jit) and ``jax_scan``
      (``lax.scan`` over stacked parameters). Per run: the first step's trace and compile seconds
      and wall time, the second step's (a compile of its own before b5d3400), the median steady step
      (blocked) and the mean of as many pipelined.
      Targets: spmd_scan's first step at 64 layers at most 1.5x its first at 4 (when both ran);
      at 16 layers its steady step at least 0.9x as fast as spmd_torch's and jax_scan's. Only
      where --workloads names them (64 unrolled layers compile for minutes on a CPU).
  Pods (tools/bench/pods.py): jobs of ``spmd_torch.distributed.run``, 2 hosts x 4 virtual CPU
  devices against 1 host x 8 (``--hosts 1``: one process, as W4 and W2mp run), side by side in
  one run; each host prints its BENCH_RESULT, gathered from the launcher's ``[host i]`` lines.
  CPU only whatever --gpu says; --against is ignored.
  W4pod  W4's spmd_torch run: per-step losses (max rel diff, rtol 1e-5), steps/s (median of timed
      windows), UncachedCompile per host (each host as many as 1x8).
  W2mppod  W2mp's mp run (each replica on the rows its global ordinal picks): per-replica
      per-step losses, steps/s.
  PodStart  seconds to every host's line after import and the first xm.mark_step, and to exit:
      1 host and 2, alternated, --steps times each (default 3), medians; target 2 hosts < 10 s
      later.
  PodFault  host 1 of a 2x4 job SIGKILLs itself at step 3, heartbeat timeout 10 s: seconds to
      host 0's exit and its status without the launcher; to the launcher's exit with it.

Host time of spmd_torch's steps (W2, W3, W3amp, W4, W6, W7cpu, Wattn, W7gpu: the blocked timed
steps; W2mp: its probed window) is split with public numbers read before and after: tracing (time
in step() less the barrier), the barrier (time in sync(); for mp, all that is not tracing), and
within it ``debug.metrics.barrier_phases()`` (linearize, key, gather, lookup, dispatch, bind),
compiles and the rest. A checkout without barrier_phases() reports its phases as n/a. The same
reads give the programs per step, their nodes (TensorsGraphSize) and the ops traced and recorded
per step (the result's ``graph``; None where the checkout keeps none).

Each (workload, implementation) pair runs in its own subprocess (``--only W3:jax``), so compile
caches, thread pools and device peak memory never leak from one run into the next. The parent
collects one ``BENCH_RESULT {...}`` line from each child, prints a table per workload and ends
with one ``BENCH_JSON {...}`` line for docs/performance.md. With ``--against PATH`` every
implementation that imports spmd_torch also runs with PATH's spmd_torch (another checkout of this
repository, e.g. the commit before), right after this checkout's in each round; the report then
sets the two side by side (medians over the rounds, and their ratio).

Usage (from the repository root):
  python -m tools.bench                          # all workloads (W7gpu: --gpu), CPU
  python -m tools.bench --workloads W2 --steps 50
  python -m tools.bench --impls eager,jax        # skip spmd_torch
  python -m tools.bench --check                  # 3 steps each from one init: loss differences
  python -m tools.bench --gpu                    # spmd_torch and JAX on CUDA (and eager if it can)
  python -m tools.bench --workloads W4 --impls jax
  python -m tools.bench --workloads W2mp --rounds 3  # mp and SPMD, alternated 3 times
  python -m tools.bench --workloads W5               # checkpoints vs orbax directly
  python -m tools.bench --workloads W6 --impls eager,jax,spmd_torch,spmd_compile
  python -m tools.bench --workloads W7gpu --gpu      # GPT-2 small on one GPU
  python -m tools.bench --workloads Wlong --gpu      # a Llama at seq 8192 that plain attention cannot fit
  python -m tools.bench --workloads W7gpu --tiny     # its small config on CPU: a smoke test
  python -m tools.bench --workloads W7cpu --against /tmp/base-132f57f  # host work vs 132f57f
  python -m tools.bench --workloads Wattn            # seq 4096 fp32 on CPU (--gpu: 8192 bf16)
  python -m tools.bench --workloads W2,W2mp --against /work/base --rounds 3  # vs another checkout
  python -m tools.bench --workloads W4pod,W2mppod,PodStart,PodFault  # pods: 2x4 against 1x8
  python -m tools.bench --workloads Wscan4,Wscan16,Wscan64  # depth: scan_layers vs loops, JAX
  python -m tools.bench --only W2:jax            # one run in this process (what the parent runs)
"""
