"""Mixed precision: the autocast policy of the ``xla`` device, and the gradient scaler's ops.

``AUTOCAST_POLICY`` is PyTorch/XLA 2.9's table for its AutocastXLA key (torch_xla/csrc/
autocast_mode.cpp), keyed by the same overloads as the lowerings; ``device.register`` installs one
kernel per row at PyTorch's AutocastPrivateUse1 key, above autograd as ATen's own autocast kernels
sit, so the casts are recorded by autograd and gradients come back in each input's dtype. The fp32
rows PyTorch/XLA leaves commented out only because it does not lower them (huber_loss, fft_*,
linalg_eigh...) are rows here: they run in float32, as CPU and CUDA autocast run them. Dimname
overloads (named tensors) are not exposed to Python and have no row.

The gradient scaler's in-place ops stay on the device: the inf/nan check and unscale of every
gradient is one node (``_amp_foreach_non_finite_check_and_unscale_`` through its functional
overload), the scale update decomposes into recorded ops.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import torch

from ._helpers import opmath
from .registry import lowers

aten = torch.ops.aten

LOWER_PRECISION_FP = "lower_precision_fp"  # cast floating inputs to the autocast dtype
FP32 = "fp32"  # cast floating inputs to float32
PROMOTE = "promote"  # cast floating inputs to the widest among them

_LOWER = [
    aten.conv1d.default,
    aten.conv1d.padding,
    aten.conv2d.default,
    aten.conv2d.padding,
    aten.conv3d.default,
    aten.conv3d.padding,
    aten.bmm.default,
    aten.mm.default,
    aten.baddbmm.default,
    aten.addmm.default,
    aten.addbmm.default,
    aten.linear.default,
    aten.matmul.default,
    aten.conv_tbc.default,
    aten.conv_transpose1d.default,
    aten.conv_transpose2d.input,
    aten.conv_transpose3d.input,
    aten.prelu.default,
    aten.relu.default,
    aten.max_pool2d.default,
    aten.einsum.default,
    # Commented out in PyTorch/XLA 2.9 only for a link error of its C++ build; CPU and CUDA
    # autocast list it. Cast, a Llama's float32 rotary products meet bfloat16 values in one
    # attention (which would raise) and the fused kernels (cuDNN's: bf16/fp16) apply.
    aten.scaled_dot_product_attention.default,
]
_FP32 = [
    aten.batch_norm.default,
    aten._softmax.default,
    aten.softmax.int,
    aten.log_softmax.int,
    aten.binary_cross_entropy.default,
    aten.grid_sampler.default,
    aten.polar.default,
    aten.prod.default,
    aten.prod.dim_int,
    aten.quantile.default,
    aten.quantile.scalar,
    aten.nanquantile.default,
    aten.nanquantile.scalar,
    aten.stft.default,
    aten.stft.center,
    aten.cdist.default,
    aten.grid_sampler_2d.default,
    aten.grid_sampler_3d.default,
    aten.trace.default,
    aten.view_as_complex.default,
    aten.cholesky.default,
    aten.cholesky_inverse.default,
    aten.cholesky_solve.default,
    aten.inverse.default,
    aten.lu_solve.default,
    aten.orgqr.default,
    aten.ormqr.default,
    aten.pinverse.default,
    aten.reflection_pad1d.default,
    aten.reflection_pad2d.default,
    aten.replication_pad1d.default,
    aten.replication_pad2d.default,
    aten.replication_pad3d.default,
    aten.mse_loss.default,
    aten.cosine_embedding_loss.default,
    aten.nll_loss.default,
    aten.nll_loss2d.default,
    aten.hinge_embedding_loss.default,
    aten.poisson_nll_loss.default,
    aten.smooth_l1_loss.default,
    aten.cross_entropy_loss.default,
    aten.l1_loss.default,
    aten.huber_loss.default,
    aten.margin_ranking_loss.default,
    aten.soft_margin_loss.default,
    aten.triplet_margin_loss.default,
    aten.multi_margin_loss.default,
    aten.ctc_loss.IntList,
    aten.ctc_loss.Tensor,
    aten.kl_div.default,
    aten.multilabel_margin_loss.default,
    aten.binary_cross_entropy_with_logits.default,
    aten.fft_fft.default,
    aten.fft_ifft.default,
    aten.fft_fft2.default,
    aten.fft_ifft2.default,
    aten.fft_fftn.default,
    aten.fft_ifftn.default,
    aten.fft_rfft.default,
    aten.fft_irfft.default,
    aten.fft_rfft2.default,
    aten.fft_irfft2.default,
    aten.fft_rfftn.default,
    aten.fft_irfftn.default,
    aten.fft_hfft.default,
    aten.fft_ihfft.default,
    aten.linalg_cond.default,
    aten.linalg_cond.p_str,
    aten.linalg_matrix_rank.default,
    aten.linalg_matrix_rank.tol_tensor,
    aten.linalg_matrix_rank.atol_rtol_tensor,
    aten.linalg_matrix_rank.atol_rtol_float,
    aten.linalg_solve.default,
    aten.linalg_cholesky.default,
    aten.linalg_svdvals.default,
    aten.linalg_eigvals.default,
    aten.linalg_eigvalsh.default,
    aten.linalg_inv.default,
    aten.linalg_householder_product.default,
    aten.linalg_tensorinv.default,
    aten.linalg_tensorsolve.default,
    aten.fake_quantize_per_tensor_affine.default,
    aten.geqrf.default,
    aten._lu_with_info.default,
    aten.qr.default,
    aten.svd.default,
    aten.triangular_solve.default,
    aten.multilabel_margin_loss_forward.default,
    aten.linalg_qr.default,
    aten.linalg_cholesky_ex.default,
    aten.linalg_svd.default,
    aten.linalg_eig.default,
    aten.linalg_eigh.default,
    aten.linalg_lstsq.default,
    aten.linalg_inv_ex.default,
]
_PROMOTE = [aten.stack.default, aten.cat.default, aten.index_copy.default]

AUTOCAST_POLICY: dict = {
    **dict.fromkeys(_LOWER, LOWER_PRECISION_FP),
    **dict.fromkeys(_FP32, FP32),
    **dict.fromkeys(_PROMOTE, PROMOTE),
}

AUTOCAST_KEY = "AutocastPrivateUse1"
_EXCLUDE_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)


def _eligible(x) -> bool:
    """Autocast casts floating device tensors other than float64, as ATen's ``is_eligible``."""
    return (
        isinstance(x, torch.Tensor)
        and x.is_floating_point()
        and x.dtype is not torch.float64
        and x.device.type == "xla"
    )


def _cast(x, dtype: torch.dtype):
    if _eligible(x):
        return x if x.dtype is dtype else x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


def _eligible_dtypes(x, found: set) -> set:
    if _eligible(x):
        found.add(x.dtype)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _eligible_dtypes(v, found)
    return found


def _widest(op, lower: torch.dtype, args: tuple, kwargs: dict) -> torch.dtype:
    """ATen's autocast ``promote_type``: float32 if any input is float32, else the lower type."""
    found = _eligible_dtypes(list(args) + list(kwargs.values()), set())
    if torch.float32 in found:
        return torch.float32
    if found - {lower}:
        raise RuntimeError(
            f"{op}: autocast to {lower} cannot promote inputs of dtypes "
            f"{sorted(str(d) for d in found)}; cast them to {lower} or float32 first"
        )
    return lower


def autocast_kernel(op, policy: str) -> Callable:
    """The AutocastPrivateUse1 kernel of ``op``: cast the inputs as ``policy`` says, then call the
    op with autocast off for the ops it decomposes into (ATen's ``WrapFunction_``)."""

    def kernel(*args, **kwargs):
        lower = torch.get_autocast_dtype("xla")
        if policy == LOWER_PRECISION_FP:
            dtype = lower
        elif policy == FP32:
            dtype = torch.float32
        else:
            dtype = _widest(op, lower, args, kwargs)
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE_AUTOCAST):
            return op(*_cast(args, dtype), **{k: _cast(v, dtype) for k, v in kwargs.items()})

    return kernel


# --- the gradient scaler -------------------------------------------------------------------------


@lowers(aten._amp_update_scale.default)
def _amp_update_scale(scale, growth_tracker, found_inf, growth_factor, backoff_factor, interval):
    """ATen's CPU/CUDA kernel: back off on inf/nan; grow after ``interval`` clean steps unless the
    grown scale overflows. Products round once from double to float, as the kernel's do."""
    found = found_inf != 0
    successful = growth_tracker + 1
    grow = ~found & (successful == interval)
    wide = scale.astype(jnp.float64)
    grown = (wide * growth_factor).astype(scale.dtype)
    backed_off = (wide * backoff_factor).astype(scale.dtype)
    kept_or_grown = jnp.where(grow & jnp.isfinite(grown), grown, scale)
    new_scale = jnp.where(found, backed_off, kept_or_grown)
    new_tracker = jnp.where(found | grow, jnp.zeros_like(successful), successful)
    return new_scale, new_tracker


@lowers(aten._amp_foreach_non_finite_check_and_unscale.default)
def _non_finite_check_and_unscale(grads, found_inf, inv_scale) -> list:
    """Every gradient times ``inv_scale`` (in opmath, rounded once), and ``found_inf`` set to 1 if
    any holds an inf or nan: one node for all gradients, nothing read on the host."""
    finite = jnp.stack([jnp.isfinite(g).all() for g in grads]).all()
    unscaled = [(g.astype(opmath(g.dtype)) * inv_scale).astype(g.dtype) for g in grads]
    return unscaled + [jnp.where(finite, found_inf, jnp.ones_like(found_inf))]


# The scaler's in-place check as its functional overload, its results written to the gradients
# and the flag.
CHECK_AND_UNSCALE = {
    aten._amp_foreach_non_finite_check_and_unscale_.default: (
        aten._amp_foreach_non_finite_check_and_unscale.default,
        (0, 1),
    )
}


def _update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, interval):
    new_scale, new_tracker = aten._amp_update_scale.default(
        scale, growth_tracker, found_inf, growth_factor, backoff_factor, interval
    )
    scale.copy_(new_scale)
    growth_tracker.copy_(new_tracker)
    return scale


DECOMPOSITIONS = {
    aten._amp_update_scale_.default: _update_scale_,
}
