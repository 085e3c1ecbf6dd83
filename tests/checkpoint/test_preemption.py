"""The preemption sync manager (PyTorch/XLA's ``_activate_preemption_sync_manager``,
``_sync_point_reached``, ``_deactivate_preemption_sync_manager``) in one process: a real SIGTERM
makes the next step checked the sync point, once; the replaced handler is chained and restored."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from spmd_torch.experimental.distributed_checkpoint import _preemption


@pytest.fixture
def previous_handler():
    """A SIGTERM handler of the test's own, recording the signals it gets; removed afterwards."""
    received = []
    original = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    yield received
    _preemption.deactivate_preemption_sync_manager()
    signal.signal(signal.SIGTERM, original)


def test_sigterm_makes_the_next_step_checked_the_sync_point(previous_handler):
    installed = signal.getsignal(signal.SIGTERM)
    _preemption.activate_preemption_sync_manager()
    _preemption.activate_preemption_sync_manager()  # a second activation changes nothing
    assert [_preemption.sync_point_reached(step) for step in range(10)] == [False] * 10

    os.kill(os.getpid(), signal.SIGTERM)

    assert previous_handler == [signal.SIGTERM]  # the handler it replaced still runs
    assert _preemption.sync_point_reached(10)
    assert _preemption.sync_point_reached(10)  # asked again at the same step: still the one
    assert [_preemption.sync_point_reached(step) for step in (11, 12)] == [False, False]
    _preemption.deactivate_preemption_sync_manager()
    assert signal.getsignal(signal.SIGTERM) is installed
    _preemption.deactivate_preemption_sync_manager()  # nothing active: nothing happens


def test_a_new_activation_starts_without_the_last_notice(previous_handler):
    _preemption.activate_preemption_sync_manager()
    os.kill(os.getpid(), signal.SIGTERM)
    assert _preemption.sync_point_reached(3)
    _preemption.deactivate_preemption_sync_manager()

    _preemption.activate_preemption_sync_manager()
    assert not _preemption.sync_point_reached(4)


def test_checking_without_an_active_manager_is_refused():
    with pytest.raises(RuntimeError, match=r"_sync_point_reached\(7\): no preemption sync"):
        _preemption.sync_point_reached(7)


def test_activating_off_the_main_thread_is_refused(previous_handler):
    errors = []

    def activate():
        try:
            _preemption.activate_preemption_sync_manager()
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=activate)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "off the main thread" in errors[0]
    with pytest.raises(RuntimeError, match="no preemption sync manager is active"):
        _preemption.sync_point_reached(0)
