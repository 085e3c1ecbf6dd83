"""The command line: ``python -m tools.bench`` runs the parent, ``--only W:IMPL`` one child."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any

import torch

from . import __doc__ as DOC
from . import harness, report, scan, workloads
from .compiled import BACKEND
from .workloads import (
    CHECK_STEPS,
    GPU_WORKLOADS,
    IMPL_ALIASES,
    IMPLS,
    OPT_IN_IMPLS,
    POD_WORKLOADS,
    SPMD_IMPLS,
    TINY_WORKLOADS,
    WORKLOADS,
)


def run_child(args: argparse.Namespace) -> int:
    """One (workload, implementation) in this process, with --tree's spmd_torch; prints its
    BENCH_RESULT, which names the spmd_torch it imported."""
    workload, impl = workloads.parse_only(args.only)
    workloads.refuse_gpu_only([workload], args.gpu, args.tiny)
    harness.configure_jax_env(args.gpu, os.environ, workloads.cpu_devices(workload))
    harness.use_tree(args.tree)
    if args.matmul_precision and impl != "eager":
        import jax

        jax.config.update("jax_default_matmul_precision", args.matmul_precision)
    warmup, steps = workloads.steps_for(workload, args)
    t0 = harness.now()
    options = workloads.runner_options(workload, impl, args)
    runner = workloads.RUNNERS[workload, impl]
    result = runner(max(warmup, 1), steps, args.check, args.gpu, **options)
    result.update(workload=workload, impl=impl, wall_s=harness.now() - t0)
    result.setdefault("spmd_file", harness.spmd_file())  # a pod workload's: its hosts'
    harness.emit(result)
    return 0


def _run_one(workload: str, impl: str, tree: str, args: argparse.Namespace) -> dict[str, Any]:
    """One child; an error entry too where an spmd_torch run imported another tree's package."""
    warmup, steps = workloads.steps_for(workload, args)
    if impl == "spmd_capture" and not args.check:  # the timed steps are the captured ones
        warmup = max(warmup, workloads.CAPTURE_WARMUP)
    argv = ["--only", f"{workload}:{impl}", "--warmup", str(warmup), "--steps", str(steps)]
    argv += ["--tree", tree] + ["--gpu"] * args.gpu + ["--check"] * args.check
    argv += ["--tiny"] * args.tiny
    if impl == "spmd_compile":
        argv += ["--compile-backend", args.compile_backend]
    if args.matmul_precision:
        argv += ["--matmul-precision", args.matmul_precision]
    print(f"... {workload}:{impl} ({tree})", file=sys.stderr, flush=True)
    env = harness.child_env(args.gpu, workloads.cpu_devices(workload), tree)
    if impl == "spmd_capture":
        env["SPMD_TORCH_AUTO_CAPTURE"] = "1"
    result = harness.spawn(argv, env, args.timeout)
    result.update(workload=workload, impl=impl, tree=tree)
    where = os.path.realpath(result.get("spmd_file") or "/nowhere")
    if impl in SPMD_IMPLS and "error" not in result:
        if not where.startswith(os.path.realpath(tree) + os.sep):
            result["error"] = f"imported spmd_torch from {where}, not from {tree}"
    return result


def _trees(args: argparse.Namespace) -> tuple[str, str | None]:
    """The two checkouts' names in labels and columns (their directories' names)."""
    own = os.path.basename(harness.ROOT)
    if args.against is None:
        return own, None
    other = os.path.basename(os.path.abspath(args.against))
    return own, other if other != own else "other"


def _failures(workload: str, results: report.Results) -> bool:
    """Prints each failed child's stderr tail; whether any failed."""
    failed = False
    for label, r in results.items():
        if "error" in r:
            failed = True
            print(f"{workload}:{label} failed:\n{r.pop('stderr_tail', '')}", file=sys.stderr)
    return failed


def _selected(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The workloads and implementations asked for, checked against the known ones."""
    if args.workloads is None:
        names = list(workloads.default_workloads(args.gpu or args.tiny))
    else:
        names = [workloads.workload_name(w) for w in args.workloads.split(",") if w.strip()]
    if args.impls is None:  # each workload runs all of its own, but the opt-in ones
        impls = [i for i in IMPLS if i not in OPT_IN_IMPLS]
    else:
        impls = [IMPL_ALIASES.get(i.strip(), i.strip()) for i in args.impls.split(",") if i.strip()]
    bad = [w for w in names if w not in WORKLOADS] + [i for i in impls if i not in IMPLS]
    if bad:
        raise SystemExit(f"unknown workload or impl {bad}; workloads {WORKLOADS}, impls {IMPLS}")
    workloads.refuse_gpu_only(names, args.gpu, args.tiny)
    if args.against is not None:
        against = os.path.abspath(args.against)
        if not os.path.isfile(os.path.join(against, "spmd_torch", "__init__.py")):
            raise SystemExit(f"--against {args.against}: no spmd_torch/__init__.py there")
        args.against = against
    return names, impls


def _device(args: argparse.Namespace) -> str:
    """'cpu', or the GPU JAX sees (--gpu; refused where it sees none)."""
    if not args.gpu:
        return "cpu"
    device = harness.gpu_available(harness.configure_jax_env(True, dict(os.environ), None))
    if device is None:
        raise SystemExit(
            "--gpu: JAX sees no CUDA device (JAX_PLATFORMS=cuda failed); install "
            "jax[cuda12] or run without --gpu"
        )
    if not torch.cuda.is_available():
        print("--gpu: torch has no CUDA; eager PyTorch runs on CPU", file=sys.stderr)
    return device


def _jax_version() -> str | None:
    """The installed version, read without importing jax (which would start a backend)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jax")
    except PackageNotFoundError:
        return None


def run_parent(args: argparse.Namespace) -> int:
    """Every selected workload, round after round, each implementation in its own child (and
    again in --against's checkout right after, where it imports spmd_torch); prints the tables
    and one BENCH_JSON line."""
    names, impls = _selected(args)
    own, other = _trees(args)
    summary: dict[str, Any] = {
        "mode": "check" if args.check else "bench",
        "device": _device(args),
        "trees": {own: harness.ROOT, **({other: args.against} if other else {})},
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "jax": _jax_version(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "results": {},
    }
    failed = False  # a child that failed, or a --check mismatch
    for workload in names:
        skipped = [i for i in impls if i not in workloads.impls_of(workload)]
        if skipped and args.impls is not None:
            print(f"\n{workload}: no {', '.join(skipped)} implementation; skipped")
        runs = []  # (label, impl, tree)
        for impl in (i for i in impls if i not in skipped):
            runs.append((impl, impl, harness.ROOT))
            if other and impl in SPMD_IMPLS and workload not in POD_WORKLOADS:
                runs.append((f"{impl}@{other}", impl, args.against))
        if not runs:
            continue
        entries = []
        for _ in range(args.rounds):  # rounds alternate the runs: a, b, a, b...
            results = {label: _run_one(workload, impl, tree, args) for label, impl, tree in runs}
            failed |= _failures(workload, results)
            entry = report.report_round(workload, results, args.check, args.gpu)
            if args.check:
                failed |= not all(p["ok"] for p in entry["check"].values())
            if skipped and args.impls is not None:
                entry["skipped"] = skipped
            entries.append(entry)
        summary["results"][workload] = entries[0] if len(entries) == 1 else {"rounds": entries}
        if len(entries) > 1 and not args.check:
            report.report_rounds(workload, entries)
        if other and not args.check:
            against = report.report_against(workload, entries, own, other)
            summary.setdefault("against", {})[workload] = against
    if not args.check:
        depths = {w: e for w, e in summary["results"].items() if w in scan.WORKLOADS}
        summary["scan_depths"] = scan.report_depths(depths)
    print()
    print("BENCH_JSON " + json.dumps(summary), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if failed else 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.bench",
        description=DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workloads",
        help=f"e.g. W1,W3 (default: all but {','.join(GPU_WORKLOADS)}, which needs --gpu or "
        "--tiny)",
    )
    p.add_argument(
        "--impls",
        help=f"subset of {','.join(IMPLS)} (default: each workload's own, but "
        f"{','.join(OPT_IN_IMPLS)}, which runs only where named)",
    )
    p.add_argument("--steps", type=int, help="timed steps (W1: timed repetitions)")
    p.add_argument("--warmup", type=int, help="warm-up steps, the first included")
    p.add_argument("--gpu", action="store_true", help="run JAX and spmd_torch on CUDA")
    p.add_argument(
        "--tiny",
        action="store_true",
        help=f"{','.join(TINY_WORKLOADS)}: a small config, which runs on CPU (smoke test, tests)",
    )
    p.add_argument(
        "--compile-backend",
        default=BACKEND,
        help="spmd_compile's torch.compile backend (default %(default)s)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help=f"run {CHECK_STEPS} steps of each from one init; compare losses",
    )
    p.add_argument(
        "--matmul-precision",
        choices=("default", "high", "highest"),
        help="jax_default_matmul_precision for jax and spmd_torch runs",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run each workload's implementations this many times, alternating (a, b, a, b...)",
    )
    p.add_argument(
        "--against",
        metavar="PATH",
        help="another checkout of this repository: every spmd_torch run also runs with its "
        f"spmd_torch (PYTHONPATH=PATH), side by side; ignored by {','.join(POD_WORKLOADS)}",
    )
    p.add_argument("--json", metavar="PATH", help="also write the BENCH_JSON summary to PATH")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per subprocess")
    p.add_argument("--only", metavar="W:IMPL", help=argparse.SUPPRESS)
    p.add_argument("--tree", default=harness.ROOT, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return run_child(args) if args.only else run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
