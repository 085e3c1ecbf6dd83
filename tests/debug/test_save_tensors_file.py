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
    path = save_to("HLO")
    xr.use_spmd()
    try:
        y = torch.ones(8, 4, device=spmd_torch.device()) + 1
        xs.mark_sharding(y, xs.get_1d_mesh("data"), ("data", None))
        spmd_torch.sync()
    finally:
        xr.reset()
    lines = path.read_text().splitlines()
    assert 'custom_call_target="Sharding", sharding={devices=[8,1]<=[8]}' in "\n".join(lines)
    at = lines.index("#OUTPUT_SHARDING_BEGIN")
    expected = "P('data',) on mesh {'data': 8}"
    assert lines[at + 1 :] == [expected, "#OUTPUT_SHARDING_END", ""]


def test_an_unknown_format_is_refused(save_to):
    save_to("dot")
    torch.ones(2, device=spmd_torch.device()).add_(1)
    with pytest.raises(ValueError, match="XLA_SAVE_TENSORS_FMT='dot'"):
        spmd_torch.sync()
