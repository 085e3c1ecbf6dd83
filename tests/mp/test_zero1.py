"""ZeRO-1 (``ZeroRedundancyOptimizer``) on the replicas of launch: training equals eager CPU
data-parallel training on the averaged (and clipped) gradient, each replica keeps 1/N of the
optimizer state, ``state_dict``/``load_state_dict`` as PyTorch/XLA 2.9's; and the xm helpers its
tests use (``xm._maybe_convert_to_cpu``, ``xm._fetch_gradients``)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

import spmd_torch.core.xla_model as xm
import spmd_torch.distributed.xla_multiprocessing as xmp
from spmd_torch.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer
from tests.helpers import assert_close
from tests.mp._training import averaged_gradient_reference, batch, net, train_replica

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
}


def _reference(initial: nn.Module, members: list, optimizer: str, clip: float | None):
    cls, kwargs = OPTIMIZERS[optimizer]
    return averaged_gradient_reference(initial, members, lambda ps: cls(ps, **kwargs), clip)


def _train(index: int, initial: nn.Module, optimizer: str, clip: float | None, groups):
    cls, kwargs = OPTIMIZERS[optimizer]
    model = copy.deepcopy(initial).to(xm.xla_device())
    opt = ZeroRedundancyOptimizer(
        model.parameters(),
        cls,
        grad_clipping=clip is not None,
        max_norm=clip,
        sharding_groups=groups,
        pin_layout=False,
        **kwargs,
    )
    losses = train_replica(model, opt, index)
    return losses, {k: v.cpu() for k, v in model.state_dict().items()}


# (replicas, optimizer, gradient clipping, sharding groups)
CASES = [
    (4, "sgd", None, None),
    (4, "adam", 0.5, None),
    (8, "sgd", 0.5, None),
    (8, "adam", None, None),
    (8, "sgd", None, [[0, 1, 2, 3], [4, 5, 6, 7]]),
]


@pytest.mark.parametrize(
    "replicas,optimizer,clip,groups",
    CASES,
    ids=[
        f"{r}-{opt}{'-clip' if clip else ''}{'-groups' if groups else ''}"
        for r, opt, clip, groups in CASES
    ],
)
def test_zero1_training_matches_eager_training_on_the_averaged_gradient(
    replicas, optimizer, clip, groups
):
    torch.manual_seed(0)
    initial = net()
    results = xmp.spawn(_train, args=(initial, optimizer, clip, groups), nprocs=replicas)
    for group in groups or [list(range(replicas))]:
        expected_losses, expected_state = _reference(initial, group, optimizer, clip)
        for position, index in enumerate(group):
            losses, state = results[index]
            assert_close(losses, expected_losses[:, position], tol="training")
            assert_close(state, expected_state, tol="training")


@pytest.mark.parametrize("replicas", [4, 8])
def test_each_replica_keeps_1_over_n_of_the_optimizer_state(replicas):
    torch.manual_seed(0)
    initial = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 30))

    def fn(index):
        model = copy.deepcopy(initial).to(xm.xla_device())
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
        model(torch.randn(2, 64).to(xm.xla_device())).sum().backward()
        opt.step()
        xm.mark_step()
        state = opt.state_dict()
        moments = {
            index: [tuple(t.shape) for t in s.values() if torch.is_tensor(t) and t.dim()]
            for index, s in state["base_state"].items()
        }
        return moments, dict(state["state"]), state["shape_info"]

    shapes = [p.shape for p in initial.parameters()]
    # each shard is the parameter padded along dim 0 to a multiple of N, cut in N
    expected = {
        i: [(math.ceil(s[0] / replicas), *s[1:])] * 2  # Adam's two moments
        for i, s in enumerate(shapes)
    }
    for moments, own_state, shape_info in xmp.spawn(fn, nprocs=replicas).values():
        assert moments == expected
        assert own_state == {}  # nothing full-sized is kept besides the parameters
        assert shape_info == dict(enumerate(shapes))


def test_state_dict_round_trip_resumes_training_where_it_stopped():
    torch.manual_seed(0)
    initial = net()

    def fn(index):
        def make(model):
            return ZeroRedundancyOptimizer(
                model.parameters(),
                torch.optim.SGD,
                lr=0.1,
                momentum=0.9,
                save_master_weights=True,
            )

        def step(model, opt, n):
            x, y = (t.to(xm.xla_device()) for t in batch(n, index))
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            xm.mark_step()

        model = copy.deepcopy(initial).to(xm.xla_device())
        opt = make(model)
        step(model, opt, 0)
        saved = xm._maybe_convert_to_cpu(opt.state_dict())
        step(model, opt, 1)  # the uninterrupted run

        other = net().to(xm.xla_device())  # different weights: the master weights restore them
        resumed = make(other)
        resumed.load_state_dict(copy.deepcopy(saved))
        reloaded = xm._maybe_convert_to_cpu(resumed.state_dict())
        step(other, resumed, 1)
        state = {k: v.cpu() for k, v in model.state_dict().items()}
        return saved, reloaded, state, {k: v.cpu() for k, v in other.state_dict().items()}

    for saved, reloaded, uninterrupted, resumed in xmp.spawn(fn, nprocs=4).values():
        assert reloaded["param_groups"] == saved["param_groups"]
        assert reloaded["shape_info"] == saved["shape_info"]
        assert_close(reloaded["base_state"], saved["base_state"], tol="exact")
        assert_close(reloaded["sharded_master_weights"], saved["sharded_master_weights"])
        # The resumed step is another program (the master weights come in as data), which XLA
        # may fuse differently on some CPUs: an ulp apart at most (1.2e-7 seen), not bitwise.
        assert_close(resumed, uninterrupted, rtol=5e-7, atol=0)


def test_use_grad_acc_hook_is_refused():
    model = net().to(xm.xla_device())
    with pytest.raises(NotImplementedError, match="use_grad_acc_hook"):
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, use_grad_acc_hook=True)
    xm.mark_step()


# --- xm helpers ----------------------------------------------------------------------------------


def test_maybe_convert_to_cpu_computes_and_copies_every_xla_tensor():
    device = xm.xla_device()
    data = {"a": torch.ones(2, device=device) * 3, "b": [torch.arange(3).to(device) + 1, "x"]}
    cpu = xm._maybe_convert_to_cpu(data)
    assert cpu["a"].device.type == "cpu" and cpu["b"][0].device.type == "cpu"
    assert cpu["a"].tolist() == [3.0, 3.0] and cpu["b"] == [cpu["b"][0], "x"]
    assert cpu["b"][0].tolist() == [1, 2, 3]
    kept = xm._maybe_convert_to_cpu(data, convert=False)
    assert kept["a"] is data["a"] and kept["b"][0] is data["b"][0]  # computed, not copied


def test_fetch_gradients_returns_the_gradients_to_change_in_place():
    model = net().to(xm.xla_device())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 6).to(xm.xla_device())).sum().backward()
    model[2].bias.grad = None
    gradients = xm._fetch_gradients(opt)
    assert len(gradients) == 3
    before = model[0].weight.grad.cpu()
    gradients[0].mul_(0.5)
    assert_close(model[0].weight.grad.cpu(), before * 0.5, tol="exact")
    xm.mark_step()
