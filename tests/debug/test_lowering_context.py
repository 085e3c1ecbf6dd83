"""``_XLAC.lowering.LoweringContext``: the HLO module of a pending graph, built without running it,
and which tensor feeds each of its parameters. References: the tensors' eager values, the shapes
and dtypes PyTorch gives, and XLA's own reading of the serialized module (jaxlib)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from jax._src.lib import xla_client

import spmd_torch
import spmd_torch._XLAC as xlac
import spmd_torch.core.xla_builder as xb
import spmd_torch.core.xla_model as xm
import spmd_torch.distributed.spmd as xs
import spmd_torch.runtime as xr
from spmd_torch._internal import pjrt
from spmd_torch.debug import graph, hlo_proto, metrics

dev = spmd_torch.device()


def _built(outputs, name="Graph"):
    ctx = xlac.lowering.LoweringContext(name)
    ctx.build(outputs)
    return ctx


def test_the_module_reads_each_input_once_and_nothing_runs():
    a_cpu, b_cpu = torch.randn(3, 4), torch.randn(4)
    a, b = a_cpu.to(dev), b_cpu.to(dev)
    spmd_torch.sync()
    y, z = torch.relu(a) + b, a * b
    ctx = _built([y, z], "MyCustomName")
    assert graph.pending_count() == 2  # built, not run
    module = json.loads(ctx.hlo_json())
    assert module["name"] == "MyCustomName"
    shape = module["hostProgramShape"]
    assert [p["dimensions"] for p in shape["parameters"]] == [["3", "4"], ["4"]]  # int64s: text
    assert {p["elementType"] for p in shape["parameters"]} == {"F32"}
    assert [r["dimensions"] for r in shape["result"]["tupleShapes"]] == [["3", "4"]] * 2
    text = ctx.hlo_text()
    assert text.count('opcode: "parameter"') == 2 and 'opcode: "maximum"' in text
    # XLA reads the serialized module back to the same signature
    program_shape = xla_client.XlaComputation(ctx.hlo()).program_shape()
    assert [s.dimensions() for s in program_shape.parameter_shapes()] == [(3, 4), (4,)]
    mapping = ctx.parameter_id_tensor_mapping()
    assert sorted(mapping) == [0, 1] and all(t.device.type == "cpu" for t in mapping.values())
    by_id = {ctx.tensor_parameter_id(a): a_cpu, ctx.tensor_parameter_id(b): b_cpu}
    assert sorted(by_id) == [0, 1]
    for k, expected in by_id.items():
        torch.testing.assert_close(mapping[k], expected, rtol=0, atol=0)
    assert ctx.tensor_parameter_id(y) == -1  # a pending value feeds no parameter
    torch.testing.assert_close(y.cpu(), torch.relu(a_cpu) + b_cpu)
    torch.testing.assert_close(z.cpu(), a_cpu * b_cpu)


def test_lifted_python_scalars_are_the_last_parameters():
    x_cpu = torch.randn(5)
    x = x_cpu.to(dev)
    ctx = _built([x * 2.5 - 0.75])
    mapping = ctx.parameter_id_tensor_mapping()
    module = json.loads(ctx.hlo_json())
    assert len(mapping) == len(module["hostProgramShape"]["parameters"]) == 3
    torch.testing.assert_close(mapping[ctx.tensor_parameter_id(x)], x_cpu, rtol=0, atol=0)
    assert mapping[1].item() == 2.5 and mapping[2].item() == 0.75  # one parameter each


def test_the_device_mapping_transfers_nothing():
    a_cpu = torch.arange(6.0).reshape(2, 3)
    a = a_cpu.to(dev)
    ctx = _built([a.sum(0)])
    before = metrics.metric_data("TransferFromDeviceTime")
    mapping = ctx.device_parameter_id_tensor_mapping()
    assert metrics.metric_data("TransferFromDeviceTime") == before
    assert mapping[0].device == dev
    torch.testing.assert_close(mapping[0].cpu(), a_cpu, rtol=0, atol=0)


def test_a_sharded_input_is_a_sharded_parameter_and_prints_as_its_spec():
    xr.use_spmd()
    try:
        mesh = xs.Mesh(np.arange(8), (2, 4), ("x", "y"))
        w = torch.randn(8, 16).to(dev)
        xs.mark_sharding(w, mesh, (None, "y"))
        ctx = _built([w @ w.T])
        (parameter,) = [
            i
            for c in hlo_proto.parse(ctx.hlo()).computations
            for i in c.instructions
            if i.opcode == "parameter"
        ]
        # 4 column blocks, each held by both rows of the mesh (a replicated last tile dim)
        assert list(parameter.sharding.tile_assignment_dimensions) == [1, 4, 2]
        hlo = xb.get_computation_hlo(xb.computation_from_module_proto("mine", ctx.hlo()))
        assert hlo.startswith("HloModule mine,")
        assert f"parameter(0), sharding={xs.get_xla_sharding_spec(w)}" in hlo
    finally:
        xr.reset()


def test_reading_before_building_and_running_a_read_module_raise():
    ctx = xlac.lowering.LoweringContext("Early")
    with pytest.raises(RuntimeError, match="'Early': call build"):
        ctx.hlo_text()
    ctx = _built([torch.ones(2, device=dev) * 3])
    ctx.set_name_string("Renamed")
    assert ctx.get_name_string() == "Renamed" and 'name: "Renamed"' in ctx.hlo_text()
    computation = xb.computation_from_module_proto("read", ctx.hlo())
    with pytest.raises(NotImplementedError, match="'read' was read from an HLO module proto"):
        computation.apply(np.ones(2))


def test_fields_outside_the_schema_print_by_number():
    # A field hlo_proto does not declare (field 1000 of an instruction) stays in the text form
    module = hlo_proto.parse(_built([torch.ones(2, device=dev) + 1]).hlo())
    extra = b"\xc0\x3e\x07"  # field 1000, varint 7
    first = module.computations[0].instructions[0]
    first.MergeFromString(extra)
    assert "1000: 7" in hlo_proto.to_text(module)


def _replica_module():
    x_cpu = torch.arange(6.0) * (xr.global_ordinal() + 1)
    x = x_cpu.to(xm.xla_device())
    total = xm.all_reduce(xm.REDUCE_SUM, x * 2)
    ctx = _built([total])
    text, mapping = ctx.hlo_text(), ctx.parameter_id_tensor_mapping()
    hlo = graph.get_tensors_hlo([total])
    spmd_torch.sync()
    mine = mapping[ctx.tensor_parameter_id(x)].tolist()
    return text, hlo, mine, x_cpu.tolist(), total.tolist(), xr.world_size()


def test_in_replicas_the_module_is_the_program_they_run_as_one():
    # A replica's collective spans the others: its module is the one program every replica
    # runs (it could not be lowered alone: JAX's unbound axis), its inputs this replica's.
    results = pjrt.run_multiprocess(_replica_module)
    assert len(results) > 1
    for text, hlo, mine, expected, total, world in results.values():
        assert 'opcode: "all-reduce"' in text and "all-reduce(" in hlo
        assert mine == expected
        assert total == [2.0 * k * world * (world + 1) / 2 for k in range(6)]
