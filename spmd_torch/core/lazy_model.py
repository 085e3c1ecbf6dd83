"""lazy_tensor_core.core.lazy_model: the lazy-tensor-core guide's names, on ``xla_model``'s code.

PyTorch's lazy-tensor-core prototype (``import lazy_tensor_core.core.lazy_model as ltm``) spelt
``xla_model`` with ``lazy`` for ``xla``. Each name here *is* the ``xla_model`` function (the same
object), so the guide's scripts run with ``ltm`` = this module and behave exactly as with ``xm``:
``ltm.lazy_device()`` is the xla device, ``ltm.mark_step()`` the barrier, ``ltm.save`` moves
tensors to the CPU first.

Example:
    >>> import spmd_torch.core.lazy_model as ltm
    >>> device = ltm.lazy_device()
    >>> model = MNIST().train().to(device)
    >>> for data, target in train_loader:
    ...     optimizer.zero_grad()
    ...     loss_fn(model(data.to(device)), target.to(device)).backward()
    ...     optimizer.step()
    ...     ltm.mark_step()
"""

from __future__ import annotations

from spmd_torch.core import xla_model as _xm

REDUCE_SUM = _xm.REDUCE_SUM
REDUCE_MUL = _xm.REDUCE_MUL
REDUCE_AND = _xm.REDUCE_AND
REDUCE_OR = _xm.REDUCE_OR
REDUCE_MIN = _xm.REDUCE_MIN
REDUCE_MAX = _xm.REDUCE_MAX

# The guide's renamed devices and tensors.
lazy_device = _xm.xla_device
is_lazy_tensor = _xm.is_xla_tensor
get_lazy_supported_devices = _xm.get_xla_supported_devices
lazy_real_devices = _xm.xla_real_devices
lazy_device_hw = _xm.xla_device_hw
lazy_replication_devices = _xm.xla_replication_devices
parse_lazy_device = _xm.parse_xla_device
ToLazyTensorArena = _xm.ToXlaTensorArena

# Names shared with xla_model.
xrt_world_size = _xm.xrt_world_size
get_ordinal = _xm.get_ordinal
get_local_ordinal = _xm.get_local_ordinal
is_master_ordinal = _xm.is_master_ordinal
master_print = _xm.master_print
unlazy = _xm.unlazy
RateTracker = _xm.RateTracker
all_reduce = _xm.all_reduce
all_gather = _xm.all_gather
all_to_all = _xm.all_to_all
collective_permute = _xm.collective_permute
add_step_closure = _xm.add_step_closure
mark_step = _xm.mark_step
wait_device_ops = _xm.wait_device_ops
reduce_gradients = _xm.reduce_gradients
optimizer_step = _xm.optimizer_step
save = _xm.save
send_cpu_data_to_device = _xm.send_cpu_data_to_device
rendezvous = _xm.rendezvous
do_on_ordinals = _xm.do_on_ordinals
mesh_reduce = _xm.mesh_reduce
set_rng_state = _xm.set_rng_state
get_rng_state = _xm.get_rng_state
get_memory_info = _xm.get_memory_info
