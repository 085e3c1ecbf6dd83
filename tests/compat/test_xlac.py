"""torch_xla._XLAC calls against PyTorch/XLA's documented answers: sharding strings and types
for 1-D and 2-D meshes, tensor ids for aliases and copies, device names, partial syncs, the RNG
seed, the matmul precision, and the metric names PyTorch/XLA reads under other names."""

from __future__ import annotations

import re
import threading
import warnings

import jaxlib.version
import numpy as np
import pytest
import torch

import spmd_torch
import spmd_torch._XLAC as xlac
import spmd_torch.backends
import spmd_torch.core.xla_builder as xb
import spmd_torch.debug.graph as graph
import spmd_torch.debug.metrics as met
import spmd_torch.distributed.spmd as xs
import spmd_torch.runtime as xr
from spmd_torch import config
from spmd_torch._lazy import execute
from tests.helpers import assert_close

dev = spmd_torch.device()


@pytest.fixture
def spmd_mode():
    xr.use_spmd()


def _marked(shape: tuple, mesh_shape: tuple, spec: tuple) -> torch.Tensor:
    t = torch.zeros(shape).to(dev)
    xs.mark_sharding(t, xs.Mesh(np.arange(8), mesh_shape), spec)
    return t


# ---- sharding strings and types --------------------------------------------------------------

SHARDINGS = {
    "1d_tiled": ((8, 4), (8,), (0, None), "{devices=[8,1]0,1,2,3,4,5,6,7}", 3),
    "1d_second_dim": ((4, 8), (8,), (None, 0), "{devices=[1,8]0,1,2,3,4,5,6,7}", 3),
    "2d_tiled": ((8, 8), (2, 4), (0, 1), "{devices=[2,4]0,1,2,3,4,5,6,7}", 3),
    "2d_replicated_last_axis": (
        (8, 4),
        (2, 4),
        (0, None),
        "{devices=[2,1,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}",
        5,
    ),
    "2d_replicated_first_axis": (
        (8, 4),
        (2, 4),
        (1, None),
        "{devices=[4,1,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}",
        5,
    ),
    "2d_transposed": ((8, 8), (2, 4), (1, 0), "{devices=[4,2]0,4,1,5,2,6,3,7}", 3),
    "2d_both_axes_on_one_dim": (
        (16, 2),
        (2, 4),
        ((0, 1), None),
        "{devices=[8,1]0,1,2,3,4,5,6,7}",
        3,
    ),
    "replicated": ((8, 4), (2, 4), (None, None), "{replicated}", 0),
}


@pytest.mark.parametrize("case", SHARDINGS.values(), ids=SHARDINGS.keys())
def test_sharding_spec_and_type_are_pytorch_xlas(spmd_mode, case):
    shape, mesh_shape, spec, text, kind = case
    t = _marked(shape, mesh_shape, spec)
    assert xlac._get_xla_sharding_spec(t) == text
    assert xlac._get_xla_sharding_type(t) == kind
    assert xs.ShardingType(kind) is xs.XLAShardedTensor(t).sharding_type


def test_sharding_spec_is_empty_and_type_none_without_a_sharding(spmd_mode):
    t = torch.zeros(8, 4).to(dev)
    assert xlac._get_xla_sharding_spec(t) == ""
    assert xlac._get_xla_sharding_type(t) is None


def test_a_programs_output_has_a_sharding_spec_and_an_upload_none(spmd_mode):
    """As measured on PyTorch/XLA: an upload reads '' before and after a sync, a value a program
    computed reads '{replicated}' (an upload updated in place too), a pending value ''."""
    upload = torch.randn(4, 4).to(dev)
    computed = upload @ upload
    assert xlac._get_xla_sharding_spec(computed) == ""
    spmd_torch.sync()
    assert xlac._get_xla_sharding_spec(upload) == ""
    assert xlac._get_xla_sharding_spec(computed) == "{replicated}"
    upload.add_(1)
    spmd_torch.sync()
    assert xlac._get_xla_sharding_spec(upload) == "{replicated}"
    assert xlac._get_xla_sharding_type(upload) == int(xs.ShardingType.REPLICATED)


def test_sharding_specs_of_several_tensors(spmd_mode):
    sharded, plain = _marked((8, 4), (8,), (0, None)), torch.zeros(2).to(dev)
    assert xlac._get_xla_sharding_specs([sharded, plain]) == ["{devices=[8,1]0,1,2,3,4,5,6,7}", ""]


def test_sharding_spec_survives_a_step_and_reads_a_wrapper(spmd_mode):
    t = _marked((8, 4), (2, 4), (0, None))
    t.add_(1)
    spmd_torch.sync()
    wrapped = xs.wrap_as_sharded_tensor(t)
    expected = "{devices=[2,1,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"
    assert xlac._get_xla_sharding_spec(wrapped) == expected


def test_clear_sharding_forgets_the_annotation(spmd_mode):
    t = _marked((8, 4), (8,), (0, None))
    xlac._xla_clear_sharding(t)
    assert xlac._get_xla_sharding_spec(t) == ""
    assert xlac._get_xla_sharding_type(t) is None


@pytest.mark.parametrize(
    "call",
    [
        xlac._get_xla_sharding_spec,
        xlac._get_xla_sharding_type,
        xlac._xla_clear_sharding,
        xlac._xla_get_tensor_id,
    ],
    ids=lambda f: f.__name__,
)
def test_cpu_tensors_are_refused_as_pytorch_xla_refuses_them(call):
    with pytest.raises(
        RuntimeError, match=r"needs a tensor on the xla device, got a torch.float32 tensor of shape"
    ):
        call(torch.zeros(2, 3))


# ---- tensor ids ------------------------------------------------------------------------------


def test_tensor_id_is_shared_by_aliases():
    w = torch.randn(4, 4).to(dev)
    ids = {
        xlac._xla_get_tensor_id(alias)
        for alias in (w, w.detach(), w[0], w.view(16), w.t(), w.data, xs.XLAShardedTensor(w))
    }
    assert len(ids) == 1 and ids.pop() > 0


def test_tensor_id_differs_between_copies_and_distinct_tensors():
    w = torch.randn(4, 4).to(dev)
    others = [w.clone(), w + 0, torch.randn(4, 4).to(dev), w.detach().clone()]
    ids = [xlac._xla_get_tensor_id(t) for t in [w, *others]]
    assert len(set(ids)) == len(ids)


def test_tensor_id_is_stable_across_in_place_updates_and_barriers():
    w = torch.randn(4, 4).to(dev)
    before = xlac._xla_get_tensor_id(w)
    w.mul_(2)
    spmd_torch.sync()
    w[0] = 1.0
    spmd_torch.sync()
    assert xlac._xla_get_tensor_id(w) == before


def test_tensor_ids_find_tied_weights_as_libraries_do():
    """huggingface_hub/transformers group a state dict's tensors by (device, id, size)."""
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied
    model = model.to(dev)
    groups: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(xlac._xla_get_tensor_id(t), []).append(name)
    assert sorted(groups.values()) == [["0.weight", "1.weight"]]


# ---- tensors: dimension sizes, partial syncs ------------------------------------------------


def test_dimension_size_of_a_data_dependent_result():
    x = torch.tensor((0, 1, 2, 0, 3, 4), device=dev)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nonzero may run on the CPU
        size = xlac._get_xla_tensor_dimension_size(torch.nonzero(x, as_tuple=False), 0)
    assert size.device == dev and size.dtype == torch.int32 and size.item() == 4
    y = torch.zeros(3, 5).to(dev)
    assert xlac._get_xla_tensor_dimension_size(y, -1).item() == 5
    with pytest.raises(IndexError, match=r"dimension 2 is out of range .* shape \(3, 5\)"):
        xlac._get_xla_tensor_dimension_size(y, 2)


def test_sync_multi_computes_only_the_given_tensors():
    x = torch.arange(4.0).to(dev)
    y, z = x * 2, x + 1
    xlac._xla_sync_multi([y, torch.ones(2)], [str(dev)], wait=True)
    assert graph.pending_count() == 1  # z is still pending
    assert_close(y, torch.arange(4.0) * 2)
    assert_close(z, torch.arange(4.0) + 1)
    xlac._xla_wait_device_ops([])


# ---- runtime and devices -------------------------------------------------------------------


def test_runtime_is_initialized_once_a_device_is_used():
    torch.ones(1).to(dev).cpu()
    assert xlac._xla_runtime_is_initialized() is True


def test_default_device_and_device_lists():
    assert xlac._xla_get_default_device() == "xla:0"
    assert torch.device(xlac._xla_get_default_device()) == dev
    assert xlac._xla_get_default_device_ordinal() == 0
    runtime_devices = [f"CPU:{k}" for k in range(8)]
    assert xlac._xla_get_devices() == runtime_devices  # one xla device per device outside SPMD
    assert xlac._xla_get_all_devices() == runtime_devices
    assert len(xlac._xla_get_all_devices()) == xr.global_device_count()
    assert xlac._xla_num_devices() == 8
    assert xlac._xla_get_runtime_devices() == runtime_devices
    assert xlac._xla_get_all_runtime_devices() == runtime_devices
    assert xlac._xla_num_runtime_devices() == 8 == xr.addressable_runtime_device_count()
    assert xlac._xla_real_devices() == runtime_devices
    assert xlac._xla_real_devices(["xla:0"]) == ["CPU:0"]


def test_runtime_devices_name_the_devices_shards_live_on(spmd_mode):
    xt = xs.mark_sharding(torch.zeros(8).to(dev), xs.get_1d_mesh(), (0,))
    assert [s.shard_device for s in xt.local_shards] == xlac._xla_get_runtime_devices()


def test_coordinator_of_a_one_process_job():
    xlac._ensure_xla_coordinator_initialized(global_rank=0, world_size=1, master_addr="localhost")
    with pytest.raises(RuntimeError, match=r"world_size=2\): this process is 0 of a job of 1"):
        xlac._ensure_xla_coordinator_initialized(0, 2, "localhost", "8547")


# ---- RNG and matmul precision ----------------------------------------------------------------


def test_rng_seed_round_trip_replays_random_values():
    xlac._xla_set_rng_seed(1234)
    assert xlac._xla_get_rng_seed() == 1234
    first = torch.rand(4, device=dev).cpu()
    xlac._xla_set_rng_seed(1234, str(dev))
    assert_close(torch.rand(4, device=dev), first)


def test_mat_mul_precision_set_and_get():
    before = xlac._xla_get_mat_mul_precision()
    try:
        for precision in ("default", "high", "highest"):
            xlac._xla_set_mat_mul_precision(precision)
            assert xlac._xla_get_mat_mul_precision() == precision
            assert spmd_torch.backends.get_mat_mul_precision() == precision
        with pytest.raises(RuntimeError, match="unknown precision 'fast'"):
            xlac._xla_set_mat_mul_precision("fast")
    finally:
        xlac._xla_set_mat_mul_precision(before)


# ---- counters and metrics --------------------------------------------------------------------


def test_counter_calls_are_the_metrics_modules():
    assert xlac._xla_counter_value is met.counter_value
    assert xlac._xla_metric_data is met.metric_data
    assert xlac._short_xla_metrics_report is met.short_metrics_report
    assert xlac._get_executed_fallback_ops is met.executed_fallback_ops


def test_increment_counter_adds_to_a_counter_of_any_name():
    met.clear_counters()
    xlac._xla_increment_counter("MarkStep", 3)
    spmd_torch.sync()
    assert met.counter_value("MarkStep") == 4
    xlac._xla_increment_counter("MyEvents", 2)
    assert xlac._xla_counter_value("MyEvents") == 2 and "MyEvents" in xlac._xla_counter_names()
    xlac._clear_xla_counters()
    assert met.counter_value("MyEvents") is None


def test_execute_computation_counts_one_device_programs():
    met.clear_all()
    for k in range(3):
        (torch.ones(2).to(dev) * k).cpu()
    assert met.counter_value("ExecuteComputation") == met.metric_data("ExecuteTime")[0] == 3
    assert met.counter_value("ExecuteReplicated") is None
    assert "Counter: ExecuteComputation\n  Value: 3" in met.metrics_report()


def test_create_compile_handles_counts_compiles():
    met.clear_all()
    for shape in [(13, 7), (11, 7), (13, 7)]:  # two distinct programs, then a cache hit
        (torch.ones(shape).to(dev) * 5).cpu()
    assert met.counter_value("CreateCompileHandles") == met.metric_data("CompileTime")[0] == 2
    report = met.short_metrics_report(counter_names=["CreateCompileHandles"])
    assert "Counter: CreateCompileHandles\n  Value: 2" in report


def test_execute_replicated_counts_programs_over_the_mesh_from_the_last_clear(spmd_mode):
    (torch.ones(8).to(dev) + 1).cpu()
    met.clear_counters()  # the metric keeps its samples; the counter starts over
    assert met.counter_value("ExecuteReplicated") is None
    assert "ExecuteReplicated" not in met.counter_names()
    t = torch.ones(2, 2).to(dev)
    t += 1
    spmd_torch.sync(wait=True)
    assert met.counter_value("ExecuteReplicated") == 1
    assert met.counter_value("ExecuteComputation") is None


def test_tensor_to_data_is_the_upload_time():
    met.clear_metrics()
    assert met.metric_data("TensorToData") is None and "TensorToData" not in met.metric_names()
    torch.tensor(156, device=dev)
    assert "TensorToData" in met.metric_names()
    assert met.metric_data("TensorToData") == met.metric_data("TransferToDeviceTime")
    assert "Metric: TensorToData\n" in met.metrics_report()
    assert "TensorToData" in met.short_metrics_report([], ["TensorToData"])
    met.clear_metrics()
    assert "TensorToData" not in met.metrics_report()


# ---- tensor debug info, device types, buffers, uploads, revisions ------------------------------


def test_debug_info_shows_the_pending_op_then_the_device_data():
    # As PyTorch/XLA's: an upload is a device-data IR node; a computed value, once synced, data
    # with no IR.
    assert xlac._get_xla_tensor_debug_info(torch.randn(5)) == "Not a XLATensor\n"
    x = torch.randn(5).to(dev)
    spmd_torch.sync()
    assert "IR: xla::device_data" in xlac._get_xla_tensor_debug_info(x)
    y = x + 5
    info = xlac._get_xla_tensor_debug_info(y)
    assert info.startswith("XLATensor {\n") and info.endswith("}\n")
    assert "XLA Shape: f32[5]" in info and "IR: aten::add.Tensor" in info
    assert "XLAData: None" in info
    spmd_torch.sync()
    info = xlac._get_xla_tensor_debug_info(y)
    assert "IR: None" in info and "XLAData: None" not in info
    assert "Data Shape: f32[5]" in info and f"Data Device: {xr.device_type()}:" in info


def test_debug_info_names_an_engine_op():
    # A compiled graph's call is one node of the engine's own op until the barrier.
    out = torch.compile(lambda t: t * 2, backend="spmd_torch")(torch.ones(3).to(dev))
    assert "IR: compiled_graph" in xlac._get_xla_tensor_debug_info(out)
    spmd_torch.sync()


@pytest.mark.parametrize(
    "make,shape",
    [
        (lambda: torch.view_as_real(torch.randn(4, dtype=torch.cfloat).to(dev)), "f32[4,2]"),
        (lambda: torch.view_as_complex(torch.randn(4, 2, dtype=torch.double).to(dev)), "c128[4]"),
    ],
)
def test_debug_info_and_text_name_complex_views_by_their_own_type(make, shape):
    t = make()
    assert f"XLA Shape: {shape}" in xlac._get_xla_tensor_debug_info(t)
    text = xlac._get_xla_tensors_text([t])
    assert text.endswith("\n") and shape in text.split("\n")[-3]


def test_text_names_a_device_data_input_as_pytorch_xla_does():
    """A computed tensor is an ``xla::device_data`` leaf in PyTorch/XLA's IR text, alone or read
    by a pending op; reading it again runs nothing."""
    x = torch.randn(1, 4).to(dev) * 2
    spmd_torch.sync()
    assert xlac._get_xla_tensors_text([x]) == "%in0:f32[1,4] = xla::device_data\nreturn %in0\n"
    assert "%in0:f32[1,4] = xla::device_data" in xlac._get_xla_tensors_text([x + 1])


def test_shape_type_is_the_element_type_the_device_holds(monkeypatch):
    half = torch.rand(3, dtype=torch.half).to(dev)
    assert xlac._get_xla_tensor_shape_type(half * torch.tensor(7.0, dtype=torch.double)) == "f16"
    assert xlac._get_xla_tensor_shape_type(torch.zeros(2, dtype=torch.bool).to(dev)) == "pred"
    monkeypatch.setattr(config.USE_BF16, "value", True)
    assert xlac._get_xla_tensor_shape_type(torch.zeros(2).to(dev)) == "bf16"


def test_unsafe_buffer_pointer_is_the_device_arrays():
    t = torch.arange(5, device=dev) * 2  # pending: computed first
    pointer = xlac._unsafe_buffer_pointer(t)
    (array,) = execute.materialize([t])
    assert pointer > 0 and pointer == array.unsafe_buffer_pointer()
    assert xlac._unsafe_buffer_pointer(torch.tensor(42, device=dev)) > 0


def test_tensors_from_aten_uploads_each_to_its_device_outside_autograd():
    cpu = [torch.randn(2, 3, requires_grad=True), torch.arange(4)]
    out = xlac._xla_tensors_from_aten(cpu, ["xla:0", "xla:0"])
    assert [t.device.type for t in out] == ["xla", "xla"] and not out[0].requires_grad
    for got, want in zip(out, cpu):
        assert_close(got.cpu(), want.detach())
    with pytest.raises(ValueError, match="2 tensors but 1 devices"):
        xlac._xla_tensors_from_aten(cpu, ["xla:0"])


def test_git_revs_name_the_xla_jax_and_torch_builds():
    revs = xlac._get_git_revs()
    assert revs["torch"] == torch.version.git_version
    assert revs["xla"] and revs["xla"] in (jaxlib.version._git_hash, f"jaxlib {jaxlib.__version__}")


def test_preemption_sync_manager_calls_reach_the_checkpoint_package():
    from spmd_torch.experimental.distributed_checkpoint import _preemption

    xlac._activate_preemption_sync_manager()
    try:
        assert xlac._sync_point_reached(1) is False  # no SIGTERM seen
    finally:
        xlac._deactivate_preemption_sync_manager()
    assert xlac._sync_point_reached is _preemption.sync_point_reached


def test_init_computation_client_starts_the_named_platform_and_keeps_its_first_failure(
    monkeypatch,
):
    """PyTorch/XLA's test_runtime_client_initialization_error: an unknown PJRT_DEVICE fails
    naming it, and the first call's outcome stands, even once the variable names a real one."""
    monkeypatch.setattr(xlac, "_CLIENT_START", [])
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    xlac._init_computation_client()  # the platform this process runs
    monkeypatch.setattr(xlac, "_CLIENT_START", [])
    message = "No PjRtPlugin registered for: DUMMY_DEVICE. Make sure the environment variable"
    for device_kind in ("DUMMY_DEVICE", "CPU"):
        monkeypatch.setenv("PJRT_DEVICE", device_kind)
        with pytest.raises(RuntimeError, match=message) as raised:
            xlac._init_computation_client()
        assert "Unknown backend dummy_device" in str(raised.value)


def test_dot_general_contracts_and_batches_as_xla():
    torch.manual_seed(0)
    x, w, v = torch.randn(4, 3, 5), torch.randn(4, 5, 2), torch.randn(6, 5)
    batched = xlac._xla_dot_general(x.to(dev), w.to(dev), (([-1], [1]), ([0], [0])))
    assert_close(batched, x @ w)
    linear = xlac._xla_dot_general(x.to(dev), v.to(dev), (([2], [1]), ()))
    assert_close(linear, x @ v.T)
    a = torch.randint(-100, 100, (3, 4), dtype=torch.int8)
    b = torch.randint(-100, 100, (4, 2), dtype=torch.int8)
    wide = xlac._xla_dot_general(
        a.to(dev), b.to(dev), (([1], [0]), ()), preferred_element_type=torch.int32
    )
    assert wide.dtype == torch.int32
    assert torch.equal(wide.cpu(), a.int() @ b.int())  # int8 products overflow int8
    with pytest.raises(RuntimeError, match="first argument needs a tensor on the xla device"):
        xlac._xla_dot_general(x, w.to(dev), (([2], [1]), ()))
    with pytest.raises(RuntimeError, match="for both lhs and rhs .* or for neither"):
        xlac._xla_dot_general(x.to(dev), w.to(dev), (([2],), ()))


def test_on_ready_callbacks_run_once_the_buffer_is_ready_and_pending_tensors_are_refused():
    from spmd_torch.experimental import callback

    x = torch.randn(300, 300, device=dev)
    y = x @ x
    with pytest.raises(RuntimeError, match=r"shape \(300, 300\) is pending"):
        callback.on_ready_callback(y, lambda t: None)
    spmd_torch.sync()
    seen = []
    done = threading.Event()

    def record(t):
        seen.append(t)
        done.set()

    callback.on_ready_callback(y, record)
    assert callback.on_ready_event(y).wait(30) and done.wait(30)
    assert seen == [y]  # the tensor itself, its value computed
    assert_close(y, x.cpu() @ x.cpu(), atol=1e-4, rtol=1e-4)
    fired = threading.Event()
    xlac._on_ready_callback(x, fired.set)  # an upload: ready as well
    assert fired.wait(30)


def test_forbidden_execution_raises_naming_the_line_and_runs_nothing():
    computed = torch.ones(2, device=dev) * 2
    spmd_torch.sync()
    pending = torch.ones(2, device=dev) * 3
    xlac._set_allow_execution(False)
    try:
        assert computed.cpu().tolist() == [2.0, 2.0]  # a computed value is read, nothing runs
        with pytest.raises(RuntimeError, match=r"compiled function, exiting: .* test_xlac\.py:\d+"):
            pending.cpu()
        assert graph.pending_count() == 1  # the value was not lost
    finally:
        xlac._set_allow_execution(True)
    assert pending.cpu().tolist() == [3.0, 3.0]


# ---- buffer donation by the user ---------------------------------------------------------------


def test_a_donated_buffer_goes_to_the_next_program_and_leaves_a_placeholder():
    """``_set_buffer_donation``: the barrier gives the live tensor's buffer up to the program
    (which XLA may reuse for an output of its shape), the tensor holds no data after, and
    reading it says why; the engine's own donation (``t1 += 2``) counts beside it."""
    a, b = torch.randn(4, 2, 7), torch.randn(4, 2, 7)  # shapes no other test compiles
    t0, t1 = a.to(dev), b.to(dev)
    spmd_torch.sync()
    counted = met.counter_value("XlaSetBufferDonation") or 0
    assert xlac._set_buffer_donation(t0, True) is True
    assert xlac._get_buffer_donation(t0) and not xlac._get_buffer_donation(t1)
    assert met.counter_value("XlaSetBufferDonation") == counted + 1
    t2 = t0 + t1
    t1 += 2
    spmd_torch.sync(wait=True)
    assert xlac._is_placecholder(t0) and not xlac._is_placecholder(t1)
    assert met.metric_data("InputOutputAliasCount")[2][-1][1] == 2  # t0's and t1's old buffers
    assert_close(t2.cpu(), a + b, tol="exact")
    assert_close(t1.cpu(), b + 2, tol="exact")
    with pytest.raises(RuntimeError, match="donated with _XLAC._set_buffer_donation"):
        t0.cpu()
    with pytest.raises(RuntimeError, match="donated with _XLAC._set_buffer_donation"):
        (t0 * 2).cpu()


def test_only_data_is_donated_and_a_donation_can_be_taken_back():
    t0 = torch.randn(3).to(dev)
    pending = t0 + 1
    counted = met.counter_value("XlaSetBufferDonation") or 0
    assert xlac._set_buffer_donation(pending, True) is False  # no buffer yet
    assert xlac._set_buffer_donation(t0[1:], True) is False  # a view's is its base's
    assert (met.counter_value("XlaSetBufferDonation") or 0) == counted
    spmd_torch.sync()
    assert xlac._set_buffer_donation(t0, True) and xlac._set_buffer_donation(t0, False)
    assert not xlac._get_buffer_donation(t0)
    out = t0 * 3
    spmd_torch.sync(wait=True)
    assert not xlac._is_placecholder(t0)
    assert_close(out.cpu(), t0.cpu() * 3, tol="exact")


def test_a_donation_outlives_syncs_with_nothing_to_run():
    t0 = torch.randn(5, 5).to(dev)
    assert xlac._set_buffer_donation(t0, True)
    spmd_torch.sync()
    spmd_torch.sync()
    assert xlac._get_buffer_donation(t0) and not xlac._is_placecholder(t0)


# ---- placeholder tensors ----------------------------------------------------------------------


def test_a_placeholder_tensor_is_traced_and_staged_out_never_read():
    """``xla_builder.create_placeholder_tensor``: a shape and a dtype, no data, nothing uploaded.
    A graph traced on placeholders lowers with each one a parameter (read twice, still one); a
    read of one, or of a value computed from one, raises naming it; a barrier computes everything
    else and leaves the values read from placeholders pending, their reads raising as before."""
    met.clear_all()
    shapes = ((1, 2), (2, 3, 4), (3, 4, 5, 6))
    for shape, dtype in zip(shapes, (torch.float32, torch.bfloat16, torch.int8)):
        p = xb.create_placeholder_tensor(shape, dtype)
        assert p.device == dev and p.dtype == dtype and p.shape == shape
        assert xlac._is_placecholder(p)
    p1 = xb.create_placeholder_tensor((2, 3), torch.bfloat16)
    p2 = xb.create_placeholder_tensor((3, 4), torch.bfloat16)
    b = (torch.sin(p1) @ p2) @ p2.T
    assert xlac._get_xla_tensors_text([b]).count("xla::device_data") == 2
    entry = re.search(r"ENTRY .*\((.*)\) -> (\S+) \{", xlac._get_xla_tensors_hlo([b]))
    assert re.findall(r": (\w+\[[\d,]*\])", entry[1]) == ["bf16[2,3]", "bf16[3,4]"]
    assert entry[2] == "bf16[2,3]"
    context = xlac.lowering.LoweringContext()
    context.build([b])
    assert (context.tensor_parameter_id(p1), context.tensor_parameter_id(p2)) == (0, 1)
    assert not met.metric_data("TransferToDeviceTime")
    for read in (p1.cpu, b.cpu):
        with pytest.raises(RuntimeError, match=r"placeholder tensor of shape \[2, 3\] and dtype"):
            read()
    x = torch.arange(3.0, device=dev)
    y = x * 2
    spmd_torch.sync()
    assert torch.equal(y.cpu(), torch.arange(3.0) * 2)
    with pytest.raises(RuntimeError, match="holds no data"):
        b.cpu()


def test_a_marked_placeholder_stages_out_its_sharding(spmd_mode):
    """Under SPMD a placeholder takes a ``mark_sharding`` as data does (uneven sizes padded), and
    the staged-out graph reads it as a parameter in that layout; no program runs."""
    p = xb.create_placeholder_tensor((6, 4), torch.float32)
    xs.mark_sharding(p, xs.Mesh(np.arange(8), (8, 1)), (0, None))
    assert xlac._get_xla_sharding_spec(p) == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    hlo = xlac._get_xla_tensors_hlo([p * 2])
    assert re.search(r"parameter\(0\), sharding=\{devices=\[8,1\]0,1,2,3,4,5,6,7\}", hlo)
    with pytest.raises(RuntimeError, match=r"placeholder tensor of shape \[6, 4\]"):
        (p * 2).cpu()


def test_tensor_handles_name_their_data():
    """``_get_tensors_handle``: one number per tensor's data, equal for tensors sharing it,
    distinct for placeholders; none for a pending value or a buffer a program took."""
    t0, t1 = torch.randn(4, 3).to(dev), torch.randn(4, 3).to(dev)
    spmd_torch.sync()
    alias = t0.detach()
    h0, h1, h_alias = xlac._get_tensors_handle([t0, t1, alias])
    assert h0 != h1 and h0 == h_alias
    p1, p2 = (xb.create_placeholder_tensor((1,), torch.bfloat16) for _ in range(2))
    assert len(set(xlac._get_tensors_handle([p1, p2]))) == 2
    with pytest.raises(RuntimeError, match="pending value"):
        xlac._get_tensors_handle([t0 + 1])
    assert xlac._set_buffer_donation(t0, True)
    _ = t0 + t1
    spmd_torch.sync(wait=True)
    assert xlac._is_placecholder(t0)
    with pytest.raises(RuntimeError, match="is deleted"):
        xlac._get_tensors_handle([t0])


@pytest.mark.parametrize("on_every_run", [False, True])
def test_a_partial_read_gives_up_donated_data_only_when_configured(on_every_run):
    """``_xla_sync_multi`` (a partial read, where the engine donates nothing) gives up the data
    its user donated only with the alias-with-buffer-donor config on, as PyTorch/XLA."""
    assert xlac._xla_get_enable_alias_with_buffer_donor_config() is False
    t0, t1 = torch.randn(4, 9).to(dev), torch.randn(4, 9).to(dev)
    spmd_torch.sync()
    xlac._xla_set_enable_alias_with_buffer_donor_config(on_every_run)
    try:
        assert xlac._xla_get_enable_alias_with_buffer_donor_config() is on_every_run
        xlac._set_buffer_donation(t0, True)
        want = t0.cpu() + t1.cpu()
        t2 = t0 + t1
        xlac._xla_sync_multi([t0, t1, t2], [str(dev)], True, False)
        assert xlac._is_placecholder(t0) is on_every_run
        assert met.metric_data("InputOutputAliasCount")[2][-1][1] == int(on_every_run)
        assert_close(t2.cpu(), want, tol="exact")
    finally:
        xlac._xla_set_enable_alias_with_buffer_donor_config(False)
