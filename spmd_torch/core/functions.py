"""torch_xla.core.functions: collectives that autograd differentiates.

``xm.all_reduce`` and ``xm.all_gather`` are not differentiable (their results have no history);
these are, for models that reduce activations across replicas in the forward pass. Inside
``launch`` the backward passes are collectives too, recorded into the same step's program.
"""

from __future__ import annotations

import torch

import spmd_torch.core.xla_model as xm
from spmd_torch import runtime

__all__ = ["all_gather", "all_reduce"]


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
