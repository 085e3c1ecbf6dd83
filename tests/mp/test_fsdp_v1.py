"""FSDP v1 (``XlaFullyShardedDataParallel``) on the replicas of launch: training equals eager CPU
data-parallel training on the averaged gradient, each replica holds 1/N of the parameters and of
the optimizer state, resharding gathers again in backward, and the replicas' checkpoints
consolidate into the unwrapped module's state dict."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.nn as nn

import spmd_torch.core.xla_model as xm
import spmd_torch.debug.graph as graph
import spmd_torch.distributed.xla_multiprocessing as xmp
import spmd_torch.runtime as xr
from spmd_torch.distributed.fsdp import (
    XlaFullyShardedDataParallel as FSDP,
)
from spmd_torch.distributed.fsdp import (
    checkpoint_module,
    consolidate_sharded_model_checkpoints,
    consolidate_sharded_state_dicts,
)
from spmd_torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
from tests.helpers import assert_close
from tests.mp._training import BATCH, averaged_gradient_reference, batch, train_replica


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def _reference(initial: nn.Module, replicas: int, optimizer: str, clip: float | None):
    """Eager CPU training on the gradient averaged over every replica's batch."""
    make = functools.partial(_optimizer, optimizer)
    return averaged_gradient_reference(initial, range(replicas), make, clip)


def _wrap(model: nn.Module, layout: str) -> nn.Module:
    flatten = layout.startswith("flat")
    if layout.endswith("nested"):
        model.fc1 = FSDP(model.fc1, flatten_parameters=flatten)
        model.fc2 = FSDP(model.fc2, flatten_parameters=flatten)
    if layout.endswith("checkpointed"):
        model.fc1 = FSDP(checkpoint_module(model.fc1), flatten_parameters=flatten)
        model.fc2 = FSDP(checkpoint_module(model.fc2), flatten_parameters=flatten)
    policy = None
    if layout.endswith("auto_wrap"):
        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=100)
    return FSDP(model, flatten_parameters=flatten, auto_wrap_policy=policy)


def _train(index: int, initial: nn.Module, layout: str, optimizer: str, clip: float | None):
    model = _wrap(copy.deepcopy(initial), layout)
    opt = _optimizer(optimizer, model.parameters())
    clip_norm = None if clip is None else functools.partial(model.clip_grad_norm_, clip)
    losses = train_replica(model, opt, index, after_backward=clip_norm)
    return losses, xm._maybe_convert_to_cpu(model.state_dict()), model.get_shard_metadata()


# (replicas, layout, optimizer, gradient clipping)
CASES = [
    (4, "root", "sgd", None),
    (4, "flat_nested", "adam", None),
    (4, "checkpointed", "sgd", None),
    (8, "nested", "sgd", 0.5),
    (8, "flat_auto_wrap", "adam", None),
]


@pytest.mark.parametrize(
    "replicas,layout,optimizer,clip",
    CASES,
    ids=[f"{r}-{layout}-{opt}{'-clip' if clip else ''}" for r, layout, opt, clip in CASES],
)
def test_fsdp_training_matches_eager_training_on_the_averaged_gradient(
    replicas, layout, optimizer, clip
):
    torch.manual_seed(0)
    initial = Net()
    expected_losses, expected_state = _reference(initial, replicas, optimizer, clip)
    results = xmp.spawn(_train, args=(initial, layout, optimizer, clip), nprocs=replicas)
    for index in range(replicas):
        assert_close(results[index][0], expected_losses[:, index], tol="training")
    full = consolidate_sharded_state_dicts([results[i][1] for i in range(replicas)], results[0][2])
    assert sorted(full) == sorted(expected_state)
    assert_close({k: full[k] for k in expected_state}, expected_state, tol="training")


@pytest.mark.parametrize("replicas", [4, 8])
@pytest.mark.parametrize("flatten", [False, True], ids=["per_parameter", "flat"])
def test_each_replica_holds_1_over_n_of_the_parameters_and_the_optimizer_state(replicas, flatten):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32))
    sizes = [p.numel() for p in model.parameters()]

    def fn(index):
        fsdp = FSDP(copy.deepcopy(model), flatten_parameters=flatten)
        opt = torch.optim.Adam(fsdp.parameters(), lr=0.01)
        fsdp(torch.randn(2, 64).to(xm.xla_device())).sum().backward()
        opt.step()
        xm.mark_step()
        shards = [p.numel() for p in fsdp.parameters()]
        moments = [
            t.numel()
            for s in opt.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim()
        ]
        # no full parameter outlives the step: the modules hold placeholders
        held = [fsdp.module[0].weight.numel(), fsdp.module[2].bias.numel()]
        return shards, moments, held

    chunk = replicas * 128  # shards are padded to a multiple of 128 elements per replica
    if flatten:
        expected = [math.ceil(sum(sizes) / chunk) * 128]
    else:
        expected = [math.ceil(n / chunk) * 128 for n in sizes]
    for shards, moments, held in xmp.spawn(fn, nprocs=replicas).values():
        assert shards == expected
        assert sum(shards) <= sum(sizes) / replicas + 128 * len(expected)
        assert sorted(moments) == sorted(expected * 2)  # Adam's two moments, shard-sized
        assert held == [1, 1]


def test_reshard_after_forward_gathers_the_parameters_again_in_backward():
    def fn(index, reshard):
        model = Net()
        model.fc2 = FSDP(model.fc2, reshard_after_forward=reshard)
        model = FSDP(model)  # the root keeps its parameters (disable_reshard_on_root)
        x = torch.randn(BATCH, 6).to(xm.xla_device())
        model(x).sum().backward()
        text = graph.pending_text()
        xm.mark_step()
        return text.count("all_gather("), text.count("optimization_barrier")

    # The root gathers 4 shards (fc1, head) and fc2 2; fc2's backward reads its weight again.
    assert xmp.spawn(fn, args=(True,), nprocs=4)[0] == (7, 1)
    assert xmp.spawn(fn, args=(False,), nprocs=4)[0] == (6, 0)


def test_consolidated_checkpoint_files_rebuild_the_unwrapped_state_dict(tmp_path):
    torch.manual_seed(0)
    initial = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    prefix = str(tmp_path / "ckpt")

    def wrap(model):
        model[0] = FSDP(model[0], flatten_parameters=True)
        return FSDP(model, buffer_dtype=torch.float16)  # consolidation restores float32

    def fn(index):
        model = wrap(copy.deepcopy(initial))
        ckpt = {"model": model.state_dict(), "shard_metadata": model.get_shard_metadata()}
        path = f"{prefix}_rank-{xr.global_ordinal():08d}-of-{xr.world_size():08d}.pth"
        xm.save(ckpt, path, master_only=False)
        # each replica resumes from its own file into a model initialised otherwise
        resumed = wrap(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)))
        resumed.load_state_dict(torch.load(path)["model"])
        xm.mark_step()
        return xm._maybe_convert_to_cpu((resumed.state_dict(), model.state_dict()))

    results = xmp.spawn(fn, nprocs=4)
    full, written = consolidate_sharded_model_checkpoints(prefix, "_rank-*-of-*.pth")
    assert written == prefix + "_consolidated.pth"
    expected = initial.state_dict()
    assert sorted(full) == sorted(expected)  # root's shards first, as in PyTorch/XLA
    assert all(full[k].dtype == v.dtype for k, v in expected.items())
    assert_close({k: full[k] for k in expected}, dict(expected), tol="exact")
    saved = torch.load(written)["model"]
    assert_close({k: saved[k] for k in expected}, dict(expected), tol="exact")
    for resumed, original in results.values():
        assert_close(resumed, original, tol="exact")


def test_consolidation_refuses_missing_files(tmp_path):
    def fn(index):
        model = FSDP(Net())
        ckpt = {"model": model.state_dict(), "shard_metadata": model.get_shard_metadata()}
        xm.save(ckpt, str(tmp_path / f"ckpt_{index}.pth"), master_only=False)

    xmp.spawn(fn, nprocs=4)
    (tmp_path / "ckpt_2.pth").unlink()
    with pytest.raises(ValueError, match=r"holds rank 0 of 4, but 3 files match"):
        consolidate_sharded_model_checkpoints(str(tmp_path / "ckpt"), "_*.pth")


def test_outside_launch_fsdp_is_a_world_of_one():
    torch.manual_seed(0)
    initial = Net()
    model = FSDP(copy.deepcopy(initial), flatten_parameters=True)
    x, y = batch(0, 0)
    loss = nn.functional.mse_loss(model(x.to(xm.xla_device())), y.to(xm.xla_device()))
    loss.backward()
    expected = nn.functional.mse_loss(initial(x), y)
    expected.backward()
    (shard,) = model.parameters()
    grads = torch.cat([p.grad.flatten() for p in initial.parameters()])
    assert_close(loss.cpu(), expected.detach(), tol="single_op")
    assert_close(shard.grad.cpu()[: grads.numel()], grads, kind="grad")
    xm.mark_step()


@pytest.mark.parametrize(
    "option",
    [
        {"_debug_dummy_forward_pass": True},
        {"_debug_dummy_all_gather_op": True},
    ],
    ids=["dummy_forward", "dummy_all_gather"],
)
def test_unimplemented_options_are_refused(option):
    with pytest.raises(NotImplementedError, match=f"{next(iter(option))} not implemented"):
        FSDP(Net(), **option)


def test_no_sync_is_refused():
    model = FSDP(Net())
    with pytest.raises(NotImplementedError, match="no_sync is not implemented"):
        with model.no_sync():
            pass
    xm.mark_step()


def test_wrapping_an_fsdp_module_or_a_module_list_is_an_error():
    with pytest.raises(RuntimeError, match="FSDP module already"):
        FSDP(FSDP(Net()))
    with pytest.raises(RuntimeError, match="defines no forward"):
        FSDP(nn.ModuleList([nn.Linear(2, 2)]))
    xm.mark_step()


# --- deferred initialisation (modules built on the meta device) ---------------------------------


class _SeededLinear(nn.Linear):
    """A linear layer whose ``reset_parameters`` is deterministic (seeded by its shape)."""

    def reset_parameters(self, offset: int = 0) -> None:
        generator = torch.Generator().manual_seed(
            offset + 100 * self.in_features + self.out_features
        )
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))


class _DeferredNet(Net):
    """``Net`` of seeded layers on any device; its ``reset_parameters`` skips the layers already
    wrapped in FSDP, as PyTorch/XLA's deferred-init test model does."""

    def __init__(self, device: str | None = None):
        nn.Module.__init__(self)
        self.fc1 = _SeededLinear(6, 16, device=device)
        self.fc2 = _SeededLinear(16, 16, device=device)
        self.head = _SeededLinear(16, 3, device=device)

    def reset_parameters(self, offset: int = 0) -> None:
        for layer in [self.fc1, self.fc2, self.head]:
            if not isinstance(layer, FSDP):
                layer.reset_parameters(offset)


_INIT_FN_OFFSET = 7  # param_init_fn's initialisation differs from reset_parameters' own


def _init_on_cpu(module: nn.Module) -> None:
    """A ``param_init_fn``: allocate on the CPU, then initialise with other seeds."""
    module.to_empty(device="cpu")
    module.reset_parameters(_INIT_FN_OFFSET)


def _materialised_reference(init: str) -> nn.Module:
    model = _DeferredNet()
    model.reset_parameters(_INIT_FN_OFFSET if init == "param_init_fn" else 0)
    return model


def _train_deferred(index: int, init: str, auto_wrap: bool):
    policy = (
        functools.partial(size_based_auto_wrap_policy, min_num_params=50) if auto_wrap else None
    )
    param_init_fn = _init_on_cpu if init == "param_init_fn" else None
    model = FSDP(_DeferredNet("meta"), auto_wrap_policy=policy, param_init_fn=param_init_fn)
    losses = train_replica(model, _optimizer("sgd", model.parameters()), index)
    return losses, xm._maybe_convert_to_cpu(model.state_dict()), model.get_shard_metadata()


@pytest.mark.parametrize("auto_wrap", [False, True], ids=["root", "auto_wrap"])
@pytest.mark.parametrize("init", ["reset_parameters", "param_init_fn"])
def test_a_meta_module_is_materialised_then_trains_as_the_materialised_module(init, auto_wrap):
    replicas = 4
    expected_losses, expected_state = _reference(
        _materialised_reference(init), replicas, "sgd", None
    )
    results = xmp.spawn(_train_deferred, args=(init, auto_wrap), nprocs=replicas)
    for index in range(replicas):
        assert_close(results[index][0], expected_losses[:, index], tol="training")
    full = consolidate_sharded_state_dicts([results[i][1] for i in range(replicas)], results[0][2])
    assert_close({k: full[k] for k in expected_state}, expected_state, tol="training")


def test_param_init_fn_is_not_called_for_a_module_that_is_not_on_the_meta_device():
    calls = []
    model = FSDP(Net(), param_init_fn=calls.append)
    assert calls == [] and all(not p.is_meta for p in model.parameters())
    xm.mark_step()


def test_a_meta_module_without_reset_parameters_or_param_init_fn_is_an_error():
    with pytest.raises(RuntimeError, match="defines no reset_parameters"):
        FSDP(nn.Sequential(nn.Linear(2, 2, device="meta")))
    with pytest.raises(RuntimeError, match=r"\['weight'\] are still on the meta device"):
        FSDP(
            nn.Linear(2, 2, device="meta"),
            param_init_fn=lambda m: setattr(m, "bias", nn.Parameter(torch.zeros(2))),
        )
    with pytest.raises(ValueError, match="param_init_fn must be callable"):
        FSDP(nn.Linear(2, 2, device="meta"), param_init_fn=1)
    xm.mark_step()
