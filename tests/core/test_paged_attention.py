"""Paged attention for inference (custom_kernel's paged_attention, multi_queries_paged_attention,
ragged_paged_attention) as one op each: values against float64 attention written out here over
each sequence's keys, on this host's XLA form and on the TPU path; torch.compile; errors."""

from __future__ import annotations

import pytest
import torch

import spmd_torch
from spmd_torch._lazy.lowering.paged import MASK_VALUE, PagedAttentionError
from spmd_torch.debug import graph
from spmd_torch.experimental.custom_kernel import (
    multi_queries_paged_attention,
    paged_attention,
    ragged_paged_attention,
)
from tests.helpers import assert_counter_delta, pallas_interpreted

dev = spmd_torch.device()


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _pages_of(pool_pages: int, sequences: int, per_sequence: int, seed: int) -> torch.Tensor:
    """Distinct page numbers, scattered over the pool, as a cache allocator hands them out."""
    order = torch.randperm(pool_pages, generator=torch.Generator().manual_seed(seed))
    return order[: sequences * per_sequence].reshape(sequences, per_sequence).to(torch.int32)


def _attend(q, k, v, positions, scale=1.0, window=None, soft_cap=None, mask_value=None):
    """float64 attention of q [queries, heads, dim] at ``positions`` over k, v [keys, kv_heads,
    dim], key/value heads repeated per group; keys after a query (or ``window`` or more before
    it) hidden: -inf, or ``mask_value`` added."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    key = torch.arange(k.shape[0])[None]
    hidden = key > positions[:, None]
    if window is not None:
        hidden |= key <= positions[:, None] - window
    if mask_value is None:
        scores = scores.masked_fill(hidden, float("-inf"))
    else:
        scores = scores + hidden * mask_value
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


# --- ragged paged attention ----------------------------------------------------------------------

# (query length, key length) per live sequence: a decode step, a chunk of a prefill, a whole
# prefill, a sequence of 40 queries (three blocks of the XLA form, one partial).
_RAGGED = [(1, 37), (5, 18), (12, 12), (40, 63)]


def _ragged_inputs(sequences=_RAGGED, heads=8, kv_heads=2, dim=32, page_size=8, tokens=72):
    """q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs: two padding sequences after the
    live ones (their lengths left at garbage values), padding tokens after the last query."""
    max_seqs = len(sequences) + 2
    per_sequence = -(-max(kv_len for _, kv_len in sequences) // page_size) + 1
    pool = max_seqs * per_sequence + 7
    q = _randn(tokens, heads, dim, seed=1)
    kv_pages = _randn(pool, page_size, 2 * kv_heads, dim, seed=2)
    kv_lens = torch.full((max_seqs,), 5, dtype=torch.int32)
    cu_q_lens = torch.zeros(max_seqs + 1, dtype=torch.int32)
    for s, (q_len, kv_len) in enumerate(sequences):
        kv_lens[s] = kv_len
        cu_q_lens[s + 1] = cu_q_lens[s] + q_len
    cu_q_lens[len(sequences) + 1 :] = cu_q_lens[len(sequences)]
    page_indices = _pages_of(pool, max_seqs, per_sequence, seed=3)
    num_seqs = torch.tensor([len(sequences)], dtype=torch.int32)
    return q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs


def ragged_float64(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale=None,
                   v_scale=None, sm_scale=1.0, **options):  # fmt: skip
    """Each live sequence's queries against its keys (even combined heads) and values (odd),
    one sequence at a time; the live queries' rows only."""
    kv_heads, dim = kv_pages.shape[2] // 2, kv_pages.shape[3]
    outputs = []
    for s in range(int(num_seqs[0])):
        start, end, kv_len = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        kv = kv_pages[page_indices[s].long()].reshape(-1, 2 * kv_heads, dim)[:kv_len]
        k, v = kv[:, 0::2], kv[:, 1::2]
        if k_scale is not None:  # an fp8 cache, read in the queries' dtype as the kernel does
            k, v = (k.float() * k_scale).to(q.dtype), (v.float() * v_scale).to(q.dtype)
        positions = kv_len - (end - start) + torch.arange(end - start)
        outputs.append(_attend(q[start:end], k, v, positions, sm_scale, **options))
    return torch.cat(outputs)


def _ragged_on_device(inputs, **options) -> torch.Tensor:
    out = ragged_paged_attention(*(t.to(dev) for t in inputs), **options)
    return out.cpu()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"sm_scale": 0.25, "soft_cap": 2.0},
        {"sliding_window": 6},
        {"sm_scale": 0.5, "sliding_window": 20, "soft_cap": 4.0},
        {"mask_value": -3.0},  # finite: hidden keys still weigh, as in the kernel
    ],
)
def test_ragged_paged_attention_equals_float64(options):
    inputs = _ragged_inputs()
    with assert_counter_delta("PagedAttention::xla", 1):
        out = _ragged_on_device(inputs, **options)
    reference_options = {
        "sm_scale": options.get("sm_scale", 1.0),
        "window": options.get("sliding_window"),
        "soft_cap": options.get("soft_cap"),
        "mask_value": options.get("mask_value"),
    }
    expected = ragged_float64(*inputs, **reference_options)
    live = int(inputs[4][int(inputs[5][0])])
    assert out.dtype == torch.float32 and out.shape == inputs[0].shape
    torch.testing.assert_close(out[:live].double(), expected, atol=1e-5, rtol=1e-5)
    assert not out[live:].any()  # the padding tokens' rows stay zero


def test_ragged_paged_attention_more_blocks_than_one_loop_step():
    """300 queries of one prefill chunk and 60 decodes: 79 query blocks, ten loop steps."""
    sequences = [(300, 310)] + [(1, 20 + s) for s in range(60)]
    inputs = _ragged_inputs(sequences, heads=4, kv_heads=4, dim=16, page_size=32, tokens=384)
    out = _ragged_on_device(inputs)
    expected = ragged_float64(*inputs)
    torch.testing.assert_close(out[:360].double(), expected, atol=1e-5, rtol=1e-5)


def test_ragged_paged_attention_of_long_prefills_takes_large_query_blocks():
    """Two prefill chunks of 300 and 150 queries in a batch of 512 tokens over 4 sequence slots:
    blocks of 128 queries (each block reads its sequence's keys once), float64's values; a
    decode batch keeps blocks of 16."""
    from spmd_torch._lazy.lowering import paged

    sequences = [(300, 310), (150, 400)]
    inputs = _ragged_inputs(sequences, heads=4, kv_heads=2, dim=16, page_size=32, tokens=512)
    assert paged._query_block(512, 4) == 128 and paged._query_block(72, 6) == 16
    out = _ragged_on_device(inputs, sm_scale=0.5, sliding_window=100)
    expected = ragged_float64(*inputs, sm_scale=0.5, window=100)
    torch.testing.assert_close(out[:450].double(), expected, atol=1e-5, rtol=1e-5)


def test_ragged_paged_attention_reads_an_fp8_cache_with_its_scales():
    """bf16 queries over a float8_e5m2 cache: keys and values scaled into bf16, as the kernel
    reads them; the output rounded to bf16 once."""
    q, kv_pages, *rest = _ragged_inputs()
    q, kv_pages = q.to(torch.bfloat16), (kv_pages * 4).to(torch.float8_e5m2)
    inputs = (q, kv_pages, *rest)
    cache = kv_pages.to(dev)
    assert torch.equal(cache.cpu().view(torch.uint8), kv_pages.view(torch.uint8))  # bit for bit
    assert torch.equal(cache.float().cpu(), kv_pages.float())
    out = _ragged_on_device(inputs, k_scale=0.25, v_scale=0.5)
    expected = ragged_float64(*inputs, k_scale=0.25, v_scale=0.5)
    live = expected.shape[0]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out[:live].double(), expected, atol=2**-8, rtol=2**-8)


def test_ragged_paged_attention_is_one_node_and_compiles_under_dynamo():
    inputs = [t.to(dev) for t in _ragged_inputs()]
    out = ragged_paged_attention(*inputs, sm_scale=0.5)
    ops = [str(n.op) for n in graph.pending_program([out]).nodes]
    assert ops == ["xla.ragged_paged_attention.default"], ops

    def call(*tensors):
        return torch.ops.xla.ragged_paged_attention(*tensors, sm_scale=0.5)

    compiled = torch.compile(call, backend="spmd_torch")
    torch.testing.assert_close(compiled(*inputs).cpu(), out.cpu(), atol=0, rtol=0)


def test_ragged_paged_attention_on_tpu_calls_jaxs_kernel(monkeypatch):
    """On TPU the op calls JAX's kernel with its operands and options (with use_kernel=False it
    takes the XLA form). This host can neither run the kernel (this JAX's Pallas interpreters
    fail on it) nor lower it (it asks the device for its TPU generation), so the XLA form
    stands in for it, called with what the kernel is given: wrong operands or options would
    give wrong values."""
    import jax

    from spmd_torch._lazy.lowering import attention, paged

    rpa = pytest.importorskip("jax.experimental.pallas.ops.tpu.ragged_paged_attention")
    calls = []

    def kernel(*operands, num_kv_pages_per_block, num_queries_per_block, vmem_limit_bytes,
               **options):  # fmt: skip
        calls.append((num_kv_pages_per_block, num_queries_per_block, jax.config.jax_enable_x64))
        return paged._ragged_in_blocks(*operands, **options)

    monkeypatch.setattr(rpa, "ragged_paged_attention", kernel)
    monkeypatch.setattr(attention, "_platform", lambda: "tpu")
    inputs = _ragged_inputs(heads=8, kv_heads=4)
    options = {"sm_scale": 0.5, "sliding_window": 9, "soft_cap": 3.0}
    expected = ragged_float64(*inputs, sm_scale=0.5, window=9, soft_cap=3.0)
    for use_kernel, impl in ((True, "kernel"), (False, "xla")):
        with assert_counter_delta(f"PagedAttention::{impl}", 1):
            out = _ragged_on_device(
                inputs, use_kernel=use_kernel, num_kv_pages_per_block=3, **options
            )
        torch.testing.assert_close(out[: len(expected)].double(), expected, atol=1e-5, rtol=1e-5)
    assert calls == [(3, None, False)]  # once, its blocks given, traced with 32-bit indices


# --- paged attention (decode) and multi-query paged attention -----------------------------------


def _paged_inputs(batch=4, heads=8, kv_heads=2, dim=32, page_size=8, per_sequence=6, queries=None):
    pool = 40
    shape = (batch, heads, dim) if queries is None else (batch, queries, heads, dim)
    q = _randn(*shape, seed=4)
    k_pages = _randn(kv_heads, pool, page_size, dim, seed=5)
    v_pages = _randn(kv_heads, pool, page_size, dim, seed=6)
    lengths = torch.tensor([1, 17, 48, 30][:batch], dtype=torch.int32)
    return q, k_pages, v_pages, lengths, _pages_of(pool, batch, per_sequence, seed=7)


def _sequence_keys(k_pages, v_pages, pages, length):
    """One sequence's keys and values [length, kv_heads, dim] from its pages."""
    kv_heads, _, _, dim = k_pages.shape

    def read(pool):
        return pool[:, pages.long()].reshape(kv_heads, -1, dim)[:, :length].transpose(0, 1)

    return read(k_pages), read(v_pages)


@pytest.mark.parametrize("soft_cap", [None, 3.0])
def test_paged_attention_equals_float64(soft_cap):
    q, k_pages, v_pages, lengths, pages = inputs = _paged_inputs()
    with assert_counter_delta("PagedAttention::xla", 1):
        out = paged_attention(
            *(t.to(dev) for t in inputs), pages_per_compute_block=3, attn_logits_soft_cap=soft_cap
        ).cpu()
    for b in range(q.shape[0]):
        k, v = _sequence_keys(k_pages, v_pages, pages[b], int(lengths[b]))
        position = torch.tensor([int(lengths[b]) - 1])
        expected = _attend(q[b][None], k, v, position, soft_cap=soft_cap)[0]
        torch.testing.assert_close(out[b].double(), expected, atol=1e-5, rtol=1e-5)


def test_paged_attention_of_an_empty_sequence_is_zero():
    inputs = list(_paged_inputs())
    inputs[3] = torch.tensor([0, 17, 0, 30], dtype=torch.int32)
    out = paged_attention(*(t.to(dev) for t in inputs), pages_per_compute_block=2).cpu()
    assert not out[0].any() and not out[2].any() and out[1].abs().sum() > 0


def test_paged_attention_on_tpu_runs_jaxs_kernel(monkeypatch):
    """The TPU path is JAX's Pallas kernel, interpreted here: the op hands it its operands as
    they are (its values equal the kernel's own, called directly)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as kernel

    inputs = _paged_inputs(heads=16, dim=128, page_size=16, per_sequence=4)
    with pallas_interpreted(monkeypatch), assert_counter_delta("PagedAttention::kernel", 1):
        out = paged_attention(
            *(t.to(dev) for t in inputs), pages_per_compute_block=2, attn_logits_soft_cap=5.0
        ).cpu()
        with jax.enable_x64(False):
            expected = kernel(
                *(jnp.asarray(t.numpy()) for t in inputs),
                pages_per_compute_block=2,
                attn_logits_soft_cap=5.0,
            )
    torch.testing.assert_close(out, torch.from_numpy(jax.device_get(expected).copy()))


def test_multi_queries_paged_attention_equals_float64():
    """Query i of sequence b sits at lengths[b] - effective_q_lens[b] + i; the rows past a
    sequence's real queries see all of its keys."""
    q, k_pages, v_pages, lengths, pages = inputs = _paged_inputs(queries=5)
    effective = torch.tensor([1, 5, 3, 4], dtype=torch.int32)
    out = multi_queries_paged_attention(
        *(t.to(dev) for t in (*inputs, effective)),
        num_kv_pages_per_compute_block=2,
        num_queries_per_compute_block=4,
        attn_logits_soft_cap=4.0,
    ).cpu()
    for b in range(q.shape[0]):
        length = int(lengths[b])
        k, v = _sequence_keys(k_pages, v_pages, pages[b], length)
        positions = (length - int(effective[b]) + torch.arange(5)).clamp(max=length - 1)
        expected = _attend(q[b], k, v, positions, soft_cap=4.0)
        torch.testing.assert_close(out[b].double(), expected, atol=1e-5, rtol=1e-5)


# --- errors ---------------------------------------------------------------------------------------


def test_errors_name_the_op_and_the_argument():
    q, k_pages, v_pages, lengths, pages = (t.to(dev) for t in _paged_inputs())
    with pytest.raises(PagedAttentionError, match=r"paged_attention: lengths must be int32"):
        paged_attention(q, k_pages, v_pages, lengths.long(), pages, pages_per_compute_block=2)
    with pytest.raises(PagedAttentionError, match=r"pages_per_compute_block=4 does not divide"):
        paged_attention(q, k_pages, v_pages, lengths, pages, pages_per_compute_block=4)
    with pytest.raises(PagedAttentionError, match=r"heads are not a multiple"):
        paged_attention(q[:, :7], k_pages, v_pages, lengths, pages, pages_per_compute_block=2)
    ragged = [t.to(dev) for t in _ragged_inputs()]
    with pytest.raises(PagedAttentionError, match=r"ragged_paged_attention: num_seqs is \[1\]"):
        ragged_paged_attention(*ragged[:5], ragged[5].repeat(2))
    with pytest.raises(PagedAttentionError, match=r"sliding_window=0 is not positive"):
        ragged_paged_attention(*ragged, sliding_window=0)


def test_mask_value_is_the_kernels():
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel

    assert MASK_VALUE == kernel.DEFAULT_MASK_VALUE
