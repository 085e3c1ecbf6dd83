"""Autocast on xla tensors: output dtypes as eager CPU autocast gives them where PyTorch/XLA's
policy and CPU's agree (PyTorch/XLA's own rows otherwise), values within low-precision tolerance
of a float64 reference on the inputs cast as the policy says, rounded once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd_torch
import spmd_torch.amp as amp
from tests.helpers import assert_close, reference, to_cpu, to_device, tolerance

BF16, F32 = torch.bfloat16, torch.float32


def _randn(*shape, dtype=F32):
    return torch.randn(*shape).to(dtype)


def _logits_and_targets():
    return (_randn(6, 5, dtype=BF16), torch.randint(0, 5, (6,)))


# name -> (fn, inputs factory). The dtype each gives under bfloat16 autocast is eager CPU
# autocast's (the two policies agree on these rows).
SHARED = {
    "mm": (torch.mm, lambda: (_randn(4, 6), _randn(6, 3))),
    "matmul": (torch.matmul, lambda: (_randn(2, 4, 6), _randn(6, 3))),
    "linear": (F.linear, lambda: (_randn(4, 6), _randn(3, 6), _randn(3))),
    "bmm": (torch.bmm, lambda: (_randn(2, 4, 6), _randn(2, 6, 3))),
    "baddbmm": (torch.baddbmm, lambda: (_randn(2, 4, 3), _randn(2, 4, 6), _randn(2, 6, 3))),
    "addmm": (torch.addmm, lambda: (_randn(4, 3), _randn(4, 6), _randn(6, 3))),
    "addbmm": (torch.addbmm, lambda: (_randn(4, 3), _randn(2, 4, 6), _randn(2, 6, 3))),
    "conv1d": (F.conv1d, lambda: (_randn(2, 3, 9), _randn(4, 3, 3), _randn(4))),
    "conv2d": (F.conv2d, lambda: (_randn(2, 3, 6, 6), _randn(4, 3, 3, 3), _randn(4))),
    "conv_transpose2d": (F.conv_transpose2d, lambda: (_randn(2, 3, 5, 5), _randn(3, 4, 3, 3))),
    "einsum": (
        lambda a, b: torch.einsum("bij,bjk->bik", a, b),
        lambda: (_randn(2, 4, 6), _randn(2, 6, 3)),
    ),
    "prelu": (F.prelu, lambda: (_randn(2, 3, 4), _randn(3))),
    "scaled_dot_product_attention": (  # float32 q and k (rotary products) with a bfloat16 v
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        lambda: (_randn(1, 2, 8, 4), _randn(1, 2, 8, 4), _randn(1, 2, 8, 4, dtype=BF16)),
    ),
    "mse_loss": (F.mse_loss, lambda: (_randn(4, 5, dtype=BF16), _randn(4, 5, dtype=BF16))),
    "l1_loss": (F.l1_loss, lambda: (_randn(4, 5, dtype=BF16), _randn(4, 5, dtype=BF16))),
    "smooth_l1_loss": (
        F.smooth_l1_loss,
        lambda: (_randn(4, 5, dtype=BF16), _randn(4, 5, dtype=BF16)),
    ),
    "cross_entropy": (F.cross_entropy, _logits_and_targets),
    "nll_loss": (lambda x, t: F.nll_loss(x, t), _logits_and_targets),
    "bce_with_logits": (
        F.binary_cross_entropy_with_logits,
        lambda: (_randn(4, 5, dtype=BF16), torch.rand(4, 5).to(BF16)),
    ),
    "kl_div": (
        lambda a, b: F.kl_div(a, b, reduction="batchmean"),
        lambda: (_randn(4, 5, dtype=BF16), torch.rand(4, 5).to(BF16)),
    ),
    "prod": (lambda x: torch.prod(x, dim=1), lambda: (torch.rand(4, 5).add(0.5).to(BF16),)),
    "cdist": (torch.cdist, lambda: (_randn(4, 3, dtype=BF16), _randn(5, 3, dtype=BF16))),
    "cat_widest": (
        lambda a, b: torch.cat([a, b]),
        lambda: (_randn(2, 3, dtype=BF16), _randn(2, 3)),
    ),
    "stack_lower": (
        lambda a, b: torch.stack([a, b]),
        lambda: (_randn(2, 3, dtype=BF16), _randn(2, 3, dtype=BF16)),
    ),
    "index_copy_widest": (
        lambda x, s: x.index_copy(0, torch.tensor([2, 0], device=x.device), s),
        lambda: (_randn(3, 4, dtype=BF16), _randn(2, 4)),
    ),
    "layer_norm_unlisted": (
        lambda x, w, b: F.layer_norm(x, (5,), w, b),
        lambda: (_randn(4, 5, dtype=BF16), _randn(5, dtype=BF16), _randn(5, dtype=BF16)),
    ),
    "add_unlisted": (torch.add, lambda: (_randn(4, 5), _randn(4, 5))),
}

# PyTorch/XLA's rows where CPU autocast has none: name -> (fn, inputs factory, dtype).
XLA_ONLY = {
    "relu": (torch.relu, lambda: (_randn(4, 5),), BF16),
    "max_pool2d": (lambda x: F.max_pool2d(x, 2), lambda: (_randn(2, 3, 4, 4),), BF16),
    "softmax": (lambda x: torch.softmax(x, -1), lambda: (_randn(4, 5, dtype=BF16),), F32),
    "log_softmax": (lambda x: torch.log_softmax(x, -1), lambda: (_randn(4, 5, dtype=BF16),), F32),
    "batch_norm": (
        lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
        lambda: (_randn(4, 3, 5, dtype=BF16), _randn(3), _randn(3)),
        F32,
    ),
}


def _cast_floating(inputs, dtype):
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)


def _expected(fn, inputs, dtype: torch.dtype):
    """The float64 result on the inputs cast to the policy's dtype, rounded once to ``dtype``
    (what an op the policy lists computes); ops without a row keep their inputs' dtypes."""
    if dtype == F32:
        return reference(fn, *_cast_floating(inputs, F32))
    return reference(fn, *_cast_floating(inputs, BF16))


def _on_xla(fn, inputs, context):
    with context():
        out = fn(*to_device(inputs))
    spmd_torch.sync()
    return to_cpu(out)


CONTEXTS = {
    "spmd_torch.amp.autocast": lambda: amp.autocast(spmd_torch.device()),
    "torch.autocast('xla', bf16)": lambda: torch.autocast("xla", dtype=BF16),
    "torch.autocast(device_type='xla')": lambda: torch.autocast(device_type="xla"),
}


@pytest.mark.parametrize("context", sorted(CONTEXTS))
@pytest.mark.parametrize("name", sorted(SHARED))
def test_dtype_and_value_as_cpu_autocast(name, context):
    torch.manual_seed(0)
    fn, make = SHARED[name]
    inputs = make()
    with torch.autocast("cpu", dtype=BF16):
        cpu_dtype = fn(*inputs).dtype
    actual = _on_xla(fn, inputs, CONTEXTS[context])
    assert actual.dtype == cpu_dtype, f"{name}: {actual.dtype}, CPU autocast gives {cpu_dtype}"
    floating = {x.dtype for x in inputs if x.is_floating_point()}
    if name.endswith("_unlisted"):
        expected = reference(fn, *inputs)  # no row: the op runs in its inputs' dtypes
    else:
        expected = _expected(
            fn, inputs, F32 if cpu_dtype == F32 and floating != {F32} else cpu_dtype
        )
    assert_close(actual, expected)


@pytest.mark.parametrize("name", sorted(XLA_ONLY))
def test_dtype_of_pytorch_xla_rows(name):
    torch.manual_seed(0)
    fn, make, dtype = XLA_ONLY[name]
    inputs = make()
    actual = _on_xla(fn, inputs, CONTEXTS["spmd_torch.amp.autocast"])
    assert actual.dtype == dtype
    assert_close(actual, _expected(fn, inputs, dtype))


def test_default_dtype_is_bfloat16_on_cpu_and_tpu():
    device = spmd_torch.device()
    a, b = to_device((_randn(4, 6), _randn(6, 3)))
    with amp.autocast(device):
        ours = a @ b
    with torch.autocast("xla"):
        plain = a @ b
    assert (ours.dtype, plain.dtype) == (BF16, BF16)
    spmd_torch.sync()


def test_float16_as_cpu_autocast():
    torch.manual_seed(0)
    inputs = (_randn(4, 6), _randn(3, 6), _randn(3))
    with torch.autocast("cpu", dtype=torch.float16):
        cpu_dtype = F.linear(*inputs).dtype
    actual = _on_xla(F.linear, inputs, lambda: amp.autocast("xla", dtype=torch.float16))
    assert actual.dtype == cpu_dtype == torch.float16
    assert_close(actual, reference(F.linear, *_cast_floating(inputs, torch.float16)))


def test_nested_disabled_region_runs_in_input_dtype():
    a, b = to_device((_randn(4, 6), _randn(6, 3)))
    with amp.autocast(spmd_torch.device()):
        with amp.autocast(spmd_torch.device(), enabled=False):
            inner = a @ b
        outer = a @ b
    assert (inner.dtype, outer.dtype) == (F32, BF16)
    spmd_torch.sync()


def test_no_grad_region_casts_too():
    a, b = to_device((_randn(4, 6), _randn(6, 3)))
    with torch.no_grad(), torch.autocast("xla", dtype=BF16):
        out = a @ b
    assert out.dtype == BF16
    spmd_torch.sync()


def test_gradients_come_back_in_parameter_dtype():
    """Autocast sits above autograd: the cast is recorded, so a float32 weight gets a float32
    gradient: the bf16 matmul's gradient, widened (the reference: the same casts by hand)."""
    torch.manual_seed(0)
    x, w = _randn(4, 6), _randn(3, 6)

    def loss_of(x, w, autocast):
        with autocast():
            y = F.linear(x, w)
        return y.float().pow(2).sum()

    xd, wd = (t.requires_grad_() for t in to_device((x, w)))
    loss_of(xd, wd, CONTEXTS["torch.autocast('xla', bf16)"]).backward()
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    y = F.linear(xr.to(BF16).double(), wr.to(BF16).double()).to(BF16)  # bf16 forward result
    (y.double().pow(2).sum()).backward()
    assert (xd.grad.dtype, wd.grad.dtype) == (F32, F32)
    grads = to_cpu((xd.grad, wd.grad))
    assert_close(grads, (xr.grad.float(), wr.grad.float()), **tolerance(BF16))  # bf16 results


def test_as_decorator():
    @amp.autocast(spmd_torch.device())
    def product(a, b):
        return a @ b

    out = product(*to_device((_randn(4, 6), _randn(6, 3))))
    assert out.dtype == BF16
    spmd_torch.sync()


def test_non_xla_device_raises_assertion_error():
    with pytest.raises(AssertionError, match="xla devices, got 'cpu'"):
        amp.autocast("cpu")


def test_unsupported_dtype_warns_and_disables():
    with pytest.warns(UserWarning, match="not supported"):
        region = amp.autocast(spmd_torch.device(), dtype=torch.float64)
    a, b = to_device((_randn(4, 6), _randn(6, 3)))
    with region:
        out = a @ b
    assert out.dtype == F32
    spmd_torch.sync()


def test_promote_refuses_mixed_low_precision_inputs():
    a, b = to_device((_randn(2, 3, dtype=BF16), _randn(2, 3, dtype=torch.float16)))
    with amp.autocast(spmd_torch.device()), pytest.raises(RuntimeError, match="aten.cat"):
        torch.cat([a, b])


def test_launch_replicas_inherit_the_default_autocast_dtype():
    """PyTorch keeps the default per thread; each replica of launch is a thread."""

    def replica(index):
        x = torch.ones(4, 4, device=spmd_torch.device())
        with torch.autocast("xla"):
            out = x @ x
        return out.dtype, torch.get_autocast_dtype("xla")

    results = spmd_torch.launch(replica)
    assert set(results.values()) == {(torch.bfloat16, torch.bfloat16)}
