"""torch_xla.debug.profiler on JAX's profiler: what the host and the devices did, step by step,
for TensorBoard's profile plugin or Perfetto.

Two ways to capture, as in PyTorch/XLA:

- in the process: ``start_trace(logdir)`` ... ``stop_trace()``;
- from a profiler server: ``start_server(port)`` in the training process, then
  ``trace('localhost:port', logdir, duration_ms)`` from anything that reaches the port (another
  process, a thread, TensorBoard's "capture profile" button). xprof's client (the ``profile``
  extra; ``python -m jax.collect_profile`` uses it too) asks the server JAX runs, which writes the
  capture itself.

Either way a capture is ``<logdir>/plugins/profile/<run>/<host>.xplane.pb`` (TensorBoard's profile
plugin, ``tensorboard --logdir <logdir>``) and ``<host>.trace.json.gz`` beside it (Chrome trace
events: ui.perfetto.dev opens it).

``Trace(name)`` marks a host region and also names the ops recorded inside it: they are lowered
under ``jax.named_scope`` and carry ``<names>/<aten op>`` in their HLO ``op_name``. ``StepTrace``
marks one training step and ends with the barrier; a ``MpDeviceLoader`` iterated around it then
skips its own. The device program of a barrier is the XLA module ``jit_SyncTensorsGraph_<key>``,
``<key>`` the hex digest the ``PT_XLA_DEBUG_LEVEL`` line prints.
"""

from __future__ import annotations

import errno
import functools
import gzip
import json
import os
import pathlib
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import jax

import spmd_torch.core.xla_model as xm
from spmd_torch._lazy import engine as _engine

__all__ = [
    "ProfilerServer",
    "StepTrace",
    "Trace",
    "get_tracer_marked_step",
    "set_tracer_marked_step",
    "start_server",
    "start_trace",
    "stop_trace",
    "trace",
    "trace_detached",
    "trace_me",
]

_F = TypeVar("_F", bound=Callable[..., Any])

_RETRY_CODES = ("UNAVAILABLE", "ALREADY_EXISTS")  # worth another attempt: nothing collected, busy


# ---- the step the tracer marked -----------------------------------------------------------------


def set_tracer_marked_step(value: bool) -> None:
    """Say whether a ``StepTrace`` has issued (or is about to issue) this step's barrier.

    ``StepTrace`` sets it on entry; a ``MpDeviceLoader``/``PerDeviceLoader`` reads and clears it
    in ``next()``, skipping its own barrier once. Per engine, so each replica of ``launch`` keeps
    its own.

    Args:
        value: True when the step's barrier is the tracer's.

    Example:
        >>> xp.set_tracer_marked_step(False)
        >>> xp.get_tracer_marked_step()
        False
    """
    _engine.current().marked_step = bool(value)


def get_tracer_marked_step() -> bool:
    """Whether a ``StepTrace`` issues this step's barrier (see :func:`set_tracer_marked_step`).

    Example:
        >>> with xp.StepTrace('train_step'):
        ...     xp.get_tracer_marked_step()
        True
    """
    return _engine.current().marked_step


# ---- capturing from a server --------------------------------------------------------------------


class ProfilerServer:
    """The profiler server :func:`start_server` started, listening on ``port``.

    It serves captures until :meth:`stop` is called or this object is garbage collected, as the
    object PyTorch/XLA's ``start_server`` returns: keep a reference while you want to be profiled.

    Example:
        >>> server = xp.start_server(9012)
        >>> server.port
        9012
        >>> server.stop()
    """

    def __init__(self, port: int) -> None:
        self.port = port
        try:
            jax.profiler.start_server(port)
        except ValueError as error:  # JAX runs one server per process
            raise RuntimeError(
                f"start_server({port}): a profiler server is already running in this process; "
                "stop it (server.stop()) or drop the object start_server returned first"
            ) from error
        self._stop = weakref.finalize(self, jax.profiler.stop_server)

    def stop(self) -> None:
        """Stop serving captures (a second call does nothing).

        Example:
            >>> server.stop()
        """
        self._stop()


def start_server(port: int, only_on_master: bool = True) -> ProfilerServer | None:
    """Start a profiler server on ``port``, so that :func:`trace` or TensorBoard's profile plugin
    can capture this process while it runs.

    Args:
        port: The TCP port to serve on (every interface, as PyTorch/XLA's server does).
        only_on_master: Start it only on the master ordinal (``xm.is_master_ordinal()``); other
            replicas get ``None``.

    Returns:
        The :class:`ProfilerServer`; the server stops when it is garbage collected. ``None`` on a
        replica that is not the master when ``only_on_master``.

    Raises:
        RuntimeError: ``port`` is not a port number, or is in use, or this process already runs a
            profiler server.

    Example:
        >>> server = xp.start_server(9012)
        >>> # elsewhere: xp.trace('localhost:9012', '/tmp/profile', duration_ms=2000)
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise RuntimeError(f"start_server: port must be an int in 1..65535, got {port!r}")
    if only_on_master and not xm.is_master_ordinal():
        return None
    _check_port_free(port)
    return ProfilerServer(port)


def _check_port_free(port: int) -> None:
    """Fail now if ``port`` is taken: JAX's server would only log that it could not bind."""
    families = [(socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")]
    for family, host in families if socket.has_ipv6 else families[1:]:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
            return
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise RuntimeError(
                    f"start_server: port {port} is already in use; pick a free port"
                ) from error
    raise RuntimeError(f"start_server: cannot bind port {port} on this machine")


def trace(
    service_addr: str,
    logdir: str | os.PathLike,
    duration_ms: int = 1000,
    num_tracing_attempts: int = 3,
    host_tracer_level: int = 2,
    device_tracer_level: int = 1,
    delay_ms: int = 0,
    timeout_s: float = 120,
    interval_s: float = 5,
) -> None:
    """Capture ``duration_ms`` of a running process from its profiler server into ``logdir``;
    blocks until the capture is written.

    The server writes ``<logdir>/plugins/profile/<run>/<host>_<port>.xplane.pb`` (both sides must
    reach ``logdir``: on one machine, any path). Where this process can read it too, a
    ``.trace.json.gz`` for Perfetto is written beside it.

    Args:
        service_addr: ``host:port`` of a server (:func:`start_server`), or several, separated by
            commas, captured over the same window.
        logdir: The TensorBoard log directory to write the capture under.
        duration_ms: How long to capture.
        num_tracing_attempts: How many captures to try when a server is not reachable yet or
            collected nothing.
        host_tracer_level: Host events recorded: 1 critical only, 2 info, 3 verbose.
        device_tracer_level: Device events recorded: 0 none, 1 all.
        delay_ms: Start capturing this long after the request.
        timeout_s: Stop retrying once this long has passed since the first attempt.
        interval_s: Wait this long between attempts.

    Raises:
        RuntimeError: No server captured anything (the reason of each attempt is in the message),
            an argument is invalid, or xprof (the ``profile`` extra) is not installed.

    Example:
        >>> server = xp.start_server(9012)
        >>> xp.trace_detached('localhost:9012', '/tmp/profile', duration_ms=2000)
        >>> train(steps=20)  # tensorboard --logdir /tmp/profile
    """
    addresses = _addresses(service_addr)
    for name, value, least in (
        ("duration_ms", duration_ms, 1),
        ("num_tracing_attempts", num_tracing_attempts, 1),
        ("host_tracer_level", host_tracer_level, 0),
        ("device_tracer_level", device_tracer_level, 0),
        ("delay_ms", delay_ms, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise RuntimeError(f"trace: {name} must be an int >= {least}, got {value!r}")
    capture = _xprof_trace()
    logdir = os.fspath(logdir)
    if "://" not in logdir:  # a server in another directory reads a relative path otherwise
        logdir = os.path.abspath(logdir)
    run = time.strftime("%Y_%m_%d_%H_%M_%S")
    options = {
        "host_tracer_level": host_tracer_level,
        "device_tracer_level": device_tracer_level,
        "delay_ms": delay_ms,
        "session_id": run,  # the run directory, so that the files written can be found
    }
    give_up_at = time.monotonic() + timeout_s
    reasons = []
    for attempt in range(1, num_tracing_attempts + 1):
        try:  # one attempt each: the wait between attempts and the deadline are ours
            capture(",".join(addresses), logdir, "", False, duration_ms, 1, options)
        except RuntimeError as error:  # xprof's status: 'UNAVAILABLE: No trace event was ...'
            reasons.append(f"attempt {attempt}: {error}")
            retry = str(error).partition(":")[0] in _RETRY_CODES
            if not retry or time.monotonic() + interval_s > give_up_at:
                break
            if attempt < num_tracing_attempts:
                time.sleep(interval_s)
            continue
        run_dir = pathlib.Path(logdir, "plugins", "profile", run)
        xplanes = {a: run_dir / f"{_host_name(a)}.xplane.pb" for a in addresses}
        written = {a for a, path in xplanes.items() if path.is_file()}
        for address in addresses:
            if address in written:
                _write_trace_json(xplanes[address])
            elif written:  # logdir is in this process's reach, and this server wrote nothing
                warnings.warn(
                    f"trace: {address} captured nothing (no {xplanes[address].name} in "
                    f"{run_dir}; xprof's log on stderr says why)",
                    stacklevel=2,
                )
        return
    raise RuntimeError(f"trace: no profile captured from {service_addr}: " + " | ".join(reasons))


def trace_detached(*args: Any, **kwargs: Any) -> threading.Thread:
    """:func:`trace` on a background thread, so the training loop goes on while it captures.

    Args:
        *args: :func:`trace`'s arguments.
        **kwargs: :func:`trace`'s keyword arguments.

    Returns:
        The started thread (``join()`` it to wait for the capture to be written).

    Example:
        >>> server = xp.start_server(9012)
        >>> capture = xp.trace_detached('localhost:9012', '/tmp/profile', duration_ms=2000)
        >>> train(steps=20)
        >>> capture.join()
    """
    thread = threading.Thread(target=trace, args=args, kwargs=kwargs, name="profiler-trace")
    thread.start()
    return thread


def _addresses(service_addr: str) -> list[str]:
    addresses = (
        [a.strip() for a in service_addr.split(",")] if isinstance(service_addr, str) else []
    )
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise RuntimeError(
                f"trace: service_addr must be 'host:port' (several separated by commas), got "
                f"{service_addr!r}"
            )
    if not addresses:
        raise RuntimeError(
            f"trace: service_addr must be a 'host:port' string, got {service_addr!r}"
        )
    return addresses


def _host_name(address: str) -> str:
    """The file name a server gives its capture: its address, ``localhost_9012``."""
    return address.replace(":", "_")


def _xprof_trace() -> Callable[..., None]:
    """xprof's capture client, imported when a capture is asked for: it loads a large library."""
    try:
        import xprof.convert._pywrap_profiler_plugin as plugin
    except ImportError as error:
        raise RuntimeError(
            "trace: capturing from a profiler server needs the xprof package (pip install "
            "'spmd_torch[profile]'); in-process captures (start_trace/stop_trace) do not"
        ) from error
    return plugin.trace


def _write_trace_json(xplane: pathlib.Path) -> None:
    """``<host>.trace.json.gz`` beside a capture a server wrote: the Chrome trace events Perfetto
    opens, as ``start_trace`` writes for its own captures."""
    profile = jax.profiler.ProfileData.from_file(str(xplane))
    events: list[dict] = []
    for pid, plane in enumerate(profile.planes):
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": plane.name}})
        for tid, line in enumerate(plane.lines):
            name = {"name": line.name}
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": name})
            events += [
                {
                    "ph": "X",
                    "pid": pid,
                    "tid": tid,
                    "ts": event.start_ns / 1e3,
                    "dur": event.duration_ns / 1e3,
                    "name": event.name,
                    "args": {key: str(value) for key, value in event.stats},
                }
                for event in line.events
            ]
    path = xplane.with_name(xplane.name.removesuffix(".xplane.pb") + ".trace.json.gz")
    with gzip.open(path, "wt") as out:  # dumps, not dump: dump encodes in Python, token by token
        out.write(json.dumps({"displayTimeUnit": "ns", "traceEvents": events}))


# ---- capturing in the process -------------------------------------------------------------------


def start_trace(
    log_dir: str | os.PathLike,
    *,
    host_tracer_level: int = 2,
    python_tracer_level: int = 0,
    create_perfetto_trace: bool = False,
) -> None:
    """Start capturing this process (host and devices) until :func:`stop_trace`.

    Programs already running finish first, so that the capture holds whole programs only (the
    tail of an earlier step would show as a run of its own). Only one capture runs at a time.
    TensorBoard need not be running.

    Args:
        log_dir: The TensorBoard log directory the capture is written under
            (``<log_dir>/plugins/profile/<run>/``).
        host_tracer_level: Host events recorded: 1 critical only, 2 info, 3 verbose.
        python_tracer_level: 1 also records every Python function call (large and slow on a
            traced training step; PyTorch/XLA records none either).
        create_perfetto_trace: Also write ``perfetto_trace.json.gz`` (the trace events without
            the metadata Perfetto's importer rejects).

    Raises:
        RuntimeError: A capture is already running.

    Example:
        >>> xp.start_trace('/tmp/profile')
        >>> train(steps=3)
        >>> xp.stop_trace()
    """
    xm.wait_device_ops()
    options = jax.profiler.ProfileOptions()
    options.host_tracer_level = host_tracer_level
    options.python_tracer_level = python_tracer_level
    jax.profiler.start_trace(
        os.fspath(log_dir), create_perfetto_trace=create_perfetto_trace, profiler_options=options
    )


def stop_trace() -> None:
    """Wait for the programs in flight, then stop the capture and write it to its ``log_dir``.

    Raises:
        RuntimeError: No capture is running.

    Example:
        >>> xp.start_trace('/tmp/profile')
        >>> train(steps=3)
        >>> xp.stop_trace()  # tensorboard --logdir /tmp/profile
    """
    xm.wait_device_ops()  # the last step's program belongs in the capture
    jax.profiler.stop_trace()


# ---- naming what is captured --------------------------------------------------------------------


class Trace(jax.profiler.TraceAnnotation):
    """A named host region in captures; the ops recorded inside it are named after it too.

    On the host timeline the region spans the ``with`` block. Every op recorded inside is lowered
    under the region's name, so the program's HLO ``op_name`` reads
    ``jit(SyncTensorsGraph_<key>)/<outer>/<name>/<aten op>/...`` and a capture's device ops, HLO
    dumps and TensorBoard's op profile group under it. The names are part of the program: a step
    traced under the same regions reuses its compiled program; other names compile another.

    Args:
        name: The region's name.
        **kwargs: Values shown with the region in the trace viewer (``batch=3``).

    Example:
        >>> with xp.Trace('attn'):
        ...     y = attention(x)
        >>> xm.mark_step()
    """

    def __init__(self, name: str, **kwargs: Any) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"Trace: name must be a non-empty str, got {name!r}")
        self.name = name
        self._outer_scope: str | None = None
        self._is_open = False
        super().__init__(name, **kwargs)

    def __enter__(self) -> Trace:
        own = _engine.current()
        self._outer_scope = outer = own.scope
        own.scope = self.name if outer is None else f"{outer}/{self.name}"
        own.regions.append((f"{self.name}.{own.next_region}", own.next_region + 1))
        own.next_region, self._is_open = 1, True
        return super().__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        self._close(_engine.current())
        super().__exit__(*exc_info)

    def _close(self, own: _engine.Engine) -> None:
        if self._is_open:  # a StepTrace closes itself before its barrier
            self._is_open = False
            own.scope = self._outer_scope
            own.next_region = own.regions.pop()[1]


class StepTrace(Trace):
    """One training step in captures (TensorBoard's step-time analysis), ending with its barrier.

    A :class:`Trace` that TensorBoard treats as a step, and at exit issues ``xm.mark_step()``
    inside the region, so the step's compile and dispatch belong to it. A ``MpDeviceLoader``
    iterated around it then skips its own barrier for that step: one program per step, not two.

    Args:
        name: The steps' name (the same for every step: it names the program's ops).
        **kwargs: ``step_num=`` the step's number, and any values to show with it.

    Example:
        >>> for step, (x, y) in enumerate(train_device_loader):
        ...     with xp.StepTrace('train_step', step_num=step):
        ...         loss = loss_fn(model(x), y); loss.backward(); optimizer.step()
    """

    def __init__(self, name: str, **kwargs: Any) -> None:
        super().__init__(name, _r=1, **kwargs)

    def __enter__(self) -> StepTrace:
        set_tracer_marked_step(True)
        return super().__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        self._close(_engine.current())  # the barrier records nothing of the step's
        try:
            xm.mark_step()
        finally:
            super().__exit__(*exc_info)


def trace_me(scope: str) -> Callable[[_F], _F]:
    """Decorator: each call of the function runs inside ``Trace(scope)``.

    Args:
        scope: The region's name.

    Example:
        >>> @xp.trace_me('loss')
        ... def compute_loss(logits, labels):
        ...     return F.cross_entropy(logits, labels)
    """

    def decorate(function: _F) -> _F:
        @functools.wraps(function)
        def traced(*args: Any, **kwargs: Any) -> Any:
            with Trace(scope):
                return function(*args, **kwargs)

        return traced  # type: ignore[return-value]

    return decorate
