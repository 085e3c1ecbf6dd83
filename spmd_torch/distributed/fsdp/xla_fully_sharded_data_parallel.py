"""torch_xla.distributed.fsdp.XlaFullyShardedDataParallel: FSDP v1 on the replicas of ``launch``.

Each replica (``launch``/``xmp.spawn``, docs/multiprocessing.md) keeps 1/N of every parameter the
wrapper owns: the parameter flattened, padded to a multiple of ``N * _shard_size_multiple`` and
cut in N, the replica's piece registered on the wrapper as an ``nn.Parameter``. An optimizer built
over ``model.parameters()`` therefore sees only shards and keeps 1/N of the optimizer state. The
original parameters are taken out of their modules.

The forward pass gathers the full parameters with ``xm.all_gather`` inside an autograd Function
whose backward is ``xm.reduce_scatter`` of the gradient (averaged over the replicas, as DDP
averages): autograd itself then accumulates each replica's gradient shard in ``shard.grad``.
Both are graph nodes, so the whole step (gathers, compute, reduce-scatters, optimizer) stays one
program per barrier. The gathered tensors are put in their modules as plain attributes for the
forward (views of the gathered flat tensor for ``flatten_parameters``) and dropped when the
backward pass ends, so no full parameter is left alive at the barrier.

``reshard_after_forward`` (default for every FSDP but the root, as in PyTorch/XLA) makes the
backward pass gather the parameters again instead of reading the forward pass's copy: what
autograd saves from them is replaced by a recipe (saved-tensor hooks) that all-gathers the shard
anew, behind an optimization barrier so XLA cannot merge the two gathers; the forward's copy is
then dead once the forward pass is done.

``state_dict()`` holds the shards (``_fsdp_shard...`` keys, PyTorch/XLA's names) and the buffers;
``get_shard_metadata()`` is what ``consolidate_sharded_model_checkpoints`` needs to rebuild the
full state dict from the replicas' files (checkpoint files are laid out as PyTorch/XLA's).

A module built on the meta device (deferred initialisation) is materialised by each FSDP module
before it shards it, as in PyTorch/XLA: ``param_init_fn(module)`` if given, else the module's own
tensors are allocated on the CPU (``to_empty``) and ``module.reset_parameters()`` fills them.
Nested FSDP modules materialise their own parameters first (the default allocation leaves their
shards alone).

Not implemented, refused with an error: the ``_debug_dummy_*`` and ``_debug_print`` options,
``no_sync()``, torchdistX's fake tensors (torchdistX is not installed with spmd_torch). Accepted with no effect here:
``optimization_barrier_in_forward`` (one program per step; XLA schedules it),
``pin_layout_in_collective_ops``, ``reduce_scatter_bucket_size_mb`` and
``coalesce_all_gather_ops`` (every collective of the step is in one program anyway),
``_use_xla_patched_linear`` (the engine records ``linear`` with its weight untransposed already).

Example:
    >>> def _mp_fn(index):
    ...     model = FSDP(Net(), flatten_parameters=True)  # 1/8 of the parameters per replica
    ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ...     loss = model(x.to(xm.xla_device())).sum()
    ...     loss.backward()
    ...     optimizer.step()  # not xm.optimizer_step: the gradients are already reduced
    ...     xm.mark_step()
    >>> spmd_torch.launch(_mp_fn)
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from enum import Enum, auto
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import Variable

from spmd_torch import runtime
from spmd_torch._lazy.tensor import LazyTensor
from spmd_torch.core import xla_model as xm

from .wrap import recursive_wrap

__all__ = ["XlaFullyShardedDataParallel"]

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


class TrainingState(Enum):
    """Where an FSDP module is: idle, or in its forward pass."""

    IDLE = auto()
    FORWARD = auto()


class _Piece:
    """One original parameter inside a sharded tensor: where it lies in the gathered (flat)
    tensor, and the modules holding it (more than one for shared parameters)."""

    __slots__ = ("offset", "numel", "shape", "holders")

    def __init__(self, offset: int, numel: int, shape: torch.Size, holders: list) -> None:
        self.offset, self.numel, self.shape, self.holders = offset, numel, shape, holders


class _FlattenParamsWrapper(nn.Module):
    """The module FSDP wraps, as PyTorch/XLA's ``XlaFlattenParamsWrapper`` lays it out: the
    original module as ``_fpw_module``; with ``flatten_parameters`` its parameters are grouped
    (trainable, frozen) into ``flat_param_<i>``, which FSDP shards (they are never registered
    here). ``state_dict()`` keys drop the ``_fpw_module.`` level, as PyTorch/XLA's do.

    Args:
        module: The module to wrap.
        param_groups: Lists of parameters of ``module`` to flatten together (none: none).
    """

    def __init__(self, module: nn.Module, param_groups: list[list[nn.Parameter]]) -> None:
        super().__init__()
        self._fpw_module = module
        self.flat_param_names: list[str] = []
        self.flat_infos: list[tuple[list, list]] = []  # (holders, other holders of shared ones)
        self._flat_shapes: list[list[torch.Size]] = []
        for params in param_groups:
            if not params:
                continue
            infos, shared, unique = self._locate(set(params))
            self.flat_param_names.append(f"flat_param_{len(self.flat_infos)}")
            self.flat_infos.append((infos, shared))
            self._flat_shapes.append([p.size() for p in unique])
        self.register_state_dict_post_hook(_drop_fpw_level)
        self.register_load_state_dict_pre_hook(_add_fpw_level)

    def _locate(self, params: set) -> tuple[list, list, list]:
        """The (name, module, attribute) of each parameter, first holder first, and the other
        holders of shared ones (name, module, attribute, first holder's module, attribute)."""
        infos, shared, unique, first = [], [], [], {}
        for module_name, module in self.named_modules():
            for name, p in module.named_parameters(recurse=False):
                if p not in params:
                    continue
                if p in first:
                    shared.append((module_name, module, name, *first[p]))
                else:
                    first[p] = (module, name)
                    infos.append((module_name, module, name))
                    unique.append(p)
        if len({p.dtype for p in unique}) != 1 or len({p.requires_grad for p in unique}) != 1:
            raise ValueError("flatten_parameters: a flat group needs one dtype and requires_grad")
        return infos, shared, unique

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fpw_module

    def metadata(self, index: int) -> tuple[list[str], list[torch.Size], list[int]]:
        """(names, shapes, numels) of the parameters in ``flat_param_<index>``."""
        infos, _ = self.flat_infos[index]
        shapes = self._flat_shapes[index]
        names = [f"{m}.{n}" if m else n for m, _, n in infos]
        return names, list(shapes), [shape.numel() for shape in shapes]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_fpw_module":
                raise
            return getattr(self._fpw_module, name)

    def __getitem__(self, key: int) -> nn.Module:
        return self._fpw_module.__getitem__(key)

    def forward(self, *inputs: Any, **kwinputs: Any) -> Any:
        return self._fpw_module(*inputs, **kwinputs)


def _drop_fpw_level(module, state_dict, prefix, local_metadata) -> None:
    """``state_dict()`` keys without the ``_fpw_module.`` level."""
    level = prefix + "_fpw_module."
    for key in [k for k in state_dict if k.startswith(level)]:
        state_dict[prefix + key[len(level) :]] = state_dict.pop(key)


def _add_fpw_level(module, state_dict, prefix, *args) -> None:
    """``load_state_dict()`` keys with the ``_fpw_module.`` level put back."""
    level = prefix + "_fpw_module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(level)]:
        state_dict[level + key[len(prefix) :]] = state_dict.pop(key)


def _materialize(module: nn.Module, param_init_fn: Callable[[nn.Module], None] | None) -> None:
    """Deferred initialisation, as PyTorch/XLA's FSDP does it: a module whose own parameters (not
    those nested FSDP modules already sharded) are on the meta device is materialised in place by
    ``param_init_fn(module)``, or else allocated on the CPU and filled by its
    ``reset_parameters()``. A module with no meta parameter is left as it is."""
    if not any(p.is_meta for p in _own_parameters(module)):
        return
    what = f"XlaFullyShardedDataParallel({type(module).__name__})"
    if param_init_fn is not None:
        if not callable(param_init_fn):
            raise ValueError(f"{what}: param_init_fn must be callable, got {param_init_fn!r}")
        param_init_fn(module)
    else:
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            raise RuntimeError(
                f"{what}: the module is on the meta device and defines no reset_parameters(); "
                "pass param_init_fn to materialise it"
            )
        for m in _own_modules(module):
            m.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            reset()
    left = [n for n, p in module.named_parameters() if p.is_meta and not hasattr(p, "_is_sharded")]
    if left:
        raise RuntimeError(f"{what}: parameters {left} are still on the meta device after init")


def _own_modules(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` and its submodules, without nested FSDP modules (which own their tensors)."""
    yield module
    for child in module.children():
        if not isinstance(child, XlaFullyShardedDataParallel):
            yield from _own_modules(child)


def _own_parameters(module: nn.Module) -> Iterator[nn.Parameter]:
    for m in _own_modules(module):
        yield from m.parameters(recurse=False)


class _Collectives(NamedTuple):
    """How an FSDP module gathers and reduce-scatters (kept apart from the module, so that the
    autograd graph holds no reference to it)."""

    compute_dtype: torch.dtype
    groups: Any
    world_size: int
    fp32_reduce_scatter: bool
    predivide: float
    postdivide: float
    scale: float

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        data = shard if shard.dtype == self.compute_dtype else shard.to(self.compute_dtype)
        return xm.all_gather(data, dim=0, groups=self.groups, pin_layout=False)

    def reduce_scatter(self, grad: torch.Tensor) -> torch.Tensor:
        """The replica's shard of the gradient averaged over the replicas, in float32."""
        if self.fp32_reduce_scatter:
            grad = grad.to(torch.float32)
        if self.predivide > 1:
            grad = grad / self.predivide
        shard = xm.reduce_scatter(
            xm.REDUCE_SUM,
            grad,
            scale=self.scale,
            scatter_dim=0,
            shard_count=self.world_size,
            groups=self.groups,
            pin_layout=False,
        )
        if self.postdivide > 1:
            shard = shard / self.postdivide
        return shard.to(torch.float32)


class _GatherShard(torch.autograd.Function):
    """The full (padded) parameter from every replica's shard; its backward reduce-scatters the
    gradient back to the shards, averaged over the replicas."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, collectives: _Collectives) -> torch.Tensor:
        ctx.collectives = collectives
        ctx.set_materialize_grads(False)
        return collectives.all_gather(shard)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None) -> tuple:
        if grad is None:
            return None, None
        return ctx.collectives.reduce_scatter(grad), None


class XlaFullyShardedDataParallel(nn.Module):
    """Shards ``module``'s parameters over the replicas of ``launch`` (PyTorch/XLA's FSDP v1,
    ZeRO-3): each replica keeps 1/N of them; the forward pass all-gathers a module's parameters,
    the backward pass reduce-scatters their gradients (averaged over the replicas).

    Build the optimizer after wrapping, over ``model.parameters()`` (the shards), and step it
    with ``optimizer.step()``, not ``xm.optimizer_step`` (which would average the gradients
    again). Nest FSDP modules (wrap the inner ones first, or pass ``auto_wrap_policy``) so that
    only one block's full parameters exist at a time.

    Args:
        module: The module to shard. Its parameters may be on the CPU (each replica uploads only
            its shard) or on the xla device; buffers are moved to the xla device.
        reshard_after_forward: Gather the parameters again in the backward pass instead of
            keeping the forward pass's copy (not for the root with ``disable_reshard_on_root``).
        flatten_parameters: Concatenate the module's parameters (trainable and frozen apart) into
            one flat parameter before sharding: fewer, larger collectives, one optimizer group.
        execute_sharding_on_init: Run a barrier at the end of ``__init__``.
        optimization_barrier_in_forward: Accepted; no effect here (see the module's docstring).
        optimization_barrier_in_backward: Put the shard through an optimization barrier before
            the backward pass's gather (``reshard_after_forward``), so XLA keeps two gathers.
        sync_on_finalization: Run a barrier when the backward pass ends (root only).
        disable_reshard_on_root: The outermost FSDP keeps its gathered parameters for the
            backward pass.
        compute_dtype: The dtype parameters are gathered and computed in (float32, float16 or
            bfloat16; the shards stay float32); floating inputs are cast to it.
        buffer_dtype: The dtype of floating buffers (default ``compute_dtype``).
        fp32_reduce_scatter: Reduce-scatter gradients in float32 when ``compute_dtype`` is not.
        sharding_groups: Replica groups to shard over (with ``sharding_rank`` and
            ``sharding_world_size``), e.g. to combine FSDP with model parallelism.
        sharding_rank: This replica's rank in its sharding group.
        sharding_world_size: The sharding groups' size.
        shard_param_on_dim_0: Shard each parameter along its first dimension, unflattened
            (ignored with ``flatten_parameters``).
        pin_layout_in_collective_ops: Accepted; no effect.
        reduce_scatter_bucket_size_mb: Accepted; no effect.
        coalesce_all_gather_ops: Accepted; no effect.
        auto_wrap_policy: Wraps the module's children (recursively) in FSDP modules of their own
            (``spmd_torch.distributed.fsdp.wrap``'s policies).
        auto_wrapper_callable: Makes those wrappers (default this class), e.g.
            ``lambda m, *a, **k: FSDP(checkpoint_module(m), *a, **k)``.
        param_init_fn: Materialises a module built on the meta device, called with the module
            (e.g. ``to_empty(device='xla')`` then ``reset_parameters()``); only called when
            some of the module's own parameters are on the meta device. Without it such a module
            is allocated on the CPU and its ``reset_parameters()`` called.
        _shard_size_multiple: Shard sizes are padded to a multiple of this (1 with
            ``shard_param_on_dim_0``), as PyTorch/XLA pads them for TPUs.
        _use_xla_patched_linear: Accepted; no effect.
        _debug_msg: A name for this instance in messages.

    Raises:
        RuntimeError: ``module`` is an FSDP module already, or defines no ``forward``.
        NotImplementedError: An option this implementation does not provide.

    Example:
        >>> policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
        >>> model = XlaFullyShardedDataParallel(GPT(), auto_wrap_policy=policy)
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    """

    def __init__(
        self,
        module: nn.Module,
        reshard_after_forward: bool = True,
        flatten_parameters: bool = False,
        execute_sharding_on_init: bool = True,
        optimization_barrier_in_forward: bool = True,
        optimization_barrier_in_backward: bool = True,
        sync_on_finalization: bool = False,
        disable_reshard_on_root: bool = True,
        compute_dtype: torch.dtype | None = None,
        buffer_dtype: torch.dtype | None = None,
        fp32_reduce_scatter: bool = False,
        sharding_groups: list[list[int]] | None = None,
        sharding_rank: int | None = None,
        sharding_world_size: int | None = None,
        shard_param_on_dim_0: bool = False,
        pin_layout_in_collective_ops: bool = True,
        reduce_scatter_bucket_size_mb: int | None = 0,
        coalesce_all_gather_ops: bool = False,
        auto_wrap_policy: Callable | None = None,
        auto_wrapper_callable: Callable | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        _shard_size_multiple: int = 128,
        _use_xla_patched_linear: bool = True,
        _debug_dummy_forward_pass: bool = False,
        _debug_msg: str = "xla_fsdp",
        _debug_print: bool = False,
        _debug_dummy_all_gather_op: bool = False,
        _debug_dummy_all_reduce_op: bool = False,
        _debug_dummy_reduce_scatter_op: bool = False,
        _debug_dummy_optimization_barrier_op: bool = False,
    ) -> None:
        if isinstance(module, XlaFullyShardedDataParallel):
            raise RuntimeError(
                "XlaFullyShardedDataParallel: the module is an FSDP module already; for nested "
                "FSDP wrap the inner modules first, then the outer one"
            )
        forward = getattr(getattr(module, "forward", None), "__func__", None)
        if forward is None or forward is nn.Module.forward:
            raise RuntimeError(
                f"XlaFullyShardedDataParallel: {type(module).__name__} defines no forward (do not "
                "wrap nn.ModuleList or nn.ModuleDict); FSDP gathers parameters around forward()"
            )
        debug = {
            "_debug_dummy_forward_pass": _debug_dummy_forward_pass,
            "_debug_print": _debug_print,
            "_debug_dummy_all_gather_op": _debug_dummy_all_gather_op,
            "_debug_dummy_all_reduce_op": _debug_dummy_all_reduce_op,
            "_debug_dummy_reduce_scatter_op": _debug_dummy_reduce_scatter_op,
            "_debug_dummy_optimization_barrier_op": _debug_dummy_optimization_barrier_op,
        }
        refused = [name for name, value in debug.items() if value]
        if refused:
            raise NotImplementedError(
                f"XlaFullyShardedDataParallel: {', '.join(refused)} not implemented in spmd_torch"
            )
        for dtype, what in ((compute_dtype, "compute_dtype"), (buffer_dtype, "buffer_dtype")):
            if dtype is not None and dtype not in FLOAT_DTYPES:
                raise ValueError(f"{what} must be one of {FLOAT_DTYPES}, not {dtype}")
        super().__init__()

        if auto_wrap_policy is not None:
            for name, child in module.named_modules():
                if isinstance(child, XlaFullyShardedDataParallel):
                    raise ValueError(
                        f"Expected {name} to NOT be FullyShardedDataParallel if using an "
                        "`auto_wrap_policy`"
                    )
            options = dict(
                reshard_after_forward=reshard_after_forward,
                flatten_parameters=flatten_parameters,
                execute_sharding_on_init=execute_sharding_on_init,
                optimization_barrier_in_forward=optimization_barrier_in_forward,
                optimization_barrier_in_backward=optimization_barrier_in_backward,
                sync_on_finalization=sync_on_finalization,
                disable_reshard_on_root=disable_reshard_on_root,
                compute_dtype=compute_dtype,
                buffer_dtype=buffer_dtype,
                fp32_reduce_scatter=fp32_reduce_scatter,
                sharding_groups=sharding_groups,
                sharding_rank=sharding_rank,
                sharding_world_size=sharding_world_size,
                shard_param_on_dim_0=shard_param_on_dim_0,
                pin_layout_in_collective_ops=pin_layout_in_collective_ops,
                reduce_scatter_bucket_size_mb=reduce_scatter_bucket_size_mb,
                coalesce_all_gather_ops=coalesce_all_gather_ops,
                param_init_fn=param_init_fn,
                _shard_size_multiple=_shard_size_multiple,
                _use_xla_patched_linear=_use_xla_patched_linear,
                _debug_msg=_debug_msg,
            )
            wrapper = auto_wrapper_callable or XlaFullyShardedDataParallel
            recursive_wrap(
                module, auto_wrap_policy, wrapper, set(), set(), only_wrap_children=True, **options
            )

        self.reshard_after_forward = self._orig_reshard_after_forward = reshard_after_forward
        self.disable_reshard_on_root = disable_reshard_on_root
        self.flatten_parameters = flatten_parameters
        self.optimization_barrier_in_forward = optimization_barrier_in_forward
        self.optimization_barrier_in_backward = optimization_barrier_in_backward
        self.sync_on_finalization = sync_on_finalization
        self.compute_dtype = compute_dtype or torch.float32
        self.buffer_dtype = buffer_dtype or self.compute_dtype
        self.fp32_reduce_scatter = fp32_reduce_scatter
        self._shard_param_on_dim_0 = shard_param_on_dim_0 and not flatten_parameters
        self._shard_size_multiple = 1 if self._shard_param_on_dim_0 else _shard_size_multiple
        self._debug_msg = _debug_msg
        self.sharding_groups = sharding_groups
        if sharding_groups is None:
            self.rank, self.world_size = runtime.global_ordinal(), runtime.world_size()
        elif sharding_rank is None or sharding_world_size is None:
            raise ValueError(
                "sharding_rank and sharding_world_size must be provided when sharding_groups is "
                "specified"
            )
        else:
            self.rank, self.world_size = sharding_rank, sharding_world_size
        self.gradient_predivide_factor = self._get_gradient_predivide_factor(self.world_size)
        self.gradient_postdivide_factor = self.world_size / self.gradient_predivide_factor
        self._reduce_scatter_scale = 1.0

        _materialize(module, param_init_fn)
        params = [p for p in module.parameters() if not hasattr(p, "_is_sharded")]
        if any(p.dtype != torch.float32 for p in params):
            raise TypeError("only fp32 parameters are supported")
        groups: list[list[nn.Parameter]] = []
        if flatten_parameters:
            groups = [
                [p for p in params if p.requires_grad],
                [p for p in params if not p.requires_grad],
            ]
        self._fsdp_wrapped_module: nn.Module = _FlattenParamsWrapper(module, groups)
        self.xla_device = xm.xla_device()
        self._shard_parameters_(params)
        self._cast_buffers(self.buffer_dtype)
        self._is_root: bool | None = None
        self._finalize_queued = False
        self.training_state = TrainingState.IDLE
        if execute_sharding_on_init:
            xm.mark_step()

    # --- sharding ----------------------------------------------------------------------------

    @staticmethod
    def _get_gradient_predivide_factor(world_size: int) -> float:
        factor = 1
        while world_size % factor == 0 and world_size / factor > factor:
            factor *= 2
        return float(factor)

    def set_gradient_divide_factors(self, pre: float, post: float, recursive: bool) -> None:
        """Divide gradients by ``pre`` before the reduce-scatter and by ``post`` after it
        (the defaults split the replica count between the two, so gradients are averaged; with
        ``(1, 1)`` the reduce-scatter itself averages, as in PyTorch/XLA).

        Args:
            pre: Divides the gradient before the reduction.
            post: Divides the reduced gradient.
            recursive: Set them in the nested FSDP modules too.

        Example:
            >>> model.set_gradient_divide_factors(8.0, 1.0, recursive=True)  # all before
        """
        if recursive:
            for m in self.modules():
                if isinstance(m, XlaFullyShardedDataParallel) and m is not self:
                    m.set_gradient_divide_factors(pre, post, False)
        self.gradient_predivide_factor, self.gradient_postdivide_factor = pre, post
        self._reduce_scatter_scale = 1.0 / self.world_size if (pre, post) == (1, 1) else 1.0

    @torch.no_grad()
    def _shard_parameters_(self, params: list[nn.Parameter]) -> None:
        """Replace the module's parameters by this replica's shards, registered here."""
        on_device = [p for p in params if p.device.type == "xla"]
        if on_device:
            xm.unlazy(on_device)  # one program, then each read below is a copy
        wrapper = self._fsdp_wrapped_module
        owned = set(params)
        flat = set()
        units = []  # (name, full CPU tensor, requires_grad, pieces)
        for index, (infos, shared) in enumerate(wrapper.flat_infos):
            group = [m._parameters[n] for _, m, n in infos]
            data = torch.cat([p.detach().cpu().reshape(-1) for p in group])
            pieces, offset = [], 0
            for p, holder in zip(group, _holders(infos, shared)):
                pieces.append(_Piece(offset, p.numel(), p.size(), holder))
                offset += p.numel()
            name = f"_fsdp_wrapped_module.{wrapper.flat_param_names[index]}"
            units.append((name, data, group[0].requires_grad, pieces))
            flat.update(group)
        first: dict = {}
        infos, shared = [], []
        for module_name, m in self.named_modules():
            for n, p in m.named_parameters(recurse=False):
                if p not in owned or p in flat:
                    continue
                if p in first:
                    shared.append((module_name, m, n, *first[p][1:]))
                else:
                    first[p] = (module_name, m, n)
                    infos.append((module_name, m, n))
        for (module_name, m, n), holder in zip(infos, _holders(infos, shared)):
            p = m._parameters[n]
            name = f"{module_name}.{n}" if module_name else n
            pieces = [_Piece(0, p.numel(), p.size(), holder)]
            units.append((name, p.detach().cpu(), p.requires_grad, pieces))
        for _, m, n in [*infos, *shared]:
            m._parameters.pop(n, None)
        for infos_, shared_ in wrapper.flat_infos:
            for _, m, n in infos_:
                m._parameters.pop(n, None)
            for _, m, n, *_ in shared_:
                m._parameters.pop(n, None)

        self._placeholder = torch.zeros(1, dtype=self.compute_dtype, device=self.xla_device)
        self.sharded_params: list[nn.Parameter] = []
        self._pieces: list[list[_Piece]] = []
        for name, full, requires_grad, pieces in units:
            shard = nn.Parameter(self._get_shard(full).to(self.xla_device), requires_grad)
            shard._is_sharded = True
            shard._orig_size = full.size()
            shard._orig_name = name
            shard._name = f"_fsdp_shard.{name}".replace(".", "_FSDP_SHARD_SEPARATOR_")
            self.register_parameter(shard._name, shard)
            self.sharded_params.append(shard)
            self._pieces.append(pieces)
        self._release_full_params()

    def _get_shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """This replica's piece of ``tensor`` (flattened unless sharded on dim 0, padded)."""
        padded = self._flatten_and_pad_to_world_size(
            tensor, self.world_size * self._shard_size_multiple
        )
        size = padded.size(0) // self.world_size
        return padded[self.rank * size : (self.rank + 1) * size].clone()

    def _flatten_and_pad_to_world_size(self, tensor: torch.Tensor, multiple: int) -> torch.Tensor:
        if self._shard_param_on_dim_0:
            pad = -tensor.size(0) % multiple
            return F.pad(tensor, [0, 0] * (tensor.dim() - 1) + [0, pad]) if pad else tensor
        tensor = tensor.flatten()
        pad = -tensor.numel() % multiple
        return F.pad(tensor, [0, pad]) if pad else tensor

    @torch.no_grad()
    def _cast_buffers(self, dtype: torch.dtype | None = None, memo: set | None = None) -> None:
        """Floating buffers to ``dtype`` (remembering their dtype for consolidation), every
        buffer to the xla device; nested FSDP modules cast their own."""
        memo = set() if memo is None else memo
        for module in self.modules():
            if module is not self and isinstance(module, XlaFullyShardedDataParallel):
                module._cast_buffers(memo=memo)
            elif module not in memo:
                memo.add(module)
                for name, buf in module.named_buffers(recurse=False):
                    if buf is None:
                        continue
                    orig_dtype = getattr(buf, "_orig_dtype", buf.dtype)
                    target = buf.dtype
                    if torch.is_floating_point(buf):
                        target = dtype or self.buffer_dtype
                    buf = buf.to(self.xla_device, target)
                    if buf.dtype != orig_dtype:
                        buf._orig_dtype = orig_dtype
                    setattr(module, name, buf)

    # --- collectives -------------------------------------------------------------------------

    def _collectives(self) -> _Collectives:
        return _Collectives(
            self.compute_dtype,
            self.sharding_groups,
            self.world_size,
            self.fp32_reduce_scatter,
            self.gradient_predivide_factor,
            self.gradient_postdivide_factor,
            self._reduce_scatter_scale,
        )

    def _gather_full_params(self) -> list[torch.Tensor]:
        """All-gather every shard (recorded by autograd) and put the full parameters in their
        modules; returns the gathered (padded) tensors."""
        gathered = []
        collectives = self._collectives()
        for shard, pieces in zip(self.sharded_params, self._pieces):
            padded = _GatherShard.apply(shard, collectives)
            gathered.append(padded)
            for piece in pieces:
                if self._shard_param_on_dim_0:  # one piece, padded along dim 0
                    value = padded[: piece.shape[0]]
                else:
                    value = padded[piece.offset : piece.offset + piece.numel].view(piece.shape)
                for m, n in piece.holders:
                    object.__setattr__(m, n, value)
        return gathered

    def _release_full_params(self) -> None:
        """Point every full parameter at a placeholder (drops the gathered tensors)."""
        for pieces in self._pieces:
            for piece in pieces:
                for m, n in piece.holders:
                    object.__setattr__(m, n, self._placeholder)

    @contextlib.contextmanager
    def _regather_in_backward(self, gathered: list[torch.Tensor]) -> Iterator[None]:
        """While the forward pass runs, tensors autograd saves that are the gathered parameters
        (or views of them) are saved as recipes: the backward pass gathers the shard again and
        replays the view (the engine's view chain) on the new copy."""
        bases = {id(g): i for i, g in enumerate(gathered)}
        again: dict[int, torch.Tensor] = {}
        shards, collectives, barrier = self.sharded_params, self._collectives(), None
        if self.optimization_barrier_in_backward:
            barrier = xm.optimization_barrier_

        def pack(t: torch.Tensor) -> Any:
            index = bases.get(id(t))
            if index is not None:
                return (_Regather, index, ())
            base = getattr(t, "_base", None)
            index = None if base is None else bases.get(id(base))
            if index is None or not isinstance(t, LazyTensor) or base._view is not None:
                return t
            if t._storage is not base._storage or t._view is None:
                return t
            return (_Regather, index, tuple((entry.func, entry.args) for entry in t._view))

        def unpack(packed: Any) -> torch.Tensor:
            if not (isinstance(packed, tuple) and packed and packed[0] is _Regather):
                return packed
            _, index, chain = packed
            with torch.no_grad():
                if index not in again:
                    data = shards[index].detach()
                    if barrier is not None:
                        barrier([data])
                    again[index] = collectives.all_gather(data)
                value = again[index]
                for func, args in chain:
                    value = func(value, *args)
            return value

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    # --- forward and backward ----------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module (PyTorch/XLA's flatten wrapper around the original module)."""
        return self._fsdp_wrapped_module

    def _lazy_init(self) -> None:
        if self._is_root is None:
            self._is_root = True
            for name, m in self.named_modules():
                if name and isinstance(m, XlaFullyShardedDataParallel) and m._is_root is None:
                    m._is_root = False
        self.reshard_after_forward = self._orig_reshard_after_forward and not (
            self._is_root and self.disable_reshard_on_root
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._lazy_init()
        self.training_state = TrainingState.FORWARD
        try:
            if self.compute_dtype != torch.float32:
                args, kwargs = _cast_floats(self.compute_dtype, args, kwargs)
            gathered = self._gather_full_params()
            grad = torch.is_grad_enabled()
            regather = grad and self.reshard_after_forward
            with self._regather_in_backward(gathered) if regather else contextlib.nullcontext():
                outputs = self.module(*args, **kwargs)
        finally:
            self.training_state = TrainingState.IDLE
        tracked = [t for t in _collect_tensors(outputs) if t.requires_grad]
        if not grad or not tracked:
            self._release_full_params()
        elif self._is_root:
            for t in tracked:
                t.register_hook(self._pre_backward_hook)
        return outputs

    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        if not self._finalize_queued:
            self._finalize_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        """At the end of the backward pass: drop every gathered parameter of the tree."""
        self._finalize_queued = False
        for m in self.modules():
            if isinstance(m, XlaFullyShardedDataParallel):
                m._release_full_params()
        if self.sync_on_finalization:
            xm.mark_step()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Not implemented: raises NotImplementedError (accumulate gradient shards instead, by
        calling backward more than once before ``optimizer.step()``)."""
        raise NotImplementedError(
            "XlaFullyShardedDataParallel.no_sync is not implemented in spmd_torch; gradient "
            "shards accumulate over several backward passes without it"
        )
        yield  # pragma: no cover

    # --- gradients, state --------------------------------------------------------------------

    @property
    def params_with_grad(self) -> list[nn.Parameter]:
        """The shards (this module's and nested ones') that have a gradient."""
        return [p for p in self.parameters() if p.grad is not None]

    @torch.no_grad()
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        groups: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """Clip the gradients by their global norm (over every replica's shards) in place.

        Call it on the root, on every replica.

        Args:
            max_norm: The largest norm allowed.
            norm_type: The p of the p-norm (``math.inf`` for the largest entry).
            groups: Replica groups of the norm's all-reduce (see ``xm.all_reduce``).

        Returns:
            The total norm before clipping.

        Example:
            >>> loss.backward()
            >>> model.clip_grad_norm_(1.0)
            >>> optimizer.step()
        """
        if not self._is_root:
            raise RuntimeError("clip_grad_norm should only be called on the root (parent) instance")
        max_norm, norm_type = float(max_norm), float(norm_type)
        grads = [p.grad.detach() for p in self.params_with_grad]
        if not grads:
            local = torch.zeros((), device=self.xla_device)
        elif norm_type == math.inf:
            local = torch.stack([g.abs().max() for g in grads]).max()
        else:
            local = torch.norm(torch.stack([torch.norm(g, norm_type) for g in grads]), norm_type)
        if norm_type == math.inf:
            total = xm.all_reduce(xm.REDUCE_MAX, local, groups=groups)
        else:
            total = xm.all_reduce(xm.REDUCE_SUM, local**norm_type, groups=groups)
            total = total ** (1.0 / norm_type)
        coefficient = torch.clip(max_norm / (total + 1e-6), 0.0, 1.0)
        for g in grads:
            g.mul_(coefficient)
        return total

    def get_shard_metadata(self) -> dict:
        """What ``consolidate_sharded_model_checkpoints`` needs besides the replicas' state
        dicts: each shard's original name and size, the flat parameters' contents, buffers'
        original dtypes, the world size and this replica's rank.

        Example:
            >>> ckpt = {'model': model.state_dict(), 'shard_metadata': model.get_shard_metadata()}
            >>> xm.save(ckpt, f'ckpt_rank-{xr.global_ordinal()}.pth', master_only=False)
        """
        shard_info, flatten_info = {}, {}
        for module_name, m in self.named_modules(remove_duplicate=False):
            module_name = module_name.replace("_fpw_module.", "")
            if isinstance(m, XlaFullyShardedDataParallel):
                shard_info[module_name] = {
                    p._name: {"_orig_size": p._orig_size, "_orig_name": p._orig_name}
                    for p in m.sharded_params
                }
            if isinstance(m, _FlattenParamsWrapper):
                for i, name in enumerate(m.flat_param_names):
                    key = f"{module_name}.{name}" if module_name else name
                    flatten_info[key] = m.metadata(i)
        buffer_info = {
            name.replace("_fpw_module.", ""): {"_orig_dtype": buf._orig_dtype}
            for name, buf in self.named_buffers()
            if buf is not None and hasattr(buf, "_orig_dtype")
        }
        return {
            "shard_info": shard_info,
            "flatten_info": flatten_info,
            "buffer_info": buffer_info,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    def get_original_names_and_sharded_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Each shard (this module's and nested ones') with the name of the parameter it holds.

        Example:
            >>> dict(model.get_original_names_and_sharded_parameters())['fc1.weight']
        """
        named = []
        for module_name, m in self.named_modules():
            if isinstance(m, XlaFullyShardedDataParallel):
                prefix = f"{module_name}." if module_name else ""
                for p in m.sharded_params:
                    name = prefix + p._orig_name
                    name = name.replace("_fsdp_wrapped_module.", "").replace("_fpw_module.", "")
                    named.append((name, p))
        return named

    def extra_repr(self) -> str:
        return (
            f"world_size={self.world_size}, rank={self.rank}, compute_dtype={self.compute_dtype}, "
            f"buffer_dtype={self.buffer_dtype}, flatten_parameters={self.flatten_parameters}, "
            f"reshard_after_forward={self.reshard_after_forward}, "
            f"sharding_groups={self.sharding_groups}"
        )

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_fsdp_wrapped_module":
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> nn.Module:
        return self._fsdp_wrapped_module.__getitem__(key)


class _Regather:
    """Marks a saved tensor packed as a recipe (see ``_regather_in_backward``)."""


def _holders(infos: list, shared: list) -> list[list]:
    """For each parameter of ``infos``, every (module, attribute) holding it."""
    holders = [[(m, n)] for _, m, n in infos]
    first = {(id(m), n): i for i, (_, m, n) in enumerate(infos)}
    for _, m, n, first_m, first_n in shared:
        holders[first[(id(first_m), first_n)]].append((m, n))
    return holders


def _collect_tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _apply_to_tensors(lambda t: found.append(t) or t, value)
    return found


def _apply_to_tensors(fn: Callable, value: Any) -> Any:
    if torch.is_tensor(value):
        return fn(value)
    if isinstance(value, OrderedDict):
        return type(value)((k, _apply_to_tensors(fn, v)) for k, v in value.items())
    if isinstance(value, dict):
        return {k: _apply_to_tensors(fn, v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        items = [_apply_to_tensors(fn, v) for v in value]
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    return value


def _cast_floats(dtype: torch.dtype, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t

    return _apply_to_tensors(cast, args), _apply_to_tensors(cast, kwargs)
