"""DataLoader worker processes once the device runs: every start method, seeded or not, on one
device, under SPMD and in launch replicas. A worker forked after JAX started must not touch JAX
(its threads did not survive the fork): ``torch.manual_seed`` there skips the device, and device
work there is refused with an error instead of waiting forever."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import spmd_torch
import spmd_torch._XLAC as _XLAC
import spmd_torch.core.xla_model as xm
import spmd_torch.distributed.parallel_loader as pl
import spmd_torch.distributed.spmd as xs
import spmd_torch.distributed.xla_multiprocessing as xmp
import spmd_torch.runtime as xr
from spmd_torch._lazy import engine

SAMPLES = 16


class Numbered(torch.utils.data.Dataset):
    """Sample i is i, plus a draw from the worker's CPU RNG times 0 (seeding must not hang)."""

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return torch.full((4,), float(i)) + 0 * torch.rand(()), torch.tensor(i)


def _loader(method: str | None, workers: int = 2, **kwargs) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        Numbered(), batch_size=4, num_workers=workers, multiprocessing_context=method, **kwargs
    )


def _rows(batches) -> list[int]:
    return [int(v) for x, _ in batches for v in x.cpu()[:, 0]]


# A spawned or forkserver worker is a fresh process whatever the parent seeded: one case each
# (each of its workers imports torch and this module, spmd_torch included, as a script's would).
@pytest.mark.parametrize(
    "method, seeded",
    [("fork", False), ("fork", True), ("spawn", False), ("forkserver", True)],
    ids=["fork-unseeded", "fork-seeded", "spawn-unseeded", "forkserver-seeded"],
)
def test_workers_after_the_device_ran(method, seeded):
    if seeded:
        torch.manual_seed(0)
    device = xm.xla_device()
    assert (torch.ones(2, device=device) * 2).cpu().tolist() == [2.0, 2.0]  # JAX is running
    if method == "fork":
        assert _rows(_loader(method)) == list(range(SAMPLES))
    assert _rows(pl.MpDeviceLoader(_loader(method), device)) == list(range(SAMPLES))


def test_workers_before_the_device_ran_and_device_random_numbers_unchanged():
    """Seeding the workers leaves the device RNG alone: the draws after an epoch equal a fresh
    seed's."""
    spmd_torch.manual_seed(5)
    assert _rows(_loader("fork")) == list(range(SAMPLES))
    device = xm.xla_device()
    after_epoch = torch.rand(3, device=device).cpu()
    spmd_torch.manual_seed(5)
    assert torch.equal(torch.rand(3, device=device).cpu(), after_epoch)


def test_seeding_starts_no_device_work():
    """``torch.manual_seed`` (every worker calls it) only remembers the seed; the key it gives is
    JAX's own seeding of that seed."""
    own = engine.current()
    torch.manual_seed(7)
    assert own.rng is None and own.seed == 7
    words = np.array(spmd_torch._lazy.execute.rng_words(), dtype=np.uint32)
    import jax

    expected = jax.random.key_data(jax.random.key(np.uint32(7), impl="threefry2x32"))
    assert words.tolist() == np.asarray(expected).tolist()


def test_device_module_reports_a_bad_fork_only_in_a_child_forked_after_jax_started():
    xm.xla_device()
    (torch.ones(1, device=xm.xla_device()) + 1).cpu()
    assert not torch.xla._is_in_bad_fork()
    reported = list(_loader("fork", worker_init_fn=None, collate_fn=_bad_fork_collate))
    assert all(bool(flag) for flag in reported)


def _bad_fork_collate(samples):
    return torch.tensor(torch.xla._is_in_bad_fork())


class OnDevice(torch.utils.data.Dataset):
    """A dataset holding xla tensors: its worker would need JAX."""

    def __init__(self):
        self.data = torch.arange(4.0, device=xm.xla_device())

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return self.data[i] * 2


def test_device_work_in_a_forked_worker_is_refused_not_a_hang():
    dataset = OnDevice()
    spmd_torch.sync()
    with pytest.raises(RuntimeError, match="forked after JAX started its runtime"):
        list(torch.utils.data.DataLoader(dataset, num_workers=1, multiprocessing_context="fork"))


def test_workers_under_spmd_with_a_sharded_loader():
    xr.use_spmd()
    try:
        mesh = xs.Mesh(np.arange(8), (8,), ("data",))
        torch.manual_seed(0)
        loader = pl.MpDeviceLoader(
            torch.utils.data.DataLoader(Numbered(), batch_size=8, num_workers=2),
            xm.xla_device(),
            input_sharding=xs.ShardingSpec(mesh, ("data", None)),
        )
        batches = list(loader)
        assert all(_XLAC._get_xla_sharding_spec(x).startswith("{devices=[8,1]") for x, _ in batches)
        assert _rows(batches) == list(range(SAMPLES))
    finally:
        xr.reset()


def _replica_epoch(index):
    loader = torch.utils.data.DataLoader(
        Numbered(), batch_size=2, num_workers=2, sampler=_EveryFourth(xr.global_ordinal())
    )
    return _rows(pl.MpDeviceLoader(loader, xm.xla_device()))


class _EveryFourth(torch.utils.data.Sampler):
    def __init__(self, start: int):
        self.start = start

    def __iter__(self):
        return iter(range(self.start, SAMPLES, 4))


def test_workers_in_launch_replicas():
    seen = xmp.spawn(_replica_epoch, nprocs=4)
    assert seen == {k: list(range(k, SAMPLES, 4)) for k in range(4)}
