"""Pallas kernels of one's own on xla tensors (torch_xla.experimental.custom_kernel's
``make_kernel_from_pallas``, ``trace_pallas`` and ``_XLAC._xla_tpu_custom_call``), and PyTorch/XLA's
ops ``torch.ops.xla.flash_attention`` and ``torch.ops.xla.gmm``: values against eager PyTorch on
CPU or float64 written out here, one compile per kernel and shapes, the errors for what does not
fit. The kernels run through Pallas's interpreter (``interpret=True``, or JAX's TPU kernels with
``pallas_interpreted``), as no accelerator is needed to check them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
from jax.experimental import pallas as pl

import spmd_torch
import spmd_torch._XLAC as xlac
from spmd_torch import config
from spmd_torch.debug import graph
from spmd_torch.experimental.custom_kernel import (
    convert_torch_dtype_to_jax,
    make_kernel_from_pallas,
    to_jax_shape_dtype_struct,
    trace_pallas,
)
from tests.core.test_custom_kernel import attention_float64
from tests.core.test_grouped_matmul import gmm_float64, inputs
from tests.helpers import assert_close, assert_compiles, pallas_interpreted

dev = spmd_torch.device()


def _add_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]


@jax.jit
def add_vectors(x, y):
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(_add_kernel, out_shape=out, interpret=True)(x, y)


def add_and_subtract(x, y):
    def kernel(x_ref, y_ref, sum_ref, difference_ref):
        sum_ref[...] = x_ref[...] + y_ref[...]
        difference_ref[...] = x_ref[...] - y_ref[...]

    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(kernel, out_shape=[out, out], interpret=True)(x, y)


def scaled(x, factor):
    """A static argument the kernel's body closes over."""

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * factor

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(
        x
    )


def same_as(x, y):
    return [(x.shape, x.dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bfloat16])
def test_a_wrapped_kernel_computes_on_xla_tensors(dtype):
    x = torch.arange(24, dtype=torch.float32).reshape(3, 8).to(dtype)
    y = (torch.arange(24, dtype=torch.float32).reshape(3, 8) * 3 - 7).to(dtype)
    out = make_kernel_from_pallas(add_vectors, same_as)(x.to(dev), y.to(dev))
    assert out.device.type == "xla" and out.dtype == dtype
    torch.testing.assert_close(out.cpu(), x + y, rtol=0, atol=0)


def test_a_wrapped_kernel_is_one_op_of_the_step_and_compiles_once():
    kernel = make_kernel_from_pallas(add_vectors, same_as)
    x = torch.randn(4, 128)
    out = kernel(x.to(dev), x.to(dev)) * 2
    ops = [str(node.op) for node in graph.pending_program([out]).nodes]
    assert ops[0] == "xla::add_vectors" and len(ops) == 2, ops  # the kernel, then the product
    spmd_torch.sync()
    with assert_compiles(0):  # the same step again: the program compiled above is reused
        for _ in range(2):
            again = kernel(x.to(dev), x.to(dev)) * 2
            spmd_torch.sync()
    assert_close(again.cpu(), (x + x) * 2)


def test_several_outputs_come_back_as_a_tuple():
    kernel = make_kernel_from_pallas(
        add_and_subtract, lambda x, y: [(x.shape, x.dtype), (x.shape, x.dtype)]
    )
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    total, difference = kernel(x.to(dev), y.to(dev))
    torch.testing.assert_close(total.cpu(), x + y)
    torch.testing.assert_close(difference.cpu(), x - y)


def test_static_arguments_reach_the_kernel_as_values():
    kernel = make_kernel_from_pallas(scaled, lambda x, *_: [(x.shape, x.dtype)])
    x = torch.randn(2, 8)
    for factor in (3.0, -0.5):
        out = kernel(x.to(dev), factor, static_argnums=(1,))
        torch.testing.assert_close(out.cpu(), x * factor)
    out = kernel(x.to(dev), factor=2.0, static_argnames=["factor"])
    torch.testing.assert_close(out.cpu(), x * 2.0)


def test_trace_pallas_gives_the_payload_xla_tpu_custom_call_runs():
    x, y = torch.randn(8, 128), torch.randn(8, 128)
    payload, tensors = trace_pallas(add_vectors, x.to(dev), y.to(dev))
    assert len(tensors) == 2
    (out,) = xlac._xla_tpu_custom_call(tensors, payload, [x.shape], [x.dtype])
    torch.testing.assert_close(out.cpu(), x + y)


def test_jaxs_tpu_flash_kernel_wrapped_equals_float64_attention(monkeypatch):
    """PyTorch/XLA's own example of a wrapped kernel: JAX's Pallas flash attention for TPU."""
    from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention

    q, k, v = (
        torch.randn(3, 2, 128, 8, generator=torch.Generator().manual_seed(s)) for s in range(3)
    )
    kernel = make_kernel_from_pallas(flash_attention, lambda q, k, v: [(q.shape, q.dtype)])
    with pallas_interpreted(monkeypatch):
        out = kernel(
            *(t.to(dev) for t in (q, k, v)),
            causal=True,
            sm_scale=0.5,
            static_argnames=["causal", "sm_scale"],
        )
        out = out.cpu()
    assert_close(out, attention_float64(q, k, v, causal=True, sm_scale=0.5).float())


def test_what_does_not_fit_is_named():
    x = torch.randn(4, 8).to(dev)
    with pytest.raises(
        ValueError, match=r"add_vectors: its outputs are \[\(\(4, 8\), torch.float32\)\]"
    ):
        make_kernel_from_pallas(add_vectors, lambda x, y: [((8, 4), x.dtype)])(x, x)
    with pytest.raises(TypeError, match="output_shape_dtype_fn must return a list"):
        make_kernel_from_pallas(add_vectors, lambda x, y: (x.shape, x.dtype))(x, x)
    payload, _ = trace_pallas(add_vectors, x, x)
    other = torch.randn(2, 8).to(dev)
    with pytest.raises(ValueError, match=r"traced for inputs .*\(4, 8\).* called on .*\(2, 8\)"):
        xlac._xla_tpu_custom_call([other, other], payload, [(2, 8)], [torch.float32])
    with pytest.raises(RuntimeError, match="requires at least one input"):
        xlac._xla_tpu_custom_call([], payload, [(4, 8)], [torch.float32])
    with pytest.raises(NotImplementedError, match="serialised Mosaic kernel"):
        xlac._xla_tpu_custom_call([x], '{"custom_call_config": {}}', [(4, 8)], [torch.float32])


def test_dtypes_as_kernels_see_them(monkeypatch):
    assert convert_torch_dtype_to_jax(torch.bfloat16) == jnp.bfloat16
    assert convert_torch_dtype_to_jax(torch.int8) == jnp.int8
    struct = to_jax_shape_dtype_struct(torch.zeros(2, 3, dtype=torch.float16))
    assert struct.shape == (2, 3) and struct.dtype == jnp.float16
    assert convert_torch_dtype_to_jax(torch.float8_e4m3fn) == jnp.float8_e4m3fn
    with pytest.raises(ValueError, match="torch.complex32"):
        convert_torch_dtype_to_jax(torch.complex32)
    monkeypatch.setattr(config.USE_BF16, "value", True)
    with pytest.raises(RuntimeError, match="XLA_USE_BF16"):
        convert_torch_dtype_to_jax(torch.float32)


def test_torch_ops_xla_flash_attention_under_torch_compile_equals_float64():
    """PyTorch/XLA's op for its kernel in a compiled graph, with its gradients."""

    def attend(q, k, v):
        return torch.ops.xla.flash_attention(q, k, v, True)

    compiled = torch.compile(attend, backend="spmd_torch", fullgraph=True)
    q, k, v = (
        torch.randn(2, 3, 16, 8, generator=torch.Generator().manual_seed(s)) for s in range(3)
    )
    leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
    out = compiled(*leaves)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    out.backward(cotangent.to(dev))
    wide = [t.double().requires_grad_() for t in (q, k, v)]
    expected = attention_float64(*wide, causal=True)
    expected.backward(cotangent.double())
    assert_close(out.detach().cpu(), expected.float().detach())
    for leaf, reference in zip(leaves, wide):
        assert_close(leaf.grad.cpu(), reference.grad.float(), kind="grad")


def test_torch_ops_xla_gmm_eager_and_under_torch_compile():
    lhs, rhs, sizes = inputs()
    expected = gmm_float64(lhs, rhs).float()
    args = (lhs.to(dev), rhs.to(dev), sizes.to(dev))
    assert_close(torch.ops.xla.gmm(*args).cpu(), expected)
    compiled = torch.compile(torch.ops.xla.gmm, backend="spmd_torch")
    assert_close(compiled(*args).cpu(), expected)
