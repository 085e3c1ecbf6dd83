"""Lowerings: splash attention, ``xla::splash_attention`` and its backward, PyTorch/XLA's
``splash_attention`` as an op of our own.

Self-attention without a scale (the caller scales ``q``): causal or full, optionally within a
window of ``window`` keys each side of the query, optionally within segments (one id per
position, shared by queries and keys), the scores optionally soft-capped (``cap * tanh(s /
cap)``); key/value heads may be fewer than query heads (grouped). The op's implementation is
chosen per platform when the program is traced:

- ``splash``: JAX's Pallas splash kernel on TPU (``make_splash_mha``, vmapped over the batch),
  for sequences a multiple of 128 long in 32 or 16-bit floats; it skips the key blocks the mask
  hides. Its forward saves the log-sum-exp and its backward starts from it: the forward kernel
  runs once per step (PyTorch/XLA's wrapper runs it again inside the backward).
- ``cudnn``: cuDNN flash attention on NVIDIA GPUs, for bf16/fp16 without segment ids or soft cap,
  with a window only where causal (cuDNN's sliding window looks back only); its backward
  differentiates the kernel (the forward runs again inside).
- ``plain`` or ``blockwise`` elsewhere, as for any attention (``attention.py``): the mask built
  one tile at a time (``BlockMask``), the tiles outside a causal mask or window skipped (every
  query sees itself, so none of them adds anything), the cap applied to each tile's scores and
  differentiated through.

Under a partitioner that splits the program (SPMD), the splash kernel is an op it splits over
batch and heads, as attention's fused kernels are (``attention._split_over_batch_and_heads``).
Each lowering bumps ``Attention::<impl>`` or ``AttentionBackward::<impl>``.
"""

from __future__ import annotations

import json
import math
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import counters
from . import attention
from .registry import lowers

_SPLASH_DTYPES = tuple(map(jnp.dtype, (jnp.float32, jnp.bfloat16, jnp.float16)))
_LANES = 128  # the splash kernel's blocks are multiples of this many positions

_LIBRARY = torch.library.Library("xla", "FRAGMENT")
_LIBRARY.define(
    "splash_attention(Tensor q, Tensor k, Tensor v, Tensor? segment_ids, bool causal, "
    "int? window, float? soft_cap, str blocks) -> (Tensor, Tensor)"
)
_LIBRARY.define(
    "splash_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor? segment_ids, "
    "Tensor out, Tensor lse, bool causal, int? window, float? soft_cap, str blocks) "
    "-> (Tensor, Tensor, Tensor)"
)


@torch.library.register_fake("xla::splash_attention", lib=_LIBRARY)
def _splash_attention_shapes(q, k, v, *rest):
    lse = q.new_empty(q.shape[:-1], dtype=torch.promote_types(q.dtype, torch.float32))
    return torch.empty_like(q), lse


@torch.library.register_fake("xla::splash_attention_backward", lib=_LIBRARY)
def _splash_attention_backward_shapes(grad, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save_for_backward(ctx, inputs: tuple, output: tuple) -> None:
    q, k, v, segment_ids, *ctx.options = inputs
    ctx.save_for_backward(q, k, v, segment_ids, *output)


def _splash_attention_grads(ctx, grad, lse_grad):
    dq, dk, dv = torch.ops.xla.splash_attention_backward(grad, *ctx.saved_tensors, *ctx.options)
    return dq, dk, dv, None, None, None, None, None


torch.library.register_autograd(
    "xla::splash_attention",
    _splash_attention_grads,
    setup_context=_save_for_backward,
    lib=_LIBRARY,
)


def _splash():
    """JAX's Pallas TPU splash attention module, or None where this JAX has none."""
    try:
        from jax.experimental.pallas.ops.tpu import splash_attention
    except ImportError:
        return None
    return splash_attention


def _implementation(q, k, segment_ids, window, soft_cap, causal: bool) -> str:
    platform = attention._platform()
    q_len, kv_len = q.shape[2], k.shape[2]
    if (
        platform == "tpu"
        and _splash() is not None
        and jnp.dtype(q.dtype) in _SPLASH_DTYPES
        and q_len % _LANES == 0
        and kv_len % _LANES == 0
    ):
        return "splash"
    # cuDNN takes a window on causal attention; ids and a soft cap are a mask it does not take
    kernel_case = segment_ids is None and soft_cap is None and (window is None or causal)
    mask = None if kernel_case else "segments"
    return attention.choose(
        platform, q.dtype, q.shape, k.shape, k.shape, mask, causal, False, has_pallas=False
    )


def _mask(q, segment_ids, causal: bool, window) -> tuple:
    """(mask for the blockwise form or None, whether it leaves causal masking to the form)."""
    if segment_ids is None and window is None:
        return None, causal
    ids = None if segment_ids is None else segment_ids.astype(jnp.int32)
    return attention.BlockMask(ids, ids, q.shape[2], causal, window, sees_itself=True), False


@lowers(torch.ops.xla.splash_attention.default)
def _splash_attention(q, k, v, segment_ids, causal, window, soft_cap, blocks):
    """(output, log-sum-exp (B, H, L) in float32 or wider)."""
    impl = _implementation(q, k, segment_ids, window, soft_cap, causal)
    counters.bump(f"Attention::{impl}")
    wide = jnp.promote_types(q.dtype, jnp.float32)
    if impl == "splash":
        options = (causal, window, soft_cap, blocks)
        forward = _kernel("forward", options, segment_ids is not None)
        out, lse = forward(q, k, v, *_given(segment_ids))
    elif impl == "cudnn":
        out, lse = attention._cudnn(q, k, v, causal, 1.0, window)
    else:
        mask, mask_causal = _mask(q, segment_ids, causal, window)
        out, lse = attention.in_blocks(impl, q, k, v, mask, mask_causal, 1.0, soft_cap=soft_cap)
    return out.astype(q.dtype), lse.astype(wide)


@lowers(torch.ops.xla.splash_attention_backward.default)
def _splash_attention_backward(
    grad, q, k, v, segment_ids, out, lse, causal, window, soft_cap, blocks
):
    """(dq, dk, dv) with the forward's implementation, from its output and log-sum-exp."""
    impl = _implementation(q, k, segment_ids, window, soft_cap, causal)
    counters.bump(f"AttentionBackward::{impl}")
    if impl == "splash":
        options = (causal, window, soft_cap, blocks)
        backward = _kernel("backward", options, segment_ids is not None)
        dq, dk, dv = backward(q, k, v, *_given(segment_ids), out, lse.astype(jnp.float32), grad)
    elif impl == "cudnn":
        primal, pullback = jax.vjp(attention.cudnn_output(causal, 1.0, window), q, k, v)
        dq, dk, dv = pullback(grad.astype(primal.dtype))
    else:
        mask, mask_causal = _mask(q, segment_ids, causal, window)
        dq, dk, dv, _ = attention._traced_backward(
            grad,
            q,
            k,
            v,
            mask,
            out,
            lse,
            mask_causal,
            1.0,
            0.0,
            None,
            attention._block(impl, k),
            False,
            soft_cap,
        )
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _given(segment_ids) -> tuple:
    return () if segment_ids is None else (segment_ids.astype(jnp.int32),)


# --- the splash kernel --------------------------------------------------------------------------


class _SplashKernel:
    """JAX's splash kernel for one shape and set of options: its forward saving the log-sum-exp
    (``forward``) and its backward from it (``backward``), on (B, H, L, E) arrays. Built once per
    shape (``of``): building it walks the mask block by block on the host."""

    def __init__(self, heads, q_len, kv_len, causal, window, soft_cap, blocks):
        splash = _splash()
        shape = (q_len, kv_len)
        mask = splash.CausalMask(shape) if causal else splash.FullMask(shape)
        if window is not None:
            mask = mask & splash.LocalMask(shape, (window, window), 0)
        with jax.ensure_compile_time_eval():  # built while a program is traced
            kernel = splash.make_splash_mha(
                splash.MultiHeadMask((mask,) * heads),
                block_sizes=_block_sizes(splash, json.loads(blocks), q_len, kv_len),
                head_shards=1,
                q_seq_shards=1,
                attn_logits_soft_cap=soft_cap,
                save_residuals=True,
            )
        # Its mask's block tables as host arrays, constants of the program: as JAX arrays a
        # program closing over them takes them as inputs the engine does not pass.
        self.kernel = jax.tree.map(np.asarray, kernel)

    @staticmethod
    @cache
    def of(heads, q_len, kv_len, *options) -> _SplashKernel:
        return _SplashKernel(heads, q_len, kv_len, *options)

    def forward(self, q, k, v, *ids):
        """(output, log-sum-exp) of one batch element's (H, L, E) arrays and (L,) ids."""
        out, (lse,) = self.kernel(q, k, v, segment_ids=_segment_ids(ids))
        return out, lse

    def backward(self, q, k, v, *rest):
        """(dq, dk, dv) of one batch element from (*ids, output, log-sum-exp, cotangent), by the
        kernel's backward from those residuals: JAX's private ``_splash_attention_bwd``, which
        the kernel's own derivative calls after running the forward again."""
        *ids, out, lse, grad = rest
        kernel, options = self.kernel, self.kernel.kwargs
        residuals = (
            q,
            k,
            v,
            _segment_ids(ids),
            None,  # the kernel's attention sinks
            out,
            lse,
            _collapsed_blocks(kernel.dq_mask_info),
            _collapsed_blocks(kernel.dkv_mask_info),
        )
        grads = _splash().splash_attention_kernel._splash_attention_bwd(
            False,  # save_residuals
            options["mask_value"],
            options["is_mqa"],
            options["block_sizes"],
            options["residual_checkpoint_name"],
            options["mask_function"],
            options["attn_logits_soft_cap"],
            options["interpret"],
            residuals,
            grad.astype(out.dtype),
        )
        return grads[3:6]  # after the three mask infos' (None)


def _segment_ids(ids: tuple):
    return _splash().SegmentIds(ids[0], ids[0]) if ids else None


def _collapsed_blocks(mask_info):
    """A mask's partial blocks with their leading dimensions joined, as the kernel's own call
    passes them."""
    if mask_info is None or mask_info.partial_mask_blocks is None:
        return mask_info
    blocks = mask_info.partial_mask_blocks
    return mask_info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))


def _block_sizes(splash, blocks: dict, q_len: int, kv_len: int):
    """The kernel's BlockSizes from PyTorch/XLA's config: each block the largest that divides
    both its sequence and the configured size (multiples of 128 both)."""
    q, kv = partial(math.gcd, q_len), partial(math.gcd, kv_len)
    fused = blocks["use_fused_bwd_kernel"]
    return splash.BlockSizes(
        block_q=q(blocks["block_q"]),
        block_kv=kv(blocks["block_kv"]),
        block_kv_compute=kv(blocks["block_kv_compute"]),
        block_q_dkv=q(blocks["block_q_dkv"]),
        block_kv_dkv=kv(blocks["block_kv_dkv"]),
        block_kv_dkv_compute=kv(blocks["block_kv_dkv_compute"]),
        block_q_dq=None if fused else q(blocks["block_q_dq"]),
        block_kv_dq=None if fused else kv(blocks["block_kv_dq"]),
        use_fused_bwd_kernel=fused,
        q_layout=splash.QKVLayout[blocks["q_layout"]],
        k_layout=splash.QKVLayout[blocks["k_layout"]],
        v_layout=splash.QKVLayout[blocks["v_layout"]],
    )


def _here(phase: str, options: tuple, *args):
    """The kernel's ``phase`` on (B, H, L, E) arrays (and what follows them), vmapped over the
    batch, the kernel built for their heads and lengths (each device's own, where split), traced
    with 64-bit types off (the Pallas kernels' indices are 32-bit)."""
    q, k = args[:2]
    kernel = _SplashKernel.of(q.shape[1], q.shape[2], k.shape[2], *options)
    with jax.enable_x64(False):
        return jax.vmap(getattr(kernel, phase))(*args)


_RESULTS = attention._OUTPUTS["cudnn"]  # the output and the log-sum-exp, as cuDNN's kernel gives


def _kernel(phase: str, options: tuple, has_ids: bool):
    """The splash kernel's ``phase`` (``forward``, ``backward``) as a function of arrays: an op
    the partitioner splits over batch and heads where it splits the program."""
    if attention._PARTITIONED.get():
        return _split(phase, options, has_ids)
    return partial(_here, phase, options)


@cache
def _split(phase: str, options: tuple, has_ids: bool):
    # Through jit, the kernel's mask tables are constants of its own function: an op the
    # partitioner splits may close over none.
    here = jax.jit(partial(_here, phase, options))
    operands = attention._QKV + (("b q",) if has_ids else ())
    if phase == "forward":
        return attention._split_over_batch_and_heads(here, operands, _RESULTS)
    operands += (*_RESULTS, "b h q d")
    return attention._split_over_batch_and_heads(here, operands, attention._QKV)
