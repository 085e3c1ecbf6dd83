"""Text pictures of a sharding: which devices hold which block of a 1-D or 2-D tensor.

PyTorch/XLA (and ``jax.debug.visualize_array_sharding``) draw with ``rich``; this draws a plain
text table instead, so it needs nothing extra and can be logged or compared in tests.
"""

from __future__ import annotations

import re

import jax
import torch

from spmd_torch import runtime
from spmd_torch._lazy.tensor import on_xla

from .xla_sharded_tensor import XLAShardedTensor
from .xla_sharding import get_xla_sharding_spec

_TILED = re.compile(r"\{devices=\[([\d,]+)\]([\d,]+)( last_tile_dim_replicate)?\}$")
_MAXIMAL = re.compile(r"\{maximal device=(\d+)\}$")
_COLORS = (41, 42, 43, 44, 45, 46, 101, 102, 103, 104, 105, 106)  # ANSI background colors


def visualize_sharding(sharding: str, use_color: bool = False) -> str:
    """Draw a sharding string as a table of device blocks, print it and return it.

    Rows and columns are the tiles of a 2-D tensor (a 1-D tensor's tiles form one row); each
    cell lists the devices holding that block, several when the block is replicated.

    Args:
        sharding: A string as :func:`get_xla_sharding_spec` returns it.
        use_color: Give each block an ANSI background color.

    Returns:
        The table as text.

    Example:
        >>> print(visualize_sharding('{devices=[2,2]0,1,2,3}'), end='')
        +-------+-------+
        | CPU 0 | CPU 1 |
        +-------+-------+
        | CPU 2 | CPU 3 |
        +-------+-------+
    """
    grid = _grid(sharding)
    kind = runtime.device_type()
    cells = [[f"{kind} {','.join(map(str, devices))}" for devices in row] for row in grid]
    width = max(len(text) for row in cells for text in row) + 2
    rule = "+" + "+".join("-" * width for _ in cells[0]) + "+"
    lines = [rule]
    for r, row in enumerate(cells):
        parts = []
        for c, text in enumerate(row):
            cell = text.center(width)
            if use_color:
                color = _COLORS[(r * len(row) + c) % len(_COLORS)]
                cell = f"\033[{color}m{cell}\033[0m"
            parts.append(cell)
        lines += ["|" + "|".join(parts) + "|", rule]
    table = "\n".join(lines) + "\n"
    print(table, end="")
    return table


def visualize_tensor_sharding(t: torch.Tensor | XLAShardedTensor, use_color: bool = False) -> str:
    """Draw how a 1-D or 2-D xla tensor is sharded over the devices; print it and return it.

    Args:
        t: A sharded tensor on the xla device, or an XLAShardedTensor.
        use_color: Give each block an ANSI background color.

    Returns:
        The table as text.

    Example:
        >>> xs.mark_sharding(x, xs.Mesh(np.arange(8), (4, 2)), (0, 1))  # x of shape (8, 8)
        >>> visualize_tensor_sharding(x)  # 4 rows of 2 blocks: CPU 0 | CPU 1, CPU 2 | CPU 3...
    """
    tensor = t.global_tensor if isinstance(t, XLAShardedTensor) else t
    on_xla(tensor, "visualize_tensor_sharding")
    if tensor.dim() > 2:
        raise ValueError(
            f"visualize_tensor_sharding draws 1-D and 2-D tensors, got shape {tuple(tensor.shape)}"
        )
    sharding = get_xla_sharding_spec(tensor)
    if not sharding:
        raise ValueError(
            f"the tensor of shape {tuple(tensor.shape)} has no sharding; mark it with "
            "mark_sharding first"
        )
    return visualize_sharding(sharding, use_color=use_color)


def _grid(sharding: str) -> list[list[list[int]]]:
    """Rows of cells, each cell the devices holding one block."""
    if sharding == "{replicated}":
        return [[list(range(jax.device_count()))]]
    maximal = _MAXIMAL.match(sharding)
    if maximal:
        return [[[int(maximal.group(1))]]]
    tiled = _TILED.match(sharding)
    if not tiled:
        raise ValueError(f"cannot draw sharding {sharding!r}: not a sharding string")
    dims = [int(d) for d in tiled.group(1).split(",")]
    devices = [int(d) for d in tiled.group(2).split(",")]
    replicas = dims.pop() if tiled.group(3) else 1
    if len(dims) > 2:
        raise ValueError(f"cannot draw sharding {sharding!r}: it tiles {len(dims)} dimensions")
    rows, cols = (1, dims[0]) if len(dims) == 1 else (dims[0], dims[1])
    groups = [devices[k * replicas : (k + 1) * replicas] for k in range(rows * cols)]
    return [groups[r * cols : (r + 1) * cols] for r in range(rows)]
