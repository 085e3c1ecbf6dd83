"""flash_attention (torch_xla.experimental.custom_kernel) as traced ops: values and gradients
against a float64 eager-CPU attention written out here, masks, SPMD sharding, argument errors."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import spmd_torch
import spmd_torch.distributed.spmd as xs
import spmd_torch.runtime as xr
from spmd_torch._lazy import counters, engine
from spmd_torch.debug import graph
from spmd_torch.experimental.custom_kernel import DEFAULT_MASK_VALUE, flash_attention
from tests.helpers import (
    assert_close,
    assert_compiles,
    assert_counter_delta,
    lowered_as_on,
    pallas_interpreted,
    pallas_kernel_shapes,
    reference,
    to_cpu,
    tolerance,
)

dev = spmd_torch.device()


def attention_float64(q, k, v, causal=False, q_ids=None, kv_ids=None, sm_scale=1.0, ab=None):
    """softmax((q k^T + ab) * sm_scale, masked keys at -inf) v, in float64 on CPU."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = q @ k.transpose(-2, -1)
    if ab is not None:
        scores = scores + ab.double()
    scores = scores * sm_scale
    allowed = torch.ones(scores.shape, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    if q_ids is not None:
        allowed &= (q_ids[..., :, None] == kv_ids[..., None, :]).unsqueeze(-3)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _qkv(shape=(2, 3, 16, 8), kv_seq_len=None, dtype=torch.float32):
    kv_shape = (*shape[:-2], kv_seq_len or shape[-2], shape[-1])
    return (
        _randn(*shape, dtype=dtype, seed=1),
        _randn(*kv_shape, dtype=dtype, seed=2),
        _randn(*kv_shape, dtype=dtype, seed=3),
    )


def _padding_ids(batch: int, seq_len: int, lengths: list[int]) -> torch.Tensor:
    """Segment id 1 on each sequence's tokens, 0 on its padding."""
    ids = torch.zeros(batch, seq_len, dtype=torch.int32)
    for row, length in enumerate(lengths):
        ids[row, :length] = 1
    return ids


def check_against_float64(q, k, v, ab=None, **options):
    """Forward values and the gradients of q, k, v (and ab) match the float64 reference within
    float32's tolerance; returns the device output."""
    cpu_tensors = {"q": q, "k": k, "v": v} | ({} if ab is None else {"ab": ab})
    cotangent = _randn(*q.shape, seed=9)

    leaves64 = {n: t.double().requires_grad_() for n, t in cpu_tensors.items()}
    expected = attention_float64(**leaves64, **options)
    grads64 = torch.autograd.grad(expected, list(leaves64.values()), cotangent.double())

    leaves = {n: t.to(dev).requires_grad_() for n, t in cpu_tensors.items()}
    moved = {n: o.to(dev) if isinstance(o, torch.Tensor) else o for n, o in options.items()}
    renamed = {"q_ids": "q_segment_ids", "kv_ids": "kv_segment_ids"}
    actual = flash_attention(**leaves, **{renamed.get(n, n): o for n, o in moved.items()})
    grads = torch.autograd.grad(actual, list(leaves.values()), cotangent.to(dev))

    assert_close(actual, expected.float())
    grad_tol = tolerance(torch.float32, "grad")
    assert_close(
        dict(zip(leaves, grads)), {n: g.float() for n, g in zip(leaves, grads64)}, **grad_tol
    )
    return actual


def test_plain_attention_matches_float64():
    check_against_float64(*_qkv())


def test_causal_attention_matches_float64():
    check_against_float64(*_qkv(), causal=True)


def test_causal_mask_starts_at_the_first_key_when_lengths_differ():
    check_against_float64(*_qkv((2, 2, 8, 4), kv_seq_len=20), causal=True)


def test_padding_segment_ids_match_float64():
    ids = _padding_ids(2, 16, [11, 16])
    check_against_float64(*_qkv(), q_ids=ids, kv_ids=ids)


def test_packed_segments_with_causal_match_float64():
    ids = torch.tensor([[1] * 5 + [2] * 7 + [3] * 4, [4] * 16], dtype=torch.int32)
    check_against_float64(*_qkv(), causal=True, q_ids=ids, kv_ids=ids)


def test_attention_bias_and_its_gradient_match_float64():
    check_against_float64(*_qkv(), ab=_randn(2, 3, 16, 16, seed=4))


def test_sm_scale_multiplies_the_biased_scores():
    check_against_float64(*_qkv(), ab=_randn(2, 3, 16, 16, seed=4), sm_scale=8**-0.5)


def test_more_leading_batch_dimensions_match_float64():
    q, k, v = _qkv((2, 2, 3, 12, 4))
    ids = torch.tensor([[1] * 8 + [0] * 4, [1] * 12]).expand(2, 2, 12).contiguous()
    check_against_float64(q, k, v, causal=True, q_ids=ids, kv_ids=ids)


def test_fully_masked_query_averages_all_values():
    # Query 0 has segment 2, which no key has: every score gets the mask value, as in the kernel,
    # and the softmax is even over all keys.
    q, k, v = _qkv((1, 2, 6, 4))
    q_ids = torch.tensor([[2, 1, 1, 1, 1, 1]])
    kv_ids = torch.ones(1, 6, dtype=torch.int64)
    out = flash_attention(
        q.to(dev), k.to(dev), v.to(dev), True, q_ids.to(dev), kv_ids.to(dev)
    ).cpu()
    assert_close(out[:, :, 0], v.double().mean(-2).float())
    assert_close(out[:, :, 1:], attention_float64(q, k, v, True, q_ids, kv_ids)[:, :, 1:].float())


def _fully_masked_rows_step(shape, q_ids, kv_ids, sm_scale):
    """A causal step where some queries' segments have no key, against float64: the kernel gives
    such a query the mask value on every score, so its scores' gradient is the softmax's at even
    probabilities rather than zero: scores that are 0 in value and the scores in gradient."""
    q, k, v = _qkv(shape)
    cotangent = _randn(*shape, seed=9)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    scores = leaves64[0] @ leaves64[1].transpose(-2, -1) * sm_scale
    masked_row = (q_ids != 1)[..., None, :, None]
    visible = torch.ones(shape[2], shape[2], dtype=torch.bool).tril() & masked_row.logical_not()
    scores = torch.where(masked_row, scores - scores.detach(), scores.masked_fill(~visible, -1e300))
    expected = torch.softmax(scores, -1) @ leaves64[2]
    expected_grads = torch.autograd.grad(expected, leaves64, cotangent.double())

    leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, True, q_ids.to(dev), kv_ids.to(dev), sm_scale)
    grads = torch.autograd.grad(out, leaves, cotangent.to(dev))
    spmd_torch.sync()
    assert_close(out, expected.float())
    assert_close(
        list(grads), [g.float() for g in expected_grads], **tolerance(torch.float32, "grad")
    )


def test_queries_seeing_no_key_keep_every_tile_of_a_long_sequence(monkeypatch):
    """600 queries, two ids tensors, causal: two queries of the first query tile see no key, so
    that tile computes all 5 key blocks (they average every key); the second skips the block
    after its last query; values and gradients as float64's."""
    listed, computed = _count_tiles(monkeypatch)
    q_ids = torch.ones(1, 600, dtype=torch.int64)
    q_ids[0, [3, 100]] = 2
    _fully_masked_rows_step((1, 2, 600, 8), q_ids, torch.ones(1, 600, dtype=torch.int64), 0.5)
    assert listed == [15, 15] and len(computed) == 2 * (5 + 4 + 5)


def test_fully_masked_query_backpropagates_as_the_kernel():
    q_ids, kv_ids = torch.tensor([[2, 1, 1, 3, 1, 1]]), torch.ones(1, 6, dtype=torch.int64)
    _fully_masked_rows_step((1, 2, 6, 4), q_ids, kv_ids, 0.5)


def test_fully_masked_query_on_the_tpu_kernel_backpropagates_from_its_residuals(monkeypatch):
    """The kernel's backward starts from the forward's shift and sum: where a query sees no key
    the shift is the mask value, and the sum (the keys averaged) must survive to the backward,
    which one log-sum-exp would not carry."""
    q_ids, kv_ids = torch.ones(1, 128, dtype=torch.int64), torch.ones(1, 128, dtype=torch.int64)
    q_ids[0, 0], q_ids[0, 70] = 2, 3
    with pallas_interpreted(monkeypatch):
        with assert_counter_delta("AttentionBackward::pallas", 1):
            _fully_masked_rows_step((1, 2, 128, 32), q_ids, kv_ids, 0.25)


def test_bfloat16_output_is_the_float64_result_rounded_once():
    q, k, v = _qkv(dtype=torch.bfloat16)
    ids = _padding_ids(2, 16, [9, 16])
    out = flash_attention(q.to(dev), k.to(dev), v.to(dev), True, ids.to(dev), ids.to(dev), 0.5)
    assert out.dtype == torch.bfloat16
    # reference() runs it on the inputs upcast to float64 and rounds the result once to bf16.
    expected = reference(
        lambda *args: attention_float64(*args).to(q.dtype), q, k, v, True, ids, ids, 0.5
    )
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_without_a_bias_enters_the_fused_op_as_it_is(dtype):
    """bfloat16/float16 q, k, v with no segment ids or ``ab`` reach the fused op in their dtype,
    ``sm_scale`` as its scale (what cuDNN's kernel takes on a GPU): the output and gradients
    are the float64 attention's within the dtype's tolerance, and the op reads no float32 copy."""
    q, k, v = (t.to(dtype) for t in _qkv(shape=(2, 4, 32, 16)))
    leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, causal=True, sm_scale=0.3)
    text = graph.pending_text([out])
    call = next(line for line in text.splitlines() if "fused_attention_overrideable" in line)
    half = {torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]
    assert call.startswith("%") and f":{half}[2,4,32,16]" in call and "scale=0.3" in call
    cotangent = _randn(*q.shape, seed=9)
    grads = torch.autograd.grad(out, leaves, cotangent.to(dev, dtype))
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    expected = attention_float64(*leaves64, causal=True, sm_scale=0.3)
    grads64 = torch.autograd.grad(expected, leaves64, cotangent.double())
    assert out.dtype == dtype
    assert_close(out, expected.to(dtype), **tolerance(dtype))
    assert_close(list(grads), [g.to(dtype) for g in grads64], tol="attention", kind="grad")


def test_half_precision_flash_attention_lowers_to_cudnn_for_nvidia_gpus(monkeypatch):
    """PyTorch/XLA scripts that call the TPU kernel get cuDNN's on an NVIDIA GPU: checked by
    lowering for CUDA without one (``lowered_as_on``)."""
    q, k, v = (t.to(torch.bfloat16).to(dev).requires_grad_() for t in _qkv((1, 4, 96, 32)))
    out = flash_attention(q, k, v, causal=True, sm_scale=32**-0.5)
    out.float().sum().backward()
    text = lowered_as_on("cuda", [out, q.grad, k.grad, v.grad], monkeypatch).as_text()
    assert "__cudnn$fmhaSoftmax(" in text and "__cudnn$fmhaSoftmaxBackward(" in text


def test_a_new_sm_scale_reuses_the_compiled_program():
    q, k, v = (t.to(dev) for t in _qkv())
    outputs = []
    with assert_compiles(1):
        for sm_scale in (0.5, 0.25):
            outputs.append(flash_attention(q, k, v, sm_scale=sm_scale))
            spmd_torch.sync()
    for out, sm_scale in zip(outputs, (0.5, 0.25)):
        assert_close(out, attention_float64(*_qkv(), sm_scale=sm_scale).float())


def test_sharded_attention_matches_and_keeps_the_spec():
    xr.use_spmd()
    mesh = xs.Mesh(np.arange(8), (8,), ("data",))
    spec = ("data", None, None, None)
    q, k, v = _qkv((8, 2, 16, 4))
    ids = _padding_ids(8, 16, [16, 3, 9, 12, 16, 1, 7, 16])
    leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
    out = flash_attention(
        *leaves, True, ids.to(dev), ids.to(dev), 0.5, partition_spec=spec, mesh=mesh
    )
    out.sum().backward()
    spmd_torch.sync()
    sharded = "{devices=[8,1,1,1]0,1,2,3,4,5,6,7}"
    assert xs.get_xla_sharding_spec(out) == sharded
    assert [xs.get_xla_sharding_spec(t.grad) for t in leaves] == [sharded] * 3

    cpu = [t.double().requires_grad_() for t in (q, k, v)]
    expected = attention_float64(*cpu, True, ids, ids, 0.5)
    expected.sum().backward()
    assert_close(out, expected.float())
    grads = to_cpu([t.grad for t in leaves])
    assert_close(grads, [t.grad.float() for t in cpu], **tolerance(torch.float32, "grad"))
    xr.reset()


def test_sharded_attention_takes_the_global_mesh():
    xr.use_spmd()
    xs.set_global_mesh(xs.Mesh(np.arange(8), (2, 4), ("data", "model")))
    try:
        q, k, v = _qkv((2, 4, 8, 4))
        ab = _randn(2, 4, 8, 8, seed=4)
        spec = ("data", "model", None, None)
        out = flash_attention(q.to(dev), k.to(dev), v.to(dev), ab=ab.to(dev), partition_spec=spec)
        spmd_torch.sync()
    finally:
        xs.set_global_mesh(None)
    assert xs.get_xla_sharding_spec(out) == "{devices=[2,4,1,1]0,1,2,3,4,5,6,7}"
    assert_close(out, attention_float64(q, k, v, ab=ab).float())
    xr.reset()


def test_a_partition_spec_lowers_for_tpus_to_the_kernel_the_partitioner_splits(monkeypatch):
    """As PyTorch/XLA runs its kernel under a ``partition_spec``, on each device's batch and
    heads: lowered for TPU, the kernel (which the partitioner cannot split by itself) is the op
    split by spmd_torch's rule, forward and backward, never a call on the whole inputs. The values
    and gradients are the float64 attention's."""
    xr.use_spmd()
    try:
        mesh = xs.Mesh(np.arange(8), (4, 2), ("fsdp", "tensor"))
        q, k, v = (t.to(torch.bfloat16) for t in _qkv((8, 4, 128, 64)))
        leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
        spec = ("fsdp", "tensor", None, None)
        out = flash_attention(*leaves, causal=True, sm_scale=0.125, partition_spec=spec, mesh=mesh)
        cotangent = _randn(*q.shape, seed=9).to(torch.bfloat16)
        grads = torch.autograd.grad(out, leaves, cotangent.to(dev))
        text = lowered_as_on("tpu", [out, *grads], monkeypatch).as_text()
        assert text.count("@CustomSPMDPartitioning(") == 2 and "@tpu_custom_call(" not in text
        monkeypatch.undo()  # lowered for this host again
        leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
        expected = attention_float64(*leaves64, causal=True, sm_scale=0.125)
        grads64 = torch.autograd.grad(expected, leaves64, cotangent.double())
        assert_close(out, expected.to(torch.bfloat16), **tolerance(torch.bfloat16))
        assert_close(
            list(grads), [g.to(torch.bfloat16) for g in grads64], tol="attention", kind="grad"
        )
    finally:
        xr.reset()


def test_a_partition_spec_on_the_tpu_path_runs_the_kernel_per_shard_with_float64s_values(
    monkeypatch,
):
    """The same call on the TPU path with its values: the Pallas kernel, run by Pallas's
    interpreter and traced by XLA's partitioner on each device's (2, 2, 128, 64) shards, gives
    float64 attention's output and gradients."""
    xr.use_spmd()
    try:
        mesh = xs.Mesh(np.arange(8), (4, 2), ("fsdp", "tensor"))
        q, k, v = (t.to(torch.bfloat16) for t in _qkv((8, 4, 128, 64)))
        cotangent = _randn(*q.shape, seed=9).to(torch.bfloat16)
        with pallas_interpreted(monkeypatch):
            shapes = pallas_kernel_shapes(monkeypatch, while_compiling=True)
            leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
            spec = ("fsdp", "tensor", None, None)
            with assert_counter_delta("Attention::pallas", 1):
                out = flash_attention(
                    *leaves, causal=True, sm_scale=0.125, partition_spec=spec, mesh=mesh
                )
                grads = torch.autograd.grad(out, leaves, cotangent.to(dev))
                spmd_torch.sync()
        assert shapes and set(shapes) == {(2, 2, 128, 64)}, shapes
        leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
        expected = attention_float64(*leaves64, causal=True, sm_scale=0.125)
        grads64 = torch.autograd.grad(expected, leaves64, cotangent.double())
        assert_close(out, expected.to(torch.bfloat16), tol="flash_kernel")
        assert_close(
            list(grads), [g.to(torch.bfloat16) for g in grads64], tol="attention", kind="grad"
        )
    finally:
        xr.reset()


def _packed_ids(batch: int, seq_len: int) -> torch.Tensor:
    """Three packed sequences a row, of lengths differing by row (every query has its own key)."""
    cuts = [[seq_len // 4 + 8 * row, seq_len // 2 + 16 * row] for row in range(batch)]
    positions = torch.arange(seq_len)
    return torch.stack([(positions >= a).int() + (positions >= b).int() for a, b in cuts])


@pytest.mark.parametrize("partitioned", [False, True], ids=["one_device", "split_4x2"])
@pytest.mark.parametrize("extras", ["segments", "ab", "ab_and_segments"])
def test_ab_and_segment_ids_reach_the_tpu_kernel_with_float64s_values(
    monkeypatch, extras, partitioned
):
    """On the TPU path the Pallas kernel takes segment ids and ``ab`` as they are (PyTorch/XLA's
    call): on one device, and split by the partitioner over a (4, 2) mesh, each device's kernel
    on its (2, 2, 128, 32) shards and its rows of ids and ``ab``. Values and gradients (``ab``'s
    too) are float64 attention's."""
    shape = (8, 4, 128, 32) if partitioned else (2, 2, 256, 32)
    tensors = dict(zip("qkv", _qkv(shape)))
    if "ab" in extras:
        tensors["ab"] = _randn(*shape[:3], shape[2], seed=4)
    ids = _packed_ids(shape[0], shape[2]) if "segments" in extras else None
    cotangent = _randn(*shape, seed=9)
    mesh = xs.Mesh(np.arange(8), (4, 2), ("fsdp", "tensor")) if partitioned else None
    spec = ("fsdp", "tensor", None, None) if partitioned else None
    if partitioned:
        xr.use_spmd()
    try:
        with pallas_interpreted(monkeypatch):
            shapes = pallas_kernel_shapes(monkeypatch, while_compiling=partitioned)
            leaves = {n: t.to(dev).requires_grad_() for n, t in tensors.items()}
            with assert_counter_delta("Attention::pallas", 1):
                out = flash_attention(
                    causal=True,
                    q_segment_ids=None if ids is None else ids.to(dev),
                    kv_segment_ids=None if ids is None else ids.to(dev),
                    sm_scale=0.25,
                    partition_spec=spec,
                    mesh=mesh,
                    **leaves,
                )
                grads = torch.autograd.grad(out, list(leaves.values()), cotangent.to(dev))
                spmd_torch.sync()
    finally:
        if partitioned:
            xr.reset()
    assert shapes and set(shapes) == {(2, 2, 128, 32) if partitioned else shape}, shapes
    leaves64 = {n: t.double().requires_grad_() for n, t in tensors.items()}
    expected = attention_float64(causal=True, q_ids=ids, kv_ids=ids, sm_scale=0.25, **leaves64)
    grads64 = torch.autograd.grad(expected, list(leaves64.values()), cotangent.double())
    assert_close(out, expected.float())
    assert_close(list(grads), [g.float() for g in grads64], kind="grad")


@pytest.mark.parametrize("extras", ["segments", "ab"])
def test_the_tpu_kernel_runs_its_forward_once_with_segment_ids_or_ab(monkeypatch, extras):
    """Lowered for TPU, a step with segment ids or ``ab`` calls the kernel's forward once: its
    backward starts from the forward's residuals, shift and sum (the op is ours: ATen's has one
    slot for them, and the backward ran the forward again)."""
    q, k, v = (t.to(dev).requires_grad_() for t in _qkv((2, 2, 128, 32)))
    ids = _packed_ids(2, 128).to(dev)
    options = {"q_segment_ids": ids, "kv_segment_ids": ids}
    if extras == "ab":
        options = {"ab": _randn(2, 2, 128, 128).to(dev).requires_grad_()}
    out = flash_attention(q, k, v, causal=True, **options)
    grads = torch.autograd.grad(out.sum(), [q, k, v, *options.values()][: 3 + (extras == "ab")])
    text = lowered_as_on("tpu", [out, *grads], monkeypatch).as_text()
    kernels = re.findall(r'tpu_custom_call.*kernel_name = "(\w+)"', text)
    assert sorted(kernels) == [
        "_flash_attention_dkv_kernel",
        "_flash_attention_dq_kernel",
        "_flash_attention_kernel",
    ], kernels


def test_a_row_of_minus_inf_in_ab_gives_zeros_on_the_tpu_kernel(monkeypatch):
    """The kernel would make NaNs of a query whose every score ``ab`` sets to ``-inf``; it gives
    zeros and finite gradients, as the blockwise form (and PyTorch's attention) does."""
    q, k, v = _qkv((1, 2, 128, 32))
    ab = _randn(1, 2, 128, 128, seed=4)
    ab[0, 1, 5] = -torch.inf
    leaves = [t.to(dev).requires_grad_() for t in (q, k, v, ab)]
    with pallas_interpreted(monkeypatch):
        with assert_counter_delta("Attention::pallas", 1):
            out = flash_attention(*leaves[:3], sm_scale=0.25, ab=leaves[3])
            grads = torch.autograd.grad(out.sum(), leaves)
            spmd_torch.sync()
    expected = attention_float64(q, k, v, sm_scale=0.25, ab=ab).nan_to_num(0.0)
    assert_close(out, expected.float())
    assert torch.count_nonzero(out.cpu()[0, 1, 5]) == 0
    assert all(bool(g.cpu().isfinite().all()) for g in grads)


def test_segment_ids_hold_no_whole_mask():
    """Packed sequences of 2048 tokens: elsewhere than on TPU the blockwise form builds each key
    block's mask from the ids, so the step's temporaries (forward and backward, by XLA's
    analysis) stay under one (seq x seq) float32 matrix; a mask tensor made of them was about
    three such matrices (50.6 MB against 16.8 MB)."""
    seq = 2048
    q, k, v = (t.to(dev).requires_grad_() for t in _qkv((1, 2, seq, 16)))
    ids = _packed_ids(1, seq).to(dev)
    out = flash_attention(q, k, v, causal=True, q_segment_ids=ids, kv_segment_ids=ids)
    ops = [str(n.op) for n in graph.pending_program([out]).nodes]
    assert ops.count("xla.flash_kernel_attention.default") == 1, ops
    torch.autograd.grad(out.sum(), [q, k, v])
    spmd_torch.sync()
    cache = engine.current().cache
    analysis = cache.executables[cache.history[-1]].compiled.memory_analysis()
    assert analysis.temp_size_in_bytes < seq * seq * 4, analysis.temp_size_in_bytes


def test_an_uneven_partition_spec_gives_float64s_values():
    """A batch the mesh axis does not divide: the partitioner pads it, with the same values."""
    xr.use_spmd()
    try:
        mesh = xs.Mesh(np.arange(8), (8,), ("data",))
        q, k, v = _qkv((6, 2, 16, 4))
        out = flash_attention(
            *(t.to(dev) for t in (q, k, v)), partition_spec=("data", None, None, None), mesh=mesh
        )
        assert_close(out, attention_float64(q, k, v).float())
    finally:
        xr.reset()


def test_a_partition_spec_of_mesh_axis_numbers_traced_by_aot_autograd():
    """PyTorch/XLA's own SPMD tests give mesh axes by number on a mesh without names, and trace
    the call with AOTAutograd (whose functional tensors manual regions cannot enter, which a
    version of this op needed): the output keeps its layout, values and gradients float64's."""
    from functorch.compile import aot_function, make_boxed_func

    xr.use_spmd()
    try:
        xs.set_global_mesh(xs.Mesh(np.arange(8), (8, 1, 1, 1)))
        q, k, v = _qkv((8, 2, 128, 8))
        leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
        traced = aot_function(
            lambda q, k, v: flash_attention(q, k, v, partition_spec=(0, None, None, None)),
            fw_compiler=lambda gm, _: make_boxed_func(gm),
        )
        out = traced(*leaves)
        out.sum().backward()
        assert xs.get_xla_sharding_spec(out) == "{devices=[8,1,1,1]0,1,2,3,4,5,6,7}"
        wide = [t.double().requires_grad_() for t in (q, k, v)]
        expected = attention_float64(*wide)
        expected.sum().backward()
        assert_close(out, expected.float().detach())
        grads = [t.grad for t in leaves]
        assert_close(grads, [t.grad.float() for t in wide], kind="grad")
    finally:
        xs.set_global_mesh(None)
        xr.reset()


def test_forward_and_backward_are_one_program_without_cpu_fallback():
    q, k, v = (t.to(dev).requires_grad_() for t in _qkv())
    ids = _padding_ids(2, 16, [5, 16]).to(dev)
    ab = _randn(2, 3, 16, 16).to(dev).requires_grad_()
    spmd_torch.sync()
    fallbacks_before = {n: c for n, c in counters.COUNTERS.items() if n.startswith("aten::")}
    with assert_compiles(1):
        flash_attention(q, k, v, True, ids, ids, 0.5, ab=ab).sum().backward()
        spmd_torch.sync()
    fallbacks = {n: c for n, c in counters.COUNTERS.items() if n.startswith("aten::")}
    assert fallbacks == fallbacks_before


def test_mask_value_is_the_kernels():
    assert DEFAULT_MASK_VALUE == -0.7 * float(np.finfo(np.float32).max)


_Q = torch.zeros(2, 3, 16, 8)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"k": torch.zeros(1, 3, 16, 8)}, ValueError, "batch and head"),
        ({"v": torch.zeros(2, 4, 16, 8)}, ValueError, "batch and head"),
        ({"k": torch.zeros(2, 3, 16, 4)}, ValueError, "head_dim mismatch"),
        ({"v": torch.zeros(2, 3, 12, 8)}, ValueError, "kv_seq_len mismatch"),
        ({"v": torch.zeros(2, 3, 16, 4)}, NotImplementedError, "v's head_dim"),
        ({"q": torch.zeros(16, 8)}, ValueError, "at least 3"),
        ({"q": torch.zeros(2, 3, 16, 8, dtype=torch.int32)}, TypeError, "q must be a floating"),
        ({"ab": torch.zeros(2, 3, 16, 8)}, ValueError, "ab must be"),
        ({"q_segment_ids": torch.ones(2, 16)}, AssertionError, "got only q_segment_ids"),
        ({"kv_segment_ids": torch.ones(2, 16)}, AssertionError, "got only kv_segment_ids"),
        (
            {"q_segment_ids": torch.ones(2, 15), "kv_segment_ids": torch.ones(2, 16)},
            ValueError,
            "q_segment_ids must be",
        ),
        (
            {"q_segment_ids": torch.ones(2, 16), "kv_segment_ids": torch.ones(3, 16)},
            ValueError,
            "kv_segment_ids must be",
        ),
        ({"partition_spec": ("data", None, None)}, ValueError, "partition_spec"),
        ({"partition_spec": ("data", None, None, None)}, ValueError, "no mesh"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_arguments_raise(kwargs, error, match):
    arguments = {"q": _Q, "k": _Q, "v": _Q} | kwargs
    arguments = {n: t.to(dev) if isinstance(t, torch.Tensor) else t for n, t in arguments.items()}
    with pytest.raises(error, match=match):
        flash_attention(**arguments)


# ---- repeat_with_fixed_output_size ----------------------------------------------------------


@pytest.mark.parametrize(
    "repeats,total",
    [
        ([0, 1, 2, 0, 4, 0, 6, 7, 8, 9], 20),  # cut short
        ([0, 5, 2, 0, 4, 9, 6, 7, 8, 0], 100),  # padded with the last element
        ([3, 6, 2, 14, 27, 47, 8, 28, 0, 1], 135),
    ],
)
def test_repeat_with_fixed_output_size_is_repeat_interleave_cut_or_padded(repeats, total):
    from spmd_torch.experimental.custom_kernel import repeat_with_fixed_output_size

    x, repeats = torch.arange(10, dtype=torch.int32), torch.tensor(repeats)
    expected = torch.repeat_interleave(x, repeats)[:total]
    expected = torch.cat([expected, x[-1].repeat(total - expected.shape[0])])
    counters.COUNTERS.clear()
    result = repeat_with_fixed_output_size(x.to(dev), repeats.to(dev), total)
    assert not [n for n in counters.COUNTERS if n.startswith("aten::")]  # no CPU fallback
    assert torch.equal(result.cpu(), expected)


def _count_tiles(monkeypatch) -> tuple[list, list]:
    """(the number of tiles each blockwise loop lists, one entry a loop; one entry per tile the
    program computes when it runs, skipped tiles left out)."""
    import jax

    from spmd_torch._lazy.lowering import attention

    listed, computed = [], []
    visible_tiles, unless_unseen = attention._visible_tiles, attention._Problem.unless_unseen

    def counted(self, step):
        def step_counted(carry, tile):
            jax.debug.callback(lambda: computed.append(1))
            return step(carry, tile)

        return unless_unseen(self, step_counted)

    monkeypatch.setattr(
        attention,
        "_visible_tiles",
        lambda *a: listed.append(len(visible_tiles(*a))) or visible_tiles(*a),
    )
    monkeypatch.setattr(attention._Problem, "unless_unseen", counted)
    return listed, computed


@pytest.mark.parametrize("shared", [True, False], ids=["one_ids_tensor", "two_ids_tensors"])
def test_long_packed_causal_attention_skips_tiles_where_queries_see_themselves(monkeypatch, shared):
    """Packed causal sequences of 600 tokens (3 query tiles x 5 key blocks), against float64.
    One ids tensor given for queries and keys: every query sees itself, so the 4 tiles above the
    diagonal are left out of the program, forward and backward. Two tensors (here equal, which
    tracing cannot know): a query might see no key and then averages them all, so all 15 tiles
    are in the program, and each is skipped when it runs if none of its queries sees any of its
    keys while each sees one elsewhere: the same 11 are computed."""
    listed, computed = _count_tiles(monkeypatch)
    q, k, v = _qkv((2, 2, 600, 8))
    positions = torch.arange(600)
    ids = torch.stack([(positions >= 150).int() + (positions >= 420).int(), positions * 0])
    cotangent = _randn(*q.shape, seed=9)
    leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
    q_ids = ids.to(dev)
    kv_ids = q_ids if shared else ids.to(dev)
    out = flash_attention(*leaves, True, q_ids, kv_ids)
    grads = torch.autograd.grad(out, leaves, cotangent.to(dev))
    spmd_torch.sync()
    assert listed == ([11, 11] if shared else [15, 15])
    assert len(computed) == 22
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    expected = attention_float64(*leaves64, True, ids, ids)
    grads64 = torch.autograd.grad(expected, leaves64, cotangent.double())
    assert_close(out, expected.float())
    assert_close(list(grads), [g.float() for g in grads64], **tolerance(torch.float32, "grad"))
