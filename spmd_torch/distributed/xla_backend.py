"""torch_xla.distributed.xla_backend on JAX: the ``xla`` backend of ``torch.distributed``.

Importing this module registers the ``xla`` backend and the ``xla://`` init method, as in
PyTorch/XLA. Inside each replica of :func:`spmd_torch.launch` (or ``xmp.spawn``)::

    dist.init_process_group('xla', init_method='xla://')

gives a process group whose rank is the replica's global ordinal and whose size is the replica
count. Its collectives call ``xm.all_reduce``, ``xm.all_gather`` and ``xm.reduce_scatter``, so they
are recorded into the lazy graph and run inside the one program of the next barrier, like every
other op; that is what lets ``DistributedDataParallel`` train over it.

``dist.new_group(ranks)`` over some of the replicas gives a group whose collectives reach only its
members. Every replica's barrier runs one program, so a subgroup's collective is written so that
every replica records the same graph whichever group it belongs to: the values of every replica
are gathered, and each replica keeps its own group's through a membership mask and an index table
that are data (uploaded once per group), not graph constants. Groups that split the replicas (the
usual ``for ranks in ...: g = dist.new_group(ranks)`` pattern, each replica then calling the
collective on its own group) therefore run as one program; all_reduce groups may differ in size,
all_gather and reduce_scatter groups need one size. A collective that only the members call, while
the other replicas record none, is a ``CollectiveMismatchError`` at the barrier (naming the
replicas), never a hang.

A group's ``_mesh`` (PyTorch/XLA's name) holds the replica groups its collectives run over, and
``dist.new_group`` chooses it as PyTorch/XLA's does: ``pg_options={'xla_pg_options': {'spmd':
True}}`` infers the rectangular mesh ``ranks`` is a row or a column of (one group per replica for
a single rank; any other slice is a ValueError), ``{'mesh': [[...], ...]}`` names it. A mesh that
splits every replica into groups of one size is passed to the xm collectives as their ``groups``
(one grouped collective, no gather of the whole world); a group without those options keeps its
own ranks as its mesh and runs through the membership mask above.

Replicas are threads of one process, while ``torch.distributed`` keeps its groups in one global
(``distributed_c10d._world``). This module replaces that global with one that gives each replica
thread a world of its own, created fresh when the replica first touches ``torch.distributed``;
every other thread keeps the original. The torch internals this relies on are named together
below the imports.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import urllib.parse
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from spmd_torch import runtime
from spmd_torch._lazy import engine, modes
from spmd_torch.core import xla_model as xm

__all__ = ["ProcessGroupXla"]

# The torch.distributed internals this module relies on (checked on torch 2.11-2.14), all here:
# - distributed_c10d._world, the override point c10d documents for its group state, and its class
#   _World, whose instance-backed properties we keep;
# - _C._distributed_c10d._set_thread_isolation_mode: a per-thread registry of group names;
# - _C._distributed_c10d._create_work_from_future: a Work over a completed Future.
_set_thread_isolation_mode = torch._C._distributed_c10d._set_thread_isolation_mode
_create_work_from_future = torch._C._distributed_c10d._create_work_from_future

# The _World properties c10d backs with module globals (shared by every thread) rather than with
# the instance; a replica's world keeps its own. The rest (default_pg, pg_coalesce_state, comms...)
# already live on the instance.
_GLOBAL_BACKED = (
    "pg_map",
    "pg_names",
    "pg_group_ranks",
    "pg_backend_config",
    "tags_to_pg",
    "pg_to_tag",
)


class _ReplicaWorld(c10d._World):
    """One replica's ``torch.distributed`` state: c10d's ``_World`` with every map its own."""

    def __init__(self) -> None:
        super().__init__()
        self._maps: dict[str, dict] = {name: {} for name in _GLOBAL_BACKED}
        self._group_count = 0

    pg_map = property(lambda self: self._maps["pg_map"])
    pg_names = property(lambda self: self._maps["pg_names"])
    pg_group_ranks = property(lambda self: self._maps["pg_group_ranks"])
    pg_backend_config = property(lambda self: self._maps["pg_backend_config"])
    tags_to_pg = property(lambda self: self._maps["tags_to_pg"])
    pg_to_tag = property(lambda self: self._maps["pg_to_tag"])

    @property
    def group_count(self) -> int:
        return self._group_count

    @group_count.setter
    def group_count(self, value: int) -> None:
        self._group_count = value


def _check_replica_world(original: c10d._World) -> None:
    """Fail loudly if this torch keeps some group state in a global we do not make per replica:
    replicas would then see each other's groups."""
    world = _ReplicaWorld()
    for name, attr in vars(c10d._World).items():
        if not isinstance(attr, property) or name == "pg_config_info":  # computed from the maps
            continue
        value = getattr(world, name)
        if isinstance(value, (dict, list)) and value is getattr(original, name):
            raise RuntimeError(
                f"torch {torch.__version__}: torch.distributed keeps _World.{name} in a global "
                "that spmd_torch does not make per replica; the xla backend needs an update"
            )


class _ReplicaWorlds:
    """Counts the live replica worlds, to hold two process-wide settings while any lives.

    c10d's C++ registry of group names must be per thread (thread isolation mode), since every
    replica names its default group "0"; and ``sys.excepthook``, which ``init_process_group``
    wraps once per replica, is put back when the last replica world dies.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._alive = 0
        self._excepthook = sys.excepthook

    def new(self) -> _ReplicaWorld:
        world = _ReplicaWorld()
        with self._lock:
            if self._alive == 0:
                self._excepthook = sys.excepthook
                _set_thread_isolation_mode(True)
            self._alive += 1
        weakref.finalize(world, self._died)  # when its replica thread exits
        return world

    def _died(self) -> None:
        with self._lock:
            self._alive -= 1
            if self._alive == 0:
                _set_thread_isolation_mode(False)
                sys.excepthook = self._excepthook


_REPLICA_WORLDS = _ReplicaWorlds()


class _WorldPerReplica:
    """Stands in for ``distributed_c10d._world``: each engine of its own (a replica of
    ``launch``, standing for a process) gets its own world, on first use; the default engine
    keeps the original."""

    __slots__ = ("_original", "_local")

    def __init__(self, original: c10d._World) -> None:
        object.__setattr__(self, "_original", original)
        object.__setattr__(self, "_local", threading.local())

    def current(self) -> c10d._World:
        """The calling engine's world."""
        own = engine.current()
        if own is engine.DEFAULT:
            return self._original
        local = self._local
        if getattr(local, "engine", None) is not own:  # a new replica (or a reused thread)
            local.engine, local.world = own, _REPLICA_WORLDS.new()
        return local.world

    def __getattr__(self, name: str) -> object:
        return getattr(self.current(), name)

    def __setattr__(self, name: str, value: object) -> None:
        setattr(self.current(), name, value)


# ---------------------------------------------------------------------------------------------
# The process group
# ---------------------------------------------------------------------------------------------
_RedOp = dist.ReduceOp.RedOpType
_REDUCE_TYPES = {
    _RedOp.SUM: xm.REDUCE_SUM,
    _RedOp.AVG: xm.REDUCE_SUM,  # scaled by 1 / size
    _RedOp.PRODUCT: xm.REDUCE_MUL,
    _RedOp.MIN: xm.REDUCE_MIN,
    _RedOp.MAX: xm.REDUCE_MAX,
    _RedOp.BAND: xm.REDUCE_AND,
    _RedOp.BOR: xm.REDUCE_OR,
}


def _completed(result: list[torch.Tensor]) -> dist.Work:
    """A finished Work: the collective is already in the graph, so there is nothing to wait for
    (its value is computed at the next barrier, with everything else)."""
    future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _on_device(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors on the replica's device: xla tensors themselves, CPU ones uploaded (the
    object collectives, ``all_gather_object`` and ``broadcast_object_list``, pass CPU tensors)."""
    device = xm.xla_device()
    return [tensor.to(device) for tensor in tensors]


def _copy_back(tensors: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Write results into the tensors that were uploaded for the collective (reading them is a
    barrier)."""
    for tensor, value in zip(tensors, values):
        if value is not tensor:
            tensor.copy_(value)


_MASKED_REDUCE = {  # xm reduce type -> (reduction over dim 0 of a stacked tensor, identity)
    xm.REDUCE_SUM: (lambda x: x.sum(0), lambda dtype: 0),
    xm.REDUCE_MUL: (lambda x: x.prod(0), lambda dtype: 1),
    xm.REDUCE_MIN: (
        lambda x: x.all(0) if x.dtype == torch.bool else x.amin(0),
        lambda dtype: _extreme(dtype, high=True),
    ),
    xm.REDUCE_MAX: (
        lambda x: x.any(0) if x.dtype == torch.bool else x.amax(0),
        lambda dtype: _extreme(dtype, high=False),
    ),
    xm.REDUCE_AND: (
        lambda x: x.all(0) if x.dtype == torch.bool else _fold(torch.bitwise_and, x),
        lambda dtype: True if dtype == torch.bool else -1,
    ),
    xm.REDUCE_OR: (
        lambda x: x.any(0) if x.dtype == torch.bool else _fold(torch.bitwise_or, x),
        lambda dtype: False if dtype == torch.bool else 0,
    ),
}


def _extreme(dtype: torch.dtype, high: bool) -> object:
    """The identity of min (``high``) or max for ``dtype``."""
    if dtype == torch.bool:
        return high
    if dtype.is_floating_point:
        return float("inf") if high else float("-inf")
    info = torch.iinfo(dtype)
    return info.max if high else info.min


def _fold(op, stacked: torch.Tensor) -> torch.Tensor:
    result = stacked[0]
    for row in stacked[1:]:
        result = op(result, row)
    return result


class _Subgroup:
    """A group of some of the replicas, as data.

    Every replica records the same graph for a collective on its own group, whichever group that
    is: all replicas' values are gathered (an ``xm.all_gather`` over the world), then a membership
    mask and index tables, uploaded once and read as program inputs, keep the group's values. So
    replicas of different groups, each calling the collective on its own, run one program.
    """

    def __init__(self, members: list[int]) -> None:
        device = xm.xla_device()
        mask = torch.zeros(runtime.world_size(), dtype=torch.bool)
        mask[members] = True
        self.members = members
        self.mask = mask.to(device)
        self.order = torch.tensor(members).to(device)  # group rank -> ordinal
        self.rank = torch.tensor([members.index(runtime.global_ordinal())]).to(device)

    @staticmethod
    def everyone(value: torch.Tensor) -> torch.Tensor:
        """Every replica's ``value``, stacked in ordinal order."""
        return xm.all_gather(value.unsqueeze(0), dim=0, pin_layout=False)

    def reduce(self, value: torch.Tensor, reduce_type: str) -> torch.Tensor:
        """``value`` reduced over the group's members."""
        reduction, identity = _MASKED_REDUCE[reduce_type]
        stacked = self.everyone(value)
        mask = self.mask.view(-1, *(1,) * value.dim())
        kept = torch.where(mask, stacked, identity(value.dtype))
        return reduction(kept).to(value.dtype)

    def gather(self, value: torch.Tensor) -> torch.Tensor:
        """The members' values stacked in group order: shape ``(group size, *value.shape)``."""
        return self.everyone(value).index_select(0, self.order)

    def from_root(self, value: torch.Tensor, root: int) -> torch.Tensor:
        """The value of the member of group rank ``root`` (its ordinal is data)."""
        (source,) = _on_device([torch.tensor([self.members[root]])])
        return self.everyone(value).index_select(0, source)[0]

    def own(self, rows: torch.Tensor) -> torch.Tensor:
        """This replica's row of ``rows`` (one row per group rank)."""
        return rows.index_select(0, self.rank)[0]


class ProcessGroupXla(dist.ProcessGroup):
    """The process group of the ``xla`` backend: collectives over the replicas of one launch.

    Each collective records the matching ``xm`` collective into the lazy graph and returns a Work
    that is already complete; the values are computed by the next barrier (``xm.mark_step()``,
    or reading a value), in the same program as the rest of the step. Create it through
    ``dist.init_process_group('xla', init_method='xla://')`` inside a replica, as in PyTorch/XLA.

    Supported: ``all_reduce`` (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR), ``all_gather``,
    ``all_gather_single`` / ``all_gather_into_tensor``, ``reduce_scatter``,
    ``reduce_scatter_single`` / ``reduce_scatter_tensor`` (SUM, AVG, MIN, MAX), ``broadcast``
    and ``barrier``; that covers ``DistributedDataParallel``. CPU tensors are accepted too (the
    result is copied back, which is a barrier), so ``all_gather_object`` and
    ``broadcast_object_list`` work. A group of ``dist.new_group(ranks)`` over some replicas
    reduces, gathers and broadcasts among its members only (see the module's docstring for how,
    and what every replica must do); its ``barrier`` meets only its members. ``_mesh`` holds the
    replica groups the collectives run over (``[]``: every replica). ``allgather_coalesced``
    gathers each input; ``allreduce_coalesced``, ``recv_anysource`` and ``monitored_barrier``
    raise NotImplementedError, as in PyTorch/XLA.

    Args:
        prefix_store: The store c10d hands the backend (unused: replicas meet in the graph).
        rank: This replica's rank in the group (its global ordinal in the default group).
        size: The number of replicas in the group.
        timeout: Unused: a collective is complete once recorded.

    Example:
        >>> import spmd_torch.distributed.xla_backend  # registers 'xla' and 'xla://'
        >>> def _mp_fn(index):
        ...     dist.init_process_group('xla', init_method='xla://')
        ...     t = torch.tensor([float(index)]).to(xm.xla_device())
        ...     dist.all_reduce(t)  # 28.0 (0 + 1 + ... + 7) in every replica
        >>> spmd_torch.launch(_mp_fn)
    """

    def __init__(self, prefix_store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self.prefix_store = prefix_store
        self.timeout = timeout
        # The replica groups this group's collectives run over, global ranks in group-rank order
        # (PyTorch/XLA's name): [] for every replica as one group, until dist.new_group sets it
        # (see _new_group) or the first collective reads the members c10d registered.
        self._mesh: list[list[int]] = []
        self._plan: _Subgroup | list[list[int]] | None | bool = False  # False: not resolved yet

    def getBackendName(self) -> str:
        return "xla"

    # c10d names a group through its C++ backends, and a Python group has none: keep the name here
    # (destroy_process_group and functional collectives read it), as PyTorch/XLA does.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _groups(self) -> _Subgroup | list[list[int]] | None:
        """How this group's collectives run, resolved once from ``_mesh``: None over every
        replica; the mesh itself when it splits the replicas into groups of one size (the xm
        collectives' ``groups``: each replica's collective on its own group is one node); else a
        ``_Subgroup`` of its one group's members (a group that other replicas need not share)."""
        if self._plan is not False:
            return self._plan
        world = list(range(runtime.world_size()))
        if not self._mesh:
            ranks = c10d._world.pg_group_ranks.get(self)  # c10d records them after creating us
            if ranks is not None:
                self._mesh = [sorted(ranks, key=ranks.get)]  # global ranks in group-rank order
            elif self.size() != len(world):
                raise RuntimeError(
                    f"xla process group of {self.size()} replicas that torch.distributed did not "
                    "register: create subgroups with dist.new_group(ranks)"
                )
        mesh = self._mesh
        if not mesh or mesh == [world]:
            self._plan = None
        elif _splits(mesh, len(world)):
            self._plan = mesh
        elif len(mesh) == 1 and set(mesh[0]) <= set(world):
            self._plan = _Subgroup(mesh[0])
        else:
            raise ValueError(
                f"xla process group: its mesh {mesh} does not split the {len(world)} replicas of "
                "this launch into groups of one size"
            )
        return self._plan

    def _own_group(self) -> list[int]:
        """The global ranks of this replica's group, in group-rank order."""
        groups = self._groups()
        if groups is None:
            return list(range(runtime.world_size()))
        if isinstance(groups, _Subgroup):
            return groups.members
        ordinal = runtime.global_ordinal()
        return next(group for group in groups if ordinal in group)

    def _reduce_type(self, op: dist.ReduceOp, collective: str) -> tuple[str, bool]:
        """The xm reduce type of a c10d reduce op, and whether to average."""
        reduce_type = _REDUCE_TYPES.get(op.op)
        if reduce_type is None:
            raise NotImplementedError(
                f"xla process group: {collective} with {op.op} is not supported"
            )
        return reduce_type, op.op == _RedOp.AVG

    def _reduced(self, value: torch.Tensor, reduce_type: str, average: bool) -> torch.Tensor:
        """``value`` reduced over the group (averaged if ``average``)."""
        sub = self._groups()
        if not isinstance(sub, _Subgroup):
            scale = 1.0 / self.size() if average else 1.0
            return xm.all_reduce(reduce_type, value, scale=scale, groups=sub, pin_layout=False)
        reduced = sub.reduce(value, reduce_type)
        if not average:
            return reduced
        if reduced.is_floating_point():
            return reduced * (1.0 / self.size())  # a lifted scalar: groups' sizes may differ
        return reduced.div(self.size(), rounding_mode="floor")

    def _gathered(self, value: torch.Tensor) -> torch.Tensor:
        """The members' values stacked in group order."""
        sub = self._groups()
        if not isinstance(sub, _Subgroup):
            return xm.all_gather(value.unsqueeze(0), dim=0, groups=sub, pin_layout=False)
        return sub.gather(value)

    @torch.no_grad()
    def allreduce(
        self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions | None = None
    ) -> dist.Work:
        reduce_type, average = self._reduce_type(
            (opts or dist.AllreduceOptions()).reduceOp, "allreduce"
        )
        values = _on_device(tensors)
        groups = self._groups()
        if not isinstance(groups, _Subgroup):  # one node for the list
            scale = 1.0 / self.size() if average else 1.0
            xm.all_reduce(reduce_type, values, scale=scale, groups=groups, pin_layout=False)
        else:
            for value in values:
                value.copy_(self._reduced(value, reduce_type, average))
        _copy_back(tensors, values)
        return _completed(tensors)

    @torch.no_grad()
    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: dist.AllgatherOptions | None = None,
    ) -> dist.Work:
        for outputs, tensor in zip(output_tensors, input_tensors):
            if len(outputs) != self.size():
                raise ValueError(
                    f"xla process group: all_gather of a {tuple(tensor.shape)} tensor needs "
                    f"{self.size()} output tensors, got {len(outputs)}"
                )
            (value,) = _on_device([tensor])
            gathered = self._gathered(value)
            gathered = gathered.to(outputs[0].device)  # CPU outputs: one read, then slices
            for output, value in zip(outputs, gathered):
                output.copy_(value)
        return _completed([t for outputs in output_tensors for t in outputs])

    @torch.no_grad()
    def all_gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        opts: dist.AllgatherOptions | None = None,
    ) -> dist.Work:
        shape = tuple(input.shape)
        stacked = (self.size(), *shape)
        concatenated = (self.size() * shape[0], *shape[1:]) if shape else stacked
        if tuple(output.shape) not in (stacked, concatenated):
            raise ValueError(
                f"xla process group: all_gather_into_tensor of a {shape} input needs an output "
                f"of shape {stacked} or {concatenated}, got {tuple(output.shape)}"
            )
        (value,) = _on_device([input])
        output.copy_(self._gathered(value).reshape(output.shape))
        return _completed([output])

    _allgather_base = all_gather_single  # the name torch < 2.13 calls

    @torch.no_grad()
    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: dist.ReduceScatterOptions | None = None,
    ) -> dist.Work:
        for output, inputs in zip(output_tensors, input_tensors):
            if len(inputs) != self.size():
                raise ValueError(
                    f"xla process group: reduce_scatter needs {self.size()} input tensors, "
                    f"got {len(inputs)}"
                )
            self.reduce_scatter_single(output, torch.stack(inputs), opts)
        return _completed(output_tensors)

    @torch.no_grad()
    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        opts: dist.ReduceScatterOptions | None = None,
    ) -> dist.Work:
        op = (opts or dist.ReduceScatterOptions()).reduceOp
        reduce_type, average = self._reduce_type(op, "reduce_scatter")
        if input.numel() != self.size() * output.numel():
            raise ValueError(
                f"xla process group: reduce_scatter_tensor of a {tuple(input.shape)} input needs "
                f"{self.size()} times the elements of its {tuple(output.shape)} output"
            )
        (value,) = _on_device([input])
        rows = value.reshape(self.size(), output.numel())
        sub = self._groups()
        if not isinstance(sub, _Subgroup):
            scale = 1.0 / self.size() if average else 1.0
            shard = xm.reduce_scatter(
                reduce_type, rows, scale, 0, self.size(), groups=sub, pin_layout=False
            )
        else:
            shard = sub.own(self._reduced(rows, reduce_type, average))
        output.copy_(shard.reshape(output.shape))
        return _completed([output])

    _reduce_scatter_base = reduce_scatter_single  # the name torch < 2.13 calls

    @torch.no_grad()
    def broadcast(
        self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions | None = None
    ) -> dist.Work:
        root = (opts or dist.BroadcastOptions()).rootRank  # a rank in the group
        sub = self._groups()
        if isinstance(sub, _Subgroup):
            for tensor in tensors:
                (value,) = _on_device([tensor])
                tensor.copy_(sub.from_root(value, root))
            return _completed(tensors)
        # As PyTorch/XLA: an all-reduce (over each group of the mesh) in which only the root
        # contributes. The mask is data, not a Python branch, so every replica records the same
        # graph.
        (not_root,) = _on_device([torch.tensor(self.rank() != root)])
        for tensor in tensors:
            (value,) = _on_device([tensor])
            contribution = [value.masked_fill(not_root, 0)]
            reduce_type = xm.REDUCE_OR if tensor.dtype == torch.bool else xm.REDUCE_SUM
            xm.all_reduce(reduce_type, contribution, groups=sub, pin_layout=False)
            tensor.copy_(contribution[0])
        return _completed(tensors)

    def barrier(self, opts: dist.BarrierOptions | None = None) -> dist.Work:
        # Replicas meet here (what a script relies on, e.g. rank 0 writes a file the others read);
        # pending device work is not flushed, as in PyTorch/XLA. A subgroup's members meet alone.
        if self._groups() is None:
            xm.rendezvous("torch.distributed.barrier")
        else:
            members = self._own_group()
            xm.rendezvous(f"torch.distributed.barrier:{members}", replicas=members)
        return _completed([])

    @torch.no_grad()
    def allgather_coalesced(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: dist.AllgatherOptions | None = None,
    ) -> dist.Work:
        """``all_gather`` of each input into its list of outputs (all in the step's program)."""
        return self.allgather(output_tensors, input_tensors, opts)

    # Not provided, as in PyTorch/XLA: a clear error rather than c10d's argument mismatch.
    def allreduce_coalesced(self, *args: object) -> dist.Work:
        raise NotImplementedError("xla process group: allreduce_coalesced is not implemented")

    def recv_anysource(self, *args: object) -> dist.Work:
        raise NotImplementedError("xla process group: recv_anysource is not implemented")

    def monitored_barrier(self, *args: object) -> dist.Work:
        raise NotImplementedError("xla process group: monitored_barrier is not implemented")


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------


class SpmdModeError(RuntimeError, AssertionError):
    """The xla process group asked for in SPMD mode: a RuntimeError, and the AssertionError that
    PyTorch/XLA raises there, so code written for either catches it."""


def _create_process_group(
    prefix_store: dist.Store, rank: int, size: int, timeout: timedelta
) -> ProcessGroupXla:
    """The ``xla`` backend's constructor, as ``dist.Backend.register_backend`` calls it."""
    modes.refuse_in_spmd(
        "the xla backend of torch.distributed runs over the replicas of launch/spawn; it is "
        "not supported in SPMD mode (use a CPU process group such as gloo there)",
        SpmdModeError,
    )
    return ProcessGroupXla(prefix_store, rank, size, timeout)


def _rendezvous_handler(url: str, **kwargs: object) -> Iterator[tuple[dist.Store, int, int]]:
    """The ``xla://`` init method: rank and world size are the replica's ordinal and count.

    The store is this replica's own: replicas meet in the graph (and at ``xm.rendezvous``), never
    through a store.
    """
    rank, size = runtime.global_ordinal(), runtime.world_size()
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlparse(url).query))
    for name, value in (("rank", rank), ("world_size", size)):
        given = int(query.get(name, -1))
        if given not in (-1, value):
            raise ValueError(
                f"init_process_group(init_method='xla://', {name}={given}): this replica's "
                f"{name} is {value}"
            )
    yield dist.HashStore(), rank, size


def _splits(mesh: list[list[int]], world_size: int) -> bool:
    """Whether ``mesh`` splits ranks ``0..world_size-1`` into disjoint groups of one size."""
    members = sorted(rank for group in mesh for rank in group)
    return members == list(range(world_size)) and len({len(group) for group in mesh}) == 1


def _infer_mesh(ranks: list[int], world_size: int) -> list[list[int]]:
    """The rectangular mesh of ``world_size`` ranks of which ``ranks`` is one row or column.

    A row is ``len(ranks)`` consecutive ranks starting at a multiple of its length (``[4, 5, 6,
    7]`` of 12: rows of 4); a column starts in the first row and steps by the row count
    (``[1, 5, 9]`` of 12: columns of 3 stepping by 4). Anything else is a ValueError.
    """
    length = len(ranks)
    if world_size % length:
        raise ValueError(
            f"new_group(ranks={ranks}): {length} ranks are not a side of a rectangle of the "
            f"{world_size} ranks"
        )
    count = world_size // length  # groups in the mesh
    start, step = ranks[0], ranks[1] - ranks[0]
    if ranks != list(range(start, start + step * length, step)) or step < 1:
        raise ValueError(f"new_group(ranks={ranks}): the ranks are not evenly spaced")
    if step == 1 and start % length == 0:  # a row
        return [list(range(k * length, (k + 1) * length)) for k in range(count)]
    if step == count and start < count:  # a column
        return [list(range(k, world_size, count)) for k in range(count)]
    raise ValueError(
        f"new_group(ranks={ranks}): not a row (consecutive, starting at a multiple of {length}) "
        f"nor a column (starting below {count}, step {count}) of the {world_size} ranks"
    )


def _mesh_of(ranks: list[int], world_size: int, options: dict) -> list[list[int]]:
    """The replica groups of a new group over ``ranks``, as PyTorch/XLA's ``new_group`` chooses
    them: the whole world as one group; with ``{'spmd': True}`` every replica's group of the mesh
    ``ranks`` is a row or column of, one group per rank for a single rank; with ``{'mesh': [...]}``
    that mesh (it must split the ranks into groups of one size, ``ranks`` one of them); else
    ``ranks`` alone (replicas outside it may group themselves differently)."""
    if ranks == list(range(world_size)):
        return [ranks]
    if options.get("mesh") is not None:
        mesh = [[int(rank) for rank in group] for group in options["mesh"]]
        if not _splits(mesh, world_size) or ranks not in mesh:
            raise ValueError(
                f"new_group(ranks={ranks}): the mesh {mesh} must split the {world_size} ranks "
                "into groups of one size, the group's ranks (in order) one of them"
            )
        return mesh
    if options.get("spmd", False):
        if len(ranks) == 1:
            if not 0 <= ranks[0] < world_size:
                raise ValueError(f"new_group(ranks={ranks}): out of the {world_size} ranks")
            return [[rank] for rank in range(world_size)]
        return _infer_mesh(ranks, world_size)
    return [ranks]


_c10d_new_group = dist.new_group
_c10d_init_process_group = dist.init_process_group


@functools.wraps(_c10d_init_process_group)
def _init_process_group(*args: Any, **kwargs: Any) -> None:
    """``dist.init_process_group``, which a replica runs stepped away from its world's turns:
    with ``env://`` or ``tcp://`` every replica meets the others in one TCP store, waiting there
    for all of them at once, as processes do (holding its turn, it would wait forever)."""
    with engine.current().mode.away():
        _c10d_init_process_group(*args, **kwargs)


@functools.wraps(_c10d_new_group)
def _new_group(*args: Any, **kwargs: Any) -> dist.ProcessGroup:
    """``dist.new_group`` as PyTorch/XLA overrides it: ``pg_options={'xla_pg_options': {...}}``
    chooses the replica groups of an ``xla`` group's collectives (``_mesh_of``); an invalid choice
    is a ValueError in every replica, before any group is created. Its store barrier waits for
    the other replicas stepped away, as ``_init_process_group`` does."""
    bound = inspect.signature(_c10d_new_group).bind(*args, **kwargs)
    ranks, pg_options = bound.arguments.get("ranks"), bound.arguments.get("pg_options")
    options = pg_options.get("xla_pg_options", {}) if isinstance(pg_options, dict) else {}
    mesh = None
    if ranks and isinstance(c10d._world.default_pg, ProcessGroupXla):
        ranks = sorted(ranks) if bound.arguments.get("sort_ranks", True) else list(ranks)
        mesh = _mesh_of(ranks, dist.get_world_size(), options)
    with engine.current().mode.away():
        group = _c10d_new_group(*args, **kwargs)
    if mesh is not None and isinstance(group, ProcessGroupXla):
        group._mesh = mesh
    return group


def _install() -> None:
    _check_replica_world(c10d._world)
    c10d._world = _WorldPerReplica(c10d._world)
    dist.new_group = _new_group
    dist.init_process_group = c10d.init_process_group = _init_process_group
    # devices as a list: register_backend iterates a string's characters.
    dist.Backend.register_backend("xla", _create_process_group, devices=["xla"])
    dist.register_rendezvous_handler("xla", _rendezvous_handler)


_install()
