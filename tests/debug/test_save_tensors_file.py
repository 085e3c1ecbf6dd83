"""XLA_SAVE_TENSORS_FILE: every barrier appends the graph it runs to FILE.<ordinal>, as text or
StableHLO, where the user's code issued it, and the outputs' shardings."""

from __future__ import annotations

import pytest
import torch

import spmd_torch
import spmd_torch.distributed.spmd as xs
import spmd_torch.runtime as xr
from spmd_torch import config


@pytest.fixture
def save_to(tmp_path, monkeypatch):
    def configure(fmt: str):
        monkeypatch.setattr(config.SAVE_TENSORS_FILE, "value", str(tmp_path / "graphs"))
        monkeypatch.setattr(config.SAVE_TENSORS_FMT, "value", fmt)
        return tmp_path / "graphs.0"

    return configure


def test_text_dump_names_the_ops_and_where_the_barrier_came_from(save_to):
    path = save_to("text")
    x = torch.ones(3, device=spmd_torch.device())
    y = (x * 2).add_(1)  # noqa: F841  (kept alive: pending)
    spmd_torch.sync()
    spmd_torch.sync()  # nothing pending: nothing written
    text = path.read_text()
    assert text.count("## BEGIN_GRAPH") == 1 and text.endswith("## END_GRAPH\n\n")
    assert "aten.mul.Tensor" in text and "aten.add.Tensor" in text
    assert f"test_text_dump_names_the_ops_and_where_the_barrier_came_from ({__file__}:" in text


def test_hlo_dump_lists_the_output_shardings(save_to):
    # As PyTorch/XLA writes them: each output's shape and the sharding its program gave it.
    # ``y`` was marked; ``z``, computed from it elementwise, the partitioner laid out alike.
    path = save_to("HLO")
    xr.use_spmd()
    try:
        y = torch.ones(8, 4, device=spmd_torch.device()) + 1
        xs.mark_sharding(y, xs.get_1d_mesh("data"), ("data", None))
        z = y * 2  # noqa: F841  (kept alive: pending)
        spmd_torch.sync()
    finally:
        xr.reset()
    text = path.read_text()
    split = "sharding={devices=[8,1]0,1,2,3,4,5,6,7}"
    assert f'custom_call_target="Sharding", {split}' in text
    section = text[text.index("#OUTPUT_SHARDING_BEGIN") :]
    expected = f"f32[8,4] {split[9:]}"
    assert (
        section == f"#OUTPUT_SHARDING_BEGIN\n\n{expected}\n{expected}\n\n#OUTPUT_SHARDING_END\n\n"
    )


def test_an_output_on_one_device_has_an_unknown_sharding(save_to):
    path = save_to("hlo")
    y = torch.ones(3, device=spmd_torch.device()) * 2  # noqa: F841
    spmd_torch.sync()
    assert "#OUTPUT_SHARDING_BEGIN\n\nf32[3] {unknown}\n\n#OUTPUT_SHARDING_END" in path.read_text()


def test_an_outputs_shape_is_the_one_the_device_holds(save_to):
    # As PyTorch/XLA writes its XLA shape: under XLA_USE_BF16 a float32 tensor is held in bf16
    path = save_to("hlo")
    with config.override(XLA_USE_BF16=True):
        y = torch.ones(3, device=spmd_torch.device()) * 2
        spmd_torch.sync()
    assert y.dtype == torch.float32
    assert "#OUTPUT_SHARDING_BEGIN\n\nbf16[3] {unknown}\n" in path.read_text()


def test_an_unknown_format_is_refused(save_to):
    save_to("dot")
    torch.ones(2, device=spmd_torch.device()).add_(1)
    with pytest.raises(ValueError, match="XLA_SAVE_TENSORS_FMT='dot'"):
        spmd_torch.sync()
