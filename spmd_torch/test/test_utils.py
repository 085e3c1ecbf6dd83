"""torch_xla.test.test_utils: the progress lines, TensorBoard summaries and test helpers of
PyTorch/XLA's example scripts (``import torch_xla.test.test_utils as test_utils``).

Summaries need ``tensorboardX`` (or ``tensorboard``, through ``torch.utils.tensorboard``); without
either, :func:`get_summary_writer` warns and returns ``None``, and every function taking a writer
accepts ``None`` and writes nothing, so a script runs on without its summaries.
"""

from __future__ import annotations

import importlib
import multiprocessing
import unittest
import warnings
from collections.abc import Callable
from datetime import datetime
from typing import Any

import torch

import spmd_torch.debug.metrics as met
from spmd_torch import runtime

__all__ = [
    "close_summary_writer",
    "get_summary_writer",
    "mp_test",
    "now",
    "print_test_update",
    "print_training_update",
    "write_to_summary",
]


def mp_test(func: Callable) -> Callable:
    """Run a test function in a fresh process of its own; the test fails if that process fails.

    The process is spawned (JAX's threads make forking unsafe), so the test function must be
    importable: a module-level function, or a method of a ``unittest.TestCase`` (rebuilt in the
    child with the same method name).

    Args:
        func: The test function or ``TestCase`` method.

    Returns:
        A function running ``func`` in a child process: for a ``TestCase`` method it asserts
        that the process exited with 0, otherwise it returns the exit code.

    Example:
        >>> class MyTest(unittest.TestCase):
        ...     @test_utils.mp_test
        ...     def test_basic(self):
        ...         self.assertEqual(xm.xrt_world_size(), 1)
    """
    location = (func.__module__, func.__qualname__)

    def wrapper(*args: Any, **kwargs: Any) -> int | None:
        case = args[0] if args and isinstance(args[0], unittest.TestCase) else None
        if case is not None:
            target_args = (location, case._testMethodName, args[1:], kwargs)
        else:
            target_args = (location, None, args, kwargs)
        process = multiprocessing.get_context("spawn").Process(
            target=_run_in_child, args=target_args
        )
        process.start()
        process.join()
        if case is None:
            return process.exitcode
        case.assertEqual(process.exitcode, 0, f"{func.__qualname__} failed in its process")
        return None

    wrapper.__name__ = func.__name__
    wrapper.__qualname__ = func.__qualname__
    wrapper.__doc__ = func.__doc__
    wrapper.__module__ = func.__module__
    wrapper.mp_test_function = func  # the undecorated test, which the child process runs
    return wrapper


def _run_in_child(location: tuple[str, str], method: str | None, args: tuple, kwargs: dict):
    """In the child process: find the decorated test by name and run the undecorated one."""
    module_name, qualname = location
    owner: Any = importlib.import_module(module_name)
    for part in qualname.split(".")[:-1]:
        owner = getattr(owner, part)
    function = getattr(owner, qualname.rsplit(".", 1)[-1]).mp_test_function
    if method is not None:
        function(owner(method), *args, **kwargs)
    else:
        function(*args, **kwargs)


def _get_device_spec(device: torch.device | str) -> str:
    return f"{device}/{runtime.global_ordinal()}"


def write_to_summary(
    summary_writer,
    global_step: int | None = None,
    dict_to_write: dict | None = None,
    write_xla_metrics: bool = False,
) -> None:
    """Write scalars (and optionally the runtime's metrics) to a TensorBoard writer.

    Args:
        summary_writer: A ``SummaryWriter``, or ``None`` to write nothing.
        global_step: The step the values belong to.
        dict_to_write: ``{name: value}`` scalars.
        write_xla_metrics: Also write every counter (by name), every metric's sample count and
            total (``<name>__TotalSamples``, ``<name>__Accumulator``) and ``aten_ops_sum``, the
            number of ops that fell back to the CPU.

    Example:
        >>> test_utils.write_to_summary(writer, step, {'loss': loss.item()})
    """
    if summary_writer is None:
        return
    for name, value in (dict_to_write or {}).items():
        summary_writer.add_scalar(name, value, global_step)
    if write_xla_metrics:
        aten_ops_sum = 0
        for name in met.counter_names():
            value = met.counter_value(name)
            if name.startswith("aten::"):
                aten_ops_sum += value
            summary_writer.add_scalar(name, value, global_step)
        for name in met.metric_names():
            count, total, _ = met.metric_data(name)
            summary_writer.add_scalar(f"{name}__TotalSamples", count, global_step)
            summary_writer.add_scalar(f"{name}__Accumulator", total, global_step)
        summary_writer.add_scalar("aten_ops_sum", aten_ops_sum, global_step)


def close_summary_writer(summary_writer) -> None:
    """Flush and close a writer; ``None`` does nothing.

    Example:
        >>> test_utils.close_summary_writer(writer)
    """
    if summary_writer is not None:
        summary_writer.flush()
        summary_writer.close()


def get_summary_writer(logdir: str | None):
    """A TensorBoard ``SummaryWriter`` logging to ``logdir`` (its start time written first).

    Uses ``tensorboardX``, else ``torch.utils.tensorboard``.

    Args:
        logdir: The log directory; ``None`` or empty: no writer.

    Returns:
        The writer, or ``None`` (no ``logdir``, or no TensorBoard package: then with a warning).

    Example:
        >>> writer = test_utils.get_summary_writer('/tmp/logs')
    """
    if not logdir:
        return None
    writer_class = _summary_writer_class()
    if writer_class is None:
        warnings.warn(
            f"get_summary_writer({logdir!r}): neither tensorboardX nor tensorboard is installed; "
            "no summaries are written",
            stacklevel=2,
        )
        return None
    writer = writer_class(log_dir=logdir)
    write_to_summary(writer, 0, {"TensorboardStartTimestamp": datetime.now().timestamp()})
    return writer


def _summary_writer_class():
    for module_name in ("tensorboardX", "torch.utils.tensorboard"):
        try:
            return importlib.import_module(module_name).SummaryWriter
        except ImportError:
            continue
    return None


def now(format: str = "%H:%M:%S") -> str:
    """The local time, formatted.

    Example:
        >>> test_utils.now()
        '14:03:59'
    """
    return datetime.now().strftime(format)


def print_training_update(
    device: torch.device | str,
    step: int,
    loss: float | torch.Tensor,
    rate: float,
    global_rate: float,
    epoch: int | None = None,
    summary_writer=None,
) -> None:
    """Print one training progress line (and write the rates to ``summary_writer``).

    ``| Training Device=xla:0/0 Epoch=1 Step=20 Loss=0.69315 Rate=410.25 GlobalRate=398.80
    Time=14:03:59``; ``Epoch`` only when given. Reading ``loss`` here waits for its value:
    call it from a step closure (``xm.add_step_closure``) so it reads the finished step's.

    Args:
        device: The device the values come from.
        step: The step number.
        loss: The loss (a number or a one-element tensor).
        rate: Examples per second of the recent steps.
        global_rate: Examples per second since training began.
        epoch: The epoch number.
        summary_writer: Also write the rates here.

    Example:
        >>> xm.add_step_closure(
        ...     test_utils.print_training_update,
        ...     args=(device, step, loss, tracker.rate(), tracker.global_rate()))
    """
    fields = [
        "Training",
        f"Device={_get_device_spec(device)}",
        f"Epoch={epoch}" if epoch is not None else None,
        f"Step={step}",
        f"Loss={float(loss):.5f}",
        f"Rate={rate:.2f}",
        f"GlobalRate={global_rate:.2f}",
        f"Time={now()}",
    ]
    print("|", " ".join(field for field in fields if field), flush=True)
    if summary_writer is not None:
        write_to_summary(
            summary_writer,
            dict_to_write={"examples/sec": rate, "average_examples/sec": global_rate},
        )


def print_test_update(
    device: torch.device | str,
    accuracy: float | None,
    epoch: int | None = None,
    step: int | None = None,
) -> None:
    """Print one evaluation line: ``| Test Device=xla:0/0 Step=3 Epoch=1 Accuracy=97.50
    Time=14:03:59`` (fields not given are left out).

    Example:
        >>> test_utils.print_test_update(device, 100.0 * correct / total, epoch)
    """
    fields = [
        "Test",
        f"Device={_get_device_spec(device)}",
        f"Step={step}" if step is not None else None,
        f"Epoch={epoch}" if epoch is not None else None,
        f"Accuracy={accuracy:.2f}" if accuracy is not None else None,
        f"Time={now()}",
    ]
    print("|", " ".join(field for field in fields if field), flush=True)
