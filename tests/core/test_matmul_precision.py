"""spmd_torch.backends.set_mat_mul_precision: the lowered products carry the precision, and
changing it recompiles. XLA on the CPU computes float32 products exactly at every precision, so
the lowered StableHLO (and the cache miss) is what a CPU test can check."""

from __future__ import annotations

import logging
import re

import pytest
import torch

import spmd_torch
import spmd_torch.backends as backends
from spmd_torch.debug import graph
from tests.helpers import assert_close, assert_compiles

dev = spmd_torch.device()


@pytest.fixture(autouse=True)
def _restore_precision():
    saved = backends.get_mat_mul_precision()
    yield
    backends.set_mat_mul_precision(saved)


def _precisions(hlo: str) -> set[str]:
    return set(re.findall(r"precision = \[(\w+), \w+\]", hlo))


def test_default_is_highest():
    assert backends.get_mat_mul_precision() == "highest"


@pytest.mark.parametrize("precision", ["default", "high", "highest"])
def test_lowered_products_carry_the_precision(precision):
    backends.set_mat_mul_precision(precision)
    assert backends.get_mat_mul_precision() == precision
    a = torch.randn(4, 8).to(dev)
    b = torch.randn(8, 3).to(dev)
    x = torch.randn(1, 2, 6, 6).to(dev)
    w = torch.randn(3, 2, 3, 3).to(dev)
    out = a @ b
    conv = torch.nn.functional.conv2d(x, w)
    hlo = graph.pending_stablehlo([out, conv])
    assert _precisions(hlo) == {precision.upper()}
    spmd_torch.sync()


def test_changing_precision_recompiles_and_values_stay_float32_on_cpu():
    a, b = torch.randn(5, 7), torch.randn(7, 2)
    ad, bd = a.to(dev), b.to(dev)
    spmd_torch.sync()
    with assert_compiles(2):
        highest = (ad @ bd).cpu()
        backends.set_mat_mul_precision("default")
        default = (ad @ bd).cpu()
        backends.set_mat_mul_precision("highest")
        again = (ad @ bd).cpu()  # the first program again: a cache hit
    assert torch.equal(again, highest)
    assert_close(highest, a @ b)
    assert torch.equal(default, highest)  # XLA:CPU computes float32 products exactly


def test_bad_value_raises_value_error_and_set_logs_a_warning(caplog):
    with pytest.raises(ValueError, match="Invalid precision: 'bf16'. Must be one of default"):
        backends.set_mat_mul_precision("bf16")
    with caplog.at_level(logging.WARNING, logger="spmd_torch.backends"):
        backends.set_mat_mul_precision("high")
    assert "mat mul precision multiple times" in caplog.text
