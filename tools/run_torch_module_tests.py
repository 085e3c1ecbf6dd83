"""Run torch's own module tests (``torch.testing._internal.common_modules.module_db``: every
``torch.nn`` module with the sample inputs torch tests it on) over the xla device, against the same
modules eagerly on the CPU: a check from outside of what ``model.to('xla')`` gives a user.

    python tools/run_torch_module_tests.py                      # every module, one line each
    python tools/run_torch_module_tests.py nn.GRU nn.LSTM       # some
    python tools/run_torch_module_tests.py --out /tmp/modules.tsv

For each module and sample (float32, training mode): the module is built on the CPU from the
sample's constructor arguments with seed 0, a deep copy is moved to the xla device, both run the
sample's forward (the same seed before each), and the floating outputs must agree; then the
gradients of the sum of the outputs with respect to every input and parameter that requires one.
Tolerances are float32's (1e-4 absolute and 1e-3 relative forward, 1e-3 both backward); NaNs must
sit in the same places. Modules that draw random numbers (dropout) are checked for running only:
the device's generator is not the CPU's. Each batch of modules runs in a child process of its own,
with a small compile cache (``XLA_COMPILATION_CACHE_SIZE``): thousands of programs compiled in one
process would exhaust its memory mappings on XLA:CPU (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import subprocess
import sys
import warnings

import torch
from torch.testing._internal.common_modules import module_db
from torch.utils._pytree import tree_flatten, tree_map

ROOT = pathlib.Path(__file__).resolve().parents[1]
RANDOM = ("Dropout",)  # module names whose outputs the device's generator decides
BATCH = 12  # modules per child process


def _close(a, b, atol: float, rtol: float) -> bool:
    return torch.allclose(a.detach(), b.detach().cpu(), atol=atol, rtol=rtol, equal_nan=True)


def _floating(tree) -> list:
    leaves, _ = tree_flatten(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


class EagerFails(Exception):
    """The CPU reference itself fails on a sample: nothing to compare, not counted."""


def _check(info, device) -> str:
    """'ok', or what differed first (sample, description, forward or which gradient)."""
    import spmd_torch

    copies: dict = {}  # a tensor a sample passes twice (KLDivLoss's input as its target) stays one

    def moved(x):
        if not torch.is_tensor(x):
            return x
        if id(x) not in copies:
            copies[id(x)] = (x, x.detach().to(device).requires_grad_(x.requires_grad))
        return copies[id(x)][1]

    compare = not any(word in info.name for word in RANDOM)
    samples = info.module_inputs_func(
        info, device="cpu", dtype=torch.float32, requires_grad=True, training=True
    )
    checked, eager_fails = 0, ""
    for i, sample in enumerate(samples):
        if sample.forward_input is None:
            continue
        where = f"sample {i} ({sample.desc})"
        torch.manual_seed(0)
        built = sample.constructor_input
        module = info.module_cls(*built.args, **built.kwargs).train()
        ours = copy.deepcopy(module).to(device)
        inputs = (sample.forward_input.args, sample.forward_input.kwargs)
        ours_inputs = tree_map(moved, inputs)
        torch.manual_seed(1)
        try:
            expected = module(*inputs[0], **inputs[1])
        except Exception as error:  # torch's sample is for another dtype (float64 only)
            eager_fails = f"{where}: eager CPU raises too ({error})"
            continue
        checked += 1
        torch.manual_seed(1)
        got = ours(*ours_inputs[0], **ours_inputs[1])
        spmd_torch.sync()  # one program for the forward; the comparisons then only read
        if not compare:
            continue
        for a, b in zip(_floating(expected), _floating(got)):
            if not _close(a, b, 1e-4, 1e-3):
                return (
                    f"{where}: forward differs by {(a.detach() - b.detach().cpu()).abs().max():.3g}"
                )
        sides = []
        for model, given, outputs in ((module, inputs, expected), (ours, ours_inputs, got)):
            leaves = [t for t in _floating(given) if t.requires_grad]
            leaves += [p for p in model.parameters() if p.requires_grad]
            summed = [t.sum() for t in _floating(outputs) if t.requires_grad]
            if not summed:
                break
            sides.append(torch.autograd.grad(sum(summed), leaves, allow_unused=True))
        spmd_torch.sync()
        if len(sides) < 2:
            continue
        for k, (a, b) in enumerate(zip(*sides)):
            if (a is None) != (b is None) or (a is not None and not _close(a, b, 1e-3, 1e-3)):
                shown = "one is None" if a is None or b is None else f"{a} against {b.cpu()}"
                return f"{where}: gradient {k} (inputs first, then parameters): {shown}"
    if not checked and eager_fails:
        raise EagerFails(eager_fails)
    return "ok"


def _child(names: list[str]) -> None:
    """Check ``names`` in this process; one JSON line per module."""
    warnings.filterwarnings("ignore")
    import spmd_torch

    device = spmd_torch.device()
    for info in module_db:
        if info.name not in names:
            continue
        try:
            outcome = _check(info, device)
            spmd_torch.sync()
        except EagerFails as error:
            outcome = f"not counted: {str(error)[:200]}"
        except Exception as error:  # one module's failure is a row, not the end of the run
            outcome = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"
        print(json.dumps({"module": info.name, "outcome": outcome}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help="module_db names (nn.GRU); all by default")
    parser.add_argument("--out", help="write a TSV of module and outcome here too")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.modules)
        return 0
    names = list(dict.fromkeys(info.name for info in module_db))
    names = [n for n in names if not args.modules or n in args.modules]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_COMPILATION_CACHE_SIZE="128")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    rows = []
    for start in range(0, len(names), BATCH):
        batch = names[start : start + BATCH]
        done = subprocess.run(
            [sys.executable, __file__, "--child", *batch], env=env, capture_output=True, text=True
        )
        seen = {}
        for line in done.stdout.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                seen[row["module"]] = row["outcome"]
        for name in batch:
            outcome = seen.get(name, f"the child process ended (exit {done.returncode})")
            rows.append((name, outcome))
            print(f"{name}: {outcome}", flush=True)
    passed = sum(outcome == "ok" for _, outcome in rows)
    counted = sum(not outcome.startswith("not counted") for _, outcome in rows)
    print(f"{passed} of {counted} modules agree with eager CPU ({len(rows) - counted} not counted)")
    if args.out:
        pathlib.Path(args.out).write_text("".join(f"{n}\t{o}\n" for n, o in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
