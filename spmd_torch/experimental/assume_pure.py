"""torch_xla.experimental.assume_pure: a pure function traced once, called as one op each way.

``assume_pure(fn)`` records ``fn``'s ops once per structure of its arguments (tensor shapes and
dtypes, the values of its other arguments, autocast) and replays that recording at every later
call, so a model's pure block stops costing Python tracing at each step. Each call is one node
of the step's program, and autograd goes through it as one op each way (JAX's pullback of the
recording). It is the one-iteration case of ``scan``'s pure recording: the tensors are the
single slice of the scanned inputs.

Where PyTorch/XLA goes through torchax and hardcodes the device key a random op draws from at
tracing time (the same numbers at every call), random ops here draw from the device's stream as
anywhere else, new numbers at each call; with ``add_rng_seed_argument=True`` they draw from the
key ``rng_seed`` starts from, and the device's stream is left as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from spmd_torch._lazy import rng

from .scan import _scan, _xla_tensor, without_dynamo

__all__ = ["PureModule", "assume_pure"]


def assume_pure(fn: Callable, *, add_rng_seed_argument: bool = False) -> Callable:
    """``fn``, recorded once per structure of its arguments and replayed at later calls.

    ``fn`` must be pure: its results depend on its arguments only, and it has no side effects
    (it writes no tensor it did not make, reads no value to the host). Its tensor arguments
    (anywhere in ``args`` and ``kwargs``) must be xla tensors; its other arguments must be
    hashable, and each distinct value is a recording of its own.

    Args:
        fn: The pure function of xla tensors.
        add_rng_seed_argument: The returned function takes a keyword ``rng_seed`` (an int, or
            an integer xla tensor of one element), and ``fn``'s random ops draw from the key it
            starts from: equal seeds, equal numbers.

    Returns:
        A function with ``fn``'s signature (and ``rng_seed``) returning ``fn``'s results.

    Example:
        >>> @assume_pure
        ... def block(x, w):
        ...     return torch.sin(x @ w)
        >>> y = block(torch.ones(3, 3, device='xla'), torch.ones(3, 3, device='xla'))
    """
    if not callable(fn):
        raise TypeError(f"assume_pure: {fn!r} is not callable")
    recordings = _Recordings(fn)

    @functools.wraps(fn)
    def pure(*args: Any, **kwargs: Any) -> Any:
        if not add_rng_seed_argument:
            return recordings.call(args, kwargs)
        if "rng_seed" not in kwargs:
            raise AssertionError(
                f"assume_pure: {getattr(fn, '__name__', fn)!r} was wrapped with "
                "add_rng_seed_argument=True: pass the keyword argument rng_seed"
            )
        kwargs = dict(kwargs)
        with rng.seeded(_seed(kwargs.pop("rng_seed"))):
            return recordings.call(args, kwargs)

    return pure


class _Recordings:
    """``fn``'s calls as one-iteration scans: a body made once, so that scan keeps its
    recordings (per function), keyed by the non-tensor arguments as well."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.statics: tuple = ()  # the call being recorded: its non-tensor leaves, its tree

        def body(carry: None, tensors: list) -> tuple[None, Any]:
            leaves, positions, spec = self.statics
            leaves = list(leaves)
            for position, tensor in zip(positions, tensors):
                leaves[position] = tensor
            args, kwargs = pytree.tree_unflatten(leaves, spec)
            return None, self.fn(*args, **kwargs)

        self.body = body

    def call(self, args: tuple, kwargs: dict) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        is_tensor = [isinstance(leaf, torch.Tensor) for leaf in leaves]
        positions = tuple(k for k, tensor in enumerate(is_tensor) if tensor)
        if not positions:
            return self.fn(*args, **kwargs)  # nothing to record on
        tensors = [
            _xla_tensor(f"assume_pure: argument {k} (flattened)", leaves[k]) for k in positions
        ]
        statics = tuple(None if tensor else leaf for leaf, tensor in zip(leaves, is_tensor))
        try:
            hash(statics)
        except TypeError:
            bad = next(leaf for leaf in statics if not _hashable(leaf))
            raise TypeError(
                f"assume_pure: a non-tensor argument of {getattr(self.fn, '__name__', self.fn)!r} "
                f"is unhashable ({type(bad).__name__}); its values key the recordings"
            ) from None
        self.statics = (statics, positions, spec)
        _, stacked = without_dynamo(_scan)(
            self.body, None, [t.unsqueeze(0) for t in tensors], None, True, (statics, spec)
        )
        return pytree.tree_map(lambda y: y[0] if isinstance(y, torch.Tensor) else y, stacked)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _seed(seed: Any) -> int | Any:
    """An ``rng_seed`` as ``rng.seeded`` takes it: an int, or the storage of the key's words."""
    if isinstance(seed, torch.Tensor):  # rng.key_words' layout, on the device: (0, seed)
        word = _xla_tensor("assume_pure: rng_seed", seed).reshape(1).to(torch.uint32)
        words = torch.cat([torch.zeros(1, dtype=torch.uint32, device=seed.device), word])
        return words._storage
    if isinstance(seed, int):
        return seed
    raise TypeError(f"assume_pure: rng_seed must be an int or an xla tensor, not {seed!r}")


class PureModule(torch.nn.Module):
    """A module whose forward is pure, called through :func:`assume_pure`: recorded once per
    structure of its inputs, its parameters and buffers passed as arguments (so they get their
    gradients and their current values at each call).

    Args:
        module: The wrapped module.

    Example:
        >>> block = PureModule(torch.nn.Linear(4, 4)).to('xla')
        >>> y = block(torch.ones(2, 4, device='xla'))
    """

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self._module = module
        self._pure_forward = assume_pure(functools.partial(_functional_forward, module))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        parameters = dict(self._module.named_parameters())
        buffers = dict(self._module.named_buffers())
        return self._pure_forward(parameters, buffers, args, kwargs)


def _functional_forward(module, parameters: dict, buffers: dict, args: tuple, kwargs: dict):
    return torch.func.functional_call(module, (parameters, buffers), args, kwargs)
