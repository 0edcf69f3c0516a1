"""Lightning's collective API (``reduce``, ``all_gather``) answered with nxdt's own collectives over one of the
strategy's communicators."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nxdt.comm import Communicator

# Lightning passes reduce ops as strings or torch ReduceOp members; nxdt.comm takes plain names.
_REDUCE_OP_NAMES = {"mean": "avg", "avg": "avg", "sum": "sum", "max": "max", "min": "min", "prod": "prod", "product": "prod"}


def op_name(reduce_op: Any) -> str:
    """nxdt.comm's name of a Lightning reduce op (None: the mean)."""
    if reduce_op is None:
        return "avg"
    name = str(getattr(reduce_op, "name", reduce_op)).split(".")[-1].lower()
    try:
        return _REDUCE_OP_NAMES[name]
    except KeyError:
        raise ValueError(f"reduce_op {reduce_op!r} is not supported by nxdt; use one of {sorted(_REDUCE_OP_NAMES)}") from None


@torch.no_grad()
def reduce(comm: Communicator, tensor: Tensor, reduce_op: Any) -> Tensor:
    """``tensor`` reduced over ``comm`` in place and returned, as DDPStrategy's ``reduce`` (Lightning's ``_sync_ddp``:
    an all-reduce into the tensor; its logger clones a value before syncing it, and syncs the accumulated batch size
    in place). Float tensors are reduced in float32; an integer mean is the sum in the integer dtype, divided and
    truncated toward zero, as ``_sync_ddp`` does over gloo: ``result.copy_(result / world_size)``."""
    op = op_name(reduce_op)
    if tensor.is_floating_point():
        out = tensor.detach().to(torch.float32, copy=True)
        comm.all_reduce(out.reshape(-1), op=op)
        return tensor.copy_(out)
    out = tensor.detach().clone()
    comm.all_reduce(out.reshape(-1), op="sum" if op == "avg" else op)
    return tensor.copy_(out / comm.size if op == "avg" else out)


def all_gather(comm: Communicator, tensor: Tensor) -> Tensor:
    """Every rank's ``tensor`` stacked along a new first dimension (bools travel as uint8: nxdt.comm moves numbers)."""
    src = tensor.detach().contiguous()
    wire = src.to(torch.uint8) if src.dtype == torch.bool else src
    out = torch.empty((comm.size, *wire.shape), dtype=wire.dtype, device=wire.device)
    comm.all_gather(out.reshape(-1), wire.reshape(-1))
    return out.to(torch.bool) if src.dtype == torch.bool else out
