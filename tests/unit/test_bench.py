"""tools/bench: W7cpu and Wattn end to end in their tiny forms (a parent run each, its children on
the CPU), their report fields read back from BENCH_JSON, and the reports' n/a and skipped rows;
the GPU workloads' steps lowered for CUDA before a GPU runs them."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from spmd_torch._lazy import compile as compile_module
from tests.helpers import lowered_as_on
from tools.bench import attention, gpu, harness, report

_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(tmp_path: pathlib.Path, workload: str, impls: str) -> tuple[dict, str]:
    """One parent run of `workload`, tiny, 1 warm-up and 2 timed steps: (BENCH_JSON, stdout)."""
    path = tmp_path / "summary.json"
    argv = ["--workloads", workload, "--tiny", "--steps", "2", "--warmup", "1"]
    argv += ["--impls", impls, "--json", str(path)]
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench", *argv],
        cwd=_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(path.read_text()), proc.stdout


@pytest.mark.slow
@pytest.mark.multiprocess
def test_w7cpu_tiny_reports_host_work(tmp_path):
    """spmd_torch only: eager and jax run gpu.py's GPT-2 paths, which W7gpu --tiny runs too."""
    summary, out = _run(tmp_path, "W7cpu", "jax_plain,spmd_torch")
    results = summary["results"]["W7cpu"]
    assert "spmd_torch" in results and results["skipped"] == ["jax_plain"]
    r = results["spmd_torch"]
    assert r["spmd_file"].startswith(str(_ROOT))
    assert r["host_ms"]["host_cpu"] > 0 and r["host_ms"]["host"] > 0
    assert isinstance(r["compiles_in_timed"], int)
    graph, parts = r["graph"], r["parts"]
    assert graph["programs"] == 1 and graph["recorded_ops"] > 0 and graph["traced_ops"] > 0
    # TensorsGraphSize of the timed steps and the probed step's pending program: one program.
    assert parts["nodes"]["total"] == graph["nodes_per_program"]
    assert (
        sum(parts["nodes"][k] for k in ("forward", "backward", "optimizer"))
        == graph["nodes_per_program"]
    )
    assert parts["optimizer_recorded_ops"] > 0 and parts["compiles"] == 0
    assert all(n >= 1 for n in parts["attention_per_call"].values())
    assert "nodes/program" in out and "attention nodes per call (2 calls)" in out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_wattn_tiny_reports_memory(tmp_path):
    """Each way of reading memory: RSS (eager), compiled (jax_plain, spmd_torch); jax (cuDNN) is
    tested apart, below."""
    summary, out = _run(tmp_path, "Wattn", "eager,jax_plain,spmd_torch")
    entry = summary["results"]["Wattn"]
    for impl in ("eager", "jax_plain", "spmd_torch"):
        assert entry[impl]["memory_bytes"] > 0, impl
        assert entry[impl]["seq"] == attention.TINY_SEQ
    assert entry["eager"]["memory_kind"].startswith("RSS")
    assert entry["spmd_torch"]["memory_kind"] == entry["jax_plain"]["memory_kind"]
    assert entry["ratios"]["spmd_torch_memory_over_jax_plain"] > 0
    assert "plain attention's (target ≤ 0.1x on CPU)" in out


def test_cudnn_rows_skipped_without_a_gpu(capsys):
    """On CPU the cuDNN rows say why they have no figures, and the reports carry on."""
    skipped = attention.wattn_jax(1, 1, False, False, tiny=True)
    assert "cuDNN" in skipped["skipped"] and gpu.w7_jax(1, 1, False, False, tiny=True) == skipped
    report.report_check("Wattn", {"jax": skipped, "jax_plain": {"losses": [1.0, 0.9]}})
    assert "jax         skipped: cuDNN" in capsys.readouterr().out
    assert report._ok({"jax": skipped}) == {}


def _spmd_result(**fields) -> dict:
    """A W7cpu spmd_torch result as an older checkout gives it: timings, none of the new
    figures."""
    return {
        "device": "xla:0",
        "steps_per_s": 2.0,
        "median_step_s": 0.5,
        "pipelined_steps_per_s": 2.0,
        "first_step_s": 9.0,
        "compiles_total": 2,
        "compiles_in_timed": 0,
        "peak_bytes": None,
        "loss_first": 6.0,
        "loss_last": 5.0,
        "config": "w7cpu",
        "params": 1000,
        "host_ms": None,
        "graph": None,
        "parts": None,
        **fields,
    }


def test_w7cpu_report_without_the_new_figures(capsys):
    report.report_w7cpu({"spmd_torch": _spmd_result()}, gpu=False)
    out = capsys.readouterr().out
    assert "nodes/program - (target ≤ 1300): n/a" in out
    assert "one step by part: n/a" in out


def test_w7cpu_against_reads_off_the_host_cpu_target(capsys):
    ours = _spmd_result(host_ms={"host_cpu": 40.0}, graph={"nodes_per_program": 1200})
    theirs = _spmd_result(host_ms={"host_cpu": 100.0}, graph={"nodes_per_program": 2629})
    entry = {"spmd_torch": ours, "spmd_torch@base": theirs}
    values = report.report_against("W7cpu", [entry], "ours", "base")["spmd_torch"]
    assert values["graph.nodes_per_program"]["ratio"] == pytest.approx(1200 / 2629)
    assert "host CPU per step ours/base: 0.40x (target ≤ 0.5x" in capsys.readouterr().out


def test_probe_figures_absent_in_a_checkout_are_none(monkeypatch):
    """read_probe and graph_per_step on metrics that keep no graph sizes, traced or recorded ops
    (an older checkout): None, not a crash."""
    import spmd_torch.debug.metrics as met

    monkeypatch.setattr(met, "metric_data", lambda name: None)
    monkeypatch.setattr(met, "counter_names", lambda: [])
    probe = harness.read_probe()
    assert (probe["graphs"], probe["traced"], probe["recorded"]) == (None, None, None)
    window = {"host_s": [0.1], "before": probe, "after": probe}
    assert set(harness.graph_per_step(window).values()) == {None}


def test_depth_workloads_run_only_where_named():
    """Wscan4/16/64 (tools/bench/scan.py): a runner per implementation, not in the default run."""
    from tools.bench import scan, workloads

    for workload in scan.WORKLOADS:
        assert workload not in workloads.default_workloads(True)
        assert all((workload, impl) in workloads.RUNNERS for impl in workloads.impls_of(workload))
    assert workloads.parse_only("wscan16:spmd_scan") == ("Wscan16", "spmd_scan")


def _tokens_result(tokens_per_s: float, peak: int | None = None, **fields) -> dict:
    """A W7gpu/Wlong result whose pipelined tokens/s is ``tokens_per_s`` (one token a step)."""
    return _spmd_result(
        tokens_per_step=1,
        pipelined_steps_per_s=tokens_per_s,
        peak_bytes=peak,
        config="small",
        **fields,
    )


def test_w7gpu_report_reads_off_issue_32s_gpu_targets(capsys):
    results = {
        "jax": _tokens_result(100.0, peak=1000),
        "inductor": _tokens_result(120.0),
        "spmd_torch": _tokens_result(2.5 * report.LAZY_BEFORE_H100, peak=900),
        "spmd_capture": _tokens_result(95.0),
        "spmd_compile": _tokens_result(130.0),
    }
    ratios = report.report_w7gpu(results, gpu=True)
    out = capsys.readouterr().out
    assert "pipelined tokens/s spmd_capture/jax: 0.95x (target ≥ 0.9x): met" in out
    assert "pipelined tokens/s spmd_capture/inductor: 0.79x (target ≥ 1.0x): NOT MET" in out
    assert "pipelined tokens/s spmd_compile/inductor: 1.08x (target ≥ 1.0x): met" in out
    assert "peak memory spmd_torch/jax: 0.90x (target ≤ 1.0x): met" in out
    assert ratios["spmd_torch_over_lazy_before"] == pytest.approx(2.5)


def test_wlong_plain_attention_out_of_memory_is_a_row_not_a_failure(capsys):
    from tools.bench import long

    def exhausted():
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 17179869184 bytes.")

    def broken():
        raise ValueError("a bug, not memory")

    row = long._guarded(exhausted)
    assert row == {
        "out_of_memory": "RESOURCE_EXHAUSTED: Out of memory allocating 17179869184 bytes."
    }
    with pytest.raises(ValueError, match="a bug"):
        long._guarded(broken)
    fell = _tokens_result(10.0, peak=400, loss_first=6.0, loss_last=5.5, params=10)
    ratios = report.report_wlong(
        {"jax": _tokens_result(20.0, peak=800), "jax_plain": row, "spmd_torch": fell}, gpu=True
    )
    out = capsys.readouterr().out
    assert (
        "jax_plain   out of memory" in out and "jax_plain out of memory: RESOURCE_EXHAUSTED" in out
    )
    assert "spmd_torch trains (loss falls): met; plain attention: out of memory" in out
    assert (
        ratios["spmd_torch_over_jax_pipelined"] == 0.5 and ratios["spmd_torch_peak_over_jax"] == 0.5
    )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_wlong_tiny_trains_under_autocast(tmp_path):
    """Wlong's model hands attention float32 rotary products beside bfloat16 values: autocast
    casts them (docs/amp.md), and the lazy loop's loss falls as plain JAX's does."""
    summary, out = _run(tmp_path, "Wlong", "jax_plain,spmd_torch")
    entry = summary["results"]["Wlong"]
    for impl in ("jax_plain", "spmd_torch"):
        assert entry[impl]["loss_last"] < entry[impl]["loss_first"], impl
        assert entry[impl]["tokens_per_step"] == 2 * 128
    assert "spmd_torch trains (loss falls): met; plain attention: fits" in out


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("workload", ["W7gpu", "Wlong"])
def test_the_gpu_workloads_steps_lower_for_gpus_and_tpus(monkeypatch, workload, platform):
    """What ``gpu_run.sh`` runs first on a lent GPU, checked without one: a lazy training step of
    W7gpu's GPT-2 and of Wlong's Llama (their model code at tiny widths, bf16 autocast, AdamW)
    lowers for CUDA and for TPU through JAX's real lowerings. On CUDA each layer's attention is
    cuDNN's fused kernel forward and backward (Wlong's with grouped key/value heads); on TPU
    Wlong's (seq 128) is the Pallas flash kernel."""
    import torch

    import spmd_torch
    import spmd_torch.amp as amp
    from tools.bench import llama, long, models

    if workload == "W7gpu":
        cfg, model, data = gpu.GPT2_TINY, gpu.new_gpt2(gpu.GPT2_TINY), gpu.gpt2_data(gpu.GPT2_TINY)
    else:
        cfg = long.LONG_TINY
        model, data = long.new_model(cfg), llama.llama_data(cfg)
    dev = spmd_torch.device()
    model.to(dev)
    batch = [torch.from_numpy(a).to(dev) for a in data]
    opt = models.new_adamw(model)
    spmd_torch.sync()
    with amp.autocast(dev, dtype=torch.bfloat16):
        loss = models.gpt_loss(model, *batch)
    loss.backward()
    opt.step()
    lowered = lowered_as_on(platform, [loss, *model.parameters()], monkeypatch)
    text = lowered.as_text()
    if platform == "cuda":
        assert text.count("__cudnn$fmhaSoftmaxBackward(") == cfg.layers
        # one forward kernel per layer once the backward's call of it is merged, before XLA
        merged = str(compile_module.merge_equal_ops(lowered))
        assert merged.count("__cudnn$fmhaSoftmax(") == cfg.layers
    elif workload == "Wlong":
        assert text.count("tpu_custom_call") >= 2 * cfg.layers


@pytest.mark.parametrize("path", ["spmd_capture", "spmd_compile"])
def test_w7gpus_compiled_steps_lower_for_cuda(monkeypatch, path):
    """W7gpu's headline rows, checked without a GPU: with automatic capture on (GPT-2's forward
    and AdamW's step captured) and with the forward under ``torch.compile(backend='spmd_torch')``,
    Dynamo's graphs are recorded as templates on this host, and the step lowers for CUDA with
    each layer's attention on cuDNN's kernels both ways. JAX's caches are cleared first, so the
    templates' lowerings are traced again for CUDA."""
    import jax
    import torch

    import spmd_torch
    import spmd_torch.amp as amp
    from spmd_torch.core import auto_capture
    from tools.bench import models

    cfg = gpu.GPT2_TINY
    dev = spmd_torch.device()
    model = gpu.new_gpt2(cfg).to(dev)
    forward = torch.compile(model, backend="spmd_torch") if path == "spmd_compile" else model
    batch = [torch.from_numpy(a).to(dev) for a in gpu.gpt2_data(cfg)]
    opt = models.new_adamw(model)
    spmd_torch.sync()

    def step() -> torch.Tensor:
        with amp.autocast(dev, dtype=torch.bfloat16):
            loss = models.gpt_loss(forward, *batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    spmd_torch.auto_capture(path == "spmd_capture")
    try:
        for _ in range(4):
            step()
            spmd_torch.sync()
        if path == "spmd_capture":
            assert auto_capture.callables() == {"captured": ["GPT2.forward", "AdamW.step"]}
        loss = step()
        jax.clear_caches()
        text = lowered_as_on("cuda", [loss, *model.parameters()], monkeypatch).as_text()
    finally:
        spmd_torch.auto_capture(False)
    assert text.count("__cudnn$fmhaSoftmaxBackward(") == cfg.layers
    assert text.count("__cudnn$fmhaSoftmax(") >= cfg.layers


def _split_fsdp(model) -> None:
    """Each 2-d parameter of ``model`` split over 8 devices along its first dimension (FSDP)."""
    import numpy as np

    import spmd_torch.distributed.spmd as xs

    mesh = xs.Mesh(np.arange(8), (8,), ("fsdp",))
    for p in model.parameters():
        if p.dim() == 2:
            xs.mark_sharding(p, mesh, ("fsdp", None))


def _train(forward, opt, batch: list, steps: int, bf16: bool) -> list[float]:
    """``steps`` steps of ``opt`` on a model called through ``forward`` on ``batch``, in float32
    or under bf16 autocast: their losses."""
    import contextlib

    import torch

    import spmd_torch
    import spmd_torch.amp as amp
    from tools.bench import models

    dev = spmd_torch.device()
    losses = []
    for _ in range(steps):
        with amp.autocast(dev, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            loss = models.gpt_loss(forward, *batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        spmd_torch.sync()
        losses.append(loss.item())
    return losses


def _wlong_tiny_steps(steps: int, fsdp: bool, bf16: bool) -> tuple[list[float], list]:
    """Losses and final parameters of ``steps`` AdamW steps of Wlong's Llama at tiny widths, from
    seed 0's weights, in float32 or under bf16 autocast; with ``fsdp``, split over 8 devices."""
    import torch

    import spmd_torch
    from tools.bench import llama, long, models

    cfg = long.LONG_TINY
    dev = spmd_torch.device()
    model = long.new_model(cfg).to(dev)
    if fsdp:
        _split_fsdp(model)
    batch = [torch.from_numpy(a).to(dev) for a in llama.llama_data(cfg)]
    losses = _train(model, models.new_adamw(model), batch, steps, bf16)
    return losses, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("fsdp", [False, True], ids=["one_device", "fsdp8"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_wlongs_step_on_the_accelerators_path_equals_this_hosts(monkeypatch, platform, fsdp):
    """Wlong's Llama (grouped heads, causal attention at seq 128) trained on an accelerator's
    path gives this host's path's losses (and float32 weights) after 3 AdamW steps. On TPU's, float32, the
    attention is the Pallas flash kernel run by Pallas's interpreter; on NVIDIA GPUs', bf16
    autocast, cuDNN's kernel stood in for by plain attention. Over 8 devices each is split by
    the partitioner's rule: under FSDP Shardy gives the queries a layout over parts of the mesh
    axis, which JAX's own rule for cuDNN's kernel refused while XLA compiled (IndivisibleError)."""
    import torch

    import spmd_torch.runtime as xr
    from spmd_torch._lazy import counters
    from tests.helpers import assert_close, cudnn_stood_in, pallas_interpreted

    accelerator = pallas_interpreted if platform == "tpu" else cudnn_stood_in
    kernel = "pallas" if platform == "tpu" else "cudnn"
    bf16 = platform == "cuda"
    if fsdp:
        xr.use_spmd()
    try:
        losses, weights = _wlong_tiny_steps(3, fsdp, bf16)
        before = counters.COUNTERS.get(f"Attention::{kernel}", 0)
        with accelerator(monkeypatch):
            their_losses, their_weights = _wlong_tiny_steps(3, fsdp, bf16)
        assert counters.COUNTERS.get(f"Attention::{kernel}", 0) > before
    finally:
        if fsdp:
            xr.reset()
    assert losses[-1] < losses[0]
    assert_close(torch.tensor(their_losses), torch.tensor(losses), tol="training")
    if not bf16:  # under bf16 a near-zero gradient's sign, so AdamW's step there, is rounding's
        assert_close(their_weights, weights, tol="training")


def _scanned_decoder_grads(fsdp: bool, bf16: bool) -> tuple[float, list]:
    """The loss and gradients of one step of Wscan's decoder, its 2 layers under ``scan_layers``
    (which JAX differentiates as one scan), at seq 128, from seed 0's weights."""
    import contextlib
    from dataclasses import replace

    import torch

    import spmd_torch
    import spmd_torch.amp as amp
    from tools.bench import scan
    from tools.bench.models import gpt_loss

    cfg = replace(scan.CFG, seq=128, layers=2)
    dev = spmd_torch.device()
    model = scan._new_decoder(cfg, scanned=True).to(dev)
    if fsdp:
        _split_fsdp(model)
    idx, tgt = (torch.from_numpy(a).to(dev) for a in scan._data(cfg))
    with amp.autocast(dev, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
        loss = gpt_loss(model, idx, tgt)
    loss.backward()
    spmd_torch.sync()
    return loss.item(), [p.grad.cpu() for p in model.parameters()]


@pytest.mark.parametrize("fsdp", [False, True], ids=["one_device", "fsdp8"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_scan_layers_on_the_accelerators_path_equals_this_hosts(monkeypatch, platform, fsdp):
    """A decoder under ``scan_layers`` on an accelerator's path (as in the test above) gives this
    host's loss and gradients. JAX differentiates the scan's body itself, outside the contexts
    the lowering sets: the Pallas kernel's backward failed to trace there under x64, and over 8
    devices the scan's residuals were counted for this host's attention, not the fused kernel's
    (``lowering of scan returned 41 outputs, expected 59``)."""
    import torch

    import spmd_torch.runtime as xr
    from tests.helpers import assert_close, cudnn_stood_in, pallas_interpreted, tolerance

    accelerator = pallas_interpreted if platform == "tpu" else cudnn_stood_in
    bf16 = platform == "cuda"
    if fsdp:
        xr.use_spmd()
    try:
        loss, grads = _scanned_decoder_grads(fsdp, bf16)
        with accelerator(monkeypatch):
            their_loss, their_grads = _scanned_decoder_grads(fsdp, bf16)
    finally:
        if fsdp:
            xr.reset()
    assert_close(torch.tensor(their_loss), torch.tensor(loss), tol="training")
    if bf16:  # the two attentions' bf16 products round apart: a bf16 ulp
        assert_close(their_grads, grads, **tolerance(torch.bfloat16, "grad"))
    else:
        assert_close(their_grads, grads, tol="training", kind="grad")


def _w7gpu_fsdp_losses(path: str, steps: int = 4) -> list[float]:
    """W7gpu's GPT-2 at tiny widths, FSDP over 8, bf16 autocast and AdamW: ``steps`` losses with
    automatic capture on (``capture``) or the forward under ``torch.compile`` (``compile``)."""
    import torch

    import spmd_torch
    from spmd_torch.core import auto_capture
    from tools.bench import models

    cfg = gpu.GPT2_TINY
    dev = spmd_torch.device()
    torch.manual_seed(0)
    model = gpu.new_gpt2(cfg).to(dev)
    _split_fsdp(model)
    forward = torch.compile(model, backend="spmd_torch") if path == "compile" else model
    batch = [torch.from_numpy(a).to(dev) for a in gpu.gpt2_data(cfg)]
    opt = models.new_adamw(model)
    spmd_torch.auto_capture(path == "capture")
    try:
        losses = _train(forward, opt, batch, steps, bf16=True)
        if path == "capture":  # while the optimizer lives
            assert auto_capture.callables() == {"captured": ["GPT2.forward", "AdamW.step"]}
    finally:
        spmd_torch.auto_capture(False)
    return losses


@pytest.mark.parametrize("path", ["capture", "compile"])
def test_w7gpus_compiled_steps_under_fsdp_on_the_gpu_path_equal_this_hosts(monkeypatch, path):
    """W7gpu's compiled rows under FSDP over 8 devices on the NVIDIA GPU path (cuDNN's kernel
    stood in for, split by the partitioner's rule inside Dynamo's graphs): automatic capture's
    and ``torch.compile``'s losses over 4 steps equal this host's path's."""
    import torch

    import spmd_torch.runtime as xr
    from spmd_torch._lazy import counters
    from tests.helpers import assert_close, cudnn_stood_in

    xr.use_spmd()
    try:
        losses = _w7gpu_fsdp_losses(path)
        before = counters.COUNTERS.get("Attention::cudnn", 0)
        with cudnn_stood_in(monkeypatch):
            their_losses = _w7gpu_fsdp_losses(path)
        assert counters.COUNTERS.get("Attention::cudnn", 0) > before
    finally:
        xr.reset()
    assert losses[-1] < losses[0]
    assert_close(torch.tensor(their_losses), torch.tensor(losses), tol="training")
