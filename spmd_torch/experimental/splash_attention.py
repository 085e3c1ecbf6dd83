"""Splash attention, PyTorch/XLA's ``torch_xla.experimental.splash_attention``.

Scripts written for TPU (torchprime's Llama and Mixtral recipes) call it for causal, sliding
window and packed-sequence attention with grouped key/value heads. Here it is one op each way
(``xla::splash_attention``) on every backend: JAX's Pallas splash kernel on TPU, cuDNN's flash
attention on NVIDIA GPUs where it applies, and elsewhere a blockwise form whose memory grows
linearly with the sequence (``spmd_torch/_lazy/lowering/splash.py``).

Differences from PyTorch/XLA, on purpose: the TPU kernel's forward runs once per step (PyTorch/XLA
runs it again in the backward); block sizes that do not divide the sequence are reduced to ones
that do; ``mesh`` and the partition specs mark the inputs' and output's shardings and XLA's
partitioner splits the kernel over batch and heads (PyTorch/XLA wraps it in a ``shard_map``).
"""

from __future__ import annotations

import dataclasses
import json

import torch

from spmd_torch._lazy.lowering import splash  # noqa: F401  (defines xla::splash_attention)
from spmd_torch.distributed.spmd import Mesh, mark_sharding_with_gradients

__all__ = ["SplashAttentionConfig", "splash_attention"]

_BLOCKS = (
    "block_q",
    "block_kv",
    "block_kv_compute",
    "block_q_dkv",
    "block_kv_dkv",
    "block_kv_dkv_compute",
    "block_q_dq",
    "block_kv_dq",
)
_LAYOUTS = ("HEAD_DIM_MINOR", "SEQ_MINOR")
_LAYOUT_OF = ("q_layout", "k_layout", "v_layout")  # the config's sa_<these>


@dataclasses.dataclass(eq=True, frozen=True)
class SplashAttentionConfig:
    """The kernel's block sizes and layouts, the mesh and partition specs of q, k, v and the
    segment ids, and an optional sliding window; passed to :func:`splash_attention` as JSON
    (``to_json``), as in PyTorch/XLA. Block sizes are multiples of 128; they matter only to the
    TPU kernel."""

    sa_block_q: int = 2048
    sa_block_kv: int = 2048
    sa_block_kv_compute: int = 2048
    sa_block_q_dkv: int = 2048
    sa_block_kv_dkv: int = 2048
    sa_block_kv_dkv_compute: int = 2048
    sa_block_q_dq: int = 2048
    sa_block_kv_dq: int = 2048
    sa_use_fused_bwd_kernel: bool = True
    sa_q_layout: str = "HEAD_DIM_MINOR"
    sa_k_layout: str = "HEAD_DIM_MINOR"
    sa_v_layout: str = "HEAD_DIM_MINOR"
    mesh: str | None = None
    qkv_partition_spec: tuple = (("data", "fsdp"), None, None, None)
    segment_ids_partition_spec: tuple = (("data", "fsdp"), None)
    attentiontype_local_sliding: bool = False
    slide_window_size: int | None = None

    def __post_init__(self):
        for name in _BLOCKS:
            size = getattr(self, f"sa_{name}")
            if not isinstance(size, int) or size <= 0 or size % 128:
                raise ValueError(
                    f"SplashAttentionConfig: sa_{name}={size!r}: block sizes are positive "
                    "multiples of 128"
                )
        for name in _LAYOUT_OF:
            if getattr(self, f"sa_{name}") not in _LAYOUTS:
                raise ValueError(
                    f"SplashAttentionConfig: sa_{name}={getattr(self, f'sa_{name}')!r} is not "
                    f"one of {_LAYOUTS}"
                )
        window = self.slide_window_size
        if self.attentiontype_local_sliding and not (isinstance(window, int) and window >= 0):
            raise ValueError(
                f"SplashAttentionConfig: slide_window_size={window!r}: local sliding attention "
                "needs a window of 0 or more positions"
            )
        if self.mesh is not None and Mesh.from_str(self.mesh) is None:
            raise ValueError(f"SplashAttentionConfig: mesh={self.mesh!r} is not str(Mesh)")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, data: str) -> SplashAttentionConfig:
        """The config ``to_json`` wrote (JSON's lists read back as tuples)."""

        def tupled(x):
            return tuple(map(tupled, x)) if isinstance(x, list) else x

        return cls(**{name: tupled(value) for name, value in json.loads(data).items()})

    def kernel_blocks(self) -> str:
        """The TPU kernel's block sizes and layouts as the op's JSON argument."""
        names = (*_BLOCKS, "use_fused_bwd_kernel", *_LAYOUT_OF)
        return json.dumps({name: getattr(self, f"sa_{name}") for name in names}, sort_keys=True)


def splash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: str,
    decoder_segment_ids: torch.Tensor | None = None,
    causal: bool = True,
    attn_logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Self-attention ``softmax(mask(cap(q @ k^T))) @ v``, with no scale (scale ``q`` first).

    Args:
        q: ``[batch, heads, seq_len, head_dim]``.
        k: ``[batch, kv_heads, seq_len, head_dim]``; ``heads`` a multiple of ``kv_heads``
            (grouped-query attention).
        v: shaped like ``k``.
        config: :meth:`SplashAttentionConfig.to_json`'s text.
        decoder_segment_ids: ``[batch, seq_len]`` ids; a query sees only keys of its own id
            (packed sequences).
        causal: query ``i`` sees keys ``0..i`` only; else every key.
        attn_logits_soft_cap: scores become ``cap * tanh(score / cap)`` before masking.

    With the config's ``attentiontype_local_sliding``, query ``i`` sees keys within
    ``slide_window_size`` positions each side too. Under SPMD with the config's ``mesh``, q, k, v,
    the output and their gradients are marked with ``qkv_partition_spec`` and the ids with
    ``segment_ids_partition_spec``.

    Returns:
        The attention output, shaped and typed like ``q``.
    """
    settings = SplashAttentionConfig.from_json(config)
    _check_arguments(q, k, v, decoder_segment_ids, attn_logits_soft_cap)
    window = settings.slide_window_size if settings.attentiontype_local_sliding else None
    mesh = None if settings.mesh is None else Mesh.from_str(settings.mesh)

    def shard(t: torch.Tensor | None, spec: tuple) -> torch.Tensor | None:
        if t is None or mesh is None:
            return t
        return mark_sharding_with_gradients(t, mesh, spec)

    qkv_spec = settings.qkv_partition_spec
    ids = shard(decoder_segment_ids, settings.segment_ids_partition_spec)
    out, _ = torch.ops.xla.splash_attention(
        shard(q, qkv_spec),
        shard(k, qkv_spec),
        shard(v, qkv_spec),
        ids,
        causal,
        window,
        None if attn_logits_soft_cap is None else float(attn_logits_soft_cap),
        settings.kernel_blocks(),
    )
    return shard(out, qkv_spec)


def _check_arguments(q, k, v, segment_ids, soft_cap) -> None:
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not q.dim() == k.dim() == v.dim() == 4:
        raise ValueError(f"splash_attention: q, k and v are [batch, heads, seq, dim]: {shapes}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"splash_attention: k and v take q's batch and head_dim, and one shape: {shapes}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"splash_attention: self-attention: q and k are as long: {shapes}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"splash_attention: q's heads ({q.shape[1]}) are not a multiple of k's "
            f"({k.shape[1]}): {shapes}"
        )
    if segment_ids is not None and tuple(segment_ids.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(
            f"splash_attention: decoder_segment_ids {tuple(segment_ids.shape)} are not "
            f"[batch, seq_len] = {(q.shape[0], q.shape[2])}"
        )
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"splash_attention: attn_logits_soft_cap={soft_cap!r} is not positive")
