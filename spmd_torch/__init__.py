"""spmd_torch: PyTorch/XLA programs on any accelerator JAX reaches, traced lazily, sharding-first."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import runtime as _runtime
from ._lazy import config as _config
from ._lazy import device as _device
from ._lazy import engine as _engine
from ._lazy import execute as _execute
from ._lazy import rng as _rng
from ._lazy.tensor import DEVICE as _DEVICE
from .core import xla_model as _xla_model  # it reads this package's names only when called
from .debug import metrics_saver as _metrics_saver
from .distributed import _dtensor_route
from .distributed import xla_multiprocessing as _xmp
from .experimental.eager_mode import eager_mode as _eager_mode
from .experimental.eager_mode import eager_mode_context as _eager_mode_context

_device.register()
_dtensor_route.register()  # DTensor on an 'xla' DeviceMesh reaches spmd_torch.distributed.spmd
if _runtime.is_spmd():  # XLA_USE_SPMD=1 in the environment
    _runtime.use_spmd()
if _config.EAGER.value:  # XLA_USE_EAGER_DEBUG_MODE=1 in the environment
    _eager_mode(True)

__version__ = "0.1.0"


def device(index: int | None = None) -> torch.device:
    """The xla device (``torch.device('xla:0')``); tensors moved there are traced lazily.

    Example:
        >>> dev = spmd_torch.device()
        >>> x = torch.ones(2, 2, device=dev) * 3
    """
    return torch.device(_DEVICE.type, index or 0)


def devices() -> list[torch.device]:
    """The devices a program addresses: one logical device per process in the SPMD model.

    Example:
        >>> spmd_torch.devices()
        [device(type='xla', index=0)]
    """
    return [device()]


def real_devices() -> list[str]:
    """The accelerators behind this process's xla devices, as PyTorch/XLA names them.

    Example:
        >>> spmd_torch.real_devices()
        ['CPU:0']
    """
    return _runtime.xla_real_devices()


def device_count() -> int:
    """The number of xla devices this process addresses: one (the SPMD model's logical device).

    Example:
        >>> spmd_torch.device_count()
        1
    """
    return 1


def sync(wait: bool = False, reset_scope: bool = True) -> None:
    """The barrier: compile (once) and dispatch every pending computation; same as mark_step().

    Then, as in PyTorch/XLA, the step's metrics go to ``XLA_METRICS_FILE`` (if set) and the step
    closures queued by ``xm.add_step_closure`` run.

    Args:
        wait: Block until the dispatched program has finished.
        reset_scope: Accepted for compatibility (PyTorch/XLA's IR scope reset; nothing to reset).

    Example:
        >>> loss = model(x).sum(); loss.backward(); opt.step()
        >>> spmd_torch.sync()
    """
    _execute.sync(wait=wait)
    replica = _engine.current().replica
    if replica is None or replica.ordinal == 0:  # one report per step, from the first replica
        _metrics_saver.save_metrics()
    _xla_model.run_step_closures()


class _Region:
    """One ``compile`` region: its name, its switches and the distinct graphs it produced; a
    context manager, and a decorator whose calls all count towards ``max_different_graphs``."""

    def __init__(self, name: str | None, full_graph: bool, max_different_graphs: int | None):
        if max_different_graphs is not None and max_different_graphs < 1:
            raise ValueError(f"max_different_graphs must be >= 1, got {max_different_graphs}")
        self.name = name
        self.full_graph = full_graph
        self.max_different_graphs = max_different_graphs
        self.graphs: set = set()
        self._open: list = []  # the regions entered with ``with``, innermost last

    def __enter__(self) -> None:
        self._open.append(self.tracing())
        self._open[-1].__enter__()

    def __exit__(self, *exc_info) -> bool | None:
        return self._open.pop().__exit__(*exc_info)

    def __call__(self, f: Callable) -> Callable:
        if self.name is None:
            self.name = getattr(f, "__name__", None) or str(f)

        @functools.wraps(f)
        def compiled(*args: Any, **kwargs: Any) -> Any:
            with self.tracing():
                return f(*args, **kwargs)

        return compiled

    @property
    def label(self) -> str:
        return self.name or "compile"

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """Trace the block lazily as one graph (eager mode off) and run it at the end."""
        with _eager_mode_context(False):
            sync()  # what came before is not part of the region's graph
            one_graph = (
                _execute.one_graph(self.label) if self.full_graph else contextlib.nullcontext()
            )
            try:
                with one_graph:
                    yield
            finally:
                new = None
                if self.max_different_graphs is not None:
                    graph = _execute.pending_signature()
                    new = graph not in self.graphs
                    self.graphs.add(graph)
                sync()
                if new and len(self.graphs) > self.max_different_graphs:
                    raise RuntimeError(
                        f"compile region {self.label!r} traced {len(self.graphs)} different "
                        f"graphs, more than max_different_graphs={self.max_different_graphs}: "
                        "its input shapes or the ops it traces change from call to call"
                    )


def compile(
    f: Callable | None = None,
    full_graph: bool = False,
    name: str | None = None,
    max_different_graphs: int | None = None,
):
    """Trace ``f`` (or the ``with`` block) into one graph, compiled once and run at its end.

    The region syncs before it starts (earlier work is not part of it) and when it ends, and
    traces lazily even in eager mode. As a decorator the region's graphs are counted over all
    calls of ``f``.

    Args:
        f: The function or module to compile; ``None`` gives a context manager (or decorator).
        full_graph: Raise if anything inside needs a program to run before the region ends
            (``.item()``, ``.cpu()``, printing a tensor, an op whose output shape depends on
            data, ``mark_step``); the error names the line.
        name: The region's name in error messages; default ``f``'s name.
        max_different_graphs: Raise when the region has traced more than this many different
            graphs (new input shapes or a different sequence of ops trace a new graph).

    Returns:
        ``f`` compiled, or a context manager when ``f`` is ``None``.

    Example:
        >>> @spmd_torch.compile(full_graph=True)
        ... def step(x):
        ...     return torch.sin(x) + torch.cos(x)
        >>> with spmd_torch.compile():
        ...     y = step(x) * 2
    """
    region = _Region(name, full_graph, max_different_graphs)
    return region if f is None else region(f)


def step() -> contextlib.AbstractContextManager:
    """A training step as a block: syncs before it and runs its one graph at its end.

    Example:
        >>> for x, y in loader:
        ...     with spmd_torch.step():
        ...         loss_fn(model(x), y).backward()
        ...         optimizer.step()
    """
    return compile()


def launch(
    fn: Callable,
    args: tuple = (),
    start_method: str = "spawn",
    debug_single_process: bool = False,
) -> Any:
    """Run ``fn(index, *args)`` once per local device, each replica owning one device.

    The per-device multiprocessing entry point of PyTorch/XLA (``torch_xla.launch``): see
    :func:`spmd_torch.distributed.xla_multiprocessing.spawn`, which it calls with
    ``nprocs=None`` (every local device), or ``nprocs=1`` with ``debug_single_process``.

    Args:
        fn: The function each replica runs; its first argument is the replica's global ordinal.
        args: The other arguments of ``fn``.
        start_method: Accepted for compatibility; replicas are threads of this process.
        debug_single_process: Run a single replica (ordinal 0), for debugging.

    Example:
        >>> def _mp_fn(index, lr):
        ...     model = Net().to(xm.xla_device())
        ...     ...
        >>> spmd_torch.launch(_mp_fn, args=(0.1,))
    """
    nprocs = 1 if debug_single_process else None
    return _xmp.spawn(fn, args=args, nprocs=nprocs, start_method=start_method)


def manual_seed(seed: int, device: torch.device | str | None = None) -> None:
    """Seed the device RNG (``torch.manual_seed`` does this too).

    Args:
        seed: The seed.
        device: Accepted for compatibility: there is one device RNG per process (per replica).

    Example:
        >>> spmd_torch.manual_seed(0)
    """
    _rng.manual_seed(seed)


from . import _XLAC  # noqa: E402, F401  (``torch_xla._XLAC``, after the names it reads are set)
