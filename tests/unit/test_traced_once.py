"""traced_once: a lowering JAX traces once per shapes and static arguments, reused by every later
call alike; its results equal the function's own, and what tells two calls apart is kept apart."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

import spmd_torch
from spmd_torch import config
from spmd_torch._lazy.lowering import _helpers, attention
from spmd_torch.debug import graph

dev = spmd_torch.device()


def _counting(fn):
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return counted, calls


def test_calls_alike_are_traced_once_and_give_the_functions_values():
    counted, calls = _counting(lambda x, y, *, scale: (x * scale + y).sum(0))
    once = _helpers.traced_once(counted)

    def program(a, b):
        return [once(a, b, scale=2.0) for _ in range(5)] + [once(b, a, scale=2.0)]

    a, b = np.arange(12.0, dtype=np.float32).reshape(3, 4), np.ones((3, 4), np.float32)
    results = jax.jit(program)(a, b)
    assert len(calls) == 1
    np.testing.assert_array_equal(results[0], (a * 2 + b).sum(0))
    np.testing.assert_array_equal(results[-1], (b * 2 + a).sum(0))


def test_static_values_that_compare_equal_are_traced_apart():
    """1, 1.0 and True, and 0.0 and -0.0, are equal keys to a dict; not to a trace."""
    filled = _helpers.traced_once(lambda x, v: jnp.full(x.shape, v))
    x = jnp.ones((2,), jnp.int32)
    assert jnp.issubdtype(jax.jit(lambda x: filled(x, 1))(x).dtype, jnp.integer)
    assert jnp.issubdtype(jax.jit(lambda x: filled(x, 1.0))(x).dtype, jnp.floating)
    assert jax.jit(lambda x: filled(x, True))(x).dtype == jnp.bool_
    once = _helpers.traced_once(lambda x, v: x * jnp.asarray(v))
    positive = jax.jit(lambda x: 1 / once(x, 0.0))(jnp.ones((1,)))
    negative = jax.jit(lambda x: 1 / once(x, -0.0))(jnp.ones((1,)))
    assert positive[0] == np.inf and negative[0] == -np.inf
    positive = jax.jit(lambda x: 1 / once(x, np.float64(0.0)))(jnp.ones((1,)))
    negative = jax.jit(lambda x: 1 / once(x, np.float64(-0.0)))(jnp.ones((1,)))
    assert positive[0] == np.inf and negative[0] == -np.inf


def test_a_flag_of_the_compile_key_traces_again():
    counted, calls = _counting(lambda x: x + 1)
    once = _helpers.traced_once(counted)
    x = jnp.zeros((3,))
    jax.jit(lambda x: once(x)).lower(x)
    with config.override(XLA_USE_BF16=True):
        jax.jit(lambda x: once(x)).lower(x)
    jax.jit(lambda x: once(x)).lower(x)
    assert len(calls) == 2


def test_every_layers_attention_is_one_trace(monkeypatch):
    """Four layers' attentions of one shape, forward and backward: one trace each way (each
    traced again before: 8 traces)."""
    problems, made = [], attention._Problem.__init__
    monkeypatch.setattr(
        attention._Problem,
        "__init__",
        lambda self, *a, **k: (problems.append(1), made(self, *a, **k))[1],
    )
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, 8, generator=gen).to(dev).requires_grad_()
    out = x
    for _ in range(4):
        out = F.scaled_dot_product_attention(out, out, out, is_causal=True)
    out.sum().backward()
    graph.pending_stablehlo()  # lowers the pending program
    assert len(problems) <= 2
    spmd_torch.sync()
    want = x.detach().cpu().requires_grad_()
    expected = want
    for _ in range(4):
        expected = F.scaled_dot_product_attention(expected, expected, expected, is_causal=True)
    expected.sum().backward()
    torch.testing.assert_close(x.grad.cpu(), want.grad, rtol=1e-5, atol=1e-5)
