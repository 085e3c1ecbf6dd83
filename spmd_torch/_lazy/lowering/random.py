"""Lowerings: random ops, drawn from the ``jax.random`` key the engine threads through the graph.

Each lowering gets one opaque typed key and uses it once, so equal keys give equal numbers.
Placement keyword arguments (layout, device, pin_memory, memory_format, generator) are the
engine's business and are taken as ``**_``; a ``None`` dtype means the default float dtype, or int64
where the schema says so.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .dtypes import to_jax_dtype
from .registry import EngineOp, lowers

aten = torch.ops.aten
KEY_IMPL = "threefry2x32"
RNG_SPLIT = EngineOp("rng_split")  # threads the device PRNG key: key -> (next key, subkey)


def key_words(seed: int) -> np.ndarray:
    """The raw key (two uint32 words) that seed ``seed`` starts from: threefry's seeding of a
    32-bit seed, ``jax.random.key(uint32(seed))``, computed on the host (no device work)."""
    return np.array([0, seed & 0xFFFFFFFF], dtype=np.uint32)


def wrap_key(raw_key: jax.Array) -> jax.Array:
    """The typed key random lowerings take, from the raw words the graph threads."""
    return jax.random.wrap_key_data(raw_key, impl=KEY_IMPL)


@lowers(RNG_SPLIT)
def _rng_split(raw_key):
    """(next state, subkey) as raw key data: the state stays data, so programs never change."""
    nxt, sub = jax.random.split(wrap_key(raw_key))
    return jax.random.key_data(nxt), jax.random.key_data(sub)


def _float_dtype(dtype: torch.dtype | None) -> np.dtype:
    """The device dtype of a float factory; None means torch's default dtype (float32)."""
    return to_jax_dtype(dtype if dtype is not None else torch.get_default_dtype())


def _like_dtype(x: jax.Array, dtype: torch.dtype | None) -> np.dtype:
    """The dtype of a ``*_like`` op: the input's unless one is given."""
    return x.dtype if dtype is None else to_jax_dtype(dtype)


def _randint(key: jax.Array, shape: tuple, low: object, high: object, dtype: np.dtype):
    """Integers in [low, high) as ``dtype``, sampled as integers so even int64 ranges are exact.

    ``high`` may be one past int64's max (random_'s full range), which only a uint64 bound holds.
    """
    sample = dtype if jnp.issubdtype(dtype, jnp.integer) else jnp.dtype(jnp.int64)
    if isinstance(high, int) and high > np.iinfo(np.int64).max:
        high = np.uint64(high)
    return jax.random.randint(key, shape, low, high, sample).astype(dtype)


def _random_end(dtype: np.dtype) -> int:
    """One past the largest value random_() draws without a bound: 2**digits for floats, so that
    every value is exact, else the dtype's max."""
    if jnp.issubdtype(dtype, jnp.floating):
        return 2 ** (jnp.finfo(dtype).nmant + 1) + 1
    return 2 if dtype == jnp.bool_ else int(jnp.iinfo(dtype).max) + 1


@lowers(aten.uniform.default, random=True)
def _uniform(key, x, from_=0.0, to=1.0, **_):
    return jax.random.uniform(key, x.shape, x.dtype, from_, to)


@lowers(aten.normal_functional.default, random=True)
def _normal_functional(key, x, mean=0.0, std=1.0, **_):
    return mean + std * jax.random.normal(key, x.shape, x.dtype)


@lowers(aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor, random=True)
def _normal_tensor(key, mean, std=1.0, **_):
    """The output takes the broadcast shape and the floating dtype of the tensor arguments."""
    shape = jnp.broadcast_shapes(jnp.shape(mean), jnp.shape(std))
    dtype = jnp.result_type(*(a for a in (mean, std) if isinstance(a, jax.Array)))
    return mean + std * jax.random.normal(key, shape, dtype)


@lowers(aten.normal.float_float, random=True)
def _normal_float_float(key, mean, std, size, dtype=None, **_):
    return mean + std * jax.random.normal(key, tuple(size), _float_dtype(dtype))


@lowers(aten.bernoulli.default, random=True)
def _bernoulli(key, x, **_):
    """``x`` holds the probabilities; they are compared in at least float32, so bf16 inputs do not
    quantize the rate to bf16's coarse uniform grid."""
    p = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return jax.random.bernoulli(key, p).astype(x.dtype)


@lowers(aten.bernoulli.p, aten.bernoulli.Tensor, random=True)
def _bernoulli_p(key, x, p, **_):
    return jax.random.bernoulli(key, jnp.asarray(p, draw_dtype(x.dtype)), x.shape).astype(x.dtype)


def draw_dtype(dtype) -> np.dtype:
    """The float a probability is drawn in: float32, float64 only for float64 tensors. A Python
    rate is a float64 under spmd_torch's ``jax_enable_x64``, and JAX draws in the rate's dtype:
    64-bit random bits, twice the work, and a bitcast of 64-bit words to float64 that TPUs,
    which run 64-bit types by rewriting them as 32-bit pairs, cannot rewrite."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


@lowers(aten.rand.default, random=True)
def _rand(key, size, dtype=None, **_):
    return jax.random.uniform(key, tuple(size), _float_dtype(dtype))


@lowers(aten.randn.default, random=True)
def _randn(key, size, dtype=None, **_):
    return jax.random.normal(key, tuple(size), _float_dtype(dtype))


@lowers(aten.rand_like.default, random=True)
def _rand_like(key, x, dtype=None, **_):
    return jax.random.uniform(key, x.shape, _like_dtype(x, dtype))


@lowers(aten.randn_like.default, random=True)
def _randn_like(key, x, dtype=None, **_):
    return jax.random.normal(key, x.shape, _like_dtype(x, dtype))


@lowers(aten.randint.default, random=True)
def _randint_high(key, high, size, dtype=torch.int64, **_):
    return _randint(key, tuple(size), 0, high, to_jax_dtype(dtype or torch.int64))


@lowers(aten.randint.low, random=True)
def _randint_low(key, low, high, size, dtype=torch.int64, **_):
    return _randint(key, tuple(size), low, high, to_jax_dtype(dtype or torch.int64))


@lowers(aten.randint_like.default, aten.randint_like.Tensor, random=True)
def _randint_like(key, x, high, dtype=None, **_):
    return _randint(key, x.shape, 0, high, _like_dtype(x, dtype))


@lowers(aten.randint_like.low_dtype, random=True)
def _randint_like_low(key, x, low, high, dtype=None, **_):
    return _randint(key, x.shape, low, high, _like_dtype(x, dtype))


@lowers(aten.randperm.default, random=True)
def _randperm(key, n, dtype=torch.int64, **_):
    return jax.random.permutation(key, n).astype(to_jax_dtype(dtype or torch.int64))


@lowers(aten.native_dropout.default, random=True)
def _native_dropout(key, x, p, train):
    """Keep each element with probability 1-p and scale kept ones by 1/(1-p); p=1 drops all (no
    inf*0), p=0 keeps all. train=None trains, as PyTorch's kernels do; eval keeps everything."""
    if train is False:
        return x, jnp.ones(x.shape, jnp.bool_)
    keep = jax.random.uniform(key, x.shape, draw_dtype(x.dtype)) >= p
    return jnp.where(keep, x / (1 - p), 0), keep


@lowers(aten.rrelu_with_noise_functional.default, random=True)
def _rrelu_with_noise(key, x, noise, lower=0.125, upper=1 / 3, training=False, **_):
    """(output, noise): training, each element at or below 0 is scaled by a slope drawn from
    U(lower, upper) and the noise keeps the slopes (1 elsewhere); in eval the slope is their mean
    and the noise is left as it was."""
    if not training:
        return jnp.where(x >= 0, x, x * ((lower + upper) / 2)), noise
    slopes = jax.random.uniform(key, x.shape, jnp.float32, lower, upper).astype(x.dtype)
    noise_out = jnp.where(x <= 0, slopes, jnp.ones_like(slopes)).astype(noise.dtype)
    return x * noise_out.astype(x.dtype), noise_out


@lowers(aten.native_dropout_backward.default)
def _native_dropout_backward(grad, mask, scale):
    """The gradient through the kept elements, scaled as the forward scaled them (ATen's order:
    the mask times the scale, then the gradient)."""
    return grad * (mask.astype(grad.dtype) * scale)


@lowers(aten.exponential.default, random=True)
def _exponential(key, x, lambd=1.0, **_):
    return jax.random.exponential(key, x.shape, x.dtype) / lambd


@lowers(aten.cauchy.default, random=True)
def _cauchy(key, x, median=0.0, sigma=1.0, **_):
    return median + sigma * jax.random.cauchy(key, x.shape, x.dtype)


@lowers(aten.log_normal.default, random=True)
def _log_normal(key, x, mean=1.0, std=2.0, **_):
    """exp of a normal with that mean and std (they are the underlying normal's, as in PyTorch)."""
    return jnp.exp(mean + std * jax.random.normal(key, x.shape, x.dtype))


@lowers(aten.geometric.default, random=True)
def _geometric(key, x, p, **_):
    """The number of Bernoulli(p) trials up to the first success (1, 2, ...), in x's dtype."""
    return jax.random.geometric(key, p, x.shape).astype(x.dtype)


@lowers(aten.random.default, random=True)
def _random(key, x, **_):
    return _randint(key, x.shape, 0, _random_end(x.dtype), x.dtype)


@lowers(getattr(aten.random, "from"), random=True)
def _random_from(key, x, from_, to=None, **_):
    return _randint(key, x.shape, from_, _random_end(x.dtype) if to is None else to, x.dtype)


@lowers(aten.random.to, random=True)
def _random_to(key, x, to, **_):
    return _randint(key, x.shape, 0, to, x.dtype)


@lowers(aten.multinomial.default, random=True)
def _multinomial(key, x, num_samples, replacement=False, **_):
    """With replacement: independent categorical draws. Without: the Gumbel top-k trick, which
    samples k distinct indices with exactly PyTorch's sequential without-replacement law."""
    logits = jnp.log(x.astype(jnp.promote_types(x.dtype, jnp.float32)))
    if replacement:
        draws = jax.random.categorical(key, logits, shape=(num_samples, *x.shape[:-1]))
        return jnp.moveaxis(draws, 0, -1)
    perturbed = logits + jax.random.gumbel(key, x.shape, logits.dtype)
    return jax.lax.top_k(perturbed, num_samples)[1].astype(jnp.int64)
