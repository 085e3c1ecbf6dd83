"""torch_xla.core.functions: collectives that autograd differentiates, and SyncBatchNorm.

``xm.all_reduce`` and ``xm.all_gather`` are not differentiable (their results have no history);
these are, for models that reduce activations across replicas in the forward pass. Inside
``launch`` the backward passes are collectives too, recorded into the same step's program.
:class:`SyncBatchNorm` normalises with the statistics of every replica's batch together.
"""

from __future__ import annotations

import torch

import spmd_torch.core.xla_model as xm
from spmd_torch import runtime

__all__ = ["SyncBatchNorm", "all_gather", "all_reduce"]


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, reduce_type, scale, groups):
        output = xm.all_reduce(reduce_type, value, scale=scale, groups=groups)
        ctx.reduce_type, ctx.scale, ctx.groups = reduce_type, scale, groups
        ctx.save_for_backward(value, output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        value, output = ctx.saved_tensors
        grad = grad_output * ctx.scale
        if ctx.reduce_type == xm.REDUCE_SUM:
            grad = xm.all_reduce(xm.REDUCE_SUM, grad, groups=ctx.groups)
        elif ctx.reduce_type == xm.REDUCE_MUL:  # d(prod)/dx = prod / x
            grad = xm.all_reduce(xm.REDUCE_SUM, grad * output, groups=ctx.groups) / value
        elif ctx.reduce_type in (xm.REDUCE_MIN, xm.REDUCE_MAX):  # to the replicas that won
            grad = xm.all_reduce(xm.REDUCE_SUM, grad, groups=ctx.groups) * (value == output)
        else:
            raise RuntimeError(f"all_reduce: reduce type {ctx.reduce_type!r} has no gradient")
        return grad, None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, dim, groups):
        ctx.dim, ctx.groups = dim, groups
        return xm.all_gather(value, dim=dim, groups=groups)

    @staticmethod
    def backward(ctx, grad_output):
        members = len(ctx.groups[0]) if ctx.groups else runtime.world_size()
        grad = xm.reduce_scatter(
            xm.REDUCE_SUM, grad_output, 1.0, ctx.dim, members, groups=ctx.groups
        )
        return grad, None, None


def all_reduce(
    reduce_type: str, value: torch.Tensor, scale: float = 1.0, groups=None
) -> torch.Tensor:
    """``xm.all_reduce`` of one tensor, differentiable (sum, mul, min and max).

    The gradient of replica k's input is the all-reduced sum of every replica's output gradient
    (times ``scale``; for mul times output / input, for min/max only where k's value won).

    Args:
        reduce_type: ``xm.REDUCE_SUM``, ``REDUCE_MUL``, ``REDUCE_MIN`` or ``REDUCE_MAX``.
        value: The tensor to reduce.
        scale: Multiplies the result.
        groups: Replica groups reducing separately; None: all replicas.

    Example:
        >>> total = xf.all_reduce(xm.REDUCE_SUM, activations)
        >>> total.sum().backward()
    """
    return _AllReduce.apply(value, reduce_type, scale, groups)


def all_gather(value: torch.Tensor, dim: int = 0, groups=None) -> torch.Tensor:
    """``xm.all_gather`` of one tensor, differentiable.

    The gradient of replica k's input is its chunk of the replicas' output gradients summed
    (a reduce-scatter). PyTorch/XLA keeps only replica k's own chunk, which is right only when
    every replica computes the same loss from the gathered tensor.

    Args:
        value: The tensor to gather.
        dim: The dimension to concatenate along.
        groups: Replica groups of one size gathering separately; None: all replicas.

    Example:
        >>> everyone = xf.all_gather(features, dim=0)
    """
    return _AllGather.apply(value, dim, groups)


class SyncBatchNorm(torch.nn.Module):
    """Batch norm over the replicas' batches together: cross-replica statistics for ``launch``.

    In training each replica's per-channel mean and variance come from the union of every
    replica's batch (two differentiable all-reduces), so the output and the gradients are those
    of ``torch.nn.BatchNorm`` over the concatenated global batch; outside ``launch`` (one SPMD
    program, whose batch already is the global one) it is plain batch norm. The running
    statistics are updated with ``momentum`` as BatchNorm does (the running variance unbiased,
    over the global count; PyTorch/XLA's keeps the biased one). In eval mode the running
    statistics normalise. Replicas must have batches of one size.

    Args:
        num_features: The channels (dimension 1 of the input, which has 2 to 5 dimensions).
        eps: Added to the variance.
        momentum: The weight of a step's statistics in the running ones.

    Example:
        >>> def _mp_fn(index):
        ...     norm = xf.SyncBatchNorm(16).to(xm.xla_device())
        ...     y = norm(local_batch)  # normalised with every replica's statistics
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.weight = torch.nn.Parameter(torch.ones(num_features))
        self.bias = torch.nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if not 2 <= batch.dim() <= 5 or batch.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}): expected an input of 2 to 5 dimensions "
                f"with {self.num_features} channels in dimension 1, got shape {tuple(batch.shape)}"
            )
        channels = [1, -1] + [1] * (batch.dim() - 2)
        if self.training:
            dims = [0, *range(2, batch.dim())]
            replicas = runtime.world_size() if xm.is_xla_tensor(batch) else 1
            count = batch.numel() // self.num_features * replicas
            mean = all_reduce(xm.REDUCE_SUM, batch.sum(dims)) / count
            centered = batch - mean.reshape(channels)
            var = all_reduce(xm.REDUCE_SUM, (centered * centered).sum(dims)) / count
            with torch.no_grad():
                unbiased = var * (count / max(count - 1, 1))
                self.running_mean.mul_(1 - self.momentum).add_(mean, alpha=self.momentum)
                self.running_var.mul_(1 - self.momentum).add_(unbiased, alpha=self.momentum)
        else:
            mean, var = self.running_mean, self.running_var
            centered = batch - mean.reshape(channels)
        scale = self.weight * torch.rsqrt(var + self.eps)
        return centered * scale.reshape(channels) + self.bias.reshape(channels)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"
