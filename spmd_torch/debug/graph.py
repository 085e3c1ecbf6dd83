"""The pending graph, as text, HLO and StableHLO, without running it: what the next sync compiles.

``get_tensors_text`` and ``get_tensors_hlo`` answer what PyTorch/XLA's
``torch_xla._XLAC._get_xla_tensors_text`` / ``_get_xla_tensors_hlo`` answer; ``save_pending`` is
what the barrier writes when ``XLA_SAVE_TENSORS_FILE`` is set.
"""

from __future__ import annotations

import math
import re
import traceback

import jax
import numpy as np
import torch
from jax.sharding import SingleDeviceSharding

from spmd_torch import config as _config
from spmd_torch._lazy import engine as _engine
from spmd_torch._lazy import placement as _placement
from spmd_torch._lazy.graph import Aval, Program, aval_text, linearize, to_text
from spmd_torch._lazy.lowering.dtypes import to_jax_dtype, to_torch_dtype
from spmd_torch._lazy.tensor import live_pending, on_xla


def pending_text(tensors: list[torch.Tensor] | None = None) -> str:
    """The pending graph computing ``tensors`` as text, one typed line per op.

    Args:
        tensors: xla tensors whose graph to show; default: every pending tensor.

    Example:
        >>> y = torch.ones(2, device=dev) * 3
        >>> print(graph.pending_text([y]))
    """
    return to_text(pending_program(tensors))


def pending_hlo(tensors: list[torch.Tensor] | None = None) -> str:
    """The pending graph computing ``tensors`` as the HLO module XLA is handed; nothing runs.

    Args:
        tensors: xla tensors whose graph to lower; default: every pending tensor.

    Example:
        >>> print(graph.pending_hlo([y]))
    """
    return _lowered(tensors, "hlo")


def pending_stablehlo(tensors: list[torch.Tensor] | None = None) -> str:
    """The pending graph computing ``tensors`` lowered to StableHLO text; nothing runs.

    Example:
        >>> print(graph.pending_stablehlo([y]))
    """
    return _lowered(tensors, "stablehlo")


def program_text(program: Program, form: str) -> str:
    """``program`` lowered, nothing run: ``form`` ``'stablehlo'`` (what JAX lowers to), ``'hlo'``
    (the HLO module XLA is handed) or ``'optimized'`` (the HLO XLA runs after its passes, SPMD
    partitioning and collectives included)."""
    arrays = [_placement.resolve(node, i) for node, i in program.leaves]
    lowered = _engine.current().mode.lowered(program, arrays)
    if form == "optimized":
        return lowered.compile().as_text()
    return hlo_text(lowered) if form == "hlo" else lowered.as_text()


def hlo_text(lowered: jax.stages.Lowered) -> str:
    """``lowered`` as HLO text in PyTorch/XLA's print style (:func:`module_text`)."""
    try:
        return module_text(xla_computation(lowered))
    except (ImportError, AttributeError):  # another jaxlib's layout: JAX's own HLO text
        return lowered.as_text(dialect="hlo", debug_info=bool(_config.HLO_DEBUG.value))


def module_text(computation) -> str:
    """jaxlib's ``XlaComputation`` as HLO text in PyTorch/XLA's print style: values named after
    their opcode (``%all-reduce.3``), operands with their shapes, shardings as ``sharding={...}``,
    no metadata. With ``XLA_HLO_DEBUG`` each op's metadata is printed, the user's ``source_file``
    and ``source_line`` in it."""
    from jaxlib import _hlo as hlo  # jaxlib's private module of HLO print options

    options = hlo.HloPrintOptions()
    options.print_percent = True
    options.print_operand_shape = True
    options.print_metadata = bool(_config.HLO_DEBUG.value)
    return _IOTA_DEVICES.sub(_listed_devices, computation.get_hlo_module().to_string(options))


def held_text(aval: Aval) -> str:
    """``aval`` as XLA spells it, in the dtype the device holds it (``XLA_USE_BF16``: ``bf16``
    for float32)."""
    return aval_text(Aval(aval.shape, to_torch_dtype(to_jax_dtype(aval.dtype))))


def _sharding_text(sharding, rank: int) -> str:
    """XLA's ``HloSharding::ToString`` of ``sharding`` for a rank-``rank`` value, its devices
    listed; ``{unknown}`` for none or one device."""
    if sharding is None or isinstance(sharding, SingleDeviceSharding):
        return "{unknown}"
    text = str(sharding._to_xla_hlo_sharding(rank))  # JAX's conversion has no public API
    return _IOTA_DEVICES.sub(_listed_devices, text)


# A tile assignment in XLA's iota form: ``devices=[2,4]<=[4,2]T(1,0)`` is arange(8) reshaped to
# [4,2] and transposed by (1,0), in the [2,4] grid.
_IOTA_DEVICES = re.compile(r"devices=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")


def _listed_devices(match: re.Match) -> str:
    """A sharding's devices written out in full, as PyTorch/XLA prints them (and
    ``_get_xla_sharding_spec`` gives them): ``devices=[2,4]0,2,4,6,1,3,5,7``."""
    grid, reshape, transpose = match.groups()
    ids = np.arange(math.prod(int(n) for n in reshape.split(",")))
    ids = ids.reshape([int(n) for n in reshape.split(",")])
    if transpose:
        ids = ids.transpose([int(n) for n in transpose.split(",")])
    return f"devices=[{grid}]{','.join(map(str, ids.ravel()))}"


def xla_computation(lowered: jax.stages.Lowered):
    """``lowered`` as jaxlib's ``XlaComputation``: the HLO module XLA is handed, its values named
    after their opcode (JAX's source locations, which would name them, are left out unless
    ``XLA_HLO_DEBUG`` asks for metadata)."""
    try:  # jaxlib's private StableHLO -> HLO conversion
        from jax._src.lib import _jax

        text = lowered.as_text(debug_info=bool(_config.HLO_DEBUG.value))
        return _jax.mlir.mlir_module_to_xla_computation(text, use_tuple_args=False)
    except (ImportError, AttributeError):  # another jaxlib's layout
        return lowered.compiler_ir("hlo")


def _lowered(tensors: list[torch.Tensor] | None, form: str) -> str:
    return program_text(pending_program(tensors), form)


def pending_count() -> int:
    """How many live tensors (counting aliases once) hold a value the next sync computes.

    Example:
        >>> y = torch.ones(2, device=dev) * 3
        >>> graph.pending_count()
        1
    """
    key = _engine.current().rng  # the engine's own PRNG key is not a tensor
    return sum(1 for s in live_pending() if s is not key and not s.ref[0].is_leaf(s.ref[1]))


def get_tensors_text(tensors: list[torch.Tensor]) -> str:
    """The graph computing ``tensors`` as text (``_XLAC._get_xla_tensors_text``).

    Args:
        tensors: xla tensors; computed ones show as inputs.

    Example:
        >>> print(graph.get_tensors_text([y]))
    """
    return pending_text(_checked(tensors, "get_tensors_text"))


def get_tensors_hlo(tensors: list[torch.Tensor]) -> str:
    """The graph computing ``tensors`` as HLO text (``_XLAC._get_xla_tensors_hlo``).

    Args:
        tensors: xla tensors.

    Example:
        >>> print(graph.get_tensors_hlo([y]))
    """
    return pending_hlo(_checked(tensors, "get_tensors_hlo"))


def _checked(tensors, api: str) -> list[torch.Tensor]:
    return [on_xla(t, f"{api} (tensors[{i}])") for i, t in enumerate(tensors)]


def pending_program(tensors: list[torch.Tensor] | None = None) -> Program:
    """The linearised graph computing ``tensors`` (default: every pending tensor); nothing runs.

    Example:
        >>> program = graph.pending_program([y])
    """
    if tensors is None:
        refs = [s.ref for s in live_pending() if not s.ref[0].is_leaf(s.ref[1])]
    else:
        refs = [t._ref() for t in tensors]
    return linearize(list({(id(n), i): (n, i) for n, i in refs}.values()))


def save_pending(path: str, fmt: str = "text") -> list:
    """Append the graph the barrier is about to run to ``path``, as PyTorch/XLA's
    ``XLA_SAVE_TENSORS_FILE`` does: the Python frames that issued the barrier, then the graph
    between ``## BEGIN_GRAPH`` and ``## END_GRAPH`` (``fmt`` 'text': our op lines; 'hlo': HLO
    text). Nothing is written when nothing is pending. Returns, for 'hlo', the outputs whose
    shardings :func:`save_output_shardings` appends once the program has laid them out.

    Raises:
        ValueError: ``fmt`` is neither 'text' nor 'hlo'.

    Example:
        >>> outputs = graph.save_pending('/tmp/graphs.0', 'hlo')
    """
    if fmt not in ("text", "hlo"):
        raise ValueError(f"XLA_SAVE_TENSORS_FMT={fmt!r}: spmd_torch writes 'text' or 'hlo'")
    key = _engine.current().rng
    outputs = [s for s in live_pending() if s is not key and not s.ref[0].is_leaf(s.ref[1])]
    if not outputs:
        return []
    frames = [f for f in traceback.extract_stack()[:-1] if "/spmd_torch/" not in f.filename]
    lines = ["[ScheduleSyncTensorsGraph]", "TensorsGraphInfo:"]
    lines += [f"  {f.name} ({f.filename}:{f.lineno})" for f in reversed(frames)]
    body = pending_hlo() if fmt == "hlo" else pending_text()
    lines += ["", "## BEGIN_GRAPH", body.rstrip("\n"), "## END_GRAPH", ""]
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")
    return outputs if fmt == "hlo" else []


def save_output_shardings(path: str, outputs: list) -> None:
    """Append PyTorch/XLA's ``#OUTPUT_SHARDING`` section for ``outputs`` (storages the program
    just computed): each one's shape as the device holds it (``XLA_USE_BF16`` applied) and the
    sharding its program gave it, as ``HloSharding::ToString`` prints it (``f32[8,4]
    {devices=[8,1]0,1,2,3,4,5,6,7}``; ``{unknown}`` for a value on one device)."""
    lines = []
    for storage in outputs:
        node, index = storage.ref
        array = node.arrays[index] if node.is_leaf(index) else None
        aval = node.avals[index]
        text = _sharding_text(getattr(array, "sharding", None), len(aval.shape))
        lines.append(f"{held_text(aval)} {text}")
    if lines:
        with open(path, "a") as f:
            f.write(
                "\n#OUTPUT_SHARDING_BEGIN\n\n" + "\n".join(lines) + "\n\n#OUTPUT_SHARDING_END\n\n"
            )
