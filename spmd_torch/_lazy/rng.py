"""The device PRNG: a key threaded through the graph as an input and an output.

Every random op splits the current key, so dropout and random factories draw new numbers each step
while the compiled program stays the same (the key is data, not a constant), and the same seed
replays the same numbers.
"""

from __future__ import annotations

import jax
import numpy as np
import torch

from .graph import RNG_SPLIT, Aval, Node, Ref
from .tensor import Storage

DEFAULT_SEED = 101  # PyTorch/XLA's default device seed
_KEY_AVAL = Aval((2,), torch.uint32)

_state: Storage | None = None


def _key_data(seed: int) -> jax.Array:
    return jax.random.key_data(jax.random.key(np.uint32(seed & 0xFFFFFFFF), impl="threefry2x32"))


def manual_seed(seed: int) -> None:
    """Reset the device key; the next random op draws the same numbers as after any other reset."""
    global _state
    _state = Storage((Node.data(_key_data(int(seed)), _KEY_AVAL), 0))


def state() -> Storage:
    if _state is None:
        manual_seed(DEFAULT_SEED)
    return _state


def next_key() -> Ref:
    """A fresh subkey for one random op; advances the threaded state."""
    storage = state()
    node = Node(RNG_SPLIT, (storage.ref,), (), {}, (_KEY_AVAL, _KEY_AVAL))
    storage.set((node, 0))
    return (node, 1)


def split(raw_key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The lowering of RNG_SPLIT: (next state, subkey) as raw key data."""
    key = jax.random.wrap_key_data(raw_key, impl="threefry2x32")
    nxt, sub = jax.random.split(key)
    return jax.random.key_data(nxt), jax.random.key_data(sub)


def wrap(raw_key: jax.Array) -> jax.Array:
    return jax.random.wrap_key_data(raw_key, impl="threefry2x32")
