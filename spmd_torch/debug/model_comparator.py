"""torch_xla.debug.model_comparator: find where two runs of a model part ways.

Put ``save(name, tensor)`` calls in the model, run it once on the CPU and once on the device with
``configure(folder)`` naming a different folder each time, then ``compare`` the folders: the
report lists, per saved tensor, the elements that differ beyond ``rtol``/``atol``, largest first.

    python -m spmd_torch.debug.model_comparator RUN1 RUN2 --rtol 1e-3   # exits 1 on differences

Each ``save`` writes ``<folder>[/step-N]/<name>.<k>`` (``k`` counts the saves of ``name`` since
``configure`` or the last change of step); only the master ordinal writes. With no folder
configured, ``save`` writes into ``MODELCMP_SAVEDIR`` if set, else does nothing, so the calls may
stay in the model. Unlike PyTorch/XLA's, ``compare`` matches saves in ``step-N`` folders too.

Example:
    >>> mc.configure('/tmp/cpu'); model(x)
    >>> mc.configure('/tmp/xla'); model.to(device)(x.to(device))
    >>> print(mc.compare('/tmp/cpu', '/tmp/xla', rtol=1e-3, atol=1e-3) or 'same')
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
import traceback

import torch

from spmd_torch import config
from spmd_torch._lazy import engine

_SAVED_FILE = re.compile(r".*\.\d+$")


class _Recorder:
    """Where saves go and how many of each name were saved in the current step."""

    def __init__(self, folder: str | None = None) -> None:
        self.folder = folder
        self.step = None
        self.counts: dict[str, int] = {}

    def path_for(self, name: str, step: int | None) -> pathlib.Path:
        root = pathlib.Path(self.folder or config.MODELCMP_SAVEDIR.read())
        if step is not None:
            root = root / f"step-{step}"
            if step != self.step:
                self.step, self.counts = step, {}
        root.mkdir(parents=True, exist_ok=True)
        index = self.counts.get(name, 0)
        self.counts[name] = index + 1
        return root / f"{name}.{index}"


_recorder = _Recorder()


def configure(save_dir: str | None) -> None:
    """Save into ``save_dir`` from now on (None: into ``MODELCMP_SAVEDIR``, or nowhere), the
    counts of each name starting again at 0.

    Example:
        >>> mc.configure('/tmp/run1')
    """
    global _recorder
    _recorder = _Recorder(save_dir)


def save(name: str | None, tensor: torch.Tensor, step: int | None = None) -> torch.Tensor:
    """Write a CPU copy of ``tensor`` as ``name`` (None: the caller's ``file.lLINE``), in the
    ``step-N`` folder when ``step`` is given; returns ``tensor``.

    Example:
        >>> x = mc.save('layer1', F.relu(self.conv1(x)))
    """
    if not (_recorder.folder or config.MODELCMP_SAVEDIR.read()):
        return tensor
    data = tensor.detach().cpu()
    if engine.current().mode.local_ordinal == 0:
        torch.save(data, _recorder.path_for(name or _caller(), step))
    return tensor


def _caller() -> str:
    here = pathlib.Path(__file__).name
    for frame in reversed(traceback.extract_stack(limit=8)[:-1]):
        if pathlib.Path(frame.filename).name != here:
            return f"{pathlib.Path(frame.filename).name}.l{frame.lineno}"
    return "noname"


def compare_tensors(
    tensor1: torch.Tensor,
    tensor2: torch.Tensor,
    rtol: float = 1e-05,
    atol: float = 1e-08,
    max_diffs: int = 25,
) -> str:
    """The elements where ``|a - b| > max(rtol * max(|a|, |b|), atol)``, one line each
    (``[index]: a vs. b<TAB>error=e``), largest error first, at most ``max_diffs``; '' if none.

    Example:
        >>> mc.compare_tensors(torch.tensor([1., 2.]), torch.tensor([1., 2.5]))
        '[1]: 2.0 vs. 2.5\\terror=0.5\\n'
    """
    if tensor1.shape != tensor2.shape:
        return f"Tensors have different shape: {list(tensor1.shape)} vs. {list(tensor2.shape)}\n"
    a, b = tensor1.double().flatten(), tensor2.double().flatten()
    error = (a - b).abs()
    allowed = torch.maximum(torch.maximum(a.abs(), b.abs()) * rtol, torch.tensor(atol))
    differ = (error > allowed).nonzero().flatten()
    order = error[differ].argsort(descending=True, stable=True)[:max_diffs]
    lines = []
    for i in differ[order].tolist():
        index = list(torch.unravel_index(torch.tensor(i), tensor1.shape)) if tensor1.dim() else []
        v1, v2 = tensor1.flatten()[i].item(), tensor2.flatten()[i].item()
        lines.append(f"{[int(k) for k in index]}: {v1} vs. {v2}\terror={error[i].item()}\n")
    if len(differ) > max_diffs:
        lines.append(f"... aborting after {max_diffs} differences\n")
    return "".join(lines)


def tensor_file_compare(
    path1: str, path2: str, rtol: float = 1e-05, atol: float = 1e-08, max_diffs: int = 25
) -> str:
    """``compare_tensors`` of two saved files, headed by the save's name, index and step."""
    report = compare_tensors(
        torch.load(path1), torch.load(path2), rtol=rtol, atol=atol, max_diffs=max_diffs
    )
    if not report:
        return ""
    path = pathlib.Path(path1)
    name, index = path.name.rsplit(".", 1)
    step = re.fullmatch(r"step-(\d+)", path.parent.name)
    at = f" at step={step.group(1)}" if step else ""
    body = "".join(f"  {line}\n" for line in report.split("\n"))
    return f'Changes in saved tensor "{name}" with id={index}{at}\n{body}'


def _saved(folder: str) -> set[str]:
    root = pathlib.Path(folder)
    return {
        str(p.relative_to(root)) for p in root.rglob("*") if _SAVED_FILE.match(p.name)
    }  # fmt: skip


def compare(
    save_dir1: str, save_dir2: str, rtol: float = 1e-05, atol: float = 1e-08, max_diffs: int = 25
) -> str:
    """The differences between two runs' saves ('' if none): each save only one run made, and
    each save whose values differ (see :func:`compare_tensors`).

    Example:
        >>> report = mc.compare('/tmp/cpu', '/tmp/xla', rtol=1e-3, atol=1e-3)
    """
    files1, files2 = _saved(save_dir1), _saved(save_dir2)
    report = [f"Mismatch: {f} not in {save_dir2}\n" for f in sorted(files1 - files2)]
    for f in sorted(files1 & files2):
        report.append(
            tensor_file_compare(
                os.path.join(save_dir1, f), os.path.join(save_dir2, f), rtol, atol, max_diffs
            )
        )
    report += [f"Mismatch: {f} not in {save_dir1}\n" for f in sorted(files2 - files1)]
    return "".join(report)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compare two model_comparator save folders.")
    parser.add_argument("--rtol", type=float, default=1e-05)
    parser.add_argument("--atol", type=float, default=1e-08)
    parser.add_argument("--max_diffs", type=int, default=25)
    parser.add_argument("savedir1", metavar="SAVEDIR1")
    parser.add_argument("savedir2", metavar="SAVEDIR2")
    args = parser.parse_args(argv)
    report = compare(args.savedir1, args.savedir2, args.rtol, args.atol, args.max_diffs)
    if report:
        print(report, file=sys.stderr)
    return 1 if report else 0


if __name__ == "__main__":
    sys.exit(main())
