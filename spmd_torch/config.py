"""Every environment switch of the engine, declared once.

A flag that changes the compiled program says so with ``in_cache_key``: its value is part of the
compile-cache key, so flipping it recompiles instead of reusing a program built for another value.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass


@dataclass
class Flag:
    name: str
    default: object
    help: str
    in_cache_key: bool = False
    value: object = None
    aliases: tuple = ()  # older names of the same switch (the lazy-tensor-core guide's LTC_*)

    def read(self) -> object:
        raw = next((os.environ[n] for n in (self.name, *self.aliases) if n in os.environ), None)
        if raw is None:
            return self.default
        if isinstance(self.default, bool):
            return raw.strip().lower() in ("1", "true", "yes", "on")
        return type(self.default)(raw)


FLAGS: dict[str, Flag] = {}


def _flag(
    name: str, default: object, help: str, in_cache_key: bool = False, aliases: tuple = ()
) -> Flag:
    flag = Flag(name, default, help, in_cache_key, aliases=aliases)
    flag.value = flag.read()
    FLAGS[name] = flag
    return flag


USE_BF16 = _flag(
    "XLA_USE_BF16",
    False,
    "Store and compute float32 and float64 tensors as bfloat16 on the device.",
    in_cache_key=True,
    aliases=("LTC_USE_BF16",),
)
DOWNCAST_BF16 = _flag(
    "XLA_DOWNCAST_BF16",
    False,
    "Store and compute float32 as bfloat16 and float64 as float32 on the device.",
    in_cache_key=True,
)
DEBUG_LEVEL = _flag(
    "PT_XLA_DEBUG_LEVEL",
    0,
    "1: one line per compile or cache hit with the reason for each recompilation; 2: also the graph.",
)


MAT_MUL_PRECISION = _flag(
    "XLA_MAT_MUL_PRECISION",
    "highest",
    "Precision of float32 matmuls and convolutions: 'default', 'high' or 'highest' (see backends).",
    in_cache_key=True,
)
EAGER = _flag(
    "XLA_USE_EAGER_DEBUG_MODE",
    False,
    "Eager mode: run each op as soon as it is issued (see spmd_torch.experimental.eager_mode).",
)


def get(name: str) -> object:
    return FLAGS[name].value


def cache_key() -> tuple:
    """The values of the flags that change compiled programs."""
    return tuple(f.value for f in FLAGS.values() if f.in_cache_key)


@contextlib.contextmanager
def override(**values: object):
    """Temporarily set flags by name, e.g. ``override(XLA_USE_BF16=True)`` in a test."""
    old = {name: FLAGS[name].value for name in values}
    for name, value in values.items():
        FLAGS[name].value = value
    try:
        yield
    finally:
        for name, value in old.items():
            FLAGS[name].value = value
