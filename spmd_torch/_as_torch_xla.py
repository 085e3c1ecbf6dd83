"""spmd_torch under PyTorch/XLA's name: ``import torch_xla`` and every ``torch_xla.X`` module.

Libraries (accelerate, transformers, Lightning, diffusers) switch into their XLA code paths the
moment they can see a ``torch_xla``, so it is opt-in, never a side effect of ``import
spmd_torch``. Two ways in:

- ``pip install ./compat/torch_xla``: a distribution named ``torch_xla``, version
  ``2.9.0+spmdtorch.<version>``, whose package is this module's ``become_torch_xla``;
- ``python -m spmd_torch.run_as_torch_xla script.py args...`` (or ``-m module``): one run, nothing
  installed; ``importlib.metadata`` then answers for ``torch_xla`` too.

``torch_xla.X.Y`` is the very module object ``spmd_torch.X.Y`` (state and ``isinstance`` shared);
``torch_xla`` itself is a module of its own carrying spmd_torch's top-level names and PyTorch/XLA's
version, which libraries compare against (``>= 2.2``).

The seed guides' older names come with it, mapped as docs/migration.md's table says:
``lazy_tensor_core.X.Y`` (PyTorch's lazy-tensor-core prototype, torch_xla's tree with ``lazy`` for
``xla``) is ``spmd_torch.X.Y``, and ``torch_xla_py``'s flat modules (torch_xla before 1.0) are
the modules they became (``torch_xla_py.xla_model`` is ``spmd_torch.core.xla_model``). Neither has
been an installable package for years, so no installed one is looked for.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import sys
import types

import torch

import spmd_torch
from spmd_torch import config
from spmd_torch._lazy.tensor import DEVICE

NAME = "torch_xla"
VERSION = f"2.9.0+spmdtorch.{spmd_torch.__version__}"  # PyTorch/XLA's release, with a local label
OLDER_NAMES = ("lazy_tensor_core", "torch_xla_py")
# torch_xla_py.<module> -> the module it became (torch_xla.core.xla_model...), spmd_torch's.
_TORCH_XLA_PY = {
    "xla_model": "spmd_torch.core.xla_model",
    "data_parallel": "spmd_torch.distributed.legacy_data_parallel",
    "utils": "spmd_torch.utils.utils",
}

# torch_xla.<short name> -> its module: PyTorch/XLA's top level imports them under these names
# (torch_xla/torch_xla.py) and exports them with its functions, so scripts write torch_xla.xm.
_SHORT_NAMES = {
    "xm": "spmd_torch.core.xla_model",
    "xenv": "spmd_torch.core.xla_env_vars",
    "xmp": "spmd_torch.distributed.xla_multiprocessing",
    "xr": "spmd_torch.runtime",
    "xu": "spmd_torch.utils.utils",
}


def _ours(fullname: str) -> str | None:
    """The spmd_torch module a submodule of ``torch_xla`` or an older name stands for, if any."""
    top, _, rest = fullname.partition(".")
    if top in (NAME, "lazy_tensor_core") and rest:
        return f"spmd_torch.{rest}"
    if top == "torch_xla_py":
        return _TORCH_XLA_PY.get(rest)
    return None


class _Aliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torch_xla.X`` as ``spmd_torch.X`` (and ``torch_xla`` itself when not installed),
    the older names' modules as theirs, and PyTorch/XLA's distribution metadata (unless the
    distribution is installed)."""

    metadata = True

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname in (NAME, *OLDER_NAMES):
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        ours = _ours(fullname)
        if ours is None or importlib.util.find_spec(ours) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec) -> types.ModuleType:
        if spec.name in (NAME, *OLDER_NAMES):
            return None  # a module of its own, filled by exec_module
        return importlib.import_module(_ours(spec.name))

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == NAME:
            become_torch_xla(module)
        elif module.__name__ in OLDER_NAMES:
            become_older_name(module)

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        if self.metadata and context.name in (None, NAME, "torch-xla"):
            yield _Distribution()


class _Distribution(importlib.metadata.Distribution):
    """``torch_xla``'s metadata, for a run that installed nothing."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n"
        return None

    def locate_file(self, path):
        return None


_ALIASES = _Aliases()


def become_torch_xla(module: types.ModuleType, installed: bool | None = None) -> None:
    """Make ``module`` PyTorch/XLA's top-level package over spmd_torch, and its submodules
    spmd_torch's; the installed distribution's ``torch_xla/__init__.py`` calls this, and so does
    the package ``run_as_torch_xla`` puts on its child processes' path (``installed=False``)."""
    _find_aliases(module, installed)
    _patch_torch()
    module.__version__ = VERSION
    module.__path__ = []  # a package: torch_xla.X is found by the aliases
    module.__getattr__ = _top_level_name
    module.__dir__ = lambda: sorted(set(dir(spmd_torch)) | {"__version__"})


def _patch_torch() -> None:
    """What ``import torch_xla`` changes in torch, done here only under its name: ``nn.GRU`` is
    the scanned GRU (one step per layer in the program, whatever the sequence's length), and
    ``nn.utils.clip_grad_norm_`` of xla parameters none of which has a gradient gives a zero on
    the xla device (torch's gives a CPU zero). Each keeps torch's own as ``._orig``. And
    ``torch.ops.quantized_decomposed`` (PT2E quantization's ops, which scripts quantizing
    weights for ``XlaQuantizedLinear`` call) is defined, as PyTorch/XLA's import defines it."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (defines the ops)

    from spmd_torch.experimental.gru import GRU

    if getattr(torch.nn.GRU, "_orig", None) is None:
        GRU._orig = torch.nn.GRU
        torch.nn.GRU = GRU
    clip = torch.nn.utils.clip_grad_norm_
    if getattr(clip, "_orig", None) is None:
        torch.nn.utils.clip_grad_norm_ = _clip_grad_norm_on_device(clip)


def _clip_grad_norm_on_device(original):
    @functools.wraps(original)
    def clip_grad_norm_(
        parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None
    ):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        parameters = list(parameters)
        if parameters and all(p.grad is None for p in parameters):
            if parameters[0].device.type == DEVICE.type:
                return torch.zeros((), device=parameters[0].device)
        return original(parameters, max_norm, norm_type, error_if_nonfinite, foreach)

    clip_grad_norm_._orig = original
    return clip_grad_norm_


def become_older_name(module: types.ModuleType, installed: bool | None = None) -> None:
    """Make ``module`` (``lazy_tensor_core`` or ``torch_xla_py``) a package whose modules are
    spmd_torch's; the installed distribution and ``run_as_torch_xla``'s children's path ship one
    of each, calling this as ``become_torch_xla`` is called."""
    _find_aliases(module, installed)
    module.__path__ = []  # a package: its modules are found by the aliases


def _find_aliases(module: types.ModuleType, installed: bool | None) -> None:
    """The aliases first on ``sys.meta_path``; a module of the installed distribution turns off
    the metadata they would answer (the distribution has its own)."""
    if _ALIASES not in sys.meta_path:
        sys.meta_path.insert(0, _ALIASES)
    config.FACE.on = True
    if installed is None:
        installed = bool(getattr(module, "__file__", None))
    if installed:
        _ALIASES.metadata = False


def _top_level_name(name: str):
    """``torch_xla.<name>``: spmd_torch's, or its submodule of that name."""
    if name.startswith("__"):
        raise AttributeError(name)
    if name in _SHORT_NAMES:
        return importlib.import_module(_SHORT_NAMES[name])
    try:
        return getattr(spmd_torch, name)
    except AttributeError:
        pass
    try:
        return importlib.import_module(f"{NAME}.{name}")
    except ImportError:
        raise AttributeError(f"module {NAME!r} has no attribute {name!r}") from None


def enable() -> None:
    """PyTorch/XLA's names for this process only (``spmd_torch.run_as_torch_xla``)."""
    if importlib.util.find_spec(NAME) is not None and NAME not in sys.modules:
        installed = importlib.import_module(NAME)
        if getattr(installed, "__version__", None) != VERSION:
            raise RuntimeError(
                f"a real torch_xla {installed.__version__} is installed; spmd_torch will not "
                "take its name (uninstall it, or import spmd_torch directly)"
            )
    if _ALIASES not in sys.meta_path:
        sys.meta_path.insert(0, _ALIASES)
    config.FACE.on = True
    sys.modules.pop("torch_xla.distributed.spmd", None)  # the DTensor route's stand-in gives way
