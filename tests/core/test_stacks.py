"""Stacks (spmd_torch/_lazy/stacks.py): same-shaped tensors as the slices of one array. Every
member must read and write as the independent tensor it stands for, against the same ops on CPU
tensors; a pointwise foreach op given all of a stack's members is recorded over the stack."""

from __future__ import annotations

import numpy as np
import torch

import spmd_torch
import spmd_torch.distributed.spmd as xs
import spmd_torch.runtime as xr
from spmd_torch._lazy import stacks
from spmd_torch.debug import graph
from tests.helpers import assert_close

dev = spmd_torch.device()


def _stacked(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Device copies of ``values``, made the members of one stack."""
    tensors = [v.to(dev) for v in values]
    assert stacks.restack(tensors) is not None
    return tensors


def _values(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 5, generator=g) for _ in range(n)]


def _ops(text: str, op: str) -> int:
    return sum(f"= {op}(" in line for line in text.splitlines())


def test_a_foreach_op_over_every_member_in_any_order_updates_the_stack_whole():
    a_cpu, b_cpu = _values(4, 0), _values(4, 1)
    a, b = _stacked(a_cpu), _stacked(b_cpu)
    spmd_torch.sync()
    order = [2, 0, 3, 1]  # torch.optim interleaves the layers' weights: any order counts
    torch._foreach_addcmul_(
        [a[k] for k in order], [b[k] for k in order], [b[k] for k in order], 0.5
    )
    torch._foreach_addcmul_(
        [a_cpu[k] for k in order], [b_cpu[k] for k in order], [b_cpu[k] for k in order], 0.5
    )
    roots = torch._foreach_sqrt(torch._foreach_abs(b))
    text = graph.pending_text()
    assert _ops(text, "aten.select_scatter.default") == 0  # no member written on its own
    assert stacks.stack_of(roots) is not None  # a functional op's results: one stack too
    assert_close(a, a_cpu)
    assert_close(roots, torch._foreach_sqrt([v.abs() for v in b_cpu]))


def test_an_incomplete_or_misaligned_stack_is_updated_member_by_member():
    a_cpu, b_cpu = _values(4, 2), _values(4, 3)
    a, b = _stacked(a_cpu), _stacked(b_cpu)
    torch._foreach_add_(a[:3], b[:3])  # member 3 absent
    torch._foreach_add_(a_cpu[:3], b_cpu[:3])
    torch._foreach_mul_(a, [b[1], b[0], b[2], b[3]])  # member k beside another's member
    torch._foreach_mul_(a_cpu, [b_cpu[1], b_cpu[0], b_cpu[2], b_cpu[3]])
    torch._foreach_add_(a, [1.0, 2.0, 3.0, 4.0])  # a Scalar[] of several values
    torch._foreach_add_(a_cpu, [1.0, 2.0, 3.0, 4.0])
    assert _ops(graph.pending_text(), "aten.select_scatter.default") > 0
    assert_close(a, a_cpu)


def test_zeros_like_members_in_order_make_stacks_whose_members_stay_independent():
    params = _stacked(_values(3, 4))
    firsts, seconds = [], []
    for p in params:  # as torch.optim makes two moments per parameter
        firsts.append(torch.zeros_like(p))
        seconds.append(torch.zeros_like(p))
    assert stacks.stack_of(firsts) is not None and stacks.stack_of(seconds) is not None
    assert stacks.stack_of(firsts) is not stacks.stack_of(seconds)
    firsts[1].add_(2.0)
    seconds[2].copy_(params[0])
    expected = [torch.zeros(3, 5) for _ in range(3)]
    assert_close(firsts, [expected[0], expected[1] + 2.0, expected[2]])
    assert_close(seconds, [expected[0], expected[1], params[0].cpu()])
    lone = torch.zeros_like(params[1])  # not member 0 of a new run: a tensor of its own
    assert stacks.member(lone) is None and lone.shape == (3, 5)


def test_restacking_refuses_aliased_or_repeated_tensors():
    tensors = [v.to(dev) for v in _values(2, 5)]
    alias = tensors[0].detach()  # noqa: F841  (re-homing tensors[0] alone would part them)
    assert stacks.restack(tensors) is None
    assert stacks.restack([tensors[1], tensors[1]]) is None
    assert all(stacks.member(t) is None for t in tensors)


def test_a_member_reports_and_takes_its_layout_through_the_stack():
    xr.use_spmd()
    mesh = xs.Mesh(np.arange(8), (2, 4), ("data", "model"))
    members = _stacked([torch.randn(4, 8) for _ in range(3)])  # a (3, 4, 8) stack
    xs.mark_sharding(members[1], mesh, (None, "model"))
    for m in members:  # the stack is laid out (None, None, model): every member as marked
        assert (
            xs.get_xla_sharding_spec(m)
            == "{devices=[1,4,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}"
        )
    whole = stacks.whole(stacks.stack_of(members))
    assert tuple(whole._storage.sharding.spec) == (None, None, "model")
    xs.clear_sharding(members[0])
    assert whole._storage.sharding is None
    spmd_torch.sync()
    xr.reset()


def test_a_foreach_op_whose_list_comes_second_runs_over_the_stack():
    exponents_cpu = _values(3, 8)
    exponents = _stacked(exponents_cpu)
    powers = torch._foreach_pow(0.9, exponents)  # Adam's bias corrections, when capturable
    assert stacks.stack_of(powers) is not None
    assert_close(powers, torch._foreach_pow(0.9, exponents_cpu))


def test_clip_grad_norm_over_stacks_norms_each_member():
    for norm_type in (2.0, float("inf")):
        grads_cpu = _values(4, 9) + [torch.randn(7)]
        grads = _stacked(grads_cpu[:4]) + [grads_cpu[4].to(dev)]
        norms = torch._foreach_norm(grads, norm_type)
        assert stacks.stack_of(norms[:4]) is not None  # one vector_norm over the stack
        assert _ops(graph.pending_text(), "aten.select.int") == 0
        assert_close(norms, torch._foreach_norm(grads_cpu, norm_type))
        params = [torch.zeros(g.shape, device=dev, requires_grad=True) for g in grads_cpu]
        params_cpu = [torch.zeros_like(g, requires_grad=True) for g in grads_cpu]
        for p, q, g, g_cpu in zip(params, params_cpu, grads, grads_cpu):
            p.grad, q.grad = g, g_cpu.clone()
        total = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type, foreach=True)
        want = torch.nn.utils.clip_grad_norm_(params_cpu, 0.5, norm_type, foreach=True)
        assert want > 0.5  # the gradients are scaled
        assert_close((total, [p.grad for p in params]), (want, [q.grad for q in params_cpu]))


def test_plain_tensors_beside_a_stack_or_right_after_one_join_stacks_later_ones_do_not():
    """An optimizer's state loaded one tensor per layer becomes stacks: the first moments where
    a foreach op gives them beside the stacked gradients, the second moments where they come
    alone right after (Adam's order), at the positions that call grouped. A list alone after a
    call that grouped nothing stays as it is. Every value stays its own."""
    grads_cpu, firsts_cpu, seconds_cpu, later_cpu = (_values(3, seed) for seed in (5, 6, 7, 8))
    grads = _stacked(grads_cpu)
    firsts, seconds, later = (
        [v.to(dev) for v in vs] for vs in (firsts_cpu, seconds_cpu, later_cpu)
    )
    other = [torch.ones(2).to(dev)]
    spmd_torch.sync()
    torch._foreach_lerp_(firsts, grads, 0.1)
    torch._foreach_mul_(seconds, 0.5)
    torch._foreach_add_(other, 1.0)  # groups nothing
    torch._foreach_mul_(later, 0.5)
    assert [stacks.member(t)[1] for t in firsts + seconds] == [0, 1, 2, 0, 1, 2]
    assert stacks.member(firsts[0])[0] is not stacks.member(seconds[0])[0]
    assert all(stacks.member(t) is None for t in later)
    torch._foreach_lerp_(firsts_cpu, grads_cpu, 0.1)
    assert_close(firsts + seconds + later, firsts_cpu + [v * 0.5 for v in seconds_cpu + later_cpu])


def test_a_fused_step_over_every_member_updates_each_stack_and_stacks_the_counters():
    """``fused=True``'s one op per step (here AdamW's, unscaling the gradients, two steps as
    torch.optim makes them) updates each stack whole, the gradients written back too; a tensor
    beside the stacks stays its own. The one step counter per parameter, fresh zeros, becomes
    one stack for all parameters at the first ``_foreach_add_``, computed at once, so that the
    first step's program reads it as the next step's does; a stack's counters are a slice of it.
    Against ATen's CPU kernel."""
    shapes = [(3, 5)] * 3 + [(7,)]
    g = torch.Generator().manual_seed(10)
    cpu = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]
    cpu[3] = [v.abs() for v in cpu[3]]  # second moments
    xla = [_stacked(values[:3]) + [values[3].to(dev)] for values in cpu]
    steps = [[torch.zeros(()) for _ in shapes], [torch.zeros((), device=dev) for _ in shapes]]
    scale, found_inf = torch.tensor(4.0), torch.tensor(0.0)
    for step in range(2):
        for (params, grads, firsts, seconds), counters, device in zip(
            (cpu, xla), steps, ("cpu", dev)
        ):
            torch._foreach_add_(counters, 1)
            if device == dev and step == 0:
                assert stacks.stack_of(counters) is not None
                # one add over one array of counters, made by one fill: no stack of them
                text = graph.pending_text()
                assert _ops(text, "aten._foreach_add.Scalar") == 1 and "f32[4] = aten.zeros" in text
                assert _ops(text, "aten.stack.default") == 4  # _stacked's
            torch._fused_adamw_(
                params, grads, firsts, seconds, [], counters, lr=0.1, beta1=0.9, beta2=0.99,
                weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False,
                grad_scale=scale.to(device), found_inf=found_inf.to(device),
            )  # fmt: skip
    assert _ops(graph.pending_text(), "aten.select_scatter.default") == 0
    assert_close(xla + [steps[1]], cpu + [steps[0]])


def test_one_tensor_at_every_position_is_taken_over_the_stack_as_over_each_member():
    """The sync-free optimizers take their step back with ``_foreach_sub_(counters, [found_inf]
    * n)``: a tensor repeated beside a stack's members is broadcast over the stack, unless it
    has as many dimensions as the stack (each member's result is then larger than the member)."""
    a_cpu = _values(3, 11)
    a = _stacked(a_cpu)
    flag_cpu, rows_cpu = torch.tensor(2.0), torch.randn(4, 3, 5)
    flag, rows = flag_cpu.to(dev), rows_cpu.to(dev)
    torch._foreach_sub_(a, [flag] * 3)
    torch._foreach_sub_(a_cpu, [flag_cpu] * 3)
    assert _ops(graph.pending_text(), "aten.select_scatter.default") == 0
    wide = torch._foreach_add(a, [rows] * 3)
    assert [tuple(t.shape) for t in wide] == [(4, 3, 5)] * 3
    assert_close(a + list(wide), a_cpu + list(torch._foreach_add(a_cpu, [rows_cpu] * 3)))


def test_a_tensor_repeated_in_the_list_written_in_place_is_not_taken_over_the_stack():
    """``_foreach_add_([t] * 3, members)`` writes ``t`` three times: the list an op writes is
    never taken over the stack as one tensor (its result would have the stack's shape), and the
    members being a stack's changes nothing against plain tensors."""
    values = _values(3, 12)
    stacked, plain = _stacked(values), [v.to(dev) for v in values]
    t, u = torch.zeros(3, 5).to(dev), torch.zeros(3, 5).to(dev)
    torch._foreach_add_([t] * 3, stacked)
    torch._foreach_add_([u] * 3, plain)
    assert t.shape == (3, 5) and torch.equal(t.cpu(), u.cpu())


def test_a_0_dim_tensor_per_member_is_taken_along_the_stack():
    """A capturable optimizer divides by one 0-dim bias correction per parameter: beside a
    stack's members, those scalars are stacked and broadcast along each member's axes, and the
    members are updated whole; without a stack (or where the list is the one written) the op
    is as before."""
    a_cpu = _values(4, 13)
    a = _stacked(a_cpu)
    scales_cpu = [torch.tensor(float(k + 2)) for k in range(4)]
    scales = [s.to(dev) for s in scales_cpu]
    torch._foreach_div_(a, scales)
    torch._foreach_div_(a_cpu, scales_cpu)
    assert _ops(graph.pending_text(), "aten.select_scatter.default") == 0
    assert_close(a, a_cpu)
    summed = torch._foreach_add(scales, scales)  # the 0-dim list first: nothing to go along
    assert_close(summed, torch._foreach_add(scales_cpu, scales_cpu))


def test_the_members_given_together_are_found_and_checked_again_cheaply():
    """``groups_in`` finds every stack all of whose members a list holds, each once, in member
    order (a compiled graph's arguments: one input per stack); a stack also held whole, or a
    member missing, is no group; ``still_grouped`` confirms the groups of an earlier call."""
    a, b = _stacked(_values(3, 14)), _stacked(_values(2, 15))
    plain = torch.ones(2).to(dev)
    values = [b[1], plain, a[2], a[0], b[0], a[1]]
    groups = stacks.groups_in(values)
    assert groups == ((3, 5, 2), (4, 0))
    assert stacks.still_grouped(values, groups)
    assert stacks.groups_in(values[:-1]) == ((4, 0),)  # a[1] missing
    assert not stacks.still_grouped(values[:-1] + [plain], groups)
    whole = stacks.whole(a[0]._storage)
    assert stacks.groups_in(values + [whole]) == ((4, 0),)  # a held whole besides
    assert not stacks.still_grouped(values + [whole], groups)
