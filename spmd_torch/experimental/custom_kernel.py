"""torch_xla.experimental.custom_kernel on JAX: ``flash_attention`` as the fused attention op.

PyTorch/XLA runs a Pallas TPU kernel here. This one is an attention op of the engine, one node
forward and one backward, lowered per platform (``lowering/attention.py``): the Pallas flash
kernel on TPU, ``ab`` and segment ids given to it as they are, its backward starting from the
forward's residuals; elsewhere blockwise attention, whose memory grows linearly with the
sequence. Without ``ab`` or segment ids it is the fused op ``F.scaled_dot_product_attention``
becomes (``_scaled_dot_product_fused_attention_overrideable``): half-precision inputs reach
cuDNN's kernel on an NVIDIA GPU (products accumulated in float32, as the TPU kernel does). With
them it is an op of our own (``xla::flash_kernel_attention``), which off TPU builds each key
block's mask from the ids (memory still linear in the sequence; ``ab`` is held whole, ``[batch,
heads, q_seq_len, kv_seq_len]``) and computes in float32 or wider. Under a ``partition_spec`` the
kernel runs on each device's batch and heads (the partitioner's rule for the fused kernels).

The grouped matmuls of mixture-of-experts layers (``gmm``, ``tgmm``, ``gmm_backward`` and the
autograd Function ``GMM``) are ``jax.lax.ragged_dot`` and ``ragged_dot_general`` over the rows of
each group, one op of the lazy graph each, where PyTorch/XLA calls its Pallas TPU kernels (the
``tiling`` argument, a tile size of those kernels, is accepted and has no effect).
``repeat_with_fixed_output_size`` (the helper of its grouped matmul kernel) is provided too: a
``repeat_interleave`` with a static output length, traced without a graph break.

Pallas kernels of one's own (``make_kernel_from_pallas``, ``trace_pallas``) run as they are: a JAX
function that calls ``pallas_call`` becomes one op of the lazy graph (``xla_builder.call_jax``), so
JAX compiles the kernel inside the step's program for whatever platform runs it (Mosaic on TPU,
Triton or Mosaic GPU on NVIDIA GPUs, Pallas's interpreter where the kernel asks for it), where
PyTorch/XLA serialises a TPU kernel into a custom call. Results carry no autograd history, as
there.

The inference kernels of the same module (``paged_attention``, ``multi_queries_paged_attention``,
``ragged_paged_attention``) are ops of the graph too (``lowering/paged.py``): JAX's Pallas paged
and ragged paged attention kernels on TPU, elsewhere the pages each sequence lists gathered and
attended to in float32. ``multi_queries_paged_attention`` takes that XLA form on every platform
(its TPU kernel is PyTorch/XLA's own; JAX ships none). ``quantized_matmul_int8`` (int8 weights
with per-channel scales, activations optionally quantized per row) is one op of the graph too,
one XLA form everywhere (``lowering/quantized.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import torch

import spmd_torch.distributed.spmd as xs
from spmd_torch import config
from spmd_torch._internal.jax_workarounds import jax_import_guard  # noqa: F401  PyTorch/XLA's re-export
from spmd_torch._lazy import dispatch
from spmd_torch._lazy.lowering import attention
from spmd_torch._lazy.lowering.dtypes import to_jax_dtype
from spmd_torch.core.xla_builder import call_jax

__all__ = [
    "DEFAULT_MASK_VALUE",
    "GMM",
    "convert_torch_dtype_to_jax",
    "flash_attention",
    "gmm",
    "gmm_backward",
    "make_kernel_from_pallas",
    "multi_queries_paged_attention",
    "paged_attention",
    "quantized_matmul_int8",
    "ragged_paged_attention",
    "repeat_with_fixed_output_size",
    "tgmm",
    "to_jax_shape_dtype_struct",
    "trace_pallas",
]

DEFAULT_MASK_VALUE = attention.MASK_VALUE
"""What the kernel adds to a masked score: finite, so a row with every key masked stays finite."""
_HALF = (torch.bfloat16, torch.float16)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    q_segment_ids: torch.Tensor | None = None,
    kv_segment_ids: torch.Tensor | None = None,
    sm_scale: float = 1.0,
    *,
    ab: torch.Tensor | None = None,
    partition_spec: Sequence | None = None,
    mesh: xs.Mesh | None = None,
) -> torch.Tensor:
    """Attention ``softmax((q @ k^T + ab) * sm_scale + mask) @ v``, as PyTorch/XLA's TPU kernel.

    Scripts written for TPU (Llama, FSDPv2 recipes) call this kernel; here it is the engine's
    fused attention, one node each way on every backend, with gradients for ``q``, ``k``, ``v``
    and ``ab``. Its memory grows linearly with the sequence, as the kernel's does, segment ids
    included (``ab`` is held whole). Products accumulate and the softmax runs in float32
    (float64 for float64 inputs), as in the kernel, and the result has ``q``'s dtype. bfloat16 or
    float16 inputs without segment ids or ``ab`` enter the fused op as they are, which runs cuDNN's
    kernel on an NVIDIA GPU. ``sm_scale`` is then a constant of the program (a new value compiles
    anew), as it is with segment ids or ``ab``; for other inputs it is a program input.

    A masked score gets :data:`DEFAULT_MASK_VALUE` added, as in the kernel: a query whose every
    key is masked (segment ids, with ``causal`` or not) attends to all keys evenly, i.e. its output
    is the mean of ``v`` over the keys. (The kernel with ``causal`` and a sequence longer than one
    512-long block averages only over the key blocks it visits.)

    Args:
        q: ``[batch, heads, q_seq_len, head_dim]``; more leading batch dimensions are allowed.
        k: ``[batch, heads, kv_seq_len, head_dim]``.
        v: ``[batch, heads, kv_seq_len, head_dim]``.
        causal: Query ``i`` sees keys ``0..i`` only (aligned at the first position when the two
            lengths differ).
        q_segment_ids: ``[batch, q_seq_len]`` integer ids; a query sees only keys of its own id
            (packed sequences, padding). Given together with ``kv_segment_ids``.
        kv_segment_ids: ``[batch, kv_seq_len]`` integer ids.
        sm_scale: Multiplies the scores (after ``ab`` is added), e.g. ``head_dim ** -0.5``.
        ab: ``[batch, heads, q_seq_len, kv_seq_len]`` attention bias added to ``q @ k^T``.
        partition_spec: Under SPMD, how ``q``, ``k``, ``v``, ``ab`` and the output are sharded
            over ``mesh`` (one entry per dimension of ``q``); segment ids take its batch and
            sequence entries. Inputs, output and their gradients are marked so, and the
            compiler partitions the attention: a fused kernel runs on each device's batch and
            heads, as under PyTorch/XLA (a split sequence is gathered first).
        mesh: The mesh for ``partition_spec``; the global mesh when omitted.

    Returns:
        The attention output, shaped and typed like ``q``.

    Example:
        >>> q, k, v = (torch.randn(2, 4, 128, 64, device='xla') for _ in range(3))
        >>> o = flash_attention(q, k, v, causal=True, sm_scale=64 ** -0.5)
        >>> mesh = xs.Mesh(np.arange(8), (8, 1), ('fsdp', 'tensor'))
        >>> o = flash_attention(q, k, v, partition_spec=('fsdp', 'tensor', None, None), mesh=mesh)
    """
    _check_arguments(q, k, v, q_segment_ids, kv_segment_ids, ab)
    if partition_spec is None:
        return _attention(q, k, v, causal, q_segment_ids, kv_segment_ids, sm_scale, ab)
    spec = tuple(partition_spec)
    if len(spec) != q.dim():
        raise ValueError(
            f"flash_attention: partition_spec {spec} has {len(spec)} entries but q has "
            f"{q.dim()} dimensions {tuple(q.shape)}: give one entry per dimension"
        )
    mesh = xs.get_global_mesh() if mesh is None else mesh
    if mesh is None:
        raise ValueError(
            "flash_attention: partition_spec given but no mesh (pass mesh= or xs.set_global_mesh)"
        )
    segment_spec = spec[:-3] + (spec[-2],)

    def shard(t: torch.Tensor | None, t_spec: tuple) -> torch.Tensor | None:
        return None if t is None else xs.mark_sharding_with_gradients(t, mesh, t_spec)

    out = _attention(
        shard(q, spec),
        shard(k, spec),
        shard(v, spec),
        causal,
        shard(q_segment_ids, segment_spec),
        shard(kv_segment_ids, segment_spec),
        sm_scale,
        shard(ab, spec),
    )
    return shard(out, spec)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    q_segment_ids: torch.Tensor | None,
    kv_segment_ids: torch.Tensor | None,
    sm_scale: float,
    ab: torch.Tensor | None,
) -> torch.Tensor:
    """The kernel's arithmetic as an attention op. With ``ab`` or segment ids, the kernel's own
    op (``xla::flash_kernel_attention``): the Pallas kernel takes them as they are on TPU, and
    elsewhere each key block's mask is built from the ids. Otherwise ATen's fused op:
    half-precision inputs go in as they are, ``sm_scale`` as the op's scale (a constant of the
    program), so that an NVIDIA GPU runs cuDNN's kernel, whose products accumulate in float32 as
    the TPU kernel's do; other inputs as ``(q * sm_scale) k^T`` in float32 or wider,
    ``sm_scale`` a program input."""
    if ab is not None or q_segment_ids is not None:
        ids = [
            None if t is None else t.reshape(-1, t.shape[-1])
            for t in (q_segment_ids, kv_segment_ids)
        ]
        bias = None if ab is None else _batched(ab)
        out, _, _ = torch.ops.xla.flash_kernel_attention(
            _batched(q), _batched(k), _batched(v), bias, *ids, causal, float(sm_scale)
        )
        return out.reshape(q.shape)
    if q.dtype in _HALF and q.dtype == k.dtype == v.dtype:
        return _fused(_batched(q), _batched(k), _batched(v), causal, sm_scale).reshape(q.shape)
    wide = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    wide = torch.promote_types(wide, torch.float32)
    flat = [_batched(t.to(wide)) for t in (q * sm_scale, k, v)]
    return _fused(*flat, causal, 1.0).reshape(q.shape).to(q.dtype)


def _batched(t: torch.Tensor) -> torch.Tensor:
    """``[*batch, heads, len, dim]`` as ``[batch, heads, len, dim]``."""
    return t.reshape(-1, *t.shape[-3:])


def _fused(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """ATen's fused attention op's output. Under SPMD the partitioner splits it as it splits its
    inputs, a fused kernel by spmd_torch's rule (``lowering/attention.py``): each device runs it
    on its own batch and heads, as PyTorch/XLA runs its kernel under a ``partition_spec``."""
    return torch.ops.aten._scaled_dot_product_fused_attention_overrideable(
        q, k, v, None, 0.0, causal, scale=scale
    )[0]


def _check_arguments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_segment_ids: torch.Tensor | None,
    kv_segment_ids: torch.Tensor | None,
    ab: torch.Tensor | None,
) -> None:
    """The Pallas kernel's checks (ValueError; NotImplementedError for a v head_dim of its own),
    PyTorch/XLA's AssertionError for a lone segment-ids tensor, TypeError for non-float inputs."""
    for name, t in (("q", q), ("k", k), ("v", v), ("ab", ab)):
        if t is not None and not t.is_floating_point():
            raise TypeError(f"flash_attention: {name} must be a floating tensor, got {t.dtype}")
    if q.dim() < 3 or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(
            "flash_attention: q, k and v must be [batch, heads, seq_len, head_dim] (of equal "
            f"rank, at least 3), got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    batch_heads = q.shape[:-2]
    if k.shape[:-2] != batch_heads or v.shape[:-2] != batch_heads:
        raise ValueError(
            "flash_attention: batch and head dimensions differ: q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"flash_attention: head_dim mismatch: q has {q.shape[-1]}, k has {k.shape[-1]}"
        )
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"flash_attention: kv_seq_len mismatch: k has {k.shape[-2]}, v has {v.shape[-2]}"
        )
    if v.shape[-1] != k.shape[-1]:
        raise NotImplementedError(
            f"flash_attention: v's head_dim {v.shape[-1]} differs from k's {k.shape[-1]}; "
            "the kernel supports equal head dims only"
        )
    q_seq_len, kv_seq_len = q.shape[-2], k.shape[-2]
    if ab is not None and tuple(ab.shape) != (*batch_heads, q_seq_len, kv_seq_len):
        raise ValueError(
            f"flash_attention: ab must be {(*batch_heads, q_seq_len, kv_seq_len)} "
            f"[batch, heads, q_seq_len, kv_seq_len], got {tuple(ab.shape)}"
        )
    if (q_segment_ids is None) != (kv_segment_ids is None):
        given = "q_segment_ids" if kv_segment_ids is None else "kv_segment_ids"
        raise AssertionError(
            f"flash_attention: both q_segment_ids and kv_segment_ids must be given; got only {given}"
        )
    batch = tuple(q.shape[:-3])
    for name, ids, seq_len in (
        ("q_segment_ids", q_segment_ids, q_seq_len),
        ("kv_segment_ids", kv_segment_ids, kv_seq_len),
    ):
        if ids is not None and tuple(ids.shape) != (*batch, seq_len):
            raise ValueError(
                f"flash_attention: {name} must be {(*batch, seq_len)} [batch, seq_len], "
                f"got {tuple(ids.shape)}"
            )


def convert_torch_dtype_to_jax(dtype: torch.dtype) -> Any:
    """The JAX dtype of a tensor of ``dtype`` as a kernel sees it (ValueError if it has none)."""
    if config.USE_BF16.value:
        raise RuntimeError("Pallas kernels do not support XLA_USE_BF16: unset the variable")
    try:
        return to_jax_dtype(dtype)
    except TypeError:
        raise ValueError(f"Unsupported dtype: {dtype} has no JAX dtype on the xla device") from None


def to_jax_shape_dtype_struct(tensor: torch.Tensor) -> jax.ShapeDtypeStruct:
    """``tensor``'s shape and JAX dtype, what a kernel is traced on."""
    return jax.ShapeDtypeStruct(tuple(tensor.shape), convert_torch_dtype_to_jax(tensor.dtype))


class TracedKernel:
    """What :func:`trace_pallas` gives where PyTorch/XLA gives a TPU kernel's serialised payload:
    the JAX function with its other arguments bound, a function of the tensor arguments' arrays.
    Called inside the step's program, it is compiled there for the program's platform. It is
    traced with 64-bit types off, as JAX's Pallas kernels are written for (their grid indices
    would otherwise be int64)."""

    _TENSOR = object()  # where a tensor argument goes among the bound ones

    def __init__(
        self, kernel: Callable, args: tuple, kwargs: dict, static_argnums, static_argnames
    ):
        self.name = getattr(kernel, "__name__", type(kernel).__name__)
        self.inputs = [(tuple(a.shape), a.dtype) for a in args if torch.is_tensor(a)]
        self._args = tuple(self._TENSOR if torch.is_tensor(a) else a for a in args)
        self._kwargs = kwargs
        self._jitted = jax.jit(
            kernel, static_argnums=static_argnums, static_argnames=static_argnames
        )
        bound = (kernel, static_argnums, _frozen(static_argnames), self._args)
        bound += (tuple(sorted(kwargs.items())),)
        try:
            hash(bound)
        except TypeError:  # an unhashable option: told apart by its printed form
            bound = repr(bound)
        self.identity = ("trace_pallas", bound)

    def __call__(self, *arrays):
        remaining = iter(arrays)
        args = [next(remaining) if a is self._TENSOR else a for a in self._args]
        with jax.enable_x64(False):
            return self._jitted(*args, **self._kwargs)


def _frozen(names):
    return names if names is None or isinstance(names, str) else tuple(names)


def trace_pallas(
    kernel: Callable,
    *args,
    static_argnums=None,
    static_argnames=None,
    use_cache: bool = False,
    **kwargs,
) -> tuple[TracedKernel, list[torch.Tensor]]:
    """Bind a JAX kernel to these arguments: ``(payload, tensor_args)`` for
    ``torch_xla._XLAC._xla_tpu_custom_call(tensor_args, payload, output_shapes, output_dtypes)``.

    The payload is a :class:`TracedKernel`, not serialised Mosaic code: the kernel is compiled
    with the step's program, for its platform. Non-tensor arguments are bound as they are
    (positions in ``static_argnums`` and names in ``static_argnames`` as static arguments of
    ``jax.jit``), keyword arguments too. ``use_cache`` is accepted: the same kernel and arguments
    are always traced once.

    Example:
        >>> payload, tensors = trace_pallas(add_vectors, x, y)
        >>> (out,) = torch_xla._XLAC._xla_tpu_custom_call(tensors, payload, [x.shape], [x.dtype])
    """
    del use_cache  # always: call_jax traces a kernel once per identity and input shapes
    payload = TracedKernel(kernel, args, kwargs, static_argnums, static_argnames)
    return payload, [a for a in args if torch.is_tensor(a)]


def make_kernel_from_pallas(kernel: Callable, output_shape_dtype_fn: Callable) -> Callable:
    """A JAX function calling ``pallas_call`` as a function of xla tensors, one op of the graph.

    ``output_shape_dtype_fn(*args)`` lists ``(shape, dtype)`` per output, as PyTorch/XLA asks;
    here the kernel's own outputs are checked against it. One output comes back as a tensor,
    several as a tuple. ``static_argnums``/``static_argnames`` given at the call reach
    ``jax.jit``, other keyword arguments the kernel.

    Example:
        >>> pt_add = make_kernel_from_pallas(add_vectors, lambda x, y: [(x.shape, x.dtype)])
        >>> out = pt_add(x, y)
    """

    def run(*args, static_argnums=None, static_argnames=None, **kwargs):
        payload, tensors = trace_pallas(
            kernel, *args, static_argnums=static_argnums, static_argnames=static_argnames, **kwargs
        )
        expected = output_shape_dtype_fn(*args)
        if not isinstance(expected, list):
            raise TypeError(
                f"make_kernel_from_pallas({payload.name}): output_shape_dtype_fn must return a "
                f"list of (shape, dtype), got {type(expected).__name__}"
            )
        outputs = run_traced_kernel(
            tensors, payload, [s for s, _ in expected], [d for _, d in expected]
        )
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    return run


def run_traced_kernel(
    tensors: Sequence[torch.Tensor],
    payload: TracedKernel,
    output_shapes: Sequence,
    output_dtypes: Sequence[torch.dtype],
) -> list[torch.Tensor]:
    """The kernel's outputs on xla tensors, checked against the shapes and dtypes the caller
    expects (a mismatch is a ValueError naming both: PyTorch/XLA would read the buffers wrongly).
    ``torch_xla._XLAC._xla_tpu_custom_call`` is this function.

    Example:
        >>> payload, tensors = trace_pallas(add_vectors, x, y)
        >>> (out,) = run_traced_kernel(tensors, payload, [x.shape], [x.dtype])
    """
    if not isinstance(payload, TracedKernel):
        raise NotImplementedError(
            f"_xla_tpu_custom_call: payload of type {type(payload).__name__}; a serialised "
            "Mosaic kernel is not run here. Give the payload trace_pallas returns, or wrap the "
            "JAX function with make_kernel_from_pallas"
        )
    if not tensors:
        raise RuntimeError(f"_xla_tpu_custom_call({payload.name}) requires at least one input")
    given = [(tuple(t.shape), t.dtype) for t in tensors]
    if given != payload.inputs:
        raise ValueError(
            f"_xla_tpu_custom_call({payload.name}): the payload was traced for inputs "
            f"{payload.inputs} (shape, dtype), but is called on {given}"
        )
    result = call_jax(payload, tuple(tensors), name=payload.name, override_hash=payload.identity)
    outputs = list(result) if isinstance(result, (tuple, list)) else [result]
    got = [(tuple(o.shape), o.dtype) for o in outputs]
    want = [(tuple(s), d) for s, d in zip(output_shapes, output_dtypes, strict=True)]
    if got != want:
        raise ValueError(
            f"Pallas kernel {payload.name}: its outputs are {got} (shape, dtype), but "
            f"{want} were expected"
        )
    return outputs


def repeat_with_fixed_output_size(
    input: torch.Tensor, repeats: torch.Tensor, total_repeat_length: int
) -> torch.Tensor:
    """``torch.repeat_interleave(input, repeats)`` with exactly ``total_repeat_length`` elements:
    cut there when the repeats add up to more, padded with ``input[-1]`` when they add up to less.

    The length is static, so the result is traced (no data-dependent shape, no device read).

    Args:
        input: a 1-d tensor.
        repeats: a 1-d integer tensor, one count per element of ``input``.
        total_repeat_length: the length of the result.

    Example:
        >>> repeats = torch.tensor([0, 2, 1], device="xla")
        >>> repeat_with_fixed_output_size(x, repeats, 4)  # x[1], x[1], x[2], x[2]
    """
    if input.dim() != 1 or repeats.dim() != 1:
        raise ValueError(
            "repeat_with_fixed_output_size: input and repeats must be 1-d, got shapes "
            f"{tuple(input.shape)} and {tuple(repeats.shape)}"
        )
    ends = torch.cumsum(repeats, dim=0)  # output position j reads the first element ending after j
    positions = torch.arange(total_repeat_length, device=input.device, dtype=ends.dtype)
    source = torch.searchsorted(ends, positions, right=True).clamp(max=input.shape[0] - 1)
    return input[source]


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    lengths: torch.Tensor,
    page_indices: torch.Tensor,
    pages_per_compute_block: int,
    megacore_mode: str | None = None,
    attn_logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Decode attention over a paged cache: each sequence's one query against its first
    ``lengths[b]`` keys, read from the pages ``page_indices[b]`` lists, in order. No scale.

    Args:
        q: ``[batch, heads, head_dim]``.
        k_pages: ``[kv_heads, total_pages, page_size, head_dim]``; ``heads`` a multiple of
            ``kv_heads`` (grouped-query attention).
        v_pages: shaped like ``k_pages``.
        lengths: ``[batch]`` int32 key counts.
        page_indices: ``[batch, pages_per_sequence]`` int32 page numbers.
        pages_per_compute_block: pages the TPU kernel takes at a time; divides
            ``pages_per_sequence``.
        megacore_mode: the TPU kernel's split over two cores: ``"kv_head"``, ``"batch"`` or None.
        attn_logits_soft_cap: scores become ``cap * tanh(score / cap)``.

    Returns:
        ``[batch, heads, head_dim]`` in ``q``'s dtype; a sequence of length 0 gives zeros.
    """
    cap = None if attn_logits_soft_cap is None else float(attn_logits_soft_cap)
    return torch.ops.xla.paged_attention(
        q, k_pages, v_pages, lengths, page_indices, pages_per_compute_block, megacore_mode, cap
    )


def multi_queries_paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    lengths: torch.Tensor,
    page_indices: torch.Tensor,
    effective_q_lens: torch.Tensor,
    num_kv_pages_per_compute_block: int,
    num_queries_per_compute_block: int,
    use_kernel: bool = True,
    attn_logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of several new queries per sequence over a paged cache that already
    holds their keys: query ``i`` of sequence ``b`` sits at position ``lengths[b] -
    effective_q_lens[b] + i`` and sees the keys up to it. No scale.

    Args:
        q: ``[batch, query_len, heads, head_dim]``; the rows past ``effective_q_lens[b]`` are
            padding (they see all ``lengths[b]`` keys).
        k_pages, v_pages, lengths, page_indices: as :func:`paged_attention`'s.
        effective_q_lens: ``[batch]`` int32 counts of real queries.
        num_kv_pages_per_compute_block, num_queries_per_compute_block: PyTorch/XLA's TPU
            kernel's blocks; no effect here.
        use_kernel: PyTorch/XLA's choice of its kernel or its reference; one form here.
        attn_logits_soft_cap: scores become ``cap * tanh(score / cap)``.

    Returns:
        ``[batch, query_len, heads, head_dim]`` in ``q``'s dtype.
    """
    cap = None if attn_logits_soft_cap is None else float(attn_logits_soft_cap)
    return torch.ops.xla.multi_queries_paged_attention(
        q,
        k_pages,
        v_pages,
        lengths,
        page_indices,
        effective_q_lens,
        num_kv_pages_per_compute_block,
        num_queries_per_compute_block,
        use_kernel,
        cap,
    )


def ragged_paged_attention(
    q: torch.Tensor,
    kv_pages: torch.Tensor,
    kv_lens: torch.Tensor,
    page_indices: torch.Tensor,
    cu_q_lens: torch.Tensor,
    num_seqs: torch.Tensor,
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    use_kernel: bool = True,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
) -> torch.Tensor:
    """Prefill and decode in one call: the queries of ``num_seqs`` sequences concatenated, each
    sequence's causal over its paged keys (vLLM's attention on TPU).

    Sequence ``s`` owns the query rows ``cu_q_lens[s]:cu_q_lens[s + 1]``, its last ones: its
    query ``i`` sits at position ``kv_lens[s] - q_len + i`` and sees the keys up to it (and
    only the last ``sliding_window`` of those, with a window).

    Args:
        q: ``[max_num_batched_tokens, heads, head_dim]``.
        kv_pages: ``[total_pages, page_size, 2 * kv_heads, head_dim]``, each kv head's keys at
            an even position of the third axis and its values at the odd one after.
        kv_lens: ``[max_num_seqs]`` int32 key counts.
        page_indices: ``[max_num_seqs, pages_per_sequence]`` int32 page numbers.
        cu_q_lens: ``[max_num_seqs + 1]`` int32 offsets of each sequence's queries.
        num_seqs: ``[1]`` int32: how many of the ``max_num_seqs`` are live.
        sm_scale: multiplies the scores.
        sliding_window, soft_cap: as above; ``cap * tanh(score / cap)``.
        mask_value: added to hidden scores (default: a large negative finite number).
        k_scale, v_scale: the scales of an fp8 cache's keys and values.
        use_kernel: False takes the XLA form on TPU too.
        num_kv_pages_per_block, num_queries_per_block, vmem_limit_bytes: the TPU kernel's.

    Returns:
        ``[max_num_batched_tokens, heads, head_dim]`` in ``q``'s dtype; the rows after the
        last live sequence's queries are unspecified (zeros off TPU).
    """
    return torch.ops.xla.ragged_paged_attention(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap),
        mask_value=None if mask_value is None else float(mask_value),
        k_scale=None if k_scale is None else float(k_scale),
        v_scale=None if v_scale is None else float(v_scale),
        use_kernel=use_kernel,
        num_kv_pages_per_block=num_kv_pages_per_block,
        num_queries_per_block=num_queries_per_block,
        vmem_limit_bytes=vmem_limit_bytes,
    )


def quantized_matmul_int8(
    x: torch.Tensor,
    w: torch.Tensor,
    scalar: torch.Tensor,
    zero_point: torch.Tensor | None = None,
    quant_block_size: torch.Tensor | None = None,
    quantize_activation: bool = False,
    batch_block_size: int | None = None,
    out_block_size: int | None = None,
    in_block_size: int | None = None,
) -> torch.Tensor:
    """``x @ (w * scalar[:, None]).T`` for int8 weights ``w [out, in]`` with a float scale per
    output channel; with ``quantize_activation`` each row of ``x`` is quantized to int8 as well
    and the product taken in int32. ``zero_point`` and ``quant_block_size`` are not supported
    (nor by PyTorch/XLA's kernel); the block sizes have no effect. Returns ``[batch, out]`` in
    ``x``'s dtype."""
    return torch.ops.xla.quantized_matmul_int8(
        x,
        w,
        scalar,
        zero_point,
        quant_block_size,
        quantize_activation,
        batch_block_size,
        out_block_size,
        in_block_size,
    )


def gmm(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    group_sizes: torch.Tensor,
    tiling: tuple[int, int, int] | None = None,
    group_offset: torch.Tensor | None = None,
    transpose_rhs: bool = False,
) -> torch.Tensor:
    """Each group's rows of ``lhs`` times its matrix: ``lhs[start_i:end_i] @ rhs[i]``, the groups'
    rows consecutive in ``lhs`` and ``group_sizes[i]`` rows long.

    Args:
        lhs: ``[m, k]``.
        rhs: ``[num_groups, k, n]`` (``[num_groups, n, k]`` with ``transpose_rhs``); with
            ``group_offset``, the matrices of groups ``group_offset`` to ``group_offset +
            rhs.shape[0] - 1`` only (a device's share of experts sharded over devices).
        group_sizes: ``[num_groups]`` int32 row counts, every group's; rows past their sum give
            zeros.
        tiling: PyTorch/XLA's kernel tile sizes; no effect here.
        group_offset: the first group ``rhs`` holds, a 0-d int32 tensor (or an int); the rows
            of the other groups give zeros, as the TPU kernel's. A group past the last one
            counts as empty.
        transpose_rhs: ``rhs`` holds each group's matrix transposed.

    Returns:
        ``[m, n]``, in ``lhs``'s dtype.
    """
    _check_group_sizes("gmm", group_sizes)
    if lhs.dim() != 2 or rhs.dim() != 3:
        raise ValueError(
            f"gmm: lhs must be [m, k] and rhs [num_groups, k, n], got {tuple(lhs.shape)} and "
            f"{tuple(rhs.shape)}"
        )
    k = rhs.shape[2] if transpose_rhs else rhs.shape[1]
    groups_given = group_sizes.shape[0] if group_offset is None else rhs.shape[0]
    if lhs.shape[1] != k or rhs.shape[0] != groups_given or groups_given > group_sizes.shape[0]:
        raise ValueError(
            f"gmm: lhs {tuple(lhs.shape)}, rhs {tuple(rhs.shape)} (transpose_rhs="
            f"{transpose_rhs}) and group_sizes {tuple(group_sizes.shape)} do not agree"
        )
    offset = _group_offset("gmm", group_offset, lhs.device)
    args = (lhs, rhs, group_sizes, offset, transpose_rhs)
    return call_jax(_grouped_rows, args, name="gmm")


def _grouped_rows(lhs, rhs, group_sizes, offset, transpose_rhs: bool):
    import jax
    import jax.numpy as jnp

    if transpose_rhs:
        rhs = rhs.swapaxes(1, 2)
    if offset is not None:  # the rows before the window multiply a zero matrix, then are masked
        before, sizes = _window(group_sizes, offset, rhs.shape[0])
        group_sizes = jnp.concatenate([before[None], sizes])
        rhs = jnp.concatenate([jnp.zeros_like(rhs[:1]), rhs])
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    if offset is not None:  # an inf or nan before the window times zero is not zero
        rows = jax.lax.iota(jnp.int32, lhs.shape[0])
        inside = (rows >= group_sizes[0]) & (rows < jnp.sum(group_sizes))
        out = jnp.where(inside[:, None], out, 0)
    return out.astype(lhs.dtype)  # summed in float32 and rounded once, as the TPU kernel


def _window(group_sizes, offset, count: int):
    """(the rows before group ``offset``, the sizes of groups ``offset`` to ``offset + count -
    1``; groups past the last are empty)."""
    import jax
    import jax.numpy as jnp

    padded = jnp.concatenate([group_sizes, jnp.zeros(count, group_sizes.dtype)])
    sizes = jax.lax.dynamic_slice(padded, (offset,), (count,))
    firsts = jnp.arange(group_sizes.shape[0]) < offset
    return jnp.sum(jnp.where(firsts, group_sizes, 0)).astype(group_sizes.dtype), sizes


def tgmm(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    group_sizes: torch.Tensor,
    tiling: tuple[int, int, int] = (512, 512, 512),
    group_offset: torch.Tensor | None = None,
    num_actual_groups: int | None = None,
) -> torch.Tensor:
    """Each group's columns of ``lhs`` times its rows of ``rhs``: ``lhs[:, start_i:end_i] @
    rhs[start_i:end_i]`` (``gmm``'s gradient for its ``rhs``).

    Args:
        lhs: ``[k, m]``.
        rhs: ``[m, n]``.
        group_sizes: ``[num_groups]`` int32 counts along ``m``.
        tiling: PyTorch/XLA's kernel tile sizes; no effect here.
        group_offset: the first group to compute, a 0-d int32 tensor (or an int); default 0.
        num_actual_groups: how many groups to compute from ``group_offset`` on (a device's share
            of experts sharded over devices); default all of them. A group past the last one
            counts as empty.

    Returns:
        ``[num_actual_groups, k, n]``, in ``lhs``'s dtype.
    """
    _check_group_sizes("tgmm", group_sizes)
    if lhs.dim() != 2 or rhs.dim() != 2 or lhs.shape[1] != rhs.shape[0]:
        raise ValueError(
            f"tgmm: lhs must be [k, m] and rhs [m, n], got {tuple(lhs.shape)} and "
            f"{tuple(rhs.shape)}"
        )
    count = group_sizes.shape[0] if num_actual_groups is None else num_actual_groups
    if not isinstance(count, int) or count < 0:
        raise ValueError(f"tgmm: num_actual_groups must be an int >= 0, got {num_actual_groups!r}")
    offset = _group_offset("tgmm", group_offset, lhs.device)
    if offset is None and count != group_sizes.shape[0]:
        offset = _group_offset("tgmm", 0, lhs.device)
    return call_jax(_grouped_columns, (lhs, rhs, group_sizes, offset, count), name="tgmm")


def _grouped_columns(lhs, rhs, group_sizes, offset, count: int):
    import jax
    import jax.numpy as jnp

    if offset is not None:  # the columns before the window are a group of their own, dropped
        before, sizes = _window(group_sizes, offset, count)
        group_sizes = jnp.concatenate([before[None], sizes])
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [0]), ([], [])),  # lhs [k, m] @ rhs [m, n], m ragged
        lhs_ragged_dimensions=[1],
        rhs_group_dimensions=[],
    )
    out = jax.lax.ragged_dot_general(
        lhs, rhs, group_sizes, numbers, preferred_element_type=jnp.float32
    )
    return (out if offset is None else out[1:]).astype(lhs.dtype)


def gmm_backward(
    grad: torch.Tensor,
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    group_sizes: torch.Tensor,
    tiling: tuple[int, int, int] = (512, 512, 512),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``gmm(lhs, rhs, group_sizes)`` for ``lhs`` and ``rhs``, given ``grad``."""
    return gmm(grad, rhs, group_sizes, transpose_rhs=True), tgmm(lhs.t(), grad, group_sizes)


class GMM(torch.autograd.Function):
    """``gmm`` with its gradients: ``GMM.apply(lhs, rhs, group_sizes, tiling)``."""

    @staticmethod
    def forward(ctx, lhs, rhs, group_sizes, tiling=(512, 512, 512)):
        ctx.save_for_backward(lhs, rhs, group_sizes)
        return gmm(lhs, rhs, group_sizes)

    @staticmethod
    def backward(ctx, grad):
        lhs, rhs, group_sizes = ctx.saved_tensors
        return (*gmm_backward(grad, lhs, rhs, group_sizes), None, None)


def _check_group_sizes(api: str, group_sizes) -> None:
    if group_sizes.dim() != 1 or group_sizes.dtype != torch.int32:
        raise ValueError(
            f"{api}: group_sizes must be a 1-d int32 tensor, got {group_sizes.dtype} "
            f"{tuple(group_sizes.shape)}"
        )


def _group_offset(api: str, group_offset, device) -> torch.Tensor | None:
    """``group_offset`` as a 0-d int32 tensor on ``device`` (None stays None)."""
    if group_offset is None:
        return None
    if isinstance(group_offset, int):
        return torch.tensor(group_offset, dtype=torch.int32, device=device)
    if group_offset.numel() != 1 or group_offset.dtype != torch.int32:
        raise ValueError(
            f"{api}: group_offset must be one int32 value, got {group_offset.dtype} "
            f"{tuple(group_offset.shape)}"
        )
    return group_offset.reshape(())


# PyTorch/XLA's ops for these kernels inside traced graphs (``torch.ops.xla.flash_attention``,
# ``torch.ops.xla.gmm``, under torch.compile). flash_attention is composite: it becomes the fused
# attention op, differentiable; gmm is one op whose fake kernel gives its shape, run by ``gmm``.
_OPS = torch.library.Library("xla", "FRAGMENT")
_OPS.define("flash_attention(Tensor q, Tensor k, Tensor v, bool casual=False) -> Tensor")
_OPS.impl(
    "flash_attention",
    lambda q, k, v, casual=False: flash_attention(q, k, v, causal=casual),
    "CompositeImplicitAutograd",
)
_OPS.define(
    "gmm(Tensor lhs, Tensor rhs, Tensor group_sizes, int[]? tiling=None, "
    "Tensor? group_offset=None, bool transpose_rhs=False) -> Tensor"
)


@torch.library.register_fake("xla::gmm", lib=_OPS)
def _gmm_shape(lhs, rhs, group_sizes, tiling=None, group_offset=None, transpose_rhs=False):
    return lhs.new_empty(lhs.shape[0], rhs.shape[1] if transpose_rhs else rhs.shape[2])


dispatch.SPECIALS[torch.ops.xla.gmm.default] = lambda func, args, kwargs: gmm(*args, **kwargs)
