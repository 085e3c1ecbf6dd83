"""torch_xla.distributed.zero_redundancy_optimizer: ZeRO-1 over the replicas of ``launch``.

``ZeroRedundancyOptimizer`` wraps any ``torch.optim.Optimizer`` class. Each replica keeps the full
parameters (the model is unchanged) but the wrapped optimizer sees only this replica's shard of
each: the parameter padded along dim 0 to a multiple of the sharding group's size and cut in that
many pieces. So the optimizer state (momentum, Adam's moments) is 1/N per replica. ``step()``
reduce-scatters the gradients (averaged over the group), clips them by their global norm
(optional), steps the shards, and all-gathers the new shards into the full parameters. The
collectives are graph nodes: the whole step is one program per barrier.

Not implemented, refused with an error: ``use_grad_acc_hook``. Accepted with no effect here:
``pin_layout`` and the ``bucket_cap_mb_*`` sizes (every collective of the step is one program).

Example:
    >>> def _mp_fn(index):
    ...     model = Net().to(xm.xla_device())
    ...     optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    ...     model(x).sum().backward()
    ...     optimizer.step()  # not xm.optimizer_step: step() reduces the gradients itself
    ...     xm.mark_step()
    >>> spmd_torch.launch(_mp_fn)
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim import Optimizer

from spmd_torch import runtime
from spmd_torch.core import xla_model as xm

__all__ = ["ZeroRedundancyOptimizer"]


class ZeroRedundancyOptimizer(Optimizer):
    """ZeRO-1: ``optimizer_class`` steps only this replica's shard of each parameter, so each
    replica keeps 1/N of the optimizer state; the full parameters are all-gathered after each
    step.

    ``param_groups`` (learning rates, schedulers) are this optimizer's and are copied to the
    wrapped one at every step. ``state_dict()`` adds ``base_state`` (this replica's shard of the
    optimizer state), ``shape_info`` and, with ``save_master_weights``, the shards themselves.

    Args:
        params: The parameters (or parameter groups) to optimize, on the xla device.
        optimizer_class: The optimizer run on the shards, e.g. ``torch.optim.SGD``.
        optimizer_dtype: The dtype of the shards and the optimizer state (default float32).
        grad_clipping: Clip the gradients by their global norm before the step.
        max_norm: That norm (default 1.0).
        pin_layout: Accepted; no effect.
        sharding_groups: Replica groups to shard over (default: all replicas, one group).
        grad_norm_groups: Replica groups to sum the gradient norm over as well (e.g. model
            parallel groups).
        lazy_init: Do not shard yet; call :meth:`init_zero` later.
        bucket_cap_mb_all_gather: Accepted; no effect.
        bucket_cap_mb_reduce_scatter: Accepted; no effect.
        use_grad_acc_hook: Not implemented: raises NotImplementedError when True.
        save_master_weights: Save the shards in ``state_dict()``.
        higher_cc_precision: Reduce-scatter gradients in ``optimizer_dtype``.
        **defaults: The wrapped optimizer's arguments (``lr``, ``momentum``...).

    Raises:
        NotImplementedError: ``use_grad_acc_hook``.
        ValueError: This replica is in none of ``sharding_groups``.

    Example:
        >>> optimizer = ZeroRedundancyOptimizer(
        ...     model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, grad_clipping=False)
    """

    def __init__(
        self,
        params: Iterable,
        optimizer_class: type[Optimizer],
        optimizer_dtype: torch.dtype | None = None,
        grad_clipping: bool = True,
        max_norm: float | None = None,
        pin_layout: bool = True,
        sharding_groups: Any = None,
        grad_norm_groups: Any = None,
        lazy_init: bool = False,
        bucket_cap_mb_all_gather: int = 0,
        bucket_cap_mb_reduce_scatter: int = 0,
        use_grad_acc_hook: bool = False,
        save_master_weights: bool = False,
        higher_cc_precision: bool = False,
        **defaults: Any,
    ) -> None:
        if use_grad_acc_hook:
            raise NotImplementedError(
                "ZeroRedundancyOptimizer: use_grad_acc_hook is not implemented in spmd_torch"
            )
        if not save_master_weights:
            logging.warning(
                "Not saving master weights may have accuracy issues when resuming training!"
            )
        super().__init__(params, defaults)
        self.global_world_size = runtime.world_size()
        self.global_rank = runtime.global_ordinal()
        self._sharding_groups = (
            [list(range(self.global_world_size))] if sharding_groups is None else sharding_groups
        )
        self._grad_norm_groups = grad_norm_groups
        self.optimizer_class = optimizer_class
        self.defaults = defaults
        self.optimizer_dtype = optimizer_dtype or torch.float32
        self.grad_clipping = grad_clipping
        self.max_norm = 1.0 if max_norm is None else max_norm
        self.pin_layout = pin_layout
        self.bucket_cap_mb_all_gather = bucket_cap_mb_all_gather
        self.bucket_cap_mb_reduce_scatter = bucket_cap_mb_reduce_scatter
        self.save_master_weights = save_master_weights
        self.higher_cc_precision = higher_cc_precision
        self.use_grad_acc_hook = use_grad_acc_hook
        self._grad_norm: torch.Tensor | None = None
        self.inited = False
        if not lazy_init:
            self.init_zero()

    def init_zero(self) -> None:
        """Shard the parameters and build the wrapped optimizer over the shards (at construction
        unless ``lazy_init``).

        Example:
            >>> optimizer = ZeroRedundancyOptimizer(params, torch.optim.SGD, lazy_init=True, lr=1)
            >>> optimizer.sharding_groups = [[0, 1], [2, 3]]
            >>> optimizer.init_zero()
        """
        self.local_world_size = len(self.sharding_groups[0])
        self.local_rank = next(
            (
                list(g).index(self.global_rank)
                for g in self.sharding_groups
                if self.global_rank in g
            ),
            None,
        )
        if self.local_rank is None:
            raise ValueError(
                f"Current rank {self.global_rank} is missing from the sharding_groups "
                f"{self.sharding_groups}"
            )
        self.base_optimizer = self.optimizer_class(self._shard_parameters(), **self.defaults)
        self._sync_param_groups(self.param_groups, self.base_optimizer.param_groups)
        self.inited = True

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The gradients' global norm at the last step (with ``grad_clipping``)."""
        return self._grad_norm

    @property
    def sharding_groups(self) -> Any:
        """The replica groups the parameters are sharded over (settable before sharding)."""
        return self._sharding_groups

    @sharding_groups.setter
    def sharding_groups(self, groups: Any) -> None:
        if self.inited:
            raise RuntimeError("already inited, cannot change sharding_groups")
        self._sharding_groups = groups

    @staticmethod
    def _sync_param_groups(source: list[dict], target: list[dict]) -> None:
        """Copy every setting but ``params`` from one optimizer's groups to the other's."""
        if len(source) != len(target):
            raise ValueError("Mismatch between number of source and destination parameter groups")
        for src, dst in zip(source, target):
            dst.update({k: v for k, v in src.items() if k != "params"})

    def _pad(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` padded with zeros along dim 0 to a multiple of the group size."""
        pad = -tensor.size(0) % self.local_world_size
        return F.pad(tensor, [0, 0] * (tensor.dim() - 1) + [0, pad]) if pad else tensor

    def _params(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(full parameter, its shard) pairs, group by group."""
        return [
            (param, shard)
            for group, shards in zip(self.param_groups, self.base_optimizer.param_groups)
            for param, shard in zip(group["params"], shards["params"])
        ]

    @torch.no_grad()
    def _shard_parameters(self) -> list[dict]:
        """The wrapped optimizer's groups: this replica's shard of each parameter, cut on the
        host (one program computes the parameters; each replica uploads only its shard)."""
        params = [p for group in self.param_groups for p in group["params"]]
        devices = {p.device for p in params}
        if len(devices) != 1 or next(iter(devices)).type != "xla":
            raise ValueError(
                f"ZeroRedundancyOptimizer: parameters must all be on the xla device, not {devices}"
            )
        self.device = next(iter(devices))
        xm.unlazy(params)
        groups = []
        for group in self.param_groups:
            shards = []
            for param in group["params"]:
                piece = self._pad(param.detach().cpu()).chunk(self.local_world_size)
                data = piece[self.local_rank].to(self.optimizer_dtype)
                shards.append(nn.Parameter(data.to(self.device), param.requires_grad))
            groups.append({**group, "params": shards})
        return groups

    @torch.no_grad()
    def _reduce_gradients(self) -> None:
        """Each shard's gradient: its part of the group's averaged gradient."""
        self._sync_param_groups(self.param_groups, self.base_optimizer.param_groups)
        for param, shard in self._params():
            if param.grad is None:
                continue
            grad = self._pad(param.grad)
            if self.higher_cc_precision:
                grad = grad.to(self.optimizer_dtype)
            shard.grad = xm.reduce_scatter(
                xm.REDUCE_SUM,
                grad,
                scale=1.0 / self.local_world_size,
                scatter_dim=0,
                shard_count=self.local_world_size,
                groups=self.sharding_groups,
                pin_layout=False,
            ).to(self.optimizer_dtype)

    @torch.no_grad()
    def _clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> None:
        """Scale the shards' gradients so that their global 2-norm is at most ``max_norm``."""
        if float(norm_type) != 2.0:
            raise RuntimeError(f"only norm type 2 is supported, getting {norm_type}")
        total = torch.zeros([], dtype=self.optimizer_dtype, device=self.device)
        for _, shard in self._params():
            if shard.grad is not None:
                total = total + (shard.grad * shard.grad).sum()
        total = xm.all_reduce(xm.REDUCE_SUM, total, groups=self.sharding_groups)
        if self._grad_norm_groups is not None:
            total = xm.all_reduce(xm.REDUCE_SUM, total, groups=self._grad_norm_groups)
        self._grad_norm = total.sqrt()
        coefficient = torch.clamp(max_norm / (self._grad_norm + 1e-6), max=1.0)
        for _, shard in self._params():
            if shard.grad is not None:
                shard.grad.mul_(coefficient)

    @torch.no_grad()
    def step(self, closure=None, **kwargs: Any) -> Any:
        """Reduce-scatter the gradients, clip them (``grad_clipping``), step the shards and
        all-gather them into the full parameters.

        Args:
            closure: Recomputes the loss (run with gradients enabled), as for any optimizer.
            **kwargs: Passed to the wrapped optimizer's ``step``.

        Returns:
            The closure's loss, or None.

        Example:
            >>> loss.backward()
            >>> optimizer.step()
            >>> xm.mark_step()
        """
        if not self.inited:
            raise RuntimeError("must call init_zero() first")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._reduce_gradients()
        if self.grad_clipping:
            self._clip_grad_norm(self.max_norm)
        self.base_optimizer.step(**kwargs)
        self.base_optimizer.zero_grad(set_to_none=True)
        self.allgather_weights_and_update_full_parameter()
        self._sync_param_groups(self.base_optimizer.param_groups, self.param_groups)
        return loss

    @torch.no_grad()
    def allgather_weights_and_update_full_parameter(self) -> None:
        """Write every stepped shard back into its full parameter (all-gather, crop the padding)
        for the parameters that have a gradient.

        Example:
            >>> optimizer.allgather_weights_and_update_full_parameter()
        """
        for param, shard in self._params():
            if param.grad is None:
                continue
            gathered = xm.all_gather(
                shard.detach().to(param.dtype), dim=0, groups=self.sharding_groups
            )
            param.copy_(gathered[: param.size(0)])

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the full parameters' gradients (or drop them, with ``set_to_none``); the shards'
        are dropped by each step."""
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """This optimizer's settings, with ``base_state`` (the replica's shard of the optimizer
        state), ``shape_info`` (each parameter's full shape) and, with ``save_master_weights``,
        ``sharded_master_weights``.

        Example:
            >>> xm.save(optimizer.state_dict(), f'opt_{xr.global_ordinal()}.pt', master_only=False)
        """
        state = super().state_dict()
        state["base_state"] = self.base_optimizer.state_dict()["state"]
        state["shape_info"] = self.get_shape_info()
        if self.save_master_weights:
            state["sharded_master_weights"] = {
                index: shard.data for index, (_, shard) in enumerate(self._params())
            }
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of :meth:`state_dict` (this replica's): the settings, the shard of
        the optimizer state and, if saved, the shards, which then replace the full parameters.

        The parameters are sharded again from their current values first.

        Example:
            >>> optimizer.load_state_dict(torch.load(f'opt_{xr.global_ordinal()}.pt'))
        """
        state_dict = copy.deepcopy(state_dict)
        base_state = state_dict.pop("base_state")
        super().load_state_dict(state_dict)
        self.init_zero()
        base = self.base_optimizer.state_dict()
        base["state"] = base_state
        base["param_groups"] = state_dict["param_groups"]
        self.base_optimizer.load_state_dict(base)
        master = state_dict.get("sharded_master_weights")
        if master is None:
            return
        with torch.no_grad():
            indices = [i for group in state_dict["param_groups"] for i in group["params"]]
            for (param, shard), index in zip(self._params(), indices):
                shard.copy_(master[index])
                param.grad = torch.zeros_like(param)  # so that the gather below covers it
        xm.mark_step()
        self.allgather_weights_and_update_full_parameter()
        xm.mark_step()

    def get_shape_info(self) -> dict[int, torch.Size]:
        """Each parameter's full shape, by its index in the state dict.

        Example:
            >>> optimizer.get_shape_info()[0]
            torch.Size([32, 32])
        """
        params = [p for group in self.param_groups for p in group["params"]]
        return {index: param.shape for index, param in enumerate(params)}
