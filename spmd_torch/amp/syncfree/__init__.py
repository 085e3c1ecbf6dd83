"""torch_xla.amp.syncfree: optimizers whose ``step(found_inf=...)`` skips an overflowed step on the
device, so mixed-precision training with ``GradScaler`` reads nothing back to the host."""

from __future__ import annotations

from .adam import Adam
from .adamw import AdamW
from .sgd import SGD

__all__ = ["SGD", "Adam", "AdamW"]
