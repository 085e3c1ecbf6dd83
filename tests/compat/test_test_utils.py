"""spmd_torch.test.test_utils: the progress lines, summaries (a writer stands in for
TensorBoard, which is not installed here) and mp_test."""

from __future__ import annotations

import re
import unittest

import pytest
import torch

import spmd_torch.core.xla_model as xm
import spmd_torch.debug.metrics as met
import spmd_torch.test.test_utils as test_utils

DEV = xm.xla_device()


class RecordingWriter:
    def __init__(self):
        self.scalars = []
        self.closed = False

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def test_print_training_update_line(capsys):
    loss = torch.tensor(0.693147, device=DEV)
    test_utils.print_training_update(DEV, 20, loss, 410.254, 398.8, epoch=1)
    line = capsys.readouterr().out
    assert re.fullmatch(
        r"\| Training Device=xla:0/0 Epoch=1 Step=20 Loss=0\.69315 Rate=410\.25 "
        r"GlobalRate=398\.80 Time=\d\d:\d\d:\d\d\n",
        line,
    )


def test_print_test_update_line_leaves_out_missing_fields(capsys):
    test_utils.print_test_update("xla:0", 97.5, epoch=2)
    assert re.fullmatch(
        r"\| Test Device=xla:0/0 Epoch=2 Accuracy=97\.50 Time=\S+\n", capsys.readouterr().out
    )


def test_training_update_writes_the_rates_to_the_writer(capsys):
    writer = RecordingWriter()
    test_utils.print_training_update(DEV, 1, 0.5, 10.0, 8.0, summary_writer=writer)
    assert writer.scalars == [("examples/sec", 10.0, None), ("average_examples/sec", 8.0, None)]


def test_write_to_summary_with_metrics():
    (torch.ones(3, device=DEV) * 2).cpu()
    writer = RecordingWriter()
    test_utils.write_to_summary(writer, 5, {"loss": 1.5}, write_xla_metrics=True)
    names = {name: value for name, value, step in writer.scalars if step == 5}
    assert names["loss"] == 1.5
    assert names["TransferFromDevice"] >= 1
    fallbacks = [met.counter_value(n) for n in met.counter_names() if n.startswith("aten::")]
    assert names["aten_ops_sum"] == sum(fallbacks)
    assert any(n.endswith("__TotalSamples") for n in names)
    test_utils.write_to_summary(None, 1, {"loss": 1.0})  # no writer: nothing to do
    test_utils.close_summary_writer(writer)
    test_utils.close_summary_writer(None)
    assert writer.closed


def test_get_summary_writer_without_tensorboard_warns_and_returns_none(tmp_path):
    assert test_utils.get_summary_writer(None) is None
    with pytest.warns(UserWarning, match="neither tensorboardX nor tensorboard is installed"):
        assert test_utils.get_summary_writer(str(tmp_path)) is None


def test_now_formats():
    assert re.fullmatch(r"\d{4}", test_utils.now("%Y"))


@test_utils.mp_test
def _passes_in_its_own_process(value):
    assert torch.ones(2, device=xm.xla_device()).sum().item() == value


@test_utils.mp_test
def _fails_in_its_own_process():
    raise AssertionError("fails")


class MpCase(unittest.TestCase):
    __test__ = False  # run by the test below, not collected on its own

    @test_utils.mp_test
    def test_in_process(self):
        self.assertEqual(xm.xrt_world_size(), 1)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_mp_test_runs_the_function_in_a_child_process():
    assert _passes_in_its_own_process(2.0) == 0
    assert _fails_in_its_own_process() != 0
    result = unittest.TestResult()
    MpCase("test_in_process").run(result)
    assert result.wasSuccessful(), result.failures + result.errors
