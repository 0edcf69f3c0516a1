"""Reduction kernels: fixed member order (so every rank gets bitwise-identical results) and fp32
accumulation for fp16/bf16 (rounded once at the end, unlike gloo which rounds at every hop)."""

from __future__ import annotations

from typing import Sequence

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8, torch.float64)
REDUCE_OPS = ("sum", "avg", "min", "max", "prod")
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPES.index(dtype) + 1
    except ValueError:
        raise TypeError(f"nxdt.comm does not support dtype {dtype}; use one of {[str(d) for d in DTYPES]}") from None


def check_op(op: str, dtype: torch.dtype) -> int:
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op {op!r} is not supported; use one of {REDUCE_OPS}")
    if op == "avg" and not dtype.is_floating_point:
        raise TypeError(f"reduce op 'avg' needs a floating-point tensor, got {dtype}; use 'sum' and divide")
    return REDUCE_OPS.index(op) + 1


def reduce_into(out: torch.Tensor, parts: Sequence[torch.Tensor], op: str, divisor: int) -> None:
    """out = op(parts[0], parts[1], ...), accumulated in fp32 for half types, in member order."""
    if out.numel() == 0:
        return
    low = out.dtype in _LOW_PRECISION
    if op in ("sum", "avg"):
        if low:
            acc = parts[0].float()
            for p in parts[1:]:
                acc.add_(p.float())
        elif len(parts) >= 2:
            acc = torch.add(parts[0], parts[1], out=out) if not _aliases(out, parts[2:]) else parts[0] + parts[1]
            for p in parts[2:]:
                acc.add_(p)
        else:
            acc = parts[0].clone()
        if op == "avg":
            acc.div_(divisor)
        if acc.data_ptr() != out.data_ptr():
            out.copy_(acc)
        return
    acc = parts[0].float() if low else parts[0].clone()
    fn = {"min": torch.minimum, "max": torch.maximum, "prod": torch.mul}[op]
    for p in parts[1:]:
        acc = fn(acc, p.float() if low else p)
    out.copy_(acc)


def _aliases(out: torch.Tensor, others: Sequence[torch.Tensor]) -> bool:
    return any(o.data_ptr() == out.data_ptr() for o in others)
