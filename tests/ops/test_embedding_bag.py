"""``F.embedding_bag`` forward and weight gradient, lowered (no CPU round trip), against eager CPU;
``sparse=True`` gives the dense gradient, as on PyTorch/XLA, which has no sparse tensors."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from spmd_torch.debug import metrics
from tests.helpers import assert_close, assert_matches_eager

INDICES = torch.tensor([1, 4, 3, 4, 5, 7, 7, 2, 9])
OFFSETS = torch.tensor([0, 1, 1, 3, 7])  # bag 1 empty, bag 2 = [4, 3] (4 can be padding)


@pytest.mark.parametrize(
    "mode,padding_idx,per_sample",
    [
        (m, p, s)
        for m, p, s in itertools.product(("sum", "mean", "max"), (None, 4), (False, True))
        if not (s and m != "sum")
    ],
)
def test_embedding_bag_matches_eager(mode, padding_idx, per_sample):
    weight = torch.randn(10, 3)
    kwargs = {"mode": mode, "padding_idx": padding_idx}
    if per_sample:
        kwargs["per_sample_weights"] = torch.rand(INDICES.shape[0])

    def fn(indices, offsets, weight, **kw):
        return F.embedding_bag(indices, weight, offsets, **kw)

    assert_matches_eager(fn, INDICES, OFFSETS, weight, grad=True, **kwargs)


@pytest.mark.parametrize("mode", ["sum", "max"])
def test_embedding_bag_2d_input_and_last_offset(mode):
    weight = torch.randn(10, 4)
    assert_matches_eager(
        lambda i, w: F.embedding_bag(i, w, mode=mode), INDICES.reshape(3, 3), weight, grad=True
    )
    assert_matches_eager(
        lambda i, o, w: F.embedding_bag(i, w, o, mode=mode, include_last_offset=True),
        INDICES,
        torch.tensor([0, 2, 9]),
        weight,
        grad=True,
    )


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_sparse_grad_is_dense_and_runs_on_device(mode):
    weight = torch.randn(10, 3)
    expected = weight.clone().requires_grad_()
    F.embedding_bag(INDICES, expected, OFFSETS, mode=mode, sparse=True).sum().backward()
    actual = weight.to("xla").requires_grad_()
    metrics.clear_counters()
    F.embedding_bag(
        INDICES.to("xla"), actual, OFFSETS.to("xla"), mode=mode, sparse=True
    ).sum().backward()
    assert not actual.grad.is_sparse
    assert_close(actual.grad.cpu(), expected.grad.to_dense())
    assert not [n for n in metrics.counter_names() if n.startswith("aten::")]
