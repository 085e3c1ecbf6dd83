"""splash_attention (torch_xla.experimental.splash_attention) as one op each way: values and
gradients against a float64 eager-CPU attention written out here, on this host's blockwise and
plain forms and on the TPU path (the Pallas splash kernel, interpreted); SPMD; errors."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

import spmd_torch
import spmd_torch.distributed.spmd as xs
import spmd_torch.runtime as xr
from spmd_torch._lazy import engine
from spmd_torch.debug import graph
from spmd_torch.experimental.splash_attention import SplashAttentionConfig, splash_attention
from tests.helpers import (
    assert_close,
    assert_compiles,
    assert_counter_delta,
    cudnn_stood_in,
    lowered_as_on,
    pallas_interpreted,
    tolerance,
)

dev = spmd_torch.device()


def splash_float64(q, k, v, ids=None, causal=True, window=None, soft_cap=None):
    """softmax(mask(cap(q k^T))) v in float64 on CPU, key/value heads repeated per group."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-2, -1)
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    rows, cols = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None]
    seen = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    if causal:
        seen &= cols <= rows
    if window is not None:
        seen &= (rows - cols).abs() <= window
    seen = seen[None, None]
    if ids is not None:
        seen = seen & (ids[:, None, :, None] == ids[:, None, None, :])
    return torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1) @ v


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _inputs(batch=2, heads=4, kv_heads=2, seq=64, dim=16):
    """q scaled as a caller scales it (splash attention has no scale of its own)."""
    return (
        _randn(batch, heads, seq, dim, seed=1, scale=dim**-0.5),
        _randn(batch, kv_heads, seq, dim, seed=2),
        _randn(batch, kv_heads, seq, dim, seed=3),
    )


def _packed_ids(batch: int, seq: int) -> torch.Tensor:
    """Four packed sequences a row, cut at different places in each row (the last cut inside
    the last tile of 256 queries at 640 tokens)."""
    positions = torch.arange(seq)
    cuts = [
        (seq // 4 + 8 * row, seq // 2 + 16 * row, seq * 7 // 8 - 8 * row) for row in range(batch)
    ]
    return torch.stack([sum((positions >= cut).int() for cut in row) for row in cuts])


def _config(window=None, **blocks) -> str:
    return SplashAttentionConfig(
        attentiontype_local_sliding=window is not None, slide_window_size=window, **blocks
    ).to_json()


def _check_against_float64(seq, form, *, ids=False, causal=True, window=None, soft_cap=None):
    q, k, v = _inputs(seq=seq)
    segment_ids = _packed_ids(q.shape[0], seq) if ids else None
    _run_and_compare(
        q, k, v, f"Attention::{form}", _config(window), segment_ids, causal, window, soft_cap
    )


def _run_and_compare(q, k, v, counter, config, ids, causal, window, soft_cap):
    """One program runs splash attention forward and backward (counted under ``counter``); its
    output and gradients equal float64 attention's."""
    cotangent = _randn(*q.shape, seed=9)
    leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
    with assert_counter_delta(counter, 1):
        out = splash_attention(
            *leaves,
            config,
            None if ids is None else ids.to(dev),
            causal=causal,
            attn_logits_soft_cap=soft_cap,
        )
        grads = torch.autograd.grad(out, leaves, cotangent.to(dev))
        spmd_torch.sync()
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    expected = splash_float64(*leaves64, ids, causal, window, soft_cap)
    grads64 = torch.autograd.grad(expected, leaves64, cotangent.double())
    assert_close(out, expected.float())
    assert_close(list(grads), [g.float() for g in grads64], kind="grad")


_MASKS = {
    "causal": {},
    "full": {"causal": False},
    "causal_window": {"window": 24},
    "full_window": {"causal": False, "window": 7},
    "wide_window": {"causal": False, "window": 129},  # at 640 its edges touch tiles' corners
    "segments": {"ids": True},
    "segments_window_cap": {"ids": True, "window": 40, "soft_cap": 2.0},
    "full_segments_cap": {"causal": False, "ids": True, "soft_cap": 1.5},
}


@pytest.mark.parametrize("mask", _MASKS)
@pytest.mark.parametrize("seq, form", [(64, "plain"), (640, "blockwise")])
def test_values_and_gradients_match_float64(mask, seq, form):
    """Grouped heads (4 query heads, 2 key/value heads) with each mask and cap, in both of this
    host's forms: plain for few keys, blockwise (over 384) whose mask is built per key block."""
    _check_against_float64(seq, form, **_MASKS[mask])


def test_one_op_each_way_and_one_program():
    q, k, v = (t.to(dev).requires_grad_() for t in _inputs())
    ids = _packed_ids(2, 64).to(dev)
    spmd_torch.sync()
    with assert_compiles(1):
        out = splash_attention(q, k, v, _config(8), ids, attn_logits_soft_cap=3.0)
        assert [str(n.op) for n in graph.pending_program([out]).nodes].count(
            "xla.splash_attention.default"
        ) == 1
        grads = torch.autograd.grad(out.sum(), [q, k, v])
        ops = [str(n.op) for n in graph.pending_program(list(grads)).nodes]
        assert ops.count("xla.splash_attention_backward.default") == 1, ops
        assert not [op for op in ops if "softmax" in op or "bmm" in op], ops
        spmd_torch.sync()


def test_a_long_packed_sequence_holds_no_whole_mask():
    """Packed sequences of 2048 tokens with a window: the step's temporaries (forward and
    backward, by XLA's analysis) stay under one (seq x seq) float32 matrix."""
    seq = 2048
    q, k, v = (t.to(dev).requires_grad_() for t in _inputs(batch=1, heads=2, kv_heads=1, seq=seq))
    ids = _packed_ids(1, seq).to(dev)
    out = splash_attention(q, k, v, _config(256), ids)
    torch.autograd.grad(out.sum(), [q, k, v])
    spmd_torch.sync()
    cache = engine.current().cache
    analysis = cache.executables[cache.history[-1]].compiled.memory_analysis()
    assert analysis.temp_size_in_bytes < seq * seq * 4, analysis.temp_size_in_bytes


@pytest.mark.parametrize(
    "causal, window, cudnn",
    [(True, None, True), (True, 16, True), (False, 16, False)],
    ids=["causal", "causal_window", "full_window"],
)
def test_half_precision_lowers_to_cudnn_for_nvidia_gpus_where_it_applies(
    monkeypatch, causal, window, cudnn
):
    """Lowered for CUDA (``lowered_as_on``): bf16 causal attention with grouped heads is cuDNN's
    kernel each way, with a window too (cuDNN's sliding window of ``window + 1`` keys, the
    query's own included); a window looking ahead too is the blockwise form (cuDNN's window
    looks back only)."""
    q, k, v = (t.to(torch.bfloat16).to(dev).requires_grad_() for t in _inputs(seq=96, dim=32))
    out = splash_attention(q, k, v, _config(window), causal=causal)
    grads = torch.autograd.grad(out.float().sum(), [q, k, v])
    text = lowered_as_on("cuda", [out, *grads], monkeypatch).as_text()
    forward = re.findall(r"__cudnn\$fmhaSoftmax\(.*", text)
    backward = re.findall(r"__cudnn\$fmhaSoftmaxBackward\(.*", text)
    assert (len(forward) > 0, len(backward)) == ((True, 1) if cudnn else (False, 0))
    if window is not None and cudnn:
        length = f"sliding_window_length\\22: {window + 1}"  # the config's quotes escaped
        assert all(length in call for call in forward + backward), forward + backward


def test_sharded_windowed_attention_runs_cudnn_on_each_devices_shard(monkeypatch):
    """Under SPMD with the config's (4, 2) mesh, on the NVIDIA GPU path (cuDNN's kernel stood in
    for, told the window): causal bf16 attention within a window is the kernel on each device's
    batch of 1, forward and backward, with float64 attention's values."""
    xr.use_spmd()
    try:
        mesh = xs.Mesh(np.arange(8), (4, 2), ("data", "fsdp"))
        config = SplashAttentionConfig(
            mesh=str(mesh), attentiontype_local_sliding=True, slide_window_size=16
        ).to_json()
        q, k, v = (t.to(torch.bfloat16) for t in _inputs(batch=8, kv_heads=2, seq=96, dim=32))
        with cudnn_stood_in(monkeypatch) as shapes:
            leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
            out = splash_attention(*leaves, config)
            grads = torch.autograd.grad(out.float().sum(), leaves)
            spmd_torch.sync()
    finally:
        xr.reset()
    assert shapes and set(shapes) == {(1, 4, 96, 32)}, shapes
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    expected = splash_float64(*leaves64, None, True, 16)
    grads64 = torch.autograd.grad(expected.sum(), leaves64)
    assert_close(out, expected.to(torch.bfloat16), **tolerance(torch.bfloat16))
    expected_grads = [g.to(torch.bfloat16) for g in grads64]
    assert_close(list(grads), expected_grads, tol="attention", kind="grad")


def test_the_cudnn_path_gives_float64s_values_with_a_window(monkeypatch):
    """On the NVIDIA GPU path (cuDNN's kernel stood in for by plain attention on this host, told
    the window), bf16 causal attention within a window of 24 keys: float64 attention's output
    and gradients within bf16's tolerance, the kernel's window passed each way."""
    q, k, v = (t.to(torch.bfloat16) for t in _inputs(seq=96, dim=32))
    cotangent = _randn(*q.shape, seed=9).to(torch.bfloat16)
    with cudnn_stood_in(monkeypatch):
        leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
        with assert_counter_delta("Attention::cudnn", 1):
            out = splash_attention(*leaves, _config(24))
            grads = torch.autograd.grad(out, leaves, cotangent.to(dev))
            spmd_torch.sync()
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    expected = splash_float64(*leaves64, None, True, 24)
    grads64 = torch.autograd.grad(expected, leaves64, cotangent.double())
    assert_close(out, expected.to(torch.bfloat16), **tolerance(torch.bfloat16))
    expected_grads = [g.to(torch.bfloat16) for g in grads64]
    assert_close(list(grads), expected_grads, tol="attention", kind="grad")


# ---- the TPU path: JAX's Pallas splash kernel -----------------------------------------------

_TPU_BLOCKS = {  # the smallest blocks the kernel takes, so 256 tokens make two of each
    field.name: 128 for field in dataclasses.fields(SplashAttentionConfig) if "block" in field.name
}


@pytest.mark.parametrize(
    "options",
    [{}, {"ids": True, "window": 40, "soft_cap": 30.0}, {"causal": False, "ids": True}],
    ids=["causal", "segments_window_cap", "full_segments"],
)
def test_the_tpu_kernel_gives_float64s_values(monkeypatch, options):
    """On the TPU path the splash kernel (run by Pallas's interpreter), with grouped heads,
    block sizes of 128 over sequences of 256: float64 attention's output and gradients."""
    q, k, v = _inputs(seq=256, dim=128)
    ids = _packed_ids(2, 256) if options.get("ids") else None
    window, soft_cap = options.get("window"), options.get("soft_cap")
    causal = options.get("causal", True)
    with pallas_interpreted(monkeypatch):
        config = _config(window, **_TPU_BLOCKS)
        _run_and_compare(q, k, v, "Attention::splash", config, ids, causal, window, soft_cap)


def test_the_tpu_kernel_runs_its_forward_once_a_step(monkeypatch):
    """Lowered for TPU, a step calls the splash kernel's forward once: its backward starts from
    the forward's log-sum-exp (PyTorch/XLA's wrapper differentiates the kernel, which runs the
    forward again)."""
    q, k, v = (t.to(dev).requires_grad_() for t in _inputs(seq=256, dim=128))
    ids = _packed_ids(2, 256).to(dev)
    out = splash_attention(q, k, v, _config(64, **_TPU_BLOCKS), ids)
    grads = torch.autograd.grad(out.sum(), [q, k, v])
    text = lowered_as_on("tpu", [out, *grads], monkeypatch).as_text()
    kernels = re.findall(r'tpu_custom_call.*kernel_name = "(\w+)"', text)
    assert sorted(kernels) == [
        "splash_mha_dkv_segmented_no_residuals",
        "splash_mha_fwd_segmented_residuals",
    ], kernels


@pytest.mark.parametrize("platform", ["tpu", "cpu"])
def test_sharded_attention_keeps_the_configs_spec_with_float64s_values(monkeypatch, platform):
    """Under SPMD with the config's mesh: the output and gradients are sharded by
    ``qkv_partition_spec``; on the TPU path the partitioner splits the kernel over batch and
    heads (each device's (1, 4, 256, 128) shard). Values are float64 attention's."""
    xr.use_spmd()
    try:
        mesh = xs.Mesh(np.arange(8), (4, 2), ("data", "fsdp"))
        config = SplashAttentionConfig(mesh=str(mesh), **_TPU_BLOCKS).to_json()
        q, k, v = _inputs(batch=8, heads=4, kv_heads=4, seq=256, dim=128)
        ids = _packed_ids(8, 256)
        leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
        if platform == "tpu":
            with pallas_interpreted(monkeypatch), assert_counter_delta("Attention::splash", 1):
                out = splash_attention(*leaves, config, ids.to(dev))
                grads = torch.autograd.grad(out.sum(), leaves)
                spmd_torch.sync()
        else:
            out = splash_attention(*leaves, config, ids.to(dev))
            grads = torch.autograd.grad(out.sum(), leaves)
            spmd_torch.sync()
        sharded = "{devices=[8,1,1,1]0,1,2,3,4,5,6,7}"
        assert [xs.get_xla_sharding_spec(t) for t in (out, *grads)] == [sharded] * 4
    finally:
        xr.reset()
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    expected = splash_float64(*leaves64, ids)
    grads64 = torch.autograd.grad(expected.sum(), leaves64)
    assert_close(out, expected.float())
    assert_close(list(grads), [g.float() for g in grads64], kind="grad")


# ---- the config and bad input -----------------------------------------------------------------


def test_the_config_reads_back_what_it_wrote():
    mesh = xs.Mesh(np.arange(8), (4, 2), ("data", "fsdp"))
    config = SplashAttentionConfig(
        sa_block_q=512, mesh=str(mesh), attentiontype_local_sliding=True, slide_window_size=64
    )
    again = SplashAttentionConfig.from_json(config.to_json())
    assert again == config
    assert again.qkv_partition_spec == (("data", "fsdp"), None, None, None)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"sa_block_q": 100}, "sa_block_q=100"),
        ({"sa_q_layout": "HEAD_MINOR"}, "sa_q_layout"),
        ({"attentiontype_local_sliding": True}, "slide_window_size=None"),
        ({"mesh": "a mesh"}, "not str"),
    ],
)
def test_a_bad_config_raises(fields, match):
    with pytest.raises(ValueError, match=match):
        SplashAttentionConfig(**fields)


_X = torch.zeros(2, 4, 16, 8)


@pytest.mark.parametrize(
    "arguments, match",
    [
        ({"k": torch.zeros(2, 3, 16, 8), "v": torch.zeros(2, 3, 16, 8)}, "not a multiple"),
        ({"k": torch.zeros(2, 4, 12, 8), "v": torch.zeros(2, 4, 12, 8)}, "as long"),
        ({"v": torch.zeros(2, 4, 16, 4)}, "one shape"),
        ({"q": torch.zeros(4, 16, 8)}, r"\[batch, heads, seq, dim\]"),
        ({"decoder_segment_ids": torch.zeros(2, 15)}, r"decoder_segment_ids \(2, 15\)"),
        ({"attn_logits_soft_cap": 0.0}, "not positive"),
    ],
)
def test_bad_arguments_raise(arguments, match):
    arguments = {"q": _X, "k": _X, "v": _X, "config": _config()} | arguments
    arguments = {n: t.to(dev) if isinstance(t, torch.Tensor) else t for n, t in arguments.items()}
    with pytest.raises(ValueError, match=match):
        splash_attention(**arguments)
