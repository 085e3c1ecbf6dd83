"""``F.scaled_dot_product_attention`` recorded as one op each way, from above autograd.

ATen's composite reaches a fused kernel through a C++ backend-choice stub no Python backend can
register for (a kernel of ``aten::_fused_sdp_choice`` is never asked), so it decomposes into mask,
bmm, softmax and dropout, forward and backward. Here its AutogradPrivateUse1 kernel calls
``_scaled_dot_product_fused_attention_overrideable``, as ATen does for a backend choosing
``SDPBackend.overrideable``, but with a bool mask kept bool (ATen would make it an additive -inf
bias) and grouped key/value heads kept grouped (ATen drops ``enable_gqa``; the lowering reads the
groups from the shapes); what the fused op does not take goes through the composite, errors
included. The fused op's own kernel records its backward op through an autograd Function: ATen's
generated one cannot take the engine's results, which leave the SymInt outputs empty.
"""

from __future__ import annotations

import torch

from .dispatch import issue
from .tensor import LazyTensor

aten = torch.ops.aten
_FUSED = aten._scaled_dot_product_fused_attention_overrideable.default
_FUSED_BACKWARD = aten._scaled_dot_product_fused_attention_overrideable_backward.default


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
    enable_gqa=False,
):  # fmt: skip
    """ATen's composite with the overrideable backend chosen wherever the fused op applies."""
    if not _fused_applies(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
        return aten.scaled_dot_product_attention.default.decompose(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    unbatched = query.dim() == 3  # (heads, L, E): a mask still broadcasts from the right
    if unbatched:
        query, key, value = (t.unsqueeze(0) for t in (query, key, value))
    out = _FUSED(query, key, value, attn_mask, dropout_p, is_causal, False, scale=scale)[0]
    return out.squeeze(0) if unbatched else out


def _fused_applies(query, key, value, mask, dropout_p, is_causal, enable_gqa) -> bool:
    """Whether the fused op computes what the composite would: 3-d or 4-d xla tensors of one
    floating dtype, no empty dimension, one batch, grouped heads only with ``enable_gqa``, a bool
    or same-dtype mask broadcasting to the scores, and no mask with ``is_causal``."""
    tensors = (query, key, value) if mask is None else (query, key, value, mask)
    rank = query.dim()
    if (
        not all(t.device.type == "xla" for t in tensors)
        or not 0 <= dropout_p < 1
        or rank not in (3, 4)
        or not rank == key.dim() == value.dim()
        or not query.dtype.is_floating_point
        or not query.dtype == key.dtype == value.dtype
        or 0 in (*query.shape, *key.shape, *value.shape)
        or key.shape[:-1] != value.shape[:-1]
        or key.shape[-1] != query.shape[-1]
    ):
        return False
    *batch, heads, q_len, _ = (1,) * (4 - rank) + tuple(query.shape)
    *kv_batch, kv_heads, kv_len, _ = (1,) * (4 - rank) + tuple(key.shape)
    if kv_batch != batch or kv_heads != heads and not (enable_gqa and heads % kv_heads == 0):
        return False
    scores = (*batch, heads, q_len, kv_len)
    return mask is None or (
        not is_causal
        and mask.dtype in (torch.bool, query.dtype)
        and mask.dim() <= 4
        and all(m in (1, n) for m, n in zip(reversed(mask.shape), reversed(scores)))
    )


def fused_attention(
    query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False,
    *, scale=None,
):  # fmt: skip
    """The fused op with autograd recording its backward op; its nine results."""
    out, lse, seed, offset = _FusedAttention.apply(
        query, key, value, attn_bias, dropout_p, is_causal, return_debug_mask, scale
    )
    return out, lse, None, None, query.shape[-2], key.shape[-2], seed, offset, None


class _FusedAttention(torch.autograd.Function):
    """One fused node forward, one backward node reading what the forward saved."""

    @staticmethod
    def forward(ctx, query, key, value, bias, dropout_p, is_causal, return_debug_mask, scale):
        arguments = (query, key, value, bias, dropout_p, is_causal, return_debug_mask)
        if type(query) is LazyTensor:  # straight to the engine, which leaves the SymInts empty
            results = issue(_FUSED, arguments, {"scale": scale})
        else:  # torch.compile's fake tensors: the meta kernel
            with torch._C._AutoDispatchBelowAutograd():
                results = _FUSED(*arguments, scale=scale)
        out, lse, seed, offset = results[0], results[1], results[6], results[7]
        ctx.save_for_backward(query, key, value, bias, out, lse, seed, offset)
        ctx.arguments = (query.shape[-2], key.shape[-2], dropout_p, is_causal, scale)
        ctx.mark_non_differentiable(lse, seed, offset)
        ctx.set_materialize_grads(False)
        return out, lse, seed, offset

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, *_):
        if grad_out is None:
            return (None,) * 8
        query, key, value, bias, out, lse, seed, offset = ctx.saved_tensors
        needed = list(ctx.needs_input_grad[:4])
        q_len, kv_len, dropout_p, is_causal, scale = ctx.arguments
        grads = _FUSED_BACKWARD(
            grad_out, query, key, value, bias, needed, out, lse, None, None, q_len, kv_len,
            dropout_p, is_causal, seed, offset, scale=scale,
        )  # fmt: skip
        return *(g if n else None for g, n in zip(grads, needed)), None, None, None, None


ABOVE_AUTOGRAD = {
    aten.scaled_dot_product_attention.default: scaled_dot_product_attention,
    _FUSED: fused_attention,
}
