"""Differential op tests driven by PyTorch's OpInfo database: xla vs eager CPU, forward and grad
(tests.helpers.assert_matches_eager: a bf16 reference is the float64 result rounded once, with
the tolerance table's bf16 row or the op's named override).

Covered: every OpInfo whose aten op has a lowering of ours, plus the nn.functional entries that
reach our lowerings through PyTorch's decompositions. Known failures are data (xfails.py), strict:
a fixed op turns its entry red until the entry is deleted.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

import spmd_torch  # noqa: F401  (registers the device)
from spmd_torch._lazy import counters
from spmd_torch._lazy.lowering import LOWERINGS
from tests.helpers import TOLERANCE_OVERRIDES, assert_matches_eager, to_device
from tests.ops.xfails import CPU_FALLBACKS, XFAILS

MAX_SAMPLES = 3
# The registry also holds the engine's own ops (EngineOp), which no OpInfo describes.
_LOWERED_PACKETS = {
    op.overloadpacket.__name__ for op in LOWERINGS if isinstance(op, torch._ops.OpOverload)
}
# User-facing ops that reach lowered aten ops only through a decomposition.
_THROUGH_DECOMPOSITION = {
    "nn.functional.conv1d",
    "nn.functional.conv2d",
    "nn.functional.conv3d",
    "nn.functional.conv_transpose1d",
    "nn.functional.conv_transpose2d",
    "nn.functional.conv_transpose3d",
    "nn.functional.max_pool1d",
    "nn.functional.max_pool2d",
    "nn.functional.avg_pool1d",
    "nn.functional.avg_pool2d",
    "nn.functional.avg_pool3d",
    "nn.functional.adaptive_avg_pool2d",
    "nn.functional.batch_norm",
    "nn.functional.layer_norm",
    "nn.functional.group_norm",
    "nn.functional.embedding",
    "softmax",
    "log_softmax",
    "nn.functional.cross_entropy",
    "nn.functional.nll_loss",
    "nn.functional.interpolate",
    "nn.functional.scaled_dot_product_attention",
    "nn.functional.gelu",
    "nn.functional.relu",
    "nn.functional.linear",
    "matmul",
    "nn.functional.mse_loss",
    "nn.functional.silu",
    "nn.functional.leaky_relu",
    "nn.functional.hardtanh",
    "nn.functional.elu",
    "nn.functional.pad",
    "nn.functional.dropout",
    "addmm",
    "baddbmm",
    "bmm",
    "mm",
    "masked_fill",
    "where",
    "clamp",
    "cumsum",
    "cumprod",
    "sort",
    "topk",
    "argmax",
    "argmin",
    "index_put",
    "scatter",
    "scatter_add",
    "gather",
    "take_along_dim",
    "index_select",
    "nn.functional.binary_cross_entropy",
    "nn.functional.binary_cross_entropy_with_logits",
}
# Ops whose values are random or uninitialised: only shapes and dtypes are compared.
_RANDOM = {
    "nn.functional.dropout",
    "bernoulli",
    "normal",
    "normal.in_place",
    "normal.number_mean",
    "uniform",
    "exponential",
    "rand_like",
    "randn",
    "randn_like",
    "randint",
    "randint_like",
    "multinomial",
    "nn.functional.rrelu",
    "nn.functional.feature_alpha_dropout",
    "nn.functional.alpha_dropout",
    "nn.functional.dropout2d",
    "nn.functional.dropout3d",
    "empty",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "empty_strided",
}


def _full_name(opinfo) -> str:
    return opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")


def _selected(opinfo) -> bool:
    aten_name = (opinfo.aten_name or opinfo.name).split(".")[-1]
    return opinfo.name in _THROUGH_DECOMPOSITION or aten_name in _LOWERED_PACKETS


def _cases():
    for opinfo in op_db:
        if not _selected(opinfo):
            continue
        name = _full_name(opinfo)
        for dtype in (torch.float32, torch.bfloat16):
            if dtype not in opinfo.supported_dtypes("cpu"):
                continue
            kinds = ["fwd"]
            if dtype is torch.float32 and opinfo.supports_autograd and name not in _RANDOM:
                kinds.append("grad")
            for kind in kinds:
                key = (name, kind, str(dtype).removeprefix("torch."))
                marks = []
                if key in XFAILS:
                    marks.append(pytest.mark.xfail(reason=XFAILS[key], strict=True))
                yield pytest.param(opinfo, dtype, kind, id="-".join(key), marks=marks)


def _samples(opinfo, dtype, requires_grad):
    torch.manual_seed(0)
    samples = opinfo.sample_inputs("cpu", dtype, requires_grad=requires_grad)
    return [s for s, _ in zip(samples, range(MAX_SAMPLES))]


def _compare_shape_dtype(actual, expected):
    actual = actual if isinstance(actual, (tuple, list)) else [actual]
    expected = expected if isinstance(expected, (tuple, list)) else [expected]
    for a, e in zip(actual, expected):
        if isinstance(e, torch.Tensor):
            assert (a.shape, a.dtype) == (e.shape, e.dtype)


@pytest.mark.parametrize("opinfo, dtype, kind", list(_cases()))
def test_op_matches_eager(opinfo, dtype, kind):
    before = _fallback_counts()
    _check_samples(opinfo, dtype, kind)
    fallbacks = sorted(k for k, n in _fallback_counts().items() if n > before.get(k, 0))
    allowed = set(CPU_FALLBACKS.get((_full_name(opinfo), kind), ()))
    # Exact, like a strict xfail: an op that gets its lowering must leave CPU_FALLBACKS.
    assert set(fallbacks) == allowed, f"ran on the CPU: {fallbacks}, expected {sorted(allowed)}"


def _fallback_counts() -> dict:
    return {k: v for k, v in counters.COUNTERS.items() if k.startswith("aten::")}


def _check_samples(opinfo, dtype, kind):
    name = _full_name(opinfo)
    for sample in _samples(opinfo, dtype, requires_grad=kind == "grad"):
        args = (sample.input, *sample.args)
        if name in _RANDOM or sample.kwargs.get("dropout_p", 0) > 0:
            expected = opinfo.op(*args, **sample.kwargs)
            device_args, device_kwargs = to_device((args, sample.kwargs))
            _compare_shape_dtype(opinfo.op(*device_args, **device_kwargs), expected)
            continue
        tol = name if name in TOLERANCE_OVERRIDES else None
        assert_matches_eager(opinfo.op, *args, grad=kind == "grad", tol=tol, **sample.kwargs)
