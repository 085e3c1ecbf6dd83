"""Lowerings: paged attention for inference, PyTorch/XLA's ``paged_attention``,
``multi_queries_paged_attention`` and ``ragged_paged_attention`` as ops of our own, under
PyTorch/XLA's schemas (``torch.ops.xla.*``).

A paged key/value cache holds each sequence's keys in fixed-size pages scattered over one pool;
``page_indices`` lists each sequence's pages in order, and only its first ``length`` keys count.
Each op is one node of the graph, its implementation chosen per platform when the program is
traced (the ``PagedAttention::<impl>`` counter says which ran):

- ``kernel``: on TPU, JAX's Pallas kernels: ``paged_attention`` (one query per sequence: decode)
  and ``ragged_paged_attention`` (any number of queries per sequence, prefill and decode mixed),
  the kernels PyTorch/XLA serialises into custom calls.
- ``xla``: elsewhere (and for ``multi_queries_paged_attention``, whose kernel is PyTorch/XLA's own,
  and for ``use_kernel=False``), the pages each sequence uses gathered and attended to with the
  mask built from the lengths, in float32: one gather per sequence, never the whole pool.

Inference only, as in PyTorch/XLA: no backward. The checks that need values (a query longer than
its keys, more pages than a sequence lists) are not made; shapes and dtypes are, in the ops' fake
kernels, so lazy tracing and ``torch.compile`` raise the same errors.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import torch

from .. import counters
from . import attention
from .registry import lowers

_LIBRARY = torch.library.Library("xla", "FRAGMENT")
_LIBRARY.define(
    "paged_attention(Tensor q, Tensor k_pages, Tensor v_pages, Tensor lengths, "
    "Tensor page_indices, int pages_per_compute_block, str? megacore_mode=None, "
    "float? attn_logits_soft_cap=None) -> Tensor"
)
_LIBRARY.define(
    "multi_queries_paged_attention(Tensor q, Tensor k_pages, Tensor v_pages, Tensor lengths, "
    "Tensor page_indices, Tensor effective_q_lens, int num_kv_pages_per_compute_block, "
    "int num_queries_per_compute_block, bool use_kernel, float? attn_logits_soft_cap=None) "
    "-> Tensor"
)
_LIBRARY.define(
    "ragged_paged_attention(Tensor q, Tensor kv_pages, Tensor kv_lens, Tensor page_indices, "
    "Tensor cu_q_lens, Tensor num_seqs, float sm_scale=1, int? sliding_window=None, "
    "float? soft_cap=None, float? mask_value=None, float? k_scale=None, float? v_scale=None, "
    "bool use_kernel=True, int? num_kv_pages_per_block=None, int? num_queries_per_block=None, "
    "int? vmem_limit_bytes=None) -> Tensor"
)

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
"""What the kernels add to a masked score (JAX's and PyTorch/XLA's default)."""
_INDEX_DTYPE = torch.int32
# The XLA form of ragged attention takes the queries of one sequence in blocks of 16 to 128 (each
# block reads its sequence's keys once), about this many query rows a loop step.
_SMALLEST_BLOCK, _LARGEST_BLOCK, _ROWS_A_STEP = 16, 128, 128


class PagedAttentionError(ValueError):
    """Arguments a paged attention op cannot take; the message names the op and the shapes."""


# --- shapes and checks (the fake kernels) --------------------------------------------------------


def _require(op: str, ok: bool, message: str) -> None:
    if not ok:
        raise PagedAttentionError(f"{op}: {message}")


def _check_indices(op: str, **tensors) -> None:
    for name, t in tensors.items():
        _require(op, t.dtype == _INDEX_DTYPE, f"{name} must be int32, got {t.dtype}")


def _check_pages(op: str, q, k_pages, v_pages, lengths, page_indices, batch: int) -> None:
    """The shared checks of the two ops whose pages are [kv_heads, pages, page_size, head_dim]."""
    shapes = (
        f"q {tuple(q.shape)}, k_pages {tuple(k_pages.shape)}, v_pages {tuple(v_pages.shape)}, "
        f"lengths {tuple(lengths.shape)}, page_indices {tuple(page_indices.shape)}"
    )
    _require(op, k_pages.dim() == 4, f"k_pages is [kv_heads, pages, page_size, head_dim]: {shapes}")
    _require(op, k_pages.shape == v_pages.shape, f"k_pages and v_pages differ: {shapes}")
    _require(op, q.shape[-1] == k_pages.shape[3], f"q and the pages' head_dim differ: {shapes}")
    _require(
        op,
        q.shape[-2] % k_pages.shape[0] == 0,
        f"q's heads are not a multiple of the pages' kv_heads: {shapes}",
    )
    _require(
        op,
        tuple(lengths.shape) == (batch,)
        and page_indices.dim() == 2
        and page_indices.shape[0] == batch,
        f"lengths is [batch] and page_indices [batch, pages_per_sequence]: {shapes}",
    )
    _check_indices(op, lengths=lengths, page_indices=page_indices)


@torch.library.register_fake("xla::paged_attention", lib=_LIBRARY)
def _paged_attention_shape(
    q,
    k_pages,
    v_pages,
    lengths,
    page_indices,
    pages_per_compute_block,
    megacore_mode=None,
    attn_logits_soft_cap=None,
):
    op = "paged_attention"
    _require(op, q.dim() == 3, f"q is [batch, heads, head_dim], got {tuple(q.shape)}")
    _check_pages(op, q, k_pages, v_pages, lengths, page_indices, q.shape[0])
    pages_per_sequence = page_indices.shape[1]
    _require(
        op,
        pages_per_compute_block > 0 and pages_per_sequence % pages_per_compute_block == 0,
        f"pages_per_compute_block={pages_per_compute_block} does not divide the "
        f"{pages_per_sequence} pages per sequence",
    )
    _require(
        op,
        megacore_mode in (None, "kv_head", "batch"),
        f"megacore_mode={megacore_mode!r} is not one of None, 'kv_head', 'batch'",
    )
    _require(
        op,
        megacore_mode != "kv_head" or k_pages.shape[0] % 2 == 0,
        f"megacore_mode='kv_head' needs an even number of kv heads, got {k_pages.shape[0]}",
    )
    _require(
        op,
        megacore_mode != "batch" or q.shape[0] % 2 == 0,
        f"megacore_mode='batch' needs an even batch, got {q.shape[0]}",
    )
    return torch.empty_like(q)


@torch.library.register_fake("xla::multi_queries_paged_attention", lib=_LIBRARY)
def _multi_queries_paged_attention_shape(
    q, k_pages, v_pages, lengths, page_indices, effective_q_lens, *rest, **options
):
    op = "multi_queries_paged_attention"
    _require(op, q.dim() == 4, f"q is [batch, query_len, heads, head_dim], got {tuple(q.shape)}")
    _check_pages(op, q, k_pages, v_pages, lengths, page_indices, q.shape[0])
    _require(
        op,
        tuple(effective_q_lens.shape) == (q.shape[0],),
        f"effective_q_lens is [batch] = ({q.shape[0]},), got {tuple(effective_q_lens.shape)}",
    )
    _check_indices(op, effective_q_lens=effective_q_lens)
    return torch.empty_like(q)


@torch.library.register_fake("xla::ragged_paged_attention", lib=_LIBRARY)
def _ragged_paged_attention_shape(
    q,
    kv_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    sm_scale=1.0,
    sliding_window=None,
    soft_cap=None,
    *rest,
    **options,
):
    op = "ragged_paged_attention"
    shapes = (
        f"q {tuple(q.shape)}, kv_pages {tuple(kv_pages.shape)}, kv_lens {tuple(kv_lens.shape)}, "
        f"page_indices {tuple(page_indices.shape)}, cu_q_lens {tuple(cu_q_lens.shape)}, "
        f"num_seqs {tuple(num_seqs.shape)}"
    )
    _require(op, q.dim() == 3, f"q is [tokens, heads, head_dim]: {shapes}")
    _require(
        op,
        kv_pages.dim() == 4 and kv_pages.shape[2] % 2 == 0,
        "kv_pages is [pages, page_size, 2 * kv_heads, head_dim], keys and values interleaved "
        f"by head: {shapes}",
    )
    _require(op, q.shape[2] == kv_pages.shape[3], f"q and kv_pages' head_dim differ: {shapes}")
    _require(
        op,
        q.shape[1] % (kv_pages.shape[2] // 2) == 0,
        f"q's heads are not a multiple of kv_pages' kv heads: {shapes}",
    )
    _require(op, page_indices.dim() == 2, f"page_indices is [max_num_seqs, pages]: {shapes}")
    seqs = page_indices.shape[0]
    _require(
        op,
        tuple(kv_lens.shape) == (seqs,) and tuple(cu_q_lens.shape) == (seqs + 1,),
        f"kv_lens is [max_num_seqs] and cu_q_lens [max_num_seqs + 1]: {shapes}",
    )
    _require(op, tuple(num_seqs.shape) == (1,), f"num_seqs is [1]: {shapes}")
    _check_indices(
        op, kv_lens=kv_lens, page_indices=page_indices, cu_q_lens=cu_q_lens, num_seqs=num_seqs
    )
    _require(
        op,
        sliding_window is None or sliding_window > 0,
        f"sliding_window={sliding_window} is not positive",
    )
    _require(op, soft_cap != 0.0, "soft_cap=0.0 divides by zero")
    return torch.empty_like(q)


# --- lowerings ------------------------------------------------------------------------------------


def _tpu_kernel(name: str):
    """JAX's Pallas TPU module ``name`` where programs compile for a TPU and this JAX has it."""
    if attention._platform() != "tpu":
        return None
    try:
        return importlib.import_module(f"jax.experimental.pallas.ops.tpu.{name}")
    except ImportError:
        return None


@lowers(torch.ops.xla.paged_attention.default)
def _paged_attention(
    q,
    k_pages,
    v_pages,
    lengths,
    page_indices,
    pages_per_compute_block,
    megacore_mode=None,
    attn_logits_soft_cap=None,
):
    kernel = _tpu_kernel("paged_attention")
    if kernel is not None:
        counters.bump("PagedAttention::kernel")
        with jax.enable_x64(False):  # Pallas kernels index in 32 bits
            return kernel.paged_attention(
                q,
                k_pages,
                v_pages,
                lengths,
                page_indices,
                pages_per_compute_block=pages_per_compute_block,
                megacore_mode=megacore_mode,
                attn_logits_soft_cap=attn_logits_soft_cap,
            )
    counters.bump("PagedAttention::xla")
    last = lengths[:, None] - 1  # each query sees every key of its sequence
    return _attend_pages(
        q[:, None], k_pages, v_pages, lengths, page_indices, last, attn_logits_soft_cap
    )[:, 0]


@lowers(torch.ops.xla.multi_queries_paged_attention.default)
def _multi_queries_paged_attention(
    q,
    k_pages,
    v_pages,
    lengths,
    page_indices,
    effective_q_lens,
    num_kv_pages_per_compute_block,
    num_queries_per_compute_block,
    use_kernel,
    attn_logits_soft_cap=None,
):
    """Query ``i`` of sequence ``b`` is at position ``lengths[b] - effective_q_lens[b] + i``: the
    last ``effective_q_lens[b]`` of its keys are its queries' own."""
    counters.bump("PagedAttention::xla")
    positions = (lengths - effective_q_lens)[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)
    return _attend_pages(
        q, k_pages, v_pages, lengths, page_indices, positions, attn_logits_soft_cap
    )


def _attend_pages(q, k_pages, v_pages, lengths, page_indices, positions, soft_cap):
    """q [batch, queries, heads, dim], each sequence attending to the keys of the pages it
    lists (``_attend``), its query ``i`` at ``positions[b, i]``."""

    def sequence(q, pages, length, positions):
        k, v = (_read_pages(pool, pages) for pool in (k_pages, v_pages))
        return _attend(q, k, v, length, positions, soft_cap=soft_cap)

    return jax.vmap(sequence)(q, page_indices, lengths, positions)


def _read_pages(pool, pages):
    """One sequence's keys (or values) [keys, kv_heads, dim] from the pages it lists of a pool
    [kv_heads, pages, page_size, dim]."""
    kv_heads, _, _, dim = pool.shape
    return pool[:, pages].reshape(kv_heads, -1, dim).swapaxes(0, 1)


def _attend(q, k, v, kv_len, positions, *, sm_scale=1.0, sliding_window=None, soft_cap=None,
            mask_value=MASK_VALUE):  # fmt: skip
    """One sequence's attention: q [queries, heads, dim] at ``positions`` against k, v [keys,
    kv_heads, dim], heads grouped over kv heads, scores scaled by ``sm_scale`` and capped; keys
    after a query (or ``sliding_window`` or more before it) get ``mask_value`` added, keys past
    ``kv_len`` count for nothing. Scores and weights in float32."""
    queries, heads, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(queries, kv_heads, heads // kv_heads, dim)
    scores = jnp.einsum("qhgd,khd->hgqk", grouped, k, preferred_element_type=jnp.float32)
    scores = _capped(scores * sm_scale, soft_cap)
    key = jnp.arange(k.shape[0], dtype=jnp.int32)
    hidden = key[None] > positions[:, None]
    if sliding_window is not None:
        hidden |= key[None] <= positions[:, None] - sliding_window
    scores = scores + jnp.where(hidden, mask_value, 0.0)
    weights = _softmax(jnp.where(key < kv_len, scores, -jnp.inf))
    out = jnp.einsum("hgqk,khd->qhgd", weights, v.astype(jnp.float32))
    return out.reshape(queries, heads, dim).astype(q.dtype)


def _softmax(scores):
    """Softmax over the last axis; a row whose every score is -inf (a sequence of length 0)
    weighs nothing, where softmax's would be NaN."""
    top = jnp.max(scores, axis=-1, keepdims=True)
    exp = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(exp, axis=-1, keepdims=True)
    return exp / jnp.where(total == 0, 1.0, total)


def _capped(scores, soft_cap):
    return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)


@lowers(torch.ops.xla.ragged_paged_attention.default)
def _ragged_paged_attention(
    q,
    kv_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    sm_scale=1.0,
    sliding_window=None,
    soft_cap=None,
    mask_value=None,
    k_scale=None,
    v_scale=None,
    use_kernel=True,
    num_kv_pages_per_block=None,
    num_queries_per_block=None,
    vmem_limit_bytes=None,
):
    mask_value = MASK_VALUE if mask_value is None else mask_value
    options = dict(
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        mask_value=mask_value,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    kernel = _tpu_kernel("ragged_paged_attention") if use_kernel else None
    if kernel is not None and _tiles(kernel, q, kv_pages):
        counters.bump("PagedAttention::kernel")
        with jax.enable_x64(False):  # Pallas kernels index in 32 bits
            return kernel.ragged_paged_attention(
                q,
                kv_pages,
                kv_lens,
                page_indices,
                cu_q_lens,
                num_seqs,
                **options,
                num_kv_pages_per_block=num_kv_pages_per_block,
                num_queries_per_block=num_queries_per_block,
                vmem_limit_bytes=vmem_limit_bytes or 120 * 1024 * 1024,
            )
    counters.bump("PagedAttention::xla")
    return _ragged_in_blocks(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)


def _tiles(module, q, kv_pages) -> bool:
    """Whether the ragged kernel takes these heads (it needs the combined kv heads in whole
    tiles of its layout, else it raises while tracing); where this JAX's module has no such
    check, the kernel checks for itself."""
    check = getattr(getattr(module, "kernel", None), "get_min_heads_per_blk", None)
    if check is None:
        return True
    try:
        check(q.shape[1], kv_pages.shape[2], q.dtype, kv_pages.dtype)
    except ValueError:
        return False
    return True


def _ragged_in_blocks(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    """The XLA form of ragged paged attention: each sequence's queries in blocks
    (``_query_block``), a few blocks a loop step, each block attending to its sequence's
    gathered keys (``options``: ``_attend_sequence``'s); as many steps as the live sequences'
    blocks need (padding sequences and tokens cost nothing). A block's rows past its sequence's
    queries are dropped when the outputs are written; tokens after the last sequence's stay
    zero."""
    tokens, heads, dim = q.shape
    seqs = page_indices.shape[0]
    size = _query_block(tokens, seqs)
    at_once = max(1, _ROWS_A_STEP // size)
    query_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    live = jnp.arange(seqs) < num_seqs[0]
    blocks = jnp.where(live, -(-query_lens // size), 0)
    block_ends = jnp.cumsum(blocks)
    padded = jnp.pad(q, ((0, size), (0, 0), (0, 0)))
    seq_of = dict(
        kv_pages=kv_pages,
        kv_lens=kv_lens,
        page_indices=page_indices,
        cu_q_lens=cu_q_lens,
        query_lens=query_lens,
        blocks=blocks,
        block_ends=block_ends,
    )

    def block(number):
        return _ragged_block(number, size, padded, tokens, seq_of, options)

    def step(carry):
        first, out = carry
        rows, values = jax.vmap(block)(first + jnp.arange(at_once))
        out = out.at[rows.reshape(-1)].set(values.reshape(-1, heads, dim), mode="drop")
        return first + at_once, out

    _, out = jax.lax.while_loop(
        lambda carry: carry[0] < block_ends[-1], step, (jnp.int32(0), jnp.zeros_like(q))
    )
    return out


def _query_block(tokens: int, seqs: int) -> int:
    """Queries a block takes: the mean a sequence has where the batch is full (``tokens`` over
    ``seqs``), as a power of two from 16 to 128. A block reads its sequence's keys once, so a
    long prefill wants large blocks; a decode step's sequences have one query each, and each of
    their blocks computes all its rows."""
    mean = max(1, tokens // max(1, seqs))
    return min(_LARGEST_BLOCK, max(_SMALLEST_BLOCK, 1 << (mean.bit_length() - 1)))


def _ragged_block(number, size: int, q, tokens: int, seq: dict, options: dict):
    """Block ``number`` of all live sequences' query blocks of ``size``: (the rows of the output
    it writes, ``tokens`` for rows it does not, [size]; its output [size, heads, dim])."""
    s = jnp.minimum(
        jnp.searchsorted(seq["block_ends"], number, side="right"), len(seq["blocks"]) - 1
    )
    within = number - (seq["block_ends"][s] - seq["blocks"][s])
    start = seq["cu_q_lens"][s] + within * size
    rows = start + jnp.arange(size, dtype=jnp.int32)
    written = (rows < seq["cu_q_lens"][s + 1]) & (number < seq["block_ends"][-1])
    queries = jax.lax.dynamic_slice_in_dim(q, start, size)
    kv_len = seq["kv_lens"][s]
    positions = kv_len - seq["query_lens"][s] + within * size + jnp.arange(size)
    out = _attend_sequence(
        queries, seq["kv_pages"], seq["page_indices"][s], kv_len, positions, **options
    )
    return jnp.where(written, rows, tokens), out


def _attend_sequence(q, kv_pages, pages, kv_len, positions, *, k_scale, v_scale, **options):
    """``_attend`` over one sequence's ``pages`` of a combined cache (keys at even heads,
    values at odd; an fp8 cache scaled into the queries' dtype)."""
    _, _, combined, dim = kv_pages.shape
    kv = kv_pages[pages].reshape(-1, combined, dim)
    k = _dequantized(kv[:, 0::2], k_scale, q.dtype)
    v = _dequantized(kv[:, 1::2], v_scale, q.dtype)
    return _attend(q, k, v, kv_len, positions, **options)


def _dequantized(pages, scale, dtype):
    """An fp8 cache's keys or values in the queries' dtype (``scale``: the cache's scale)."""
    if scale is None:
        return pages
    return (pages.astype(jnp.float32) * scale).astype(dtype)
