"""torch_xla.distributed.fsdp.wrap: which submodules FSDP wraps as units of their own.

A policy is called as ``policy(module, recurse, unwrapped_params)``: with ``recurse`` True it says
whether to look inside ``module``, with ``recurse`` False whether to wrap it; ``unwrapped_params``
counts the parameters of ``module`` not yet wrapped. The policies take extra arguments, bound with
``functools.partial``. They are PyTorch/XLA's (and torch FSDP's, whose third argument is named
``nonwrapped_numel``): ``SpmdFullyShardedDataParallel(auto_wrap_policy=...)`` takes them, and
:func:`recursive_wrap` applies one with any wrapper.

Example:
    >>> policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    >>> model = FSDPv2(GPT(), mesh=mesh, auto_wrap_policy=policy)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn

__all__ = [
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "recursive_wrap",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
]


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Wrap every submodule as a unit of its own (and look inside each).

    Example:
        >>> model = FSDPv2(Net(), mesh=mesh, auto_wrap_policy=always_wrap_policy)
    """
    return True


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, unwrapped_params: int, lambda_fn: Callable[[nn.Module], bool]
) -> bool:
    """Look inside every module; wrap those for which ``lambda_fn(module)`` is true.

    Args:
        module: The module asked about.
        recurse: Asked whether to look inside (True) or whether to wrap (False).
        unwrapped_params: Parameters of ``module`` not wrapped yet (unused).
        lambda_fn: Says which modules to wrap.

    Example:
        >>> policy = functools.partial(
        ...     lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear))
    """
    return True if recurse else bool(lambda_fn(module))


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    unwrapped_params: int,
    transformer_layer_cls: set[type[nn.Module]],
) -> bool:
    """Look inside every module; wrap the instances of ``transformer_layer_cls`` (the blocks of
    a transformer), leaving the rest (embeddings, final norm) to the outer unit.

    Args:
        module: The module asked about.
        recurse: Asked whether to look inside (True) or whether to wrap (False).
        unwrapped_params: Parameters of ``module`` not wrapped yet (unused).
        transformer_layer_cls: The layer classes wrapped as units.

    Example:
        >>> policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    """
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    unwrapped_params: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
) -> bool:
    """Wrap modules holding at least ``min_num_params`` parameters not wrapped yet.

    Looks inside a module only when it is that large and not one of ``force_leaf_modules``
    (default ``{nn.MultiheadAttention}``); wraps it when it is that large and not one of
    ``exclude_wrap_modules`` (default ``{nn.ModuleList, nn.ModuleDict}``). The defaults are the
    attributes ``FORCE_LEAF_MODULES`` and ``EXCLUDE_WRAP_MODULES`` of this function.

    Args:
        module: The module asked about.
        recurse: Asked whether to look inside (True) or whether to wrap (False).
        unwrapped_params: Parameters of ``module`` not wrapped yet.
        min_num_params: The size threshold.
        force_leaf_modules: Module types never looked into.
        exclude_wrap_modules: Module types never wrapped.

    Example:
        >>> policy = functools.partial(size_based_auto_wrap_policy, min_num_params=int(1e6))
    """
    if force_leaf_modules is None:
        force_leaf_modules = size_based_auto_wrap_policy.FORCE_LEAF_MODULES
    if exclude_wrap_modules is None:
        exclude_wrap_modules = size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES
    large = unwrapped_params >= min_num_params
    if recurse:
        return large and not isinstance(module, tuple(force_leaf_modules))
    return large and not isinstance(module, tuple(exclude_wrap_modules))


size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}


def recursive_wrap(
    module: nn.Module,
    auto_wrap_policy: Callable[..., bool],
    wrapper_cls: Callable[..., nn.Module],
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    only_wrap_children: bool = False,
    **kwargs: Any,
) -> tuple[nn.Module, int]:
    """Wrap, bottom-up, the submodules of ``module`` the policy picks, with ``wrapper_cls``.

    Children wrapped are replaced in their parent (``setattr``); ``module`` itself is wrapped
    last if the policy picks it for the parameters its children left unwrapped (never with
    ``only_wrap_children``).

    Args:
        module: The module to wrap in.
        auto_wrap_policy: The policy, called with keywords ``module``, ``recurse`` and
            ``unwrapped_params``.
        wrapper_cls: Makes a unit: ``wrapper_cls(submodule, **kwargs)`` (a submodule's
            ``_wrap_overrides`` dict, if any, overrides ``kwargs``).
        ignored_modules: Modules left alone, with everything inside them.
        ignored_params: Parameters not counted.
        only_wrap_children: Do not wrap ``module`` itself.
        **kwargs: Passed to ``wrapper_cls``.

    Returns:
        The (possibly wrapped) module and the number of parameters wrapped.

    Raises:
        ValueError: A submodule is already an instance of ``wrapper_cls``.

    Example:
        >>> model, wrapped = recursive_wrap(model, policy, FSDPv2, set(), set(), mesh=mesh)
    """
    if isinstance(wrapper_cls, type):
        for name, child in module.named_modules():
            if child not in ignored_modules and isinstance(child, wrapper_cls):
                raise ValueError(
                    f"recursive_wrap: submodule {name or '<root>'!r} is already a "
                    f"{wrapper_cls.__name__}"
                )
    num_params = sum(p.numel() for p in module.parameters() if p not in ignored_params)
    if not auto_wrap_policy(module=module, recurse=True, unwrapped_params=num_params):
        return module, 0
    wrapped_params = 0
    for name, child in module.named_children():
        if child in ignored_modules:
            continue
        wrapped_child, child_params = recursive_wrap(
            child, auto_wrap_policy, wrapper_cls, ignored_modules, ignored_params, **kwargs
        )
        if wrapped_child is not child:
            setattr(module, name, wrapped_child)
        wrapped_params += child_params
    remainder = num_params - wrapped_params
    if not only_wrap_children and auto_wrap_policy(
        module=module, recurse=False, unwrapped_params=remainder
    ):
        overrides = getattr(module, "_wrap_overrides", {})
        return wrapper_cls(module, **{**kwargs, **overrides}), num_params
    return module, wrapped_params
