"""debug.model_comparator: saves of a CPU run and a device run compare equal, and a difference is
reported at its element."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import spmd_torch
from spmd_torch.debug import model_comparator as mc


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, kernel_size=3)
        self.fc = nn.Linear(4 * 3 * 3, 5)

    def forward(self, x: torch.Tensor, step: int | None = None) -> torch.Tensor:
        mc.save(None, x, step)
        x = mc.save("conv", F.relu(F.max_pool2d(self.conv(x), 2)), step)
        return mc.save("out", F.log_softmax(self.fc(x.flatten(1)), dim=1), step)


def test_a_cpu_run_and_a_device_run_compare_equal(tmp_path):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 1, 8, 8)
    mc.configure(str(tmp_path / "cpu"))
    model(x)
    model(x, step=3)
    mc.configure(str(tmp_path / "xla"))
    device = spmd_torch.device()
    on_device = model.to(device)
    on_device(x.to(device))
    on_device(x.to(device), step=3)
    mc.configure(None)
    saved = sorted(
        p.relative_to(tmp_path / "xla").as_posix() for p in (tmp_path / "xla").rglob("*.*")
    )
    assert saved == [
        "conv.0", "out.0", "step-3/conv.0", "step-3/out.0",
        "step-3/test_model_comparator.py.l21.0", "test_model_comparator.py.l21.0",
    ]  # fmt: skip
    assert mc.compare(str(tmp_path / "cpu"), str(tmp_path / "xla"), rtol=1e-4, atol=1e-5) == ""


def test_differences_are_reported_largest_first(tmp_path):
    mc.configure(str(tmp_path / "a"))
    mc.save("w", torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    mc.save("only_a", torch.zeros(1))
    mc.configure(str(tmp_path / "b"))
    mc.save("w", torch.tensor([[1.0, 2.5], [3.0, 3.0]]))
    mc.configure(None)
    report = mc.compare(str(tmp_path / "a"), str(tmp_path / "b"))
    assert report == (
        f"Mismatch: only_a.0 not in {tmp_path / 'b'}\n"
        'Changes in saved tensor "w" with id=0\n'
        "  [1, 1]: 4.0 vs. 3.0\terror=1.0\n"
        "  [0, 1]: 2.0 vs. 2.5\terror=0.5\n"
        "  \n"
    )
    assert mc.main([str(tmp_path / "a"), str(tmp_path / "a")]) == 0
    assert mc.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1


def test_without_a_folder_save_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mc.configure(None)
    t = torch.ones(2)
    assert mc.save("x", t) is t
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("MODELCMP_SAVEDIR", str(tmp_path))
    mc.save("x", t)
    assert [p.name for p in tmp_path.iterdir()] == ["x.0"]
    assert torch.equal(torch.load(tmp_path / "x.0"), t)
