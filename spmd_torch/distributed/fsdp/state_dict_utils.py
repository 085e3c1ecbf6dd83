"""torch_xla.distributed.fsdp.state_dict_utils: the full model state dict from FSDP's shards.

Each replica of an ``XlaFullyShardedDataParallel`` model saves its own ``model.state_dict()``
(the shards, under ``_fsdp_shard...`` keys, and the buffers) with ``model.get_shard_metadata()``.
Consolidation concatenates the replicas' shards in rank order, crops the padding, restores each
parameter's shape, splits flat parameters into the originals and drops FSDP's own levels from the
names: the result loads into the unwrapped module. The file layout is PyTorch/XLA's, so
checkpoints consolidate here whichever of the two wrote them.

Example:
    >>> ckpt = {'model': model.state_dict(), 'shard_metadata': model.get_shard_metadata()}
    >>> xm.save(ckpt, f'/tmp/ckpt_rank-{xr.global_ordinal():08d}.pth', master_only=False)
    >>> # later, anywhere:
    >>> full, path = consolidate_sharded_model_checkpoints('/tmp/ckpt', '_rank-*.pth')
    >>> Net().load_state_dict(full)
"""

from __future__ import annotations

import glob
from collections import OrderedDict

import torch

__all__ = ["consolidate_sharded_model_checkpoints", "consolidate_sharded_state_dicts"]

_SHARD = "_fsdp_shard"
_FLAT = "_fsdp_wrapped_module.flat_param_"
_LEVELS = ("_fsdp_wrapped_module.", "_fpw_module.")


def consolidate_sharded_state_dicts(state_dict_list: list[dict], shard_metadata: dict) -> dict:
    """The full state dict of the unwrapped module, from every replica's FSDP state dict.

    Args:
        state_dict_list: ``model.state_dict()`` of every rank, in rank order.
        shard_metadata: ``model.get_shard_metadata()`` of any rank.

    Returns:
        An ``OrderedDict`` of full tensors, keyed as the unwrapped module's state dict (buffers
        are rank 0's, in their original dtype).

    Raises:
        ValueError: The number of state dicts is not the metadata's world size.

    Example:
        >>> full = consolidate_sharded_state_dicts([ckpt['model'] for ckpt in ckpts],
        ...                                        ckpts[0]['shard_metadata'])
    """
    world_size = shard_metadata["world_size"]
    if len(state_dict_list) != world_size:
        raise ValueError(
            f"consolidate_sharded_state_dicts: {len(state_dict_list)} state dicts for a world of "
            f"{world_size}"
        )
    buffer_info = shard_metadata.get("buffer_info", {})
    full: OrderedDict = OrderedDict()
    for key, value in state_dict_list[0].items():
        parts = key.split(".")
        at = next((i for i, part in enumerate(parts) if part.startswith(_SHARD)), None)
        if at is None:  # a buffer: rank 0's, in its original dtype
            if key in buffer_info:
                value = value.to(buffer_info[key]["_orig_dtype"])
            full[key] = value
            continue
        prefix, name = ".".join(parts[:at]), ".".join(parts[at:])
        info = shard_metadata["shard_info"][prefix][name]
        size = torch.Size(info["_orig_size"])
        joined = torch.cat([state_dict[key] for state_dict in state_dict_list])
        if joined.dim() == 1:  # flattened shards (the usual case)
            joined = joined[: size.numel()].view(size)
        else:  # sharded along dim 0 (shard_param_on_dim_0)
            joined = joined[: size[0]]
        full[f"{prefix}.{info['_orig_name']}" if prefix else info["_orig_name"]] = joined

    flatten_info = shard_metadata["flatten_info"]
    for key in [k for k in full if _FLAT in k]:
        flat = full.pop(key)
        names, shapes, numels = flatten_info[key]
        prefix = key.rpartition(".")[0]
        for name, shape, piece in zip(names, shapes, flat.split(list(numels))):
            full[f"{prefix}.{name}" if prefix else name] = piece.view(shape)

    def original(key: str) -> str:
        for level in _LEVELS:
            key = key.replace(level, "")
        return key

    return OrderedDict((original(k), v) for k, v in full.items())


def consolidate_sharded_model_checkpoints(
    ckpt_prefix: str,
    ckpt_suffix: str = "*.pth",
    save_path: str = "",
    save_model: bool = True,
) -> tuple[dict, str | None]:
    """Rebuild the full model state dict from FSDP checkpoint files, one per rank.

    Each file (``torch.load``-able) is a dict with ``'model'``, the rank's ``model.state_dict()``,
    and ``'shard_metadata'``, its ``model.get_shard_metadata()``.

    Args:
        ckpt_prefix: The files' common beginning; they match ``ckpt_prefix + ckpt_suffix``.
        ckpt_suffix: The rest of the file name pattern (a glob).
        save_path: Where to write the result, ``{'model': full_state_dict}`` (default
            ``ckpt_prefix + '_consolidated.pth'``).
        save_model: Write it (else only return it).

    Returns:
        The full state dict, and the path written (None without ``save_model``).

    Raises:
        FileNotFoundError: No file matches.
        ValueError: Files are missing or extra: their number or ranks do not match the world
            size their metadata records.

    Example:
        >>> full, path = consolidate_sharded_model_checkpoints(
        ...     ckpt_prefix='/tmp/mnist-fsdp/final_ckpt', ckpt_suffix='_rank-*-of-*.pth')
    """
    pattern = ckpt_prefix + ckpt_suffix
    paths = glob.glob(pattern)
    if not paths:
        raise FileNotFoundError(f"Cannot find any files matching {pattern}.")
    print(f"found {len(paths)} checkpoint files in {pattern}")
    loaded = sorted(
        ((torch.load(path, map_location="cpu"), path) for path in paths),
        key=lambda item: item[0]["shard_metadata"]["rank"],
    )
    for rank, (ckpt, path) in enumerate(loaded):
        metadata = ckpt["shard_metadata"]
        if metadata["world_size"] != len(loaded) or metadata["rank"] != rank:
            raise ValueError(
                f"{path} holds rank {metadata['rank']} of {metadata['world_size']}, but "
                f"{len(loaded)} files match {pattern} (expected ranks 0..{len(loaded) - 1}): "
                "are files missing or extra?"
            )
    full = consolidate_sharded_state_dicts(
        [ckpt["model"] for ckpt, _ in loaded], loaded[0][0]["shard_metadata"]
    )
    written = None
    if save_model:
        written = save_path or ckpt_prefix + "_consolidated.pth"
        torch.save({"model": full}, written)
        print(f"saved consolidated model to {written}")
    return full, written
