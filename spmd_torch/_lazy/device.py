"""The ``xla`` device: PyTorch's PrivateUse1 backend renamed, with a Python device guard.

We do the steps of ``torch.utils.backend_registration._setup_privateuseone_for_python_backend``
ourselves, skipping its generated ``Tensor.is_xla``-style methods (that name is PyTorch's own).
Factory calls (``torch.empty(..., device='xla')``) reach the PrivateUse1 key with no tensor
argument; a kernel per factory sends them to the same dispatcher as every other op.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.optim.optimizer as torch_optimizer

from . import attention, rng
from .dispatch import issue
from .engine import FORKED_AFTER_JAX, current
from .execute import rng_words, wait_device_ops
from .lowering.amp import AUTOCAST_KEY, AUTOCAST_POLICY, autocast_kernel
from .tensor import DEVICE, LazyTensor, _rebuild_on_device


class _Stream:
    """The device's one stream: JAX orders device work itself. torch.distributed.checkpoint's
    FileSystemWriter asks the backend for it."""

    device_type = DEVICE.type

    def synchronize(self) -> None:
        wait_device_ops()

    def wait_stream(self, other) -> None:
        """Work on one stream is already ordered."""


_STREAM = _Stream()


class _BackendModule:
    """What ``torch.xla`` answers: the mode's devices, one stream; seeding reaches the device PRNG."""

    @staticmethod
    def current_stream(device=None) -> _Stream:
        return _STREAM

    @staticmethod
    def stream(stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext(stream)

    @staticmethod
    def is_available() -> bool:
        # Not torch.accelerator's device, as PyTorch/XLA's XLA device type never is: a DataLoader
        # with pin_memory=True (transformers' default) would pin through PrivateUse1's allocator.
        return False

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return current().mode.device_count()

    @staticmethod
    def _is_in_bad_fork() -> bool:
        """True in a child forked after JAX started (as ``torch.cuda``'s after CUDA started):
        ``torch.manual_seed`` in a DataLoader worker then leaves the device alone."""
        return bool(FORKED_AFTER_JAX)

    @staticmethod
    def get_amp_supported_dtype() -> list:
        """What ``torch.autocast('xla', dtype=...)`` accepts."""
        return [torch.bfloat16, torch.float16]

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        rng.manual_seed(seed)

    manual_seed = manual_seed_all

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        """The device PRNG key as a CPU uint8 tensor (what torch.random.fork_rng saves)."""
        words = np.array(rng_words(), dtype=np.uint32)
        return torch.from_numpy(words.view(np.uint8).copy())

    @staticmethod
    def set_rng_state(state: torch.Tensor, device=None) -> None:
        rng.set_words(*(int(w) for w in state.numpy().view(np.uint32)))


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, device_index) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _DeviceGuard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


aten = torch.ops.aten

# Ops that reach the PrivateUse1 key itself: factories (no tensor argument), and copies that
# torch.tensor(..., device='xla') makes with the Python key excluded.
_BACKEND_OPS = [
    aten.copy_.default,
    aten._copy_from.default,
    aten._copy_from_and_resize.default,
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.full.default,
    aten.zeros.default,
    aten.ones.default,
    aten.scalar_tensor.default,
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.linspace.default,
    aten.eye.default,
    aten.eye.m,
    aten.rand.default,
    aten.randn.default,
    aten.randint.default,
    aten.randint.low,
    aten.randperm.default,
    aten._efficientzerotensor.default,
]


def _factory_kernel(op):
    def kernel(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and device.index:  # xla:1...: checked, and ops look for devices
            current().mode.use_device(device.index)
        return issue(op, args, kwargs)

    return kernel


def _einsum_above_autograd(equation, operands, path=None):
    """einsum reaches the lowering whole (one dot_general, no reshapes) unless autograd must
    record it: then ATen's decomposition, whose ops autograd knows. PyTorch/XLA's patched linear
    calls it with gradients off, in its forward and its backward alike."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in operands):
        return aten.einsum.default.decompose(equation, operands, path=path)
    with torch._C._AutoDispatchBelowAutograd():
        return aten.einsum.default(equation, operands, path=path)


def _contract(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.einsum(equation, a, b)`` inside a backward: straight to our dispatch when nothing
    between would act on it (no gradient recorded, no autocast, no dispatch mode, both lazy), as
    torch.einsum's Python and the dispatcher's hop back into Python cost more than the op's
    recording; otherwise the whole way, so ``create_graph`` records a differentiable graph."""
    direct = (
        type(a) is LazyTensor
        and type(b) is LazyTensor
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled(DEVICE.type)
        and not torch._C._len_torch_dispatch_stack()
    )
    if direct:
        return LazyTensor.__torch_dispatch__(aten.einsum.default, (), (equation, [a, b]))
    return torch.einsum(equation, a, b)


class _Linear(torch.autograd.Function):
    """``F.linear`` as one recorded node forward and three backward (two einsums and a sum),
    where ATen's decomposition records the weight's transpose, reshapes of a batched input, an
    addmm and their backward; PyTorch/XLA patches linear with einsums for the same reason. A
    backward that autograd records (``create_graph``) is made of differentiable ops."""

    generate_vmap_rule = True

    @classmethod
    def apply(cls, x, weight, bias):
        """``Function.apply`` without its per-call ``inspect.signature`` binding (the arguments
        are bound already), except under functorch transforms, which need its path."""
        if torch._C._are_functorch_transforms_active():
            return super().apply(x, weight, bias)
        return super(torch.autograd.Function, cls).apply(x, weight, bias)

    @staticmethod
    def forward(x, weight, bias):
        with torch._C._AutoDispatchBelowAutograd():
            return aten.linear.default(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias = inputs
        ctx.save_for_backward(x, weight)
        ctx.bias_shape = None if bias is None else bias.shape

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _contract("...o,oi->...i", grad, weight)
        if ctx.needs_input_grad[1]:
            grad_weight = _contract("...o,...i->oi", grad, x)
        if ctx.bias_shape is not None and ctx.needs_input_grad[2]:
            if grad.dim() > 1 and ctx.bias_shape == grad.shape[-1:]:
                grad_bias = grad.sum(list(range(grad.dim() - 1)))
            else:  # a vector input, or a bias that broadcasts otherwise
                grad_bias = grad.sum_to_size(ctx.bias_shape)
        return grad_x, grad_weight, grad_bias


def _linear_above_autograd(x, weight, bias=None):
    """linear reaches the lowering whole: as one autograd Function where gradients are taken."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _Linear.apply(x, weight, bias)
    with torch._C._AutoDispatchBelowAutograd():
        return aten.linear.default(x, weight, bias)


_registered: list = []


def register() -> None:
    """Make ``torch.device('xla')`` our lazy device; idempotent."""
    if _registered:
        return
    if torch._C._get_privateuse1_backend_name() != DEVICE.type:
        torch.utils.rename_privateuse1_backend(DEVICE.type)
    torch._register_device_module(DEVICE.type, _BackendModule())
    # torch.save of an xla tensor pickles a CPU copy and this rebuild; weights_only loads allow it.
    torch.serialization.add_safe_globals([_rebuild_on_device])
    torch._C._acc.register_python_privateuseone_hook(_Hooks())
    torch._C._acc.register_python_privateuseone_device_guard(_DeviceGuard())
    library = torch.library.Library("aten", "IMPL")
    for op in _BACKEND_OPS:
        library.impl(op, _factory_kernel(op), "PrivateUse1")
    library.impl(aten.einsum.default, _einsum_above_autograd, "AutogradPrivateUse1")
    library.impl(aten.linear.default, _linear_above_autograd, "AutogradPrivateUse1")
    for op, kernel in attention.ABOVE_AUTOGRAD.items():  # attention as one op each way
        library.impl(op, kernel, "AutogradPrivateUse1")
    # Autocast: PyTorch/XLA's cast policy above autograd; every other op passes through.
    for op, policy in AUTOCAST_POLICY.items():
        library.impl(op, autocast_kernel(op, policy), AUTOCAST_KEY)
    passthrough = torch.library.Library("_", "IMPL")
    passthrough.fallback(torch.library.fallthrough_kernel, AUTOCAST_KEY)
    torch.set_autocast_dtype(DEVICE.type, torch.bfloat16)  # AutocastXLA's default (thread-local)
    # torch.optim and clip_grad_norm_ take their multi-tensor path (one node per foreach call)
    # only for the tensor types they list; xla parameters are LazyTensors.
    for supported in (torch_optimizer, torch.utils._foreach_utils):
        supported._foreach_supported_types.append(LazyTensor)
    _registered.extend([library, passthrough])
    # Backward of device tensors runs on the calling thread: an error raised by a backward op on
    # autograd's per-device worker thread of a Python backend terminates the process.
    torch._C._set_multithreading_enabled(False)
