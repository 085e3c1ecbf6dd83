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


def get_words() -> tuple[int, int]:
    """The current key as two 32-bit words; computes pending random ops' key if needed."""
    from .execute import materialize_refs

    (array,) = materialize_refs([state().ref])
    high, low = (int(word) for word in np.asarray(array))
    return high, low


def set_words(high: int, low: int) -> None:
    """Make the key exactly these two words (a state saved by get_words)."""
    words = np.array([high, low], dtype=np.uint32)
    state().set((Node.data(jax.device_put(words), _KEY_AVAL), 0))


def get_state() -> torch.Tensor:
    """The key as a CPU uint8 tensor: PyTorch's form of an RNG state."""
    return torch.from_numpy(np.array(get_words(), dtype=np.uint32).view(np.uint8).copy())


def set_state(saved: torch.Tensor) -> None:
    set_words(*(int(w) for w in saved.numpy().view(np.uint32)))


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
