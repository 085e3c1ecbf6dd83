"""torch.optim on xla parameters: the multi-tensor (foreach) path by default, as on CUDA, each
foreach call and each fused step one node over every parameter; a step equals eager CPU's (the
single-tensor loop) to float32 rounding on one device, over an 8-device FSDP mesh (the state laid
out like its parameter) and in 4 launch replicas."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import spmd_torch
import spmd_torch.core.xla_model as xm
import spmd_torch.distributed.spmd as xs
import spmd_torch.distributed.xla_multiprocessing as xmp
import spmd_torch.runtime as xr
from spmd_torch._lazy.graph import DATA
from spmd_torch._XLAC import _get_xla_sharding_spec
from spmd_torch.amp import syncfree
from spmd_torch.debug import graph
from tests.helpers import assert_close, to_cpu, tolerance

dev = spmd_torch.device()

# name -> (make on the device, make on the CPU reference: torch.optim's single-tensor loop)
OPTIMIZERS = {
    "sgd_momentum": (
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False),
    ),
    "adam": (
        lambda ps: torch.optim.Adam(ps, lr=0.01),
        lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False),
    ),
    "adamw": (
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=False),
    ),
    "adamw_amsgrad": (
        lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True, foreach=False),
    ),
    "adamw_single_tensor": (
        lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=False),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=False),
    ),
    "adamw_fused": (
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, fused=True),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=False),
    ),
    "sgd_fused": (
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
    ),
    "syncfree_adamw": (
        lambda ps: syncfree.AdamW(ps, lr=0.01, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=False),
    ),
    "syncfree_sgd": (
        lambda ps: syncfree.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
    ),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
    )


def _losses(model: torch.nn.Module, optimizer, batches: list, on_device: bool) -> list[float]:
    losses = []
    for x, y in batches:
        if on_device:
            x, y = x.to(dev), y.to(dev)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if on_device:
            spmd_torch.sync()
        losses.append(loss.item())
    return losses


def _batches(steps: int = 4, batch: int = 6) -> list:
    torch.manual_seed(1)
    return [(torch.randn(batch, 8), torch.randn(batch, 4)) for _ in range(steps)]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_steps_equal_eager_on_one_device(name):
    make, make_cpu = OPTIMIZERS[name]
    cpu = _model()
    model = copy.deepcopy(cpu).to(dev)
    batches = _batches()
    expected = _losses(cpu, make_cpu(cpu.parameters()), batches, on_device=False)
    got = _losses(model, make(model.parameters()), batches, on_device=True)
    training = tolerance(torch.float32, "fwd", "training")
    assert_close(torch.tensor(got), torch.tensor(expected), **training)
    assert_close(to_cpu(list(model.parameters())), list(cpu.parameters()), **training)


def _step_program(make) -> tuple[list[str], int, int]:
    """The ops of the program one optimizer step records (everything else run before it), its
    lifted scalars and its 0-dim tensor inputs."""
    model = _model().to(dev)
    optimizer = make(model.parameters())
    x = torch.randn(6, 8).to(dev)
    for _ in range(2):  # the second step: the state exists
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        for p in model.parameters():
            p.grad = p.grad.clone()  # the gradients themselves, not views read through the step
        spmd_torch.sync()
        optimizer.step()
        program = graph.pending_program()
        spmd_torch.sync()
    ops = [str(node.op) for node in program.nodes]
    zero_dim = sum(not node.avals[i].shape for node, i in program.leaves if node.op == DATA)
    return ops, len(program.scalars), zero_dim


def test_default_adamw_is_a_handful_of_foreach_nodes():
    """torch.optim picks its foreach path for xla parameters: 8 nodes over all 6 parameters,
    7 scalar inputs (per-parameter bias corrections travel as one vector each), where the
    single-tensor loop recorded 8 ops and 7 scalars per parameter."""
    ops, scalars, _ = _step_program(lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1))
    assert len(ops) <= 12 and all(op.startswith("aten._foreach_") for op in ops), ops
    assert scalars <= 8, scalars


def test_fused_adamw_is_one_node():
    """The step, and its counters' +1: the six counters are one array (the step reads them
    through one ``unbind``), not six program inputs and six outputs."""
    ops, _, zero_dim = _step_program(lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True))
    assert ops == ["aten._foreach_add.Scalar", "aten.unbind.int", "aten._fused_adamw.default"]
    assert zero_dim == 0


@pytest.mark.parametrize("make", [syncfree.Adam, syncfree.SGD], ids=["adam", "sgd"])
def test_a_syncfree_step_is_one_fused_node_and_its_counters(make):
    def with_flag(ps):
        optimizer = make(ps, lr=0.01, **({"momentum": 0.9} if make is syncfree.SGD else {}))
        step = optimizer.step
        optimizer.step = lambda: step(found_inf=torch.zeros((), device=dev))
        return optimizer

    ops, _, _ = _step_program(with_flag)
    fused = [op for op in ops if "_fused_" in op]
    # the counters' +1, their unbind and -found_inf, the flag
    assert len(fused) == 1 and len(ops) <= 5, ops


def test_clip_grad_norm_is_foreach_nodes():
    model = _model().to(dev)
    model(torch.randn(6, 8).to(dev)).pow(2).mean().backward()
    spmd_torch.sync()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    ops = [str(node.op) for node in graph.pending_program().nodes]
    assert (
        ops.count("aten._foreach_norm.Scalar") == 1 and ops.count("aten._foreach_mul.Tensor") == 1
    )
    assert ops.count("aten.linalg_vector_norm.default") == 1  # the norm of the norms
    assert ops.count("aten.mul.Tensor") <= 1, ops  # max_norm / total: not one per parameter
    spmd_torch.sync()


def test_fsdp_adamw_state_is_laid_out_like_its_parameter():
    xr.use_spmd()
    try:
        mesh = xs.Mesh(np.arange(8), (8,), ("fsdp",))
        cpu = _model()
        model = copy.deepcopy(cpu).to(dev)
        for p in model.parameters():
            xs.mark_sharding(p, mesh, ("fsdp",) + (None,) * (p.dim() - 1))
        batches = _batches(steps=3, batch=8)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        expected = _losses(
            cpu,
            torch.optim.AdamW(cpu.parameters(), lr=0.01, weight_decay=0.1, foreach=False),
            batches,
            on_device=False,
        )
        got = _losses(model, optimizer, batches, on_device=True)
        assert_close(
            torch.tensor(got), torch.tensor(expected), **tolerance(torch.float32, "fwd", "training")
        )
        for p in model.parameters():
            spec = _get_xla_sharding_spec(p)
            assert spec.startswith("{devices=[8"), spec
            for key in ("exp_avg", "exp_avg_sq"):
                assert _get_xla_sharding_spec(optimizer.state[p][key]) == spec, key
    finally:
        xr.reset()


def _replica_training(index, batches):
    model = _model().to(xm.xla_device())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    losses = []
    for x, y in batches:
        x, y = x[index::4].to(xm.xla_device()), y[index::4].to(xm.xla_device())
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        xm.optimizer_step(optimizer)  # gradients averaged over the replicas
        losses.append(loss)
    return [loss.item() for loss in losses]


def test_four_replicas_step_as_one_averaged_eager_step():
    batches = _batches(steps=3, batch=8)
    got = xmp.spawn(_replica_training, args=(batches,), nprocs=4)
    cpu = _model()
    optimizer = torch.optim.AdamW(cpu.parameters(), lr=0.01, weight_decay=0.1, foreach=False)
    expected = np.zeros((4, len(batches)))
    for step, (x, y) in enumerate(batches):
        grads = []
        for k in range(4):
            cpu.zero_grad()
            loss = torch.nn.functional.mse_loss(cpu(x[k::4]), y[k::4])
            loss.backward()
            expected[k, step] = loss.item()
            grads.append([p.grad.clone() for p in cpu.parameters()])
        for p, replica_grads in zip(cpu.parameters(), zip(*grads)):
            p.grad = torch.stack(replica_grads).mean(0)
        optimizer.step()
    actual = np.array([got[k] for k in range(4)])
    assert_close(
        torch.from_numpy(actual),
        torch.from_numpy(expected),
        **tolerance(torch.float32, "fwd", "training"),
    )
