"""Reduction kernels: fixed member order (so every rank computing the same element gets the same
bits) and fp32 accumulation for fp16/bf16 (rounded once at the end, unlike gloo which rounds at
every hop). The native kernels (:mod:`nxdt.comm.native`) do the same in one vectorised pass over all
operands; the torch code below is their fallback and reference (bit-identical)."""

from __future__ import annotations

from typing import Sequence

import torch

from nxdt.comm import native

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8, torch.float64)
REDUCE_OPS = ("sum", "avg", "min", "max", "prod")
LOW_PRECISION = (torch.float16, torch.bfloat16)


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
    dtype_code(dtype)
    return REDUCE_OPS.index(op) + 1


def _combine_(acc: torch.Tensor, other: torch.Tensor, op: str) -> None:
    if op in ("sum", "avg"):
        acc.add_(other)
    elif op == "min":
        torch.minimum(acc, other, out=acc)
    elif op == "max":
        torch.maximum(acc, other, out=acc)
    else:
        acc.mul_(other)


_BINARY = {"sum": torch.add, "avg": torch.add, "min": torch.minimum, "max": torch.maximum, "prod": torch.mul}


def _native_reduce(out: torch.Tensor, parts: Sequence[torch.Tensor], op: str, divisor: int) -> bool:
    """out = op(parts...) in exactly this order by the native kernel; False when it cannot run here."""
    lib = native.lib
    if lib is None or len(parts) > native.MAX_MEMBERS or not out.is_contiguous() or not out.is_cpu:
        return False
    dtype, count = out.dtype, out.numel()
    for p in parts:
        if p.dtype != dtype or p.numel() != count or not p.is_contiguous():
            return False
    lib.reduce(
        out.data_ptr(), tuple(p.data_ptr() for p in parts), count, DTYPES.index(dtype) + 1, REDUCE_OPS.index(op) + 1, divisor
    )
    return True


def reduce_into(out: torch.Tensor, parts: Sequence[torch.Tensor], op: str, divisor: int) -> None:
    """out = op(parts[0], parts[1], ...) in member order; ``out`` may be one of ``parts`` (then that part
    is the first operand: each element is still reduced by one fixed sequence on the rank that owns it).
    Half types accumulate in fp32 (in-place ops promote without a temporary per part)."""
    if out.numel() == 0:
        return
    if native.lib is not None:
        ordered = parts
        if out.dtype not in LOW_PRECISION:  # the torch path's order: an aliased part first, then the others
            ptr = out.data_ptr()
            alias = next((i for i, p in enumerate(parts) if p.data_ptr() == ptr), -1)
            if alias > 0:
                ordered = [parts[alias]] + [p for i, p in enumerate(parts) if i != alias]
        if _native_reduce(out, ordered, op, divisor):
            return
    if out.dtype in LOW_PRECISION:
        acc = parts[0].float()
        for p in parts[1:]:
            _combine_(acc, p, op)
        if op == "avg":
            acc.div_(divisor)
        out.copy_(acc)
        return
    ptr = out.data_ptr()
    alias = next((i for i, p in enumerate(parts) if p.data_ptr() == ptr), -1)
    rest: Sequence[torch.Tensor]
    if alias >= 0:
        rest = [p for i, p in enumerate(parts) if i != alias]
    elif len(parts) >= 2:
        _BINARY[op](parts[0], parts[1], out=out)
        rest = parts[2:]
    else:
        out.copy_(parts[0])
        rest = []
    for p in rest:
        _combine_(out, p, op)
    if op == "avg":
        out.div_(divisor)


def reduce_in_place(out: torch.Tensor, parts: Sequence[torch.Tensor], own: int, op: str, divisor: int) -> None:
    """out = op(parts[0], parts[1], ...) in member order where ``out`` is ``parts[own]`` itself (a slice owner's or a
    reduce root's own contribution): the bits of ``reduce_into`` over private copies, whichever member ``own`` is, so
    a reduction cut into pieces reduces every element as the whole would (nxdt.parallel.overlap relies on it)."""
    if out.numel() == 0:
        return
    if native.lib is not None and _native_reduce(out, parts, op, divisor):
        return  # blockwise: every operand of an element is read before the element is written
    if own >= 2 and out.dtype not in LOW_PRECISION:  # out is overwritten by parts[0] op parts[1] before it is read
        parts = [out.clone() if i == own else p for i, p in enumerate(parts)]
        reduce_into(out, parts, op, divisor)  # no alias left: member order
        return
    # own 0: out is the first operand; own 1: parts[0] op out, commutative for one operation; half types: reduce_into
    # widens every operand before writing out
    reduce_into(out, parts, op, divisor)


def reduce_own_into(out: torch.Tensor, parts: Sequence[torch.Tensor], own: int, op: str, divisor: int) -> None:
    """Like ``reduce_into(out, parts, ...)`` where ``out`` already holds ``parts[own]``'s values (the
    caller's tensor, whose copy sits in its shm slot): reads ``out`` instead of that part where the
    member order allows, so members 0 and 1 reduce in place (two memory streams per operand, not
    three). Every element still gets the same operation sequence in member order, so the bits equal
    ``reduce_into``'s on every member (elementwise ops do not reassociate)."""
    if out.numel() == 0:
        return
    if native.lib is not None and _native_reduce(out, [out if i == own else p for i, p in enumerate(parts)], op, divisor):
        return  # member order, reading out instead of parts[own]: the same bits (elementwise ops, one order)
    if out.dtype in LOW_PRECISION or len(parts) < 2 or own > 1:
        reduce_into(out, parts, op, divisor)
        return
    if own == 0:
        rest = parts[1:]
    else:
        _BINARY[op](parts[0], out, out=out)
        rest = parts[2:]
    for p in rest:
        _combine_(out, p, op)
    if op == "avg":
        out.div_(divisor)
