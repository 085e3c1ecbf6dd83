"""nn lowerings (conv, pooling, softmax, norms, losses, embedding, upsampling) vs eager CPU aten.

Backward cases feed each backward op what autograd would: saved statistics, indices and totals come
from the eager forward on the same inputs.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tests.helpers import assert_close
from tests.unit._lowering_harness import assert_same, case, check, lowered, named, tight

aten = torch.ops.aten
_gen = torch.Generator().manual_seed(0)


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=_gen, dtype=dtype)


# --- convolution ---------------------------------------------------------------------------------

_CONVS = {
    # id: (input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    "1d-stride-pad-bias": ((2, 4, 9), (6, 4, 3), True, [2], [1], [1], False, [0], 1),
    "2d-plain": ((2, 4, 7, 8), (6, 4, 3, 3), False, [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
    "2d-stride-pad-dilation-groups": (
        (2, 4, 9, 8),
        (6, 2, 3, 3),
        True,
        [2, 1],
        [1, 2],
        [2, 1],
        False,
        [0, 0],
        2,
    ),
    "2d-depthwise": ((1, 4, 6, 6), (8, 1, 3, 3), True, [1, 1], [1, 1], [1, 1], False, [0, 0], 4),
    "3d": ((1, 2, 5, 6, 5), (4, 2, 3, 3, 3), True, [1, 2, 1], [1, 0, 1], [1, 1, 1], False, [0], 1),
    "transposed-2d-output-padding": (
        (2, 4, 5, 5),
        (4, 3, 3, 3),
        True,
        [2, 2],
        [1, 1],
        [1, 1],
        True,
        [1, 1],
        1,
    ),
    "transposed-2d-groups-dilation": (
        (2, 4, 5, 4),
        (4, 3, 3, 2),
        False,
        [2, 1],
        [0, 1],
        [2, 2],
        True,
        [1, 0],
        2,
    ),
    "transposed-1d-large-padding": ((2, 3, 6), (3, 2, 4), True, [3], [4], [1], True, [2], 1),
}


def _conv_args(spec):
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = spec
    nd = len(x) - 2
    out_channels = w[1] * groups if transposed else w[0]
    b = _t(out_channels) if bias else None
    padding = padding * nd if len(padding) == 1 else padding
    output_padding = output_padding * nd if len(output_padding) == 1 else output_padding
    return (_t(*x), _t(*w), b, stride, padding, dilation, transposed, output_padding, groups)


CONV_CASES = [
    case(aten.convolution.default, *_conv_args(spec), id=name) for name, spec in _CONVS.items()
] + [
    case(
        aten.convolution.default,
        _t(2, 4, 6, 6, dtype=torch.bfloat16),
        _t(3, 4, 3, 3, dtype=torch.bfloat16),
        _t(3, dtype=torch.bfloat16),
        [1, 1],
        [1, 1],
        [1, 1],
        False,
        [0, 0],
        1,
        id="2d-bf16",
    ),
]


def _conv_backward_cases():
    masks = itertools.cycle([[True, True, True], [True, False, False], [False, True, True]])
    cases = []
    for (name, spec), mask in zip(_CONVS.items(), masks):
        x, w, b, *rest = _conv_args(spec)
        grad = _t(*aten.convolution(x, w, b, *rest).shape)
        bias_sizes = None if b is None else list(b.shape)
        mask = mask if b is not None else [*mask[:2], False]
        args = (grad, x, w, bias_sizes, *rest, mask)
        cases.append(case(aten.convolution_backward.default, *args, id=f"backward-{name}"))
    return cases


@pytest.mark.parametrize("op,args,kwargs,tol", CONV_CASES + _conv_backward_cases())
def test_convolution_matches_eager(op, args, kwargs, tol):
    check(op, *args, cast=True, tol=tol or tight, **kwargs)


def test_convolution_backward_bf16_matches_eager():
    x, w = _t(2, 4, 6, 6, dtype=torch.bfloat16), _t(3, 4, 3, 3, dtype=torch.bfloat16)
    rest = ([2, 1], [1, 0], [1, 1], False, [0, 0], 1)
    grad = _t(*aten.convolution(x, w, None, *rest).shape, dtype=torch.bfloat16)
    args = (grad, x, w, [3], *rest, [True, True, True])
    check(aten.convolution_backward.default, *args, cast=True, tol=tight)


# --- pooling -------------------------------------------------------------------------------------

_x2d = _t(2, 3, 9, 10)
_x3d = _t(1, 2, 5, 6, 7)
_MAX_POOLS = [
    # id, input, kernel_size, stride, padding, dilation, ceil_mode
    ("2d-k3-s2-pad1", _x2d, [3, 3], [2, 2], [1, 1], [1, 1], False),
    ("2d-ceil-mode", _x2d, [3, 3], [2, 2], [0, 0], [1, 1], True),
    ("2d-ceil-mode-pad", _x2d, [2, 2], [2, 2], [1, 1], [1, 1], True),
    ("2d-dilation", _x2d, [2, 3], [1, 2], [1, 1], [2, 2], False),
    ("2d-default-stride", _x2d, [2, 2], [], [0, 0], [1, 1], False),
    ("2d-unbatched", _t(3, 9, 10), [3, 2], [2, 1], [1, 0], [1, 1], True),
    ("3d-ceil-mode", _x3d, [2, 2, 2], [2, 1, 2], [1, 0, 1], [1, 1, 1], True),
]


def _max_pool_ops(x):
    if x.ndim == 5:
        return aten.max_pool3d_with_indices, aten.max_pool3d_with_indices_backward
    return aten.max_pool2d_with_indices, aten.max_pool2d_with_indices_backward


def _max_pool_cases():
    cases = []
    for name, x, *params in _MAX_POOLS:
        forward, backward = _max_pool_ops(x)
        cases.append(case(forward.default, x, *params, id=name))
        values, indices = forward(x, *params)
        grad = _t(*values.shape)
        cases.append(case(backward.default, grad, x, *params, indices, id=f"backward-{name}"))
    return cases


_AVG_POOLS = [
    # id, input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
    ("2d-pad-count-pad", _x2d, [3, 3], [2, 2], [1, 1], False, True, None),
    ("2d-pad-exclude-pad", _x2d, [3, 3], [2, 2], [1, 1], False, False, None),
    ("2d-ceil-count-pad", _x2d, [3, 2], [2, 3], [1, 1], True, True, None),
    ("2d-ceil-exclude-pad", _x2d, [3, 2], [2, 3], [1, 1], True, False, None),
    ("2d-divisor-override", _x2d, [3, 3], [2, 2], [1, 0], True, True, 5),
    ("2d-default-stride", _x2d, [2, 2], [], [0, 0], False, True, None),
    ("3d-ceil-exclude-pad", _x3d, [2, 3, 2], [1, 2, 2], [1, 1, 0], True, False, None),
]


def _avg_pool_cases():
    cases = []
    for name, x, *params in _AVG_POOLS:
        forward = aten.avg_pool3d if x.ndim == 5 else aten.avg_pool2d
        backward = aten.avg_pool3d_backward if x.ndim == 5 else aten.avg_pool2d_backward
        cases.append(case(forward.default, x, *params, id=name))
        grad = _t(*forward(x, *params).shape)
        cases.append(case(backward.default, grad, x, *params, id=f"backward-{name}"))
    return cases


_ADAPTIVE = [
    ("2d-even-bins", _t(2, 3, 8, 9), [4, 3]),
    ("2d-uneven-bins", _t(2, 3, 8, 9), [3, 5]),
    ("2d-global", _t(2, 3, 8, 9), [1, 1]),
    ("2d-upsampling-bins", _t(1, 2, 3, 4), [5, 6]),
    ("3d-mixed-bins", _t(1, 2, 6, 5, 4), [3, 2, 3]),
]


def _adaptive_cases():
    cases = []
    for name, x, size in _ADAPTIVE:
        forward = aten._adaptive_avg_pool3d if len(size) == 3 else aten._adaptive_avg_pool2d
        backward = getattr(aten, f"_adaptive_avg_pool{len(size)}d_backward")
        cases.append(case(forward.default, x, size, id=name))
        grad = _t(*forward(x, size).shape)
        cases.append(case(backward.default, grad, x, id=f"backward-{name}"))
    return cases


@pytest.mark.parametrize(
    "op,args,kwargs,tol", _max_pool_cases() + _avg_pool_cases() + _adaptive_cases()
)
def test_pooling_matches_eager(op, args, kwargs, tol):
    check(op, *args, cast=True, tol=tol or tight, **kwargs)


def test_max_pool2d_defaults_omitted_by_dispatch():
    """__torch_dispatch__ drops trailing defaulted arguments; the lowering must supply them."""
    x = _t(1, 2, 6, 6)
    check(aten.max_pool2d_with_indices.default, x, [2, 2], cast=True, tol=tight)


_im2col_x = _t(2, 3, 6, 7)
_im2col_params = ([2, 3], [1, 2], [1, 0], [2, 1])  # kernel_size, dilation, padding, stride


@pytest.mark.parametrize(
    "op,args,kwargs,tol",
    [
        case(aten.im2col.default, _im2col_x, *_im2col_params, id="im2col"),
        case(aten.im2col.default, _im2col_x[0], *_im2col_params, id="im2col-unbatched"),
        case(aten.im2col.default, _t(0, 3, 6, 7), *_im2col_params, id="im2col-empty-batch"),
        case(
            aten.col2im.default,
            aten.im2col(_im2col_x, *_im2col_params),
            [6, 7],
            *_im2col_params,
            id="col2im",
        ),
    ],
)
def test_im2col_matches_eager(op, args, kwargs, tol):
    check(op, *args, cast=True, tol=tol or tight, **kwargs)


# --- softmax -------------------------------------------------------------------------------------

_logits = _t(3, 5, 4)
_logits_bf16 = _t(3, 5, dtype=torch.bfloat16)
_masked_logits = _t(3, 4).index_fill(0, torch.tensor([1]), -math.inf)


def _softmax_cases():
    cases = []
    for name, x, dim in [
        ("dim1", _logits, 1),
        ("dim-last", _logits, -1),
        ("bf16", _logits_bf16, 0),
        ("0-dim", _t(), 0),  # one element: softmax 1, log-softmax 0 (nn.Softmax's scalar sample)
        ("0-dim-last", _t(), -1),
    ]:
        for forward, backward in [
            (aten._softmax, aten._softmax_backward_data),
            (aten._log_softmax, aten._log_softmax_backward_data),
        ]:
            op_name = forward.__name__.strip("_")
            cases.append(case(forward.default, x, dim, False, id=f"{op_name}-{name}"))
            out = forward(x, dim, False)
            grad = torch.randn(out.shape, generator=_gen).to(x.dtype)
            cases.append(
                case(backward.default, grad, out, dim, x.dtype, id=f"{op_name}-backward-{name}")
            )
    return cases


@pytest.mark.parametrize(
    "op,args,kwargs,tol",
    _softmax_cases()
    + [
        case(aten._safe_softmax.default, _masked_logits, 1, id="safe_softmax-masked-row-is-zero"),
        case(aten._safe_softmax.default, _logits, -1, torch.float64, id="safe_softmax-dtype"),
        case(aten._safe_softmax.default, _t(), 0, id="safe_softmax-0-dim"),
    ],
)
def test_softmax_matches_eager(op, args, kwargs, tol):
    check(op, *args, cast=True, tol=tol or tight, **kwargs)


@pytest.mark.parametrize("op", [aten._softmax.default, aten._log_softmax.default], ids=str)
def test_softmax_half_to_float_returns_float32(op):
    """CPU torch rejects half_to_float, so compare with the float32 op on the upcast input."""
    got = lowered(op, _logits_bf16, 1, True)
    assert got.dtype == torch.float32
    assert_same(got, op(_logits_bf16.float(), 1, False), tight, cast=True)


# --- normalization -------------------------------------------------------------------------------


def _layer_norm_cases():
    cases = []
    configs = [
        ("affine", _t(2, 3, 8), [8], _t(8), _t(8), [True, True, True]),
        ("no-affine-2-dims", _t(2, 3, 8), [3, 8], None, None, [True, False, False]),
        ("weight-only-mask-input", _t(4, 6), [6], _t(6), None, [True, False, False]),
        ("bf16", _t(2, 8, dtype=torch.bfloat16), [8], None, None, [True, False, False]),
    ]
    for name, x, shape, w, b, mask in configs:
        cases.append(case(aten.native_layer_norm.default, x, shape, w, b, 1e-5, id=name))
        _, mean, rstd = aten.native_layer_norm(x, shape, w, b, 1e-5)
        grad = torch.randn(x.shape, generator=_gen).to(x.dtype)
        args = (grad, x, shape, mean, rstd, w, b, mask)
        cases.append(case(aten.native_layer_norm_backward.default, *args, id=f"backward-{name}"))
    return cases


def _group_norm_cases():
    cases = []
    for name, w, b in [("affine", _t(6), _t(6)), ("no-affine", None, None)]:
        x = _t(2, 6, 4, 5)
        args = (x, w, b, 2, 6, 20, 3, 1e-5)
        cases.append(case(aten.native_group_norm.default, *args, id=name))
        _, mean, rstd = aten.native_group_norm(*args)
        mask = [True, w is not None, b is not None]  # autograd asks only for what exists
        bwd = (_t(*x.shape), x, mean, rstd, w, 2, 6, 20, 3, mask)
        cases.append(case(aten.native_group_norm_backward.default, *bwd, id=f"backward-{name}"))
    return cases


@pytest.mark.parametrize("op,args,kwargs,tol", _layer_norm_cases() + _group_norm_cases())
def test_layer_and_group_norm_match_eager(op, args, kwargs, tol):
    check(op, *args, cast=True, tol=tol or tight, **kwargs)


_bn_x = _t(4, 3, 5, 5)
_bn_w, _bn_b = _t(3), _t(3)
_bn_mean, _bn_var = _t(3), torch.rand(3, generator=_gen) + 0.5


def _batch_norm_backward_case(train: bool, mask: list, name: str):
    _, save_mean, save_invstd = aten._native_batch_norm_legit.no_stats(
        _bn_x, _bn_w, _bn_b, True, 0.1, 1e-5
    )
    saved = (save_mean, save_invstd) if train else (None, None)
    args = (_t(*_bn_x.shape), _bn_x, _bn_w, _bn_mean, _bn_var, *saved, train, 1e-5, mask)
    return case(aten.native_batch_norm_backward.default, *args, id=name)


@pytest.mark.parametrize(
    "op,args,kwargs,tol",
    [
        case(
            aten._native_batch_norm_legit_functional.default,
            *(_bn_x, _bn_w, _bn_b, _bn_mean, _bn_var, True, 0.1, 1e-5),
            id="functional-training-updates-running-stats",
        ),
        case(
            aten._native_batch_norm_legit_functional.default,
            *(_bn_x, None, None, _bn_mean, _bn_var, False, 0.1, 1e-5),
            id="functional-eval-keeps-running-stats",
        ),
        case(
            aten._native_batch_norm_legit_functional.default,
            *(_t(6, 3, dtype=torch.bfloat16), None, None, _bn_mean, _bn_var, True, 0.3, 1e-3),
            id="functional-training-bf16-2d",
        ),
        case(
            aten._native_batch_norm_legit.no_stats,
            *(_bn_x, _bn_w, None, True, 0.1, 1e-5),
            id="no_stats",
        ),
        _batch_norm_backward_case(True, [True, True, True], "backward-training"),
        _batch_norm_backward_case(False, [True, True, True], "backward-eval"),
        _batch_norm_backward_case(True, [True, False, False], "backward-input-only"),
    ],
)
def test_batch_norm_matches_eager(op, args, kwargs, tol):
    check(op, *args, cast=True, tol=tol or tight, **kwargs)


def test_batch_norm_no_training_returns_the_statistics_it_used():
    """Eval batch norm, which AOTAutograd's graphs hold: eager's output, and per channel (the
    shapes its meta kernel promises; CPU's kernel returns empty ones) the running mean and the
    inverse standard deviation it normalized with."""
    args = (_bn_x, _bn_w, _bn_b, _bn_mean, _bn_var, 0.1, 1e-5)
    out, mean, invstd = lowered(aten._native_batch_norm_legit_no_training.default, *args)
    expected = aten._native_batch_norm_legit_no_training.default(*args)[0]
    assert_same(out, expected, tight)
    assert_same(mean, _bn_mean, tight)
    assert_same(invstd, 1 / torch.sqrt(_bn_var + 1e-5), tight)


# --- losses --------------------------------------------------------------------------------------

_logp = torch.log_softmax(_t(6, 5), 1)
_target = torch.tensor([0, 4, 2, 2, 1, 3])
_class_weight = torch.rand(5, generator=_gen)
_logp2d = torch.log_softmax(_t(2, 5, 3, 4), 1)
_target2d = torch.randint(0, 5, (2, 3, 4), generator=_gen)


def _nll_cases():
    configs = [
        ("", aten.nll_loss_forward, aten.nll_loss_backward, _logp, _target),
        ("2d-", aten.nll_loss2d_forward, aten.nll_loss2d_backward, _logp2d, _target2d),
        ("1d-input-", aten.nll_loss_forward, aten.nll_loss_backward, _logp[0], torch.tensor(3)),
    ]
    cases = []
    for prefix, forward, backward, x, target in configs:
        for reduction, (weight, ignore_index) in itertools.product(
            (0, 1, 2), [(None, -100), (_class_weight, 2)]
        ):
            name = (
                f"{prefix}reduction{reduction}-{'weight' if weight is not None else 'unweighted'}"
            )
            name += f"-ignore{ignore_index}"
            args = (x, target, weight, reduction, ignore_index)
            cases.append(case(forward.default, *args, id=name))
            out, total = forward(*args)
            grad = torch.randn(out.shape, generator=_gen)
            bwd = (grad, x, target, weight, reduction, ignore_index, total)
            cases.append(case(backward.default, *bwd, id=f"backward-{name}"))
    return cases


@pytest.mark.parametrize("op,args,kwargs,tol", _nll_cases())
def test_nll_loss_matches_eager(op, args, kwargs, tol):
    check(op, *args, cast=True, tol=tol or tight, **kwargs)


def test_nll_loss_all_ignored_mean_is_nan_and_grad_zero():
    target = torch.full((6,), 2)
    args = (_logp, target, None, 1, 2)
    check(aten.nll_loss_forward.default, *args, cast=True, tol=tight)
    _, total = aten.nll_loss_forward(*args)
    bwd = (torch.tensor(1.0), _logp, target, None, 1, 2, total)
    check(aten.nll_loss_backward.default, *bwd, cast=True, tol=tight)


_probs = (
    torch.sigmoid(_t(4, 5))
    .index_fill(1, torch.tensor([0]), 0.0)
    .index_fill(1, torch.tensor([4]), 1.0)
)  # saturated probabilities exercise PyTorch's log clamp at -100
_labels = torch.rand(4, 5, generator=_gen)
_bce_weight = torch.rand(4, 5, generator=_gen)
_bound_values = torch.tensor([-2.0, -1.0, -0.5, 0.0, 0.7, 1.0, 3.0])


def _loss_cases():
    cases = []
    for reduction in (0, 1, 2):
        x, y = _t(4, 5), _t(4, 5)
        cases.append(case(aten.mse_loss.default, x, y, reduction, id=f"mse-reduction{reduction}"))
        grad = _t(*aten.mse_loss(x, y, reduction).shape)
        args = (grad, x, y, reduction)
        cases.append(case(aten.mse_loss_backward.default, *args, id=f"mse_backward-{reduction}"))
        for weight in (None, _bce_weight):
            name = f"reduction{reduction}-{'weight' if weight is not None else 'unweighted'}"
            args = (_probs, _labels, weight, reduction)
            cases.append(case(aten.binary_cross_entropy.default, *args, id=f"bce-{name}"))
            grad = _t(*aten.binary_cross_entropy(*args).shape)
            bwd = (grad, *args)
            cases.append(
                case(aten.binary_cross_entropy_backward.default, *bwd, id=f"bce_backward-{name}")
            )
    cases.append(case(aten.mse_loss.default, _t(3), _t(3), id="mse-default-reduction"))
    grad = _t(*_bound_values.shape)
    cases.append(
        case(aten.hardtanh_backward.default, grad, _bound_values, -1.0, 1.0, id="hardtanh_backward")
    )
    return cases


@pytest.mark.parametrize("op,args,kwargs,tol", _loss_cases())
def test_loss_matches_eager(op, args, kwargs, tol):
    check(op, *args, cast=True, tol=tol or tight, **kwargs)


# --- embedding -----------------------------------------------------------------------------------

_indices = torch.tensor([[1, 3, 3, 0], [3, 2, 9, 1]])


@pytest.mark.parametrize(
    "op,args,kwargs,tol",
    [
        case(aten.embedding.default, _t(10, 4), _indices, id="embedding"),
        case(aten.embedding.default, _t(10, 4), _indices, 3, id="embedding-padding-idx"),
        case(
            aten.embedding_dense_backward.default,
            *(_t(2, 4, 6), _indices, 10, -1, False),
            id="backward",
        ),
        case(
            aten.embedding_dense_backward.default,
            *(_t(2, 4, 6), _indices, 10, 3, False),
            id="backward-padding-idx",
        ),
        case(
            aten.embedding_dense_backward.default,
            *(_t(2, 4, 6), _indices, 12, 1, True),
            id="backward-scale-grad-by-freq-padding-idx",
        ),
    ],
)
def test_embedding_matches_eager(op, args, kwargs, tol):
    check(op, *args, cast=True, tol=tol or tight, **kwargs)


# --- upsampling ----------------------------------------------------------------------------------

_image = _t(2, 3, 4, 5)
_UPSAMPLES = [
    # id, output_size, scales (h, w)
    ("double", [8, 10], (None, None)),
    ("up-uneven", [7, 9], (None, None)),
    ("down", [3, 2], (None, None)),
    ("scales-given", [6, 11], (1.5, 2.3)),
    ("identity", [4, 5], (None, None)),
]


def _upsample_cases():
    cases = []
    for name, size, scales in _UPSAMPLES:
        grad = _t(2, 3, *size)
        nearest = (_image, size, *scales)
        cases.append(case(aten.upsample_nearest2d.default, *nearest, id=f"nearest-{name}"))
        bwd = (grad, size, list(_image.shape), *scales)
        cases.append(
            case(aten.upsample_nearest2d_backward.default, *bwd, id=f"nearest-backward-{name}")
        )
        for align_corners in (False, True):
            tag = f"{name}-align{int(align_corners)}"
            fwd = (_image, size, align_corners, *scales)
            cases.append(case(aten.upsample_bilinear2d.default, *fwd, id=f"bilinear-{tag}"))
            bwd = (grad, size, list(_image.shape), align_corners, *scales)
            cases.append(
                case(aten.upsample_bilinear2d_backward.default, *bwd, id=f"bilinear-backward-{tag}")
            )
    return cases


@pytest.mark.parametrize(
    "op,args,kwargs,tol",
    _upsample_cases()
    + [
        case(aten.upsample_nearest2d.vec, _image, None, [1.5, 2.3], id="nearest-vec-scales"),
        case(aten.upsample_nearest2d.vec, _image, [5, 3], None, id="nearest-vec-size"),
        case(aten.upsample_bilinear2d.vec, _image, None, False, [0.6, 1.7], id="bilinear-vec"),
        case(
            aten.upsample_bilinear2d.default,
            *(_t(1, 2, 6, 5, dtype=torch.bfloat16), [4, 7], False),
            id="bilinear-bf16",
        ),
    ],
)
def test_upsample_matches_eager(op, args, kwargs, tol):
    check(op, *args, cast=True, tol=tol or tight, **kwargs)


# sizes per rank: (input spatial, output sizes (up-uneven, down), scales given for the up case)
_RANKS = {
    1: ((6,), ([11], [4]), (1.7,)),
    2: ((4, 5), ([7, 9], [3, 2]), (1.6, 2.3)),
    3: ((3, 4, 2), ([5, 7, 4], [2, 3, 1]), (1.5, 2.1, 2.0)),
}
_NEAREST = {
    1: (aten.upsample_nearest1d, aten._upsample_nearest_exact1d),
    2: (aten.upsample_nearest2d, aten._upsample_nearest_exact2d),
    3: (aten.upsample_nearest3d, aten._upsample_nearest_exact3d),
}
_INTERPOLATING = {
    1: aten.upsample_linear1d,
    2: aten.upsample_bicubic2d,
    3: aten.upsample_trilinear3d,
}
_BACKWARD = {
    aten.upsample_nearest1d: aten.upsample_nearest1d_backward,
    aten.upsample_nearest2d: aten.upsample_nearest2d_backward,
    aten.upsample_nearest3d: aten.upsample_nearest3d_backward,
    aten._upsample_nearest_exact1d: aten._upsample_nearest_exact1d_backward,
    aten._upsample_nearest_exact2d: aten._upsample_nearest_exact2d_backward,
    aten._upsample_nearest_exact3d: aten._upsample_nearest_exact3d_backward,
    aten.upsample_linear1d: aten.upsample_linear1d_backward,
    aten.upsample_bicubic2d: aten.upsample_bicubic2d_backward,
    aten.upsample_trilinear3d: aten.upsample_trilinear3d_backward,
}


def _upsample_nd_cases():
    """Forward and backward of every rank's nearest, nearest-exact and (bi/tri)linear or bicubic
    op: upsampling and downsampling by size, explicit scales, both align_corners."""
    cases = []
    for nd, (spatial, sizes, given) in _RANKS.items():
        x = _t(2, 3, *spatial)
        shapes = [(sizes[0], (None,) * nd, "up"), (sizes[1], (None,) * nd, "down")]
        shapes.append(([int(n * s) for n, s in zip(spatial, given)], given, "scales"))
        for size, scales, tag in shapes:
            grad = _t(2, 3, *size)
            for packet in _NEAREST[nd]:
                name = f"{packet.__name__}-{tag}"
                cases.append(case(packet.default, x, size, *scales, id=name))
                bwd = (grad, size, list(x.shape), *scales)
                cases.append(case(_BACKWARD[packet].default, *bwd, id=f"{name}-backward"))
            packet = _INTERPOLATING[nd]
            for align in (False, True):
                name = f"{packet.__name__}-{tag}-align{int(align)}"
                cases.append(case(packet.default, x, size, align, *scales, id=name))
                bwd = (grad, size, list(x.shape), align, *scales)
                cases.append(case(_BACKWARD[packet].default, *bwd, id=f"{name}-backward"))
    return cases


@pytest.mark.parametrize(
    "op,args,kwargs,tol",
    _upsample_nd_cases()
    + [
        case(aten.upsample_nearest1d.default, _t(1, 2, 5), [9], id="nearest1d-scales-omitted"),
        # double size with another scale given: only the 2d forward and the backwards shortcut
        case(aten.upsample_nearest1d.default, _t(2, 3, 4), [8], 2.1, id="nearest1d-2x-scale"),
        case(aten.upsample_nearest2d.default, _t(2, 3, 4, 4), [8, 8], 2.1, 2.1, id="nearest2d-2x"),
        case(
            aten.upsample_nearest1d_backward.default,
            *(_t(2, 3, 8), [8], [2, 3, 4], 2.1),
            id="nearest1d-backward-2x-scale",
        ),
        case(
            aten.upsample_bicubic2d.default,
            *(_t(1, 2, 6, 5, dtype=torch.bfloat16), [9, 7], False),
            tol=named("nn.functional.interpolate.bicubic"),  # bf16 weights: see the table
            id="bicubic-bf16",
        ),
    ],
)
def test_upsample_nd_matches_eager(op, args, kwargs, tol):
    check(op, *args, cast=True, tol=tol or tight, **kwargs)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_multi_margin_loss_backward_is_lowered_and_matches_cpu(p, reduction):
    """multi_margin_loss's backward (which has no meta kernel in PyTorch) runs on the device,
    with class weights and a margin, and equals CPU's gradient."""
    import spmd_torch.debug.metrics as met

    g = torch.Generator().manual_seed(p)
    x = torch.randn(6, 7, generator=g).requires_grad_()
    target, weight = torch.randint(0, 7, (6,), generator=g), torch.rand(7, generator=g)
    loss = torch.nn.functional.multi_margin_loss
    out = loss(x, target, p=p, margin=0.7, weight=weight, reduction=reduction)
    cotangent = torch.rand(out.shape, generator=g)
    (expected,) = torch.autograd.grad(out, x, cotangent)
    xd = x.detach().to("xla").requires_grad_()
    before = met.counter_value("aten::multi_margin_loss_backward")
    out_d = loss(
        xd, target.to("xla"), p=p, margin=0.7, weight=weight.to("xla"), reduction=reduction
    )
    (got,) = torch.autograd.grad(out_d, xd, cotangent.to("xla"))
    assert met.counter_value("aten::multi_margin_loss_backward") == before
    assert_close(got.cpu(), expected, tol="single_op")


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_multilabel_margin_loss_backward_is_lowered_and_matches_cpu(reduction):
    """multilabel_margin_loss's backward (no meta kernel in PyTorch either) runs on the device and
    equals CPU's gradient: labels up to each row's first -1, repeated labels counted twice."""
    import spmd_torch.debug.metrics as met

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 6, generator=g).requires_grad_()
    target = torch.tensor(
        [
            [3, 0, -1, 1, 2, 4],
            [0, 1, 2, 3, 4, 5],
            [-1, 1, 2, 0, 0, 0],
            [5, 5, -1, 0, 0, 0],
            [2, -1, 3, 3, 3, 3],
        ]
    )
    loss = torch.nn.functional.multilabel_margin_loss
    out = loss(x, target, reduction=reduction)
    cotangent = torch.rand(out.shape, generator=g)
    (expected,) = torch.autograd.grad(out, x, cotangent)
    xd = x.detach().to("xla").requires_grad_()
    before = met.counter_value("aten::multilabel_margin_loss_backward")
    (got,) = torch.autograd.grad(
        loss(xd, target.to("xla"), reduction=reduction), xd, cotangent.to("xla")
    )
    assert met.counter_value("aten::multilabel_margin_loss_backward") == before
    assert_close(got.cpu(), expected, tol="single_op")
