"""``torch.compile(..., backend='spmd_torch')`` (and PyTorch's ``openxla`` backends through the
``torch_xla`` name) against eager CPU: training and eval of an MLP, a CNN and a small GPT, step
after step, with no recompile once warm; sharded parameters keep their layout; graph breaks and
graphs that cannot be recorded still give the right answer; the PRNG key threads through
compiled graphs as through traced code; a compiled ``xm.all_reduce`` inside ``launch``."""

from __future__ import annotations

import copy
import gc
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters as dynamo_counters

import spmd_torch
import spmd_torch.amp as amp
import spmd_torch.core.xla_model as xm
import spmd_torch.debug.graph as graph
import spmd_torch.distributed.spmd as xs
from spmd_torch import runtime as xr
from tests.helpers import assert_close, assert_compiles, run_example, to_cpu
from tests.models.test_training import MLP

dev = spmd_torch.device()


class CNN(nn.Module):
    """Convolutions, pooling and batch norm (whose running statistics the forward updates)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1, bias=False)  # batch norm follows
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3)
        self.fc = nn.Linear(16 * 2 * 2, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.avg_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(torch.flatten(x, 1))


class GPT(nn.Module):
    """A two-layer decoder: token and position embeddings, causal attention through
    ``scaled_dot_product_attention``, layer norms and a GELU MLP, a head tied to the embedding."""

    def __init__(self, vocab=64, d=32, heads=4, seq=16, layers=2):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                dict(
                    ln1=nn.LayerNorm(d),
                    qkv=nn.Linear(d, 3 * d, bias=False),  # a key bias has no gradient
                    proj=nn.Linear(d, d),
                    ln2=nn.LayerNorm(d),
                    up=nn.Linear(d, 4 * d),
                    down=nn.Linear(4 * d, d),
                )
            )
            for _ in range(layers)
        )
        self.ln = nn.LayerNorm(d)

    def forward(self, idx):
        b, t = idx.shape
        x = self.tok(idx) + self.pos[:t]
        for blk in self.blocks:
            q, k, v = blk.qkv(blk.ln1(x)).chunk(3, dim=-1)
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk.proj(y.transpose(1, 2).reshape(b, t, -1))
            x = x + blk.down(F.gelu(blk.up(blk.ln2(x))))
        return self.ln(x) @ self.tok.weight.t()


def _batches(kind: str, steps: int):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        if kind == "mlp":
            yield torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        elif kind == "cnn":
            yield torch.randn(8, 1, 14, 14, generator=g), torch.randint(0, 10, (8,), generator=g)
        else:
            tokens = torch.randint(0, 64, (4, 17), generator=g)
            yield tokens[:, :-1], tokens[:, 1:]


MODELS = {"mlp": MLP, "cnn": CNN, "gpt": GPT}


def _loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _compiled_step(model, opt):
    """The training step as PyTorch/XLA's dynamo guide writes it, under the spmd_torch backend."""

    def step(x, y):
        opt.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        return loss

    return torch.compile(step, backend="spmd_torch")


@pytest.mark.parametrize("kind", ["mlp", "cnn", "gpt"])
def test_training_step_compiled_whole_matches_eager(kind):
    """zero_grad, forward, backward and AdamW's step inside one compiled function: the losses,
    the weights and the optimizer state equal eager CPU's; no recompile once warm."""
    torch.manual_seed(0)
    cpu_model = MODELS[kind]()
    model = copy.deepcopy(cpu_model).to(dev)
    cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    compiled = _compiled_step(model, opt)
    losses, expected = [], []
    for k, (x, y) in enumerate(_batches(kind, 6)):
        if k == 3:  # warm: the first steps made AdamW's state and recorded every graph
            graphs = dynamo_counters["stats"]["unique_graphs"]
            compiles = spmd_torch.debug.metrics.metric_data("CompileTime")[0]
        losses.append(compiled(x.to(dev), y.to(dev)))
        xm.mark_step()
        cpu_opt.zero_grad()
        expected.append(_loss(cpu_model, x, y))
        expected[-1].backward()
        cpu_opt.step()
    assert dynamo_counters["stats"]["unique_graphs"] == graphs
    assert spmd_torch.debug.metrics.metric_data("CompileTime")[0] == compiles
    assert_close(
        torch.stack([v.cpu() for v in losses]), torch.stack(expected).detach(), tol="training"
    )
    for (name, p), q in zip(model.named_parameters(), cpu_model.parameters()):
        assert_close(p.cpu(), q.detach(), tol="training")
    # Dynamo made the optimizer capturable, as on CUDA: its step counters live on the device.
    assert all(s["step"].device.type == "xla" for s in opt.state.values())
    moments = [s["exp_avg"] for s in opt.state.values()]
    cpu_moments = [s["exp_avg"] for s in cpu_opt.state.values()]
    assert_close(to_cpu(moments), cpu_moments, tol="training")


def test_eval_of_a_module():
    """A compiled module in eval mode (batch norm reading its running statistics) gives eager's
    outputs, for two batch sizes (two recordings of the same graph)."""
    torch.manual_seed(0)
    cpu_model = CNN().eval()
    for x, _ in _batches("cnn", 1):
        cpu_model.train()(x)  # running statistics that are not the initial ones
    cpu_model.eval()
    model = copy.deepcopy(cpu_model).to(dev)
    compiled = torch.compile(model, backend="spmd_torch")
    with torch.no_grad():
        for batch in (8, 3):
            x = torch.randn(batch, 1, 14, 14)
            assert_close(compiled(x.to(dev)).cpu(), cpu_model(x), tol="training")


def test_batch_norm_statistics_written_in_place():
    """The compiled forward of a training-mode CNN updates batch norm's running statistics (an
    input mutated by the graph) as eager does."""
    torch.manual_seed(0)
    cpu_model = CNN()
    model = copy.deepcopy(cpu_model).to(dev)
    compiled = torch.compile(model, backend="spmd_torch")
    for x, _ in _batches("cnn", 3):
        compiled(x.to(dev)).sum().backward()
        cpu_model(x).sum().backward()
        xm.mark_step()
    assert_close(model.bn1.running_mean.cpu(), cpu_model.bn1.running_mean, tol="training")
    assert_close(model.bn1.running_var.cpu(), cpu_model.bn1.running_var, tol="training")
    assert model.bn1.num_batches_tracked.item() == 3


def test_xla_autocast_entered_inside_a_compiled_function():
    """``spmd_torch.amp.autocast`` entered inside the compiled function (as a training step under
    autocast writes it): the linear layer runs in bfloat16, softmax in float32, as eager CPU with
    the casts written out (reference in float32, rounded to bfloat16 once)."""
    torch.manual_seed(0)
    layer, x = nn.Linear(16, 8), torch.randn(4, 16)

    def forward(layer, x):
        with amp.autocast(dev):
            y = layer(x)
            return y, torch.softmax(y, dim=-1)

    y, p = torch.compile(forward, backend="spmd_torch")(copy.deepcopy(layer).to(dev), x.to(dev))
    w, b = (t.bfloat16().float() for t in (layer.weight, layer.bias))
    expected = F.linear(x.bfloat16().float(), w, b).bfloat16()
    assert (y.dtype, p.dtype) == (torch.bfloat16, torch.float32)
    torch.testing.assert_close(y.cpu(), expected, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(p.cpu(), torch.softmax(expected.float(), -1), rtol=2e-2, atol=1e-2)


def test_a_step_of_compiled_calls_runs_as_one_program():
    """A compiled forward and backward and an uncompiled optimizer step wait for the barrier and
    run there as one program. A loop of compiled steps with no barrier runs each iteration when
    the next one calls the same graph, as PyTorch/XLA's loops need no mark_step: one program per
    iteration, the same one, and the graph never grows past one iteration."""
    torch.manual_seed(0)
    model = MLP().to(dev)
    cpu_model = copy.deepcopy(model).cpu()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cpu_opt = torch.optim.SGD(cpu_model.parameters(), lr=0.1, momentum=0.9)
    loss_of = torch.compile(lambda x, y: F.cross_entropy(model(x), y), backend="spmd_torch")
    runs = lambda: (spmd_torch.debug.metrics.metric_data("ExecuteTime") or [0])[0]  # noqa: E731
    for x, y in _batches("mlp", 3):
        opt.zero_grad()
        before = runs()
        loss = loss_of(x.to(dev), y.to(dev))
        loss.backward()
        opt.step()
        assert runs() == before and graph.pending_count() > 0
        xm.mark_step()
        assert runs() == before + 1 and graph.pending_count() == 0
        cpu_opt.zero_grad()
        expected = F.cross_entropy(cpu_model(x), y)
        expected.backward()
        cpu_opt.step()
        assert_close(loss.cpu(), expected.detach(), tol="training")

    step = _compiled_step(model, opt)
    step(*(t.to(dev) for t in next(_batches("mlp", 1))))
    xm.mark_step()
    before, pending = runs(), []
    for k, (x, y) in enumerate(_batches("mlp", 4)):
        step(x.to(dev), y.to(dev))
        assert runs() == before + k  # the iteration before this one ran as it began
        pending.append(graph.pending_count())
    assert len(set(pending)) == 1 and pending[0] > 0
    with assert_compiles(0):
        xm.mark_step()


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.linear(x)) + x


def test_a_graph_called_once_per_layer_waits_for_the_barrier():
    """Blocks compiled one by one share one graph (Dynamo passes each block's parameters in), so
    it is called once per layer. The first step runs each call as the next one comes (nothing
    tells a layer from a loop yet); once a barrier has ended a step of those calls, a step is one
    program. A loop of such steps with no barrier runs a step's 4 calls at a time, one program
    (the same) per iteration."""
    torch.manual_seed(0)
    blocks = nn.ModuleList([_Block() for _ in range(4)])
    x = torch.randn(8, 16)
    with torch.no_grad():
        expected = x
        for block in blocks:
            expected = block(expected)
    blocks.to(dev)
    for block in blocks:
        block.compile(backend="spmd_torch")

    def forward():
        h = x.to(dev)
        for block in blocks:
            h = block(h)
        return h

    runs = lambda: (spmd_torch.debug.metrics.metric_data("ExecuteTime") or [0])[0]  # noqa: E731
    forward()  # Dynamo's first calls: a graph per block until it sees they share one
    xm.mark_step()
    for _ in range(2):
        before = runs()
        out = forward()
        assert runs() == before and graph.pending_count() > 0
        xm.mark_step()
        assert runs() == before + 1
    assert_close(out.cpu(), expected)
    before = runs()
    with assert_compiles(0):
        for k in range(3):
            out = forward()
            assert runs() == before + k  # the iteration before this one ran as it began
        xm.mark_step()
    assert_close(out.cpu(), expected)


def test_a_call_through_pytorch_xlas_bridge_runs_at_once():
    """PyTorch's openxla backends reach spmd_torch through PyTorch/XLA's bridge entry: there each
    call runs at once (its outputs are data when it returns), as PyTorch/XLA's does."""
    from spmd_torch.core.dynamo_bridge import extract_compiled_graph

    f = torch.compile(lambda t: torch.cos(t) + 1, backend=extract_compiled_graph)
    runs = lambda: (spmd_torch.debug.metrics.metric_data("ExecuteTime") or [0])[0]  # noqa: E731
    x = torch.randn(6)
    f(x.to(dev))
    before = runs()
    out = f(x.to(dev))
    assert runs() == before + 1 and graph.pending_count() == 0
    assert_close(out.cpu(), torch.cos(x) + 1)


def test_a_call_in_eager_mode_runs_at_once():
    f = torch.compile(lambda t: torch.sin(t) * 3, backend="spmd_torch")
    x = torch.randn(5)
    with spmd_torch.experimental.eager_mode_context(True):
        out = f(x.to(dev))
        assert graph.pending_count() == 0
    assert_close(out.cpu(), torch.sin(x) * 3)


def test_sharded_parameters_keep_their_sharding():
    """FSDP-style marks over 8 devices: the compiled step keeps every weight's and every AdamW
    moment's layout, and the losses equal eager's."""
    xr.use_spmd()
    try:
        mesh = xs.Mesh(np.arange(8), (8,), ("fsdp",))
        torch.manual_seed(0)
        cpu_model = MLP()
        model = copy.deepcopy(cpu_model).to(dev)
        for p in model.parameters():
            if p.dim() == 2:
                xs.mark_sharding(p, mesh, ("fsdp", None))
        specs = {n: spmd_torch._XLAC._get_xla_sharding_spec(p) for n, p in model.named_parameters()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=1e-2)

        step = _compiled_step(model, opt)
        for x, y in _batches("mlp", 3):
            loss = step(x.to(dev), y.to(dev))
            xm.mark_step()
            cpu_opt.zero_grad()
            expected = F.cross_entropy(cpu_model(x), y)
            expected.backward()
            cpu_opt.step()
            assert_close(loss.cpu(), expected.detach(), tol="training")
        for name, p in model.named_parameters():
            # Marked weights keep their mark; unmarked biases, written by the steps, read as
            # PyTorch/XLA's program outputs do.
            expected_spec = specs[name] if p.dim() == 2 else "{replicated}"
            assert spmd_torch._XLAC._get_xla_sharding_spec(p) == expected_spec, name
            if p.dim() == 2:  # marked: AdamW's moments follow the mark
                moment = opt.state[p]["exp_avg"]
                assert spmd_torch._XLAC._get_xla_sharding_spec(moment) == specs[name], name
    finally:
        xr.reset()


def test_graph_break_gives_the_right_answer():
    """A host read in the middle breaks the graph in two; the result is eager's."""

    def f(x):
        y = torch.sin(x) * 2
        if y.sum().item() > 0:  # a value the graph depends on: Dynamo breaks here
            return torch.cos(y) + 1
        return torch.tanh(y) - 1

    compiled = torch.compile(f, backend="spmd_torch")
    for sign in (1.0, -1.0):
        x = torch.linspace(0.1, 1.0, 12).reshape(3, 4) * sign
        assert_close(compiled(x.to(dev)).cpu(), f(x))


def test_a_graph_of_meta_tensors_runs_as_it_is():
    """Meta tensors carry shapes, no values: the compiled graph runs on them as it is (nothing
    uploaded), as a library checks output shapes before the real call (PyTorch/XLA's kernel
    tests do); the same function then runs on xla tensors."""

    def f(x, w):
        return torch.nn.functional.linear(x, w).relu() * 2

    compiled = torch.compile(f, backend="spmd_torch")
    out = compiled(torch.empty(5, 3, device="meta"), torch.empty(4, 3, device="meta"))
    assert out.is_meta and out.shape == (5, 4)
    x, w = torch.randn(5, 3), torch.randn(4, 3)
    assert_close(compiled(x.to(dev), w.to(dev)).cpu(), f(x, w))


@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
def test_graph_with_data_dependent_shape_runs_op_by_op():
    """``nonzero`` inside a graph (Dynamo told to keep such ops): it cannot be recorded once for
    every call, so it runs op by op (with a warning), and gives eager's result at each call."""

    def f(x):
        return (x[torch.nonzero(x > 0, as_tuple=True)] * 3).sum() + x.mean()

    compiled = torch.compile(f, backend="spmd_torch")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for values in ([1.0, -2.0, 3.0, 4.0], [-1.0, 2.0, -3.0, -4.0]):
            x = torch.tensor(values)
            assert_close(compiled(x.to(dev)).cpu(), f(x))
    assert any("op by op" in str(w.message) for w in caught)


def test_random_numbers_match_traced_code():
    """Dropout inside a compiled graph draws from the device PRNG key as traced code does: the
    same seed gives the same numbers compiled or not, and each call new ones."""

    def f(x):
        return F.dropout(x, p=0.5, training=True) + torch.rand_like(x)

    compiled = torch.compile(f, backend="spmd_torch")
    x = torch.ones(64, 8).to(dev)
    xm.set_rng_state(7)
    first, second = compiled(x).cpu(), compiled(x).cpu()
    xm.set_rng_state(7)
    assert_close(first, f(x).cpu(), tol="exact")
    assert_close(second, f(x).cpu(), tol="exact")
    assert not torch.equal(first, second)


def test_compiled_all_reduce_in_replicas():
    """PyTorch/XLA's test_mp_replication pattern: ``xm.all_reduce`` in a function compiled with
    ``fullgraph=True``, called in every replica of launch."""

    def all_reduce(t):
        return xm.all_reduce(xm.REDUCE_SUM, t)

    compiled = torch.compile(all_reduce, backend="spmd_torch", fullgraph=True)

    def replica(index):
        x = torch.full((2, 3), float(index + 1)).to(xm.xla_device())
        return compiled(x).cpu(), compiled(x * 2).cpu()

    results = spmd_torch.launch(replica)
    total = sum(k + 1 for k in results)
    for once, twice in results.values():
        assert_close(once, torch.full((2, 3), float(total)), tol="exact")
        assert_close(twice, torch.full((2, 3), 2.0 * total), tol="exact")


def test_openxla_backend_with_the_torch_xla_name(tmp_path):
    """A PyTorch/XLA script as written, run through ``spmd_torch.run_as_torch_xla``: PyTorch's
    own ``openxla`` (training) and ``openxla_eval`` backends reach spmd_torch's bridge."""
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            import torch_xla
            import torch_xla.core.xla_model as xm
            torch.manual_seed(0)
            cpu = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
            model.load_state_dict(cpu.state_dict())
            model = model.to(torch_xla.device())
            x = torch.randn(5, 8)
            with torch.no_grad():
                out = torch.compile(model, backend="openxla_eval")(x.to(torch_xla.device()))
            assert torch.allclose(out.cpu(), cpu(x), atol=1e-5)
            torch.compile(model, backend="openxla")(x.to(torch_xla.device())).sum().backward()
            cpu(x).sum().backward()
            assert torch.allclose(model[0].weight.grad.cpu(), cpu[0].weight.grad, atol=1e-5)
            print("ok")
            """
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "spmd_torch.run_as_torch_xla", str(script)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


@pytest.mark.multiprocess
def test_compiled_mnist_example_trains_as_the_traced_one():
    """examples/mnist_compile.py (the step under torch.compile, no mark_step) prints the losses
    examples/mnist.py prints (traced lazily, dropout included: the same PRNG stream)."""
    compiled = run_example("mnist_compile.py", "--steps", "12")
    traced = run_example("mnist.py", "--steps", "12")
    losses = [line for line in compiled.splitlines() if line.startswith("step")]
    assert len(losses) == 3
    assert losses == [line for line in traced.splitlines() if line.startswith("step")]
    assert "3 compilations" in compiled


def test_mark_sharding_inside_traced_graphs():
    """PyTorch/XLA's in-graph mark (``torch.ops.xla.dynamo_mark_sharding``, what
    ``xs.mark_sharding`` becomes while a graph is traced): called directly, inside a function
    compiled by Dynamo, and through ``MarkShardingFunction`` under ``aot_function`` with another
    compiler, the marked tensors (and the gradient) come out sharded, the values eager's."""
    from functorch.compile import aot_function, make_boxed_func

    xr.use_spmd()
    try:
        mesh = xs.Mesh(np.arange(8), (8,), ("x",))
        spec = lambda t: spmd_torch._XLAC._get_xla_sharding_spec(t)  # noqa: E731
        w = torch.randn(8, 4).to(dev)
        torch.ops.xla.dynamo_mark_sharding(w, list(range(8)), [8], "('x',)", "('x', None)")
        assert spec(w).startswith("{devices=[8,1]")

        @torch.compile(backend="spmd_torch")
        def f(t):
            h = torch.sin(t) * 2 + 1
            xs.mark_sharding(h, mesh, (None, "x"))
            return h

        x = torch.randn(4, 8)
        out = f(x.to(dev))
        assert spec(out).startswith("{devices=[1,8]")  # unmarked, it comes out replicated ('')
        assert_close(out.cpu(), torch.sin(x) * 2 + 1)

        # the graph's own input marked (its backward graph's input too, as FSDPv2's
        # shard_output meets it): a constraint inside the program, where there is no data yet
        @torch.compile(backend="spmd_torch")
        def scale(t):
            xs.mark_sharding(t, mesh, ("x", None))
            return t * 3

        u = torch.randn(8, 4).to(dev).requires_grad_(True)
        scaled = scale(u)
        scaled.sum().backward()
        xm.mark_step()
        assert spec(scaled).startswith("{devices=[8,1]")
        assert_close(scaled.cpu(), u.detach().cpu() * 3)
        assert_close(u.grad.cpu(), torch.full((8, 4), 3.0))

        def g(t):
            return xs.MarkShardingFunction.apply(torch.cos(t), mesh, ("x",)) * 3

        v = torch.randn(8).to(dev).requires_grad_(True)
        y = aot_function(g, lambda gm, _: make_boxed_func(gm))(v)
        y.sum().backward()
        xm.mark_step()
        assert spec(y).startswith("{devices=[8]") and spec(v.grad).startswith("{devices=[8]")
        assert_close(v.grad.cpu(), -3 * torch.sin(v.detach().cpu()))
    finally:
        xr.reset()


def test_a_finished_engine_takes_its_call_count_with_it():
    """A compiled graph counts its calls per step per engine; an engine that finished (a replica's)
    leaves no count behind that a later engine at the same address would inherit."""
    from spmd_torch._lazy import engine, modes

    double = torch.compile(lambda x: x * 2 + 1, backend="spmd_torch")
    spare = engine.Engine(modes.PerDevice(), cache=engine.current().cache)
    with engine.running(spare):
        y = double(torch.ones(3, device=spmd_torch.device()))
        template = y._ref()[0].args[1]
        assert list(template.calls) == [spare]
        assert y.cpu().tolist() == [3.0, 3.0, 3.0]
    del spare, y
    gc.collect()
    assert list(template.calls) == []


def _scale_all(xs):
    torch._foreach_mul_(xs, 0.5)


def _touch_some(xs):
    """Reads every member, writes two."""
    xs[1].mul_(xs[0])
    xs[3].add_(xs[2])


def test_a_graph_given_every_member_of_a_stack_takes_the_stack_whole():
    """A graph given all members of a stack (``scan_layers``' layers) records them as one
    placeholder stack, one input and one output of its program: a foreach update of every
    member comes back as the new stack itself, and in-place writes to some members only leave
    the others as they were."""
    from spmd_torch._lazy import compiled, stacks

    g = torch.Generator().manual_seed(3)
    cpu = [torch.randn(3, 5, generator=g) for _ in range(4)]
    members = [t.to(spmd_torch.device()) for t in cpu]
    assert stacks.restack(members) is not None
    for step in (_scale_all, _touch_some, _scale_all):
        torch.compile(step, backend="spmd_torch", dynamic=False)(members)
        (node,) = [n for n in graph.pending_program().nodes if n.op is compiled.GRAPH]
        template = node.args[1]
        assert len(template.stack_writes) == 1 and not template.writes  # the stack, whole
        ops = {str(n.op) for n in template.program.nodes}
        assert ("aten.select_scatter.default" in ops) == (step is _touch_some), ops
        xm.mark_step()
        step(cpu)
    assert stacks.stack_of(members) is not None  # still the members of one stack
    assert_close(members, cpu)
