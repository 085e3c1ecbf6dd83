"""The lazy engine's contract: tracing, views and in-place, the barrier, caching, RNG, donation."""

from __future__ import annotations

import contextlib
import copy
import gc
import threading
import warnings

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import spmd_torch
import spmd_torch.core.xla_model as xm
import spmd_torch.debug.graph
import spmd_torch.debug.metrics as met
import spmd_torch.distributed.spmd as xs
import spmd_torch.runtime as xr
from spmd_torch import config
from spmd_torch._lazy import compile as compile_module
from spmd_torch._lazy import counters, engine, modes
from spmd_torch._lazy.execute import global_array
from tests.conftest import engine_leaks
from tests.helpers import assert_close, assert_compiles

dev = spmd_torch.device()


def test_device_is_xla0():
    assert dev == torch.device("xla:0")
    t = torch.ones(2, 3, device=dev)
    assert t.device == dev and t.device.type == "xla"
    assert t.dtype == torch.float32 and t.shape == (2, 3) and t.is_contiguous()
    moved = torch.ones(2, requires_grad=True).to("xla")
    assert moved.device == dev and moved.requires_grad and not moved.is_leaf
    assert spmd_torch.devices()[0] == dev and spmd_torch.device_count() == 8


def test_ops_record_without_running():
    spmd_torch.sync()
    x = torch.arange(6.0).reshape(2, 3).to(dev)
    with assert_compiles(0):
        y = (x * 2).exp().sum(dim=1)
        assert y.shape == (2,) and y.dtype == torch.float32
    assert_close(y, (torch.arange(6.0).reshape(2, 3) * 2).exp().sum(dim=1))


def test_sync_with_nothing_pending_compiles_nothing():
    spmd_torch.sync()
    with assert_compiles(0):
        spmd_torch.sync()


def test_inplace_through_index_updates_base():
    x = torch.zeros(3, 4, device=dev)
    x[0] += 1
    x[:, 1] = 5.0
    expected = torch.zeros(3, 4)
    expected[0] += 1
    expected[:, 1] = 5.0
    assert_close(x, expected)


def test_views_see_writes_to_base_and_base_sees_writes_through_views():
    base_cpu = torch.arange(12.0).reshape(3, 4)
    base = base_cpu.to(dev)
    views = [base.view(12), base.transpose(0, 1), base[1:, ::2]]
    base.mul_(2)
    base_cpu.mul_(2)
    for view, cpu_view in zip(views, [base_cpu.view(12), base_cpu.t(), base_cpu[1:, ::2]]):
        assert_close(view, cpu_view)
    views[1][0].fill_(-1)  # write through the transpose: first column of base
    base_cpu.t()[0].fill_(-1)
    assert_close(base, base_cpu)
    views[2].add_(100)
    base_cpu[1:, ::2].add_(100)
    assert_close(base, base_cpu)
    assert_close(views[0], base_cpu.view(12))


def test_detach_shares_storage():
    x = torch.ones(4, device=dev)
    x.detach().zero_()
    assert_close(x, torch.zeros(4))


def test_copy_from_cpu_into_slice():
    x = torch.zeros(2, 3, device=dev)
    x[1].copy_(torch.tensor([1.0, 2.0, 3.0]))
    assert_close(x, torch.tensor([[0.0, 0, 0], [1, 2, 3]]))


def test_deepcopy_of_a_pending_random_tensor_is_independent():
    spmd_torch.sync()
    x = torch.rand(5, device=dev)  # pending: its graph holds the engine's PRNG split
    first = x[0]
    y = copy.deepcopy(x)
    assert_close(y, x.cpu(), tol="exact")
    y[0] = 1
    assert_close(x[0], first.cpu(), tol="exact")
    assert y[0].item() == 1.0


def test_item_tolist_print_cpu():
    x = torch.tensor([[1.5, -2.0]], device=dev)
    assert (x.sum()).item() == -0.5
    assert x.tolist() == [[1.5, -2.0]]
    assert "device='xla:0'" in repr(x) and "1.5000" in repr(x)
    assert x.cpu().device.type == "cpu"
    assert torch.tensor(7, device=dev).item() == 7


def test_item_runs_only_what_it_needs_and_keeps_the_rest_pending():
    spmd_torch.sync()
    a = torch.ones(3, device=dev) * 2
    b = a + 1
    other = torch.full((5,), 3.0, device=dev).sqrt()
    assert b.sum().item() == 9.0
    assert spmd_torch.debug.graph.pending_count() >= 1  # `other` was not computed
    with assert_compiles(1):
        spmd_torch.sync()
    assert_close(other, torch.full((5,), 3.0).sqrt())


def test_python_scalars_do_not_recompile():
    x = torch.ones(8, device=dev)
    spmd_torch.sync()
    results = []
    with assert_compiles(1):
        for lr in (0.1, 0.2, 0.3, 0.4):
            y = x.mul(lr).add(lr, alpha=lr)
            spmd_torch.sync()
            results.append(y)
    for lr, y in zip((0.1, 0.2, 0.3, 0.4), results):
        assert_close(y, torch.ones(8) * lr + lr * lr)


def test_python_ints_do_not_recompile_and_keep_integer_meaning():
    """Ints are program data as floats are, 0 and 1 included; integer results stay exact."""
    x = torch.arange(6, device=dev)
    xf = torch.arange(6.0, device=dev)
    u8 = torch.tensor([1, 200], dtype=torch.uint8, device=dev)
    spmd_torch.sync()
    results = []
    with assert_compiles(1):
        for k in range(6):
            results.append(
                (xf * k, x * k, (x + k) // 2, x & (k + 1), u8 + (250 + k), x * (2**40 + k))
            )
            spmd_torch.sync()
    for k, got in enumerate(results):
        xc, xfc, u8c = x.cpu(), xf.cpu(), u8.cpu()
        want = (xfc * k, xc * k, (xc + k) // 2, xc & (k + 1), u8c + (250 + k), xc * (2**40 + k))
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g.cpu(), w), (k, g, w)


def test_int_scalars_stay_constants_where_the_lowering_builds_on_them():
    """x ** 2 is x * x (its int exponent is not data), and an op whose schema takes an ``int``
    (round's decimals) keeps it: each value its own program, exact as on the CPU."""
    x = torch.tensor([-1.5, 0.25, 3.0])
    with assert_compiles(2):
        assert torch.equal((x.to(dev) ** 2).cpu(), x**2)
        assert torch.equal((x.to(dev) ** 3).cpu(), x**3)
    assert torch.equal(
        torch.round(x.to(dev) * 10, decimals=1).cpu(), torch.round(x * 10, decimals=1)
    )


def test_a_static_numbers_type_is_part_of_the_program():
    """2 == 2.0 == True in Python, so a structure comparing static values by value ran the int64
    program of ``full(s, 16777217) // 1 - 16777216`` for its float32 twin, whose full rounds to
    16777216 first (1 instead of 0). ``full`` lifts its number now (an int64 or a float64 input),
    ``floor_divide`` keeps its own: for it, the reason names the type."""
    big = torch.tensor([16777217])
    cases = [
        lambda d: torch.full((1,), 16777217, device=d) // 1 - 16777216,
        lambda d: torch.full((1,), 16777217.0, device=d) // 1 - 16777216,
        lambda d: torch.floor_divide(big.to(d), 1) - 16777216,
        lambda d: torch.floor_divide(big.to(d), 1.0) - 16777216,
    ]
    with assert_compiles(4):
        for make in cases:
            got, want = make(dev).cpu(), make("cpu")
            assert got.dtype == want.dtype and torch.equal(got, want), (got, want)
    assert "a Python number's type" in compile_module.explain_last_miss()


def test_a_static_zeros_sign_is_part_of_the_program():
    """0.0 == -0.0 too: ``F.pad(x, value=-0.0)``, whose number stays in the program, is not run
    as the ``0.0`` program."""
    x = torch.tensor([1.0, 2.0])
    with assert_compiles(2):
        for zero in (0.0, -0.0):
            got = 1 / F.pad(x.to(dev), (1, 0), value=zero)
            assert torch.equal(got.cpu(), 1 / F.pad(x, (1, 0), value=zero))


def test_where_with_a_new_number_each_step_compiles_once():
    """``torch.where(mask, value, x)`` wraps its number in ``scalar_tensor``: a program input, as
    PyTorch/XLA's device data, not a number kept in the program (one compile per value)."""
    x = torch.tensor([1.0, -2.0, 3.0], device=dev)
    spmd_torch.sync()
    with assert_compiles(1):
        for step in range(1, 4):
            got = torch.where(x > 0, float(step), x) + torch.where(x > 0, x, step)
            spmd_torch.sync()
    xc = x.cpu()
    assert torch.equal(got.cpu(), torch.where(xc > 0, 3.0, xc) + torch.where(xc > 0, xc, 3))


def test_a_device_learning_rate_written_with_fill_compiles_once():
    """``lr.fill_(value)`` (how an LR scheduler writes a tensor learning rate) takes its number
    as a program input, as PyTorch/XLA's device data: a new value each step, one program."""
    lr, w = torch.tensor(0.01, device=dev), torch.ones(4, device=dev)
    spmd_torch.sync()
    with assert_compiles(1):
        for step in range(1, 5):
            lr.fill_(1.0 / (1 + step))
            w.sub_(w * lr)
            spmd_torch.sync()
    want = torch.ones(4)
    for step in range(1, 5):
        want.sub_(want * (1.0 / (1 + step)))
    assert_close(w, want)


def test_a_static_nan_does_not_recompile():
    """NaN != NaN, and a NaN's hash is its object's id: a step writing ``float('nan')`` where an
    op keeps its number in the program (``pad``'s fill) compiled again at every step, each NaN a
    new key; ``where``'s, a program input, beside it."""
    mask, x = torch.tensor([True, False], device=dev), torch.tensor([1.0, 2.0], device=dev)
    spmd_torch.sync()
    with assert_compiles(1):
        for _ in range(3):
            got = torch.where(mask, x, float("nan")) + F.pad(x, (0, 0), value=float("nan"))
            spmd_torch.sync()
    torch.testing.assert_close(got.cpu(), torch.tensor([2.0, float("nan")]), equal_nan=True)


_NUMBERS = (0.5, -1.25, -0.0, 3, -7, 2**24 + 1, float("inf"), float("nan"))
_INDEX = torch.tensor([[0], [2], [1]])


@pytest.mark.parametrize(
    "make",
    [
        lambda x, v: x * torch.full((3, 4), v, device=x.device),
        lambda x, v: torch.full((3,), v, dtype=torch.int32, device=x.device) + 1,
        lambda x, v: torch.full((2,), v, dtype=torch.bfloat16, device=x.device) * 2,
        lambda x, v: x + torch.full_like(x, v),
        lambda x, v: 1 / x.new_full((2, 4), v),
        lambda x, v: 1 / x.index_fill(1, torch.tensor([0, 2], device=x.device), v),
        lambda x, v: x.int().index_fill(1, torch.tensor([0, 2], device=x.device), v),
        lambda x, v: 1 / x.scatter(1, _INDEX.to(x.device), v),
        lambda x, v: x.scatter(1, _INDEX.to(x.device), v, reduce="multiply"),
    ],
    ids=(
        "full full_int32 full_bf16 full_like new_full index_fill index_fill_int32 scatter "
        "scatter_multiply"
    ).split(),
)
@pytest.mark.filterwarnings("error::FutureWarning")  # JAX's scatter refusing to cast a number
def test_a_fill_number_is_a_program_input(make):
    """``full`` and its kin, ``index_fill`` and ``scatter`` with a number take it as a program
    input, as PyTorch/XLA makes it device data: a value that changes each step is one program
    per type (int or float), not one per value. Each value equals eager's, to the sign of zero
    and through the casts (an int past float32's precision, -0.0 into bfloat16)."""
    x = torch.randn(3, 4)
    xd = x.to(dev)
    spmd_torch.sync()
    with assert_compiles(2):  # one for the floats, one for the ints
        for value in _NUMBERS:
            try:
                want = make(x, value)
            except RuntimeError:  # eager refuses a number the dtype cannot hold (inf in int32)
                continue
            got = make(xd, value).cpu()
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
            assert torch.equal(got.float().signbit(), want.float().signbit()), value


def test_a_dropout_rate_schedule_compiles_once():
    """Dropout's p, changing each step as a schedule changes it, is a program input: one
    program, and each step keeps about 1-p of the elements, scaled by 1/(1-p), with the
    gradient through the same mask."""
    x = torch.rand(64, 64, device=dev) + 1
    spmd_torch.sync()
    with assert_compiles(1):
        for p in (0.1, 0.5, 0.9):
            w = x.clone().requires_grad_()
            y = F.dropout(w, p, training=True)
            y.sum().backward()
            spmd_torch.sync()
            kept, yc, xc = y.cpu() != 0, y.detach().cpu(), x.cpu()
            assert abs(kept.float().mean().item() - (1 - p)) < 0.05, p
            assert_close(yc[kept], xc[kept] / (1 - p))
            assert_close(w.grad.cpu(), kept.float() / (1 - p))


def test_a_lifted_fill_kept_as_state_is_made_on_the_host():
    """Adagrad's ``full_like(p, initial_accumulator_value)`` state is made as data before the
    first step's program (its number, a program input, is known there), so the first step
    compiles the program every later step runs; the losses are eager's."""

    def train(device, steps=3):
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 3).to(device)
        opt = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.25)
        data = torch.randn(4, 5).to(device)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = model(data).square().mean()
            loss.backward()
            opt.step()
            if device != "cpu":
                spmd_torch.sync()
            losses.append(loss.item())
        return losses

    filled = met.counter_value("ConstantFilledOnHost") or 0
    with assert_compiles(1):
        got = train(dev)
    assert met.counter_value("ConstantFilledOnHost") - filled == 2  # the weight's and bias' sums
    assert_close(torch.tensor(got), torch.tensor(train("cpu")), tol="training")


def test_same_step_traced_again_hits_the_cache():
    w = torch.randn(4, 4).to(dev)
    spmd_torch.sync()
    with assert_compiles(1):
        for _ in range(3):
            w.add_(torch.ones(4, 4, device=dev) @ w * 0.01)
            spmd_torch.sync()


def test_the_compile_cache_keeps_the_most_recently_run_programs():
    """XLA_COMPILATION_CACHE_SIZE bounds the cache, as in PyTorch/XLA: past it the program run
    least recently is dropped (and compiles again when it comes back), the others stay."""
    x = torch.arange(4.0).to(dev)
    spmd_torch.sync()

    def step(k: int) -> torch.Tensor:  # three programs, told apart by their ops
        y = [x + 1, x * 2, x.exp()][k]
        spmd_torch.sync()
        return y

    with config.override(XLA_COMPILATION_CACHE_SIZE=2):
        engine.current().cache.clear()
        before = met.counter_value("CompilationCacheEviction") or 0
        with assert_compiles(2):
            step(0), step(1)
        with assert_compiles(0):
            step(0)  # now the most recently run: program 1 is the least
        with assert_compiles(1):
            step(2)
        assert (met.counter_value("CompilationCacheEviction") or 0) - before == 1
        with assert_compiles(0):
            step(0), step(2)
        with assert_compiles(1):
            assert_close(step(1).cpu(), torch.arange(4.0) * 2, tol="exact")
        assert len(engine.current().cache.executables) == 2


def test_rng_gives_new_numbers_each_step_without_recompiling():
    spmd_torch.manual_seed(3)
    spmd_torch.sync()
    draws = []
    with assert_compiles(1):
        for _ in range(3):
            draws.append(torch.rand(1000, device=dev))
            spmd_torch.sync()
    cpu = [d.cpu() for d in draws]
    assert not torch.equal(cpu[0], cpu[1]) and not torch.equal(cpu[1], cpu[2])
    assert 0.45 < cpu[0].mean().item() < 0.55 and cpu[0].min() >= 0 and cpu[0].max() < 1


def test_same_seed_same_numbers():
    def draw():
        torch.manual_seed(11)
        a = torch.randn(64, device=dev)
        b = torch.nn.functional.dropout(torch.ones(64, device=dev), 0.5)
        return a.cpu(), b.cpu()

    first, second = draw(), draw()
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert set(first[1].unique().tolist()) <= {0.0, 2.0}


def test_step_donates_overwritten_buffers():
    p = torch.randn(16, 16).to(dev)
    spmd_torch.sync()
    old = global_array(p)
    p.mul_(0.5)
    spmd_torch.sync()
    assert old.is_deleted()


def test_inputs_still_held_are_not_donated():
    x = torch.randn(8).to(dev)
    spmd_torch.sync()
    array = global_array(x)
    y = x * 2
    spmd_torch.sync()
    assert not array.is_deleted()
    assert_close(y, x.cpu() * 2)


@torch.library.custom_op("spmd_torch_test::cpu_cumulative_max", mutates_args=(), device_types="cpu")
def _cpu_cumulative_max(x: torch.Tensor) -> torch.Tensor:
    return torch.cummax(x, 0).values  # a kernel for the CPU only, like torchvision's nms


@_cpu_cumulative_max.register_fake
def _(x):
    return torch.empty_like(x)


def test_cpu_fallback_is_counted_and_warned_once():
    x = torch.tensor([3.0, 1.0, 4.0, 1.0, 5.0], device=dev)
    name = "aten::cpu_cumulative_max"  # no lowering and no device-independent kernel
    counters.COUNTERS.pop(name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values = _cpu_cumulative_max(x)
    assert any(
        "cpu_cumulative_max" in str(w.message) and "no xla lowering" in str(w.message)
        for w in caught
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is counted but not warned about again
        _cpu_cumulative_max(x)
    assert counters.COUNTERS[name] == 2
    assert_close(values, torch.tensor([3.0, 3.0, 4.0, 4.0, 5.0]))


def test_a_lowered_op_whose_shape_depends_on_data_runs_on_the_cpu_and_says_why():
    a = torch.tensor([[3.0, 0.0], [2.0, 5.0], [1.0, 1.0]], device=dev)
    b = torch.tensor([[1.0], [4.0], [2.0]], device=dev)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.linalg.lstsq(a, b, driver="gelsd")  # residuals only for a full-rank a
    assert any(
        "lstsq" in str(w.message) and "depends on its data" in str(w.message) for w in caught
    )
    expected = torch.linalg.lstsq(a.cpu(), b.cpu(), driver="gelsd")
    assert_close(got.solution, expected.solution)
    assert got.residuals.shape == expected.residuals.shape == (1,)


@torch.library.custom_op("spmd_torch_test::scaled_softplus", mutates_args=())
def _scaled_softplus(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.nn.functional.softplus(x) * scale


@_scaled_softplus.register_fake
def _(x, scale):
    return torch.empty_like(x)


def test_a_librarys_custom_op_runs_its_kernel_on_the_device_not_the_cpu():
    x = torch.randn(4, 3)
    before = {k: v for k, v in counters.COUNTERS.items() if k.startswith("spmd_torch_test::")}
    y = _scaled_softplus(x.to(dev), 2.0)
    assert "aten.softplus.default" in spmd_torch.debug.graph.get_tensors_text([y])
    assert_close(y, torch.nn.functional.softplus(x) * 2.0)
    after = {k: v for k, v in counters.COUNTERS.items() if k.startswith("spmd_torch_test::")}
    assert after == before  # no CPU fallback counted under the op's name


def test_mixing_cpu_and_device_tensors_raises_device_mismatch():
    x = torch.ones(3, device=dev)
    with pytest.raises(
        RuntimeError, match=r"on the same device.*\(3,\) torch.float32 tensor on cpu"
    ):
        x + torch.ones(3)
    assert_close(x + torch.tensor(2.0), torch.full((3,), 3.0))  # 0-dim CPU tensors are allowed


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_float8_tensors_travel_bit_for_bit_and_compute(dtype):
    """fp8 (inference caches and weights): uploaded and read back bit for bit, cast on the
    device as PyTorch casts on the CPU (round to nearest even)."""
    values = torch.tensor([0.0, -1.5, 3.25, 448.0 if dtype is torch.float8_e4m3fn else 57344.0])
    eight = values.to(dtype)
    on_device = eight.to(dev)
    assert torch.equal(on_device.cpu().view(torch.uint8), eight.view(torch.uint8))
    wide = torch.tensor([0.1, -2.7, 100.3, 1e-3])
    cast = wide.to(dev).to(dtype).cpu()
    assert cast.dtype == dtype
    assert torch.equal(cast.view(torch.uint8), wide.to(dtype).view(torch.uint8))
    assert torch.equal((on_device.float() * 2).cpu(), eight.float() * 2)


def test_unsupported_dtype_names_op_and_dtype():
    x = torch.ones(3, device=dev)
    with pytest.raises(TypeError, match=r"complex32.*xla|xla.*complex32"):
        x.to(torch.complex32)


def test_inplace_dtype_rules_match_pytorch():
    i = torch.ones(3, dtype=torch.int64, device=dev)
    with pytest.raises(RuntimeError, match="can't be cast"):
        i.add_(1.5)
    f = torch.ones(3, device=dev)
    f.add_(torch.ones(3, dtype=torch.int64, device=dev))
    assert f.dtype == torch.float32
    assert_close(f, torch.full((3,), 2.0))


def test_int64_and_float64_keep_their_meaning():
    big = torch.tensor([2**40 + 1], dtype=torch.int64, device=dev)
    assert (big * 2).item() == 2**41 + 2
    d = torch.tensor([1.0 + 1e-12], dtype=torch.float64, device=dev)
    assert (d - 1).item() == pytest.approx(1e-12, rel=1e-3)


def test_sync_returns_before_the_program_finishes():
    x = torch.randn(256, 256).to(dev)
    spmd_torch.sync()
    for _ in range(5):
        x = x @ x / 256
    spmd_torch.sync()
    array = global_array(x)
    assert isinstance(array, jax.Array)
    jax.block_until_ready(array)


class _CpuScaledBackward(torch.autograd.Function):
    """Backward multiplies by a CPU tensor: on xla that op raises (a device mismatch)."""

    @staticmethod
    def forward(ctx, x):
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        return grad * torch.arange(5.0)


@pytest.mark.filterwarnings("ignore:aten.mul.Tensor has no xla lowering")
def test_a_failing_op_inside_backward_degrades_to_cpu():
    x = torch.zeros(5).to(dev).requires_grad_()
    y = _CpuScaledBackward.apply(x)
    with pytest.warns(UserWarning, match="aten.mul.Tensor failed on xla inside backward"):
        y.sum().backward()
    assert_close(x.grad, torch.arange(5.0))


def test_inplace_overload_with_other_argument_order():
    x = torch.tensor([1.0, 2.0, 3.0], device=dev)
    x.pow_(2)  # pow_.Scalar(Tensor, Scalar) is computed by pow.Tensor_Scalar
    assert_close(x, torch.tensor([1.0, 4.0, 9.0]))


def test_assigning_data_rebinds_the_value():
    p = torch.nn.Parameter(torch.ones(3).to(dev))
    p.data = torch.full((3,), 5.0).to(dev)
    p.data.mul_(2)
    assert isinstance(p, torch.nn.Parameter) and p.requires_grad
    assert_close(p.detach(), torch.full((3,), 10.0))


def test_training_steps_leave_no_arrays_behind():
    import gc

    spmd_torch.sync()
    xm.wait_device_ops()  # programs in flight recorded: their outputs no longer held
    gc.collect()
    baseline = len(jax.live_arrays()) - _scalar_vectors_cached()
    model = torch.nn.Linear(8, 4).to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(2, 8).to(dev)).sum().backward()
        optimizer.step()
        spmd_torch.sync()
    xm.wait_device_ops()
    held = len(jax.live_arrays()) - _scalar_vectors_cached() - baseline
    assert held == 6  # weight, bias, their momentum buffers and gradients
    del model, optimizer
    gc.collect()
    assert len(jax.live_arrays()) - _scalar_vectors_cached() == baseline


def _scalar_vectors_cached() -> int:
    """The programs' lifted scalars kept on the device for their next runs, one array each."""
    return sum(len(inputs) for inputs in engine.current().cache.scalars_on_device.values())


def test_meta_module_to_empty_on_the_device_then_initialised_matches_eager():
    # empty_like(meta, device='xla') restrides its fresh result with as_strided: an alias of the
    # whole storage, not a view, so nn.Module can swap it in as a parameter.
    layer = torch.nn.Linear(4, 3, device="meta").to_empty(device=dev)
    torch.manual_seed(0)
    eager = torch.nn.Linear(4, 3)
    with torch.no_grad():
        layer.weight.copy_(eager.weight)
        layer.bias.copy_(eager.bias)
    x = torch.randn(2, 4)
    assert_close(layer(x.to(dev)), eager(x))
    y = torch.zeros(3, 4, device=dev)
    torch.as_strided(y, (3, 4), (4, 1)).add_(1)  # still an alias: writes reach y
    assert_close(y, torch.ones(3, 4), tol="exact")


def test_as_strided_out_of_bounds_raises():
    x = torch.arange(10.0).to(dev)
    with pytest.raises(RuntimeError, match=r"as_strided.*out of bounds for a storage of 10"):
        x.as_strided((2, 2), (1, 2), 10)
    assert_close(x.as_strided((2, 2), (1, 2), 5), torch.arange(10.0).as_strided((2, 2), (1, 2), 5))


def test_data_dependent_shapes_run_on_cpu_and_are_counted():
    x = torch.tensor([3.0, -1.0, 2.0, -5.0], device=dev)
    counters.COUNTERS.pop("aten::index", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        positive = x[x > 0]
    assert counters.COUNTERS["aten::index"] == 1
    assert_close(positive, torch.tensor([3.0, 2.0]))


def test_expanded_gradient_accumulates_without_touching_its_source():
    """Autograd may keep an expanded tensor as .grad; add_/zero_ on it must act on the grad alone."""
    w_cpu = torch.nn.Parameter(torch.ones(3))
    w = torch.nn.Parameter(torch.ones(3).to(dev))
    for param in (w_cpu, w):
        for _ in range(2):
            (param.sum() * 2).backward()
    assert_close(w.grad, w_cpu.grad)
    w.grad.zero_()
    assert_close(w.grad, torch.zeros(3))
    x = torch.ones(3).to(dev)
    y = x.expand(2, 3)
    x.add_(1)  # reads through an expand view still see writes to the base
    assert_close(y, torch.full((2, 3), 2.0))


def test_matmul_with_a_transposed_operand_reads_the_untransposed_value():
    """``a @ w.t()`` records linear(a, w): backward's ``grad @ w.t().t()`` then reads the same
    ``w.t()`` the forward did (one all-gather of a sharded weight, not two)."""
    a, w = torch.randn(3, 4), torch.randn(5, 4)
    out = a.to(dev) @ w.to(dev).t()
    assert "aten.linear.default" in spmd_torch.debug.graph.pending_text([out])
    assert_close(out, a @ w.t())


def test_module_to_keeps_tied_parameters_tied_and_parameters_the_same_objects():
    emb, head = torch.nn.Embedding(4, 3), torch.nn.Linear(3, 4, bias=False)
    head.weight = emb.weight  # a language model's tied head
    model = torch.nn.Sequential(emb, head)
    weight = emb.weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # made before the move, as on CUDA
    expected = weight.detach().clone()
    model.to(dev)
    assert model[0].weight is model[1].weight is weight
    assert weight.device == dev
    tokens = torch.tensor([0, 2])
    model(tokens.to(dev)).sum().backward()
    optimizer.step()
    spmd_torch.sync()
    reference = expected.clone().requires_grad_()
    torch.nn.functional.linear(
        torch.nn.functional.embedding(tokens, reference), reference
    ).sum().backward()
    assert_close(weight, expected - 0.5 * reference.grad)


def test_module_to_refuses_a_parameter_a_live_cpu_graph_holds_and_a_copy_moves():
    """The swap's limit (docs/migration.md): a CPU forward not yet backpropagated holds the second
    layer's weight, so PyTorch refuses to swap it; a deep copy of the model moves, and its
    results equal the CPU model's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)
    expected = model(x)  # its graph saves model[2].weight for the backward
    moved = copy.deepcopy(model).to(dev)
    assert_close(moved(x.to(dev)), expected)
    with pytest.raises(RuntimeError, match="Couldn't swap Linear.weight"):
        model.to(dev)


def test_a_lazy_module_moves_once_its_first_forward_gave_it_shapes():
    """Before it, the move is refused by name (the parameter would lose its laziness: torch's
    lazy modules keep it only through ``param.data =``, which a CPU tensor cannot take from an
    xla one); after it, the module computes as on the CPU."""
    lazy = torch.nn.LazyLinear(3)
    with pytest.raises(RuntimeError, match="UninitializedParameter .* run the module once on a"):
        copy.deepcopy(lazy).to(dev)
    x = torch.randn(2, 5)
    expected = lazy(x)
    assert_close(lazy.to(dev)(x.to(dev)).cpu(), expected.detach())


def test_leak_guard_names_spmd_mode_and_pending_tensors():
    assert engine_leaks() == []
    xr.use_spmd()
    y = torch.ones(3, device=dev) * 2
    leaks = engine_leaks()
    assert leaks[0].startswith("mode is SpmdMesh(8 devices)")
    assert "1 tensors still hold pending values" in leaks[1] and "aten.mul.Tensor" in leaks[1]
    spmd_torch.sync()
    assert engine_leaks(spmd_expected=True) == []
    xr.reset()
    assert_close(y, torch.full((3,), 2.0))


def test_each_thread_can_trace_with_an_engine_of_its_own():
    x = torch.ones(2, device=dev) + 1  # pending on the default engine
    seen = {}

    def replica():
        with engine.running(engine.Engine(modes.PerDevice(), cache=engine.current().cache)):
            z = torch.full((2,), 5.0, device=dev) * 3
            seen["pending"] = spmd_torch.debug.graph.pending_count()
            spmd_torch.sync()
            seen["after"] = spmd_torch.debug.graph.pending_count()
            seen["value"] = z.cpu()

    thread = threading.Thread(target=replica)
    thread.start()
    thread.join()
    assert seen["pending"] == 1 and seen["after"] == 0  # its own pending tensor only
    assert spmd_torch.debug.graph.pending_count() == 1  # the other engine's sync left x pending
    assert_close(seen["value"], torch.full((2,), 15.0))
    assert_close(x, torch.full((2,), 2.0))


def test_wait_device_ops_skips_an_output_a_later_program_was_given():
    # An output still held (here through the engine's own list) whose buffer the next program
    # took over (donated, as an in-place update does) is not waited for: waiting on it raised.
    x = torch.ones(4).to(dev)
    y = x * 2
    spmd_torch.sync()
    held = [ref() for outputs in engine.current().in_flight for ref in outputs]
    y.add_(1)
    spmd_torch.sync()
    assert any(array.is_deleted() for array in held)
    xm.wait_device_ops()
    assert_close(y, torch.full((4,), 3.0))


def _frozen(obj) -> bool:
    return not any(o is obj for o in gc.get_objects())  # frozen objects are in no generation


@pytest.mark.parametrize("freeze", [True, False])
def test_warm_up_end_freezes_the_heap_once(monkeypatch, freeze):
    # The first cache hit after a compile collects and freezes the heap (the model included),
    # so full collections stop walking it; the hits after it leave the heap alone.
    monkeypatch.setattr(config.FREEZE_HEAP, "value", freeze)
    gc.unfreeze()
    threshold = gc.get_threshold()
    gc.set_threshold(700, *threshold[1:])  # Python's default, as before any warm-up ended
    layer = torch.nn.Linear(13, 7 if freeze else 6).to(dev)  # a program no other test compiled

    def step():
        with torch.no_grad():
            layer.weight.mul_(0.5)
        spmd_torch.sync()

    step()
    assert not _frozen(layer) and gc.get_freeze_count() == 0
    step()
    assert _frozen(layer) is freeze
    # ... and lets the young generation grow past a step's graph, which dies at the barrier
    young = gc.get_threshold()[0]
    gc.set_threshold(*threshold)
    assert young == (compile_module.YOUNG_GENERATION if freeze else 700)
    assert (gc.get_freeze_count() > 0) is freeze
    # A thread an earlier test left may compile meanwhile; the hit after that compile settles
    # again, rightly. So the step checked is one that began settled and saw no compile. Its
    # check counts calls: the freeze count itself drops whenever a frozen object is freed.
    calls = []
    for name in ("collect", "freeze", "unfreeze"):
        real = getattr(gc, name)
        monkeypatch.setattr(
            gc, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a)
        )
    for _ in range(4):
        compiles = counters.COUNTERS["UncachedCompile"]
        began_settled = not engine.current().cache.unsettled
        calls.clear()
        step()
        if began_settled and counters.COUNTERS["UncachedCompile"] == compiles:
            break
    assert calls == []
    monkeypatch.undo()
    gc.unfreeze()


def test_a_cycle_frozen_then_dropped_is_collected_when_the_next_warm_up_ends(monkeypatch):
    # Cycles alive at one freeze (a graph Dynamo later drops) are not kept for ever: the next
    # warm-up's end unfreezes, collects everything, and freezes again.
    import weakref

    monkeypatch.setattr(config.FREEZE_HEAP, "value", True)
    gc.unfreeze()

    class Cyclic:
        pass

    def warm_up(rows: int) -> None:  # a program no other test compiled, run twice
        t = torch.ones(rows, 5).to(dev)
        for _ in range(2):
            t.mul_(0.5)
            spmd_torch.sync()

    cycle = Cyclic()
    cycle.itself = cycle
    alive = weakref.ref(cycle)
    warm_up(17)
    del cycle
    gc.collect()
    assert alive() is not None  # frozen: the collector does not look at it
    # The whole heap is collected again once the time since the last such collection passes
    # ten times its length; here, as if long ago.
    monkeypatch.setattr(compile_module, "_LAST_WHOLE_COLLECTION", [float("-inf"), 0.0])
    warm_up(19)
    assert alive() is None
    gc.unfreeze()


def test_a_mid_step_read_of_a_program_with_lifted_scalars_matches_eager():
    # PyTorch/XLA's test_spooky_ailing: a zeroed result of a pending op, element writes of
    # Python floats (lifted scalars), then a host read of the pending values: a partial program
    # whose only inputs are those scalars.
    m = torch.arange(3, dtype=torch.float32)
    values = [3.0**v for v in m.tolist()]
    ours = torch.empty_like(torch.pow(3, m.to(dev))).zero_()
    for i, v in enumerate(values):
        ours[i] = v
    assert_close(ours.cpu(), torch.tensor(values))


def test_a_read_holds_the_pending_values_it_computes_on_the_way():
    """A host read computes the live tensors its value comes from once and keeps them: the next
    read from them runs only what is new, and what no live tensor holds is not kept."""
    x = torch.arange(6.0).to(dev)
    base = torch.sin(x) * 2  # pending, and live
    temporary_sum = (base + 1).sum()
    assert temporary_sum.item() == pytest.approx(
        float((torch.sin(torch.arange(6.0)) * 2 + 1).sum())
    )
    assert spmd_torch.debug.graph.pending_text([base * 3]).count("aten.sin") == 0  # base is data
    assert_close((base * 3).cpu(), torch.sin(torch.arange(6.0)) * 6)


def test_a_loss_read_before_the_backward_leaves_the_forward_out_of_the_step():
    """The activations autograd saved come out of the read's program: the backward's program
    reads them instead of running the forward again."""
    w_cpu = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(5, 4)
    w = w_cpu.detach().to(dev).requires_grad_()
    loss = torch.tanh(x.to(dev) @ w).sum()
    want = torch.tanh(x @ w_cpu).sum()
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    loss.backward()
    want.backward()
    step = spmd_torch.debug.graph.pending_text([w.grad])
    assert "aten.tanh_backward" in step and "aten.tanh.default" not in step, step
    assert_close(w.grad.cpu(), w_cpu.grad)


def test_reads_without_a_barrier_keep_the_pending_list_short():
    """Each read walks the pending writes once and drops those that are data or dead: a loop
    that reads every iteration and never syncs does not walk all of its writes at each read."""
    w = torch.randn(8, 8).to(dev)
    spmd_torch.sync()
    for i in range(50):
        h = torch.relu(w * (i % 3 + 1)) @ w
        assert (h.sum() > -1e9).item()
    assert len(engine.current().pending) < 10


def test_lbfgs_programs_stop_growing_and_its_losses_are_eager_cpus():
    """torch.optim.LBFGS reads a value per iteration while its history stays pending: each read
    once computed the whole history again, in programs that grew with every iteration (with
    max_iter=20 its first step ran the process out of memory mappings for their code). Now each
    read keeps what it computed, and the steps after the first compile nothing."""

    def train(device, steps: int) -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        ).to(device)
        x, y = torch.randn(64, 8).to(device), torch.randn(64, 1).to(device)
        optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=6)

        def closure():
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        losses = [optimizer.step(closure).item()]
        with assert_compiles(0) if device != "cpu" else contextlib.nullcontext():
            losses += [optimizer.step(closure).item() for _ in range(steps - 1)]
        return losses

    assert_close(torch.tensor(train(dev, 3)), torch.tensor(train("cpu", 3)))


def test_equal_python_numbers_share_one_lifted_input():
    """Each layer's ``eps`` reads one program input, so XLA's kernels of alike layers stay alike
    (and compile once); 0.0 and -0.0, 1 and 1.0 stay apart, and a pattern of equal numbers that
    changes is one more program, named as such, whose results stay exact."""
    x = torch.tensor([1.0, -2.0, 0.25, 3.5])
    xd = x.to(dev)
    spmd_torch.sync()
    y, want = xd, x
    for _ in range(6):
        y, want = y * 0.5 + 1e-6, want * 0.5 + 1e-6
    assert spmd_torch.debug.graph.pending_text([y]).count(" = scalar") == 2
    assert torch.equal(y.cpu(), want)
    apart = (xd * 0.0, xd * -0.0, xd + 1, xd + 1.0, xd / -0.0, xd * 1)
    assert spmd_torch.debug.graph.pending_text(list(apart)).count(" = scalar") == 4
    for got, w in zip(apart, (x * 0.0, x * -0.0, x + 1, x + 1.0, x / -0.0, x * 1)):
        assert got.dtype == w.dtype and torch.equal(got.cpu(), w), (got, w)
        assert torch.equal(got.cpu().signbit(), w.signbit())
    with assert_compiles(2):
        for a, b in [(0.5, 0.5), (0.5, 0.25), (0.5, 0.5), (0.75, 0.25)]:
            assert torch.equal((xd * a + b).cpu(), x * a + b), (a, b)
            if (a, b) == (0.5, 0.25):
                assert "equal numbers share one input" in compile_module.explain_last_miss()


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused", "adam_amsgrad_fsdp"])
def test_the_first_step_compiles_the_program_every_later_step_runs(optimizer):
    """torch.optim makes its state with ``zeros_like`` in the first step: that step's program
    used to hold the fills and the next step's, reading the state, was another compile. The
    barrier now computes the fills first (a small program), so the step's program is the one
    every later step runs: the second step compiles nothing, under SPMD with the state laid out
    as its parameter too (an unmarked one's replicated). Losses equal eager CPU's."""

    def train(device, steps: int) -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
        ).to(device)
        if optimizer.endswith("fsdp") and device != "cpu":  # the biases left unmarked
            mesh = xs.Mesh(np.arange(8), (8, 1), ("fsdp", "model"))
            for p in model.parameters():
                if p.dim() == 2:
                    xs.mark_sharding(p, mesh, ("fsdp", None))
        opt = {
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
            "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
            "adam_amsgrad_fsdp": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
        }[optimizer](model.parameters())
        x = torch.randn(16, 8).to(device)
        losses, compiles = [], []
        for _ in range(steps):
            before = counters.COUNTERS.get("UncachedCompile", 0)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if device != "cpu":
                spmd_torch.sync()
            compiles.append(counters.COUNTERS.get("UncachedCompile", 0) - before)
            losses.append(loss.item())
        if device != "cpu":  # the step's program, and the fills' (unless an earlier test's)
            assert 1 <= compiles[0] <= 2 and compiles[1:] == [0] * (steps - 1), compiles
        if optimizer.endswith("fsdp") and device != "cpu":
            for p in model.parameters():
                for state in opt.state[p].values():
                    if state.dim():
                        assert xs.get_xla_sharding_spec(state) == xs.get_xla_sharding_spec(p)
        return losses

    if optimizer.endswith("fsdp"):
        xr.use_spmd()
    try:
        assert_close(torch.tensor(train(dev, 3)), torch.tensor(train("cpu", 3)), tol="training")
    finally:
        xr.reset()


def test_a_fill_nothing_wrote_becomes_data_before_the_step():
    """A live fill the step only reads (a buffer, a mask) is made first, on the host, and held
    as data: the step's program reads it, as the next step's does, and it holds its values; no
    program is compiled or run for the fills."""
    x = torch.randn(3, 4)
    xd = x.to(dev)
    spmd_torch.sync()
    mask = torch.ones(3, 4, device=dev)
    buffer = torch.zeros_like(xd)
    full = torch.full((2,), -2.5, dtype=torch.bfloat16, device=dev)
    y = xd * mask
    executed = met.counter_value("ExecuteComputation") or 0
    filled = met.counter_value("ConstantFilledOnHost") or 0
    spmd_torch.sync()  # one program: the step's, reading the fills
    assert met.counter_value("ExecuteComputation") - executed == 1
    assert met.counter_value("ConstantFilledOnHost") - filled == 3
    assert torch.equal(y.cpu(), x) and torch.equal(buffer.cpu(), torch.zeros(3, 4))
    assert torch.equal(full.cpu(), torch.full((2,), -2.5, dtype=torch.bfloat16))
    with assert_compiles(0):  # the next step's program: the same
        y = xd * mask
        spmd_torch.sync()


def test_a_lifted_number_is_converted_once_per_dtype_in_the_compiled_module(monkeypatch):
    """A ``_foreach_*`` op converts its Python number for each tensor of its list; XLA is given
    the module with those equal conversions merged (an unrolled decoder's AdamW step has
    thousands), and the values are those of eager PyTorch."""
    modules = []
    compile_lowered = jax.stages.Lowered.compile

    def compile_and_keep(self, *args, **kwargs):
        modules.append(self.as_text())
        return compile_lowered(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_and_keep)
    cpu = [torch.randn(3, n) for n in range(2, 8)]  # shapes no other test compiles
    xs = [t.to(dev) for t in cpu]
    spmd_torch.sync()
    torch._foreach_mul_(xs, 0.37)
    spmd_torch.sync()
    (module,) = modules
    assert module.count("(tensor<f64>) -> tensor<f32>") == 1
    for x, t in zip(xs, cpu):
        assert_close(x.cpu(), t * 0.37)
