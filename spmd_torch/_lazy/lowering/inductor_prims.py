"""The prims Dynamo's own decompositions put into graphs (``addcmul_`` with a value becomes
inductor's ``fma``). They exist once torch.compile has loaded inductor's prims, so the backend
(core/dynamo_bridge.py) registers them then, not at import."""

from __future__ import annotations

import torch

from .registry import LOWERINGS, lowers


def register() -> None:
    """Register the lowerings of inductor's prims (loaded by now: Dynamo imports them)."""
    from torch._inductor import inductor_prims  # noqa: F401  (defines torch.ops.prims.fma)

    fma = torch.ops.prims.fma.default
    if fma not in LOWERINGS:
        lowers(fma)(_fma)


def _fma(a, b, c):
    """a * b + c, as inductor's fma (XLA may fuse it; no test depends on the rounding)."""
    return a * b + c
