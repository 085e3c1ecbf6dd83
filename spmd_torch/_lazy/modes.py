"""The modes a program runs in: one device, an SPMD mesh, or a replica of ``launch``.

The engine's mode does the work that depends on it, so nothing else asks which mode it is in (as
JAX's current trace processes each primitive): where uploads land, how inputs are gathered, how a
run executes (through the compile cache, or handed to the replicas' world), how a read of pending
values runs, and the world: its size, the ordinals, the axis collectives span, rendezvous.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from spmd_torch import config

from . import compile as compiler
from . import counters, engine, placement, transfer
from .graph import DATA, Program, linearize
from .lowering.collectives import ALONE_AXIS, REPLICA_AXIS
from .replicas import across_hosts
from .run import Run, execute
from .tensor import SEVERAL_DEVICES, XLA_DEVICES


def _inputs_by_aval(run: Run) -> tuple:
    """On one device an input is its aval (shape and dtype): nothing else can differ."""
    return tuple([node.avals[i] for node, i in run.program.leaves])


def _inputs_by_layout(run: Run) -> tuple:
    """Over several devices an input is (stored shape, dtype, sharding, logical shape): uneven
    ones are stored padded."""
    return tuple(
        (a.shape, a.dtype, placement.key_of(a.sharding), node.avals[i].shape)
        for a, (node, i) in zip(run.arrays, run.program.leaves)
    )


class PerDevice:
    """Each program runs on one of the process's devices: JAX's default one, where uploads land,
    unless the tensors are on another (``xla:N`` is JAX's N-th local device, as in PyTorch/XLA
    outside SPMD): a barrier runs one program per device used."""

    landing = None  # JAX's default device
    replicated = None  # the layout replicated over the SPMD devices: none here
    input_key = staticmethod(_inputs_by_aval)  # what of an input the compile cache keys on
    alone_axis = ALONE_AXIS  # XLA_ALWAYS_ALLREDUCE's collectives: over a mesh of the one device
    # Equal Python numbers share one program input (graph.linearize) where the program is this
    # process's alone; on a pod every host runs it, and hosts' numbers may differ (a host index),
    # so which of them are equal must not part the hosts' programs.
    shares_equal_scalars = property(lambda self: jax.process_count() == 1)
    # Small programs of its own may run before the step's: the fills a barrier computes first
    # (execute._constants_first), the step counters Dynamo moves to the device (stacked as data
    # while it traces, core/dynamo_bridge.py). Not a replica's: its programs run together with
    # the other replicas' (whose fills may differ), and running one would pass its turn to them
    # in the middle of a Dynamo trace, whose "compiling" flag is the process's.
    runs_side_programs = True
    # Whether its programs take the lifted scalars packed in one vector (a replicas' program,
    # whose inputs are the replicas' values stacked), or one input each (compile.scalar_avals).
    packs_scalars = False
    spmd_ended = False  # set when SPMD ends: its programs' outputs span the mesh (gather)

    def __init__(self):
        self.meetings: dict = {}  # tag -> rendezvous held with the other processes so far

    local_ordinal = 0
    local_world_size = 1
    home_index = 0  # the N of the xla:N that ``torch_xla.device()`` and ``device='xla'`` name
    names = XLA_DEVICES  # a tensor's device by its value's device index (graph.Node.device)

    def index_of(self, index: int | None) -> int:
        """The device index a node records for ``xla:index`` (None: the home device)."""
        return self.home_index if index is None else index

    world_size = property(lambda self: jax.process_count())  # the job's processes, one per host
    ordinal = property(lambda self: jax.process_index())

    spans = ""  # what xla:0 stands for, where it is the only xla device
    follows_spmd_variable = True  # XLA_USE_SPMD switches it to SPMD and back (runtime.is_spmd)
    mesh_key = None  # the SPMD mesh's device ids, in compile-cache keys: none here

    def device_count(self) -> int:
        """How many xla devices the process has: one per device it drives."""
        return len(self.local_devices())

    def by_device(self, items: list, ref_of: Callable) -> list:
        """``items`` grouped by the xla device of their value (``ref_of(item)``), in first-use
        order: [(device, items)]; one group while every tensor is on xla:0, or where the process
        has one xla device (under SPMD, in a replica)."""
        if not SEVERAL_DEVICES or self.device_count() == 1:
            return [(0, items)]
        groups: dict = {}
        for item in items:
            groups.setdefault(ref_of(item)[0].device or 0, []).append(item)
        return list(groups.items())

    def use_device(self, index: int | None) -> torch.device:
        """``xla:index`` (None: the home device), checked to exist; tracing finds each op's
        device from then on."""
        index = self.home_index if index is None else index
        count = self.device_count()
        if not 0 <= index < count:
            names = "xla:0" if count == 1 else f"xla:0 to xla:{count - 1}"
            raise IndexError(f"xla:{index}: this process's xla devices are {names}{self.spans}")
        if index and not SEVERAL_DEVICES:
            SEVERAL_DEVICES.append(index)
        return XLA_DEVICES[index]

    def landing_on(self, device: int):
        """Where new data on xla:``device`` lands."""
        return SingleDeviceSharding(jax.local_devices()[device]) if device else self.landing

    def stage(self, host: np.ndarray, device: int = 0):
        """A host value copied to xla:``device``, uploaded where new data lands there."""
        return transfer.upload(host, self.landing_on(device))

    def gather(self, program: Program) -> list:
        """The program's inputs on its devices (data still on the host uploaded; data on
        another xla device copied over, as ``.to('xla:1')`` asked, and so is data an SPMD
        program left over the mesh, once SPMD has ended: the leaf keeps the copy)."""
        arrays = [placement.resolve(node, i) for node, i in program.leaves]
        if SEVERAL_DEVICES or self.spmd_ended:
            target = jax.local_devices()[program.device]
            for k, (a, (node, i)) in enumerate(zip(arrays, program.leaves)):
                if a.devices() != {target}:
                    arrays[k] = jax.device_put(a, target)
                    if self.spmd_ended and node.op == DATA:
                        node.arrays[i] = arrays[k]
        return arrays

    def execute(self, run: Run) -> list:
        return execute(run)

    def lowered(self, program: Program, arrays: list, every_input: bool = False):
        """``program`` lowered as this mode runs it, nothing compiled (the debug views')."""
        return compiler.lowered(program, arrays, every_input)

    def run(
        self, program: Program, donate: bool, out_shardings: tuple | None = None, written=None
    ) -> list:
        """Compute a linearised graph (``run.Run.of`` says what ``donate`` gives up; ``written``:
        per output, its ref and the storages it will be bound to)."""
        try:
            with counters.timed("GatherTime"):
                arrays = self.gather(program)
            if program.device:  # outputs on xla:N even when no input says so (factories)
                here = self.landing_on(program.device)
                out_shardings = tuple(
                    s or here for s in out_shardings or [None] * len(program.outputs)
                )
            return self.execute(Run.of(program, arrays, donate, out_shardings, written))
        except RuntimeError as error:
            transfer.raise_if_given_up(error)
            raise

    def read(self, refs: list, layouts: dict | None, sync: Callable) -> None:
        """Compute the pending ``refs`` (each once), leaving each value on its node; ``layouts``
        maps (id(node), index) to an output's layout; ``sync`` runs everything pending."""
        for device, group in self.by_device(refs, lambda ref: ref):
            shardings = None if not layouts else tuple(layouts.get((id(n), i)) for n, i in group)
            program = linearize(group, device)
            for (node, index), array in zip(group, self.run(program, False, shardings)):
                node.keep(index, array)

    def collective_axis(self, api: str) -> str | None:
        """The mesh axis replica collectives span: none in a world of one, or one of one device
        (``XLA_ALWAYS_ALLREDUCE``)."""
        if self.world_size > 1:
            raise NotImplementedError(
                f"xm.{api} across {self.world_size} hosts outside launch/spawn: in the SPMD "
                "model collectives come from sharding; mark tensors over a global mesh instead"
            )
        return self.alone_axis if config.ALWAYS_ALLREDUCE.read() else None

    def rendezvous(self, tag: str, payload, ordinals: list) -> list:
        """Every process's payload, in process order (each host is one, as in PyTorch/XLA)."""
        members = sorted(set(ordinals) or range(self.world_size))
        payloads, others = {self.ordinal: payload}, set(members) - {self.ordinal}
        if others:
            self.meetings[tag] = count = self.meetings.get(tag, 0) + 1
            payloads = across_hosts(f"{tag}/{count}", payloads, others)
        return [payloads[k] for k in members]

    def away(self) -> contextlib.AbstractContextManager:
        """Around a wait for something outside the program (a loader's next batch)."""
        return contextlib.nullcontext()

    def local_devices(self) -> list:
        return jax.local_devices()

    def refuse_per_replica(self, what: str, hint: str = "") -> None:
        """Raise if ``what`` cannot run in a replica of launch."""

    def with_spmd(self) -> SpmdMesh:
        return SpmdMesh()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world of {self.world_size})"


class SpmdMesh(PerDevice):
    """Programs run over every device, partitioned by GSPMD as tensors are marked; uploads land
    replicated, and data already on one device is replicated the first time a program reads it
    (PyTorch/XLA's one-time replication when SPMD starts)."""

    input_key = staticmethod(_inputs_by_layout)
    alone_axis = None  # a program spans every device: a one-device collective has no place

    @functools.cached_property
    def replicated(self) -> NamedSharding:
        """Replicated over every device JAX sees, found on first use: ``XLA_USE_SPMD=1`` at import
        starts no device work (a DataLoader worker imports spmd_torch too)."""
        return NamedSharding(Mesh(np.array(jax.devices()), ("devices",)), PartitionSpec())

    @property
    def landing(self) -> NamedSharding:
        return self.replicated

    @functools.cached_property
    def mesh_key(self) -> tuple:
        """A program over the mesh is another executable than the same one on one device, even
        with no input telling them apart (a factory's)."""
        return tuple(d.id for d in self.replicated.mesh.devices.flat)

    def __repr__(self) -> str:
        return f"SpmdMesh({self.replicated.num_devices} devices)"

    spans = " (in SPMD mode xla:0 spans every device: shard tensors over them with a mesh)"

    def device_count(self) -> int:
        return 1

    def stage(self, host: np.ndarray, device: int = 0) -> transfer.HostData:
        """Kept on the host: a ``mark_sharding`` may come next, uploading only each shard
        (PyTorch/XLA's virtual device, whose use it counts)."""
        counters.bump("VirtualDeviceUsage")
        return transfer.HostData(host, self.replicated)

    def gather(self, program: Program) -> list:
        """The inputs on the mesh: host-held data uploaded and every single-device array
        replicated onto it, once (the leaf keeps the replicated array)."""
        arrays = []
        for node, i in program.leaves:
            array = node.arrays[i]
            if type(array) is transfer.HostData:
                array = node.arrays[i] = transfer.upload(array.host, self.replicated)
            elif array.sharding.num_devices != self.replicated.num_devices:
                array = node.arrays[i] = jax.device_put(array, self.replicated)
            arrays.append(array)
        return arrays


class Replica(PerDevice):
    """A replica of ``launch``: a thread tracing its own graph on its own device, standing for one
    process of PyTorch/XLA's multiprocessing. Its world runs all replicas' runs as one program."""

    input_key = staticmethod(_inputs_by_layout)  # the replicas' inputs, stacked over their mesh
    # Replicas' numbers differ by ordinal (``x * ordinal``): which of them are equal must not part
    # their programs, which run as one (with collectives, nothing else may run).
    shares_equal_scalars = False
    runs_side_programs = False
    packs_scalars = True

    def __init__(self, world, ordinal: int, cpu_rng, named_by_ordinal: bool = False):
        super().__init__()
        self.world = world  # replicas.World
        self.index = ordinal
        self.cpu_rng = cpu_rng  # its torch CPU RNG state, carried with its turn
        self.landing = transfer.OnReplica(world.mesh.devices.flat[ordinal])
        if named_by_ordinal:  # PyTorch/XLA's CPU threads: thread N on xla:N
            self.home_index = self.local_ordinal
            self.names = _Named(XLA_DEVICES[self.home_index])
            if self.home_index and not SEVERAL_DEVICES:
                SEVERAL_DEVICES.append(self.home_index)  # tensors look up their device's name

    def index_of(self, index: int | None) -> int:
        """0, whatever its device's name: the graph knows the replica's one device as 0."""
        return 0

    ordinal = property(lambda self: self.index)  # numbered across every host's replicas
    local_ordinal = property(lambda self: self.world.local.index(self.index))
    world_size = property(lambda self: self.world.size)
    local_world_size = property(lambda self: len(self.world.local))

    def use_device(self, index: int | None) -> torch.device:
        """Its one device, ``xla:0`` or (named by ordinal) ``xla:N``; tensors carry that N."""
        if index is not None and index != self.home_index:
            raise IndexError(
                f"xla:{index}: this process's xla devices are xla:{self.home_index}{self.spans}"
            )
        return XLA_DEVICES[self.home_index]

    def landing_on(self, device: int):
        return self.landing  # whatever N its tensors carry

    def gather(self, program: Program) -> list:
        """Its blocks as they are: the world stacks them (an earlier output's stay whole)."""
        return [node.arrays[i] for node, i in program.leaves]

    def execute(self, run: Run) -> list:
        return self.world.wait(self, run)

    def lowered(self, program: Program, arrays: list, every_input: bool = False):
        """The one program every replica runs (its collectives span them), this replica's
        inputs standing for each's."""
        return compiler.lowered(program, arrays, every_input, self.world.mesh)

    def read(self, refs: list, layouts: dict | None, sync: Callable) -> None:
        """A barrier first: its collectives need every replica, and the others' programs then
        match; what is left (views of its results) runs on its own device."""
        sync()
        missing = [ref for ref in refs if not ref[0].is_leaf(ref[1])]
        if missing:
            program = linearize(missing)
            outputs = self.world.run_alone(self, Run.of(program, self.gather(program), False))
            for (node, index), array in zip(missing, outputs):
                node.keep(index, array)

    def collective_axis(self, api: str) -> str:
        return REPLICA_AXIS

    def rendezvous(self, tag: str, payload, ordinals: list) -> list:
        return self.world.rendezvous(self, tag, payload, ordinals)

    def away(self) -> contextlib.AbstractContextManager:
        return self.world.stepped_away(self)  # the other replicas run meanwhile

    spans = " (a replica of launch/spawn owns one device)"
    follows_spmd_variable = False  # a replica is never in SPMD mode, whatever the process says

    def local_devices(self) -> list:
        return [self.landing.device]

    def refuse_per_replica(self, what: str, hint: str = "") -> None:
        hint = hint or "a replica owns one device; shard over a mesh from one process instead"
        raise RuntimeError(f"{what} inside replica {self.ordinal} of launch/spawn: {hint}")

    def with_spmd(self) -> SpmdMesh:
        self.refuse_per_replica("SPMD mode (use_spmd, mark_sharding)")


class _Named(dict):
    """A replica's one device, by whatever index: its nodes record 0, its tensors show xla:N."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __missing__(self, index) -> torch.device:
        return self.device


def use_spmd() -> None:
    """Run every later program of the calling engine over every device; ``XLA_USE_SPMD=1`` tells
    scripts and subprocesses, as PyTorch/XLA sets it."""
    own = engine.current()
    own.mode = own.mode.with_spmd()
    os.environ["XLA_USE_SPMD"] = "1"


def in_spmd() -> bool:
    """Whether the calling engine runs its programs over the SPMD mesh. ``XLA_USE_SPMD`` is
    PyTorch/XLA's switch, read where it asks: a script that sets or deletes it turns SPMD on or
    off here (a replica of ``launch`` is never in SPMD mode)."""
    own = engine.current()
    wanted = config.USE_SPMD.read()
    if own.mode.follows_spmd_variable and wanted != (own.mode.replicated is not None):
        if wanted:
            use_spmd()
        else:
            own.mode = own.home
            own.mode.spmd_ended = True
    return own.mode.replicated is not None


def ensure_spmd() -> None:
    """SPMD mode, turned on if it is not yet: what sharding a tensor does, as in PyTorch/XLA."""
    if not in_spmd():
        use_spmd()


def refuse_in_spmd(what: str, error: type[Exception] = RuntimeError) -> None:
    """Raise ``error`` naming ``what`` (which cannot run over the SPMD mesh) if SPMD is on."""
    if in_spmd():
        raise error(what)


# The default engine's home mode: the modes sit above the engine's state, as JAX's traces do.
engine.DEFAULT.home = engine.DEFAULT.mode = PerDevice()
