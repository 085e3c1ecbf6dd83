"""In-place view ops (``x.t_()``, ``x.transpose_(0, 1)``): the tensor becomes a view of its former
self, and writes through it still reach the storage, as on CPU."""

from __future__ import annotations

import pytest
import torch

import spmd_torch

dev = spmd_torch.device()

OPS = {
    "t_": lambda t: t.t_(),
    "transpose_": lambda t: t.transpose_(0, 1),  # transpose_.default is transpose.int
    "swapdims_": lambda t: t.swapdims_(0, 1),
    "unsqueeze_": lambda t: t.unsqueeze_(1),
    "squeeze_": lambda t: t.unsqueeze_(0).squeeze_(0),
    "as_strided_": lambda t: t.as_strided_((2, 3), (1, 2)),
}


@pytest.mark.parametrize("name", list(OPS))
def test_inplace_view_matches_eager_and_writes_through(name):
    cpu = torch.arange(6.0).reshape(3, 2)
    base_cpu = cpu.clone()
    alias_cpu = base_cpu.view(-1)
    out_cpu = OPS[name](base_cpu)
    base = cpu.to(dev)
    alias = base.view(-1)
    out = OPS[name](base)
    assert out is base and out.shape == out_cpu.shape and out.stride() == out_cpu.stride()
    torch.testing.assert_close(out.cpu(), out_cpu)
    out_cpu.mul_(10)  # the storage both views share
    out.mul_(10)
    torch.testing.assert_close(alias.cpu(), alias_cpu)


def test_stft_matches_eager():
    x = torch.randn(2, 400)
    window = torch.hann_window(64)
    got = torch.stft(x.to(dev), 64, hop_length=16, window=window.to(dev), return_complex=True)
    expected = torch.stft(x, 64, hop_length=16, window=window, return_complex=True)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-4)


def test_reading_each_slice_or_row_compiles_one_program_per_shape():
    """A host read of a view of known data takes its index as a program input: reading every
    layer's slice of a stack, or every row (PyTorch/XLA's test_utils compares tensors row by
    row), compiles once per shape, not once per index; the values are the CPU tensor's."""
    from tests.helpers import assert_compiles

    cpu = torch.randn(6, 5, 4)
    base = cpu.to(dev)
    spmd_torch.sync()
    base[0].cpu(), base[:, 1:3][0, 1:].cpu()  # the first read of each kind compiles
    with assert_compiles(0):
        for i in range(-6, 6):
            torch.testing.assert_close(base[i].cpu(), cpu[i], rtol=0, atol=0)
            torch.testing.assert_close(
                base[:, 1:3][i, 1:].cpu(), cpu[:, 1:3][i, 1:], rtol=0, atol=0
            )
    for got, want in [
        (base.transpose(0, 1)[3][1], cpu.transpose(0, 1)[3][1]),
        (base[2:-1], cpu[2:-1]),
        (base[::2][1], cpu[::2][1]),
        (base[1:100], cpu[1:100]),
        (base[-3].t()[1:3], cpu[-3].t()[1:3]),
    ]:
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
