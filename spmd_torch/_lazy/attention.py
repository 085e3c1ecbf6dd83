"""``F.scaled_dot_product_attention`` recorded as one op each way, from above autograd.

ATen's composite reaches a fused kernel through a C++ backend-choice stub no Python backend can
register for (a kernel of ``aten::_fused_sdp_choice`` is never asked), so it decomposes into mask,
bmm, softmax and dropout, forward and backward. Here its AutogradPrivateUse1 kernel calls
``_scaled_dot_product_fused_attention_overrideable``, as ATen does for a backend choosing
``SDPBackend.overrideable``, but with a bool mask kept bool (ATen would make it an additive -inf
bias) and grouped key/value heads kept grouped (ATen drops ``enable_gqa``; the lowering reads the
groups from the shapes); what the fused op does not take goes through the composite, errors
included. Autograd records the fused op's backward op (ATen's derivative). The dispatcher sends
the composite here too where autograd is skipped (``torch.inference_mode``).
"""

from __future__ import annotations

import torch

aten = torch.ops.aten
_FUSED = aten._scaled_dot_product_fused_attention_overrideable.default


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


ABOVE_AUTOGRAD = {aten.scaled_dot_product_attention.default: scaled_dot_product_attention}
