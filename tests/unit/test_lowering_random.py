"""Random lowerings: shapes and dtypes as eager torch gives them, value ranges, statistics of
100k samples (within 5 standard errors), and keys: the same key repeats the numbers, another
changes them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from spmd_torch._lazy.lowering import LOWERINGS
from spmd_torch._lazy.lowering.dtypes import to_torch_dtype
from tests.helpers import assert_close
from tests.unit._lowering_harness import as_program, to_jax

aten = torch.ops.aten
N = 100_000
KEY = jax.random.key(0)


def _draw(op, *args: object, key: jax.Array = KEY, **kwargs: object) -> object:
    """Call the lowering with torch tensors in ``args`` turned into jax arrays (eagerly: compiling
    each case costs more than it checks here)."""
    return LOWERINGS[op].fn(key, *to_jax(args), **kwargs)


def _trace(op, args: tuple, kwargs: dict) -> object:
    """The lowering's output shapes and dtypes when traced as under jax.jit (key and tensors as
    inputs)."""
    program, inputs = as_program(LOWERINGS[op].fn, (KEY, *args), kwargs)
    return jax.eval_shape(program, *inputs)


def _np(x: jax.Array) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _assert_mean_std(x: jax.Array, mean: float, std: float) -> None:
    """Sample mean within 5 standard errors of ``mean``, sample std within 5 % of ``std``."""
    x = _np(x).reshape(-1)
    assert abs(x.mean() - mean) < 5 * std / math.sqrt(x.size), (x.mean(), mean)
    assert abs(x.std() - std) < 0.05 * std, (x.std(), std)


def _assert_rate(mask: jax.Array, p: float) -> None:
    """A Bernoulli(p) rate within 5 standard errors."""
    mask = _np(mask).reshape(-1)
    assert abs(mask.mean() - p) < 5 * math.sqrt(p * (1 - p) / mask.size), (mask.mean(), p)


ones = torch.ones(N)
probs = torch.full((4, 5), 0.25)

# (op, args, kwargs) whose result shape and dtype must be eager torch's, and that must depend on
# the key (and only on it).
CASES = [
    pytest.param(aten.uniform.default, (ones, -2.0, 3.0), {}, id="uniform"),
    pytest.param(aten.uniform.default, (torch.ones(7, dtype=torch.float64),), {}, id="uniform-f64"),
    pytest.param(aten.normal_functional.default, (ones, 2.0, 3.0), {}, id="normal_functional"),
    pytest.param(aten.normal.Tensor_float, (torch.zeros(3, 4), 2.0), {}, id="normal-Tensor_float"),
    pytest.param(aten.normal.float_Tensor, (1.0, torch.ones(3, 4)), {}, id="normal-float_Tensor"),
    pytest.param(
        aten.normal.Tensor_Tensor, (torch.zeros(3, 1), torch.ones(4)), {}, id="normal-broadcast"
    ),
    pytest.param(aten.normal.float_float, (0.0, 1.0, [3, 4]), {}, id="normal-float_float"),
    pytest.param(
        aten.normal.float_float, (0.0, 1.0, [5]), {"dtype": torch.float64}, id="normal-f64"
    ),
    pytest.param(aten.bernoulli.default, (torch.full((6, 7), 0.5),), {}, id="bernoulli"),
    pytest.param(aten.bernoulli.p, (torch.zeros(6, 7), 0.5), {}, id="bernoulli-p"),
    pytest.param(
        aten.bernoulli.Tensor, (torch.zeros(6, 7), torch.full((7,), 0.5)), {}, id="bernoulli-Tensor"
    ),
    pytest.param(aten.rand.default, ([3, 4],), {}, id="rand"),
    pytest.param(aten.rand.default, ([3],), {"dtype": torch.float64}, id="rand-f64"),
    pytest.param(aten.randn.default, ([3, 4],), {"dtype": None}, id="randn"),
    pytest.param(
        aten.rand_like.default, (torch.ones(3, 4, dtype=torch.float64),), {}, id="rand_like"
    ),
    pytest.param(
        aten.randn_like.default,
        (torch.ones(3, 4),),
        {"dtype": torch.float64},
        id="randn_like-dtype",
    ),
    pytest.param(aten.randint.default, (10, [50]), {}, id="randint"),
    pytest.param(aten.randint.default, (10, [50]), {"dtype": torch.float32}, id="randint-float"),
    pytest.param(aten.randint.low, (-5, 5, [50]), {"dtype": torch.int32}, id="randint-low"),
    pytest.param(
        aten.randint_like.default, (torch.ones(50, dtype=torch.int16), 9), {}, id="randint_like"
    ),
    pytest.param(
        aten.randint_like.low_dtype, (torch.ones(50), -3, 3), {}, id="randint_like-low_dtype"
    ),
    pytest.param(
        aten.randint_like.Tensor, (torch.ones(50), torch.tensor(7)), {}, id="randint_like-Tensor"
    ),
    pytest.param(aten.randperm.default, (50,), {}, id="randperm"),
    pytest.param(aten.randperm.default, (50,), {"dtype": torch.int32}, id="randperm-int32"),
    pytest.param(
        aten.native_dropout.default, (torch.ones(6, 7), 0.5, True), {}, id="native_dropout"
    ),
    pytest.param(aten.exponential.default, (torch.ones(50),), {}, id="exponential"),
    pytest.param(aten.random.default, (torch.zeros(50),), {}, id="random"),
    pytest.param(aten.random.default, (torch.zeros(50, dtype=torch.int64),), {}, id="random-int64"),
    pytest.param(getattr(aten.random, "from"), (torch.zeros(50), -3, 9), {}, id="random-from"),
    pytest.param(aten.random.to, (torch.zeros(50, dtype=torch.int8), 100), {}, id="random-to"),
    pytest.param(aten.multinomial.default, (probs, 3), {}, id="multinomial"),
    pytest.param(aten.multinomial.default, (probs[0], 30, True), {}, id="multinomial-replacement"),
]


def _as_list(x: object) -> list:
    return list(x) if isinstance(x, (tuple, list)) else [x]


@pytest.mark.parametrize(("op", "args", "kwargs"), CASES)
def test_traced_shape_and_dtype_match_eager_torch(op, args, kwargs):
    expected = _as_list(op(*args, **kwargs))
    got = _as_list(_trace(op, args, kwargs))
    assert [tuple(g.shape) for g in got] == [tuple(e.shape) for e in expected]
    assert [to_torch_dtype(g.dtype) for g in got] == [e.dtype for e in expected]


@pytest.mark.parametrize(("op", "args", "kwargs"), CASES)
def test_same_key_same_numbers_other_key_others(op, args, kwargs):
    first = _as_list(_draw(op, *args, **kwargs))
    again = _as_list(_draw(op, *args, **kwargs))
    other = _as_list(_draw(op, *args, key=jax.random.key(1), **kwargs))
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_uniform_range_and_moments():
    x = _draw(aten.uniform.default, ones, -2.0, 3.0)
    assert _np(x).min() >= -2.0 and _np(x).max() < 3.0
    _assert_mean_std(x, 0.5, 5 / math.sqrt(12))


@pytest.mark.parametrize("dtype", [None, torch.float64], ids=["default", "f64"])
def test_rand_range_and_moments(dtype):
    x = _draw(aten.rand.default, [N], dtype=dtype)
    assert _np(x).min() >= 0.0 and _np(x).max() < 1.0
    _assert_mean_std(x, 0.5, 1 / math.sqrt(12))


def test_rand_like_moments():
    _assert_mean_std(_draw(aten.rand_like.default, ones), 0.5, 1 / math.sqrt(12))


@pytest.mark.parametrize(
    ("op", "args"),
    [
        pytest.param(aten.randn.default, ([N],), id="randn"),
        pytest.param(aten.randn_like.default, (ones,), id="randn_like"),
        pytest.param(aten.normal.float_float, (0.0, 1.0, [N]), id="normal-float_float"),
    ],
)
def test_standard_normal_moments(op, args):
    _assert_mean_std(_draw(op, *args), 0.0, 1.0)


def test_normal_functional_moments():
    _assert_mean_std(_draw(aten.normal_functional.default, ones, 2.0, 3.0), 2.0, 3.0)


def test_normal_tensor_mean_and_std_are_per_element():
    """Half the elements centred on -10 with std 1, half on +10 with std 2."""
    mean = torch.cat([torch.full((N // 2,), -10.0), torch.full((N // 2,), 10.0)])
    std = torch.cat([torch.ones(N // 2), torch.full((N // 2,), 2.0)])
    x = _np(_draw(aten.normal.Tensor_Tensor, mean, std))
    _assert_mean_std(x[: N // 2], -10.0, 1.0)
    _assert_mean_std(x[N // 2 :], 10.0, 2.0)
    _assert_mean_std(_draw(aten.normal.Tensor_float, mean[: N // 2], 3.0), -10.0, 3.0)
    _assert_mean_std(_draw(aten.normal.float_Tensor, 1.0, std[N // 2 :]), 1.0, 2.0)


def test_bernoulli_rates_follow_each_probability():
    p = torch.cat([torch.full((N,), 0.3), torch.zeros(100), torch.ones(100)])
    x = _np(_draw(aten.bernoulli.default, p))
    assert set(np.unique(x)) == {0.0, 1.0}
    _assert_rate(x[:N], 0.3)
    assert x[N : N + 100].sum() == 0 and x[N + 100 :].sum() == 100


def test_bernoulli_bf16_probability_is_not_quantized():
    """bf16 holds 0.1 as 0.10009765625; the rate must not drift to bf16's 1/128 uniform grid."""
    p = jnp.full((N,), 0.1, jnp.bfloat16)
    x = LOWERINGS[aten.bernoulli.default].fn(KEY, p)
    assert x.dtype == jnp.bfloat16
    _assert_rate(x, float(p[0]))


@pytest.mark.parametrize(
    ("op", "p"),
    [
        pytest.param(aten.bernoulli.p, 0.2, id="p"),
        pytest.param(aten.bernoulli.Tensor, torch.tensor(0.7), id="Tensor"),
    ],
)
def test_bernoulli_given_p_rate(op, p):
    x = _draw(op, torch.zeros(N, dtype=torch.float64), p)
    assert x.dtype == jnp.float64
    _assert_rate(x, float(p))


@pytest.mark.parametrize(
    ("op", "args", "low", "high"),
    [
        pytest.param(aten.randint.default, (7, [N]), 0, 7, id="randint"),
        pytest.param(aten.randint.low, (-3, 4, [N]), -3, 4, id="randint-low"),
        pytest.param(aten.randint_like.default, (ones, 5), 0, 5, id="randint_like"),
        pytest.param(aten.randint_like.low_dtype, (ones, 2, 6), 2, 6, id="randint_like-low"),
        pytest.param(getattr(aten.random, "from"), (ones, -4, 4), -4, 4, id="random-from"),
        pytest.param(aten.random.to, (ones, 6), 0, 6, id="random-to"),
    ],
)
def test_integers_cover_exactly_the_range_uniformly(op, args, low, high):
    x = _np(_draw(op, *args))
    assert set(np.unique(x)) == set(range(low, high))
    _assert_mean_std(x, (low + high - 1) / 2, math.sqrt(((high - low) ** 2 - 1) / 12))


@pytest.mark.parametrize(
    ("dtype", "high"),
    [
        pytest.param(torch.float32, 2**24, id="f32-mantissa"),
        pytest.param(torch.float16, 2**11, id="f16-mantissa"),
        pytest.param(torch.int8, 127, id="int8"),
        pytest.param(torch.uint8, 255, id="uint8"),
        pytest.param(torch.int64, 2**63 - 1, id="int64"),
    ],
)
def test_random_without_range_spans_the_dtype(dtype, high):
    """random_() draws from [0, 2**digits] for floats and [0, max] for integers."""
    x = _draw(aten.random.default, torch.zeros(N, dtype=dtype))
    assert x.dtype == jnp.dtype(str(dtype).removeprefix("torch."))
    values = np.asarray(x).astype(np.float64 if dtype.is_floating_point else np.int64)
    assert values.min() >= 0 and values.max() <= high
    assert values.max() > 0.99 * high


def test_random_from_without_to_reaches_the_dtype_max():
    x = np.asarray(_draw(getattr(aten.random, "from"), torch.zeros(N, dtype=torch.int8), -5, None))
    assert set(np.unique(x)) == set(range(-5, 128))


def test_random_bool_draws_both_values():
    x = np.asarray(_draw(aten.random.default, torch.zeros(1000, dtype=torch.bool)))
    assert x.dtype == np.bool_ and 300 < x.sum() < 700


@pytest.mark.parametrize("n", [0, 1, 1000])
def test_randperm_is_a_permutation(n):
    x = np.asarray(_draw(aten.randperm.default, n))
    assert x.dtype == np.int64 and np.array_equal(np.sort(x), np.arange(n))
    if n > 1:
        assert not np.array_equal(x, np.arange(n))


def test_native_dropout_keeps_one_minus_p_and_rescales():
    x = torch.randn(N, generator=torch.Generator().manual_seed(0))
    out, mask = _draw(aten.native_dropout.default, x, 0.3, True)
    assert mask.dtype == jnp.bool_
    _assert_rate(mask, 0.7)
    expected = np.where(np.asarray(mask), x.numpy() / 0.7, 0.0)
    assert_close(torch.from_numpy(np.array(out)), torch.from_numpy(expected), tol="single_op")


@pytest.mark.parametrize(
    ("p", "train", "kept"),
    [
        pytest.param(0.0, True, True, id="p0-keeps-all"),
        pytest.param(1.0, True, False, id="p1-drops-all"),
        pytest.param(0.5, False, True, id="eval-keeps-all"),
    ],
)
def test_native_dropout_edge_cases(p, train, kept):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    out, mask = _draw(aten.native_dropout.default, x, p, train)
    assert np.all(np.asarray(mask) == kept)
    np.testing.assert_array_equal(np.asarray(out), x.numpy() if kept else np.zeros(1000))


def test_native_dropout_train_none_trains_like_torch():
    """PyTorch's kernels read train=None as training."""
    _, mask = _draw(aten.native_dropout.default, torch.ones(N), 0.5, None)
    _assert_rate(mask, 0.5)


def test_dropout_backward_is_one_op_equal_to_cpu():
    """Dropout's backward reaches the device as one op (PyTorch/XLA's xla::native_dropout_backward
    counter) and equals CPU's kernel on the same gradient and mask, in float32 and bfloat16."""
    import spmd_torch.debug.metrics as met

    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        grad, mask = torch.randn(64, 8, generator=g).to(dtype), torch.rand(64, 8, generator=g) > 0.3
        before = met.counter_value("xla::native_dropout_backward") or 0
        got = torch.ops.aten.native_dropout_backward(grad.to("xla"), mask.to("xla"), 1 / 0.7)
        assert met.counter_value("xla::native_dropout_backward") == before + 1
        expected = torch.ops.aten.native_dropout_backward(grad, mask, 1 / 0.7)
        assert_close(got.cpu(), expected, tol="exact" if dtype == torch.float32 else "single_op")


def test_rrelu_with_noise_trains_with_uniform_slopes_and_keeps_them():
    """On the device, rrelu_with_noise (which writes its noise argument) is one lowered op: in
    training the slopes of elements at or below 0 are uniform in [lower, upper] (mean within 5
    standard errors), written into the noise, which the output and the gradient are x times;
    in eval it equals CPU's kernel and leaves the noise as it was."""
    import spmd_torch.debug.metrics as met

    x = torch.randn(N, generator=torch.Generator().manual_seed(0))
    noise, xd = torch.zeros(N).to("xla"), x.to("xla").requires_grad_()
    fallbacks = met.counter_value("aten::rrelu_with_noise")
    out = aten.rrelu_with_noise(xd, noise, 0.1, 0.3, True)
    out.sum().backward()
    assert met.counter_value("aten::rrelu_with_noise") == fallbacks  # no CPU fallback
    slopes, negative = noise.cpu(), x <= 0
    assert torch.all(slopes[~negative] == 1)
    assert torch.all((slopes[negative] >= 0.1) & (slopes[negative] <= 0.3))
    _assert_mean_std(jnp.asarray(slopes[negative].numpy()), 0.2, 0.2 / math.sqrt(12))
    assert_close(out.cpu(), x * slopes, tol="exact")
    assert_close(xd.grad.cpu(), slopes, tol="exact")
    kept = torch.full((8,), 7.0)
    small = torch.randn(8, generator=torch.Generator().manual_seed(1))
    got = aten.rrelu_with_noise(small.to("xla"), device_kept := kept.to("xla"), 0.1, 0.3, False)
    assert_close(
        got.cpu(), aten.rrelu_with_noise(small, kept.clone(), 0.1, 0.3, False), tol="exact"
    )
    assert torch.equal(device_kept.cpu(), kept)


def test_exponential_moments():
    _assert_mean_std(_draw(aten.exponential.default, ones, 4.0), 0.25, 0.25)


def test_multinomial_with_replacement_follows_the_probabilities():
    p = torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.0, 0.0, 1.0, 0.0]])
    x = np.asarray(_draw(aten.multinomial.default, p, N, True))
    assert x.shape == (2, N)
    for k in (0, 2, 3):
        _assert_rate(x[0] == k, float(p[0, k]))
    assert not np.any(x[0] == 1) and np.all(x[1] == 2)


def test_multinomial_without_replacement_draws_distinct_likely_first():
    """Distinct per row, never a zero-probability index; the first draw follows p."""
    p = torch.tensor([0.5, 0.0, 0.3, 0.2]).expand(N // 10, 4).contiguous()
    x = np.asarray(_draw(aten.multinomial.default, p, 3))
    assert x.shape == (N // 10, 3)
    assert np.all(np.sort(x, axis=1) == [0, 2, 3])
    _assert_rate(x[:, 0] == 0, 0.5)
    _assert_rate(x[:, 0] == 3, 0.2)
