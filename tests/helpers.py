"""The test kit: one comparison of eager CPU with xla (forward and gradients), the reference it
compares with, the one tolerance table, and metric-counting assertions.

A bfloat16/float16 reference never comes from CPU's own low-precision kernels, whose rounding
depends on the instruction set (AVX2, AVX-512, AMX): reference() upcasts the inputs exactly to
float64, runs the op there and rounds each result once to the dtype CPU gives it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
import torch.utils._pytree as pytree

import spmd_torch
from spmd_torch._lazy import counters
from tests.xla_codegen import child_flags

LOW_PRECISION = (torch.bfloat16, torch.float16)


def _tol(rtol: float, atol: float) -> dict:
    return {"rtol": rtol, "atol": atol}


EXACT = _tol(0, 0)

# One row per dtype, "fwd" for results and "grad" for gradients: a value passes when
# |actual - expected| <= atol + rtol * |expected|. Dtypes not listed (integers, bool) are exact.
TOLERANCES: dict[torch.dtype, dict[str, dict]] = {
    torch.float64: {"fwd": _tol(1e-7, 1e-7), "grad": _tol(1e-7, 1e-7)},
    # XLA sums in another order than CPU (trees, not loops); a gradient adds several such sums and
    # often goes through a composite decomposition, hence the looser grad row.
    torch.float32: {"fwd": _tol(1e-4, 1e-5), "grad": _tol(2e-4, 2e-4)},
    # bf16 keeps 8 significant bits: one ulp is 2**-8 to 2**-7 of the value. The reference is the
    # float64 result rounded once; ours computes in float32 and rounds once, so the two differ by
    # at most one ulp (rtol 8e-3 > 2**-7), plus float32 summation error where a result cancels to
    # ~0 (atol 1e-5). Ops that round a bf16 intermediate get a named override below.
    torch.bfloat16: {"fwd": _tol(8e-3, 1e-5), "grad": _tol(8e-3, 1e-5)},
    # float16 keeps 11 bits: one ulp is 2**-11 to 2**-10 of the value (rtol 1e-3), as for bf16.
    torch.float16: {"fwd": _tol(1e-3, 1e-5), "grad": _tol(1e-3, 1e-5)},
}

_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)

# Named overrides of the table: name -> dtype -> {"fwd"|"grad": tolerance}. A dtype or kind an
# entry leaves out falls back to TOLERANCES. OpInfo tests look up their op's full name here.
TOLERANCE_OVERRIDES: dict[str, dict[torch.dtype, dict[str, dict]]] = {
    # Bitwise: results that involve no rounding, or round exactly as the reference does.
    "exact": {dtype: {"fwd": EXACT, "grad": EXACT} for dtype in _FLOATS},
    # One aten op on its own (the lowering unit tests, a collective against numpy): float32
    # differs only in summation order.
    "single_op": {
        torch.float32: {"fwd": _tol(1e-5, 1e-5)},
        torch.complex64: {"fwd": _tol(1.3e-6, 1e-5)},
        torch.complex128: {"fwd": _tol(1e-7, 1e-7)},
    },
    # Ops that move data or add a handful of terms (the indexing lowerings): torch.testing's
    # float32 default.
    "data_movement": {torch.float32: {"fwd": _tol(1.3e-6, 1e-5)}},
    # cdist's matrix-product path, |x|^2 + |y|^2 - 2 x.y, cancels where the distance is small.
    "cdist_mm": {torch.float32: {"fwd": _tol(1e-4, 1e-4)}},
    # Bicubic interpolation rounds its cubic weights to bf16, as PyTorch's CPU kernel stores them,
    # and the weights have both signs: an output that cancels (0.0084) is off by an ulp of the
    # operands (0.002-0.006), not of itself. Two ulps, and atol an ulp of operands of ~2.
    "nn.functional.interpolate.bicubic": {torch.bfloat16: {"fwd": _tol(1.6e-2, 1e-2)}},
    # The same float32 steps resumed on another mesh partitioning: XLA sums the sharded dimensions
    # in another order, so losses differ by a few ulps (2**-23 each) of rounding, no more. The
    # table's 1e-4 would let a slightly wrong restored optimizer state (AdamW's moments or step)
    # pass; 2e-6 is ~16 ulps.
    "resharded": {torch.float32: {"fwd": _tol(2e-6, 0)}},
    # Attention's backward reads the forward's output rounded to bf16, as flash kernels do (the
    # row sums of dO * O): q's and k's gradients are off by about an ulp of the largest gradient
    # rather than of each element (up to 0.007 on gradients of magnitude 2-5; exact from a
    # float32 output). float16 likewise, by its own ulp (2**-9 at 2-4).
    "attention": {
        torch.bfloat16: {"grad": _tol(8e-3, 1.6e-2)},
        torch.float16: {"grad": _tol(1e-3, 2e-3)},
    },
    # The Pallas TPU flash kernel rounds the probabilities to the values' dtype before their
    # product with the values (what the matrix unit takes), so a bf16 output is off by about an
    # ulp of the largest value (2**-8 of ~4) rather than of itself (0.004 on outputs near 0).
    "flash_kernel": {torch.bfloat16: {"fwd": _tol(8e-3, 1.6e-2)}},
    # Whole training loops: "fwd" compares parameters after several optimizer steps (Adam moves
    # each element by ~lr * sign(grad), amplifying float noise), "grad" gradients of one model.
    "training": {torch.float32: {"fwd": _tol(1e-3, 1e-4), "grad": _tol(1e-4, 1e-6)}},
}


def tolerance(dtype: torch.dtype, kind: str = "fwd", name: str | None = None) -> dict:
    """The table's rtol/atol for ``dtype`` (``kind`` "fwd" or "grad"), or its override ``name``."""
    if kind not in ("fwd", "grad"):
        raise ValueError(f"tolerance kind must be 'fwd' or 'grad', got {kind!r}")
    if name is not None:
        if name not in TOLERANCE_OVERRIDES:
            raise KeyError(f"no tolerance override {name!r}; known: {sorted(TOLERANCE_OVERRIDES)}")
        override = TOLERANCE_OVERRIDES[name].get(dtype, {})
        if kind in override:
            return override[kind]
    return TOLERANCES.get(dtype, {}).get(kind, EXACT)


def to_device(tree):
    dev = spmd_torch.device()
    return pytree.tree_map(
        lambda x: (
            x.detach().to(dev).requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
        ),
        tree,
    )


def to_cpu(tree):
    return pytree.tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, tree)


def _compare(
    actual, expected, tol_of: Callable[[torch.dtype], dict], label: str = "result"
) -> None:
    """Same structure, shapes and dtypes exactly; values within ``tol_of(dtype)``; a failure
    names the leaf (``label`` and its path)."""
    actual, expected = to_cpu(actual), to_cpu(expected)
    flat_actual, spec_actual = pytree.tree_flatten(actual)
    flat_expected, spec_expected = pytree.tree_flatten_with_path(expected)
    assert spec_actual == spec_expected, f"structure {spec_actual} != {spec_expected}"
    for a, (path, e) in zip(flat_actual, flat_expected):
        where = f"{label}{pytree.keystr(path)}"
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"{where}: expected a tensor, got {type(a)}"
            assert a.shape == e.shape, f"{where}: shape {tuple(a.shape)} != {tuple(e.shape)}"
            assert a.dtype == e.dtype, f"{where}: dtype {a.dtype} != {e.dtype}"
            tol = tol_of(e.dtype)
            torch.testing.assert_close(
                a.detach(), e.detach(), equal_nan=True, msg=lambda m: f"{where}: {m}", **tol
            )
        elif isinstance(e, float) and isinstance(a, float):
            assert a == e or (math.isnan(a) and math.isnan(e)), f"{where}: {a!r} != {e!r}"
        else:
            assert a == e, f"{where}: {a!r} != {e!r}"


def assert_close(actual, expected, *, tol: str | None = None, kind: str = "fwd", **tolerance_):
    """Same structure, shapes and dtypes exactly; values within the table's ``kind`` tolerance
    ("fwd" or "grad") for each dtype, or its override ``tol`` (a name in TOLERANCE_OVERRIDES,
    looked up per dtype, so a tree mixing dtypes gets each dtype's row), or within the rtol/atol
    given (``**tolerance(dtype, kind, name)``).

    Example:
        >>> assert_close(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]), tol="exact")
    """
    if tolerance_ and (tol is not None or kind != "fwd"):
        raise TypeError("assert_close: give either tol/kind or rtol/atol, not both")
    tolerance(torch.float32, kind, tol)  # an unknown kind or override name fails here
    _compare(actual, expected, lambda dtype: tolerance_ or tolerance(dtype, kind, tol))


# --- the reference -------------------------------------------------------------------------------


def _is_low_precision(x) -> bool:
    if isinstance(x, torch.Tensor):
        return x.dtype in LOW_PRECISION
    return isinstance(x, torch.dtype) and x in LOW_PRECISION


def _copy(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A detached copy of ``x`` in ``dtype`` with its whole storage, its strides and its storage
    offset, so ops that read the storage (as_strided) see the same elements."""
    if x.layout != torch.strided or x.device.type != "cpu" or x.is_conj() or x.is_neg():
        return x.detach().resolve_conj().resolve_neg().to(dtype, copy=True)
    storage = x.untyped_storage()
    flat = torch.empty(0, dtype=x.dtype).set_(storage, 0, (storage.nbytes() // x.element_size(),))
    return flat.to(dtype, copy=True).as_strided(x.shape, x.stride(), x.storage_offset())


def _round_once(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded once (to nearest, ties to even) to ``dtype``. torch converts float64 to
    bf16/fp16 through float32, rounding twice; narrowing to float32 by rounding to odd first
    keeps the result exact (float32 has more than two bits beyond bf16's and fp16's)."""
    if dtype not in LOW_PRECISION or x.dtype != torch.float64:
        return x.to(dtype)
    narrow = x.to(torch.float32)
    inexact = (narrow.double() != x) & ~x.isnan()
    past = inexact & (narrow.double().abs() > x.abs())  # rounded away from zero: truncate
    narrow = torch.where(past, torch.nextafter(narrow, torch.zeros_like(narrow)), narrow)
    bits = narrow.view(torch.int32)
    odd = torch.where(inexact, bits | 1, bits).view(torch.float32)
    return odd.to(dtype)


def _widen(leaves: list, wide: torch.dtype) -> list:
    """Floating tensors copied exactly into ``wide`` (requires_grad kept, as new leaves), floating
    dtype arguments replaced by ``wide``; the rest as it is."""
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x = _copy(x, wide).requires_grad_(x.requires_grad)
        elif isinstance(x, torch.dtype) and x.is_floating_point:
            x = wide
        out.append(x)
    return out


def _round_like(wide_result, probe):
    """Each tensor of the float64 ``wide_result`` rounded once to the dtype of the matching one in
    ``probe`` (CPU's low-precision result, used for its structure and dtypes only)."""
    flat_wide, spec_wide = pytree.tree_flatten(wide_result)
    flat_probe, spec_probe = pytree.tree_flatten_with_path(probe)
    assert spec_wide == spec_probe, f"upcasting changed the result: {spec_wide} != {spec_probe}"
    rounded = []
    for w, (path, p) in zip(flat_wide, flat_probe):
        if isinstance(p, torch.Tensor):
            shape = tuple(w.shape) if isinstance(w, torch.Tensor) else w
            assert shape == tuple(p.shape), (
                f"upcasting changed result{pytree.keystr(path)}: {shape!r} != {tuple(p.shape)}"
            )
            w = _round_once(w.detach(), p.dtype)
        rounded.append(w)
    return pytree.tree_unflatten(rounded, spec_wide)


def _run_reference(fn, args: tuple, kwargs: dict):
    """(result, (leaves, wide leaves, raw wide result)): fn's CPU result, with a low-precision
    input rounded once from float64. Every op the suite compares has a float64 CPU kernel; one
    without would raise here (float32, which also holds bf16/fp16 exactly, would then do)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if not any(_is_low_precision(x) for x in leaves):
        result = fn(*args, **kwargs)
        return result, (leaves, leaves, result)
    with torch.no_grad():
        probe_args, probe_kwargs = pytree.tree_unflatten(
            [_copy(x, x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves], spec
        )
        probe = fn(*probe_args, **probe_kwargs)
    wide_leaves = _widen(leaves, torch.float64)
    wide_args, wide_kwargs = pytree.tree_unflatten(wide_leaves, spec)
    result = fn(*wide_args, **wide_kwargs)
    return _round_like(result, probe), (leaves, wide_leaves, result)


def reference(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on CPU, except that with a bfloat16/float16 tensor or dtype among
    the arguments every floating input is upcast exactly to float64 (floating dtype arguments
    too), ``fn`` runs there, and each result is rounded once to the dtype CPU gives it (CPU's
    low-precision run supplies only the structure and dtypes).

    Example:
        >>> x = torch.tensor([1.0, 3.0], dtype=torch.bfloat16)
        >>> reference(torch.div, x, 3.0)
        tensor([0.3340, 1.0000], dtype=torch.bfloat16)
    """
    return _run_reference(fn, args, kwargs)[0]


# --- eager CPU vs xla ----------------------------------------------------------------------------


def _differentiable(result, expected) -> list[int]:
    """Positions, among the flattened results, of the floating outputs autograd tracks."""
    return [
        i
        for i, (r, e) in enumerate(zip(pytree.tree_leaves(result), pytree.tree_leaves(expected)))
        if isinstance(r, torch.Tensor) and r.requires_grad and e.is_floating_point()
    ]


def _pick(tree, positions: list[int]) -> list:
    leaves = pytree.tree_leaves(tree)
    return [leaves[i] for i in positions]


def _cotangents(expected: list) -> list:
    """A fixed random cotangent per differentiable output, in its dtype."""
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(e.shape, generator=generator, dtype=torch.float64).to(e.dtype) for e in expected
    ]


def _grads(outputs: list, inputs: list, cotangents: list) -> list:
    cotangents = [c.to(o.device, o.dtype) for c, o in zip(cotangents, outputs)]
    return list(torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True))


def _inputs(tree, grad: bool):
    """Fresh CPU copies of the inputs; with ``grad``, the floating ones require grad unless the
    caller already chose which do (OpInfo samples mark their differentiable inputs)."""
    leaves, spec = pytree.tree_flatten(tree)
    floating = [isinstance(x, torch.Tensor) and x.is_floating_point() for x in leaves]
    chosen = any(f and x.requires_grad for f, x in zip(floating, leaves))
    copies = [
        _copy(x, x.dtype).requires_grad_(x.requires_grad if chosen or not f else grad)
        if isinstance(x, torch.Tensor)
        else x
        for f, x in zip(floating, leaves)
    ]
    return pytree.tree_unflatten(copies, spec)


def assert_matches_eager(fn, *args, grad: bool = False, tol: str | None = None, **kwargs):
    """``fn`` on xla copies of the arguments matches ``fn`` on CPU copies (see reference()): same
    structure, shapes and dtypes, values within the table's "fwd" tolerance (or override ``tol``).

    With ``grad``, the floating inputs require grad, the floating outputs are backpropagated with a
    fixed random cotangent on both sides, and every input's gradient is compared too ("grad"
    tolerance). Returns the xla result.
    """
    return matches_eager(fn, *args, grad=grad, tol=tol, **kwargs)()


def matches_eager(
    fn, *args, grad: bool = False, tol: str | None = None, eager_bits: bool = False, **kwargs
):
    """assert_matches_eager in two halves: this runs both sides (the xla side traced, gradients
    included) and returns the comparison, which returns the xla result. Several of them, one
    ``spmd_torch.sync()``, then their comparisons: every case's values come from one program.

    ``eager_bits`` (forward only) takes eager CPU's own result as the reference, bit for bit:
    for an op whose ATen kernel rounds intermediates to bf16/fp16 itself, which the float64
    reference rounded once would hold to a precision PyTorch does not give."""
    cpu_args, cpu_kwargs = _inputs((args, kwargs), grad)
    device_args, device_kwargs = to_device((cpu_args, cpu_kwargs))
    if eager_bits:  # the float64 run is not needed: no gradient to take from it
        assert not grad and tol == "exact", "eager_bits compares a forward's bits: tol='exact'"
        expected = fn(*cpu_args, **cpu_kwargs)
    else:
        expected, (leaves, wide_leaves, wide_result) = _run_reference(fn, cpu_args, cpu_kwargs)
    actual = fn(*device_args, **device_kwargs)
    checks = [(actual, expected, lambda dtype: tolerance(dtype, "fwd", tol), "result")]
    if grad:
        outputs = _differentiable(wide_result, expected)
        inputs = [
            i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad
        ]
        assert outputs and inputs, "grad=True, but no floating output depends on a floating input"
        cotangents = _cotangents(_pick(expected, outputs))
        wide_inputs = [wide_leaves[i] for i in inputs]
        wide_grads = _grads(_pick(wide_result, outputs), wide_inputs, cotangents)
        expected_grads = {
            f"input {i}": None if g is None else _round_once(g, leaves[i].dtype)
            for i, g in zip(inputs, wide_grads)
        }
        device_leaves = pytree.tree_leaves((device_args, device_kwargs))
        device_inputs = [device_leaves[i] for i in inputs]
        actual_grads = _grads(_pick(actual, outputs), device_inputs, cotangents)
        grad_tol = lambda dtype: tolerance(dtype, "grad", tol)  # noqa: E731
        checks.append((dict(zip(expected_grads, actual_grads)), expected_grads, grad_tol, "grad"))

    def compare():
        for check in checks:
            _compare(*check)
        return actual

    return compare


# --- the accelerators' paths, on this host -------------------------------------------------------


def lowered_as_on(platform: str, tensors: list, monkeypatch):
    """The pending program that computes ``tensors``, lowered for ``platform`` (``'cuda'``: an
    NVIDIA GPU, ``'tpu'``) with no such device here, through JAX's real lowerings: cuDNN's fused
    attention (JAX's check of the cuDNN version answered: 9.3) and the Pallas TPU kernels. The
    attention lowering is told the platform."""
    from spmd_torch._lazy import compile as compile_module
    from spmd_torch._lazy import placement
    from spmd_torch._lazy.lowering import attention
    from spmd_torch.debug import graph

    if platform == "cuda":
        fused = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
        monkeypatch.setattr(fused, "check_cudnn_version", lambda: 90300)
    monkeypatch.setattr(attention, "_platform", lambda: platform)
    program = graph.pending_program(tensors)
    arrays = [placement.resolve(node, i) for node, i in program.leaves]
    return compile_module.lowered(program, arrays, platforms=(platform,))


def _forget_on_another_platform() -> list:
    """What a process keeps of its programs that holds its platform's choices: the compile cache,
    the fused kernels' differentiable wrappers (whose traces JAX caches), scans' residual
    shapes."""
    from spmd_torch._lazy import compile as compile_module
    from spmd_torch._lazy import loop
    from spmd_torch._lazy.lowering import attention, splash

    return [
        attention._pallas_kernel.cache_clear,
        attention._split_kernel.cache_clear,
        splash._split.cache_clear,
        compile_module.clear_cache,
        loop._RESIDUALS.clear,
    ]


@contextlib.contextmanager
def pallas_interpreted(monkeypatch):
    """Programs compiled in the block take the TPU path (attention is told the platform is a TPU)
    and run its Pallas kernels on this host through Pallas's HLO interpreter: their values, not
    only their lowering, with no TPU. The setting is global, not per thread, because a kernel the
    partitioner splits is traced while XLA compiles. What the process keeps of this host's
    programs is forgotten on the way in and out (``_forget_on_another_platform``). The
    interpreted kernels are large programs, and XLA's inlining propagates each op's Python
    traceback: a test's deep stacks made it take over 10 minutes for one step, so their ops
    carry none."""
    import jax
    from jax._src import config as jax_config

    from spmd_torch._lazy.lowering import attention

    setting = getattr(jax_config, "pallas_tpu_interpret_mode_context_manager", None)
    if setting is None:
        pytest.skip("this JAX has no interpreter for Pallas TPU kernels")
    monkeypatch.setattr(attention, "_platform", lambda: "tpu")
    before = setting.get_global(), jax.config.jax_traceback_in_locations_limit
    for forget in _forget_on_another_platform():
        forget()
    setting.set_global(True)  # True: the HLO interpreter (no host callbacks)
    jax.config.update("jax_traceback_in_locations_limit", 0)
    try:
        yield
    finally:
        setting.set_global(before[0])
        jax.config.update("jax_traceback_in_locations_limit", before[1])
        for forget in _forget_on_another_platform():
            forget()


def pallas_kernel_shapes(monkeypatch, while_compiling: bool = False) -> list:
    """The shapes of the queries each call of the Pallas kernel's forward is traced with (only
    while XLA compiles, ``while_compiling``: see ``compiling_flag``): JAX's module calls its
    ``_flash_attention`` for the public function and its residual-saving form alike."""
    from spmd_torch._lazy.lowering import attention

    module = attention._flash()
    kernel = module._flash_attention
    shapes, compiling = [], compiling_flag(monkeypatch)

    def spy(q, k, v, *args):
        if compiling[0] or not while_compiling:
            shapes.append(tuple(q.shape))
        return kernel(q, k, v, *args)

    monkeypatch.setattr(module, "_flash_attention", spy)
    return shapes


def compiling_flag(monkeypatch) -> list:
    """A flag, ``[True]`` while XLA compiles a program of the engine's: the partitioner traces
    then what each device runs of an op it splits by a rule (lowering traced it whole, for its
    result's shape only)."""
    from spmd_torch._lazy import compile as compile_module

    flag = [False]
    compile_xla = compile_module._compiled

    def compiled(lowered):
        flag[0] = True
        try:
            return compile_xla(lowered)
        finally:
            flag[0] = False

    monkeypatch.setattr(compile_module, "_compiled", compiled)
    return flag


@contextlib.contextmanager
def cudnn_stood_in(monkeypatch):
    """Programs compiled in the block take the NVIDIA GPU path, cuDNN's kernel chosen and
    replaced by plain attention computing its two results (output, log-sum-exp) on this host:
    what is around the kernel (the partitioner's rule, grouped heads, the backward) runs for
    real. Yields the shapes of the queries the kernel is traced with while XLA compiles. What
    the process keeps of this host's programs is forgotten on the way in and out
    (``_forget_on_another_platform``)."""
    from spmd_torch._lazy.lowering import attention

    shapes, compiling = [], compiling_flag(monkeypatch)

    def stand_in(q, k, v, causal, scale, window=None):
        if compiling[0]:
            shapes.append(tuple(q.shape))
        mask = (
            None if window is None else attention.BlockMask(None, None, q.shape[2], window=window)
        )
        return attention.blockwise_forward(q, k, v, mask, causal, scale, 0.0, None, k.shape[2])

    kernel = attention._cudnn_here
    monkeypatch.setattr(attention, "_platform", lambda: "cuda")
    monkeypatch.setattr(attention, "_cudnn_here", stand_in)
    for forget in _forget_on_another_platform():
        forget()
    try:
        yield shapes
    finally:
        monkeypatch.setattr(attention, "_cudnn_here", kernel)
        for forget in _forget_on_another_platform():
            forget()


# --- metrics -------------------------------------------------------------------------------------


@contextlib.contextmanager
def assert_compiles(n: int):
    """The block compiles exactly ``n`` new programs."""
    before = counters.COUNTERS.get("UncachedCompile", 0)
    yield
    compiled = counters.COUNTERS.get("UncachedCompile", 0) - before
    assert compiled == n, f"expected {n} compilations, got {compiled}"


@contextlib.contextmanager
def assert_counter_delta(name: str, n: int):
    before = counters.COUNTERS.get(name, 0)
    yield
    delta = counters.COUNTERS.get(name, 0) - before
    assert delta == n, f"counter {name}: expected +{n}, got +{delta}"


ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_example(name: str):
    """``examples/<name>.py`` as a module (not run as a script), to call its functions."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_example(script: str, *args: str, hosts: int = 1) -> str:
    """Run ``examples/<script>`` on 8 virtual CPU devices, as one host or (``hosts``) as a job of
    that many hosts through ``spmd_torch.distributed.run``; its output, asserting it exited 0.
    The time limit only ends a hang: an example shares the machine with the suite's workers."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=child_flags())
    command = [sys.executable, str(ROOT / "examples" / script), *args]
    if hosts > 1:
        launcher = ["-m", "spmd_torch.distributed.run", "--hosts", str(hosts)]
        command[1:1] = [*launcher, "--devices-per-host", str(8 // hosts)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{script} exited with {result.returncode}:\n{output}"
    return output
