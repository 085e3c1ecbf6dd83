"""Automatic capture (``spmd_torch.auto_capture``): an unchanged lazy training loop, once its step
repeats, runs its model's forward and its optimizer's step through the ``spmd_torch`` backend.
The training tests run the same loop three ways: lazily (capture off), with capture on, and
eagerly on the CPU; capture's losses equal lazy's (float32 rounding apart) and eager's (training
tolerance). Also: graph breaks and failures fall back and say so in the metrics report, sharded
parameters keep their shardings, no recompile once warm, the replicas of ``launch``, GradScaler,
what the user compiled is left alone, and off means lazy."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters as dynamo_counters

import spmd_torch
import spmd_torch.amp as amp
import spmd_torch.core.xla_model as xm
import spmd_torch.debug.metrics as met
import spmd_torch.distributed.spmd as xs
import spmd_torch.distributed.xla_multiprocessing as xmp
from spmd_torch import config
from spmd_torch import runtime as xr
from spmd_torch._lazy import compiled, stacks
from spmd_torch.core import auto_capture as capture
from spmd_torch.core import dynamo_bridge
from spmd_torch.debug import graph as debug_graph
from tests.compile.test_backend import GPT
from tests.helpers import ROOT, assert_close
from tests.models.test_training import MLP

dev = spmd_torch.device()
STEPS = 7  # steps 0-2 lazy (step 0 makes the optimizer's state), 3 compiles, 4-6 steady
LAZY = {"rtol": 1e-5, "atol": 1e-6}  # capture vs lazy: the same math, rounded differently


class Branchy(nn.Module):
    """A data-dependent Python branch in the forward: Dynamo breaks the graph at the read."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 10)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if h.sum().item() > 0:  # the graph break the report names
            h = h * 2
        else:
            h = h - 1
        return self.b(h)


class Tiny(nn.Module):
    """One layer: for the tests of what capture decides, where a graph's size does not matter."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc(x)


class Scanned(nn.Module):
    """Four alike layers run by ``scan_layers`` (its first call stacks their weights); on the
    CPU, the eager reference, by the loop it replaces."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        from spmd_torch.experimental.scan_layers import scan_layers

        if x.device.type == "xla":
            return self.head(scan_layers(self.layers, x))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _batches(kind: str, steps: int = STEPS):
    g = torch.Generator().manual_seed(0)
    for k in range(steps):
        if kind == "gpt":
            tokens = torch.randint(0, 64, (4, 17), generator=g)
            yield tokens[:, :-1], tokens[:, 1:]
        else:  # alternating signs: Branchy takes both branches
            x = torch.randn(16, 32, generator=g) + (2.0 if k % 2 else -2.0)
            yield x, torch.randint(0, 10, (16,), generator=g)


def _loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _train(model, opt, kind: str, device=dev, counts: list | None = None) -> torch.Tensor:
    """The loop as users write it; ``counts`` gets (programs compiled, Dynamo graphs) per step."""
    losses = []
    for x, y in _batches(kind):
        opt.zero_grad()
        loss = _loss(model, x.to(device), y.to(device))
        loss.backward()
        opt.step()
        if device == dev:
            xm.mark_step()
            if counts is not None:
                counts.append((met.counter_value("UncachedCompile"), _dynamo_graphs()))
        losses.append(loss.detach())
    return torch.stack([loss.cpu() for loss in losses])


def _dynamo_graphs() -> int:
    return dynamo_counters["stats"]["unique_graphs"]


def _three_ways(make, kind: str, opt=torch.optim.AdamW):
    """Losses of the same loop lazily, captured, and on the CPU; captured's compile counts."""
    torch.manual_seed(0)
    cpu = make()
    models = [copy.deepcopy(cpu).to(dev) for _ in range(2)]
    opts = [opt(model.parameters(), lr=1e-2) for model in models]
    lazy = _train(models[0], opts[0], kind)
    spmd_torch.auto_capture(True)
    try:
        counts: list = []
        captured = _train(models[1], opts[1], kind, counts=counts)
        states = capture.callables()  # of live callables: the optimizers live on
        report = met.metrics_report()
    finally:
        spmd_torch.auto_capture(False)
    eager = _train(cpu, opt(cpu.parameters(), lr=1e-2), kind, device="cpu")
    assert_close(captured, lazy, **LAZY)
    assert_close(captured, eager, tol="training")
    return states, counts, report


@pytest.mark.parametrize(
    "make, kind",
    [
        pytest.param(MLP, "mlp", id="mlp"),
        pytest.param(functools.partial(GPT, layers=1), "gpt", id="gpt", marks=pytest.mark.slow),
    ],
)
def test_training_loop_is_captured_and_matches_lazy_and_eager(make, kind):
    """The forward and AdamW's step are captured from step 3 on; the losses are lazy's and
    eager's; steps 4.. compile nothing (no program, no Dynamo graph)."""
    states, counts, report = _three_ways(make, kind)
    name = kind.upper()
    assert states == {"captured": [f"{name}.forward", "AdamW.step"]}
    assert counts[3] == counts[-1], f"recompiled in steady state: {counts}"
    assert counts[3][1] > counts[2][1]  # step 3 went through Dynamo
    assert f"AutoCapture: {name}.forward\n  State: captured" in report


def test_data_dependent_branch_breaks_then_falls_back_and_says_why():
    """``if h.sum().item() > 0`` in the forward: Dynamo breaks the graph there, runs the read
    lazily, and compiles the rest again for each value read (it specializes on the float), so
    past the recompile budget the forward goes back to lazy tracing; the losses are lazy's and
    eager's throughout, and the report names the break, the user's line and the reason."""
    before = met.counter_value("DynamoGraphBreak") or 0
    with config.override(SPMD_TORCH_AUTO_CAPTURE_RECOMPILES=2):
        states, _, report = _three_ways(Branchy, "branchy", opt=torch.optim.SGD)
    assert states == {"lazy": ["Branchy.forward"], "captured": ["SGD.step"]}
    assert (met.counter_value("DynamoGraphBreak") or 0) > before
    (section,) = [s for s in report.split("AutoCapture: ")[1:] if s.startswith("Branchy")]
    assert "GraphBreak: " in section and "item()" in section
    assert "test_auto_capture.py:" in section  # the user's line, not a library's
    assert "Reason: Dynamo compiled it again 3 times" in section


def test_eval_under_no_grad_after_training():
    """model.eval() under torch.no_grad() once the training loop was captured: eager's output
    (Dynamo compiles the inference graph), then training goes on captured."""
    torch.manual_seed(0)
    cpu = MLP()
    model = copy.deepcopy(cpu).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spmd_torch.auto_capture(True)
    try:
        _train(model, opt, "mlp")
        _train(cpu, torch.optim.SGD(cpu.parameters(), lr=0.1), "mlp", device="cpu")
        x = torch.randn(5, 32)
        model.eval()
        cpu.eval()
        with torch.no_grad():
            out = model(x.to(dev))
            xm.mark_step()
            assert_close(out.cpu(), cpu(x), tol="training")
        assert capture.callables()["captured"] == ["MLP.forward", "SGD.step"]
    finally:
        spmd_torch.auto_capture(False)


def _trainer_style(model, opt) -> tuple[torch.Tensor, list]:
    """transformers' Trainer's and accelerate's loop: ``MpDeviceLoader`` hands each batch over at
    a barrier of its own, which also runs the running sum of the losses logged (no module called
    there); the step ends at ``xm.optimizer_step``'s barrier. Returns the losses and what the
    sum's last barrier left, with the names of the captured callables after each step."""
    import spmd_torch.distributed.parallel_loader as pl

    batches = [(x, y) for x, y in _batches("mlp")]
    total = torch.zeros((), device=dev)
    losses, captured = [], []
    for x, y in pl.MpDeviceLoader(batches, dev):
        opt.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        xm.optimizer_step(opt, barrier=True)
        total = total + loss.detach()
        losses.append(loss.detach())
        captured.append(capture.callables().get("captured", []))
    return torch.stack([loss.cpu() for loss in losses + [total]]), captured


def test_barriers_between_steps_that_call_no_module_do_not_stop_capture():
    """A loader's barrier between every two steps is not a step: the step still repeats, so the
    forward and AdamW's step are captured from the fourth step on, and the losses and their
    running sum are lazy's (the sum's barrier used to reset the comparison: nothing was ever
    captured)."""
    torch.manual_seed(0)
    models = [MLP().to(dev) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    lazy, _ = _trainer_style(models[0], opts[0])
    spmd_torch.auto_capture(True)
    try:
        captured, names = _trainer_style(models[1], opts[1])
    finally:
        spmd_torch.auto_capture(False)
    assert names[1] == [] and names[2] == names[-1] == ["MLP.forward", "AdamW.step"], names
    assert_close(captured, lazy, **LAZY)


def _closure_loop(model, opt) -> torch.Tensor:
    """Lightning's loop: the step's forward and backward in a closure ``optimizer.step`` calls."""
    losses = []
    for x, y in _batches("mlp"):

        def closure(x=x.to(dev), y=y.to(dev)):
            opt.zero_grad()
            loss = _loss(model, x, y)
            loss.backward()
            return loss

        losses.append(opt.step(closure).detach())
        xm.mark_step()
    return torch.stack([loss.cpu() for loss in losses])


@pytest.mark.parametrize("opt", [torch.optim.AdamW, torch.optim.LBFGS], ids=["adamw", "lbfgs"])
def test_a_step_given_a_closure(opt):
    """AdamW calls its closure once, first: capture calls it lazily (its forward captured on its
    own), then the step compiled by Dynamo. LBFGS calls it again and again: its steps run lazily.
    The losses are lazy's (LBFGS's line search amplifies the captured forward's rounding: within
    training tolerance)."""
    torch.manual_seed(0)
    models = [MLP().to(dev) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [opt(m.parameters(), lr=1e-2) for m in models]
    lazy = _closure_loop(models[0], opts[0])
    spmd_torch.auto_capture(True)
    try:
        captured = _closure_loop(models[1], opts[1])
        report = capture.report()
    finally:
        spmd_torch.auto_capture(False)
    if opt is torch.optim.AdamW:
        assert_close(captured, lazy, **LAZY)
    else:
        assert_close(captured, lazy, tol="training")
    name = f"AutoCapture: {opt.__name__}.step\n  State: captured\n"
    assert (name + "  Compiles: 1\n" in report) == (opt is torch.optim.AdamW), report
    assert name in report and "AutoCapture: MLP.forward\n  State: captured\n" in report


@pytest.mark.parametrize("make", [MLP, Scanned], ids=["mlp", "scanned"])
def test_sharded_parameters_keep_their_shardings(make):
    """FSDP-style marks over the 8-device mesh: captured steps keep every weight's sharding and
    AdamW's moments follow it, also where ``scan_layers`` stacked the layers (the stack is one
    input of the captured step's program); the losses are lazy's."""
    xr.use_spmd()
    try:
        mesh = xs.Mesh(np.arange(8), (8,), ("fsdp",))
        torch.manual_seed(0)
        models = [make().to(dev) for _ in range(2)]
        models[1].load_state_dict(models[0].state_dict())
        for model in models:
            for p in model.parameters():
                if p.dim() == 2 and p.shape[0] % 8 == 0:
                    xs.mark_sharding(p, mesh, ("fsdp", None))
        spec = spmd_torch._XLAC._get_xla_sharding_spec
        marked = {
            n: spec(p)
            for n, p in models[1].named_parameters()
            if p.dim() == 2 and p.shape[0] % 8 == 0
        }
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
        lazy = _train(models[0], opts[0], "mlp")
        spmd_torch.auto_capture(True)
        try:
            captured = _train(models[1], opts[1], "mlp")
            name = make.__name__
            assert capture.callables() == {"captured": [f"{name}.forward", "AdamW.step"]}
        finally:
            spmd_torch.auto_capture(False)
        assert_close(captured, lazy, **LAZY)
        for name, p in models[1].named_parameters():
            if name in marked:
                assert spec(p) == marked[name] != "{replicated}", name
                assert spec(opts[1].state[p]["exp_avg"]) == marked[name], name
    finally:
        xr.reset()


def _scaled_fp16_loop(model) -> tuple[torch.Tensor, dict]:
    """amp.md's float16 loop: autocast, GradScaler, a sync-free optimizer taking found_inf."""
    opt = amp.syncfree.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = amp.GradScaler()
    losses = []
    for x, y in _batches("mlp"):
        with amp.autocast(dev, dtype=torch.float16):
            loss = _loss(model, x.to(dev), y.to(dev))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        xm.mark_step()
        losses.append(loss.detach())
    return torch.stack([loss.cpu() for loss in losses]), capture.callables()


def test_grad_scaler_and_autocast():
    """float16 autocast with GradScaler and syncfree SGD (the scaler passes found_inf to the
    captured step): the losses are lazy's."""
    torch.manual_seed(0)
    models = [Tiny().to(dev) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    lazy, _ = _scaled_fp16_loop(models[0])
    spmd_torch.auto_capture(True)
    try:
        captured, states = _scaled_fp16_loop(models[1])
    finally:
        spmd_torch.auto_capture(False)
    assert states == {"captured": ["Tiny.forward", "SGD.step"]}
    assert_close(captured, lazy, **LAZY)


def _replica_loop(index: int, make, opt) -> list[float]:
    """PyTorch/XLA's per-device loop: each replica its own data, xm.optimizer_step averaging."""
    torch.manual_seed(0)
    model = make().to(xm.xla_device())
    opt = opt(model.parameters())
    g = torch.Generator().manual_seed(index)
    losses = []
    for _ in range(6):
        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad()
        loss = _loss(model, x.to(xm.xla_device()), y.to(xm.xla_device()))
        loss.backward()
        xm.optimizer_step(opt)
        xm.mark_step()
        losses.append(loss.detach())
    return [loss.item() for loss in losses] + [capture.callables().get("captured", [])]


@pytest.mark.parametrize(
    "make, opt",
    [
        pytest.param(MLP, functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), id="mlp-sgd"),
        # AdamW: Dynamo moves its counters mid-trace, where no replica may pass its turn
        pytest.param(Scanned, functools.partial(torch.optim.AdamW, lr=1e-2), id="scanned-adamw"),
    ],
)
def test_replicas_of_launch_capture_one_shared_program(make, opt):
    """xmp.spawn(nprocs=4): every replica captures its model and optimizer; their steps stay one
    program (the replicas' recordings of a graph are equal), and each replica's losses are
    lazy's."""
    lazy = xmp.spawn(_replica_loop, args=(make, opt), nprocs=4)
    spmd_torch.auto_capture(True)
    try:
        captured = xmp.spawn(_replica_loop, args=(make, opt), nprocs=4)
    finally:
        spmd_torch.auto_capture(False)
    step = f"{opt.func.__name__}.step"
    for k in range(4):
        *losses, names = captured[k]
        assert {f"{make.__name__}.forward", step} <= set(names)
        assert_close(torch.tensor(losses), torch.tensor(lazy[k][:-1]), **LAZY)


def test_backend_failure_falls_back_to_lazy(monkeypatch):
    """The backend raising on a graph: the call still gives lazy's result (Dynamo runs the graph
    as it is), the callable goes back to lazy tracing for good, and the report says why."""

    def broken(gm, example_inputs):
        raise RuntimeError("no lowering for this graph")

    monkeypatch.setattr(dynamo_bridge, "spmd_torch_backend", broken)
    states, _, report = _three_ways(Tiny, "mlp", opt=torch.optim.SGD)
    assert states == {"lazy": ["Tiny.forward", "SGD.step"]}
    assert "Reason: the backend failed: RuntimeError: no lowering for this graph" in report
    assert met.counter_value("AutoCaptureFallback") >= 2


@config.override(SPMD_TORCH_AUTO_CAPTURE_RECOMPILES=1)
def test_recompiling_every_step_falls_back():
    """A batch size that changes every step: past the recompile budget the forward goes back to
    lazy tracing (no thrashing), saying so; the results stay eager's."""
    torch.manual_seed(0)
    cpu = Tiny()
    model = copy.deepcopy(cpu).to(dev)
    spmd_torch.auto_capture(True)
    try:
        for batch in (8, 8, 8, 9, 10, 11, 12):
            x = torch.randn(batch, 32)
            out = model(x.to(dev))
            xm.mark_step()
            assert_close(out.cpu(), cpu(x), tol="training")
        assert capture.callables() == {"lazy": ["Tiny.forward"]}
        assert "SPMD_TORCH_AUTO_CAPTURE_RECOMPILES=1" in capture.report()
    finally:
        spmd_torch.auto_capture(False)


def test_off_leaves_everything_lazy_and_installs_nothing():
    """Capture is opt-in: off (the default) no hook is installed and nothing is captured; turned
    off, the captured callables are lazy again."""
    assert config.AUTO_CAPTURE.default is False and not capture.enabled()
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    assert capture._module_called not in hooks.values()
    torch.manual_seed(0)
    model = Tiny().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    graphs, captured = _dynamo_graphs(), met.counter_value("AutoCaptured")
    _train(model, opt, "mlp")
    assert model._compiled_call_impl is None and "step" not in vars(opt)
    assert (_dynamo_graphs(), met.counter_value("AutoCaptured")) == (graphs, captured)
    spmd_torch.auto_capture(True)
    _train(model, opt, "mlp")
    assert model._compiled_call_impl is not None and "step" in vars(opt)
    spmd_torch.auto_capture(False)
    assert model._compiled_call_impl is None and "step" not in vars(opt)
    assert capture._module_called not in hooks.values()


def test_a_step_the_user_compiled_is_left_alone():
    """The user's own torch.compile'd step (forward and optimizer step inside): the hooks see
    no top-level call, so nothing is wrapped twice."""
    torch.manual_seed(0)
    model = Tiny().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @torch.compile(backend="spmd_torch")
    def step(x, y):
        opt.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        return loss

    spmd_torch.auto_capture(True)
    try:
        for x, y in _batches("mlp", 5):
            step(x.to(dev), y.to(dev))
            xm.mark_step()
        assert "captured" not in capture.callables()
        assert model._compiled_call_impl is None and "step" not in vars(opt)
    finally:
        spmd_torch.auto_capture(False)


def _captured_step_program(make, **adamw):
    """(the program of one more captured step, as pending before its barrier, the model, its
    AdamW) after the loop has run with capture on."""
    torch.manual_seed(0)
    model = make().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **adamw)
    spmd_torch.auto_capture(True)
    try:
        _train(model, opt, "mlp")
        opt.zero_grad()
        _loss(model, *(t.to(dev) for t in next(_batches("mlp")))).backward()
        opt.step()
        program = debug_graph.pending_program()
        xm.mark_step()
    finally:
        spmd_torch.auto_capture(False)
    return program, model, opt


def test_a_captured_optimizer_updates_scanned_layers_stack_by_stack():
    """AdamW's step over ``scan_layers``' stacked layers is captured, and its program reads and
    writes each stack whole (the members of a stack, given together, are recorded as the members
    of one placeholder stack): no slice of a layer read or written apart, as in the lazy step.
    The losses equal lazy's and eager's, and steady steps compile nothing."""
    states, counts, _ = _three_ways(Scanned, "mlp")
    assert states["captured"] == ["Scanned.forward", "AdamW.step"]
    assert counts[3] == counts[-1], f"recompiled in steady state: {counts}"

    program = _captured_step_program(Scanned)[0]
    templates = [
        node.args[1]
        for node in program.nodes
        if node.op in (compiled.GRAPH, compiled.GRAPH_WITH_COLLECTIVES)
    ]
    step = [t for t in templates if t.stack_writes]
    assert len(step) == 1  # the optimizer's
    # the layers' weights and biases, their two moments each, and every parameter's counter
    assert len(step[0].stack_writes) == 7
    ops = {str(node.op) for node in step[0].program.nodes}
    assert "aten.select_scatter.default" not in ops  # no member written apart
    selects = [node for node in step[0].program.nodes if node.op is torch.ops.aten.select.int]
    # read apart: only the per-parameter scalars made from the counters, no layer's slice
    assert all(node.avals[0].shape == () for node in selects)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_captured_step_reads_its_step_counters_as_one_array(fused):
    """Dynamo moves AdamW's CPU step counters to the device before it traces the step (a fused
    step's are there already); there they become the members of one stack, so the step's
    program reads and writes one array of all the counters, not a 0-dim array per parameter
    (148 of GPT-2's 595 program inputs)."""
    program, model, opt = _captured_step_program(MLP, fused=fused)
    leaves = [ref[0].avals[ref[1]].shape for ref in program.leaves]
    counters = len(list(model.parameters()))
    assert leaves.count(()) == 0 and leaves.count((counters,)) == 1, leaves
    steps = [opt.state[p]["step"] for p in model.parameters()]
    assert stacks.stack_of(steps) is not None
    assert [float(t) for t in steps] == [STEPS + 1] * counters


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_a_module_the_user_compiled_is_left_alone():
    """``torch.compile(model)`` in a lazy loop: the compiled module is left to the user (said in
    the report), the optimizer's step is captured."""
    torch.manual_seed(0)
    model = Tiny().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="spmd_torch")
    spmd_torch.auto_capture(True)
    try:
        _train(compiled, opt, "mlp")
        states = capture.callables()
        assert states == {"left alone": ["OptimizedModule.forward"], "captured": ["SGD.step"]}
        assert "Reason: torch.compile(module) wraps it" in capture.report()
    finally:
        spmd_torch.auto_capture(False)


def test_the_environment_variable_turns_it_on_without_importing_dynamo():
    """SPMD_TORCH_AUTO_CAPTURE=1 installs the hooks at import; Dynamo waits for a capture."""
    code = (
        "import sys, spmd_torch\n"
        "from spmd_torch.core import auto_capture\n"
        "assert auto_capture.enabled() and 'torch._dynamo' not in sys.modules\n"
    )
    env = {**os.environ, "SPMD_TORCH_AUTO_CAPTURE": "1"}
    run = [sys.executable, "-c", code]
    result = subprocess.run(run, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
