"""The scale targets of examples/llama_pod.py, measured on the 8-device CPU mesh (docs/scale.md).

``memory`` builds the model sharded and reports the host memory that took against one copy of the
parameters, each device's share of the parameters, and the first training step's memory per
device by XLA's analysis (compiled, not run: at ``--size 1b`` a step would not fit a small
machine). With ``--run`` it also runs two steps and reports what each device then holds
(parameters, gradients, AdamW's moments), the steady step's memory and the training compiles.
``restore`` trains and checkpoints on a (2, 4) mesh, then restores on a (4, 2) mesh in a new
process and compares the checksums of every parameter and AdamW bit. Each runs in a fresh process:

    python -m tools.llama_scale memory --size 1b [--layers N --seq N --batch N] [--no-scan]
    python -m tools.llama_scale memory --run
    python -m tools.llama_scale restore --size 1b --layers 2 --seq 128
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import psutil  # noqa: E402
import torch  # noqa: E402

import spmd_torch.core.xla_model as xm  # noqa: E402
import spmd_torch.debug.metrics as met  # noqa: E402
import spmd_torch.distributed.spmd as xs  # noqa: E402
import spmd_torch.runtime as xr  # noqa: E402
from spmd_torch._lazy import compile as _compile  # noqa: E402
from spmd_torch._lazy import engine, placement  # noqa: E402
from spmd_torch._lazy.execute import global_array  # noqa: E402
from spmd_torch.debug import graph  # noqa: E402
from spmd_torch.utils.checkpoint import checkpoint  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "llama_pod.py"


def load_example():
    spec = importlib.util.spec_from_file_location("llama_pod", EXAMPLE)
    module = sys.modules["llama_pod"] = importlib.util.module_from_spec(spec)  # for dataclasses
    spec.loader.exec_module(module)
    return module


def run_unrolled(layers, inputs: tuple) -> tuple:
    """The example's ``run_scanned`` unrolled (``--no-scan``), each layer checkpointed: the
    program holds every layer, for comparison."""
    for layer in layers:
        inputs = checkpoint(layer, *inputs)
    return inputs


def per_device_bytes(tensors: list[torch.Tensor]) -> list[int]:
    """What each device holds of ``tensors``: the bytes of its shards, padding included."""
    held = [0] * xr.global_runtime_device_count()
    for tensor in tensors:
        for shard in global_array(tensor).addressable_shards:
            held[shard.device.id] += shard.data.nbytes
    return held


def expected_share(model) -> int:
    """One device's share of the parameters if every matrix is split 8 ways and the rest (the
    RMSNorm scales) is replicated."""
    split = sum(p.nbytes for p in model.parameters() if p.dim() == 2)
    return split // xr.global_runtime_device_count() + sum(
        p.nbytes for p in model.parameters() if p.dim() == 1
    )


def size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n:.0f} B"


def analysis_text(stats) -> str:
    return (
        f"arguments {size(stats.argument_size_in_bytes)}, outputs "
        f"{size(stats.output_size_in_bytes)} (aliased {size(stats.alias_size_in_bytes)}), "
        f"temporaries {size(stats.temp_size_in_bytes)}"
    )


def record_step(llama, model, optimizer, mesh) -> None:
    """One training step recorded, not run."""
    tokens, targets = (t.to(xm.xla_device()) for t in llama.batch(model.cfg))
    xs.mark_sharding(tokens, mesh, ("fsdp", None))
    xs.mark_sharding(targets, mesh, ("fsdp", None))
    llama.train_step(model, optimizer, tokens, targets, bf16=True)


def compile_pending():
    """The pending program compiled for the mesh, not run: (its memory analysis, seconds)."""
    started = time.perf_counter()
    program = graph.pending_program()
    arrays = [placement.resolve(node, index) for node, index in program.leaves]
    compiled = _compile.lowered(program, arrays).compile()
    return compiled.memory_analysis(), time.perf_counter() - started


def memory(llama, args, cfg) -> None:
    xr.use_spmd()
    mesh = llama.make_mesh(args.mesh)
    before = psutil.Process().memory_info().rss
    started = time.perf_counter()
    run_layers = run_unrolled if args.no_scan else llama.run_scanned
    model = llama.build_sharded(cfg, mesh, run_layers)
    xm.wait_device_ops()  # the program that writes the shards has run
    built = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    parameters = list(model.parameters())
    one_copy = sum(p.nbytes for p in parameters)
    print(
        f"{args.size} {cfg}: {sum(p.numel() for p in parameters):,} parameters, "
        f"{size(one_copy)} in float32, mesh {args.mesh}, built sharded in {built:.1f}s"
    )
    print(
        f"host memory: {size(before)} before building, peak {size(peak)}: grew by "
        f"{size(peak - before)} = {(peak - before) / one_copy:.2f} x one copy of the "
        "parameters"
    )
    held = per_device_bytes(parameters)
    print(
        f"parameters per device: {min(held):,}..{max(held):,} bytes; total/8 plus the "
        f"replicated norms is {expected_share(model):,}"
    )
    optimizer = llama.new_optimizer(model)
    record_step(llama, model, optimizer, mesh)
    stats, seconds = compile_pending()
    print(f"first step per device, compiled in {seconds:.1f}s, not run: {analysis_text(stats)}")
    print(
        "  its outputs hold parameters, gradients and AdamW's two moments: "
        f"{stats.output_size_in_bytes / expected_share(model):.2f} x one device's parameter share"
    )
    devices = xr.global_runtime_device_count()
    need = devices * (stats.argument_size_in_bytes + stats.output_size_in_bytes)
    need += devices * stats.temp_size_in_bytes
    print(f"  running it on this CPU mesh would take about {size(need)} of host memory")
    if args.run:
        run(llama, model, optimizer, mesh)


def run(llama, model, optimizer, mesh) -> None:
    """Two steps for real: what each device holds after them, the steady step's memory by XLA's
    analysis, the compiles and the step times."""
    met.clear_all()
    times = []
    for step in range(3):
        started = time.perf_counter()
        if step:  # the first step is the one recorded for the analysis
            record_step(llama, model, optimizer, mesh)
        xm.mark_step()
        xm.wait_device_ops()
        times.append(time.perf_counter() - started)
    cache = engine.current().cache
    first, steady = (cache.executables[key].compiled for key in cache.history[-2:])
    compiles = met.counter_value("UncachedCompile") or 0
    print(f"3 steps: {', '.join(f'{t:.2f}s' for t in times)}; {compiles} compilations")
    parameters = list(model.parameters())
    grads = [p.grad for p in parameters]
    moments = [optimizer.state[p][k] for p in parameters for k in ("exp_avg", "exp_avg_sq")]
    for name, tensors in (("parameters", parameters), ("gradients", grads), ("moments", moments)):
        held = per_device_bytes(tensors)
        print(f"  {name} per device: {min(held):,}..{max(held):,} bytes")
    print(f"  one device's parameter share (total/8 + norms): {expected_share(model):,} bytes")
    print(f"first step per device, as run: {analysis_text(first.memory_analysis())}")
    print(f"steady step per device: {analysis_text(steady.memory_analysis())}")


def restore(llama, args, cfg) -> None:
    """Train and save on (2, 4), restore on (4, 2), each in a process of its own."""
    sizes = [f"--{f}={getattr(args, f)}" for f in ("layers", "seq", "batch") if getattr(args, f)]
    with tempfile.TemporaryDirectory() as directory:
        common = [sys.executable, str(EXAMPLE), "--size", args.size, *sizes, "--ckpt", directory]
        outputs = []
        for mesh in ("2x4", "4x2"):  # the second run restores and stops: no step is left
            started = time.perf_counter()
            result = subprocess.run(
                [*common, "--mesh", mesh, "--steps", "2"], capture_output=True, text=True
            )
            seconds = time.perf_counter() - started
            peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
            print(result.stdout, end="")
            if result.returncode:
                raise SystemExit(f"{mesh}: exited {result.returncode}\n{result.stderr[-4000:]}")
            print(f"-- {mesh}: {seconds:.1f}s, peak host memory so far {size(peak)}")
            outputs.append(result.stdout)
    saved = re.search(r"saved step 1: checksum (\S+)", outputs[0]).group(1)
    restored = re.search(r"resumed from step 1: checksum (\S+),", outputs[1]).group(1)
    print(f"{cfg}: saved on (2, 4) {saved}, restored on (4, 2) {restored}: ", end="")
    print("bit-exact" if saved == restored else "DIFFERENT")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("memory", "restore"))
    parser.add_argument("--size", default="small")
    for field in ("layers", "seq", "batch"):
        parser.add_argument(f"--{field}", type=int)
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument("--no-scan", action="store_true")
    parser.add_argument("--run", action="store_true", help="memory: also run two steps")
    args = parser.parse_args()
    llama = load_example()
    overrides = {f: getattr(args, f) for f in ("layers", "seq", "batch") if getattr(args, f)}
    cfg = dataclasses.replace(llama.SIZES[args.size], **overrides)
    (memory if args.what == "memory" else restore)(llama, args, cfg)


if __name__ == "__main__":
    main()
