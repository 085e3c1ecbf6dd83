"""Run a script written for PyTorch/XLA unchanged, ``torch_xla`` being spmd_torch, for this run only.

    python -m spmd_torch.run_as_torch_xla train.py --lr 0.1
    python -m spmd_torch.run_as_torch_xla -m pytest test_operations.py

Nothing is installed: ``import torch_xla`` (and ``torch_xla.X.Y``, ``importlib.metadata``'s
``torch_xla``) work inside this run alone: this process and the processes it starts
(``multiprocessing`` spawn children, subprocesses), whose ``PYTHONPATH`` gets the folder of a
``torch_xla`` package doing the same. ``pip install ./compat/torch_xla`` makes it
permanent for an environment (see spmd_torch/_as_torch_xla.py).
"""

from __future__ import annotations

import os
import runpy
import sys

from spmd_torch import _as_torch_xla


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv == ["-m"]:
        raise SystemExit(
            "usage: python -m spmd_torch.run_as_torch_xla [-m module | script.py] args..."
        )
    _as_torch_xla.enable()
    children = os.path.join(os.path.dirname(__file__), "_run_path")  # subprocesses read this,
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [children, os.environ.get("PYTHONPATH")])
    )
    sys.path.append(children)  # spawn children this (the aliases come first in this process)
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py` sets it
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
