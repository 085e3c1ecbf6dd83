"""Pictures of a sharding: which devices hold which block of a 1-D or 2-D tensor.

As PyTorch/XLA 2.9 (and ``jax.debug.visualize_array_sharding``), a ``rich`` table: printed, and
returned so that it can be printed again, captured or compared with another table.
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType

import torch

from spmd_torch import runtime
from spmd_torch._lazy.tensor import on_xla

from .xla_sharded_tensor import XLAShardedTensor
from .xla_sharding import get_xla_sharding_spec

_TILED = re.compile(r"\{devices=\[([\d,]+)\]([\d,]+)( last_tile_dim_replicate)?\}$")
_MAXIMAL = re.compile(r"\{maximal device=(\d+)\}$")
_RICH_MODULES = (
    "rich.align",
    "rich.box",
    "rich.console",
    "rich.padding",
    "rich.style",
    "rich.table",
)


def visualize_sharding(
    sharding: str,
    use_color: bool = True,
    scale: float = 1.0,
    min_width: int = 9,
    max_width: int = 80,
):
    """Draw a sharding string as a ``rich`` table of device blocks, print it and return it.

    Rows and columns are the tiles of a 2-D tensor (a 1-D tensor's tiles form one row). A cell
    names the device holding its block (``CPU 3``), or the list of devices when the block is
    replicated (``CPU [0, 1]``), as PyTorch/XLA 2.9 draws them.

    Args:
        sharding: A string as :func:`get_xla_sharding_spec` returns it.
        use_color: Draw without grid lines when the console has colors (PyTorch/XLA's choice).
        scale: Accepted for PyTorch/XLA's signature; the table sizes itself to its cells, as
            PyTorch/XLA's does.
        min_width: Accepted for PyTorch/XLA's signature, likewise.
        max_width: The width of the console the table is printed on.

    Returns:
        The ``rich.table.Table``.

    Raises:
        ValueError: ``rich`` is not installed, or ``sharding`` is not a sharding string.

    Example:
        >>> table = visualize_sharding('{devices=[2,2]0,1,2,3}')
        Visualizing {devices=[2,2]0,1,2,3} (showing up to the first two dimensions)
        ┌───────┬───────┐
        │       │       │
        │ CPU 0 │ CPU 1 │
        ...
    """
    rich = _rich()
    print(f"Visualizing {sharding} (showing up to the first two dimensions)")
    console = rich.console.Console(width=max_width)
    plain = not (use_color and console.color_system is not None)
    table = rich.table.Table(
        show_header=False,
        show_lines=plain,
        padding=0,
        highlight=plain,
        pad_edge=False,
        box=rich.box.SQUARE if plain else None,
    )
    kind = runtime.device_type()
    for row in _grid(sharding):
        table.add_row(*(_cell(rich, f"{kind} {devices}") for devices in row))
    console.print(table, end="\n\n")
    return table


def _rich() -> ModuleType:
    """``rich`` with the modules the table needs, or PyTorch/XLA's ValueError without it."""
    try:
        for name in _RICH_MODULES:
            importlib.import_module(name)
    except ImportError as error:
        raise ValueError(
            "`visualize_sharding` requires `rich` to be installed (pip install rich)"
        ) from error
    return importlib.import_module("rich")


def _cell(rich: ModuleType, text: str):
    """One block of the table: its text centred in a padding of one, as PyTorch/XLA's."""
    return rich.padding.Padding(
        rich.align.Align(text, "center", vertical="middle"),
        (1, 1, 1, 1),
        style=rich.style.Style(bgcolor=None, color=None),
    )


def visualize_tensor_sharding(t: torch.Tensor | XLAShardedTensor, **kwargs):
    """Draw how a 1-D or 2-D xla tensor is sharded over the devices; print it and return it.

    Args:
        t: A sharded tensor on the xla device, or an XLAShardedTensor.
        **kwargs: :func:`visualize_sharding`'s options (``use_color``, ``max_width``...).

    Returns:
        The ``rich.table.Table``.

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
    return visualize_sharding(sharding, **kwargs)


def _grid(sharding: str) -> list[list[int | list[int]]]:
    """Rows of cells, each the device holding one tile, or the list of devices holding a
    replicated block (every device for a replicated tensor), as PyTorch/XLA's table names them."""
    if sharding == "{replicated}":
        return [[list(range(runtime.global_runtime_device_count()))]]
    maximal = _MAXIMAL.match(sharding)
    if maximal:
        return [[int(maximal.group(1))]]
    tiled = _TILED.match(sharding)
    if not tiled:
        raise ValueError(f"cannot draw sharding {sharding!r}: not a sharding string")
    dims = [int(d) for d in tiled.group(1).split(",")]
    devices = [int(d) for d in tiled.group(2).split(",")]
    if tiled.group(3):
        replicas = dims.pop()
        devices = [devices[k : k + replicas] for k in range(0, len(devices), replicas)]
    if len(dims) > 2:
        raise ValueError(f"cannot draw sharding {sharding!r}: it tiles {len(dims)} dimensions")
    cols = dims[-1]
    return [devices[r : r + cols] for r in range(0, len(devices), cols)]
