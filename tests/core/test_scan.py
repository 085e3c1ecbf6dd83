"""scan, scan_layers, fori_loop and while_loop against the Python loops they replace (eager CPU,
outputs and gradients): lazily traced, under torch.compile, under SPMD with sharded layers and
in launch's replicas; the program holds one iteration whatever the trip count; bad input raises
naming the layer or the shape."""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref

import jax
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._higher_order_ops.while_loop import while_loop as torch_while_loop

import spmd_torch
import spmd_torch.distributed.spmd as xs
import spmd_torch.distributed.xla_multiprocessing as xmp
import spmd_torch.runtime as xr
from spmd_torch._lazy import stacks
from spmd_torch.debug import graph
from spmd_torch.experimental.fori_loop import fori_loop, while_loop
from spmd_torch.experimental.scan import scan, tree_flatten_none, value_and_grad_partitioned
from spmd_torch.experimental.scan_layers import _structure, scan_layers
from tests.helpers import assert_close, assert_compiles

dev = spmd_torch.device()
D, HEADS = 16, 2


class MLP(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.dropout(self.down(torch.tanh(self.up(x))))


class Decoder(nn.Module):
    """A pre-norm transformer block: causal attention (SDPA), layer norms, an MLP."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(*qkv.unbind(0), is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, s, D))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


def _stack(kind: str, layers: int = 3) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList((MLP if kind == "mlp" else Decoder)() for _ in range(layers))


def _unrolled(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def _loss(out):
    return (out * out).sum()


def _compare_with_cpu(layers_cpu, run, x=None):
    """``run(xla_layers, x)`` against the unrolled loop on CPU: output, input and weight grads."""
    x = torch.randn(2, 4, D) if x is None else x
    layers = copy.deepcopy(layers_cpu).to(dev)
    xd = x.to(dev).requires_grad_()
    out = run(layers, xd)
    _loss(out).backward()
    want_x = x.clone().requires_grad_()
    want = _unrolled(layers_cpu, want_x)
    _loss(want).backward()
    spmd_torch.sync()
    assert_close(out, want.detach())
    assert_close(xd.grad, want_x.grad, kind="grad")
    for (name, p), q in zip(layers.named_parameters(), layers_cpu.parameters()):
        assert_close(p.grad, q.grad, kind="grad"), name
    return layers


def _policy(name: str | None):
    if name == "min_cut":
        from functorch.compile import min_cut_rematerialization_partition

        return min_cut_rematerialization_partition
    return None if name is None else getattr(jax.checkpoint_policies, name)


@pytest.mark.parametrize(
    "kind, policy",
    [("mlp", None), ("mlp", "nothing_saveable"), ("decoder", None), ("decoder", "min_cut")],
)
def test_scan_layers_matches_the_unrolled_loop(kind, policy):
    partition = _policy(policy)
    _compare_with_cpu(
        _stack(kind), lambda layers, x: scan_layers(layers, x, partition_fn=partition)
    )


def test_scan_with_pytrees_and_a_closed_over_weight_matches_the_python_loop():
    torch.manual_seed(1)
    w_cpu = (torch.randn(D, D) / 4).requires_grad_()
    init_cpu = (torch.randn(3, D, requires_grad=True), torch.zeros(3, D))
    xs_cpu = {"w": (torch.randn(5, D, D) / 4).requires_grad_(), "b": torch.randn(5, D)}

    def step(w):
        def fn(carry, x):
            h, total = carry
            h = torch.tanh(h @ x["w"] + x["b"]) @ w * 0.5
            return (h, total + h), (h.sum(-1), None)

        return fn

    def to_xla(t):
        return t.detach().to(dev).requires_grad_(t.requires_grad)

    w, init, xs_ = (
        to_xla(w_cpu),
        [to_xla(t) for t in init_cpu],
        {k: to_xla(v) for k, v in xs_cpu.items()},
    )
    (h, total), (ys, none) = scan(step(w), tuple(init), xs_)
    assert none is None
    (_loss(h) + _loss(total) + _loss(ys)).backward()

    carry, ys_cpu = init_cpu, []
    for i in range(5):
        carry, (y, _) = step(w_cpu)(carry, {k: v[i] for k, v in xs_cpu.items()})
        ys_cpu.append(y)
    (_loss(carry[0]) + _loss(carry[1]) + _loss(torch.stack(ys_cpu))).backward()
    spmd_torch.sync()
    assert_close(
        (h, total, ys), (carry[0].detach(), carry[1].detach(), torch.stack(ys_cpu).detach())
    )
    assert_close(
        (w.grad, init[0].grad, xs_["w"].grad),
        (w_cpu.grad, init_cpu[0].grad, xs_cpu["w"].grad),
        kind="grad",
    )


@pytest.mark.parametrize("kind, policy", [("decoder", None), ("mlp", "nothing_saveable")])
def test_scan_layers_under_torch_compile(kind, policy):
    layers_cpu = _stack(kind, 2)
    layers = copy.deepcopy(layers_cpu).to(dev)
    partition = _policy(policy)
    compiled = torch.compile(
        lambda x: scan_layers(layers, x * 2.0, partition_fn=partition), backend="spmd_torch"
    )
    for _ in range(2):  # the second call reuses what the first recorded
        layers.zero_grad(set_to_none=True)
        layers_cpu.zero_grad(set_to_none=True)
        x = torch.randn(2, 4, D)
        xd = x.to(dev).requires_grad_()
        out = compiled(xd)
        _loss(out).backward()
        want_x = x.clone().requires_grad_()
        want = _unrolled(layers_cpu, want_x * 2.0)
        _loss(want).backward()
        spmd_torch.sync()
        assert_close(out, want.detach())
        assert_close(xd.grad, want_x.grad, kind="grad")
        for p, q in zip(layers.parameters(), layers_cpu.parameters()):
            assert_close(p.grad, q.grad, kind="grad")


@pytest.mark.parametrize("kind, policy", [("mlp", None), ("decoder", "nothing_saveable")])
def test_scan_layers_keeps_the_layers_shardings_under_spmd(kind, policy):
    xr.use_spmd()
    mesh = xs.Mesh(np.arange(8), (2, 4), ("data", "model"))

    def run(layers, x):
        for layer in layers:
            xs.mark_sharding(layer.up.weight, mesh, ("model", None))
            xs.mark_sharding(layer.down.weight, mesh, (None, "model"))
        out = scan_layers(layers, x, partition_fn=_policy(policy))
        text = graph.pending_text()  # the stacks, computed first, laid out as the layers are
        assert "{_,model,_} = xla::device_data" in text and "{_,_,model} = xla::device_data" in text
        return out

    layers = _compare_with_cpu(_stack(kind, 2), run)
    for layer in layers:
        for p in (layer.up.weight, layer.down.weight):
            assert xs.get_xla_sharding_spec(p.grad) == xs.get_xla_sharding_spec(p)
    xr.reset()


def test_scan_layers_first_call_runs_the_program_of_every_later_call():
    """Layers holding data (initialised, restored) are stacked by a small program of their own
    before the first call's: that call's program is then every later call's, so an inference
    loop or a run resumed from a checkpoint compiles its step once, not twice."""
    layers_cpu = _stack("decoder", 4)
    layers = copy.deepcopy(layers_cpu).to(dev)
    xs_cpu = [torch.randn(2, 4, D) for _ in range(2)]
    inputs = [x.to(dev) for x in xs_cpu]
    spmd_torch.sync()
    with torch.no_grad(), assert_compiles(2):  # the stacks, then the scan
        first = scan_layers(layers, inputs[0])
        spmd_torch.sync()
    with torch.no_grad(), assert_compiles(0):
        second = scan_layers(layers, inputs[1])
        spmd_torch.sync()
    with torch.no_grad():
        want = [_unrolled(layers_cpu, x) for x in xs_cpu]
    assert_close([first.cpu(), second.cpu()], want)


def test_optimizer_state_loaded_beside_scanned_layers_joins_their_stacks():
    """An optimizer's state loaded from a state dict (a checkpoint's) holds a tensor per layer:
    the first step makes each kind of it a stack beside the layers' (computed apart, as the
    layers' stacks are), so that step's program is the one every later step runs, and the
    optimizer updates the state whole."""
    layers_cpu = _stack("mlp", 4)
    opt_cpu = torch.optim.AdamW(layers_cpu.parameters(), lr=0.01)
    x = torch.randn(2, 4, D)

    def step(layers, opt, run):
        opt.zero_grad()
        _loss(run(layers, x if run is _unrolled else x.to(dev))).backward()
        opt.step()

    step(layers_cpu, opt_cpu, _unrolled)  # the state to load
    layers = copy.deepcopy(layers_cpu).to(dev)
    opt = torch.optim.AdamW(layers.parameters(), lr=0.01)
    opt.load_state_dict(copy.deepcopy(opt_cpu.state_dict()))
    spmd_torch.sync()
    with assert_compiles(
        2
    ):  # the stacks (the layers' and the moments' alike: one program), the step
        step(layers, opt, scan_layers)
        spmd_torch.sync()
    with assert_compiles(0):
        step(layers, opt, scan_layers)
        spmd_torch.sync()
    for _ in range(2):
        step(layers_cpu, opt_cpu, _unrolled)
    weight = layers[2].up.weight
    assert stacks.member(opt.state[weight]["exp_avg"])[1] == 2  # layer 2's slice of a stack
    assert stacks.member(opt.state[weight]["exp_avg_sq"])[1] == 2
    assert_close([p.cpu() for p in layers.parameters()], list(layers_cpu.parameters()))
    assert_close(
        [opt.state[p]["exp_avg_sq"].cpu() for p in layers.parameters()],
        [opt_cpu.state[p]["exp_avg_sq"] for p in layers_cpu.parameters()],
    )


def test_a_sharded_optimizer_state_joins_stacks_laid_out_as_it_was():
    """State restored sharded like its parameters (as a checkpoint restores it) keeps that
    layout in its stacks, the stacked axis unsplit: AdamW's moments are not gathered whole onto
    every device."""
    xr.use_spmd()
    mesh = xs.Mesh(np.arange(8), (2, 4), ("data", "model"))
    layers = _stack("mlp", 4).to(dev)
    for layer in layers:
        xs.mark_sharding(layer.up.weight, mesh, ("model", None))
    opt = torch.optim.AdamW(layers.parameters(), lr=0.01)
    for p in layers.parameters():
        opt.state[p] = {"step": torch.tensor(1.0)}
        for key in ("exp_avg", "exp_avg_sq"):
            opt.state[p][key] = torch.full(p.shape, 0.01).to(dev)
            if p.dim() == 2 and p.shape[0] == 2 * D:  # up.weight's
                xs.mark_sharding(opt.state[p][key], mesh, ("model", None))
    spmd_torch.sync()
    _loss(scan_layers(layers, torch.randn(2, 4, D).to(dev))).backward()
    opt.step()
    spmd_torch.sync()
    weight = layers[1].up.weight
    for key in ("exp_avg", "exp_avg_sq"):
        moment = opt.state[weight][key]
        assert stacks.member(moment)[1] == 1
        assert xs.get_xla_sharding_spec(moment) == xs.get_xla_sharding_spec(weight)
    xr.reset()


def test_scan_layers_in_launch_replicas():
    layers_cpu = _stack("mlp")
    x = torch.randn(2, 4, D)

    def replica(index):
        layers = copy.deepcopy(layers_cpu).to(dev)
        xd = (x * (index + 1)).to(dev).requires_grad_()
        out = scan_layers(layers, xd)
        _loss(out).backward()
        spmd_torch.sync()
        return out.cpu(), xd.grad.cpu(), [p.grad.cpu() for p in layers.parameters()]

    for index, (out, x_grad, grads) in xmp.spawn(replica, nprocs=4).items():
        layers = copy.deepcopy(layers_cpu)
        want_x = (x * (index + 1)).requires_grad_()
        want = _unrolled(layers, want_x)
        _loss(want).backward()
        assert_close(out, want.detach())
        assert_close(
            (x_grad, grads), (want_x.grad, [p.grad for p in layers.parameters()]), kind="grad"
        )


def _program_size(run, layers: int) -> tuple[int, int, int]:
    """(nodes, dot_generals, tanhs in the StableHLO) of a forward and backward over ``layers``
    MLP layers."""
    stack = _stack("mlp", layers).to(dev)
    _loss(run(stack, torch.randn(2, 4, D, device=dev))).backward()
    text = graph.pending_stablehlo()
    return len(graph.pending_program().nodes), text.count("dot_general"), text.count("tanh")


def test_the_program_for_8_layers_is_not_larger_than_for_2():
    nodes, *layer_ops = _program_size(scan_layers, 2)
    more_nodes, *more_layer_ops = _program_size(scan_layers, 8)
    assert more_layer_ops == layer_ops  # one layer's ops whatever the depth
    assert more_nodes - nodes <= 6 * 4  # at most a node per parameter: its gradient's read
    # The measure sees an unrolled loop: it grows with the layers.
    nodes, dots, _ = _program_size(_unrolled, 2)
    more_nodes, more_dots, _ = _program_size(_unrolled, 8)
    assert more_nodes > 3 * nodes and more_dots >= 4 * dots


_OPTIMIZERS = {
    "adamw": lambda params, fused: torch.optim.AdamW(params, lr=1e-2, fused=fused),
    "adam_amsgrad": lambda params, fused: torch.optim.Adam(
        params, lr=1e-2, amsgrad=True, weight_decay=0.1, fused=fused
    ),
    "sgd_momentum": lambda params, fused: torch.optim.SGD(
        params, lr=1e-2, momentum=0.9, fused=fused
    ),
    "adagrad": lambda params, fused: torch.optim.Adagrad(params, lr=1e-2, fused=fused),
}


@pytest.mark.parametrize("kind, fused", [("adamw", None), *((kind, True) for kind in _OPTIMIZERS)])
def test_optimizer_steps_and_state_dict_see_each_layers_own_parameters(kind, fused):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            # Not attention: the gradient of its key bias is 0 but for rounding, which Adam's
            # normalized steps would amplify into different updates.
            self.layers = _stack("mlp", 2)

        def forward(self, x, scanned: bool):
            return scan_layers(self.layers, x) if scanned else _unrolled(self.layers, x)

    model_cpu = Model()
    model = copy.deepcopy(model_cpu).to(dev)
    assert list(model.state_dict()) == list(model_cpu.state_dict())  # layers.0.up.weight ...
    optimizers = [_OPTIMIZERS[kind](m.parameters(), fused) for m in (model, model_cpu)]
    for step in range(3):
        x = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(step))
        # The first step compiles the program of every later one (a fused step's counters and
        # Adagrad's sums, made before scan_layers stacks the parameters, too), but SGD's: its
        # first step copies the gradients into the momentum buffers, as on any device.
        again = int(kind == "sgd_momentum" and step == 1)
        with assert_compiles(again) if step else contextlib.nullcontext():
            for m, optimizer, scanned in zip((model, model_cpu), optimizers, (True, False)):
                optimizer.zero_grad()
                _loss(m(x.to(next(m.parameters()).device), scanned)).backward()
                optimizer.step()
            spmd_torch.sync()
    assert_close(
        {k: v.cpu() for k, v in model.state_dict().items()},
        dict(model_cpu.state_dict()),
        tol="training",
    )
    reloaded = Model().to(dev)
    reloaded.load_state_dict(model.state_dict())
    x = torch.randn(2, 4, D)
    assert_close(reloaded(x.to(dev), True).detach(), model_cpu(x, False).detach(), tol="training")


def test_random_ops_draw_new_numbers_each_iteration_as_the_unrolled_loop():
    torch.manual_seed(0)
    layers = nn.ModuleList(MLP(dropout=0.5) for _ in range(3)).to(dev)
    x = torch.randn(2, 4, D, device=dev)
    outs = []
    for run in (scan_layers, _unrolled):
        spmd_torch.manual_seed(7)
        outs.append(run(layers, x).cpu())
    assert_close(outs[0], outs[1])
    _, ys = scan(
        lambda c, x: (c, x + torch.rand(2, device=dev)),
        torch.zeros(2, device=dev),
        torch.zeros(3, 2, device=dev),
    )
    ys = ys.cpu()
    assert not torch.equal(ys[0], ys[1]) and not torch.equal(ys[1], ys[2])


def test_a_python_number_in_the_body_is_lifted_and_compiles_once():
    xs_ = torch.randn(4, 3).to(dev)

    def run(scale: float):
        carry, _ = scan(lambda c, x: (c * scale + x, None), torch.ones(3, device=dev), xs_)
        return carry.cpu()

    run(0.5)
    with assert_compiles(0):
        got = run(0.25)
    want = torch.ones(3)
    for x in xs_.cpu():
        want = want * 0.25 + x
    assert_close(got, want)


def test_a_pure_function_is_recorded_once_and_replayed_on_the_values_of_the_moment():
    traced = []
    w_cpu = (torch.rand(3) / 2).requires_grad_()
    w = w_cpu.detach().to(dev).requires_grad_()  # closed over: read at its value of each call

    def fn(carry, x):
        traced.append(x.shape)
        return carry * w + x, torch.sin(carry)

    def python_loop(xs):
        carry, ys = torch.ones(3), []
        for x in xs:
            ys.append(torch.sin(carry))
            carry = carry * w_cpu + x
        return carry, torch.stack(ys)

    for length in (4, 4, 6):
        xs = torch.randn(length, 3)
        carry, ys = scan(fn, torch.ones(3, device=dev), xs.to(dev), is_fn_pure=True)
        (carry.sum() + ys.square().sum()).backward()
        want_carry, want_ys = python_loop(xs)
        (want_carry.sum() + want_ys.square().sum()).backward()
        assert_close(carry, want_carry.detach())
        assert_close(ys, want_ys.detach())
        assert_close(w.grad, w_cpu.grad, kind="grad")
        with torch.no_grad():
            for p in (w, w_cpu):
                p.sub_(0.1 * p.grad)
                p.grad = None
    assert traced == [(3,)]  # the trip count is not part of the recording
    scan(fn, torch.ones(3, device=dev), torch.randn(2, 3, device=dev))
    scan(fn, torch.ones(3, device=dev), torch.randn(2, 3, device=dev))
    assert len(traced) == 3  # not pure: traced at each call
    with torch.autocast("xla", dtype=torch.bfloat16):
        scan(fn, torch.ones(3, device=dev), torch.randn(2, 3, device=dev), is_fn_pure=True)
    assert len(traced) == 4  # autocast records other ops


def test_pure_layers_are_recorded_once_across_optimizer_steps():
    layers_cpu = _stack("mlp", 4)
    layers = copy.deepcopy(layers_cpu).to(dev)
    calls = []
    layers[0].register_forward_pre_hook(lambda module, args: calls.append(1))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (layers, layers_cpu)]
    for _ in range(3):
        x = torch.randn(2, 4, D)
        out = scan_layers(layers, x.to(dev), is_layer_pure=True)
        want = _unrolled(layers_cpu, x)
        for o in (out, want):
            _loss(o).backward()
        assert_close(out, want.detach())
        for p, q in zip(layers.parameters(), layers_cpu.parameters()):
            assert_close(p.grad, q.grad, kind="grad")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert len(calls) == 1


def test_pure_layers_draw_new_numbers_at_each_call_and_are_recorded_again_in_eval_mode():
    torch.manual_seed(0)
    layers_cpu = nn.ModuleList(MLP(dropout=0.5) for _ in range(3))
    layers = copy.deepcopy(layers_cpu).to(dev)
    calls = []
    layers[0].register_forward_pre_hook(lambda module, args: calls.append(module.training))
    x = torch.randn(2, 4, D)
    outs = []
    for seed in (1, 2):
        for run in (lambda ls, x: scan_layers(ls, x, is_layer_pure=True), _unrolled):
            spmd_torch.manual_seed(seed)
            outs.append(run(layers, x.to(dev)).cpu())
    assert calls.count(True) == 1 + 2  # the scan's recording, then layer 0 in each unrolled loop
    assert_close(outs[0], outs[1])
    assert_close(outs[2], outs[3])
    assert not torch.equal(outs[0], outs[2])
    layers.eval(), layers_cpu.eval()
    out = scan_layers(layers, x.to(dev), is_layer_pure=True)
    assert calls.count(False) == 1
    assert_close(out, _unrolled(layers_cpu, x))


def test_reading_each_layers_gradient_runs_the_backward_once():
    """Each layer's gradient is a slice of a pending stacked gradient: reading them one by one
    runs the backward once, then one small program per shape of slice (not the backward once
    per layer, as when each read compiled its own program)."""
    torch.manual_seed(0)
    layers_cpu = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
    layers = copy.deepcopy(layers_cpu).to(dev)
    x = torch.randn(3, 8)
    scan_layers(layers, x.to(dev)).square().sum().backward()
    _unrolled(layers_cpu, x).square().sum().backward()
    with assert_compiles(3):  # the backward; the (8, 8) and (8,) slices
        grads = [p.grad.cpu() for p in layers.parameters()]
    for got, p in zip(grads, layers_cpu.parameters()):
        assert_close(got, p.grad, kind="grad")


def test_a_checkpoint_policy_keeps_only_each_iterations_carry():
    layers = _stack("decoder", 4).to(dev)
    x = torch.randn(2, 4, D, device=dev).requires_grad_()
    sizes = []
    for policy in (None, jax.checkpoint_policies.nothing_saveable):
        out = scan_layers(layers, x, partition_fn=policy)
        (scan_node,) = [n for n in graph.pending_program([out]).nodes if str(n.op) == "scan"]
        residuals = scan_node.avals[1:]  # after the carry: what the backward reads
        sizes.append(sum(np.prod(a.shape) for a in residuals))
        del out
    kept, weights = sizes[1], sum(p.numel() for p in layers.parameters())
    assert kept <= weights + 4 * x.numel() + 8  # the stacked weights, each layer's input, the key
    assert sizes[0] > 2 * kept


def test_attention_in_a_scan_keeps_no_probabilities_for_the_backward():
    """512 keys: SDPA runs blockwise; JAX differentiating the body gets its blockwise backward,
    which recomputes the probabilities, so each layer keeps O(seq) values, not O(seq²)."""
    x = torch.randn(2, 512, D)
    kept = []

    def run(layers, xd):
        out = scan_layers(layers, xd)
        (scan_node,) = [n for n in graph.pending_program([out]).nodes if str(n.op) == "scan"]
        kept.extend(np.prod(a.shape) for a in scan_node.avals[1:])
        return out

    _compare_with_cpu(_stack("decoder", 3), run, x)
    # The widest a layer keeps is its MLP's hidden activation (2·D per token); one layer's
    # probabilities would be 2 sequences x 2 heads x 512 x 512, 64x that.
    assert max(kept) <= 3 * 2 * x.numel()


def test_fori_loop_with_int_bounds_is_a_differentiable_python_loop():
    x_cpu = torch.randn(4, requires_grad=True)
    w_cpu = torch.randn(4, 4, requires_grad=True)
    x, w = x_cpu.detach().to(dev).requires_grad_(), w_cpu.detach().to(dev).requires_grad_()
    left, out = fori_loop(2, 7, lambda v: torch.sin(w @ v), x)
    _loss(out).backward()
    want = x_cpu
    for _ in range(5):
        want = torch.sin(w_cpu @ want)
    _loss(want).backward()
    assert left.item() == 0
    assert_close(out, want.detach())
    assert_close((x.grad, w.grad), (x_cpu.grad, w_cpu.grad), kind="grad")


def test_while_loops_and_tensor_bounded_fori_loops_match_python_loops():
    linear = nn.Linear(3, 3)
    linear_xla = copy.deepcopy(linear).to(dev)
    x = torch.randn(2, 3)
    with torch.no_grad():
        count, out = while_loop(
            lambda i, h: i > 0,
            lambda i, h: (i - 1, linear_xla(h)),
            (torch.tensor(4, device=dev), x.to(dev)),
        )
        want = x
        for _ in range(4):
            want = linear(want)
        assert count.item() == 0
        assert_close(out, want)
    i, total = torch_while_loop(  # PyTorch's op runs here on xla tensors
        lambda i, t: i < 10,
        lambda i, t: (i + 1, t + i),
        (torch.tensor(0, device=dev), torch.tensor(0, device=dev)),
    )
    assert (i.item(), total.item()) == (10, 45)
    left, doubled = fori_loop(
        torch.tensor(1, device=dev),
        torch.tensor(6, device=dev),
        lambda v: v * 2,
        torch.ones(3, device=dev),
    )
    assert left.item() == 0 and doubled.cpu().tolist() == [32.0] * 3


def test_layers_of_different_structure_raise_naming_the_layer():
    different = [MLP(), MLP(), Decoder()]
    with pytest.raises(
        ValueError,
        match="layer 2 differs from layer 0 at module '\\(itself\\)', a Decoder .*, and has "
        "mismatched keys: missing \\[\\], extra \\['ln1.bias'",
    ):
        scan_layers(nn.ModuleList(different).to(dev), torch.zeros(2, D, device=dev))
    wider = _stack("mlp", 2)
    wider[1].up = nn.Linear(D, 3 * D)
    wider[1].down = nn.Linear(3 * D, D)
    with pytest.raises(
        ValueError, match=r"Shape mismatch for 'up.weight' in layer 1: f32\[48,16\]"
    ):
        scan_layers(wider.to(dev), torch.zeros(2, D, device=dev))
    no_bias = _stack("mlp", 2)
    no_bias[1].up.bias = None
    with pytest.raises(ValueError, match=r"layer 1 has mismatched keys: missing \['up.bias'\]"):
        scan_layers(no_bias.to(dev), torch.zeros(2, D, device=dev))


def test_a_layers_walk_names_what_torchs_generators_name_and_keeps_nothing_alive():
    """scan_layers walks each layer once (modules, then parameters and buffers by name): the
    same names, order and tensors as named_modules/named_parameters/named_buffers, shared and
    tied members once, eval mode seen; and no reference cycle holds the tensors afterwards."""
    shared = nn.Linear(3, 3)
    layer = nn.Module()
    layer.a = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.BatchNorm1d(2), shared))
    layer.b, layer.c, layer.none = shared, shared, None
    layer.register_buffer("scratch", torch.zeros(2), persistent=False)
    layer.w = nn.Parameter(torch.ones(1))
    layer.tied = layer.w
    layer.register_parameter("absent", None)
    layer.a[1].eval()
    modules, state = _structure(layer)
    assert modules == [(name, type(m), m.training) for name, m in layer.named_modules()]
    want = {**dict(layer.named_parameters()), **dict(layer.named_buffers())}
    assert list(state) == list(want) and all(state[k] is want[k] for k in want)
    weak = weakref.ref(layer.w)
    gc.disable()
    try:
        del layer, state, want
        assert weak() is None
    finally:
        gc.enable()


def test_a_body_changing_shapes_raises_naming_the_shape():
    xs_ = torch.zeros(3, 2, device=dev)
    with pytest.raises(ValueError, match=r"changed the carry's init from f32\[2\] to f32\[4\]"):
        scan(lambda c, x: (torch.cat([c, x]), None), torch.zeros(2, device=dev), xs_)
    with pytest.raises(
        ValueError, match=r"body_fn changed carried_inputs\[1\] from f32\[2\] to f64\[2\]"
    ):
        while_loop(
            lambda i, h: i > 0,
            lambda i, h: (i - 1, h.double()),
            (torch.tensor(3, device=dev), xs_[0]),
        )
    with pytest.raises(
        ValueError, match="the leaves of xs differ in length: xs\\[0\\] has 3, xs\\[1\\] has 2"
    ):
        scan(lambda c, x: (c, None), torch.zeros(2, device=dev), (xs_, xs_[:2]))


def test_a_data_dependent_trip_count_with_gradients_raises():
    x = torch.ones(3, device=dev).requires_grad_()
    bound = torch.tensor(3, device=dev)
    with pytest.raises(
        RuntimeError, match="fori_loop with tensor bounds: input_value\\[0\\] .* requires grad"
    ):
        fori_loop(0, bound, lambda v: v * 2, x)


def test_a_scan_body_may_write_its_arguments_in_place_and_they_stay_inside():
    """PyTorch/XLA's cumsum example writes its carry (``carry += x``): each write is a value of
    that iteration, init and xs stay as they were, and gradients are the loop's without the
    writes."""

    def body(c, x):
        c *= x
        x.add_(1)
        return c, c * x

    values = (torch.arange(6.0) + 1).reshape(3, 2)
    init, xs_ = torch.ones(2, device=dev).requires_grad_(), values.to(dev).requires_grad_()
    final, ys = scan(body, init, xs_)
    (final.sum() + ys.sum()).backward()
    want_init, want_xs = torch.ones(2, requires_grad=True), values.clone().requires_grad_()
    carry, outs = want_init, []
    for x in want_xs:
        carry = carry * x
        outs.append(carry * (x + 1))
    (carry.sum() + torch.stack(outs).sum()).backward()
    assert_close((final, ys), (carry.detach(), torch.stack(outs).detach()))
    assert_close((init.grad, xs_.grad), (want_init.grad, want_xs.grad), kind="grad")
    assert torch.equal(init.detach().cpu(), torch.ones(2))
    assert torch.equal(xs_.detach().cpu(), values)


def test_a_body_may_neither_write_what_it_reads_from_outside_nor_read_values():
    xs_ = torch.zeros(3, 2, device=dev)
    outside = torch.zeros(2, device=dev)
    with pytest.raises(
        RuntimeError, match=r"fori_loop: an in-place operation on input_value\[0\] \(f32\[2\]\)"
    ):
        fori_loop(0, 3, lambda v: v.add_(1), torch.zeros(2, device=dev))
    with pytest.raises(RuntimeError, match=r"on a f32\[2\] tensor from outside it"):
        scan(lambda c, x: (c + outside.add_(1), None), torch.zeros(2, device=dev), xs_)
    with pytest.raises(
        RuntimeError, match="scan's body would run a program .* a loop body is one graph"
    ):
        scan(lambda c, x: (c * c.sum().item(), None), torch.zeros(2, device=dev), xs_)


def _adamw_step_size(layers: int, fused: bool | None) -> list[tuple[int, int]]:
    """(nodes, inputs) of each of two training steps' programs, AdamW included, over ``layers``
    scanned MLP layers."""
    stack = _stack("mlp", layers).to(dev)
    optimizer = torch.optim.AdamW(stack.parameters(), lr=1e-2, fused=fused)
    sizes = []
    for _ in range(2):
        _loss(scan_layers(stack, torch.randn(2, 4, D, device=dev))).backward()
        optimizer.step()
        optimizer.zero_grad()
        program = graph.pending_program()
        sizes.append((len(program.nodes), len(program.leaves)))
        spmd_torch.sync()
    return sizes


@pytest.mark.parametrize("fused", [None, True])
def test_an_adamw_step_over_8_scanned_layers_is_the_program_of_2(fused):
    """The layers' weights, gradients and moments are stacks (stacks.py): the optimizer updates
    one array per kind of weight, so neither program grows with the depth, and the second step
    reads each stack as one input. The fused step too, its step counters one stack made before
    its first program, which is then the program of every later step."""
    (first, second) = _adamw_step_size(2, fused)
    (first_8, second_8) = _adamw_step_size(8, fused)
    assert first_8 == first and second_8 == second


# --- value_and_grad_partitioned: one iteration as AOTAutograd's forward and backward ---------------


def _layer_step(carry: dict, x: dict) -> tuple[dict, torch.Tensor]:
    hidden = torch.tanh(carry["h"] @ x["w"] + x["b"])
    return {"h": hidden, "n": carry["n"] * 2}, (hidden * carry["n"]).sum(-1)


@pytest.mark.parametrize("partition", ["default", "min_cut"])
def test_value_and_grad_partitioned_equals_eager_autograd(partition):
    from functorch.compile import default_partition, min_cut_rematerialization_partition

    partition_fn = {"default": default_partition, "min_cut": min_cut_rematerialization_partition}
    torch.manual_seed(0)
    carry = {"h": torch.randn(3, 4), "n": torch.randn(3, 1)}
    x = {"w": torch.randn(4, 4), "b": torch.randn(4)}
    on_xla = lambda tree: {k: v.to(dev) for k, v in tree.items()}  # noqa: E731
    xs = {k: v[None].to(dev).requires_grad_() for k, v in x.items()}
    forward, alias_input, backward = value_and_grad_partitioned(
        _layer_step, on_xla(carry), xs, partition_fn[partition]
    )
    new_carry, (y, partial) = forward(on_xla(carry), on_xla(x))
    activations = alias_input(partial, on_xla(x))
    grad_carry, grad_x = backward(
        {"h": torch.ones(3, 4, device=dev), "n": torch.ones(3, 1, device=dev)},
        (torch.ones(3, device=dev), activations),
    )

    leaves = [t.clone().requires_grad_() for t in (*carry.values(), *x.values())]
    eager_carry, eager_y = _layer_step(dict(zip(carry, leaves[:2])), dict(zip(x, leaves[2:])))
    outputs = [*eager_carry.values(), eager_y]
    grads = torch.autograd.grad(outputs, leaves, [torch.ones_like(t) for t in outputs])
    for got, want in zip([*new_carry.values(), y], outputs):
        assert_close(got.cpu(), want.detach())
    for got, want in zip([*grad_carry.values(), *grad_x.values()], grads):
        assert_close(got.cpu(), want)


def test_value_and_grad_partitioned_gives_back_the_inputs_it_saves_and_keeps_its_graphs():
    def step(carry, x):
        new = carry @ x
        return new, new

    carry, xs = torch.randn(2, 2, device=dev), torch.randn(5, 2, 2, device=dev)
    forward, alias_input, backward = value_and_grad_partitioned(step, carry, xs)
    x = xs[0]
    _, (_, partial) = forward(carry, x)
    activations = alias_input(partial, x)
    # The backward of carry @ x needs carry and x: x is given back, not returned again.
    assert [a is x for a in activations].count(True) == 1
    assert not any(a is x for a in partial) and len(activations) == len(partial) + 1
    assert value_and_grad_partitioned(step, carry, xs)[0] is forward  # traced once per structure
    assert value_and_grad_partitioned(step, carry[:1], xs[:, :, :1])[0] is not forward


def test_tree_flatten_none_drops_and_restores_none_leaves():
    tree = {"a": (1, None), "b": None, "c": [2, (None, 3)]}
    leaves, unflatten = tree_flatten_none(tree)
    assert leaves == [1, 2, 3]
    assert unflatten([4, 5, 6]) == {"a": (4, None), "b": None, "c": [5, (None, 6)]}
