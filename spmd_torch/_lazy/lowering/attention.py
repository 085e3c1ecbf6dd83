"""Lowerings: attention as one op each way, ``_scaled_dot_product_fused_attention_overrideable``
and its backward, each lowered to the best implementation the program's platform has.

``choose`` picks it when the program is traced, from the platform, dtype, shapes, mask kind and
dropout, which forward and backward share, so both halves of one attention use one implementation:

- ``cudnn``: cuDNN flash attention (``jax.nn.dot_product_attention(implementation='cudnn')``) on
  NVIDIA GPUs, for bf16/fp16 without a mask tensor or dropout, head dims a multiple of 8 up to 128,
  causal only for square attention (where cuDNN's diagonal is PyTorch's);
- ``pallas``: the Pallas flash kernel on TPU, without dropout, sequence lengths a multiple of 128
  (grouped key/value heads are repeated); a float mask shaped like the scores becomes its ``ab``
  (a mask that broadcasts would have to be made whole: it takes the blockwise form);
- ``plain``: the scores materialised and softmaxed whole, which XLA fuses: up to
  ``PLAIN_MAX_KEYS`` keys on CPU, where it is as fast as the blockwise form or faster;
- ``blockwise``: everywhere else, an online softmax over blocks of ``BLOCK`` keys (``lax.scan``)
  that saves the log-sum-exp; the backward recomputes each block's probabilities from it, so memory
  grows linearly with the sequence. Where the mask is a band of positions (causal, a sliding
  window) the queries are cut into tiles too and the tiles outside the band are never computed.
  ``plain`` is the same code with one block, called once (no loop).

``custom_kernel.flash_attention`` with ``ab`` or segment ids (packed sequences) is an op of our
own, ``xla::flash_kernel_attention`` and its backward: the Pallas kernel takes both as they are,
and the blockwise and plain forms build each key block's mask from the ids (``BlockMask``).

Where XLA's partitioner splits the program (SPMD), either fused kernel is a ``custom_partitioning``
op with a rule of ours, split over batch and heads, each device running the kernel on its own
shards (``_split_kernel``).

The forward's second result is the float32 log-sum-exp of the scaled, masked scores, less a float
mask's largest value in each row (see ``_Problem``; the Pallas kernel's, its largest seen value):
the blockwise and pallas backwards start from it and the output, the cudnn backward
differentiates its kernel (``jax.vjp``: its forward runs again). Rows with every key masked
(``-inf``) give zeros, as PyTorch's ``_safe_softmax``. Dropout draws one mask per key block from
the node's PRNG key, which the forward returns bit-cast into ``philox_seed`` for the backward to
draw the same masks again. Each lowering bumps ``Attention::<impl>`` (forward) or
``AttentionBackward::<impl>``: the metrics count programs compiled with each implementation.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import math
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend import backend as jax_backend
from jax.sharding import NamedSharding, PartitionSpec

from .. import counters
from ._helpers import traced_once
from .linalg import accumulation_dtype, precision
from .random import draw_dtype, wrap_key
from .registry import lowers

aten = torch.ops.aten

BLOCK = 128  # keys per block of the blockwise form
Q_BLOCK = 256  # queries per tile where the blockwise form skips tiles outside a band
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # the Pallas kernel's, for segment ids
PLAIN_MAX_KEYS = 384  # on CPU, up to this many keys plain attention is as fast or faster
_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_CUDNN_MAX_HEAD_DIM = 128  # 256 on Hopper, which a pure choice does not know: the lower bound
_PALLAS_BLOCK = 128  # the TPU kernel's default block along each sequence


def choose(
    platform: str,
    dtype: object,
    q_shape: tuple,
    k_shape: tuple,
    v_shape: tuple,
    mask: str | None,
    causal: bool,
    dropout: bool,
    has_pallas: bool = True,
) -> str:
    """The implementation of one attention: ``cudnn``, ``pallas``, ``blockwise`` or ``plain``.

    ``platform`` is ``cuda``/``gpu``, ``rocm``, ``tpu`` or ``cpu``; ``mask`` is None, ``'bool'``,
    ``'float'``, ``'scores'`` (a float mask shaped like the scores) or ``'segments'`` (segment
    ids): the Pallas kernel takes the last two as they are; ``q_shape`` is (batch, heads, q_len,
    head_dim), ``k_shape``/``v_shape`` are (batch, kv_heads, kv_len, head_dim). A pure function of its arguments: forward and backward
    ask it the same question and get the same answer."""
    q_len, head_dim = q_shape[-2], q_shape[-1]
    kv_len, v_head_dim = k_shape[-2], v_shape[-1]
    fused = mask is None and not dropout and head_dim == v_head_dim
    pallas = mask in (None, "scores", "segments") and not dropout and head_dim == v_head_dim
    if (
        platform in ("cuda", "gpu")
        and fused
        and jnp.dtype(dtype) in _CUDNN_DTYPES
        and head_dim % 8 == 0
        and head_dim <= _CUDNN_MAX_HEAD_DIM
        and (not causal or q_len == kv_len)
    ):
        return "cudnn"
    if (
        platform == "tpu"
        and has_pallas
        and pallas
        and q_len % _PALLAS_BLOCK == 0
        and kv_len % _PALLAS_BLOCK == 0
    ):
        return "pallas"
    if platform == "cpu" and kv_len <= PLAIN_MAX_KEYS:
        return "plain"
    return "blockwise"


# Whether the program being traced is split by XLA's partitioner over several devices (SPMD),
# outside its manual regions: set by compile while it traces one. A fused kernel is a custom call
# the partitioner cannot split by itself (the Pallas kernel would run on inputs gathered on every
# device), so there it is an op with a rule that tells how (``_split_kernel``); inside a manual
# region each device runs it on its own shards as it is.
_PARTITIONED = contextvars.ContextVar("attention_partitioned", default=False)


@contextlib.contextmanager
def partitioned(value: bool):
    """Trace attention as in a program the partitioner splits (``value``) or not."""
    token = _PARTITIONED.set(value)
    try:
        yield
    finally:
        _PARTITIONED.reset(token)


def _platform() -> str:
    """The platform programs compile for; a GPU named by its vendor (cuDNN is NVIDIA's)."""
    backend = jax.default_backend()
    if backend == "gpu":
        version = jax_backend.get_backend().platform_version.lower()
        return "rocm" if "rocm" in version else "cuda"
    return backend


def _flash():
    """JAX's Pallas TPU flash attention module, or None where this JAX has none. Its
    residual-saving forward and its backward from those residuals are private
    (``_flash_attention``, ``_flash_attention_bwd``), as PyTorch/XLA calls them: the public
    function differentiated runs the forward kernel twice."""
    try:
        from jax.experimental.pallas.ops.tpu import flash_attention
    except ImportError:
        return None
    return flash_attention


def _mask_kind(bias, q, k) -> str | None:
    """None, ``'bool'``, ``'scores'`` (a float mask as large as the scores, which the Pallas
    kernel takes as its ``ab``) or ``'float'`` (one that broadcasts)."""
    if bias is None:
        return None
    if bias.dtype == jnp.bool_:
        return "bool"
    return "scores" if bias.shape == (*q.shape[:3], k.shape[2]) else "float"


def _implementation(q, k, v, mask: str | None, causal: bool, dropout_p: float) -> str:
    """``choose``'s answer for this program's platform and these arrays."""
    platform = _platform()
    return choose(
        platform,
        q.dtype,
        q.shape,
        k.shape,
        v.shape,
        mask,
        causal,
        dropout_p > 0,
        has_pallas=platform != "tpu" or _flash() is not None,
    )


# --- the blockwise form (plain: one block) --------------------------------------------------------


class _Problem:
    """One attention in grouped form: q (B, Hk, G, L, E) against k/v (B, Hk, S, E), float32 or
    wider; the mask as a (b, h, g, l, s) array broadcasting against the scores, less its largest
    value per row (``shift``: a row masked by a huge finite value keeps its log-sum-exp, which
    that value would otherwise swallow); the keys padded to whole blocks.

    The loops run over ``tiles``, (query tile, key block) pairs. Where the mask is a band of
    positions (causal, a window) whose outside adds exactly nothing, the queries are cut into
    tiles of ``Q_BLOCK`` (padded to whole tiles) and the pairs wholly outside the band are left
    out: causal attention computes about half the scores. Where it is segment ids known only at
    run time (``skips_unseen``), the queries are cut so too and a pair none of whose queries sees
    any of its keys is skipped when the program runs (``unless_unseen``). Otherwise one tile
    holds every query and every key block is visited."""

    def __init__(
        self, q, k, v, bias, causal: bool, scale: float, dropout_p: float, key, block, soft_cap
    ):
        batch, heads, self.q_len, _ = q.shape
        kv_heads, self.kv_len = k.shape[1], k.shape[2]
        self.group = heads // kv_heads
        self.wide = jnp.promote_types(accumulation_dtype(q.dtype) or q.dtype, jnp.float32)
        self.scale, self.causal, self.dropout_p, self.key = scale, causal, dropout_p, key
        self.soft_cap = soft_cap
        self.block = min(block, self.kv_len)
        blocks = -(-self.kv_len // self.block)
        padding = blocks * self.block - self.kv_len
        band = _band(bias, causal, self.q_len, self.kv_len)
        self.skips_unseen = band is None and isinstance(bias, BlockMask) and bias.q is not None
        tiled = band or self.skips_unseen
        self.q_block = Q_BLOCK if tiled and blocks > 1 and self.q_len > Q_BLOCK else self.q_len
        self.q_tiles = -(-self.q_len // self.q_block)
        self.rows = self.q_tiles * self.q_block  # the queries padded to whole tiles
        self.tiles = _visible_tiles(self, blocks, band)
        q = q.astype(self.wide).reshape(batch, kv_heads, self.group, self.q_len, -1)
        self.q = self.pad_rows(q)
        self.k = _pad_end(k.astype(self.wide), padding, axis=2)
        self.v = _pad_end(v.astype(self.wide), padding, axis=2)
        self.bias = None if bias is None else _grouped_bias(bias, heads, kv_heads, self.group)
        self.shift = None
        if isinstance(bias, BlockMask):
            self.shift = bias.shift(self.kv_len).astype(self.wide)
        elif self.bias is not None and self.bias.dtype != jnp.bool_:
            top = self.bias.max(-1, keepdims=True).astype(self.wide)
            self.shift = jnp.where(top == -jnp.inf, 0, top)
        if self.shift is not None:
            self.shift = self.pad_rows(self.shift)
        if isinstance(self.bias, BlockMask):
            self.bias = self.bias.padded(padding, self.rows - self.q_len)
        elif self.bias is not None:
            if self.bias.shape[-1] != 1:
                self.bias = _pad_end(self.bias, padding, axis=4)
            self.bias = self.pad_rows(self.bias)
        self.padded = padding > 0

    def pad_rows(self, x):
        """``x`` (..., L, ...) along axis 3 padded to whole query tiles; one that broadcasts
        along it (size 1) as it is."""
        return x if x.shape[3] == 1 else _pad_end(x, self.rows - self.q_len, axis=3)

    def unpad_rows(self, x):
        return x if self.rows == self.q_len else lax.slice_in_dim(x, 0, self.q_len, axis=3)

    def queries(self, i):
        """Query tile ``i``: its first index and queries."""
        first = i * self.q_block
        return first, _tile(self.q, first, self.q_block, axis=3)

    def keys(self, j):
        """Key block ``j``: its first index, keys and values."""
        start = j * self.block
        k = lax.dynamic_slice_in_dim(self.k, start, self.block, axis=2)
        v = lax.dynamic_slice_in_dim(self.v, start, self.block, axis=2)
        return start, k, v

    def bias_tile(self, first, start):
        """The mask of the queries from ``first`` against the key block from ``start``."""
        if isinstance(self.bias, BlockMask):
            return self.bias.block(first, self.q_block, start, self.block)
        if self.bias is None:
            return None
        bias = _tile(self.bias, first, self.q_block, axis=3)
        return bias if bias.shape[-1] == 1 else _tile(bias, start, self.block, axis=4)

    def logits(self, q, k):
        """The scaled scores of queries ``q`` against keys ``k`` (B, Hk, G, l, block),
        soft-capped (``cap * tanh(s / cap)``) where there is a cap."""
        s = jnp.einsum("bhgle,bhse->bhgls", q, k, precision=precision()) * self.scale
        return s if self.soft_cap is None else jnp.tanh(s / self.soft_cap) * self.soft_cap

    def uncapped(self, ds, logits):
        """The gradient of the scores before the soft cap, from theirs after it (``ds``)."""
        return ds if self.soft_cap is None else ds * (1 - jnp.square(logits / self.soft_cap))

    def scores(self, first, start, logits):
        """The biased and masked scores of the query tile from ``first`` against the key block
        from ``start``, from their ``logits``."""
        s = logits
        bias = self.bias_tile(first, start)
        if bias is not None and bias.dtype == jnp.bool_:
            s = jnp.where(bias, s, -jnp.inf)
        elif bias is not None:
            s = s + bias.astype(s.dtype) - _tile(self.shift, first, self.q_block, axis=3)
        shape = (self.q_block, self.block)
        cols = start + lax.broadcasted_iota(jnp.int32, shape, 1)
        visible = None
        if self.causal:
            visible = cols <= first + lax.broadcasted_iota(jnp.int32, shape, 0)
        if self.padded:
            inside = cols < self.kv_len
            visible = inside if visible is None else visible & inside
        return s if visible is None else jnp.where(visible, s, -jnp.inf)

    def unless_unseen(self, step):
        """``step``, made to leave the carry as it is on a tile none of whose queries sees any
        of its keys, where each of those queries sees a key elsewhere (a query that sees none
        averages every key, so each tile counts for it). Only for segment ids read at run time:
        the comparison of ids costs little beside the tile's products."""
        if not self.skips_unseen or self.q_block == self.q_len:
            return step

        def unless(carry, tile):
            _, i, j = tile
            first, start = i * self.q_block, j * self.block
            seen = self.bias.seen(start, self.block, first, self.q_block).any()
            everywhere_blind = _tile(self.shift, first, self.q_block, axis=3) != 0
            needed = seen | everywhere_blind.any()
            return lax.cond(needed, step, lambda carry, tile: carry, carry, tile)

        return unless

    def kept(self, t, shape):
        """Tile ``t``'s dropout factors (0 or 1 / (1 - p)), or None without dropout."""
        if not self.dropout_p:
            return None
        # Drawn flat: XLA:CPU takes up to tens of seconds to compile a 5-d draw; a flat one
        # compiles in a fraction of a second and shards alike.
        flat = (math.prod(shape),)
        rate = jnp.asarray(1 - self.dropout_p, draw_dtype(self.wide))
        keep = jax.random.bernoulli(jax.random.fold_in(self.key, t), rate, flat)
        return keep.reshape(shape).astype(self.wide) / (1 - self.dropout_p)


def _band(bias, causal: bool, q_len: int, kv_len: int) -> tuple | None:
    """(lowest, highest) key-minus-query offset a query may see, where the mask is that band of
    positions and nothing outside it adds to any query's attention; None otherwise.

    Causal masking by ``-inf`` is such a band. A ``BlockMask`` gives unseen scores a finite
    value, so a query that sees no key averages every key: its band's outside is nothing only
    where every query sees a key, its own (``sees_itself``) or, without segment ids, one in the
    band."""
    if isinstance(bias, BlockMask) and (bias.q is None or bias.sees_itself):
        window = math.inf if bias.window is None else bias.window
        lowest, highest = -window, min(0 if bias.causal else math.inf, window)
        every_query_sees_a_key = bias.sees_itself or q_len - 1 + lowest <= kv_len - 1
        bounded = lowest > -math.inf or highest < math.inf
        return (lowest, highest) if bounded and every_query_sees_a_key else None
    if causal and not isinstance(bias, BlockMask):
        return (-math.inf, 0)
    return None


def _visible_tiles(p: _Problem, blocks: int, band: tuple | None):
    """(tile index, query tile, key block) of every pair with a query and key in ``band`` (every
    pair without one), as an int32 array (pairs, 3); the tile index numbers dropout's draws."""
    rows, cols = np.meshgrid(np.arange(p.q_tiles), np.arange(blocks), indexing="ij")
    index = rows * blocks + cols
    if band is not None:
        first, last = rows * p.q_block, np.minimum((rows + 1) * p.q_block, p.q_len) - 1
        start, end = cols * p.block, np.minimum((cols + 1) * p.block, p.kv_len) - 1
        inside = (start - last <= band[1]) & (end - first >= band[0])
        rows, cols, index = rows[inside], cols[inside], index[inside]
    return np.stack([index.ravel(), rows.ravel(), cols.ravel()], axis=1).astype(np.int32)


def _tile(x, first, size: int, axis: int):
    """``size`` entries of ``x`` from ``first`` along ``axis``; ``x`` itself where that is all of
    it or it broadcasts there."""
    if x.shape[axis] in (1, size):
        return x
    return lax.dynamic_slice_in_dim(x, first, size, axis=axis)


def _add_at(x, update, starts: tuple):
    """``x`` with ``update`` added to its entries from ``starts``."""
    if x.shape == update.shape:
        return x + update
    starts = tuple(jnp.asarray(n, jnp.int32) for n in starts)  # one index type, under x64 too
    current = lax.dynamic_slice(x, starts, update.shape)
    return lax.dynamic_update_slice(x, current + update, starts)


def _put_tile(x, update, first, axis: int):
    """``x`` with ``update`` written over its entries from ``first`` along ``axis``."""
    if x.shape[axis] == update.shape[axis]:
        return update
    return lax.dynamic_update_slice_in_dim(x, update, first, axis=axis)


@partial(
    jax.tree_util.register_dataclass,
    data_fields=("q", "kv"),
    meta_fields=("q_len", "causal", "window", "sees_itself"),
)
@dataclasses.dataclass(frozen=True)
class BlockMask:
    """A mask built one tile at a time (never whole), from segment ids and positions: query
    ``i`` sees key ``j`` where their ids are equal (where there are ids), ``j <= i`` when
    ``causal``, and ``|i - j| <= window`` where there is a window. An unseen score gets
    ``MASK_VALUE``, finite as in the Pallas kernels, so a query that sees no key averages them
    all. ``q`` is (B, L), ``kv`` (B, S), int32, or both None; ``q_len`` is L. ``sees_itself``:
    query ``i`` and key ``i`` share their id (self-attention with one set of ids), so every
    query sees a key, its own."""

    q: jax.Array | None
    kv: jax.Array | None
    q_len: int
    causal: bool = False
    window: int | None = None
    sees_itself: bool = False

    def seen(self, start, size: int, first=0, rows: int | None = None):
        """(B or 1, rows, size): which of ``size`` keys from ``start`` each of ``rows`` queries
        from ``first`` (all of them by default) sees."""
        rows = self.q_len if rows is None else rows
        shape = (rows, size)
        query = first + lax.broadcasted_iota(jnp.int32, shape, 0)
        key = start + lax.broadcasted_iota(jnp.int32, shape, 1)
        seen = jnp.ones((1, *shape), bool)
        if self.q is not None:
            q = _tile(self.q, first, rows, axis=1)
            kv = lax.dynamic_slice_in_dim(self.kv, start, size, axis=1)
            seen = q[:, :, None] == kv[:, None, :]
        if self.causal:
            seen = seen & (key <= query)
        if self.window is not None:
            seen = seen & (jnp.abs(query - key) <= self.window)
        return seen

    def block(self, first, rows: int, start, size: int):
        """The mask of ``rows`` queries from ``first`` against ``size`` keys from ``start``,
        broadcasting against (B, Hk, G, rows, size)."""
        return jnp.where(self.seen(start, size, first, rows), 0.0, MASK_VALUE)[:, None, None]

    def shift(self, kv_len: int):
        """The mask's largest value in each row (0 or ``MASK_VALUE``), as ``_Problem`` keeps."""
        seen = self.seen(0, kv_len).any(-1)
        return jnp.where(seen, 0.0, MASK_VALUE)[:, None, None, :, None]

    def padded(self, padding: int, query_padding: int = 0) -> BlockMask:
        """Keys added past the last (the blockwise form masks them by position), and queries
        (whose rows it drops)."""
        if self.q is None:
            return self
        q = _pad_end(self.q, query_padding, axis=1)
        return dataclasses.replace(self, q=q, kv=_pad_end(self.kv, padding, axis=1))


def _pad_end(x, padding: int, axis: int):
    """``x`` with ``padding`` zeros (False) after its last entry along ``axis``."""
    if not padding:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, padding)
    return jnp.pad(x, widths)


def _grouped_bias(bias, heads: int, kv_heads: int, group: int):
    """A mask broadcasting against (B, H, L, S), reshaped to broadcast against (B, Hk, G, L, S)."""
    if isinstance(bias, BlockMask):
        return bias
    bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    b, h, q_len, kv_len = bias.shape
    if h == heads and group > 1:
        return bias.reshape(b, kv_heads, group, q_len, kv_len)
    return bias.reshape(b, h, 1, q_len, kv_len)


def _over_tiles(step, init, tiles):
    """``lax.scan(step, init, tiles)``, the carry alone; one tile (plain attention) is one call,
    no loop: JAX keeps a one-trip loop, which XLA then has to take apart at every attention."""
    if len(tiles) > 1:
        return lax.scan(lambda carry, tile: (step(carry, tile), None), init, jnp.asarray(tiles))[0]
    return step(init, tuple(int(n) for n in tiles[0]))


def blockwise_forward(q, k, v, bias, causal, scale, dropout_p, key, block, soft_cap=None):
    """(output (B, H, L, Ev), log-sum-exp (B, H, L)) by an online softmax over key blocks."""
    p = _Problem(q, k, v, bias, causal, scale, dropout_p, key, block, soft_cap)
    rows = p.q.shape[:-1]

    def step(carry, tile):
        top, total, acc = carry
        t, i, j = tile
        first, qi = p.queries(i)
        start, kj, vj = p.keys(j)
        s = p.scores(first, start, p.logits(qi, kj))
        top_i, total_i, acc_i = (_tile(x, first, p.q_block, axis=3) for x in carry)
        new_top = jnp.maximum(top_i, s.max(-1))
        safe_top = jnp.where(new_top == -jnp.inf, 0, new_top)
        probs = jnp.exp(s - safe_top[..., None])
        rescale = jnp.exp(top_i - safe_top)
        total_i = rescale * total_i + probs.sum(-1)
        kept = p.kept(t, probs.shape)
        dropped = probs if kept is None else probs * kept
        update = jnp.einsum("bhgls,bhse->bhgle", dropped, vj, precision=precision())
        acc_i = rescale[..., None] * acc_i + update
        updated = zip((top, total, acc), (new_top, total_i, acc_i))
        return tuple(_put_tile(x, x_i, first, axis=3) for x, x_i in updated)

    start = (
        jnp.full(rows, -jnp.inf, p.wide),
        jnp.zeros(rows, p.wide),
        jnp.zeros(rows + (v.shape[-1],), p.wide),
    )
    top, total, acc = (p.unpad_rows(x) for x in _over_tiles(p.unless_unseen(step), start, p.tiles))
    empty = total == 0  # every key masked: zeros, as PyTorch's _safe_softmax
    out = jnp.where(empty[..., None], 0, acc / jnp.where(empty, 1, total)[..., None])
    lse = jnp.where(empty, -jnp.inf, top + jnp.log(jnp.where(empty, 1, total)))
    batch, heads = q.shape[:2]
    return out.reshape(batch, heads, p.q_len, -1), lse.reshape(batch, heads, p.q_len)


def blockwise_backward(
    grad, q, k, v, bias, out, lse, causal, scale, dropout_p, key, block, bias_grad, soft_cap=None
):
    """(dq, dk, dv, dbias or None): each tile's probabilities recomputed from ``lse``."""
    p = _Problem(q, k, v, bias, causal, scale, dropout_p, key, block, soft_cap)
    grouped = p.q.shape[:3] + (p.q_len,)
    grad = p.pad_rows(grad.astype(p.wide).reshape(grouped + (-1,)))
    lse = lse.astype(p.wide).reshape(grouped)
    safe_lse = p.pad_rows(jnp.where(lse == -jnp.inf, 0, lse))
    delta = (grad * p.pad_rows(out.astype(p.wide).reshape(grouped + (-1,)))).sum(-1)
    bias_grad = bias_grad and isinstance(p.bias, jax.Array) and p.bias.dtype != jnp.bool_

    def step(carry, tile):
        dq, dk, dv, dbias = carry
        t, i, j = tile
        first, qi = p.queries(i)
        start, kj, vj = p.keys(j)
        grad_i = _tile(grad, first, p.q_block, axis=3)
        logits = p.logits(qi, kj)
        lse_i = _tile(safe_lse, first, p.q_block, axis=3)
        probs = jnp.exp(p.scores(first, start, logits) - lse_i[..., None])
        kept = p.kept(t, probs.shape)
        dropped = probs if kept is None else probs * kept
        dv_j = jnp.einsum("bhgls,bhgle->bhse", dropped, grad_i, precision=precision())
        dprobs = jnp.einsum("bhgle,bhse->bhgls", grad_i, vj, precision=precision())
        if kept is not None:
            dprobs = dprobs * kept
        ds = probs * (dprobs - _tile(delta, first, p.q_block, axis=3)[..., None])
        dlogits = p.uncapped(ds, logits)
        dq_i = jnp.einsum("bhgls,bhse->bhgle", dlogits, kj, precision=precision()) * p.scale
        dk_j = jnp.einsum("bhgls,bhgle->bhse", dlogits, qi, precision=precision()) * p.scale
        dq = _add_at(dq, dq_i, (0, 0, 0, first, 0))
        dk = _add_at(dk, dk_j, (0, 0, start, 0))
        dv = _add_at(dv, dv_j, (0, 0, start, 0))
        if bias_grad:
            reduced = _sum_to(ds, tuple(1 if n == 1 else m for n, m in zip(dbias.shape, ds.shape)))
            at = (first if dbias.shape[3] > 1 else 0, start if dbias.shape[4] > 1 else 0)
            dbias = _add_at(dbias, reduced, (0, 0, 0, *at))
        return dq, dk, dv, dbias

    dbias = jnp.zeros(p.bias.shape, p.wide) if bias_grad else None
    init = (jnp.zeros_like(p.q), jnp.zeros_like(p.k), jnp.zeros_like(p.v), dbias)
    dq, dk, dv, dbias = _over_tiles(p.unless_unseen(step), init, p.tiles)
    dk, dv = (lax.slice_in_dim(x, 0, p.kv_len, axis=2) for x in (dk, dv))
    if dbias is not None:
        dbias = lax.slice_in_dim(dbias, 0, min(dbias.shape[4], p.kv_len), axis=4)
        dbias = p.unpad_rows(dbias).reshape(bias.shape)
    return p.unpad_rows(dq).reshape(q.shape), dk, dv, dbias


def _differentiable_blockwise(causal: bool, scale: float, dropout_p: float, soft_cap=None):
    """The blockwise forward as a function of (q, k, v, mask, key) whose JAX derivative is the
    blockwise backward. Outside a loop nothing differentiates it (autograd records the backward
    op); inside a scan's body JAX does, and would otherwise keep every key block's
    probabilities for the backward (B·H·L·S values per layer): this way it keeps q, k, v, the
    mask, the key's words (with dropout), the output and the log-sum-exp. The log-sum-exp's cotangent is dropped, as ATen marks
    it non-differentiable."""

    @jax.custom_vjp
    def attend(q, k, v, bias, words):
        key = None if words is None else wrap_key(words)
        return blockwise_forward(q, k, v, bias, causal, scale, dropout_p, key, BLOCK, soft_cap)

    def forward(q, k, v, bias, words):
        out, lse = attend(q, k, v, bias, words)
        return (out, lse), (q, k, v, bias, words, out, lse)

    def backward(saved, cotangents):
        q, k, v, bias, words, out, lse = saved
        key = None if words is None else wrap_key(words)
        dq, dk, dv, dbias = blockwise_backward(
            cotangents[0],
            q,
            k,
            v,
            bias,
            out,
            lse,
            causal,
            scale,
            dropout_p,
            key,
            BLOCK,
            True,
            soft_cap,
        )
        dtypes = [x.dtype for x in (q, k, v)]
        dq, dk, dv = (g.astype(d) for g, d in zip((dq, dk, dv), dtypes))
        return dq, dk, dv, None if dbias is None else dbias.astype(bias.dtype), None

    attend.defvjp(forward, backward)
    return attend


@traced_once
def _blockwise_attend(
    q, k, v, bias, words, causal: bool, scale: float, dropout_p: float, soft_cap=None
):
    return _differentiable_blockwise(causal, scale, dropout_p, soft_cap)(q, k, v, bias, words)


# Every layer's attention is the same trace: JAX traces each form once per shapes and arguments.
_traced_forward = traced_once(blockwise_forward)
_traced_backward = traced_once(blockwise_backward)


def in_blocks(impl: str, q, k, v, mask, causal: bool, scale: float, *, soft_cap=None, **dropout):
    """(output, log-sum-exp) of the ``blockwise`` or ``plain`` form; with ``dropout_p`` and
    ``key`` given, dropout. The blockwise form goes through its differentiable wrapper, since a
    scan's body differentiates it (``_differentiable_blockwise``)."""
    dropout_p, key = dropout.get("dropout_p", 0.0), dropout.get("key")
    if impl == "blockwise":
        words = jax.random.key_data(key) if dropout_p else None  # a residual must be an array
        return _blockwise_attend(q, k, v, mask, words, causal, scale, dropout_p, soft_cap)
    block = _block(impl, k)
    return _traced_forward(q, k, v, mask, causal, scale, dropout_p, key, block, soft_cap)


def _sum_to(x, shape: tuple):
    """``x`` summed over the axes where ``shape`` is 1 (a broadcast operand's gradient)."""
    axes = tuple(i for i, (n, m) in enumerate(zip(x.shape, shape)) if m == 1 and n != 1)
    return x.sum(axes, keepdims=True) if axes else x


# --- the fused kernels --------------------------------------------------------------------------


def _cudnn(q, k, v, causal: bool, scale: float, window: int | None = None):
    """cuDNN flash attention on (B, H, L, E) arrays: (output, log-sum-exp). With ``window``
    (causal only, as cuDNN takes it) query ``i`` sees keys ``i - window`` to ``i``."""
    return _fused("cudnn", q, k, v, causal, scale, window=window)


def _cudnn_here(q, k, v, causal: bool, scale: float, window: int | None = None) -> tuple:
    out, lse = jax.nn.dot_product_attention(
        *(x.transpose(0, 2, 1, 3) for x in (q, k, v)),  # JAX's layout: (B, L, H, E)
        scale=scale,
        is_causal=causal,
        local_window_size=None if window is None else (window, 0),
        implementation="cudnn",
        return_residual=True,
    )
    return out.transpose(0, 2, 1, 3), lse.transpose(0, 2, 1)


def _pallas(q, k, v, causal: bool, scale: float, *extras, named: tuple = ()) -> tuple:
    """The Pallas TPU flash kernel's results on (B, H, L, E) arrays, key/value heads repeated per
    group: (output, shift, sum), the softmax's residuals (B, H, L) (its probabilities are
    ``exp(s - shift) / sum``), for ``_pallas_backward``. ``extras`` are the kernel's optional
    operands ``named`` (``_EXTRAS``):
    ``"ab"``, a (B, H, L, S) bias added to the scores before ``scale``; ``"segments"``, the
    queries' and keys' segment ids (B, L) and (B, S), int32."""
    k, v = _repeated(q, k, v)
    return _fused("pallas", q, k, v, causal, scale, *extras, named=named)


def _repeated(q, k, v) -> tuple:
    """k and v with each key/value head repeated for its group of query heads."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    return k, v


def _pallas_backward(q, k, v, *rest, causal: bool, scale: float, named: tuple = ()) -> tuple:
    """(dq, dk, dv, and dab with an ``ab``) of ``_pallas`` from (*extras, output, shift, sum,
    cotangent) ``rest``, by the kernel's backward from the forward's residuals: its forward does
    not run again. Grouped heads' gradients are summed over their group."""
    group = q.shape[1] // k.shape[1]
    repeated = _repeated(q, k, v)
    if _PARTITIONED.get():
        grads = _split_backward(causal, scale, named)(q, *repeated, *rest)
    else:
        grads = _pallas_backward_here(q, *repeated, *rest, causal=causal, scale=scale, named=named)
    dq, dk, dv, *dab = grads
    if group > 1:
        dk, dv = (g.reshape(k.shape[0], k.shape[1], group, *g.shape[2:]).sum(2) for g in (dk, dv))
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), *dab


def _block_sizes(q, k):
    batch, heads, q_len, head_dim = q.shape
    return _flash().BlockSizes.get_default(batch, heads, q_len, k.shape[2], head_dim)


def _given(named: tuple, extras: tuple) -> tuple:
    """(ab or None, SegmentIds or None) from the kernel's optional operands."""
    given = dict(zip(_flat_names(named), extras))
    ids = _flash().SegmentIds(given["q_ids"], given["kv_ids"]) if "q_ids" in given else None
    return given.get("ab"), ids


def _pallas_forward_here(q, k, v, *extras, causal: bool, scale: float, named: tuple) -> tuple:
    """(output, shift, sum): the kernel's residual-saving form, its residuals ``m`` and ``l``."""
    with jax.enable_x64(False):
        out, total, top = _flash()._flash_attention(
            q, k, v, *_given(named, extras), True, causal, scale, _block_sizes(q, k), False
        )
    return out, top, total


def _pallas_backward_here(q, k, v, *rest, causal: bool, scale: float, named: tuple) -> tuple:
    """(dq, dk, dv, and dab with an ``ab``): the kernel's backward from (*extras, output, shift,
    sum, cotangent)."""
    *extras, out, top, total, grad = rest
    ab, ids = _given(named, extras)
    residuals = (q, k, v, ab, ids, out, total.astype(jnp.float32), top.astype(jnp.float32))
    with jax.enable_x64(False):
        grads = _flash()._flash_attention_bwd(
            False, causal, scale, _block_sizes(q, k), False, residuals, grad.astype(out.dtype)
        )
    return grads[: _differentiable(named)]


@cache
def _pallas_kernel(causal: bool, scale: float, named: tuple = ()):
    """The Pallas flash kernel on (q, k, v, *extras ``named``), differentiable in q, k, v and
    ``ab``, traced with 64-bit types off forward and backward wherever JAX traces them. JAX's
    Pallas kernels are written for 32-bit types: under spmd_torch's ``jax_enable_x64`` their grid
    indices become int64 and they fail to trace (the flash kernel's ``lax.select`` of an index
    and a literal 0), and JAX differentiates a scan's body (``scan_layers``) outside any context
    the lowering sets."""
    forward = partial(_pallas_forward_here, causal=causal, scale=scale, named=named)
    backward = partial(_pallas_backward_here, causal=causal, scale=scale, named=named)
    return _from_residuals(forward, backward, _differentiable(named))


def _from_residuals(forward, backward, wrt: int):
    """``forward`` of (q, k, v, *extras) -> (output, shift, sum), differentiable by
    ``backward`` of (*operands, output, shift, sum, cotangent): the first ``wrt`` operands take
    its cotangents, the other extras none."""
    attend = jax.custom_vjp(forward)
    attend.defvjp(
        lambda *args: (results := forward(*args), (*args, *results)),
        lambda saved, cotangents: (
            *backward(*saved, cotangents[0]),
            *(None for _ in saved[wrt:-3]),
        ),
    )
    return attend


def _fused(impl: str, q, k, v, causal: bool, scale: float, *extras, named=(), window=None) -> tuple:
    """Fused kernel ``impl``'s results; on each device's batch and heads where the partitioner
    splits the program. Only the Pallas kernel takes extras, only cuDNN's a window."""
    if _PARTITIONED.get():
        return _split_kernel(impl, causal, scale, named, window)(q, k, v, *extras)
    return _here(impl, q, k, v, causal, scale, *extras, named=named, window=window)


def _here(impl: str, q, k, v, causal: bool, scale: float, *extras, named, window) -> tuple:
    """Fused kernel ``impl``'s results on the arrays as they are."""
    if impl == "cudnn":
        return _cudnn_here(q, k, v, causal, scale, window)
    return _pallas_kernel(causal, scale, named)(q, k, v, *extras)


_QKV = ("b h q d", "b g k d", "b g k d")  # q's, k's and v's dimensions, named as
# ``_split_over_batch_and_heads`` reads them
_EXTRAS = {"ab": {"ab": "b h q k"}, "segments": {"q_ids": "b q", "kv_ids": "b k"}}
# the Pallas kernel's optional operands in the order given, "ab" first (differentiable)
_OUTPUTS = {"cudnn": ("b h q d", "b h q"), "pallas": ("b h q d", "b h q", "b h q")}
# the dimensions of each kernel's results: cuDNN's output and log-sum-exp, the Pallas kernel's
# output and residuals


def _flat_names(named: tuple) -> tuple:
    return tuple(name for extra in named for name in _EXTRAS[extra])


def _extra_dims(named: tuple) -> tuple:
    return tuple(_EXTRAS[extra][name] for extra in named for name in _EXTRAS[extra])


def _differentiable(named: tuple) -> int:
    """How many leading operands take cotangents: q, k, v, and ``ab`` where given."""
    return 4 if "ab" in named else 3


# --- the fused kernels in a program the partitioner splits --------------------------------------
#
# A fused kernel is a custom call, which XLA's partitioner cannot split by itself. JAX gives
# cuDNN's a rule, but that rule reads the operands' layouts as PartitionSpecs over the mesh: it
# raised IndivisibleError while XLA compiled an FSDP step, where Shardy splits a sharded
# projection's output dim into heads and head dim over parts of the mesh axis, which no
# PartitionSpec names. Here each kernel is an op with a rule of ours, which takes any layout;
# inside, each device runs the kernel on its own batch and heads (JAX's rule is not asked there:
# nothing is left to split).


@cache
def _split_kernel(impl: str, causal: bool, scale: float, named=(), window=None):
    """Kernel ``impl`` (``_here``) as an op the partitioner splits over batch and heads,
    differentiable: forward, each device runs it on its shards of q, k, v and the extras
    ``named``; backward, the Pallas kernel's backward from the forward's residuals
    (``_split_backward``), or, for cuDNN's kernel, on those and the output's cotangent,
    differentiating it there (its forward runs again inside: the residuals it saves are the
    kernel's own, which cannot leave the shard's function). Results after the output (the
    log-sum-exp, the residuals) take no cotangent."""
    kernel = partial(_here, impl, named=named, window=window)
    operands = (*_QKV, *_extra_dims(named))
    wrt = _differentiable(named)

    def forward_here(*args):  # positional only: custom_partitioning binds no keywords
        q, k, v, *extras = args
        return kernel(q, k, v, causal, scale, *extras)

    forward = _split_over_batch_and_heads(forward_here, operands, _OUTPUTS[impl])
    if impl == "pallas":
        return _from_residuals(forward, _split_backward(causal, scale, named), wrt)

    def pullback_here(*args):
        *args, cotangent = args
        pull = jax.vjp(lambda *d: forward_here(*d, *args[wrt:])[0], *args[:wrt])[1]
        return pull(cotangent)

    backward = _split_over_batch_and_heads(pullback_here, (*operands, "b h q d"), operands[:wrt])

    def pullback(saved, cotangents):
        return *backward(*saved, cotangents[0]), *(None for _ in saved[wrt:])

    attend = jax.custom_vjp(forward)
    attend.defvjp(lambda *args: (forward(*args), args), pullback)
    return attend


@cache
def _split_backward(causal: bool, scale: float, named: tuple = ()):
    """``_pallas_backward_here`` on (q, k, v, *extras, output, shift, sum, cotangent) as an op
    the partitioner splits over batch and heads."""

    def backward_here(*args):  # positional only, as every operand of a split op
        return _pallas_backward_here(*args, causal=causal, scale=scale, named=named)

    operands = (*_QKV, *_extra_dims(named), *_OUTPUTS["pallas"], "b h q d")
    return _split_over_batch_and_heads(backward_here, operands, operands[: _differentiable(named)])


def _split_over_batch_and_heads(fn, operands: tuple, results: tuple):
    """``fn`` of (q, k, v, ...) as an op the partitioner splits over batch and heads
    (``_layout``), gathering every other dimension where it is split: attention's rows of one
    batch and head never meet another's. ``operands`` and ``results`` name each array's
    dimensions: ``b``, ``h`` (query heads), ``g`` (key/value heads), ``q`` and ``k`` (query and
    key positions), ``d``."""
    split = custom_partitioning(fn)

    def layouts(mesh, arg_shapes) -> tuple:
        batch, heads = _layout(mesh, arg_shapes[0], arg_shapes[1].shape[1])

        def of(dims: str) -> NamedSharding:
            split = {"b": batch, "h": heads, "g": heads}
            return NamedSharding(mesh, PartitionSpec(*(split.get(d) for d in dims.split())))

        return tuple(map(of, operands)), tuple(map(of, results))

    def partition(mesh, arg_shapes, result_shape):
        inputs, outputs = layouts(mesh, arg_shapes)
        return mesh, fn, outputs, inputs

    def infer(mesh, arg_shapes, result_shape):  # the GSPMD partitioner's question (no Shardy)
        return layouts(mesh, arg_shapes)[1]

    split.def_partition(
        partition,
        infer_sharding_from_operands=infer,
        decode_shardings=False,  # a layout over parts of a mesh axis has no PartitionSpec
        sharding_rule=f"{', '.join(operands)} -> {', '.join(results)}",
        need_replication_factors=("q", "d", "k"),  # Shardy's order: as the factors first appear
    )
    return split


def _layout(mesh, query, kv_heads: int) -> tuple:
    """The mesh axes batch and heads are split over (PartitionSpec entries): each mesh axis goes
    to the batch, to the heads (dividing the key/value heads too) or to neither, in the mesh's
    order. The split placing each device's batch and heads where ``query``'s split layout has
    them, where there is one (then nothing moves), else the one splitting most: XLA slices
    replicated operands, and moves others (a layout over parts of a mesh axis, as Shardy gives
    q under FSDP, has no such split)."""
    shape = query.shape
    wanted = None if query.sharding is None else _batch_and_heads(query.sharding, shape)
    sizes = dict(mesh.shape)
    best, most = (None, None), 1
    for roles in itertools.product((0, 1, None), repeat=len(sizes)):
        axes = [tuple(a for a, role in zip(sizes, roles) if role == d) or None for d in (0, 1)]
        parts = [math.prod(sizes[a] for a in group or ()) for group in axes]
        if shape[0] % parts[0] or shape[1] % parts[1] or kv_heads % parts[1]:
            continue
        if wanted is not None and parts[0] * parts[1] > 1:
            layout = NamedSharding(mesh, PartitionSpec(*axes))
            if _batch_and_heads(layout, shape) == wanted:
                return tuple(axes)
        if parts[0] * parts[1] > most:
            best, most = tuple(axes), parts[0] * parts[1]
    return best


def _batch_and_heads(sharding, shape: tuple) -> dict:
    """Each device's slices of the first two dimensions under ``sharding``."""
    return {
        device: tuple((s.start, s.stop) for s in index[:2])
        for device, index in sharding.devices_indices_map(shape).items()
    }


def cudnn_output(causal: bool, scale: float, window: int | None = None):
    """cuDNN's kernel's output as a function of (q, k, v), for ``jax.vjp`` (the Pallas kernel
    has a backward of its own)."""
    return lambda q, k, v: _cudnn(q, k, v, causal, scale, window)[0]


def _pallas_masked(q, k, v, bias, causal: bool, scale: float) -> tuple:
    """(output, log-sum-exp less the mask's largest seen value per row, as ``_Problem`` keeps
    it) of ``q k^T * scale + bias`` through the kernel, which adds its ``ab`` before scaling: the
    queries go in scaled (as PyTorch's own math attention scales them), the bias as it is (no
    division that would take a large negative mask value to ``-inf``). Less that value, the
    log-sum-exp keeps the softmax's sum where a row's mask is huge (``finfo.min`` on every key:
    ``m + log(l) = m`` in float32), so the backward can start from it."""
    ab, alive = _kernel_ab(bias, causal)
    out, top, total = _pallas(_scaled(q, scale), k, v, causal, 1.0, ab, named=("ab",))
    lse = (top - _seen_max(ab, causal)) + jnp.log(total)
    return jnp.where(alive, out, 0).astype(out.dtype), lse


def _pallas_masked_backward(grad, q, k, v, bias, out, lse, causal: bool, scale: float) -> tuple:
    """(dq, dk, dv, dbias) of ``_pallas_masked`` by the kernel's backward from its output and
    log-sum-exp: the forward kernel does not run again. The kernel's residuals (shift, sum) are
    rebuilt as (the mask's largest seen value + ``lse``, rounded; ``exp`` of what rounding
    lost), so ``exp(s - shift) / sum`` are the forward's probabilities even where the shift
    is huge."""
    ab, alive = _kernel_ab(bias, causal)
    grad = jnp.where(alive, grad, 0).astype(grad.dtype)
    largest, lse = _seen_max(ab, causal), lse.astype(jnp.float32)
    shift = largest + lse
    lost = _rounding_error(largest, lse, shift)
    residuals = (out, shift, jnp.exp(lost), grad)
    dq, dk, dv, dab = _pallas_backward(
        _scaled(q, scale), k, v, ab, *residuals, causal=causal, scale=1.0, named=("ab",)
    )
    return (dq * scale).astype(q.dtype), dk, dv, dab.astype(bias.dtype)


def _scaled(q, scale: float):
    return q if scale == 1.0 else (q * scale).astype(q.dtype)


def _seen_max(ab, causal: bool):
    """The largest of the kernel's ``ab`` each query sees, (B, H, L)."""
    if causal:
        ab = jnp.where(jnp.tri(*ab.shape[2:], dtype=bool), ab, MASK_VALUE)
    return ab.max(-1)


def _rounding_error(a, b, total):
    """``a + b - total`` exactly, ``total`` being ``a + b`` rounded (Knuth's two-sum)."""
    b_part = total - a
    return (a - (total - b_part)) + (b - b_part)


def _kernel_ab(bias, causal: bool) -> tuple:
    """(the kernel's ``ab``, which queries see a key): ``-inf`` goes in as ``MASK_VALUE``, since a
    row of them would be NaNs in the kernel, and such a row's output is to be zeros, as in
    PyTorch and the blockwise form (``alive``, (B, H, L, 1), is False there)."""
    seen = bias > -jnp.inf
    if causal:
        seen = seen & jnp.tri(bias.shape[2], bias.shape[3], dtype=bool)
    return jnp.maximum(bias.astype(jnp.float32), MASK_VALUE), seen.any(-1, keepdims=True)


def _scale(q, scale) -> float:
    return 1 / math.sqrt(q.shape[-1]) if scale is None else scale


def _block(impl: str, k) -> int:
    return k.shape[2] if impl == "plain" else BLOCK


def _seed_of(key) -> jax.Array:
    """The PRNG key's two words as the one int64 ``philox_seed`` (high word first), packed by
    shifts, not a bitcast: TPUs run 64-bit integers by rewriting them as 32-bit pairs, and
    XLA's rewrite has no bitcast from 32-bit words to a 64-bit integer."""
    high, low = jax.random.key_data(key).astype(jnp.int64)
    return (high << 32) | low


def _key_of(seed) -> jax.Array:
    """``_seed_of``'s inverse: the key whose words the seed holds."""
    words = jnp.stack([seed >> 32, seed & 0xFFFFFFFF]).astype(jnp.uint32)
    return wrap_key(words)


def _drops_out(args: tuple, kwargs: dict) -> bool:
    """Whether a call draws dropout masks (one without leaves the random stream as it was)."""
    return (args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)) > 0


@lowers(aten._scaled_dot_product_fused_attention_overrideable.default, random=_drops_out)
def _attention(
    key,
    q,
    k,
    v,
    attn_bias=None,
    dropout_p=0.0,
    is_causal=False,
    return_debug_mask=False,
    scale=None,
):
    """(output, log-sum-exp, philox_seed: the PRNG key's words as one int64, philox_offset: 0)."""
    if return_debug_mask:
        raise NotImplementedError(
            "_scaled_dot_product_fused_attention_overrideable: return_debug_mask=True (the "
            "attention probabilities) is not supported on xla"
        )
    impl = _implementation(q, k, v, _mask_kind(attn_bias, q, k), is_causal, dropout_p)
    counters.bump(f"Attention::{impl}")
    scale = _scale(q, scale)
    if impl == "cudnn":
        out, lse = _cudnn(q, k, v, is_causal, scale)
    elif impl == "pallas":
        if attn_bias is None:
            out, top, total = _pallas(q, k, v, is_causal, scale)
            lse = top + jnp.log(total)  # every query sees a key: the sum survives
        else:
            out, lse = _pallas_masked(q, k, v, attn_bias, is_causal, scale)
        lse = lse.astype(jnp.promote_types(q.dtype, jnp.float32))
    else:
        dropout = {"dropout_p": dropout_p, "key": key}
        out, lse = in_blocks(impl, q, k, v, attn_bias, is_causal, scale, **dropout)
    return out, lse, _seed_of(key), jnp.zeros((), jnp.int64)


@lowers(aten._scaled_dot_product_fused_attention_overrideable_backward.default)
def _attention_backward(
    grad,
    q,
    k,
    v,
    attn_bias,
    grad_input_mask,
    out,
    lse,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    philox_seed,
    philox_offset,
    scale=None,
):
    """(dq, dk, dv, dbias: zeros where the mask needs none) with the forward's implementation."""
    impl = _implementation(q, k, v, _mask_kind(attn_bias, q, k), is_causal, dropout_p)
    counters.bump(f"AttentionBackward::{impl}")
    scale = _scale(q, scale)
    if impl == "pallas" and attn_bias is None:
        lse = lse.astype(jnp.float32)
        residuals = (out, lse, jnp.ones_like(lse))  # exp(s - lse) / 1: the same probabilities
        return *_pallas_backward(q, k, v, *residuals, grad, causal=is_causal, scale=scale), None
    if impl == "pallas":
        return _pallas_masked_backward(grad, q, k, v, attn_bias, out, lse, is_causal, scale)
    if impl == "cudnn":
        primal, pullback = jax.vjp(cudnn_output(is_causal, scale), q, k, v)
        return *pullback(grad.astype(primal.dtype)), None
    key = _key_of(philox_seed)
    dq, dk, dv, dbias = _traced_backward(
        grad,
        q,
        k,
        v,
        attn_bias,
        out,
        lse,
        is_causal,
        scale,
        dropout_p,
        key,
        _block(impl, k),
        bool(grad_input_mask[3]),
    )
    if attn_bias is not None and dbias is None:
        dbias = jnp.zeros(attn_bias.shape, attn_bias.dtype)
    return dq, dk, dv, dbias


# --- the Pallas kernel's attention, with ab and segment ids: an op of our own ------------------
#
# ``custom_kernel.flash_attention`` with ``ab`` or segment ids: ``(q k^T + ab) * scale``, a query
# seeing only keys of its own segment. As a mask tensor given to ATen's op the ids would be a
# (batch, q_len, kv_len) bias held whole, and ATen's op has one slot for the softmax's residuals
# where a query whose every key is masked needs two; as an op of their own the ids and ``ab``
# reach the Pallas kernel as they are on TPU, its backward starting from its residuals, and
# elsewhere the blockwise form builds each key block's mask from the ids (``BlockMask``).

_LIBRARY = torch.library.Library("xla", "FRAGMENT")
_LIBRARY.define(
    "flash_kernel_attention(Tensor q, Tensor k, Tensor v, Tensor? ab, Tensor? q_segment_ids, "
    "Tensor? kv_segment_ids, bool causal, float scale) -> (Tensor, Tensor, Tensor)"
)
_LIBRARY.define(
    "flash_kernel_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor? ab, "
    "Tensor? q_segment_ids, Tensor? kv_segment_ids, Tensor out, Tensor shift, Tensor total, "
    "bool causal, float scale) -> (Tensor, Tensor, Tensor, Tensor)"
)


def _statistic(q: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape[:-1], dtype=torch.promote_types(q.dtype, torch.float32))


@torch.library.register_fake("xla::flash_kernel_attention", lib=_LIBRARY)
def _flash_kernel_attention_shapes(q, k, v, *rest):
    return torch.empty_like(q), _statistic(q), _statistic(q)


@torch.library.register_fake("xla::flash_kernel_attention_backward", lib=_LIBRARY)
def _flash_kernel_attention_backward_shapes(grad, q, k, v, ab, *rest):
    dab = q.new_empty(0) if ab is None else torch.empty_like(ab)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dab


def _save_for_backward(ctx, inputs: tuple, output: tuple) -> None:
    *tensors, ctx.causal, ctx.scale = inputs
    ctx.save_for_backward(*tensors, *output)


def _flash_kernel_attention_grads(ctx, grad, *statistics_grads):
    saved = ctx.saved_tensors
    dq, dk, dv, dab = torch.ops.xla.flash_kernel_attention_backward(
        grad, *saved, ctx.causal, ctx.scale
    )
    return dq, dk, dv, None if saved[3] is None else dab, None, None, None, None


torch.library.register_autograd(
    "xla::flash_kernel_attention",
    _flash_kernel_attention_grads,
    setup_context=_save_for_backward,
    lib=_LIBRARY,
)


class _KernelProblem:
    """One call of the op as each implementation takes it: ``impl``; for the Pallas kernel its
    extras, ``ab`` and the ids, and which queries see a key (``alive``, ``_kernel_ab``); for the blockwise form its mask
    (``BlockMask``, or ``ab * scale`` with the segment mask added) and whether causal masking is
    left to it (it is folded into the segment mask where there is one)."""

    def __init__(self, q, k, v, ab, q_segment_ids, kv_segment_ids, causal: bool, scale: float):
        mask = "scores" if ab is not None else "segments"
        self.impl = _implementation(q, k, v, mask, causal, 0.0)
        has_ids = q_segment_ids is not None
        segments = _segments(q_segment_ids, kv_segment_ids, causal) if has_ids else None
        if self.impl == "pallas":
            self.named = (("ab",) if ab is not None else ()) + (("segments",) if has_ids else ())
            self.extras, self.alive = (), None
            if ab is not None:
                kernel_ab, self.alive = _kernel_ab(ab, causal)
                self.extras = (kernel_ab,)
            self.extras += () if segments is None else (segments.q, segments.kv)
            return
        wide = jnp.promote_types(accumulation_dtype(q.dtype) or q.dtype, jnp.float32)
        self.causal = causal and not has_ids
        if ab is None:
            self.bias = segments
        else:
            self.bias = ab.astype(wide) * scale
            if segments is not None:
                seen = segments.seen(0, k.shape[2])[:, None]
                self.bias = self.bias + jnp.where(seen, 0.0, MASK_VALUE).astype(wide)


def _segments(q_segment_ids, kv_segment_ids, causal: bool) -> BlockMask:
    """The ids' mask; one array given for both (self-attention's usual call) is a mask where
    every query sees itself."""
    ids = (t.astype(jnp.int32) for t in (q_segment_ids, kv_segment_ids))
    shared = q_segment_ids is kv_segment_ids
    return BlockMask(*ids, q_segment_ids.shape[1], causal, sees_itself=shared)


@lowers(torch.ops.xla.flash_kernel_attention.default)
def _flash_kernel_attention(q, k, v, ab, q_segment_ids, kv_segment_ids, causal, scale):
    """(output, shift, sum) of (B, H, L, E) attention as the Pallas kernel computes it, its
    softmax's probabilities being ``exp(s - shift) / sum``: the kernel's residuals on TPU (where a
    query sees no key, the sum counts the keys it averages, which a log-sum-exp would lose to the
    mask value), the log-sum-exp and 1 from the blockwise form (plain for few keys on CPU)
    elsewhere."""
    p = _KernelProblem(q, k, v, ab, q_segment_ids, kv_segment_ids, causal, scale)
    counters.bump(f"Attention::{p.impl}")
    if p.impl == "pallas":
        out, shift, total = _pallas(q, k, v, causal, scale, *p.extras, named=p.named)
        if p.alive is not None:
            out = jnp.where(p.alive, out, 0).astype(out.dtype)
    else:
        out, shift = in_blocks(p.impl, q, k, v, p.bias, p.causal, scale)
        total = jnp.ones_like(shift)
    wide = jnp.promote_types(q.dtype, jnp.float32)
    return out.astype(q.dtype), shift.astype(wide), total.astype(wide)


@lowers(torch.ops.xla.flash_kernel_attention_backward.default)
def _flash_kernel_attention_backward(
    grad, q, k, v, ab, q_segment_ids, kv_segment_ids, out, shift, total, causal, scale
):
    """(dq, dk, dv, dab: empty without ``ab``) with the forward's implementation, from its
    residuals."""
    p = _KernelProblem(q, k, v, ab, q_segment_ids, kv_segment_ids, causal, scale)
    counters.bump(f"AttentionBackward::{p.impl}")
    if p.impl == "pallas":
        if p.alive is not None:
            grad = jnp.where(p.alive, grad, 0).astype(grad.dtype)
        residuals = (out, shift, total, grad)
        dq, dk, dv, *dab = _pallas_backward(
            q, k, v, *p.extras, *residuals, causal=causal, scale=scale, named=p.named
        )
    else:
        block = _block(p.impl, k)
        dq, dk, dv, *dab = _traced_backward(
            grad, q, k, v, p.bias, out, shift, p.causal, scale, 0.0, None, block, ab is not None
        )
        dab = [d * scale for d in dab if d is not None]
    dab = jnp.zeros((0,), q.dtype) if ab is None else dab[0].reshape(ab.shape).astype(ab.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dab
