"""F.scaled_dot_product_attention as one fused node each way: values and gradients against eager
CPU for every mask kind, GQA, scale and dtype; dropout's mask shared by forward and backward; the
blockwise form against the plain one; the implementation chosen per platform; SPMD."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import spmd_torch
import spmd_torch.distributed.spmd as xs
import spmd_torch.runtime as xr
from spmd_torch._lazy import compile as compile_module
from spmd_torch._lazy import counters
from spmd_torch._lazy.lowering import attention
from spmd_torch._lazy.lowering.dtypes import to_jax_dtype
from spmd_torch.debug import graph
from tests.helpers import (
    assert_close,
    assert_compiles,
    assert_counter_delta,
    assert_matches_eager,
    cudnn_stood_in,
    lowered_as_on,
    pallas_interpreted,
    pallas_kernel_shapes,
    to_cpu,
    tolerance,
)

dev = spmd_torch.device()
FUSED = "aten._scaled_dot_product_fused_attention_overrideable.default("
FUSED_BACKWARD = "aten._scaled_dot_product_fused_attention_overrideable_backward.default("


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _qkv(q_shape=(2, 4, 8, 16), kv_shape=(2, 4, 10, 16), dtype=torch.float32):
    return _randn(*q_shape, dtype=dtype, seed=1), *(
        _randn(*kv_shape, dtype=dtype, seed=s) for s in (2, 3)
    )


def _bool_mask(*shape, seed=4):
    mask = torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) > 0.4
    mask[..., 0] = True  # every query keeps a key: eager CPU's fused kernels NaN an empty row
    return mask


MASKS = {
    "none": {},
    "causal": {"is_causal": True},
    "bool": {"attn_mask": _bool_mask(2, 4, 8, 10)},
    "bool_broadcast": {"attn_mask": _bool_mask(8, 10)},
    "additive": {"attn_mask": _randn(2, 4, 8, 10, seed=5)},
    "additive_broadcast": {"attn_mask": _randn(1, 4, 1, 10, seed=5)},
}


@pytest.mark.parametrize("mask", MASKS)
def test_masks_match_eager_forward_and_backward(mask):
    # An additive mask is a floating input: its gradient is compared too.
    assert_matches_eager(F.scaled_dot_product_attention, *_qkv(), grad=True, **MASKS[mask])


@pytest.mark.parametrize(
    "dtype, is_causal", [(torch.float32, True), (torch.bfloat16, False)], ids=["fp32", "bf16"]
)
def test_grouped_query_attention_matches_eager(dtype, is_causal):
    q, k, v = _qkv((2, 8, 8, 16), (2, 2, 8, 16), dtype)
    assert_matches_eager(
        F.scaled_dot_product_attention,
        *(q, k, v),
        grad=True,
        tol="attention",
        is_causal=is_causal,
        enable_gqa=True,
    )


def test_bfloat16_with_a_bool_mask_and_scale_matches_eager():
    q, k, v = _qkv(dtype=torch.bfloat16)
    mask = MASKS["bool"]["attn_mask"]
    assert_matches_eager(
        F.scaled_dot_product_attention, q, k, v, mask, grad=True, tol="attention", scale=0.3
    )


def test_unbatched_heads_match_eager():
    q, k, v = _qkv((4, 8, 16), (4, 10, 16))
    assert_matches_eager(F.scaled_dot_product_attention, q, k, v, grad=True, scale=0.3)


def test_rows_with_every_key_masked_are_zero_as_in_eager():
    mask = torch.ones(8, 10, dtype=torch.bool)
    mask[3] = False
    q, k, v = (t.double() for t in _qkv())
    out = assert_matches_eager(F.scaled_dot_product_attention, q, k, v, mask, grad=True)
    assert not out[:, :, 3].cpu().any()


def test_long_keys_go_blockwise_and_match_eager():
    # 400 keys: blockwise on CPU, three whole blocks and a partial one; 24 queries.
    q, k, v = _qkv((1, 2, 24, 8), (1, 2, 400, 8))
    before = counters.COUNTERS.get("Attention::blockwise", 0)
    assert_matches_eager(F.scaled_dot_product_attention, q, k, v, grad=True, is_causal=True)
    assert counters.COUNTERS.get("Attention::blockwise", 0) > before


@pytest.mark.parametrize("queries, keys", [(600, 600), (641, 700), (700, 600)])
def test_causal_attention_over_query_tiles_matches_eager(queries, keys):
    """Past one tile of queries (``Q_BLOCK``) causal attention leaves out the tiles above the
    diagonal: eager's values and gradients, with grouped heads, the queries padded to whole
    tiles, and more keys than queries or fewer."""
    q, k, v = _qkv((1, 4, queries, 8), (1, 2, keys, 8))
    assert_matches_eager(
        F.scaled_dot_product_attention, q, k, v, grad=True, is_causal=True, enable_gqa=True
    )


def _tiles(causal=False, mask=None, seq=1024):
    zeros = jnp.zeros((1, 1, seq, 8))
    problem = attention._Problem(
        zeros, zeros, zeros, mask, causal, 1.0, 0.0, None, attention.BLOCK, None
    )
    return len(problem.tiles)


def test_the_blockwise_form_visits_only_tiles_a_query_sees():
    """1,024 queries in 4 tiles of 256 against 8 key blocks of 128 (32 tiles): causal, query
    tile r sees key blocks 0 to 2r + 1 (20 tiles); a causal window of 128, blocks 2r - 1 to
    2r + 1 (11), with segment ids too where each query is a key of its own segment (splash's);
    otherwise, with segment ids, every tile is in the program (a query that sees no key averages
    them all), each skipped when it runs if unseen (``_Problem.unless_unseen``)."""
    window = attention.BlockMask(None, None, 1024, causal=True, window=128)
    ids = jnp.zeros((1, 1024), jnp.int32)
    assert _tiles() == 8  # one tile of every query
    assert _tiles(causal=True) == 20
    assert _tiles(mask=window) == 11
    segmented = attention.BlockMask(ids, ids, 1024, causal=True, window=128)
    assert _tiles(mask=segmented) == 32
    assert _tiles(mask=dataclasses.replace(segmented, sees_itself=True)) == 11
    assert _tiles(mask=dataclasses.replace(segmented, window=None, sees_itself=True)) == 20
    # ids without a band (packed sequences attending both ways): every tile, skipped if unseen
    assert _tiles(mask=attention.BlockMask(ids, ids, 1024, sees_itself=True)) == 32


def _segment_ids(rng, seq: int) -> jnp.ndarray:
    return jnp.asarray(np.cumsum(rng.random((2, seq)) < 0.01, axis=1), jnp.int32)


_BANDED = {  # (q_len, kv_len, causal, mask maker, soft cap)
    "causal_gqa": (700, 700, True, None, None),
    "causal_fewer_queries": (300, 900, True, None, None),
    "causal_fewer_keys": (900, 300, True, None, None),
    "causal_window": (
        777,
        777,
        False,
        lambda rng, n: attention.BlockMask(None, None, n, True, 100),
        None,
    ),
    "window": (600, 600, False, lambda rng, n: attention.BlockMask(None, None, n, window=50), None),
    "shared_ids_window_cap": (
        650,
        650,
        False,
        lambda rng, n: (lambda ids: attention.BlockMask(ids, ids, n, True, 200, True))(
            _segment_ids(rng, n)
        ),
        3.0,
    ),
    "causal_float_bias": (
        520,
        520,
        True,
        lambda rng, n: jnp.asarray(rng.normal(size=(2, 4, n, n))),
        None,
    ),
}


@pytest.mark.parametrize("case", _BANDED)
def test_leaving_out_tiles_outside_the_band_changes_nothing(monkeypatch, case):
    """The blockwise form's forward and backward, in float64, with the tiles outside the band
    left out and with every key block visited by one tile of all queries: the same output,
    log-sum-exp and gradients (the mask's too), to float64 rounding."""
    q_len, kv_len, causal, make_mask, soft_cap = _BANDED[case]
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 4, q_len, 8)))
    k, v = (jnp.asarray(rng.normal(size=(2, 2, kv_len, 8))) for _ in range(2))
    grad = jnp.asarray(rng.normal(size=(2, 4, q_len, 8)))
    mask = None if make_mask is None else make_mask(rng, q_len)

    def attend():
        options = (causal, 0.3, 0.0, None, attention.BLOCK)
        out, lse = attention.blockwise_forward(q, k, v, mask, *options, soft_cap)
        grads = attention.blockwise_backward(
            grad, q, k, v, mask, out, lse, *options, True, soft_cap
        )
        return out, lse, *grads

    skipped = attention._band(mask, causal, q_len, kv_len)
    assert skipped is not None
    banded = attend()
    monkeypatch.setattr(attention, "_band", lambda *args: None)
    whole = attend()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dmask"), banded, whole):
        if b is None:
            assert a is None, name
            continue
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-9, atol=1e-12, err_msg=name
        )


@pytest.mark.parametrize("blind", [False, True], ids=["every_query_sees_a_key", "blind_queries"])
def test_skipping_unseen_tiles_when_the_program_runs_changes_nothing(monkeypatch, blind):
    """Segment ids given apart for queries and keys, causal, 700 positions: the blockwise form's
    forward and backward in float64 with the unseen tiles skipped when the program runs, and with
    one tile of all queries visiting every key block, agree to float64 rounding; ``blind``: two
    queries of the first tile see no key (each averages every key, so that tile skips none)."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(2, 4, 700, 8)))
    k, v = (jnp.asarray(rng.normal(size=(2, 2, 700, 8))) for _ in range(2))
    grad = jnp.asarray(rng.normal(size=(2, 4, 700, 8)))
    kv_ids = _segment_ids(rng, 700)
    q_ids = kv_ids.at[:, jnp.array([5, 200])].set(10**6) if blind else kv_ids + 0
    mask = attention.BlockMask(q_ids, kv_ids, 700, causal=True)

    def attend():
        options = (False, 0.3, 0.0, None, attention.BLOCK)
        out, lse = attention.blockwise_forward(q, k, v, mask, *options)
        grads = attention.blockwise_backward(grad, q, k, v, mask, out, lse, *options, True)
        return out, lse, *grads[:3]

    skipping = attend()
    monkeypatch.setattr(attention, "Q_BLOCK", 10**6)  # one tile of all queries: nothing skipped
    whole = attend()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), skipping, whole):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-9, atol=1e-12, err_msg=name
        )


def test_plain_attention_lowers_without_a_loop_and_long_keys_with_one():
    """Plain attention is the blockwise code with one block, called once: no one-trip loop for
    XLA to take apart at every layer (a 32-layer step had 64); blockwise keeps its scan."""
    for keys, loops in ((10, 0), (400, 2)):
        leaves = [t.to(dev).requires_grad_() for t in _qkv((1, 2, 24, 8), (1, 2, keys, 8))]
        out = F.scaled_dot_product_attention(*leaves)
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
        assert graph.pending_hlo(list(grads)).count(" while(") == loops, keys
        spmd_torch.sync()


def test_one_node_forward_and_one_backward_without_bmm_or_softmax():
    leaves = [t.to(dev).requires_grad_() for t in _qkv()]
    mask = MASKS["bool"]["attn_mask"].to(dev)
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, dropout_p=0.1)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    text = graph.pending_text(list(grads))
    assert text.count(FUSED) == 1, text
    assert text.count(FUSED_BACKWARD) == 1, text
    for op in ("bmm", "_softmax", "_safe_softmax", "matmul", "masked_fill", "bernoulli"):
        assert f"aten.{op}." not in text, text


def test_broadcast_kv_heads_without_enable_gqa_take_atens_composite():
    # One key/value head broadcast over four query heads without enable_gqa is the math form's
    # broadcasting, which the fused op does not take: ATen's composite runs, as in eager.
    q, k, v = _qkv(kv_shape=(2, 1, 10, 16))
    text = graph.pending_text([F.scaled_dot_product_attention(q.to(dev), k.to(dev), v.to(dev))])
    assert FUSED not in text and "aten.bmm." in text, text
    assert_matches_eager(F.scaled_dot_product_attention, q, k, v, grad=True)


# --- dropout -------------------------------------------------------------------------------------


def _dropout_reference(q, k, v, kept, p):
    """Attention with the given keep mask: softmax(q k^T / sqrt(E)) * kept / (1 - p) @ v."""
    probs = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, -1)
    return (probs * kept / (1 - p)) @ v


@pytest.mark.parametrize("plain_max_keys", [attention.PLAIN_MAX_KEYS, 0], ids=["plain", "blocks"])
def test_dropout_uses_one_mask_forward_and_backward(monkeypatch, plain_max_keys):
    # The mask is read off the forward of a one-hot v (a zero where dropped); with the device key
    # reset, the same draw then drives a real forward and backward, which must match attention in
    # float64 with that mask, gradients of q, k and v included. Blockwise: 3 blocks of 4 keys.
    monkeypatch.setattr(attention, "PLAIN_MAX_KEYS", plain_max_keys)
    monkeypatch.setattr(attention, "BLOCK", 4)
    p, seq = 0.3, 11 + (plain_max_keys == 0)  # a shape per form: no program shared between them
    q, k, v = _qkv((2, 2, 6, 8), (2, 2, seq, 8))
    spmd_torch.manual_seed(7)
    one_hot = torch.eye(seq).expand(2, 2, seq, seq).to(dev)
    kept = F.scaled_dot_product_attention(q.to(dev), k.to(dev), one_hot, dropout_p=p).cpu() != 0
    assert 0.5 < kept.float().mean() < 0.9

    spmd_torch.manual_seed(7)
    leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, dropout_p=p)
    cotangent = _randn(*out.shape, seed=9)
    grads = torch.autograd.grad(out, leaves, cotangent.to(dev))

    wide = [t.double().requires_grad_() for t in (q, k, v)]
    expected = _dropout_reference(*wide, kept.double(), p)
    expected_grads = torch.autograd.grad(expected, wide, cotangent.double())
    assert_close(out, expected.float())
    assert_close(list(grads), [g.float() for g in expected_grads], kind="grad")


def test_dropout_draws_a_new_mask_each_step():
    q, k, v = (t.to(dev) for t in _qkv())
    first = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5).cpu()
    second = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5).cpu()
    assert not torch.equal(first, second)


# --- the blockwise form --------------------------------------------------------------------------


def _jax(t: torch.Tensor) -> jax.Array:
    return jnp.asarray(t.numpy())


@pytest.mark.parametrize(
    "case", ["causal", "gqa", "bias_per_key", "bias_broadcast_keys", "bool_mask"]
)
def test_blockwise_equals_plain_with_partial_blocks(case):
    # 37 keys in blocks of 5 (a partial block last) against one block of 37; 7 queries.
    q, k, v = _qkv((2, 4, 7, 8), (2, 2 if case == "gqa" else 4, 37, 8))
    v = torch.cat([v, v[..., :3]], -1)  # a head dim of v's own
    bias = {
        "bias_per_key": _randn(1, 4, 7, 37, seed=6),
        "bias_broadcast_keys": _randn(2, 1, 7, 1, seed=6),
        "bool_mask": _bool_mask(7, 37),
    }.get(case)
    causal = case == "causal"
    arrays = [_jax(t) for t in (_randn(2, 4, 7, 11, seed=9), q, k, v)]
    arrays.append(None if bias is None else _jax(bias))

    @functools.partial(jax.jit, static_argnums=0)
    def forward_and_backward(block, grad, q, k, v, bias):
        out, lse = attention.blockwise_forward(q, k, v, bias, causal, 0.4, 0.0, None, block)
        grads = attention.blockwise_backward(
            grad, q, k, v, bias, out, lse, causal, 0.4, 0.0, None, block, True
        )
        return [x for x in (out, lse, *grads) if x is not None]

    plain, blocks = (forward_and_backward(block, *arrays) for block in (37, 5))
    for a, b in zip(blocks, plain):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tolerance(torch.float32, "grad"))


# --- the choice of implementation ----------------------------------------------------------------

_SQUARE = dict(q_shape=(2, 8, 1024, 64), k_shape=(2, 8, 1024, 64), v_shape=(2, 8, 1024, 64))


def _choose(platform, dtype=jnp.bfloat16, mask=None, causal=True, dropout=False, **shapes):
    return attention.choose(
        platform, dtype, **(_SQUARE | shapes), mask=mask, causal=causal, dropout=dropout
    )


def test_choice_is_cudnn_for_half_precision_on_nvidia_gpus():
    assert _choose("cuda") == "cudnn"
    assert _choose("gpu", jnp.float16, causal=False) == "cudnn"
    assert _choose("cuda", k_shape=(2, 2, 1024, 64), v_shape=(2, 2, 1024, 64)) == "cudnn"  # GQA


@pytest.mark.parametrize(
    "why, arguments",
    [
        ("float32", dict(dtype=jnp.float32)),
        ("a mask tensor", dict(mask="bool")),
        ("an additive mask", dict(mask="float")),
        ("dropout", dict(dropout=True)),
        ("head dim above 128", dict(q_shape=(2, 8, 1024, 256), k_shape=(2, 8, 1024, 256))),
        ("head dim not a multiple of 8", dict(q_shape=(2, 8, 64, 60), k_shape=(2, 8, 64, 60))),
        ("causal with q_len != kv_len", dict(q_shape=(2, 8, 512, 64))),
        ("ROCm", dict(platform="rocm")),
    ],
)
def test_choice_falls_through_cudnn_to_blockwise_on_gpus(why, arguments):
    platform = arguments.pop("platform", "cuda")
    if "k_shape" in arguments:
        arguments["v_shape"] = arguments["k_shape"]
    assert _choose(platform, **arguments) == "blockwise", why


def test_choice_is_pallas_on_tpu_where_it_applies():
    assert _choose("tpu") == "pallas"
    assert _choose("tpu", jnp.float32, causal=False) == "pallas"
    assert _choose("tpu", mask="float") == "blockwise"
    assert _choose("tpu", dropout=True) == "blockwise"
    assert _choose("tpu", q_shape=(2, 8, 1000, 64)) == "blockwise"  # not whole 128-blocks
    no_pallas = attention.choose("tpu", jnp.bfloat16, **_SQUARE, mask=None, causal=True,
                                 dropout=False, has_pallas=False)  # fmt: skip
    assert no_pallas == "blockwise"


def test_choice_on_cpu_is_plain_for_short_keys_and_blockwise_for_long():
    short = attention.PLAIN_MAX_KEYS
    kv = dict(k_shape=(2, 8, short, 64), v_shape=(2, 8, short, 64))
    assert _choose("cpu", jnp.float32, **kv) == "plain"
    assert _choose("cpu", jnp.float32, mask="bool", dropout=True, **kv) == "plain"
    assert _choose("cpu", jnp.float32) == "blockwise"  # 1024 keys
    assert _choose("cpu") == "blockwise"


# --- the fused kernels' wiring, on CPU ----------------------------------------------------------


def _xla_in_place_of_cudnn(monkeypatch):
    """Programs lowered as on an NVIDIA GPU, JAX's XLA attention standing in for cuDNN's (same
    layout, same log-sum-exp residual)."""
    dot_product_attention = jax.nn.dot_product_attention

    def xla_attention(q, k, v, implementation=None, **kwargs):
        assert implementation == "cudnn" and q.shape[2] % k.shape[2] == 0  # (B, L, H, E)
        wide = (x.astype(jnp.float32) for x in (q, k, v))
        out, lse = dot_product_attention(*wide, implementation="xla", **kwargs)
        return out.astype(q.dtype), lse

    monkeypatch.setattr(attention, "_platform", lambda: "cuda")
    monkeypatch.setattr(jax.nn, "dot_product_attention", xla_attention)


class _PlainFlash:
    """JAX's Pallas flash module's calls that the TPU path makes without a mask, written as plain
    attention: the residual-saving forward ((output, softmax sum l, shift m), where l and m may
    be any pair with the same exp(s - m) / l) and the backward from them, each for equal head
    counts (grouped heads must arrive repeated)."""

    class BlockSizes:
        get_default = staticmethod(lambda *shape: None)

    @staticmethod
    def _scores(q, k, causal, sm_scale):
        assert q.shape[1] == k.shape[1]
        s = jnp.einsum("bhle,bhse->bhls", q.astype(jnp.float32), k.astype(jnp.float32))
        s = s * sm_scale
        if causal:
            s = jnp.where(jnp.tri(s.shape[-2], s.shape[-1], dtype=bool), s, -jnp.inf)
        return s

    @classmethod
    def _flash_attention(cls, q, k, v, ab, segment_ids, save_residuals, causal, sm_scale, *_):
        assert ab is None and segment_ids is None and save_residuals
        s = cls._scores(q, k, causal, sm_scale)
        top = s.max(-1)
        total = jnp.exp(s - top[..., None]).sum(-1)
        p = jnp.exp(s - top[..., None]) / total[..., None]
        out = jnp.einsum("bhls,bhse->bhle", p, v.astype(jnp.float32)).astype(q.dtype)
        return out, total, top

    @classmethod
    def _flash_attention_bwd(cls, save_residuals, causal, sm_scale, block_sizes, debug, res, do):
        q, k, v, _, _, o, total, top = res
        p = jnp.exp(cls._scores(q, k, causal, sm_scale) - top[..., None]) / total[..., None]
        do = do.astype(jnp.float32)
        dv = jnp.einsum("bhls,bhle->bhse", p, do)
        dp = jnp.einsum("bhle,bhse->bhls", do, v.astype(jnp.float32))
        ds = p * (dp - (o.astype(jnp.float32) * do).sum(-1, keepdims=True)) * sm_scale
        dq = jnp.einsum("bhls,bhse->bhle", ds, k.astype(jnp.float32))
        dk = jnp.einsum("bhls,bhle->bhse", ds, q.astype(jnp.float32))
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


def _reference_in_place_of_pallas(monkeypatch):
    """Programs lowered as on a TPU, plain attention standing in for the Pallas kernel."""
    monkeypatch.setattr(attention, "_platform", lambda: "tpu")
    monkeypatch.setattr(attention, "_flash", lambda: _PlainFlash)


@pytest.mark.parametrize("kernel", ["cudnn", "pallas"])
def test_fused_kernels_are_wired_as_the_op_expects(monkeypatch, kernel):
    # Shapes of each kernel's own: programs are cached by structure, not by platform.
    {"cudnn": _xla_in_place_of_cudnn, "pallas": _reference_in_place_of_pallas}[kernel](monkeypatch)
    head_dim = {"cudnn": 8, "pallas": 16}[kernel]
    q, k, v = _qkv((1, 4, 128, head_dim), (1, 2, 128, head_dim), torch.bfloat16)
    before = counters.COUNTERS.get(f"Attention::{kernel}", 0)
    assert_matches_eager(
        F.scaled_dot_product_attention,
        *(q, k, v),
        grad=True,
        tol="attention",
        is_causal=True,
        enable_gqa=True,
    )
    assert counters.COUNTERS.get(f"Attention::{kernel}", 0) > before
    assert counters.COUNTERS.get(f"AttentionBackward::{kernel}", 0) > 0


@pytest.mark.parametrize(
    "q_shape, kv_shape, dtype, causal",
    [
        ((2, 8, 256, 64), (2, 2, 256, 64), torch.bfloat16, True),  # GPT-style, grouped heads
        ((1, 4, 128, 128), (1, 4, 192, 128), torch.float16, False),  # cross attention
    ],
)
def test_a_step_lowers_to_cudnns_kernels_for_nvidia_gpus(
    monkeypatch, q_shape, kv_shape, dtype, causal
):
    """The cuDNN path against JAX's real cuDNN API, with no GPU here: JAX's check of the cuDNN
    version is answered for it, and a training step's pending program (attention forward and
    backward) lowers for CUDA with cuDNN's fused forward and backward kernels; the lowered
    program's outputs have the shapes and dtypes the op promises (the output, the gradients)."""
    q, k, v = (t.to(dev).requires_grad_() for t in _qkv(q_shape, kv_shape, dtype))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    out.float().square().sum().backward()
    wanted = [out, q.grad, k.grad, v.grad]
    before = counters.COUNTERS.get("Attention::cudnn", 0)
    lowered = lowered_as_on("cuda", wanted, monkeypatch)
    text = lowered.as_text()
    assert "__cudnn$fmhaSoftmax(" in text and "__cudnn$fmhaSoftmaxBackward(" in text
    assert counters.COUNTERS.get("Attention::cudnn", 0) > before
    # The backward differentiates the kernel (jax.vjp), calling it again; merged before XLA:
    merged = str(compile_module.merge_equal_ops(lowered))
    assert merged.count("__cudnn$fmhaSoftmax(") == 1
    assert counters.COUNTERS.get("AttentionBackward::cudnn", 0) > 0
    results = jax.tree.leaves(lowered.out_info)
    assert [(r.shape, r.dtype) for r in results] == [
        (tuple(t.shape), to_jax_dtype(t.dtype)) for t in wanted
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_step_lowers_to_the_pallas_kernel_for_tpus(monkeypatch, dtype):
    """The TPU path against JAX's real Pallas flash kernel, with no TPU here: a training step's
    causal attention over grouped heads (repeated for the kernel) lowers for TPU to the kernel's
    Mosaic calls, forward once and backward from its residuals (the backward ran the forward
    kernel again, 4 calls), the outputs shaped and typed as the op promises."""
    q, k, v = (t.to(dev).requires_grad_() for t in _qkv((1, 4, 256, 64), (1, 2, 256, 64), dtype))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.float().square().sum().backward()
    wanted = [out, q.grad, k.grad, v.grad]
    before = counters.COUNTERS.get("Attention::pallas", 0)
    lowered = lowered_as_on("tpu", wanted, monkeypatch)
    kernels = re.findall(r'tpu_custom_call.*kernel_name = "(\w+)"', lowered.as_text())
    # the forward once: the backward starts from its residuals
    assert kernels == [
        "_flash_attention_kernel",
        "_flash_attention_dkv_kernel",
        "_flash_attention_dq_kernel",
    ], kernels
    assert counters.COUNTERS.get("Attention::pallas", 0) > before
    results = jax.tree.leaves(lowered.out_info)
    assert [(r.shape, r.dtype) for r in results] == [
        (tuple(t.shape), to_jax_dtype(t.dtype)) for t in wanted
    ]


# --- SPMD ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mesh_shape, spec",
    [((8,), ("data", None, None, None)), ((2, 4), ("data", "model", None, None))],
)
def test_sharded_attention_is_one_program_and_matches_eager(mesh_shape, spec):
    xr.use_spmd()
    names = ("data", "model")[: len(mesh_shape)]
    mesh = xs.Mesh(np.arange(8), mesh_shape, names)
    q, k, v = _qkv((8, 4, 16, 8), (8, 4, 16, 8))
    leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
    for t in leaves:
        xs.mark_sharding(t, mesh, spec)
    with assert_compiles(1):
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        out.sum().backward()
        spmd_torch.sync()
    wide = [t.double().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*wide, is_causal=True)
    expected.sum().backward()
    assert_close(out, expected.float())
    grads = to_cpu([t.grad for t in leaves])
    assert_close(grads, [t.grad.float() for t in wide], kind="grad")
    xr.reset()


@pytest.mark.parametrize("attend", ["sdpa", "dropout_then_sdpa"])
def test_dropout_draws_and_seeds_have_no_64_bit_bitcast(monkeypatch, attend):
    """TPUs run 64-bit types by rewriting them as 32-bit pairs, and XLA's rewrite has no bitcast
    between 64-bit and 32-bit words: a dropout's uniforms are drawn in float32 (a Python rate is a
    float64 under jax_enable_x64, and JAX drew in its dtype: 64-bit bits, bitcast to float64),
    and the PRNG key a dropout attention hands its backward (``philox_seed``) is packed with
    shifts. Lowered for TPU, a step with both has no bitcast of a 64-bit type; the masks the
    backward draws again are the forward's (the dropout tests above)."""
    q, k, v = (t.to(dev).requires_grad_() for t in _qkv((1, 2, 128, 16), (1, 2, 128, 16)))
    if attend == "dropout_then_sdpa":
        q = F.dropout(q, 0.1)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
    out.sum().backward()
    text = lowered_as_on("tpu", [out, k.grad, v.grad], monkeypatch).as_text()
    casts = [line for line in text.splitlines() if "bitcast_convert" in line]
    assert casts and not [line for line in casts if re.search(r"x(u?i|f)64>", line)], casts


def _sdpa_step_against_float64(q, k, v, **options) -> None:
    """One SDPA training step's output and gradients on xla against float64 eager attention,
    within a flash kernel's rounding (``flash_kernel``, ``attention``)."""
    leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
    cotangent = _randn(*q.shape, seed=9, dtype=q.dtype)
    out = F.scaled_dot_product_attention(*leaves, **options)
    grads = torch.autograd.grad(out, leaves, cotangent.to(dev))
    wide = [t.double().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*wide, **options)
    expected_grads = torch.autograd.grad(expected, wide, cotangent.double())
    assert_close(out, expected.to(q.dtype), tol="flash_kernel")
    assert_close(list(grads), [g.to(q.dtype) for g in expected_grads], tol="attention", kind="grad")


@pytest.mark.parametrize(
    "q_shape, kv_shape, dtype, causal",
    [
        ((1, 4, 256, 64), (1, 2, 256, 64), torch.bfloat16, True),  # grouped heads, repeated
        ((2, 2, 128, 32), (2, 2, 256, 32), torch.float32, False),  # cross attention
    ],
)
def test_the_pallas_kernel_interpreted_matches_float64_attention(
    monkeypatch, q_shape, kv_shape, dtype, causal
):
    """The TPU path's values, not only its lowering: JAX's Pallas flash kernel run here by
    Pallas's interpreter, forward and backward (the kernel differentiated), inside the step's
    one program, equals float64 attention."""
    before = [
        counters.COUNTERS.get(f"{op}::pallas", 0) for op in ("Attention", "AttentionBackward")
    ]
    with pallas_interpreted(monkeypatch):
        shapes = pallas_kernel_shapes(monkeypatch)
        _sdpa_step_against_float64(
            *_qkv(q_shape, kv_shape, dtype), is_causal=causal, enable_gqa=True
        )
    assert shapes and set(shapes) == {q_shape}
    after = [counters.COUNTERS.get(f"{op}::pallas", 0) for op in ("Attention", "AttentionBackward")]
    assert after[0] > before[0] and after[1] > before[1]


def test_a_masked_step_runs_the_pallas_forward_kernel_once(monkeypatch):
    """Lowered for TPU, a training step's attention with a float mask shaped like the scores (the
    kernel's ``ab``) has the forward kernel once: the backward starts from the output and the
    log-sum-exp (it ran the forward kernel again, and a blockwise pass for the log-sum-exp)."""
    q, k, v, mask = (
        t.to(dev).requires_grad_()
        for t in (*_qkv((1, 2, 128, 64), (1, 2, 256, 64)), _randn(1, 2, 128, 256, seed=5))
    )
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.square().sum().backward()
    lowered = lowered_as_on("tpu", [out, q.grad, k.grad, v.grad, mask.grad], monkeypatch)
    text = lowered.as_text()
    kernels = re.findall(r'tpu_custom_call.*kernel_name = "(\w+)"', text)
    assert kernels == [
        "_flash_attention_kernel",
        "_flash_attention_dkv_kernel",
        "_flash_attention_dq_kernel",
    ], kernels
    assert " while(" not in text and "stablehlo.while" not in text  # no blockwise pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_float_mask_shaped_like_the_scores_reaches_the_pallas_kernel(monkeypatch, dtype):
    """On the TPU path a float mask as large as the scores goes to the kernel as its ``ab``
    (queries scaled first: the kernel scales after adding it), and the mask's gradient is the
    kernel's, its backward starting from the forward's output and log-sum-exp; a row of ``-inf``
    gives zeros, as PyTorch's; a row of ``finfo.min`` averages every key, its sum surviving to
    the backward; a mask that broadcasts takes the blockwise form (the kernel would need it
    whole). Values and gradients, the mask's too, are float64 attention's."""
    q, k, v = _qkv((2, 2, 128, 32), (2, 2, 256, 32), dtype)
    mask = _randn(2, 2, 128, 256, seed=5, dtype=dtype)
    mask[:, :, :, 200:] = torch.finfo(dtype).min  # padding, with the value libraries use
    mask[0, 1, 5] = -torch.inf  # a query that sees no key: zeros, with no gradient
    mask[1, 0, 7, ::2] = -torch.inf
    mask[1, 1, 9] = torch.finfo(dtype).min  # every key masked by a huge value: all averaged
    cotangent = _randn(*q.shape, seed=9, dtype=dtype)
    with pallas_interpreted(monkeypatch):
        shapes = pallas_kernel_shapes(monkeypatch)
        leaves = [t.to(dev).requires_grad_() for t in (q, k, v, mask)]
        with assert_counter_delta("Attention::pallas", 1):
            out = F.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3], scale=0.2)
            grads = torch.autograd.grad(out, leaves, cotangent.to(dev))
            spmd_torch.sync()
        with assert_counter_delta("Attention::blockwise", 1):
            broadcast = F.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3][:1, :1])
            broadcast.cpu()
    assert shapes and set(shapes) == {q.shape}, shapes
    wide = [t.double().requires_grad_() for t in (q, k, v, mask)]
    expected = F.scaled_dot_product_attention(*wide[:3], attn_mask=wide[3], scale=0.2)
    expected_grads = torch.autograd.grad(expected, wide, cotangent.double())
    assert_close(out, expected.to(dtype), tol="flash_kernel")
    assert_close(list(grads), [g.to(dtype) for g in expected_grads], tol="attention", kind="grad")
    assert_close(
        broadcast,
        F.scaled_dot_product_attention(*wide[:3], attn_mask=wide[3][:1, :1]).to(dtype),
        tol="flash_kernel",
    )


@pytest.mark.parametrize(
    "mesh_shape, spec, shard",
    [
        ((4, 2), ("data", "model", None, None), (2, 2, 256, 32)),
        ((8,), ("data", None, None, None), (1, 4, 256, 32)),
        ((8,), (None, None, "data", None), (1, 4, 256, 32)),  # sequence split: to batch
    ],
)
def test_sharded_attention_runs_the_pallas_kernel_on_each_devices_shards(
    monkeypatch, mesh_shape, spec, shard
):
    """Under SPMD the partitioner splits the step's program, and it cannot split the Pallas
    kernel by itself (a custom call: every device would run it on gathered inputs). The kernel is
    an op it splits by a rule, over batch and heads, forward and backward: traced here by XLA's
    partitioner, every call of the kernel is on one device's shard, and the step (one program)
    equals float64 attention. A split sequence is gathered and the batch split instead."""
    xr.use_spmd()
    try:
        mesh = xs.Mesh(np.arange(8), mesh_shape, ("data", "model")[: len(mesh_shape)])
        q, k, v = _qkv((8, 4, 256, 32), (8, 4, 256, 32))
        with pallas_interpreted(monkeypatch):
            shapes = pallas_kernel_shapes(monkeypatch, while_compiling=True)
            leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
            for t in leaves:
                xs.mark_sharding(t, mesh, spec)
            with assert_compiles(1), assert_counter_delta("Attention::pallas", 1):
                out = F.scaled_dot_product_attention(*leaves, is_causal=True)
                out.square().sum().backward()
                spmd_torch.sync()
        assert shapes and set(shapes) == {shard}, shapes
        wide = [t.double().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*wide, is_causal=True).square().sum().backward()
        expected = F.scaled_dot_product_attention(*wide, is_causal=True)
        assert_close(out, expected.float().detach(), tol="attention")
        grads = to_cpu([t.grad for t in leaves])
        assert_close(grads, [t.grad.float() for t in wide], tol="attention", kind="grad")
    finally:
        xr.reset()


def test_sharded_attention_lowers_for_tpus_to_the_split_kernel(monkeypatch):
    """Lowered for TPU (JAX's real lowering, no TPU here), a sharded step's attention is the op
    the partitioner splits by its rule, forward and backward, not the blockwise form."""
    xr.use_spmd()
    try:
        mesh = xs.Mesh(np.arange(8), (8,), ("data",))
        q, k, v = (t.to(dev).requires_grad_() for t in _qkv((8, 2, 256, 32), (8, 2, 256, 32)))
        for t in (q, k, v):
            xs.mark_sharding(t, mesh, ("data", None, None, None))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
        with assert_counter_delta("Attention::blockwise", 0):
            text = lowered_as_on("tpu", [out, q.grad, k.grad, v.grad], monkeypatch).as_text()
        assert text.count("@CustomSPMDPartitioning(") == 2  # the kernel, and its backward
        assert counters.COUNTERS.get("Attention::pallas", 0) > 0
    finally:
        xr.reset()


def test_sharded_attention_runs_cudnns_kernel_on_each_devices_shards(monkeypatch):
    """On NVIDIA GPUs a program the partitioner splits runs cuDNN's kernel, with grouped
    key/value heads, on each device's batch and heads, by the same rule as the Pallas kernel
    (its forward results: the output and the log-sum-exp), forward and backward: one program,
    each call on a (2, 4, 128, 64) shard of the (8, 8, 128, 64) queries over a (4, 2) mesh,
    values and gradients equal to float64 attention's within bf16's rounding."""
    xr.use_spmd()
    try:
        mesh = xs.Mesh(np.arange(8), (4, 2), ("data", "model"))
        q, k, v = _qkv((8, 8, 128, 64), (8, 2, 128, 64), torch.bfloat16)
        with cudnn_stood_in(monkeypatch) as shapes:
            leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
            for t in leaves:
                xs.mark_sharding(t, mesh, ("data", "model", None, None))
            with assert_compiles(1), assert_counter_delta("Attention::cudnn", 1):
                out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
                out.float().square().sum().backward()
                spmd_torch.sync()
        assert shapes and set(shapes) == {(2, 4, 128, 64)}, shapes
        wide = [t.double().requires_grad_() for t in (q, k, v)]
        expected = F.scaled_dot_product_attention(*wide, is_causal=True, enable_gqa=True)
        expected.square().sum().backward()
        assert_close(out, expected.to(torch.bfloat16).detach())
        grads = to_cpu([t.grad for t in leaves])
        assert_close(grads, [t.grad.to(torch.bfloat16) for t in wide], tol="attention", kind="grad")
    finally:
        xr.reset()


def test_inside_each_devices_function_cudnns_kernel_is_a_plain_call_on_the_shard(monkeypatch):
    """What the partitioner's rule for the fused kernels relies on: in the function each device
    runs (a context manual over every mesh axis, as a shard_map over all of them), JAX lowers
    cuDNN's kernel as a plain call on the device's shard, without asking its own rule for it
    (which refused FSDP's layouts). Lowered for CUDA with no GPU here."""
    fused = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 90300)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    spec = jax.sharding.PartitionSpec("data", "model")
    each_device = jax.shard_map(
        lambda q, k, v: attention._cudnn_here(q, k, v, True, 0.125),
        mesh=mesh,
        in_specs=(spec,) * 3,
        out_specs=(spec, spec),
    )
    layout = jax.sharding.NamedSharding(mesh, spec)
    q = jax.ShapeDtypeStruct((8, 8, 128, 64), jnp.bfloat16, sharding=layout)
    text = jax.jit(each_device).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
    assert "CustomSPMDPartitioning" not in text
    calls = [line for line in text.splitlines() if "@__cudnn$fmhaSoftmax(" in line]
    assert len(calls) == 1 and "tensor<2x128x4x64xbf16>" in calls[0], calls  # (B, L, H, E)


@pytest.mark.parametrize(
    "mesh_shape, spec, heads, kv_heads, split",
    [
        ((4, 2), ("data", "model"), 8, 8, (("data",), ("model",))),  # as given
        ((4, 2), ("model", "data"), 8, 8, (("model",), ("data",))),
        ((4, 2), (), 8, 8, (("data", "model"), None)),  # replicated: split most, sliced
        ((2, 4), ("data", "model"), 8, 2, (("data", "model"), None)),  # 4 parts of 2 kv heads
        ((8,), ("data",), 8, 8, (("data",), None)),
        ((8,), (None, "data"), 8, 8, (None, ("data",))),
    ],
)
def test_the_fused_kernels_split_keeps_the_queries_layout_where_it_can(
    mesh_shape, spec, heads, kv_heads, split
):
    """The partitioner's rule for a fused kernel splits batch and heads over mesh axes where the
    queries already are, else as much as the shapes allow (``attention._layout``)."""
    names = ("data", "model")[: len(mesh_shape)]
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(mesh_shape), names)
    layout = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    query = jax.ShapeDtypeStruct((8, heads, 128, 64), jnp.float32, sharding=layout)
    assert attention._layout(mesh, query, kv_heads) == split


def test_inference_mode_records_the_fused_op_and_no_dropout_call_keeps_the_random_stream():
    q, k, v = (torch.randn(1, 2, 8, 4).to(spmd_torch.device()) for _ in range(3))
    with torch.inference_mode():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ops = [str(n.op) for n in graph.pending_program([out]).nodes]
    assert ops == ["aten._scaled_dot_product_fused_attention_overrideable.default"], ops
    spmd_torch.manual_seed(3)
    F.scaled_dot_product_attention(q, k, v).sum().cpu()
    after_attention = torch.rand(4, device=spmd_torch.device()).cpu()
    spmd_torch.manual_seed(3)
    assert torch.equal(torch.rand(4, device=spmd_torch.device()).cpu(), after_attention)


@pytest.mark.parametrize("mask", ["causal", "bool", "additive"])
def test_blockwise_attention_in_a_scan_matches_the_python_loop(monkeypatch, mask):
    # Inside a scan's body JAX differentiates the forward; it must get the blockwise backward's
    # gradients (an additive mask's too), not its own of the forward's loop. 3 blocks of 4 keys.
    from spmd_torch.experimental.scan import scan

    monkeypatch.setattr(attention, "PLAIN_MAX_KEYS", 0)
    monkeypatch.setattr(attention, "BLOCK", 4)
    q, k, v = _qkv((2, 2, 7, 8), (2, 2, 7, 8))
    kvs = torch.stack([torch.stack([k, v]), torch.stack([v, k])])  # two iterations' keys, values
    masks = {"causal": None, "bool": _bool_mask(7, 7), "additive": _randn(2, 1, 7, 7, seed=5)}
    m = masks[mask]
    kwargs = {"is_causal": mask == "causal"}

    def run(q, kvs, m):
        def fn(carry, kv):
            return F.scaled_dot_product_attention(carry, kv[0], kv[1], attn_mask=m, **kwargs), None

        if q.device.type == "cpu":
            for kv in kvs:
                q = fn(q, kv)[0]
            return q
        return scan(fn, q, kvs)[0]

    cpu = [q.requires_grad_(), kvs.requires_grad_()]
    if mask == "additive":
        cpu.append(m.requires_grad_())
    on_xla = [t.detach().to(dev).requires_grad_() for t in cpu]
    want = run(cpu[0], cpu[1], cpu[2] if len(cpu) > 2 else m)
    got = run(
        on_xla[0], on_xla[1], on_xla[2] if len(on_xla) > 2 else None if m is None else m.to(dev)
    )
    cotangent = _randn(*want.shape, seed=9)
    want_grads = torch.autograd.grad(want, cpu, cotangent)
    grads = torch.autograd.grad(got, on_xla, cotangent.to(dev))
    assert_close(got, want.detach())
    assert_close(list(grads), list(want_grads), kind="grad")
