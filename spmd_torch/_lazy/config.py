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

    def read(self) -> object:
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        if isinstance(self.default, bool):
            return raw.strip().lower() in ("1", "true", "yes", "on")
        return type(self.default)(raw)


FLAGS: dict[str, Flag] = {}


def _flag(name: str, default: object, help: str, in_cache_key: bool = False) -> Flag:
    flag = Flag(name, default, help, in_cache_key)
    flag.value = flag.read()
    FLAGS[name] = flag
    return flag


USE_BF16 = _flag(
    "XLA_USE_BF16",
    False,
    "Store and compute float32 and float64 tensors as bfloat16 on the device.",
    in_cache_key=True,
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
