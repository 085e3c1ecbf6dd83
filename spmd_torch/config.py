"""Every environment variable spmd_torch reads, declared once, with one parser for each kind.

A flag that changes the compiled program says so with ``in_cache_key``: its value is part of the
compile-cache key, so flipping it recompiles instead of reusing a program built for another value.
``value`` is read when spmd_torch is imported; ``read()`` reads the environment again, for the
variables PyTorch/XLA reads at each use.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

TRUE_WORDS = ("1", "on", "yes", "true", "y")
FALSE_WORDS = ("0", "off", "no", "false", "n", "")


def parse(text: str, kind: type, name: str) -> object:
    """``text`` as ``kind``; booleans read on/off words and integers (``'2'``: on, as
    PyTorch/XLA's runtime reads its switches). Bad text raises an error naming the variable;
    every switch spmd_torch declares is read through here."""
    try:
        if kind is bool:
            word = text.strip().lower()
            return word in TRUE_WORDS if word in TRUE_WORDS + FALSE_WORDS else bool(int(word))
        return kind(text)
    except ValueError:
        kind_name = getattr(kind, "__name__", kind)
        raise ValueError(
            f"environment variable {name}={text!r} is not a valid {kind_name}"
        ) from None


@dataclass
class Flag:
    name: str
    default: object
    help: str
    kind: type
    in_cache_key: bool = False
    value: object = None
    aliases: tuple = ()  # older names of the same switch (the lazy-tensor-core guide's LTC_*)

    def read(self) -> object:
        """The variable's value in the environment now (its default when unset)."""
        raw = next((os.environ[n] for n in (self.name, *self.aliases) if n in os.environ), None)
        if raw is None:
            return self.default
        return parse(raw, self.kind, self.name)


FLAGS: dict[str, Flag] = {}


def _flag(
    name: str,
    default: object,
    help: str,
    kind: type | None = None,
    in_cache_key: bool = False,
    aliases: tuple = (),
) -> Flag:
    flag = Flag(name, default, help, kind or type(default), in_cache_key, aliases=aliases)
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
    "PyTorch/XLA's debugging tool: 1, a Compilation Analysis (cause, recompilation reason, graph, "
    "the user's frames) per compile; 2 and up, an Execution Analysis per program run too.",
)
DEBUG_TOOL = _flag(
    "PT_XLA_DEBUG",
    False,
    "The debugging tool in full (PT_XLA_DEBUG_LEVEL 100 unless that is set), and the metrics "
    "analysis (pt-xla-profiler: too-frequent compiles and host reads, ops not lowered, each with "
    "the user's file:line) at each barrier that changes it and at exit.",
)
if DEBUG_TOOL.value and "PT_XLA_DEBUG_LEVEL" not in os.environ:
    DEBUG_LEVEL.value = 100  # PyTorch/XLA's default once PT_XLA_DEBUG is on
DEBUG_FILE = _flag(
    "PT_XLA_DEBUG_FILE",
    None,
    "Append the debugging tool's output to this file instead of printing it to stderr.",
    kind=str,
)
DEBUG_MAX_FRAME = _flag(
    "PT_XLA_DEBUG_MAX_FRAME", 8, "How many of the user's Python frames an analysis lists."
)
IR_DEBUG = _flag(
    "XLA_IR_DEBUG",
    False,
    "Record each node's Python traceback: the IR text names the user's file:line of each op.",
)
HLO_DEBUG = _flag(
    "XLA_HLO_DEBUG",
    False,
    "As XLA_IR_DEBUG, and the tracebacks become each HLO op's source metadata (file and line).",
    in_cache_key=True,
)
if HLO_DEBUG.value:
    IR_DEBUG.value = True  # the metadata comes from the tracebacks it records
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
USE_SPMD = _flag(
    "XLA_USE_SPMD",
    False,
    "SPMD mode from the start (runtime.use_spmd() sets it too, for scripts and subprocesses).",
)
MODELCMP_SAVEDIR = _flag(
    "MODELCMP_SAVEDIR",
    "",
    "debug.model_comparator: where save() writes when configure() named no folder (read each call).",
)
SAVE_TENSORS_FILE = _flag(
    "XLA_SAVE_TENSORS_FILE",
    None,
    "At every barrier append the graph about to run to this file plus '.<ordinal>' (debug.graph).",
    kind=str,
)
SAVE_TENSORS_FMT = _flag(
    "XLA_SAVE_TENSORS_FMT",
    "text",
    "XLA_SAVE_TENSORS_FILE's format: 'text' (the graph's op lines) or 'hlo' (StableHLO text).",
)
DUMP_POST_OPTIMIZATIONS = _flag(
    "XLA_DUMP_POST_OPTIMIZATIONS",
    False,
    "_get_xla_tensors_hlo returns the compiled HLO: after XLA's passes, SPMD partitioned.",
)
METRICS_FILE = _flag(
    "XLA_METRICS_FILE",
    None,
    "Append the metrics report to this file at every barrier ('STDOUT'/'STDERR' print it).",
    kind=str,
)
PJRT_DEVICE = _flag(
    "PJRT_DEVICE",
    None,
    "PyTorch/XLA's device kind ('CPU', 'CUDA', 'TPU'...): picks JAX's platform at start-up.",
    kind=str,
)
CPU_NUM_DEVICES = _flag(
    "CPU_NUM_DEVICES",
    None,
    "PyTorch/XLA's count of CPU devices: on the CPU platform, how many JAX's CPU backend makes.",
    kind=int,
)
COORDINATOR_ADDRESS = _flag(
    "SPMD_TORCH_COORDINATOR_ADDRESS",
    None,
    "host:port of process 0's coordinator, for a job of several processes (one per host).",
    kind=str,
)
NUM_PROCESSES = _flag(
    "SPMD_TORCH_NUM_PROCESSES", None, "The job's process count (with the coordinator).", kind=int
)
PROCESS_ID = _flag(
    "SPMD_TORCH_PROCESS_ID",
    None,
    "This process's id in [0, processes) (with the coordinator).",
    kind=int,
)
INIT_TIMEOUT_S = _flag(
    "SPMD_TORCH_INIT_TIMEOUT_S",
    300,
    "Seconds the processes of a job wait for each other at start-up before failing.",
)
HEARTBEAT_TIMEOUT_S = _flag(
    "SPMD_TORCH_HEARTBEAT_TIMEOUT_S",
    100,
    "Seconds without a heartbeat after which a process of the job counts as dead and the job ends.",
)
SHUTDOWN_TIMEOUT_S = _flag(
    "SPMD_TORCH_SHUTDOWN_TIMEOUT_S",
    300,
    "Seconds a process that finished waits at exit for the others before failing.",
)
LOOPBACK = _flag(
    "SPMD_TORCH_LOOPBACK",
    False,
    "Keep the coordinator and CPU collectives of a multi-process job on 127.0.0.1 (one machine).",
)
FREEZE_HEAP = _flag(
    "SPMD_TORCH_FREEZE_HEAP",
    True,
    "gc.freeze() what import made, and once warm-up ends (a compiled program runs again) collect "
    "and freeze the Python heap and collect the young generation every 50,000 net allocations "
    "instead of 700.",
)
AUTO_CAPTURE = _flag(
    "SPMD_TORCH_AUTO_CAPTURE",
    False,
    "Automatic capture (opt-in): once a lazy training step repeats, the forward of each module "
    "called from user code and each optimizer.step run through torch.compile's spmd_torch "
    "backend, falling back to lazy tracing where Dynamo breaks or fails (core/auto_capture.py).",
)
COMPILATION_CACHE_SIZE = _flag(
    "XLA_COMPILATION_CACHE_SIZE",
    2048,
    "Compiled programs kept per compile cache, as in PyTorch/XLA; past it the least recently run "
    "is dropped (each holds its machine code: a process that compiles without bound would run "
    "out of memory mappings).",
)
AUTO_CAPTURE_RECOMPILES = _flag(
    "SPMD_TORCH_AUTO_CAPTURE_RECOMPILES",
    4,
    "How many times Dynamo may compile a captured callable again (new shapes, a train/eval or "
    "grad-mode switch, a value a graph break hands on) before it goes back to lazy tracing.",
)
ALWAYS_ALLREDUCE = _flag(
    "XLA_ALWAYS_ALLREDUCE",
    False,
    "In a world of one device, emit each replica collective as an XLA collective over that "
    "device (as with more replicas) instead of leaving it out (read at each collective).",
)
RATE_TRACKER_SMOOTHING = _flag(
    "RATE_TRACKER_SMOOTHING",
    0.4,
    "xm.RateTracker's default weight of the previous rate (read when a tracker is made).",
)
PRINT_DEBUG = _flag(
    "DEBUG",
    0,
    "utils.get_print_fn() prints when this integer is nonzero (read at each call).",
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


@dataclass
class _Face:
    """Whether this process runs under PyTorch/XLA's names (``spmd_torch._as_torch_xla`` turns it
    on, never off): there the few behaviours docs/migration.md lists follow PyTorch/XLA's."""

    on: bool = False


FACE = _Face()
