"""Known failures of the OpInfo differential tests: (op, "fwd"|"grad", dtype) -> reason.

Applied as strict xfails: when an op gets fixed its test turns red until its entry is deleted.
An op that still runs on the CPU without a data-dependent output shape is a failure too
(``_cpu``: the lowering it lacks); CPU_FALLBACKS lists the only fallbacks allowed to pass.
"""

_SPARSE = (
    "sparse CSR tensors are out of scope: aten::_sparse_mm_reduce_impl has no SparseCsrxla kernel"
)
_PARTIAL_VIEWS = (
    "samples view a larger storage (input = base[5:15]) and storage_offset counts from the base; "
    "the copy to the device owns a fresh 10-element storage (as .clone() does on CPU), so offsets "
    "address other elements: the xla result equals as_strided of a CPU clone"
)
_TIES = (
    "bf16 samples hold many equal values (equal in the float64 reference too) and CPU's unstable "
    "sort/topk orders ties its own way; "
    "values match exactly and every index points at an equal value (ours keep ties in index order)"
)
_STATS_DTYPE = (
    "CPU returns the saved mean/rstd of a bf16 input in bf16; shapes and dtypes come from "
    "PyTorch's meta kernel, which (as CUDA) gives float32; the output and the values match"
)
_BN_EVAL_STATS = (
    "in eval (training=False) CPU saves empty (0,) mean/invstd; PyTorch's meta kernel, which gives "
    "our shapes, says (C,); the normalized output matches"
)

_CUDA_ONLY = "jiterator OpInfos run only on CUDA/ROCm: CPU eager raises, so there is no reference"
_FEATURE_DROPOUT = (
    "dropout2d/3d and alpha dropout call aten.bernoulli with a tensor p through PyTorch's "
    "decomposition, which reaches bernoulli.p without p"
)
_RESIZE = "resize_ changes a storage's size; xla tensors have fixed-size storages"
_CHALF = "complex32 (chalf) has no JAX dtype"
_TENSOR_SPLIT = (
    "the sample's tensor of split indices moves to the device with the input, and tensor_split "
    "requires it on the CPU (PyTorch's own check)"
)
_EXPM = (
    "jax.scipy.linalg.expm's Pade/scaling differs from PyTorch's degree-18 Taylor method beyond "
    "float32 tolerance on the samples' large-norm matrices; expm has no bfloat16"
)
_EIGH_SIGNS = (
    "eigenvectors are defined up to sign; XLA's eigh picks other signs than LAPACK's syevd "
    "(eigenvalues match)"
)
_RANDOM_SAMPLES = "the op draws random numbers internally: the device stream differs from CPU's"
_SAMPLER = (
    "a sampler drawing from the device's PRNG stream, not CPU's generator: the values differ; "
    "shape and dtype match (test_opinfo's _RANDOM compares only those, as for exponential)"
)
_LOGCUMSUMEXP_GRAD = (
    "ATen's backward is a difference of two logcumsumexps that cancel, so it magnifies the "
    "forward's rounding: JAX's cumlogsumexp combines in a tree, eager in sequence; against "
    "float64, the first sample's gradient is off by 8.8e-3 here and by 2.5e-3 in eager"
)
_LINEAR_CE_BF16 = (
    "no reference fits both samples: the second sample's loss is one bf16 ulp (0.03125) from "
    "eager's and the float64 reference's, which agree; the third equals eager's, which is one "
    "ulp from the reference (bf16 matmuls and their accumulation order)"
)

# Ops whose bf16 result here is eager CPU's, bit for bit, and so as far from the float64
# reference rounded once as eager's (more than one ulp): ATen's kernels round intermediates to
# bf16. Their bf16 forward is compared with eager's bits, exactly (test_opinfo).
BF16_AS_EAGER = {
    "_unsafe_masked_index_put_accumulate",
    "cross",
    "linalg.cross",
    "nn.functional.cosine_similarity",
    "nn.functional.gaussian_nll_loss",
    "nn.functional.hinge_embedding_loss",
    "nn.functional.multilabel_soft_margin_loss",
    "nn.functional.tanhshrink",
    "special.ndtr",
}


def _cpu(*ops: str) -> str:
    return "no lowering yet, runs on the CPU: " + ", ".join(f"aten::{op}" for op in ops)


XFAILS: dict[tuple[str, str, str], str] = {
    ("_batch_norm_with_update", "fwd", "bfloat16"): _STATS_DTYPE,
    ("_native_batch_norm_legit", "fwd", "bfloat16"): _STATS_DTYPE + "; " + _BN_EVAL_STATS,
    ("_native_batch_norm_legit", "fwd", "float32"): _BN_EVAL_STATS,
    ("_native_batch_norm_legit", "grad", "float32"): _BN_EVAL_STATS,
    ("argsort", "fwd", "bfloat16"): _TIES,
    ("as_strided.partial_views", "fwd", "bfloat16"): _PARTIAL_VIEWS,
    ("as_strided.partial_views", "fwd", "float32"): _PARTIAL_VIEWS,
    ("as_strided.partial_views", "grad", "float32"): _PARTIAL_VIEWS,
    ("cauchy", "fwd", "bfloat16"): _SAMPLER,
    ("cauchy", "fwd", "float32"): _SAMPLER,
    ("chalf", "fwd", "bfloat16"): _CHALF,
    ("chalf", "fwd", "float32"): _CHALF,
    ("chalf", "grad", "float32"): _CHALF,
    ("geometric", "fwd", "bfloat16"): _SAMPLER,
    ("geometric", "fwd", "float32"): _SAMPLER,
    ("jiterator_2inputs_2outputs", "fwd", "bfloat16"): _CUDA_ONLY,
    ("jiterator_2inputs_2outputs", "fwd", "float32"): _CUDA_ONLY,
    ("jiterator_4inputs_with_extra_args", "fwd", "bfloat16"): _CUDA_ONLY,
    ("jiterator_4inputs_with_extra_args", "fwd", "float32"): _CUDA_ONLY,
    ("jiterator_binary", "fwd", "bfloat16"): _CUDA_ONLY,
    ("jiterator_binary", "fwd", "float32"): _CUDA_ONLY,
    ("jiterator_binary_return_by_ref", "fwd", "bfloat16"): _CUDA_ONLY,
    ("jiterator_binary_return_by_ref", "fwd", "float32"): _CUDA_ONLY,
    ("jiterator_unary", "fwd", "bfloat16"): _CUDA_ONLY,
    ("jiterator_unary", "fwd", "float32"): _CUDA_ONLY,
    ("linalg.eigh", "fwd", "float32"): _EIGH_SIGNS,
    ("log_normal", "fwd", "bfloat16"): _SAMPLER,
    ("log_normal", "fwd", "float32"): _SAMPLER,
    ("logcumsumexp", "grad", "float32"): _LOGCUMSUMEXP_GRAD,
    ("matrix_exp", "fwd", "bfloat16"): _EXPM,
    ("matrix_exp", "fwd", "float32"): _EXPM,
    ("matrix_exp", "grad", "float32"): _EXPM,
    ("native_batch_norm", "fwd", "bfloat16"): _STATS_DTYPE,
    ("native_batch_norm", "fwd", "float32"): _BN_EVAL_STATS,
    ("native_batch_norm", "grad", "float32"): _BN_EVAL_STATS,
    ("native_layer_norm", "fwd", "bfloat16"): _STATS_DTYPE,
    ("nn.functional.alpha_dropout", "fwd", "bfloat16"): _FEATURE_DROPOUT,
    ("nn.functional.alpha_dropout", "fwd", "float32"): _FEATURE_DROPOUT,
    ("nn.functional.dropout2d", "fwd", "bfloat16"): _FEATURE_DROPOUT,
    ("nn.functional.dropout2d", "fwd", "float32"): _FEATURE_DROPOUT,
    ("nn.functional.dropout3d", "fwd", "bfloat16"): _FEATURE_DROPOUT,
    ("nn.functional.dropout3d", "fwd", "float32"): _FEATURE_DROPOUT,
    ("nn.functional.feature_alpha_dropout.with_train", "fwd", "bfloat16"): _FEATURE_DROPOUT,
    ("nn.functional.feature_alpha_dropout.with_train", "fwd", "float32"): _FEATURE_DROPOUT,
    ("nn.functional.feature_alpha_dropout.with_train", "grad", "float32"): _FEATURE_DROPOUT,
    ("nn.functional.fractional_max_pool3d", "fwd", "float32"): _RANDOM_SAMPLES,
    ("nn.functional.fractional_max_pool3d", "grad", "float32"): _RANDOM_SAMPLES,
    ("nn.functional.linear_cross_entropy.chunked_none", "fwd", "bfloat16"): _LINEAR_CE_BF16,
    ("pca_lowrank", "fwd", "float32"): _RANDOM_SAMPLES,
    ("resize_", "fwd", "bfloat16"): _RESIZE,
    ("resize_", "fwd", "float32"): _RESIZE,
    ("resize_as_", "fwd", "bfloat16"): _RESIZE,
    ("resize_as_", "fwd", "float32"): _RESIZE,
    ("sort", "fwd", "bfloat16"): _TIES,
    ("sparse.mm.reduce", "fwd", "bfloat16"): _SPARSE,
    ("sparse.mm.reduce", "fwd", "float32"): _SPARSE,
    ("sparse.mm.reduce", "grad", "float32"): _SPARSE,
    ("sparse.sampled_addmm", "fwd", "float32"): _SPARSE,
    ("sparse.sampled_addmm", "grad", "float32"): _SPARSE,
    ("svd_lowrank", "fwd", "float32"): _RANDOM_SAMPLES,
    ("tensor_split", "fwd", "bfloat16"): _TENSOR_SPLIT,
    ("tensor_split", "fwd", "float32"): _TENSOR_SPLIT,
    ("tensor_split", "grad", "float32"): _TENSOR_SPLIT,
    ("to_sparse", "fwd", "bfloat16"): _SPARSE,
    ("to_sparse", "fwd", "float32"): _SPARSE,
    ("to_sparse", "grad", "float32"): _SPARSE,
    ("topk", "fwd", "bfloat16"): _TIES,
}

# Ops that still run on the CPU (counted and warned about) while their test passes:
# (op, "fwd"|"grad") -> the aten:: fallback counters the test may bump. Any other fallback fails.
# Only data-dependent output shapes belong here (nonzero, masked_select, unique and kin).
CPU_FALLBACKS: dict[tuple[str, str], tuple[str, ...]] = {
    # Backward through boolean-mask indexing: the mask's nonzero positions are data-dependent.
    ("index_fill", "grad"): ("aten::_unique",),
    ("index_put", "grad"): ("aten::index",),
    ("argwhere", "fwd"): ("aten::nonzero",),
    ("combinations", "fwd"): ("aten::masked_select",),
    ("combinations", "grad"): ("aten::masked_select",),
    ("masked_select", "fwd"): ("aten::masked_select",),
    ("masked_select", "grad"): ("aten::masked_select",),
    ("nonzero", "fwd"): ("aten::nonzero",),
    ("unique", "fwd"): ("aten::_unique2",),
    ("unique_consecutive", "fwd"): ("aten::unique_consecutive",),
}
