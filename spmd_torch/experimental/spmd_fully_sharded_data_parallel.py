"""torch_xla.experimental.spmd_fully_sharded_data_parallel: FSDP written as sharding annotations.

Fully sharded data parallelism needs no runtime of its own under SPMD: each parameter is sharded
along the mesh's ``'fsdp'`` axis and each forward output along its batch dimension, and GSPMD
(``jax.jit``'s partitioner) inserts the all-gathers of the weights and the reduce-scatters of the
gradients. The wrapper only writes those annotations, so one training step stays one program, and
a parameter keeps its sharding across optimizer updates.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

import spmd_torch.distributed.spmd as xs
from spmd_torch._lazy.tensor import DEVICE

__all__ = ["SpmdFullyShardedDataParallel"]

ShardOutput = Callable[[Any, xs.Mesh], None]
"""``shard_output(output, mesh)``: marks the sharding of a forward's output; returns nothing."""


def _prepare_spmd_partition_spec(
    tensor: torch.Tensor, extra_data_axis: str | None = None, shard_maximal: bool = False
) -> tuple:
    """The FSDP spec of ``tensor``: one dimension over ``'fsdp'`` (dim 0, or its largest), rest None.

    Scalars get ``()`` (replicated). With ``extra_data_axis`` the dimension is split over
    ``(extra_data_axis, 'fsdp')``, the data axis major, as in PyTorch/XLA.
    """
    shape = tuple(tensor.shape)
    spec: list = [None] * len(shape)
    if not shape:
        return ()
    index = shape.index(max(shape)) if shard_maximal else 0
    spec[index] = (extra_data_axis, "fsdp") if extra_data_axis else "fsdp"
    return tuple(spec)


def _default_shard_output(extra_data_axis: str | None) -> ShardOutput:
    """PyTorch/XLA's default: shard a tensor output (or a tuple's first element) on dim 0."""

    def shard_output(output: Any, mesh: xs.Mesh) -> None:
        real_output = None
        if isinstance(output, torch.Tensor):
            real_output = output
        elif isinstance(output, tuple):
            real_output = output[0] if output and isinstance(output[0], torch.Tensor) else None
        if real_output is not None and real_output is not output:
            warnings.warn(
                "SpmdFullyShardedDataParallel: the forward returned a tuple; only its first "
                "element is sharded. Pass shard_output=... to shard the others.",
                stacklevel=3,
            )
        if real_output is None:
            first = type(output[0]).__name__ if isinstance(output, tuple) and output else None
            what = type(output).__name__ + (f" whose first element is a {first}" if first else "")
            raise RuntimeError(
                f"SpmdFullyShardedDataParallel: cannot shard a forward output of type {what}; "
                "the default shards a tensor or the tensor first in a tuple. Pass "
                "shard_output=fn, with fn(output, mesh) marking the tensors to shard."
            )
        xs.mark_sharding(
            real_output, mesh, _prepare_spmd_partition_spec(real_output, extra_data_axis)
        )

    return shard_output


def _check_has_forward(module: nn.Module) -> None:
    forward = getattr(type(module), "forward", None)
    if forward is None or forward is nn.Module.forward:
        raise RuntimeError(
            f"SpmdFullyShardedDataParallel: {type(module).__name__} defines no forward; wrap a "
            "module that is called as a whole (not an nn.ModuleList or nn.ModuleDict), and call "
            "the wrapper rather than its submodules or weights"
        )


def _check_mesh(mesh: xs.Mesh | None, extra_data_axis: str | None) -> xs.Mesh:
    """The mesh to shard over: ``mesh``, else the global one; it must have an ``'fsdp'`` axis."""
    if mesh is None:
        mesh = xs.get_global_mesh()
        if mesh is None:
            raise ValueError(
                "SpmdFullyShardedDataParallel: no mesh was given and no global mesh is set; pass "
                "mesh=xs.Mesh(device_ids, (n,), ('fsdp',)) or call xs.set_global_mesh(mesh) first"
            )
    names = mesh.axis_names or ()
    axes = ", ".join(f"{name!r}: {size}" for name, size in mesh.shape().items())
    if "fsdp" not in names:
        raise ValueError(
            f"SpmdFullyShardedDataParallel: the mesh has no axis named 'fsdp'; its axes are "
            f"{{{axes}}} (axis_names={mesh.axis_names}). Name the axis to shard parameters "
            "over 'fsdp'"
        )
    if extra_data_axis is not None and extra_data_axis not in names:
        raise ValueError(
            f"SpmdFullyShardedDataParallel: The provided {extra_data_axis} axis is not in the "
            f"mesh. (extra_data_axis={extra_data_axis!r}; the mesh's axes are {{{axes}}})"
        )
    return mesh


def _to_xla(module: nn.Module) -> nn.Module:
    """``module`` with every parameter and buffer on the xla device (tied ones stay tied)."""
    tensors = [*module.parameters(), *module.buffers()]
    if any(t.device.type != "xla" for t in tensors):
        module.to(DEVICE)
    return module


def _recursive_wrap(
    module: nn.Module,
    auto_wrap_policy: Callable[..., bool],
    wrapper: Callable[..., nn.Module],
    only_wrap_children: bool,
    **wrapper_kwargs: Any,
) -> tuple[nn.Module, int]:
    """Wrap, bottom-up, the submodules the policy picks; returns the module and its wrapped numel.

    The policy is called as torch's FSDP calls it, ``policy(module, recurse, nonwrapped_numel)``
    (positionally, so PyTorch/XLA's ``unwrapped_params`` policies work as well): with ``recurse``
    True it says whether to look inside ``module``, with False whether to wrap it.
    """
    numel = sum(p.numel() for p in module.parameters())
    if not auto_wrap_policy(module, True, numel):
        return module, 0
    wrapped_numel = 0
    for name, child in module.named_children():
        wrapped, child_numel = _recursive_wrap(
            child, auto_wrap_policy, wrapper, False, **wrapper_kwargs
        )
        if wrapped is not child:
            setattr(module, name, wrapped)
        wrapped_numel += child_numel
    if not only_wrap_children and auto_wrap_policy(module, False, numel - wrapped_numel):
        return wrapper(module, **wrapper_kwargs), numel
    return module, wrapped_numel


class SpmdFullyShardedDataParallel(nn.Module):
    """Fully sharded data parallelism by sharding annotations: GSPMD writes the collectives.

    Moves ``module`` to the xla device if it is not there, then shards each of its parameters
    that has no sharding yet along the mesh's ``'fsdp'`` axis: one dimension (the largest, the
    first of equals, as PyTorch/XLA does) is split over ``'fsdp'``, the others are replicated;
    1-D parameters are split too. Every forward output is then sharded on its batch dimension
    (dim 0) by ``shard_output``, which makes the partitioner gather weights where they are used
    and reduce-scatter their gradients, as FSDP does. The annotations stay with the parameters
    across optimizer steps, so a training loop compiles once per distinct graph.

    With ``auto_wrap_policy`` the submodules it picks are wrapped first (each shards its own
    parameters and output), then the root shards what is left. PyTorch/XLA's backward
    optimization barriers (a hint against huge fusions) are not placed.

    Args:
        module: The module to shard; it must define ``forward``.
        mesh: The device mesh, with an axis named ``'fsdp'``; default: the global mesh
            (``xs.set_global_mesh``).
        shard_output: ``fn(output, mesh)`` marking the sharding of each forward output. Default:
            the output tensor, or the first element of a tuple output (with a warning), is
            sharded on dim 0 over ``'fsdp'``; other outputs raise.
        auto_wrap_policy: A torch FSDP wrap policy, called as ``policy(module, recurse,
            nonwrapped_numel)``, e.g. ``functools.partial(transformer_auto_wrap_policy,
            transformer_layer_cls={Block})`` or ``ModuleWrapPolicy({Block})``.
        auto_wrapper_callable: ``fn(module, mesh=..., shard_output=...)`` returning the wrapped
            submodule (e.g. adding activation checkpointing); default this class.
        extra_data_axis: A second mesh axis to split the batch (and the sharded dimension of
            the outputs) over, major to ``'fsdp'``, for a (data, fsdp) mesh.

    Example:
        >>> import functools, numpy as np
        >>> import spmd_torch.distributed.spmd as xs
        >>> from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
        >>> from spmd_torch.experimental.spmd_fully_sharded_data_parallel import (
        ...     SpmdFullyShardedDataParallel as FSDPv2)
        >>> mesh = xs.Mesh(np.arange(8), (8,), ('fsdp',))
        >>> policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
        >>> model = FSDPv2(GPT(), mesh=mesh, auto_wrap_policy=policy)
        >>> xs.get_xla_sharding_spec(model.module.head.weight)
        '{devices=[8,1]0,1,2,3,4,5,6,7}'
        >>> loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: xs.Mesh | None = None,
        shard_output: ShardOutput | None = None,
        auto_wrap_policy: Callable[..., bool] | None = None,
        auto_wrapper_callable: Callable[..., nn.Module] | None = None,
        *,
        extra_data_axis: str | None = None,
    ) -> None:
        if isinstance(module, SpmdFullyShardedDataParallel):
            raise RuntimeError(
                "SpmdFullyShardedDataParallel: the module is already wrapped; for nested "
                "wrapping, wrap the inner submodules first, then the outer module"
            )
        _check_has_forward(module)
        mesh = _check_mesh(mesh, extra_data_axis)
        super().__init__()
        _to_xla(module)
        if auto_wrap_policy is not None:
            for name, sub in module.named_modules():
                if isinstance(sub, SpmdFullyShardedDataParallel):
                    raise ValueError(
                        f"SpmdFullyShardedDataParallel: submodule {name!r} is already wrapped; "
                        "with an auto_wrap_policy no submodule may be wrapped beforehand"
                    )
            _recursive_wrap(
                module,
                auto_wrap_policy,
                auto_wrapper_callable or SpmdFullyShardedDataParallel,
                only_wrap_children=True,  # the root is this wrapper
                mesh=mesh,
                shard_output=shard_output,
                extra_data_axis=extra_data_axis,
            )
        self._orig_module = module
        self._mesh = mesh
        # Parameters already sharded (by a wrapped submodule, or by hand) keep their sharding.
        for param in module.parameters():
            if xs.get_xla_sharding_spec(param) == "":
                xs.mark_sharding(
                    param, mesh, _prepare_spmd_partition_spec(param, shard_maximal=True)
                )
        self._shard_output = shard_output or _default_shard_output(extra_data_axis)

    @property
    def module(self) -> nn.Module:
        """The wrapped module, as with DDP's ``.module``."""
        return self._orig_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = self._orig_module(*args, **kwargs)
        self._shard_output(output, self._mesh)
        return output

    def __getattr__(self, name: str) -> Any:
        """Attributes the wrapper lacks come from the wrapped module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self.__dict__.get("_modules", {}).get("_orig_module")
            if wrapped is None:  # still in __init__, or being unpickled
                raise
            return getattr(wrapped, name)

    def __getitem__(self, key: int) -> nn.Module:
        """Index the wrapped module (an ``nn.Sequential``)."""
        return self._orig_module[key]
