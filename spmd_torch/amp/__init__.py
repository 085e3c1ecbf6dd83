"""torch_xla.amp: mixed precision on the xla device.

``autocast`` runs matmuls and convolutions in bfloat16 (or float16) and numerically sensitive ops
in float32, with PyTorch/XLA's cast policy; ``GradScaler`` scales float16 losses with its inf/nan
check and scale update on the device; ``syncfree`` holds optimizers that skip a step on the device
when the scaler found an inf or nan, so a training step reads nothing back to the host. See
docs/amp.md.
"""

from __future__ import annotations

from . import syncfree
from .autocast_mode import autocast, custom_bwd, custom_fwd
from .grad_scaler import GradScaler

__all__ = ["GradScaler", "autocast", "custom_bwd", "custom_fwd", "syncfree"]
