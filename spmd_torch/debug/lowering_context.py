"""PyTorch/XLA's ``torch_xla._XLAC.lowering.LoweringContext``: the HLO module of the pending graph
that computes some tensors, built without running it, and which tensor feeds each parameter.

Custom-op and export code reads a graph through it: ``build`` the tensors, take ``hlo()`` (the
serialized ``HloModuleProto``) or its text and JSON forms, and ``parameter_id_tensor_mapping`` for
the values the module's parameters take. The module is the one the next sync would hand XLA for
these tensors (our lowering, with the inputs' shardings), so its parameters are the graph's device
data in first-use order, then the lifted Python scalars, one each, when there are any. In a
replica of ``launch`` it is the one program every replica runs, each parameter the replicas'
values stacked (the scalars in one vector); the mappings give this replica's.

Example:
    >>> ctx = torch_xla._XLAC.lowering.LoweringContext("MyGraph")
    >>> ctx.build([a + b])
    >>> 'opcode: "add"' in ctx.hlo_text()
    True
    >>> ctx.tensor_parameter_id(a)
    0
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spmd_torch._lazy import compile as _compile
from spmd_torch._lazy import placement as _placement
from spmd_torch._lazy.engine import current
from spmd_torch._lazy.tensor import on_xla, wrap
from spmd_torch.debug import graph, hlo_proto


class LoweringContext:
    """The HLO module of a set of tensors' pending graph; see the module docstring."""

    def __init__(self, name: str = "PyLoweringContext"):
        self._name = name
        self._module = None  # the HloModuleProto message, once built
        self._leaves: list = []  # per parameter: the leaf (node, index) it reads
        self._scalars: list = []  # the lifted scalars' values (the last parameters)

    def build(self, tensors: Sequence[torch.Tensor]) -> None:
        """Lower the graph computing ``tensors`` (its outputs, in order); nothing runs."""
        checked = [
            on_xla(t, f"LoweringContext.build (tensors[{i}])") for i, t in enumerate(tensors)
        ]
        program = graph.pending_program(checked)
        arrays = [_placement.resolve(node, i) for node, i in program.leaves]
        lowered = current().mode.lowered(program, arrays, every_input=True)
        self._module = hlo_proto.parse(
            graph.xla_computation(lowered).as_serialized_hlo_module_proto()
        )
        self._module.name = self._name
        self._leaves = list(program.leaves)
        values = program.scalar_values()
        if current().mode.packs_scalars:
            self._scalars = [values] if len(values) else []
        else:
            self._scalars = _compile.unpacked(values, _compile.scalar_parts_of(program))

    def hlo(self) -> bytes:
        """The serialized ``HloModuleProto``."""
        return self._built().SerializeToString(deterministic=True)

    def hlo_text(self) -> str:
        """The module in protobuf's text form (``opcode: "parameter"``)."""
        return hlo_proto.to_text(self._built())

    def hlo_json(self) -> str:
        """The module in protobuf's JSON form (``hostProgramShape``)."""
        return hlo_proto.to_json(self._built())

    def parameter_id_tensor_mapping(self) -> dict[int, torch.Tensor]:
        """Parameter number -> the value it takes, copied to the CPU (a device-to-host transfer)."""
        return {k: t.cpu() for k, t in self.device_parameter_id_tensor_mapping().items()}

    def device_parameter_id_tensor_mapping(self) -> dict[int, torch.Tensor]:
        """Parameter number -> an xla tensor of the value it takes; nothing is transferred."""
        self._built()
        mapping = {k: wrap(leaf, leaf[0].avals[leaf[1]]) for k, leaf in enumerate(self._leaves)}
        device = current().mode.use_device(None)
        for value in self._scalars:
            mapping[len(mapping)] = torch.from_numpy(value).to(device)
        return mapping

    def tensor_parameter_id(self, tensor: torch.Tensor) -> int:
        """The parameter ``tensor``'s device data feeds; -1 for a pending value or another's."""
        self._built()
        node, index = on_xla(tensor, "LoweringContext.tensor_parameter_id")._ref()
        for k, (leaf, i) in enumerate(self._leaves):
            if leaf is node and i == index:
                return k
        return -1

    def set_name_string(self, name: str) -> None:
        """Name the module (its ``name``; the next ``build`` keeps it)."""
        self._name = name
        if self._module is not None:
            self._module.name = name

    def get_name_string(self) -> str:
        return self._name

    def _built(self):
        if self._module is None:
            raise RuntimeError(
                f"LoweringContext {self._name!r}: call build(tensors) before reading its module"
            )
        return self._module
