"""The device PRNG: a key threaded through the graph as an input and an output.

Every random op splits the engine's current key (an ``RNG_SPLIT`` node, lowered like any op), so
dropout and random factories draw new numbers each step while the compiled program stays the same
(the key is data, not a constant), and the same seed replays the same numbers. Reading the key
back computes it: that is the barrier's job (``execute.rng_words``).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from .engine import current
from .graph import Arg, Aval, Node, Ref
from .lowering.random import RNG_SPLIT, key_words
from .tensor import Storage
from .transfer import upload

DEFAULT_SEED = 101  # PyTorch/XLA's default device seed
_KEY_AVAL = Aval((2,), torch.uint32)


def manual_seed(seed: int) -> None:
    """Reset the device key; the next random op draws the same numbers as after any other reset.

    Only remembered here: the key reaches the device on first use, so seeding starts no device
    work (``torch.manual_seed`` in a DataLoader worker seeds every device module)."""
    engine = current()
    engine.rng, engine.seed = None, int(seed)


def set_words(high: int, low: int) -> None:
    """Make the key exactly these two words (a state saved from ``execute.rng_words``)."""
    state().set((_key(np.array([high, low], dtype=np.uint32)), 0))


def _key(words: np.ndarray) -> Node:
    """The key's words where the engine's data lands (a replica's on its own device)."""
    return Node.data(upload(words), _KEY_AVAL)


def state() -> Storage:
    """The storage holding the engine's key, made from its seed (or the default) on first use."""
    engine = current()
    if engine.rng is None:
        seed = DEFAULT_SEED if engine.seed is None else engine.seed
        engine.rng = Storage((_key(key_words(seed)), 0))
        # Uploaded replicated over a mesh, as a program would leave it: said now, the first
        # program that draws numbers is the same program as the ones after it.
        engine.rng.sharding = engine.mode.replicated
    return engine.rng


def current_key() -> Ref:
    """The engine's key as it is, not advanced: for a random op's call that draws nothing."""
    return state().ref


def next_key() -> Ref:
    """A fresh subkey for one random op; advances the threaded state."""
    storage = state()
    node = Node(RNG_SPLIT, (storage.ref,), (Arg(0),), {}, (_KEY_AVAL, _KEY_AVAL))
    storage.set((node, 0))
    return (node, 1)


@contextlib.contextmanager
def seeded(seed: int | Storage):
    """Random ops inside draw from the key ``seed`` starts from (an int, or a storage holding
    the key's two words), and the engine's own key is left as it was: equal seeds, equal
    numbers."""
    engine = current()
    if not isinstance(seed, Storage):
        seed = Storage((_key(key_words(int(seed))), 0))
    seed.sharding = engine.mode.replicated
    saved = engine.rng, engine.seed
    engine.rng = seed
    try:
        yield
    finally:
        engine.rng, engine.seed = saved
