"""Line budget of the lazy engine: size is a feature (lowering tables are not counted).

Counts non-blank, non-comment lines of spmd_torch/_lazy/*.py (not lowering/) and fails past the
budget. Run: python tools/sz.py
"""

from __future__ import annotations

import pathlib
import sys

ENGINE = pathlib.Path(__file__).resolve().parents[1] / "spmd_torch" / "_lazy"
BUDGET = 4368  # +100 SPMD stages (placement, manual), +500 replicas (issue 8), +100 issue 10:
# autocast, eager mode, compile regions, profiler scopes, metrics (window, LazyTracing, data);
# issue 16's modes left it at 2791; +50 issue 17, hosts: rendezvous across hosts through the job's
# key-value store, each host's part of a global batch, reading values that span hosts; +15
# issue 18: CPU programs with collectives run in lockstep (the eager SPMD example's deadlock);
# +15 xm.rendezvous across the hosts of an SPMD job (one process per host, as in PyTorch/XLA);
# +27 issue 19 item 4: gradients and state made like a sharded tensor (zeros_like, clone) follow
# its layout, so FSDP shards the optimizer state; +261 issue 19 item 1, torch.compile: a graph
# Dynamo/AOTAutograd traced, recorded once into a template and called as one node (compiled.py,
# with its CPU part and PRNG key), the tensor's face to Dynamo, functional all_reduce; +2 issue 19
# item 3: view_as_real and view_as_complex are views (each one's write-back is the other); +18
# a compiled graph's call runs at once with what its inputs wait for (execute.run_now); +6 a
# handle's ops are its tensor's, and bind skips single-device outputs' layout; +14 nll_loss takes
# float class indices, as PyTorch/XLA does; +3 ReplicateShardedData counts host reads of sharded
# arrays; -3 on review (one lifted-scalar aval, the recorder's CPU part as an ordered dict); +20
# issue 18: dimension checks raise at the call (IndexCheckError, both IndexError and RuntimeError;
# max/min of nothing, which meta kernels let through to fail at the barrier in JAX's words); +13
# PyTorch/XLA's xla::<op> counters (a count per recorded call) and VirtualDeviceUsage (uploads
# held on the host in SPMD mode); +3 a storage knows whether its value is an upload no program
# wrote since (PyTorch/XLA's sharding spec '' against a program output's '{replicated}'); +11
# issue 19 item 2: the mode says what of an input the compile cache keys on (on one device its
# aval: no sharding compared per input; lookup 69 -> 26 us on W2, 1.06 -> 0.21 ms on compiled W3);
# +20 the heap frozen once warm-up ends (a 0.5-0.9 s full collection every 10-40 steps of GPT-2
# small otherwise) and wait_device_ops skipping outputs a later program was given; +10 programs
# in flight kept per program, one readiness check each (was a filter over every live output);
# -2 compiled calls wait for the barrier (execute.run_now gone); +10 ops that write an argument
# as a side effect run through functionalization's <op>_functional (rrelu_with_noise); +5 allclose
# on the device (isclose().all(), one bool back); +10 warm-up's end collects the whole heap again
# (cycles frozen earlier), at most a tenth of the time; +1 issue 18: XLA_ALWAYS_ALLREDUCE's
# one-device axis per mode (a world of one emits its collectives); +5 issue 19 item 3: a library's
# op (torch.library.custom_op, e.g. torch_nn's chunked linear_cross_entropy) runs its composite
# kernel on the device instead of a CPU fallback; +9 issue 18: einsum kept whole above autograd
# where autograd does not record it (PyTorch/XLA's reshape-free patched linear); -11 CPU's
# argument checks that meta kernels lack (max/min of nothing, arange's bounds) are a table in
# lowering/checks.py; +94 issue 18: outside SPMD each local device is an xla device (xla:N), as in
# PyTorch/XLA: a node knows its device, an op its tensors' (mismatches raise), uploads and CPU
# fallbacks land there, a barrier or a read runs one program per device in use (the mode groups
# them), a compiled graph's call runs on its tensors' device, loaders and restores upload to
# their device, a pickled tensor comes back on its device; +3 eager ops' programs timed as
# PyTorch/XLA's EagerOpCompileTime/ExecuteTime; +12 an in-place view op finds its out-of-place
# overload by its arguments where the names differ (transpose_.default is transpose.int: stft);
# +37 issue 19 item 2, W1's per-op path: LazyTracing's samples go to a list (no lock per op),
# folded (under the lock) at each barrier and on reads; a fresh storage and tensor set only what differs from the
# defaults; +8 warm-up's end lets the young generation grow to 50,000 objects (a step's graph,
# alive until the barrier, was walked ~8 times a step on W3); +16 inputs (leaves, lifted scalars) made
# without Node.__init__'s engine lookup, the outputs' locations kept by the walk, a compiled
# graph's call reads its arguments inline (host time of the compiled step); +9 a compiled graph
# called once per layer waits for the barrier once a step has shown its calls (it ran each call);
# +77 issue 31: forked DataLoader workers refuse device work, seeds wait for first use, ints lifted;
# +120 issue 31 item 5: PyTorch/XLA's debugging tool (compilation and execution analyses, the
# metrics analysis with each event's user line), tracebacks as IR text lines and HLO metadata;
# +110 issue 32: foreach calls and fused optimizer steps one node each (lists lifted as one
# vector scalar), linear above autograd, the barrier's walk in CPU time too
# +105 issue 32 item 2: F.scaled_dot_product_attention as one fused op each way, its kernel above
# autograd and the fused op's autograd Function (attention.py), registered in device.py
# +441 issue 33 item 1: loops traced once (loop.py): a body recorded on placeholders, its scan or
# while loop one node lowering itself, a scan's backward one node over JAX's pullback residuals
# +4 issue 33 item 2: a Scalar[] of one value is lifted as one scalar (AdamW's bias corrections:
# XLA compiles each parameter's update kernel once, not once per parameter; 147 params 26 -> 8 s)
# +18 issue 33 item 3: a program's replicated inputs restated on its split inputs' mesh (JAX names
# the outputs' layouts on the first input's mesh; a 2-D split had no name on the uploads' 1-D one)


def engine_lines() -> dict[str, int]:
    counts = {}
    for path in sorted(ENGINE.glob("*.py")):
        lines = path.read_text().splitlines()
        counts[path.name] = sum(
            1 for line in lines if line.strip() and not line.strip().startswith("#")
        )
    return counts


def main() -> int:
    counts = engine_lines()
    for name, n in counts.items():
        print(f"{n:6d}  {name}")
    total = sum(counts.values())
    print(f"{total:6d}  total (budget {BUDGET})")
    return 0 if total <= BUDGET else 1


if __name__ == "__main__":
    sys.exit(main())
