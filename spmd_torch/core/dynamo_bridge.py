"""``torch.compile`` on xla tensors: the ``spmd_torch`` backend, and PyTorch/XLA's bridge behind
PyTorch's own ``openxla`` and ``openxla_eval`` backends (with the ``torch_xla`` name installed).

Dynamo traces the Python code; AOTAutograd splits the graph into a forward and a backward over
plain aten ops; each becomes a :class:`~spmd_torch._lazy.compiled.CompiledGraph`, recorded once
per input shapes and then called as one node of the lazy graph. Under ``spmd_torch`` a call does
not end the step: the graph joins the barrier's program with the rest of the step (forward,
backward and optimizer step: one program). Under PyTorch's ``openxla`` names, through PyTorch/XLA's
bridge entry, each call runs at once with what is pending, as PyTorch/XLA's does, so its outputs
are device data (their shardings and metrics readable) when the call returns.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from functorch.compile import make_boxed_func
from torch._dynamo import trace_rules
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.variables import optimizer as dynamo_optimizer
from torch._dynamo.variables import torch as dynamo_torch
from torch._dynamo.variables.ctx_manager import AutocastModeVariable

from spmd_torch._lazy import execute, stacks
from spmd_torch._lazy.compiled import CompiledGraph
from spmd_torch._lazy.lowering import inductor_prims
from spmd_torch._lazy.tensor import LazyTensor

# Dynamo must never trace the engine's frames, nor JAX's under them: they run where compiled code
# breaks its graph (a backward, an eager region), and an op there is an op of the lazy graph. A
# loop traced once is a graph break too: it records its body lazily (Dynamo off inside).
_NOT_TRACED = (
    "spmd_torch._lazy",
    "spmd_torch.experimental.scan",
    "spmd_torch.experimental.scan_layers",
    "spmd_torch.experimental.fori_loop",
    "jax",
    "jaxlib",
    "ml_dtypes",
)
for _module in _NOT_TRACED:
    trace_rules.add(_module)
inductor_prims.register()


def _capturable_on_xla(set_capturable: Callable) -> Callable:
    """Dynamo makes a new optimizer capturable (its step counters device tensors) when its
    parameters are on CUDA, so that the compiled step has no CPU part: the same on xla."""

    def on_xla_too(self, tx) -> None:
        optimizer = self.value
        for group in optimizer.param_groups:
            params = group.get("params", [])
            if "capturable" in group and params and not any(p in optimizer.state for p in params):
                if all(p.device.type == "xla" for p in params):
                    group["capturable"] = True
        set_capturable(self, tx)

    return on_xla_too


def _steps_stacked_on_xla(move_step_if_cpu: Callable) -> Callable:
    """Dynamo moves an optimizer's CPU step counters to their parameters' device before it traces
    the step. On xla the counters, moved or made there (a fused step's), become the members of
    one stack (``execute.stack_counters``, as a lazy step's do at their first ``+1``), so that
    the compiled step reads and writes one array for all of them instead of one 0-dim array per
    parameter (W7cpu's GPT-2: 148 of the step's 595 inputs, and as many outputs); counters
    already in a stack (``scan_layers``' layers) stay in theirs. Not in a replica of launch."""

    def move(self) -> None:
        move_step_if_cpu(self)
        counters = [
            s["step"]
            for s in self.value.state.values()
            if type(s.get("step")) is LazyTensor and stacks.member(s["step"]) is None
        ]
        execute.stack_counters(counters)

    return move


_OPTIMIZER = dynamo_optimizer.OptimizerVariable
_OPTIMIZER._set_capturable = _capturable_on_xla(_OPTIMIZER._set_capturable)
_OPTIMIZER.move_step_if_cpu = _steps_stacked_on_xla(_OPTIMIZER.move_step_if_cpu)


def _is_autocast_subclass(value) -> bool:
    """A subclass of ``torch.autocast`` with an ``__init__`` of its own (``spmd_torch.amp``'s
    and PyTorch/XLA's ``autocast``): Dynamo would trace into that ``__init__`` and fail there."""
    base = torch.amp.autocast_mode.autocast
    return (
        isinstance(value, type) and issubclass(value, base) and value.__init__ is not base.__init__
    )


def _autocast_subclasses_too(is_matching_cls: Callable, call_function: Callable):
    """Such a class is built eagerly from its (constant) arguments, and Dynamo enters the result
    as the ``torch.autocast(device, dtype)`` it stands for, a context of the graph."""

    def matching(value) -> bool:
        return is_matching_cls(value) or _is_autocast_subclass(value)

    def call(self, tx, args, kwargs):
        if not _is_autocast_subclass(self.value):
            return call_function(self, tx, args, kwargs)
        made = self.value(
            *(a.as_python_constant() for a in args),
            **{k: v.as_python_constant() for k, v in kwargs.items()},
        )
        state = [made.device, made.fast_dtype, made._enabled, made._cache_enabled]
        return AutocastModeVariable(state, initial_values=None)

    return staticmethod(matching), call


_CONTEXTS = dynamo_torch.TorchCtxManagerClassVariable
_CONTEXTS.is_matching_cls, _CONTEXTS.call_function = _autocast_subclasses_too(
    _CONTEXTS.is_matching_cls, _CONTEXTS.call_function
)


def extract_compiled_graph(xla_model: torch.fx.GraphModule, xla_args) -> Callable:
    """The graph ``xla_model`` as a function of xla tensors (PyTorch/XLA's bridge entry, which
    PyTorch's ``openxla`` backends call with the graph's first real arguments); each call runs
    at once, as PyTorch/XLA's."""
    return CompiledGraph(xla_model, _name(xla_model), at_once=True)


def _compiler(graph: torch.fx.GraphModule, example_inputs) -> Callable:
    return make_boxed_func(CompiledGraph(graph, _name(graph)))


def _name(graph) -> str:
    return f"compiled graph {graph._get_name()}"


# ``torch.compile(model, backend='spmd_torch')``: registered through this package's entry point
# (group ``torch_dynamo_backends``), so importing spmd_torch costs no Dynamo import.
# Inference graphs (an optimizer step) keep their in-place writes: the template writes them back
# itself, instead of AOTAutograd copying each output into its input after the call.
spmd_torch_backend = aot_autograd(
    fw_compiler=_compiler, bw_compiler=_compiler, keep_inference_input_mutations=True
)
