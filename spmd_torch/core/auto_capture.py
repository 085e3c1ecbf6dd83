"""Automatic capture: an unchanged lazy training loop runs its model's forward and its optimizer's
step through the ``spmd_torch`` torch.compile backend by itself, once its step repeats.

Lazy tracing costs host Python per aten op at every step; a compiled call costs one node. So once
the barrier has run the same program twice in a row (``Program.identity``), each top-level call
of the step (a module on the xla device called by user code rather than by another module's
forward, and ``optimizer.step``) goes through ``torch.compile(..., backend='spmd_torch')`` from
then on. Everything else in the step stays lazily traced, and graph breaks (a ``.item()``, the
breaks ``torch.optim`` asks for) run their parts lazily, as under ``torch.compile``.

Top-level calls are found by PyTorch's global module hooks, which count how deep module calls
nest on each thread, and its global optimizer step pre-hook; nothing is installed while capture
is off, and a module's captured call bypasses the hooks (``Module._compiled_call_impl``, the slot
``Module.compile()`` fills). A callable goes back to lazy tracing for good, with the reason in the
metrics report, when Dynamo or the backend fails on it, or when Dynamo compiles it again more than
``SPMD_TORCH_AUTO_CAPTURE_RECOMPILES`` times (shapes or guards that change from step to step, such
as a value read at a graph break that the rest of the forward branches on).
Callables the user compiled themselves are left alone.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import sysconfig
import threading
import types
import weakref
from typing import Any

import jax
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from spmd_torch import _barrier, config
from spmd_torch._lazy import counters, engine
from spmd_torch.debug import graph, metrics

_WATCHING, _CAPTURED, _LAZY, _LEFT = "watching", "captured", "lazy", "left alone"
# Dynamo folds it to True where it traces our code (the hooks inside a compiled module): there
# the hooks and wrappers below do nothing.
_is_compiling = torch.compiler.is_compiling


class _Thread(threading.local):
    """Per thread, so per engine (each replica of ``launch`` is a thread with its own)."""

    depth = 0  # module calls open on this thread (a captured call counts as one)
    current = None  # the callable whose captured call runs (what a failure is charged to)
    suppressing = None  # Dynamo's suppress_errors before a captured call's compile set it
    seen: dict | None = None  # id(owner) -> _Callable: top-level calls since the last barrier
    engine = None  # the engine of the barrier before, and its step count then
    steps = -1
    compiles = 0  # programs compiled (process-wide) by then
    last = None  # what that step was (the identity of the program that barrier ran)
    armed = False  # the step repeated: capture what it calls


_LOCAL = _Thread()
_CALLABLES: dict[int, _Callable] = {}  # id(module or optimizer) -> its callable, while it lives
_COMPILED: dict = {}  # (kind, class) -> its compiled entry function, shared by every instance
_HOOKS: list = []  # the handles of the hooks auto_capture() installed
_LOCK = threading.Lock()
# Dynamo's, once capture imported it: its errors, counters and graph-break reasons.
_DYNAMO: dict[str, Any] = {"errors": ()}


class _Callable:
    """A top-level module or optimizer seen by the hooks: its state, and why it is in it."""

    def __init__(self, owner: Any, kind: str):
        self.kind = kind  # "forward" or "step"
        self.name = f"{type(owner).__name__}.{kind}"
        self.ref = weakref.ref(owner, functools.partial(_forget, id(owner)))
        self.state = _WATCHING
        self.reason = ""  # why it is lazy, or left alone
        self.error = ""  # a failure during its current captured call
        self.breaks: dict[str, int] = {}  # graph break: times Dynamo compiled past it
        self.compiles = 0  # captured calls during which Dynamo compiled something
        self.compiled = None  # the class's compiled entry function
        self.original = None  # the optimizer's own instance-level step (an LR scheduler's)

    def capture(self) -> None:
        """Route the next calls through Dynamo, unless the user compiled it (or wrapped the
        optimizer's step) themselves."""
        owner = self.ref()
        if owner is None or self.state != _WATCHING:
            return
        why = _left_alone_because(owner, self.kind)
        if why:
            self.state, self.reason = _LEFT, why
            return
        self.compiled = _compiled_entry(self.kind, type(owner))
        if self.kind == "forward":
            owner._compiled_call_impl = _captured_forward(self, self.ref)
        else:
            self.original = owner.__dict__.get("step")  # an LR scheduler's wrapper, or None
            owner.step = _captured_step(self, self.ref)
        self.state = _CAPTURED
        counters.bump("AutoCaptured")

    def call(self, target, args: tuple, kwargs: dict) -> Any:
        """One captured call: through Dynamo, charging what it compiles and breaks to this
        callable; a failure sends it back to lazy tracing (this call's result is still right:
        Dynamo ran the failed frame uncompiled, or nothing ran and it runs lazily here)."""
        local = _LOCAL
        local.depth += 1
        outer, local.current = local.current, self
        graphs, breaks = _dynamo_graphs(), len(_break_reasons())
        pending = len(engine.current().pending)
        if _compile_starting not in _DYNAMO["starts"]:  # torch._dynamo.reset() dropped it
            _DYNAMO["starts"].append(_compile_starting)
        try:
            return self.compiled(target, *args, **kwargs)
        except _DYNAMO["errors"] as error:  # one Dynamo does not suppress
            self.error = f"{type(error).__name__}: {_first_line(error)}"
            if len(engine.current().pending) != pending:
                raise  # part of the call ran: running it again would repeat that part
            return target(*args, **kwargs)
        finally:
            local.depth -= 1
            local.current = outer
            if outer is None and local.suppressing is not None:
                _DYNAMO["config"].suppress_errors, local.suppressing = local.suppressing, None
            if _dynamo_graphs() != graphs or len(_break_reasons()) != breaks:
                self._compiled(graphs, breaks)
            if self.error:
                self.fall_back(self.error)

    def _compiled(self, graphs: int, breaks: int) -> None:
        """Dynamo compiled during the call: note its graph breaks; past
        ``SPMD_TORCH_AUTO_CAPTURE_RECOMPILES`` compiles again, give up on the callable."""
        reasons = _break_reasons()
        new = reasons[breaks:] if len(reasons) >= breaks else reasons
        for reason in new:
            text = _describe_break(reason)
            if text is not None:
                if text not in self.breaks:
                    counters.bump("DynamoGraphBreak")
                self.breaks[text] = self.breaks.get(text, 0) + 1
        if _dynamo_graphs() == graphs:
            return
        self.compiles += 1
        if self.compiles > 1:
            counters.bump("DynamoRecompile")
        limit = config.AUTO_CAPTURE_RECOMPILES.value
        if self.compiles - 1 > limit and not self.error:
            self.error = (
                f"Dynamo compiled it again {self.compiles - 1} times, more than "
                f"SPMD_TORCH_AUTO_CAPTURE_RECOMPILES={limit}: its input shapes or guards change "
                "from call to call (TORCH_LOGS=recompiles says which)"
            )

    def fall_back(self, reason: str) -> None:
        """Back to lazy tracing for good, saying why."""
        self.state, self.reason, self.error = _LAZY, reason, ""
        counters.bump("AutoCaptureFallback")
        _release(self)

    def report(self) -> str:
        lines = [f"AutoCapture: {self.name}", f"  State: {self.state}"]
        if self.reason:
            lines.append(f"  Reason: {self.reason}")
        if self.compiles:
            lines.append(f"  Compiles: {self.compiles}")
        lines += [f"  GraphBreak: {text}" for text in self.breaks]
        return "\n".join(lines) + "\n"


def _forget(key: int, ref: weakref.ref, callables: dict = _CALLABLES) -> None:
    """A callable's owner died: forget it (``callables`` bound early: owners die at exit too)."""
    entry = callables.get(key)
    if entry is not None and entry.ref is ref:
        del callables[key]


def _release(entry: _Callable) -> None:
    """Undo what capture installed on the callable's owner (if it still lives)."""
    owner = entry.ref()
    if owner is None:
        return
    if entry.kind == "forward":
        if getattr(owner.__dict__.get("_compiled_call_impl"), "entry", None) is entry:
            owner._compiled_call_impl = None
    elif getattr(owner.__dict__.get("step"), "entry", None) is entry:
        if entry.original is None:
            del owner.step
        else:
            owner.step = entry.original


def _captured_forward(entry: _Callable, ref: weakref.ref):
    """The module's ``_compiled_call_impl``: its calls through Dynamo. Traced itself (the module
    called inside another compiled module), it is the module's plain call."""

    def captured(*args, **kwargs):
        if _is_compiling():
            return ref()._call_impl(*args, **kwargs)
        return entry.call(ref()._call_impl, args, kwargs)

    captured.entry = entry
    return captured


def _step_of(optimizer, *args, **kwargs):
    """``optimizer.step`` once captured (also as an LR scheduler made later wraps it). Traced
    itself (inside a function the user compiled), it is the optimizer's plain step.

    A closure (Lightning passes one at every step: forward, backward, gradient reduction) is
    called lazily, as the optimizer would call it, before the captured step without it, where the
    optimizer calls it once before it updates anything; otherwise (LBFGS, an optimizer of the
    user's) the whole step runs lazily."""
    if _is_compiling():
        return type(optimizer).step(optimizer, *args, **kwargs)
    entry = _CALLABLES.get(id(optimizer))
    step = types.MethodType(type(optimizer).step, optimizer)
    if entry is None or entry.state != _CAPTURED or len(args) > 1:
        return step(*args, **kwargs)
    closure = args[0] if args else kwargs.pop("closure", None)
    if closure is None:
        return entry.call(step, (), kwargs)
    if not _calls_closure_first(type(optimizer)):
        return step(closure, **kwargs)
    with torch.enable_grad():
        loss = closure()
    entry.call(step, (), kwargs)
    return loss


_CLOSURE_FIRST = ("torch.optim.", "spmd_torch.amp.syncfree.")


def _calls_closure_first(cls: type) -> bool:
    """Whether ``cls.step`` calls its closure once, under ``enable_grad``, before anything else:
    torch.optim's steps and the syncfree ones, LBFGS's aside (it calls it again and again)."""
    module = getattr(cls.step, "__module__", "") + "."
    return module.startswith(_CLOSURE_FIRST) and not issubclass(cls, torch.optim.LBFGS)


def _captured_step(entry: _Callable, ref: weakref.ref):
    """The optimizer's instance-level ``step``; no reference back to the optimizer, so that it
    is freed as soon as the user drops it."""

    def step(*args, **kwargs):
        return _step_of(ref(), *args, **kwargs)

    step.__func__ = _step_of  # what an LR scheduler made later wraps (its step tracking)
    step.entry = entry
    return step


def _enter(target, /, *args, **kwargs):
    """What Dynamo compiles: the call of ``target``, a module's ``_call_impl`` (its hooks
    included) or an optimizer's ``step``, passed in so that every instance shares the graphs."""
    return target(*args, **kwargs)


def _compiled_entry(kind: str, cls: type):
    """One compiled function per class and kind, of a code object of its own: Dynamo keeps its
    graphs per code object, so instances of a class (each replica's model) share them, and one
    class's recompiles do not count against another's."""
    with _LOCK:
        if (kind, cls) not in _COMPILED:
            _import_dynamo()
            name = f"{cls.__name__}_{kind}"
            entry = types.FunctionType(_enter.__code__.replace(co_name=name), globals(), name)
            entry.__qualname__ = name
            _COMPILED[kind, cls] = torch.compile(entry, backend=_backend, dynamic=False)
        return _COMPILED[kind, cls]


def _backend(gm: torch.fx.GraphModule, example_inputs: list):
    """The ``spmd_torch`` backend; where it fails the graph runs as it is (lazily traced) and the
    callable goes back to lazy tracing after this call."""
    from spmd_torch.core.dynamo_bridge import spmd_torch_backend

    try:
        return spmd_torch_backend(gm, example_inputs)
    except Exception as error:
        if _LOCAL.current is not None:
            _LOCAL.current.error = f"the backend failed: {type(error).__name__}: {error}"
        return gm.forward


def _import_dynamo() -> None:
    """Once, at the first capture (importing spmd_torch imports no Dynamo): the backend, and
    Dynamo's bookkeeping read at each captured call. A compile started inside a captured call
    makes Dynamo run a frame it fails on uncompiled (``suppress_errors``, for this thread and
    this call only), and the failure it logs is charged to the callable."""
    if "config" in _DYNAMO:
        return
    import torch._dynamo
    from torch._dynamo import callback, exc, utils

    from spmd_torch.core import dynamo_bridge  # noqa: F401  (the backend's Dynamo patches)

    _DYNAMO.update(
        config=torch._dynamo.config,
        errors=exc.TorchDynamoException,
        counters=utils.counters,
        reasons=utils.graph_break_reasons,
    )
    _DYNAMO["starts"] = callback.callback_handler.start_callbacks
    logging.getLogger("torch._dynamo.convert_frame").addFilter(_charge_failure)


def _compile_starting(_args) -> None:
    local = _LOCAL
    if local.current is not None and local.suppressing is None:
        dynamo = _DYNAMO["config"]
        local.suppressing, dynamo.suppress_errors = dynamo.suppress_errors, True


def _charge_failure(record) -> bool:
    """A warning of Dynamo's during a captured call: a frame it failed on and ran uncompiled,
    or its own recompile limit hit (it stops compiling the frame)."""
    current = _LOCAL.current
    if current is not None and record.levelno >= logging.WARNING and not current.error:
        current.error = f"Dynamo: {record.getMessage().strip().splitlines()[0]}"
    return True


# --- finding top-level calls: the hooks run at every module call in the process (CPU modules too)
# while capture is on, so they do the least they can ----------------------------------------------


def _module_called(module, args) -> None:
    if _is_compiling():
        return
    local = _LOCAL
    depth = local.depth
    local.depth = depth + 1
    if not depth:
        _top_level(module, "forward")


def _module_returned(module, args, output) -> None:
    if not _is_compiling():
        local = _LOCAL
        depth = local.depth
        if depth:
            local.depth = depth - 1


def _optimizer_stepping(optimizer, args, kwargs) -> None:
    if not _is_compiling() and not _LOCAL.depth:
        _top_level(optimizer, "step")


def _top_level(owner, kind: str) -> None:
    """Note a call from user code of a callable on the xla device, for the step's barrier."""
    entry = _CALLABLES.get(id(owner))
    if entry is None:
        if not _on_xla(owner, kind) or _inside_users_compile():
            return
        entry = _CALLABLES[id(owner)] = _Callable(owner, kind)
    if entry.state == _WATCHING:
        local = _LOCAL
        if local.seen is None:
            local.seen = {}
        local.seen[id(owner)] = entry


def _on_xla(owner, kind: str) -> bool:
    if kind == "forward":
        tensor = next(owner.parameters(), None)
        if tensor is None:
            tensor = next(owner.buffers(), None)
    else:
        tensor = next((p for group in owner.param_groups for p in group["params"]), None)
    return tensor is not None and tensor.device.type == "xla"


def _inside_users_compile() -> bool:
    """A call from the uncompiled part of a function the user compiled is not user code."""
    return torch._C._dynamo.eval_frame.get_eval_frame_callback() is not None


def _left_alone_because(owner, kind: str) -> str:
    """Why capture leaves the callable as it is: it is compiled already, or a step of the
    user's replaced the optimizer's (an LR scheduler's step tracking is fine: it calls the
    class's)."""
    if kind == "forward":
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        if eval_frame is not None and isinstance(owner, eval_frame.OptimizedModule):
            return "torch.compile(module) wraps it"
        if owner._compiled_call_impl is not None:
            return "module.compile() compiled it"
        if isinstance(owner, torch.jit.ScriptModule):
            return "it is a TorchScript module"
        return ""
    step = owner.__dict__.get("step")
    if step is not None and not hasattr(step, "_wrapped_by_lr_sched"):
        return f"optimizer.step is replaced on the instance (by {step!r})"
    return ""


# --- the barrier ---------------------------------------------------------------------------------


def _at_barrier() -> None:
    """Before the barrier's program runs: if the step repeated the one before (the same program
    identity) capture every callable the step called from user code.

    A barrier that called none (a data loader's, the one that runs a logged loss's running sum)
    is not a step and leaves the comparison as it was: transformers' Trainer and accelerate run
    such a barrier between every two training steps."""
    local = _LOCAL
    own = engine.current()
    if local.engine is not own or own.steps != local.steps + 1:  # a new engine, or reset
        local.engine, local.last, local.armed = own, None, False
    compiles, local.compiles = local.compiles, _compiles()
    local.steps = own.steps
    seen, local.seen = local.seen, None
    if own.eager:
        local.last = None
        return
    if not seen:
        return
    if not local.armed:
        local.armed, local.last = _step_of_barrier(seen, compiles, local.last)
    if local.armed:
        for entry in seen.values():
            entry.capture()


def _step_of_barrier(seen: dict, compiles: int, last) -> tuple[bool, Any]:
    """(whether the step repeats the one before, what it was). Its program's identity; when
    reads computed all of it (an evaluation loop reading each output), its callables, if it
    compiled no program."""
    program = graph.pending_program()
    if program.nodes:
        step = program.identity
    else:
        step = frozenset(seen) if _compiles() == compiles else None
    return step is not None and step == last, step


def _compiles() -> int:
    return metrics.counter_value("UncachedCompile") or 0


# --- switching it on and off ---------------------------------------------------------------------


def enabled() -> bool:
    """Whether automatic capture is on (``SPMD_TORCH_AUTO_CAPTURE``, or :func:`auto_capture`)."""
    return bool(_HOOKS)


def auto_capture(enabled: bool = True) -> None:
    """Turn automatic capture on or off (opt-in: ``SPMD_TORCH_AUTO_CAPTURE=1`` turns it on at
    import).

    Once on, a training loop whose step repeats (the barrier runs the same program twice in a
    row) runs the forward of each module called from user code on the xla device, and each
    optimizer's ``step``, through ``torch.compile(..., backend='spmd_torch')`` from the step
    after; graph breaks run their parts lazily, and a callable Dynamo fails on, or compiles again
    too often, goes back to lazy tracing. The metrics report lists each callable, its state, its
    graph breaks and why it fell back. Off, every captured callable goes back to lazy tracing.

    Args:
        enabled: On (default) or off.

    Example:
        >>> spmd_torch.auto_capture()
        >>> for x, y in loader:
        ...     loss = loss_fn(model(x), y); loss.backward(); opt.step(); xm.mark_step()
        >>> print(met.metrics_report())  # AutoCapture: GPT.forward / State: captured ...
    """
    with _LOCK:
        if enabled and not _HOOKS:
            _HOOKS.extend(
                [
                    torch.nn.modules.module.register_module_forward_pre_hook(_module_called),
                    torch.nn.modules.module.register_module_forward_hook(
                        _module_returned, always_call=True
                    ),
                    register_optimizer_step_pre_hook(_optimizer_stepping),
                ]
            )
            _barrier.BEFORE_RUN.append(_at_barrier)
            metrics.SECTIONS["AutoCapture"] = report
        elif not enabled and _HOOKS:
            for handle in _HOOKS:
                handle.remove()
            _HOOKS.clear()
            _barrier.BEFORE_RUN.remove(_at_barrier)
            del metrics.SECTIONS["AutoCapture"]
            for entry in list(_CALLABLES.values()):
                _release(entry)
            _CALLABLES.clear()
            vars(_LOCAL).clear()  # this thread's step history; other threads' end with them


def report() -> str:
    """Each callable automatic capture decided on: its state (captured, lazy, left alone), why,
    how often Dynamo compiled it, and its graph breaks (the metrics report's section)."""
    entries = [e for e in list(_CALLABLES.values()) if e.state != _WATCHING]
    return "".join(entry.report() for entry in entries)


def callables() -> dict[str, list[str]]:
    """The names of the callables seen, by state: ``{'captured': ['GPT.forward', ...], ...}``."""
    by_state: dict[str, list[str]] = {}
    for entry in list(_CALLABLES.values()):
        by_state.setdefault(entry.state, []).append(entry.name)
    return by_state


# --- Dynamo's bookkeeping -------------------------------------------------------------------------


def _dynamo_graphs() -> int:
    return _DYNAMO["counters"]["stats"]["unique_graphs"]


def _break_reasons() -> list:
    return _DYNAMO["reasons"]


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # spmd_torch/
_LIBRARIES = tuple(
    folder + os.sep
    for folder in (
        os.path.dirname(torch.__file__),
        os.path.dirname(jax.__file__),
        _PACKAGE,
        sysconfig.get_paths()["stdlib"],
    )
)


def _describe_break(reason) -> str | None:
    """A graph break's first line and the user's line it happened at; None for breaks inside
    libraries only (torch.optim's own, or frames of the engine's that Dynamo looked at)."""
    for frame in reversed(reason.user_stack):
        if not frame.filename.startswith(_LIBRARIES):
            where = f"{os.path.basename(frame.filename)}:{frame.lineno}"
            return f"{reason.reason.strip().splitlines()[0]} ({where})"
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""
