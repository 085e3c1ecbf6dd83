"""Lowerings: convolution, pooling, softmax, normalization, losses, embedding, upsampling.

Norms, softmax and pooling sums of bf16/fp16 inputs run in float32, PyTorch's opmath type, so their
statistics match PyTorch's kernels. Backward ops whose forward is linear in the differentiated input
(convolution, average pooling, upsampling, col2im) are ``jax.vjp`` of the forward lowering: one
definition of the index math serves both directions. Backward ops with an undefined output
(``output_mask`` False, or no weight) return None in its place, as PyTorch's kernels do.
"""

from __future__ import annotations

import itertools
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .dtypes import to_jax_dtype
from .linalg import PRECISION, accumulation_dtype, precision
from .registry import lowers, meta_kernel, register_table

aten = torch.ops.aten

_SPATIAL = {1: "W", 2: "HW", 3: "DHW"}


def _upcast(x: jax.Array) -> jax.Array:
    """x in its accumulation dtype: float32 for bf16/fp16, else unchanged."""
    return x.astype(accumulation_dtype(x.dtype) or x.dtype)


def _expand(v: object, nd: int) -> list[int]:
    """An int or one-element list broadcast to ``nd`` dims, as PyTorch broadcasts ``int[N]``."""
    v = [v] if isinstance(v, int) else list(v)
    return v * nd if len(v) == 1 else v


def _vjp(f, primal: jax.Array, cotangent: jax.Array) -> jax.Array:
    """The gradient of linear ``f`` for ``cotangent``; ``primal`` only supplies shape and dtype."""
    out, pullback = jax.vjp(f, primal)
    return pullback(cotangent.astype(out.dtype))[0]


def _per_channel(v: jax.Array, ndim: int) -> jax.Array:
    """A (C,) vector shaped to broadcast against an (N, C, *spatial) tensor."""
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def _affine(x: jax.Array, weight, bias) -> jax.Array:
    """x * weight + bias, each optional."""
    if weight is not None:
        x = x * weight
    return x if bias is None else x + bias


def _reduce(loss: jax.Array, reduction: int) -> jax.Array:
    """PyTorch's Reduction enum: 0 none, 1 mean, 2 sum."""
    return loss if reduction == 0 else loss.mean() if reduction == 1 else loss.sum()


# --- convolution ---------------------------------------------------------------------------------


def _transposed_kernel(w: jax.Array, groups: int) -> jax.Array:
    """(C_in, C_out/g, *k) transposed-conv weights as flipped (C_out, C_in/g, *k) conv weights."""
    c_in, c_out_g, *k = w.shape
    w = w.reshape(groups, c_in // groups, c_out_g, *k).swapaxes(1, 2)
    w = w.reshape(groups * c_out_g, c_in // groups, *k)
    return jnp.flip(w, tuple(range(2, w.ndim)))


def _conv(x, w, stride, padding, dilation, transposed, output_padding, groups, accumulate=True):
    """aten.convolution without bias; transposed = input-dilated conv with flipped weights."""
    nd = x.ndim - 2
    stride, padding, dilation = _expand(stride, nd), _expand(padding, nd), _expand(dilation, nd)
    if transposed:
        k = w.shape[2:]
        output_padding = _expand(output_padding, nd)
        pads = [
            (d * (kk - 1) - p, d * (kk - 1) - p + op)
            for kk, p, d, op in zip(k, padding, dilation, output_padding)
        ]
        w, lhs_dilation, stride = _transposed_kernel(w, groups), stride, [1] * nd
    else:
        pads, lhs_dilation = [(p, p) for p in padding], [1] * nd
    spatial = _SPATIAL[nd]
    return lax.conv_general_dilated(
        x,
        w,
        window_strides=stride,
        padding=pads,
        lhs_dilation=lhs_dilation,
        rhs_dilation=dilation,
        dimension_numbers=("NC" + spatial, "OI" + spatial, "NC" + spatial),
        feature_group_count=groups,
        precision=precision(),
        preferred_element_type=accumulation_dtype(x.dtype) if accumulate else None,
    )


@lowers(aten.convolution.default)
def _convolution(
    input, weight, bias, stride, padding, dilation, transposed, output_padding, groups
):
    """Bias joins in the accumulation dtype, so bf16 rounds once, after it."""
    out = _conv(input, weight, stride, padding, dilation, transposed, output_padding, groups)
    if bias is not None:
        out = out + _per_channel(bias, out.ndim)
    return out.astype(input.dtype)


@lowers(aten.convolution_backward.default)
def _convolution_backward(
    grad_output,
    input,
    weight,
    bias_sizes,
    stride,
    padding,
    dilation,
    transposed,
    output_padding,
    groups,
    output_mask,
):
    """vjp of the forward; bf16 stays bf16 here since XLA accumulates bf16 convs in f32 anyway."""
    conv = partial(
        _conv,
        stride=stride,
        padding=padding,
        dilation=dilation,
        transposed=transposed,
        output_padding=output_padding,
        groups=groups,
        accumulate=False,
    )
    _, pullback = jax.vjp(conv, input, weight)
    grad_input, grad_weight = pullback(grad_output.astype(input.dtype))
    grad_bias = _upcast(grad_output).sum((0, *range(2, grad_output.ndim)))
    return tuple(
        g if m else None for g, m in zip((grad_input, grad_weight, grad_bias), output_mask)
    )


# --- pooling -------------------------------------------------------------------------------------


def _pool_size(size, k, s, p, d, ceil_mode) -> tuple[int, int]:
    """PyTorch's pooling_output_shape, and the high-side padding the last window needs."""
    out = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1  # the last window must start inside the input or its left padding
    return out, max(0, (out - 1) * s + d * (k - 1) + 1 - size - p)


def _windows(x, kernel, stride, padding, dilation, ceil_mode, fill):
    """Every pooling window of the trailing ``len(kernel)`` dims, as a new last axis."""
    lead = x.ndim - len(kernel)
    sizes = [
        _pool_size(*a, ceil_mode) for a in zip(x.shape[lead:], kernel, stride, padding, dilation)
    ]
    pads = [(0, 0, 0)] * lead + [(p, hi, 0) for p, (_, hi) in zip(padding, sizes)]
    x = lax.pad(x, jnp.array(fill, x.dtype), pads)
    windows = []
    for offset in itertools.product(*(range(k) for k in kernel)):
        start = [o * d for o, d in zip(offset, dilation)]
        limit = [st + (n - 1) * s + 1 for st, (n, _), s in zip(start, sizes, stride)]
        windows.append(
            lax.slice(x, [0] * lead + start, list(x.shape[:lead]) + limit, [1] * lead + stride)
        )
    return jnp.stack(windows, -1)


def _pool_args(nd, kernel_size, stride, padding, dilation=1):
    """Kernel, stride (empty means the kernel), padding and dilation, each ``nd`` long."""
    kernel = _expand(kernel_size, nd)
    return kernel, _expand(stride or kernel, nd), _expand(padding, nd), _expand(dilation, nd)


def _max_pool(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False, *, nd):
    """Max and its index into the flattened unpadded input plane; first max wins, NaN beats all."""
    kernel, stride, padding, dilation = _pool_args(nd, kernel_size, stride, padding, dilation)
    floating = jnp.issubdtype(self.dtype, jnp.floating)
    fill = -jnp.inf if floating else jnp.iinfo(self.dtype).min
    windows = _windows(self, kernel, stride, padding, dilation, ceil_mode, fill)
    best = jnp.argmax(windows, -1)
    values = jnp.take_along_axis(windows, best[..., None], -1)[..., 0]
    index = 0
    for i, offset in enumerate(jnp.unravel_index(best, kernel)):
        axis_shape = [-1] + [1] * (nd - 1 - i)
        start = (jnp.arange(best.shape[i - nd]) * stride[i] - padding[i]).reshape(axis_shape)
        index = index * self.shape[i - nd] + start + offset * dilation[i]
    return values, index.astype(jnp.int64)


def _max_pool_backward(
    grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices, *, nd
):
    return _to_indices(grad_output, self, indices, nd)


def _window_max(x, positions: list):
    """The max of each window and its index into the flattened input plane, first max winning
    and NaN beating all (as max_pool's): ``positions[i]``, of shape (planes or 1s..., n_i, k_i),
    lists the input positions along spatial axis i of the n_i windows, k_i each."""
    nd, lead = len(positions), x.ndim - len(positions)
    positions = [jnp.asarray(p).reshape((1,) * (lead + 2 - p.ndim) + p.shape) for p in positions]
    windows = x
    for i, p in enumerate(positions):
        flat = p.reshape(p.shape[:lead] + (1,) * i + (-1,) + (1,) * (nd - 1 - i))
        windows = jnp.take_along_axis(windows, flat, axis=lead + i)
    # (..., n1 * k1, n2 * k2, ...) -> (..., n1, n2, ..., k1 * k2 * ...)
    windows = windows.reshape(windows.shape[:lead] + sum((p.shape[-2:] for p in positions), ()))
    windows = jnp.moveaxis(windows, [lead + 2 * i + 1 for i in range(nd)], range(-nd, 0))
    windows = windows.reshape(windows.shape[: lead + nd] + (-1,))
    best = jnp.argmax(windows, -1)
    values = jnp.take_along_axis(windows, best[..., None], -1)[..., 0]
    index = 0
    for i, offset in enumerate(jnp.unravel_index(best, [p.shape[-1] for p in positions])):
        p = positions[i]  # (..., n_i, k_i) -> (..., 1s, n_i, 1s, k_i): indexed by the offset
        table = p.reshape(
            p.shape[:lead] + (1,) * i + p.shape[-2:-1] + (1,) * (nd - 1 - i) + p.shape[-1:]
        )
        position = jnp.take_along_axis(table, offset[..., None], -1)[..., 0]
        index = index * x.shape[lead + i] + position
    return values, index.astype(jnp.int64)


def _adaptive_bins(size: int, n_out: int) -> np.ndarray:
    """(n_out, widest bin) input positions of PyTorch's bins [floor(i*L/n), ceil((i+1)*L/n));
    a narrower bin repeats its last position, which changes neither its max nor the first one."""
    starts = np.arange(n_out) * size // n_out
    ends = -(-(np.arange(n_out) + 1) * size // n_out)
    offsets = np.arange(int((ends - starts).max()))
    return np.minimum(starts[:, None] + offsets, ends[:, None] - 1)


def _adaptive_max_pool(self, output_size):
    """Each of PyTorch's bins' max and its index into the flattened input plane."""
    lead = self.ndim - len(output_size)
    sizes = zip(self.shape[lead:], output_size)
    return _window_max(self, [_adaptive_bins(size, n) for size, n in sizes])


def _fractional_starts(sample, size: int, kernel: int, n_out: int):
    """ATen's generate_intervals: window starts trunc((i + u) * a) - trunc(u * a), a = (size -
    kernel) / (n_out - 1), computed in the input's dtype; the last window ends at the edge."""
    alpha = jnp.asarray(size - kernel, sample.dtype) / max(n_out - 1, 1)
    i = jnp.arange(n_out - 1, dtype=sample.dtype)
    starts = jnp.trunc((i + sample[..., None]) * alpha) - jnp.trunc(sample * alpha)[..., None]
    last = jnp.full(sample.shape + (1,), size - kernel, jnp.int32)
    return jnp.concatenate([starts.astype(jnp.int32), last], axis=-1)


def _fractional_max_pool(self, kernel_size, output_size, random_samples):
    """Max over windows placed by one random sample per plane and dimension; first max wins.
    The samples' order is ATen's: 2-D takes (width, height), 3-D (time, height, width)."""
    nd = len(output_size)
    lead = self.ndim - nd
    samples = random_samples.reshape(self.shape[:lead] + (nd,)).astype(self.dtype)
    order = (1, 0) if nd == 2 else (0, 1, 2)
    positions = [
        _fractional_starts(samples[..., order[i]], self.shape[lead + i], k, n)[..., None]
        + jnp.arange(k)
        for i, (k, n) in enumerate(zip(kernel_size, output_size))
    ]
    return _window_max(self, positions)


@lowers(aten.fractional_max_pool2d.default, aten.fractional_max_pool3d.default)
def _fractional_max_pool_lowering(self, kernel_size, output_size, random_samples):
    return _fractional_max_pool(self, tuple(kernel_size), tuple(output_size), random_samples)


@lowers(aten.fractional_max_pool2d_backward.default, aten.fractional_max_pool3d_backward.default)
def _fractional_max_pool_backward(grad_output, self, kernel_size, output_size, indices):
    return _to_indices(grad_output, self, indices, len(output_size))


@lowers(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def _adaptive_max_pool_lowering(self, output_size):
    return _adaptive_max_pool(self, tuple(output_size))


@lowers(aten.adaptive_max_pool2d_backward.default)
def _adaptive_max_pool2d_backward(grad_output, self, indices):
    return _to_indices(grad_output, self, indices, 2)


@lowers(aten.adaptive_max_pool3d_backward.default)
def _adaptive_max_pool3d_backward(grad_output, self, indices):
    return _to_indices(grad_output, self, indices, 3)


def _to_indices(grad_output, self, indices, nd):
    """Scatter-add each output's gradient onto the input element its index (into the flattened
    last ``nd`` dims) names: every max pool's backward."""
    rows = math.prod(self.shape[:-nd])
    grad = _upcast(grad_output).reshape(rows, -1)
    out = jnp.zeros((rows, math.prod(self.shape[-nd:])), grad.dtype)
    out = out.at[jnp.arange(rows)[:, None], indices.reshape(rows, -1)].add(grad)
    return out.reshape(self.shape)


def _pool_divisor(size, k, s, p, n_out, count_include_pad) -> np.ndarray:
    """Per-dim avg_pool divisor: the window clipped to the padded input, or to the input alone."""
    start = np.arange(n_out) * s - p
    end = np.minimum(start + k, size + p)
    if count_include_pad:
        return end - start
    return np.minimum(end, size) - np.maximum(start, 0)


def _avg_pool(
    self,
    kernel_size,
    stride=(),
    padding=0,
    ceil_mode=False,
    count_include_pad=True,
    divisor_override=None,
    *,
    nd,
):
    """Window sums over zero padding, divided by PyTorch's per-window count (a static table)."""
    kernel, stride, padding, _ = _pool_args(nd, kernel_size, stride, padding)
    lead = self.ndim - nd
    sizes = [_pool_size(*a, 1, ceil_mode) for a in zip(self.shape[lead:], kernel, stride, padding)]
    x = _upcast(self)
    total = lax.reduce_window(
        x,
        np.array(0, x.dtype),  # a concrete zero: JAX then knows the sum and can differentiate it
        lax.add,
        (1,) * lead + tuple(kernel),
        (1,) * lead + tuple(stride),
        [(0, 0)] * lead + [(p, hi) for p, (_, hi) in zip(padding, sizes)],
    )
    if divisor_override:
        return (total / divisor_override).astype(self.dtype)
    divisor = np.ones((), np.int64)
    for size, k, s, p, (n, _) in zip(self.shape[lead:], kernel, stride, padding, sizes):
        divisor = np.multiply.outer(divisor, _pool_divisor(size, k, s, p, n, count_include_pad))
    return (total / divisor).astype(self.dtype)


def _avg_pool_backward(grad_output, self, *args, nd):
    return _vjp(lambda x: _avg_pool(x, *args, nd=nd), self, grad_output)


def _adaptive_matrix(size: int, n_out: int) -> np.ndarray:
    """(n_out, size) averaging matrix over PyTorch's bins [floor(i*L/n), ceil((i+1)*L/n))."""
    m = np.zeros((n_out, size))
    for i in range(n_out):
        start, end = i * size // n_out, -(-(i + 1) * size // n_out)
        m[i, start:end] = 1 / (end - start)
    return m


def _adaptive_avg_pool(self, output_size):
    """Bins of equal size reshape into a mean; uneven bins contract with an averaging matrix."""
    out = _upcast(self)
    for i, n in enumerate(output_size):
        axis = self.ndim - len(output_size) + i
        size = out.shape[axis]
        if size % n == 0:
            out = out.reshape(out.shape[:axis] + (n, size // n) + out.shape[axis + 1 :])
            out = out.mean(axis + 1)
        else:
            m = jnp.asarray(_adaptive_matrix(size, n), out.dtype)
            out = jnp.moveaxis(
                jnp.tensordot(out, m, ((axis,), (1,)), precision=PRECISION), -1, axis
            )
    return out.astype(self.dtype)


def _adaptive_avg_pool_backward(grad_output, self, *, nd):
    size = grad_output.shape[-nd:]
    return _vjp(lambda x: _adaptive_avg_pool(x, size), self, grad_output)


for _nd in (2, 3):
    lowers(getattr(aten, f"max_pool{_nd}d_with_indices").default)(partial(_max_pool, nd=_nd))
    lowers(getattr(aten, f"max_pool{_nd}d_with_indices_backward").default)(
        partial(_max_pool_backward, nd=_nd)
    )
    lowers(getattr(aten, f"avg_pool{_nd}d").default)(partial(_avg_pool, nd=_nd))
    lowers(getattr(aten, f"avg_pool{_nd}d_backward").default)(partial(_avg_pool_backward, nd=_nd))
    lowers(getattr(aten, f"_adaptive_avg_pool{_nd}d").default)(_adaptive_avg_pool)
    lowers(getattr(aten, f"_adaptive_avg_pool{_nd}d_backward").default)(
        partial(_adaptive_avg_pool_backward, nd=_nd)
    )


@lowers(aten.im2col.default)
def _im2col(self, kernel_size, dilation, padding, stride):
    """(…, C, H, W) -> (…, C*kh*kw, L): channel-major columns, as nn.Unfold lays them out."""
    kernel, stride, padding, dilation = _pool_args(2, kernel_size, stride, padding, dilation)
    windows = jnp.moveaxis(_windows(self, kernel, stride, padding, dilation, False, 0), -1, -3)
    *lead, channels, taps, rows, cols = windows.shape  # sizes spelled out: the batch may be 0
    return windows.reshape(*lead, channels * taps, rows * cols)


@lowers(aten.col2im.default)
def _col2im(self, output_size, kernel_size, dilation, padding, stride):
    """The adjoint of im2col: overlapping columns sum into the image."""
    channels = self.shape[-2] // math.prod(_expand(kernel_size, 2))
    image = jnp.zeros(self.shape[:-2] + (channels, *output_size), self.dtype)
    return _vjp(lambda x: _im2col(x, kernel_size, dilation, padding, stride), image, self)


# --- softmax -------------------------------------------------------------------------------------


def _over(x, dim):
    """The axes a softmax of ``x`` along ``dim`` reduces: none for a 0-dim ``x`` (PyTorch takes
    its dim 0 or -1 as the one element's: softmax 1, log-softmax 0)."""
    return () if x.ndim == 0 else dim


def _softmax_in_opmath(fn):
    """``fn`` over ``dim`` in float32 for bf16/fp16 inputs; ``half_to_float`` keeps the float32
    result instead of rounding it back."""

    def lowering(self, dim, half_to_float):
        out = fn(_upcast(self), axis=_over(self, dim))
        return out if half_to_float else out.astype(self.dtype)

    return lowering


register_table(
    {
        aten._softmax.default: _softmax_in_opmath(jax.nn.softmax),
        aten._log_softmax.default: _softmax_in_opmath(jax.nn.log_softmax),
    }
)


@lowers(aten._safe_softmax.default)
def _safe_softmax(self, dim, dtype=None):
    """Softmax whose fully masked (all -inf) rows are 0, not NaN: what SDPA's math path calls."""
    x = self if dtype is None else self.astype(to_jax_dtype(dtype))
    out = jax.nn.softmax(_upcast(x), axis=_over(x, dim))
    masked = jnp.all(x == -jnp.inf, axis=_over(x, dim), keepdims=True)
    return jnp.where(masked, 0, out).astype(x.dtype)


@lowers(aten._softmax_backward_data.default)
def _softmax_backward_data(grad_output, output, dim, input_dtype):
    """From the saved output y: y * (g - sum(g * y)); the result takes the forward input's dtype."""
    g, y = _upcast(grad_output), _upcast(output)
    return (y * (g - (g * y).sum(_over(y, dim), keepdims=True))).astype(to_jax_dtype(input_dtype))


@lowers(aten._log_softmax_backward_data.default)
def _log_softmax_backward_data(grad_output, output, dim, input_dtype):
    """From the saved output y: g - exp(y) * sum(g); the result takes the forward input's dtype."""
    g, y = _upcast(grad_output), _upcast(output)
    return (g - jnp.exp(y) * g.sum(_over(y, dim), keepdims=True)).astype(to_jax_dtype(input_dtype))


# --- normalization -------------------------------------------------------------------------------


def _moments(x: jax.Array, axes: tuple) -> tuple[jax.Array, jax.Array]:
    """Mean and biased variance over ``axes``; two passes, so the variance is never negative."""
    mean = x.mean(axes, keepdims=True)
    return mean, jnp.square(x - mean).mean(axes, keepdims=True)


def _normalized_grad(g, xhat, rstd, axes):
    """d/dx of (x - mean) * rstd with the statistics over ``axes`` taken from x itself."""
    mean_g = g.mean(axes, keepdims=True)
    return rstd * (g - mean_g - xhat * (g * xhat).mean(axes, keepdims=True))


@lowers(aten.native_layer_norm.default)
def _native_layer_norm(input, normalized_shape, weight, bias, eps):
    """Mean and rstd keep the normalized dims as size 1, the shape autograd saves them in."""
    axes = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    x = _upcast(input)
    mean, var = _moments(x, axes)
    rstd = 1 / jnp.sqrt(var + eps)
    return _affine((x - mean) * rstd, weight, bias).astype(input.dtype), mean, rstd


@lowers(aten.native_layer_norm_backward.default)
def _native_layer_norm_backward(
    grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask
):
    """Gradients from the saved statistics; weight/bias grads exist only where weight/bias do."""
    axes = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    batch = tuple(range(input.ndim - len(normalized_shape)))
    g, xhat = _upcast(grad_out), (_upcast(input) - mean) * rstd
    grad_input = _normalized_grad(_affine(g, weight, None), xhat, rstd, axes)
    grad_weight = (g * xhat).sum(batch) if weight is not None else None
    grad_bias = g.sum(batch) if bias is not None else None
    return tuple(
        r if m else None for r, m in zip((grad_input, grad_weight, grad_bias), output_mask)
    )


@lowers(aten.native_group_norm.default)
def _native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    """Statistics per (sample, group), returned as (N, group) like PyTorch's."""
    x = _upcast(input).reshape(N, group, -1)
    mean, var = _moments(x, (2,))
    rstd = 1 / jnp.sqrt(var + eps)
    out = ((x - mean) * rstd).reshape(input.shape)
    w = None if weight is None else _per_channel(weight, input.ndim)
    b = None if bias is None else _per_channel(bias, input.ndim)
    return _affine(out, w, b).astype(input.dtype), mean[..., 0], rstd[..., 0]


@lowers(aten.native_group_norm_backward.default)
def _native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    """Gradients from the saved statistics; weight/bias grads sum over samples and HxW."""
    shape = (N, group, C // group, HxW)
    g, x = _upcast(grad_out).reshape(shape), _upcast(input).reshape(shape)
    mean, rstd = mean[..., None, None], rstd[..., None, None]
    xhat = (x - mean) * rstd
    gw = g if weight is None else g * weight.reshape(1, group, -1, 1)
    grad_input = _normalized_grad(gw, xhat, rstd, (2, 3)).reshape(input.shape)
    grad_weight = (g * xhat).sum((0, 3)).reshape(C)
    grad_bias = g.sum((0, 3)).reshape(C)
    return tuple(
        r if m else None for r, m in zip((grad_input, grad_weight, grad_bias), output_mask)
    )


def _batch_norm_apply(input, weight, bias, mean, invstd):
    """(x - mean) * invstd * weight + bias with (C,) statistics, in the accumulation dtype."""
    nd = input.ndim
    out = (_upcast(input) - _per_channel(mean, nd)) * _per_channel(invstd, nd)
    w = None if weight is None else _per_channel(weight, nd)
    b = None if bias is None else _per_channel(bias, nd)
    return _affine(out, w, b).astype(input.dtype)


def _batch_norm_train(input, weight, bias, eps):
    """Output, batch mean, invstd and the biased batch variance."""
    mean, var = _moments(_upcast(input), (0, *range(2, input.ndim)))
    mean, var = mean.reshape(-1), var.reshape(-1)
    invstd = 1 / jnp.sqrt(var + eps)
    return _batch_norm_apply(input, weight, bias, mean, invstd), mean, invstd, var


def _batch_norm_eval(input, weight, bias, running_mean, running_var, eps):
    """Output from the running statistics; PyTorch saves no statistics in eval (empty tensors)."""
    invstd = 1 / jnp.sqrt(_upcast(running_var) + eps)
    empty = jnp.zeros((0,), _upcast(input).dtype)
    return _batch_norm_apply(input, weight, bias, running_mean, invstd), empty, empty


@lowers(aten._native_batch_norm_legit_functional.default)
def _native_batch_norm_legit_functional(
    input, weight, bias, running_mean, running_var, training, momentum, eps
):
    """Also returns the updated running stats; the variance enters them unbiased, as PyTorch's."""
    if not training:
        out = _batch_norm_eval(input, weight, bias, running_mean, running_var, eps)
        return (*out, running_mean, running_var)
    out, mean, invstd, var = _batch_norm_train(input, weight, bias, eps)
    n = input.size // input.shape[1]
    new_mean = (1 - momentum) * running_mean + momentum * mean
    new_var = (1 - momentum) * running_var + momentum * var * n / (n - 1)
    return out, mean, invstd, new_mean, new_var


@lowers(aten._native_batch_norm_legit_no_training.default)
def _native_batch_norm_legit_no_training(
    input, weight, bias, running_mean, running_var, momentum, eps
):
    """The statistics it used, per channel, where the meta kernel promises them (AOTAutograd's
    eval graphs); CPU's kernel returns empty ones."""
    out = _batch_norm_eval(input, weight, bias, running_mean, running_var, eps)[0]
    return out, running_mean, 1 / jnp.sqrt(_upcast(running_var) + eps)


@lowers(aten._native_batch_norm_legit.no_stats)
def _native_batch_norm_legit_no_stats(input, weight, bias, training, momentum, eps):
    """Without running stats PyTorch normalizes with batch statistics whatever ``training`` says."""
    return _batch_norm_train(input, weight, bias, eps)[:3]


@lowers(aten.native_batch_norm_backward.default)
def _native_batch_norm_backward(
    grad_out,
    input,
    weight,
    running_mean,
    running_var,
    save_mean,
    save_invstd,
    train,
    eps,
    output_mask,
):
    """In training the batch statistics depend on the input; in eval the norm is affine."""
    nd, axes = input.ndim, (0, *range(2, input.ndim))
    if train:
        mean, invstd = save_mean, save_invstd
    else:
        mean, invstd = running_mean, 1 / jnp.sqrt(_upcast(running_var) + eps)
    g, rstd = _upcast(grad_out), _per_channel(invstd, nd)
    xhat = (_upcast(input) - _per_channel(mean, nd)) * rstd
    gw = g if weight is None else g * _per_channel(weight, nd)
    grad_input = _normalized_grad(gw, xhat, rstd, axes) if train else gw * rstd
    grad_weight, grad_bias = (g * xhat).sum(axes), g.sum(axes)
    return tuple(
        r if m else None for r, m in zip((grad_input, grad_weight, grad_bias), output_mask)
    )


# --- losses --------------------------------------------------------------------------------------


def _nll_weights(self, target, weight, ignore_index):
    """Class axis, target made safe to gather with, and each element's weight (0 where ignored)."""
    axis = 0 if self.ndim == 1 else 1
    valid = target != ignore_index
    safe = jnp.where(valid, target, 0)
    w = jnp.ones(target.shape, self.dtype) if weight is None else weight[safe].astype(self.dtype)
    return axis, valid, safe, jnp.where(valid, w, 0)


@lowers(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def _nll_loss_forward(self, target, weight, reduction, ignore_index):
    """Returns (loss, total_weight); reduction none gives total_weight 0 for a batch, but the
    target's weight for a single (1-d) input, as PyTorch's kernel does."""
    axis, valid, safe, w = _nll_weights(self, target, weight, ignore_index)
    picked = jnp.take_along_axis(self, jnp.expand_dims(safe, axis), axis).squeeze(axis)
    loss = jnp.where(valid, -picked * w, 0)
    if reduction == 0:
        return loss, w if self.ndim == 1 else jnp.zeros((), self.dtype)
    total = w.sum()
    return (loss.sum() / total if reduction == 1 else loss.sum()), total


def _multi_margin_loss(x, target, p, margin, weight, reduction):
    """ATen's multi_margin_loss: per sample, the hinge ``max(0, margin - x[y] + x[j])`` (to the
    power ``p``, weighted by ``weight[y]``) summed over the classes j != y, divided by C."""
    scores = x.reshape(-1, x.shape[-1] if x.ndim else 1)  # a 0-d or 1-d input is one sample
    labels = target.reshape(-1)
    classes = scores.shape[1]
    own = jnp.take_along_axis(scores, labels[:, None], 1)
    hinge = jnp.maximum(margin - own + scores, 0) ** p
    if weight is not None:
        hinge = hinge * weight[labels][:, None]
    hinge = jnp.where(jnp.arange(classes) == labels[:, None], 0, hinge)
    per_sample = hinge.sum(1) / classes
    return _reduce(per_sample if x.ndim == 2 else per_sample.reshape(()), reduction)


@meta_kernel(
    "multi_margin_loss_backward",
    "multilabel_margin_loss_backward",
    "fractional_max_pool3d_backward",
)
def _input_shaped(grad_output, x, *args, **kwargs):
    """A backward's result: shaped like the forward's input."""
    return torch.empty_like(x)


@lowers(aten.multi_margin_loss_backward.default)
def _multi_margin_loss_backward(grad_output, x, target, p, margin, weight=None, reduction=1):
    """The gradient of the loss above."""
    loss = partial(_multi_margin_loss, target=target, p=p, margin=margin, weight=weight)
    return _pullback(partial(loss, reduction=reduction), grad_output, x)


def _pullback(loss, grad_output, x):
    """``grad_output`` taken back through ``loss`` at ``x`` by autodiff (a hinge's slope is 0
    where it is 0, as in ATen's kernels), shaped as the loss's output was."""
    value, pullback = jax.vjp(loss, x)
    return pullback(grad_output.astype(x.dtype).reshape(value.shape))[0]


@lowers(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def _nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    """A one-hot times -weight * grad (over total_weight for mean): no scatter needed."""
    axis, valid, safe, w = _nll_weights(self, target, weight, ignore_index)
    scale = grad_output / total_weight if reduction == 1 else grad_output
    coef = jnp.where(valid, -w * scale, 0)
    one_hot = jax.nn.one_hot(safe, self.shape[axis], axis=axis, dtype=self.dtype)
    return one_hot * jnp.expand_dims(coef, axis)


def _multilabel_margin_loss(x, target, is_target, reduction):
    """ATen's multilabel_margin_loss: per sample, for each label j listed in ``target`` before its
    first -1 and each class i not listed, ``max(0, 1 - x[j] + x[i])``, summed, divided by C."""
    scores = x.reshape(-1, x.shape[-1] if x.ndim else 1)
    labels = target.reshape(scores.shape)
    listed = jnp.cumprod(labels >= 0, axis=1).astype(x.dtype)  # the labels before the first -1
    own = jnp.take_along_axis(scores, jnp.maximum(labels, 0), 1)
    hinge = jnp.maximum(1 - own[:, :, None] + scores[:, None, :], 0)
    others = 1 - is_target.reshape(scores.shape).astype(x.dtype)
    per_sample = (hinge * listed[:, :, None] * others[:, None, :]).sum((1, 2)) / scores.shape[1]
    return _reduce(per_sample if x.ndim == 2 else per_sample.reshape(()), reduction)


@lowers(aten.multilabel_margin_loss_backward.default)
def _multilabel_margin_loss_backward(grad_output, x, target, reduction, is_target):
    """The gradient of the loss above."""
    loss = partial(_multilabel_margin_loss, target=target, is_target=is_target)
    return _pullback(partial(loss, reduction=reduction), grad_output, x)


@lowers(aten.mse_loss.default)
def _mse_loss(self, target, reduction=1):
    return _reduce(jnp.square(self - target), reduction)


@lowers(aten.mse_loss_backward.default)
def _mse_loss_backward(grad_output, self, target, reduction):
    """2 (x - y) g, over numel for mean."""
    scale = 2 / self.size if reduction == 1 else 2
    return scale * (self - target) * grad_output


@lowers(aten.binary_cross_entropy.default)
def _binary_cross_entropy(self, target, weight=None, reduction=1):
    """Each log is clamped at -100, as PyTorch's, so a saturated probability gives a finite loss."""
    log_p = jnp.maximum(jnp.log(self), -100)
    log_q = jnp.maximum(jnp.log1p(-self), -100)
    loss = (target - 1) * log_q - target * log_p
    return _reduce(_affine(loss, weight, None), reduction)


@lowers(aten.binary_cross_entropy_backward.default)
def _binary_cross_entropy_backward(grad_output, self, target, weight=None, reduction=1):
    """PyTorch clamps the denominator p(1-p) at 1e-12."""
    grad = grad_output * (self - target) / jnp.maximum((1 - self) * self, 1e-12)
    grad = _affine(grad, weight, None)
    return grad / self.size if reduction == 1 else grad


@lowers(aten.hardtanh_backward.default)
def _hardtanh_backward(grad_output, self, min_val, max_val):
    """Zero at the clamp bounds themselves, as PyTorch's."""
    return jnp.where((self <= min_val) | (self >= max_val), 0, grad_output)


# --- embedding -----------------------------------------------------------------------------------


@lowers(aten.embedding.default)
def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(weight, indices, axis=0)


@lowers(aten.embedding_dense_backward.default)
def _embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    """Scatter-add rows; padding_idx rows get none, and scale_grad_by_freq divides by counts."""
    index = indices.reshape(-1)
    grad = _upcast(grad_output).reshape(index.shape[0], -1)
    if scale_grad_by_freq:
        counts = jnp.zeros(num_weights, grad.dtype).at[index].add(1)
        grad = grad / counts[index][:, None]
    if padding_idx >= 0:
        grad = jnp.where((index == padding_idx)[:, None], 0, grad)
    return jnp.zeros((num_weights, grad.shape[1]), grad.dtype).at[index].add(grad)


_BAG_SUM, _BAG_MEAN, _BAG_MAX = 0, 1, 2


def _kept(indices: jax.Array, padding_idx: int) -> jax.Array:
    """Which indices count: all but ``padding_idx`` (negative: none is padding)."""
    return indices != padding_idx if padding_idx >= 0 else jnp.ones(indices.shape, bool)


@lowers(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def _embedding_bag(
    weight,
    indices,
    offsets,
    scale_grad_by_freq=False,
    mode=_BAG_SUM,
    sparse=False,
    per_sample_weights=None,
    include_last_offset=False,
    padding_idx=-1,
):
    """(output, offset2bag, bag_size, max_indices) as PyTorch's CPU kernel: padding indices count
    in no bag, an empty bag gives zeros; max picks the first maximum of each column."""
    num_bags, n = offsets.shape[0] - int(include_last_offset), indices.shape[0]
    bag = jnp.maximum(jnp.searchsorted(offsets[:num_bags], jnp.arange(n), side="right") - 1, 0)
    keep = _kept(indices, padding_idx)
    # one per offset, as PyTorch's meta kernel has it (include_last_offset: a last one of 0)
    bag_size = jnp.zeros(offsets.shape[0], indices.dtype).at[bag].add(keep.astype(indices.dtype))
    rows = _upcast(jnp.take(weight, indices, axis=0))
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None]
    shape = (num_bags, weight.shape[1])
    if mode != _BAG_MAX:
        out = jnp.zeros(shape, rows.dtype).at[bag].add(jnp.where(keep[:, None], rows, 0))
        if mode == _BAG_MEAN:
            out = out / jnp.maximum(bag_size, 1)[:, None].astype(out.dtype)
        return out, bag, bag_size, jnp.zeros((0,), indices.dtype)
    rows = jnp.where(keep[:, None], rows, -jnp.inf)
    out = jnp.full(shape, -jnp.inf, rows.dtype).at[bag].max(rows)
    position = jnp.where(rows == out[bag], jnp.arange(n)[:, None], n)
    first = jnp.full(shape, n).at[bag].min(position)
    filled = (bag_size[:num_bags] > 0)[:, None]
    max_indices = jnp.where(filled, jnp.append(indices, 0)[first], 0)
    return jnp.where(filled, out, 0), bag, bag_size, max_indices


@lowers(aten._embedding_bag_backward.default)
def _embedding_bag_backward(
    grad,
    indices,
    offsets,
    offset2bag,
    bag_size,
    max_indices,
    num_weights,
    scale_grad_by_freq,
    mode,
    sparse,
    per_sample_weights=None,
    padding_idx=-1,
):
    """The weight's gradient, dense: PyTorch/XLA has no sparse tensors, so ``sparse=True`` gets
    the dense gradient too (PyTorch/XLA runs the dense kernel for it)."""
    return _embedding_bag_dense_backward(
        grad, indices, offset2bag, bag_size, max_indices, num_weights,
        scale_grad_by_freq, mode, per_sample_weights, padding_idx,
    )  # fmt: skip


@lowers(aten._embedding_bag_dense_backward.default)
def _embedding_bag_dense_backward(
    grad,
    indices,
    offset2bag,
    bag_size,
    max_indices,
    num_weights,
    scale_grad_by_freq,
    mode,
    per_sample_weights=None,
    padding_idx=-1,
):
    """Each bag's gradient back to its rows (max: to the row each column's maximum came from)."""
    shape = (num_weights, grad.shape[1])
    grad = _upcast(grad)
    if mode == _BAG_MAX:
        columns = jnp.arange(grad.shape[1])[None, :]
        rows = jnp.where(max_indices >= 0, max_indices, 0)
        grad = jnp.where((bag_size[: grad.shape[0]] > 0)[:, None], grad, 0)
        return jnp.zeros(shape, grad.dtype).at[rows, columns].add(grad)
    rows = grad[offset2bag]
    if mode == _BAG_MEAN:
        rows = rows / jnp.maximum(bag_size[offset2bag], 1)[:, None].astype(rows.dtype)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None]
    if scale_grad_by_freq:
        counts = jnp.zeros(num_weights, rows.dtype).at[indices].add(1)
        rows = rows / counts[indices][:, None]
    rows = jnp.where(_kept(indices, padding_idx)[:, None], rows, 0)
    return jnp.zeros(shape, rows.dtype).at[indices].add(rows)


@lowers(aten._embedding_bag_per_sample_weights_backward.default)
def _embedding_bag_per_sample_weights_backward(
    grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1
):
    """d(out)/d(per_sample_weights): each index's row dotted with its bag's gradient (sum mode)."""
    dots = jnp.sum(_upcast(grad)[offset2bag] * jnp.take(weight, indices, axis=0), axis=1)
    return jnp.where(_kept(indices, padding_idx), dots, 0)


# --- upsampling ----------------------------------------------------------------------------------


def _source_scale(in_size: int, out_size: int, scale) -> float:
    """PyTorch's compute_scales_value: 1/scale_factor when one was given, else in/out."""
    return 1 / scale if scale is not None and scale > 0 else in_size / out_size


def _nearest_source(in_size: int, out_size: int, scale) -> np.ndarray:
    """PyTorch's nearest_neighbor_compute_source_index, floor(i * scale) in float32: what the 1d
    and 3d forward kernels use."""
    s = np.float32(_source_scale(in_size, out_size, scale))
    src = np.floor(np.arange(out_size, dtype=np.float32) * s).astype(np.int64)
    return np.minimum(src, in_size - 1)


def _nearest_index(in_size: int, out_size: int, scale) -> np.ndarray:
    """PyTorch's nearest_idx, used by the 2d forward and every backward kernel: same size and
    double size map exactly, whatever scale the caller gave."""
    if out_size == in_size:
        return np.arange(out_size)
    if out_size == 2 * in_size:
        return np.arange(out_size) >> 1
    return _nearest_source(in_size, out_size, scale)


def _nearest_exact_index(in_size: int, out_size: int, scale) -> np.ndarray:
    """PyTorch's nearest_exact_idx: (i + 0.5) * scale in double, rounded to float32, floored."""
    s = np.float32(_source_scale(in_size, out_size, scale))
    src = ((np.arange(out_size) + 0.5) * np.float64(s)).astype(np.float32)
    return np.minimum(np.floor(src).astype(np.int64), in_size - 1)


def _source_index(in_size: int, out_size: int, align_corners: bool, scale, cubic=False):
    """PyTorch's area_pixel_compute_source_index for every output; only cubic keeps negatives."""
    dst = np.arange(out_size, dtype=np.float64)
    if align_corners:
        return dst * ((in_size - 1) / (out_size - 1) if out_size > 1 else 0)
    src = (dst + 0.5) * _source_scale(in_size, out_size, scale) - 0.5
    return src if cubic else np.maximum(src, 0)


def _linear_taps(in_size: int, out_size: int, align_corners: bool, scale):
    """Two source indices and their weights per output, as guard_index_and_lambda picks them."""
    src = _source_index(in_size, out_size, align_corners, scale)
    i0 = np.minimum(src.astype(np.int64), in_size - 1)
    t = np.clip(src - i0, 0, 1)
    return (i0, np.minimum(i0 + 1, in_size - 1)), (1 - t, t)


def _cubic_near(x, a: float = -0.75):
    """Keys' cubic convolution weight for a tap at distance x <= 1 (PyTorch's A = -0.75)."""
    return ((a + 2) * x - (a + 3)) * x * x + 1


def _cubic_far(x, a: float = -0.75):
    """Keys' cubic convolution weight for a tap at distance 1 < x < 2."""
    return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a


def cubic_weights(t) -> tuple:
    """The four bicubic tap weights (taps at -1, 0, 1, 2) for fractions ``t``: NumPy or JAX."""
    return (_cubic_far(t + 1), _cubic_near(t), _cubic_near(1 - t), _cubic_far(2 - t))


def _cubic_taps(in_size: int, out_size: int, align_corners: bool, scale):
    """Four source indices, clamped at the borders, and their weights per output, as PyTorch's
    HelperInterpCubic computes them."""
    src = _source_index(in_size, out_size, align_corners, scale, cubic=True)
    i = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
    t = np.clip(src - i, 0, 1)
    indices = tuple(np.clip(i + k, 0, in_size - 1) for k in (-1, 0, 1, 2))
    return indices, cubic_weights(t)


def _antialias_taps(in_size: int, out_size: int, align_corners: bool, scale):
    """Bilinear antialiasing (PyTorch's _upsample_bilinear2d_aa): each output averages the inputs
    under a triangle filter widened by the downscale factor, weights normalised to sum to 1; the
    narrower windows pad with zero weights on a border index."""
    if align_corners:
        scale = (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
    else:
        scale = _source_scale(in_size, out_size, scale)
    support = scale if scale >= 1 else 1.0  # the triangle's half-width, 1, stretched
    width = int(math.ceil(support)) * 2 + 1
    center = scale * (np.arange(out_size) + 0.5)
    start = np.maximum((center - support + 0.5).astype(np.int64), 0)
    size = np.clip(np.minimum((center + support + 0.5).astype(np.int64), in_size) - start, 0, width)
    offsets = np.arange(width)
    distance = (start[:, None] + offsets - center[:, None] + 0.5) / max(scale, 1.0)
    weights = np.where(offsets < size[:, None], np.maximum(0, 1 - np.abs(distance)), 0)
    totals = weights.sum(1, keepdims=True)
    weights = weights / np.where(totals == 0, 1, totals)
    indices = np.minimum(start[:, None] + offsets, in_size - 1)
    return tuple(indices.T), tuple(weights.T)


def _upsample_nearest(self, output_size, scales, index=_nearest_index):
    for i, (n, s) in enumerate(zip(output_size, scales)):
        axis = self.ndim - len(output_size) + i
        self = jnp.take(self, index(self.shape[axis], n, s), axis=axis)
    return self


def _interpolate(self, output_size, align_corners, scales, taps, round_weights=False):
    """Separable interpolation, one spatial axis at a time, in the accumulation dtype: each output
    is the weighted sum of the inputs ``taps`` picks along that axis. ``round_weights`` first
    rounds the weights to the input dtype, as PyTorch's generic CPU kernel stores them."""
    x = _upcast(self)
    weight_dtype = self.dtype if round_weights else x.dtype
    for i, (n, s) in enumerate(zip(output_size, scales)):
        axis = x.ndim - len(output_size) + i
        indices, weights = taps(x.shape[axis], n, align_corners, s)
        shape = (-1,) + (1,) * (x.ndim - 1 - axis)
        terms = zip(indices, weights, strict=True)
        x = sum(
            jnp.take(x, j, axis=axis) * jnp.asarray(w, weight_dtype).astype(x.dtype).reshape(shape)
            for j, w in terms
        )
    return x.astype(self.dtype)


def _scales(output_size, scales: tuple) -> tuple:
    """An upsample op's per-axis scales, None for the trailing ones dispatch left out."""
    return scales + (None,) * (len(output_size) - len(scales))


def _upsample_grad(grad_output, input_size, up):
    """The vjp of ``up``, an upsampling of an ``input_size`` tensor, in the accumulation dtype."""
    zeros = jnp.zeros(input_size, _upcast(grad_output).dtype)
    return _vjp(up, zeros, grad_output).astype(grad_output.dtype)


def _vec_size(x, output_size, scale_factors):
    """.vec overloads: the output size given, or floor(input size * scale factor)."""
    if output_size is not None:
        return output_size, [None] * len(output_size)
    spatial = x.shape[2:]
    return [int(n * s) for n, s in zip(spatial, scale_factors)], scale_factors


@lowers(aten.upsample_nearest1d.default, aten.upsample_nearest3d.default)
def _upsample_nearest_1d_3d(self, output_size, *scales):
    return _upsample_nearest(self, output_size, _scales(output_size, scales), _nearest_source)


@lowers(aten.upsample_nearest2d.default)
def _upsample_nearest2d(self, output_size, scales_h=None, scales_w=None):
    return _upsample_nearest(self, output_size, (scales_h, scales_w))


@lowers(aten.upsample_nearest2d.vec)
def _upsample_nearest2d_vec(input, output_size, scale_factors):
    return _upsample_nearest(input, *_vec_size(input, output_size, scale_factors))


@lowers(
    aten.upsample_nearest1d_backward.default,
    aten.upsample_nearest2d_backward.default,
    aten.upsample_nearest3d_backward.default,
)
def _upsample_nearest_backward(grad_output, output_size, input_size, *scales):
    up = partial(_upsample_nearest, output_size=output_size, scales=_scales(output_size, scales))
    return _upsample_grad(grad_output, input_size, up)


@lowers(
    aten._upsample_nearest_exact1d.default,
    aten._upsample_nearest_exact2d.default,
    aten._upsample_nearest_exact3d.default,
)
def _upsample_nearest_exact(self, output_size, *scales):
    return _upsample_nearest(self, output_size, _scales(output_size, scales), _nearest_exact_index)


@lowers(
    aten._upsample_nearest_exact1d_backward.default,
    aten._upsample_nearest_exact2d_backward.default,
    aten._upsample_nearest_exact3d_backward.default,
)
def _upsample_nearest_exact_backward(grad_output, output_size, input_size, *scales):
    scales = _scales(output_size, scales)
    up = partial(
        _upsample_nearest, output_size=output_size, scales=scales, index=_nearest_exact_index
    )
    return _upsample_grad(grad_output, input_size, up)


@lowers(
    aten.upsample_linear1d.default,
    aten.upsample_bilinear2d.default,
    aten.upsample_trilinear3d.default,
)
def _upsample_linear(self, output_size, align_corners, *scales):
    return _interpolate(
        self, output_size, align_corners, _scales(output_size, scales), _linear_taps
    )


@lowers(aten.upsample_bilinear2d.vec)
def _upsample_bilinear2d_vec(input, output_size, align_corners, scale_factors):
    size, scales = _vec_size(input, output_size, scale_factors)
    return _interpolate(input, size, align_corners, scales, _linear_taps)


@lowers(
    aten.upsample_linear1d_backward.default,
    aten.upsample_bilinear2d_backward.default,
    aten.upsample_trilinear3d_backward.default,
)
def _upsample_linear_backward(grad_output, output_size, input_size, align_corners, *scales):
    return _interpolate_backward(
        grad_output, output_size, input_size, align_corners, scales, _linear_taps
    )


def _interpolate_backward(grad_output, output_size, input_size, align_corners, scales, taps):
    """The vjp of the forward interpolation with the same taps (PyTorch's own backward math)."""
    up = partial(
        _interpolate,
        output_size=output_size,
        align_corners=align_corners,
        scales=_scales(output_size, scales),
        taps=taps,
    )
    return _upsample_grad(grad_output, input_size, up)


@lowers(aten._upsample_bilinear2d_aa.default)
def _upsample_bilinear2d_aa(self, output_size, align_corners, *scales):
    scales = _scales(output_size, scales)
    return _interpolate(self, output_size, align_corners, scales, _antialias_taps)


@lowers(aten._upsample_bilinear2d_aa_backward.default)
def _upsample_bilinear2d_aa_backward(grad_output, output_size, input_size, align_corners, *scales):
    return _interpolate_backward(
        grad_output, output_size, input_size, align_corners, scales, _antialias_taps
    )


@lowers(aten.upsample_bicubic2d.default)
def _upsample_bicubic2d(self, output_size, align_corners, *scales):
    """The weights round to bf16/fp16 here (not in the backward, whose kernel keeps float32)."""
    scales = _scales(output_size, scales)
    return _interpolate(self, output_size, align_corners, scales, _cubic_taps, round_weights=True)


@lowers(aten.upsample_bicubic2d_backward.default)
def _upsample_bicubic2d_backward(grad_output, output_size, input_size, align_corners, *scales):
    return _interpolate_backward(
        grad_output, output_size, input_size, align_corners, scales, _cubic_taps
    )


# --- activations and losses with a shape of their own --------------------------------------------


@lowers(aten.glu.default)
def _glu(self, dim=-1):
    a, b = jnp.split(self, 2, axis=dim)
    return a * jax.nn.sigmoid(b)


@lowers(aten.glu_backward.default)
def _glu_backward(grad_output, self, dim):
    return jax.vjp(partial(_glu, dim=dim), self)[1](grad_output)[0]


def _huber(diff, delta):
    absolute = jnp.abs(diff)
    return jnp.where(absolute < delta, 0.5 * diff * diff, delta * (absolute - 0.5 * delta))


@lowers(aten.huber_loss.default)
def _huber_loss(self, target, reduction=1, delta=1.0):
    return _reduce(_huber(self - target, delta), reduction)


@lowers(aten.huber_loss_backward.default)
def _huber_loss_backward(grad_output, self, target, reduction, delta):
    diff = self - target
    grad = jnp.clip(diff, -delta, delta) * grad_output
    return grad / self.size if reduction == 1 else grad


@lowers(aten.pixel_shuffle.default)
def _pixel_shuffle(self, upscale_factor):
    """(*, C r^2, H, W) -> (*, C, H r, W r)."""
    r = upscale_factor
    *batch, c, h, w = self.shape
    x = self.reshape(*batch, c // (r * r), r, r, h, w)
    n = len(batch)
    x = x.transpose(*range(n), n, n + 3, n + 1, n + 4, n + 2)
    return x.reshape(*batch, c // (r * r), h * r, w * r)


@lowers(aten.pixel_unshuffle.default)
def _pixel_unshuffle(self, downscale_factor):
    """(*, C, H r, W r) -> (*, C r^2, H, W)."""
    r = downscale_factor
    *batch, c, h, w = self.shape
    n = len(batch)
    x = self.reshape(*batch, c, h // r, r, w // r, r)
    x = x.transpose(*range(n), n, n + 2, n + 4, n + 1, n + 3)
    return x.reshape(*batch, c * r * r, h // r, w // r)


@lowers(aten.channel_shuffle.default, aten.native_channel_shuffle.default)
def _channel_shuffle(self, groups):
    n, c, *spatial = self.shape
    x = self.reshape(n, groups, c // groups, *spatial)
    return jnp.swapaxes(x, 1, 2).reshape(self.shape)
