"""BatchNorm whose batch statistics are those of the global batch over data parallelism, on CPU.

``Trainer(sync_batchnorm=True)`` asks for ``torch.nn.SyncBatchNorm``, which refuses CPU tensors in torch 2.13
("SyncBatchNorm expected input tensor to be on GPU or XPU", ``torch/nn/modules/batchnorm.py``), so DDPStrategy on
CPU cannot train with it. :class:`SyncBatchNorm` computes what torch's computes — normalisation by the mean and
(biased) variance of the inputs of every rank of the group, running statistics updated with the unbiased variance of
that global batch (torch's ``sync_batch_norm``: ``batch_norm_gather_stats_with_counts``) — with nxdt's all-reduce:
the per-channel sums, then the per-channel sums of squared deviations from the global mean (two passes: no
cancellation of ``E[x²] - E[x]²``). Each all-reduce is differentiable (its backward all-reduces the gradient, as
torch's backward reduces ``sum_dy`` and ``sum_dy_xmu``), so the gradients are those of the global batch's
normalisation. In eval mode, or on a one-rank group, it is the ordinary BatchNorm.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from nxdt.comm import Communicator


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the gradient of every rank's copy of the sum flows back to every rank's input."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, comm: Communicator) -> Tensor:
        ctx.comm = comm
        out = t.detach().clone()
        comm.all_reduce(out.reshape(-1), op="sum")
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        out = grad.detach().clone().contiguous()
        ctx.comm.all_reduce(out.reshape(-1), op="sum")
        return out, None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """``torch.nn.SyncBatchNorm`` over an nxdt communicator (inputs ``[N, C, *]``)."""

    def __init__(self, num_features: int, comm: Communicator, **kwargs: Any) -> None:
        super().__init__(num_features, **kwargs)
        self.comm = comm

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training or self.comm.size == 1:
            return super().forward(input)
        dims = [0, *range(2, input.dim())]  # every dimension but the channels
        shape = [1, -1] + [1] * (input.dim() - 2)
        x = input.float()
        count = torch.tensor([x.numel() // x.shape[1]], dtype=torch.float64)
        self.comm.all_reduce(count, op="sum")
        n = int(count.item())
        mean = _AllReduceSum.apply(x.sum(dims), self.comm) / n
        centred = x - mean.reshape(shape)
        var = _AllReduceSum.apply(centred.square().sum(dims), self.comm) / n
        out = centred * torch.rsqrt(var + self.eps).reshape(shape)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                assert self.num_batches_tracked is not None
                self.num_batches_tracked.add_(1)
                factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), factor)
                unbiased = var.detach() * (n / max(n - 1, 1))
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        return out.to(input.dtype)


def convert_sync_batchnorm(module: nn.Module, comm: Communicator) -> nn.Module:
    """``module`` with every BatchNorm (and torch SyncBatchNorm) replaced by :class:`SyncBatchNorm` over ``comm``,
    sharing its parameters and buffers (as ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` does)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
        synced = SyncBatchNorm(
            module.num_features,
            comm,
            eps=module.eps,
            momentum=module.momentum,
            affine=module.affine,
            track_running_stats=module.track_running_stats,
        )
        _share_state(module, synced)
        synced.original_class = type(module)  # what revert_sync_batchnorm makes it again
        return synced
    for name, child in module.named_children():
        converted = convert_sync_batchnorm(child, comm)
        if converted is not child:
            setattr(module, name, converted)
    return module


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """:func:`convert_sync_batchnorm` undone: each :class:`SyncBatchNorm` back to the class it replaced."""
    if isinstance(module, SyncBatchNorm):
        cls = getattr(module, "original_class", nn.BatchNorm1d)
        if cls is nn.SyncBatchNorm:
            plain: nn.Module = nn.SyncBatchNorm(
                module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
            )
        else:
            plain = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
        _share_state(module, plain)
        return plain
    for name, child in module.named_children():
        reverted = revert_sync_batchnorm(child)
        if reverted is not child:
            setattr(module, name, reverted)
    return module


def _share_state(src: nn.Module, dst: nn.Module) -> None:
    """``dst`` takes ``src``'s parameters and buffers themselves (the optimizer keeps holding the same tensors)."""
    with torch.no_grad():
        if getattr(src, "affine", False):
            dst.weight = src.weight
            dst.bias = src.bias
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(dst, name, getattr(src, name))
    dst.train(src.training)
    if hasattr(src, "qconfig"):
        dst.qconfig = src.qconfig
