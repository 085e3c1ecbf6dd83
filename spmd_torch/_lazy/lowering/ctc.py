"""Lowerings: the CTC loss (``F.ctc_loss``) and its backward.

ATen's forward recursion, vectorised over the batch: ``log_alpha[t, s]``, the log-probability of
the first ``t + 1`` frames emitting the first ``s + 1`` symbols of the target with blanks
between and around its labels, one ``lax.scan`` step per frame. Lengths are static (``_ctc_loss``
takes int lists; PyTorch reads tensor lengths to the host before calling it), so every shape is
known. The backward is the recursion's pullback plus ``exp(log_probs)``: ATen returns the
gradient as seen through the ``log_softmax`` that produces the log-probabilities (its terms sum
to zero over classes, so that backward leaves it unchanged), and so do we.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .registry import lowers, meta_kernel

aten = torch.ops.aten


def _padded_targets(targets, target_lengths: tuple) -> jax.Array:
    """(N, max length) labels: rows of a 2-D ``targets``, or cuts of a concatenated 1-D one."""
    width = max(max(target_lengths, default=0), 1)
    if targets.ndim == 2:
        return jnp.pad(targets, ((0, 0), (0, max(width - targets.shape[1], 0))))[:, :width]
    starts = np.concatenate([[0], np.cumsum(target_lengths)[:-1]]).astype(np.int64)
    index = np.minimum(starts[:, None] + np.arange(width), max(targets.shape[0] - 1, 0))
    return targets[index] if targets.shape[0] else jnp.zeros(index.shape, targets.dtype)


def _logsumexp(x, axis: int):
    """log(sum(exp(x))) whose gradient stays finite (zero) where every term is -inf: states no
    path reaches pass zero cotangents, which jax.nn.logsumexp's 0/0 would turn into NaN."""
    top = jnp.max(x, axis=axis, keepdims=True)
    top = lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0))
    total = jnp.sum(jnp.exp(x - top), axis=axis)
    reached = total > 0
    safe = jnp.log(jnp.where(reached, total, 1)) + jnp.squeeze(top, axis)
    return jnp.where(reached, safe, -jnp.inf)


def _log_alpha(log_probs, targets, input_lengths: tuple, target_lengths: tuple, blank: int):
    """(N, T, 2 * max target length + 1) forward variables (-inf where they do not exist) and
    each sample's negative log-likelihood."""
    frames, batch, _ = log_probs.shape
    lengths = np.asarray(target_lengths, np.int64)
    labels = _padded_targets(targets, target_lengths).astype(jnp.int32)
    states = 2 * int(lengths.max(initial=0)) + 1
    s = np.arange(states)
    # the extended target: blank, label 0, blank, label 1, ..., blank
    extended = jnp.where(s % 2 == 0, blank, labels[:, np.minimum(s // 2, labels.shape[1] - 1)])
    exists = s[None, :] <= 2 * lengths[:, None]
    skips = (s % 2 == 1) & (s >= 3)
    skips = skips & (extended != jnp.roll(extended, 2, axis=1))
    emit = jnp.take_along_axis(jnp.moveaxis(log_probs, 0, 1), extended[:, None, :], axis=2)
    neg_inf = jnp.array(-jnp.inf, log_probs.dtype)
    first = jnp.where((s[None, :] < 2) & exists, emit[:, 0], neg_inf)

    def step(previous, emitted):
        one_back = jnp.pad(previous, ((0, 0), (1, 0)), constant_values=-jnp.inf)[:, :-1]
        two_back = jnp.pad(previous, ((0, 0), (2, 0)), constant_values=-jnp.inf)[:, :-2]
        paths = jnp.stack([previous, one_back, jnp.where(skips, two_back, neg_inf)])
        current = jnp.where(exists, _logsumexp(paths, axis=0) + emitted, neg_inf)
        return current, current

    _, rest = lax.scan(step, first, jnp.moveaxis(emit[:, 1:], 1, 0))
    alphas = jnp.concatenate([first[None], rest])  # (T, N, states)
    inputs = np.asarray(input_lengths, np.int64)
    alive = np.arange(frames)[:, None] < inputs[None, :]
    log_alpha = jnp.moveaxis(jnp.where(alive[..., None], alphas, neg_inf), 0, 1)
    last = alphas[np.maximum(inputs - 1, 0), np.arange(batch)]
    ends = np.stack([2 * lengths, np.maximum(2 * lengths - 1, 0)], axis=1)
    ends_exist = np.stack([np.ones_like(lengths, bool), lengths > 0], axis=1)
    finals = jnp.where(ends_exist, jnp.take_along_axis(last, jnp.asarray(ends), axis=1), neg_inf)
    nll = -_logsumexp(finals, axis=1)
    # no frames: only the empty target is possible
    nll = jnp.where(inputs == 0, jnp.where(lengths == 0, 0.0, jnp.inf).astype(nll.dtype), nll)
    return log_alpha, nll


@lowers(aten._ctc_loss.default)
def _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    log_alpha, nll = _log_alpha(
        log_probs, targets, tuple(input_lengths), tuple(target_lengths), blank
    )
    if zero_infinity:
        nll = jnp.where(jnp.isinf(nll), jnp.zeros_like(nll), nll)
    return nll, log_alpha


@meta_kernel("_ctc_loss_backward")
def _log_probs_shaped(grad, log_probs, *args, **kwargs):
    """The backward's result: shaped like the log-probabilities."""
    return torch.empty_like(log_probs)


@lowers(aten._ctc_loss_backward.default)
def _ctc_loss_backward(
    grad,
    log_probs,
    targets,
    input_lengths,
    target_lengths,
    neg_log_likelihood,
    log_alpha,
    blank,
    zero_infinity=False,
):
    """ATen's ``exp(log_probs) - posterior`` per frame a sample has, times its grad; zero past
    its length; for a target no alignment reaches, zero under ``zero_infinity``, else NaN."""
    inputs, lengths = tuple(input_lengths), tuple(target_lengths)

    def nll_of(log_probs):
        return _log_alpha(log_probs, targets, inputs, lengths, blank)[1]

    nll, pullback = jax.vjp(nll_of, log_probs)
    (minus_posterior,) = pullback(grad.astype(nll.dtype))
    alive = np.arange(log_probs.shape[0])[:, None] < np.asarray(inputs)[None, :]
    out = jnp.where(alive[..., None], jnp.exp(log_probs) * grad[None, :, None], 0) + minus_posterior
    impossible = jnp.isinf(nll)[None, :, None] & alive[..., None]  # zero_infinity: 0, else NaN
    out = jnp.where(impossible, 0.0 if zero_infinity else jnp.nan, out)
    return out.astype(log_probs.dtype)


def _lengths(lengths) -> list:
    """Lengths given as a tensor, read to the host as ATen reads them (on CUDA too)."""
    return lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)


def _ctc_loss_with_tensor_lengths(log_probs, targets, input_lengths, target_lengths, *args):
    return aten._ctc_loss(
        log_probs, targets, _lengths(input_lengths), _lengths(target_lengths), *args
    )


def _ctc_loss_backward_with_tensor_lengths(
    grad, log_probs, targets, input_lengths, target_lengths, *args
):
    inputs, lengths = _lengths(input_lengths), _lengths(target_lengths)
    return aten._ctc_loss_backward(grad, log_probs, targets, inputs, lengths, *args)


# The overloads taking lengths as tensors, as the int-list ones (dispatch's decompositions).
DECOMPOSITIONS = {
    aten._ctc_loss.Tensor: _ctc_loss_with_tensor_lengths,
    aten._ctc_loss_backward.Tensor: _ctc_loss_backward_with_tensor_lengths,
}
