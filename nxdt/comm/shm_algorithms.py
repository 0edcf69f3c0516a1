"""Collectives over a :class:`~nxdt.comm.shm.ShmChannel`, chunk by chunk (one step per chunk).

All-reduce has two algorithms, chosen per chunk by size (same choice on every rank):

* ``direct``: every member reduces the whole chunk from all slots (one synchronisation; best for
  small chunks where latency dominates);
* ``slice``: every member reduces only its slice, publishes it, and copies the others' reduced
  slices out (two synchronisations, each byte reduced once: best for large chunks).

Other ops are one step per chunk: publish, wait for the members, copy out.
"""

from __future__ import annotations

import math

import torch

from nxdt.comm.errors import CommMismatchError
from nxdt.comm.reduce import check_op, dtype_code, reduce_into
from nxdt.comm.shm import ShmChannel

DIRECT_ALL_REDUCE_MAX_BYTES = 128 << 10

OP_ALL_REDUCE, OP_ALL_GATHER, OP_REDUCE_SCATTER, OP_ALL_TO_ALL, OP_BROADCAST, OP_REDUCE, OP_SEND_RECV, OP_BARRIER, OP_A2A_SIZES = range(1, 10)


def _bytes_view(slot: torch.Tensor, dtype: torch.dtype, count: int) -> torch.Tensor:
    return slot[:count * dtype.itemsize].view(dtype)


def _mine(ch: ShmChannel, fp: tuple, desc: str, dtype: torch.dtype, count: int) -> torch.Tensor:
    ch.begin(fp, desc)
    return ch.typed(ch.me, dtype)[:count]


def _slice(count: int, parts: int, index: int) -> tuple[int, int]:
    per = -(-count // parts) if count else 0
    return min(count, index * per), min(count, (index + 1) * per)


def _chunks(count: int, chunk: int):
    if count == 0:
        yield 0, 0
        return
    for start in range(0, count, chunk):
        yield start, min(count, start + chunk)


def all_reduce(ch: ShmChannel, t: torch.Tensor, op: str, algorithm: str = "auto") -> None:
    red = check_op(op, t.dtype)
    n, me = ch.size, ch.me
    elem = t.element_size()
    fp = (OP_ALL_REDUCE + 100 * red, dtype_code(t.dtype), t.numel(), 0)
    for c0, c1 in _chunks(t.numel(), ch.slot_bytes // elem):
        k = c1 - c0
        whole = c0 == 0 and c1 == t.numel()
        dst = t if whole else t[c0:c1]
        mine = _mine(ch, fp, f"all_reduce({op})", t.dtype, k)
        mine.copy_(dst)
        ch.publish()
        ch.wait_published()
        direct = algorithm == "direct" or (algorithm == "auto" and (k * elem <= DIRECT_ALL_REDUCE_MAX_BYTES or n == 2))
        if direct:
            reduce_into(dst, [ch.typed(i, t.dtype)[:k] for i in range(n)], op, n)
        else:
            lo, hi = _slice(k, n, me)
            reduce_into(mine[lo:hi], [ch.typed(i, t.dtype)[lo:hi] for i in range(n)], op, n)
            ch.mark_reduced()
            ch.wait_reduced()
            for i in range(n):
                lo, hi = _slice(k, n, i)
                dst[lo:hi].copy_(ch.typed(i, t.dtype)[lo:hi])
        ch.finish()


def all_gather(ch: ShmChannel, out: torch.Tensor, inp: torch.Tensor) -> None:
    count = inp.numel()
    fp = (OP_ALL_GATHER, dtype_code(inp.dtype), count, 0)
    for c0, c1 in _chunks(count, ch.slot_bytes // inp.element_size()):
        _bytes_view(ch.begin(fp, "all_gather"), inp.dtype, c1 - c0).copy_(inp[c0:c1])
        ch.publish()
        ch.wait_published()
        for i in range(ch.size):
            out[i * count + c0:i * count + c1].copy_(_bytes_view(ch.slot_of(i), inp.dtype, c1 - c0))
        ch.finish()


def reduce_scatter(ch: ShmChannel, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
    red = check_op(op, inp.dtype)
    n, m = ch.size, out.numel()
    rows = inp.view(n, m)
    fp = (OP_REDUCE_SCATTER + 100 * red, dtype_code(inp.dtype), m, 0)
    for c0, c1 in _chunks(m, max(1, ch.slot_bytes // (inp.element_size() * n))):
        k = c1 - c0
        _bytes_view(ch.begin(fp, f"reduce_scatter({op})"), inp.dtype, n * k).view(n, k).copy_(rows[:, c0:c1])
        ch.publish()
        ch.wait_published()
        reduce_into(out[c0:c1], [_bytes_view(ch.slot_of(i), inp.dtype, n * k).view(n, k)[ch.me] for i in range(n)], op, n)
        ch.finish()


def broadcast(ch: ShmChannel, t: torch.Tensor, root: int) -> None:
    fp = (OP_BROADCAST, dtype_code(t.dtype), t.numel(), root)
    for c0, c1 in _chunks(t.numel(), ch.slot_bytes // t.element_size()):
        slot = ch.begin(fp, f"broadcast(root={root})")
        if ch.me == root:
            _bytes_view(slot, t.dtype, c1 - c0).copy_(t[c0:c1])
        ch.publish()
        ch.wait_published()
        if ch.me != root:
            t[c0:c1].copy_(_bytes_view(ch.slot_of(root), t.dtype, c1 - c0))
        ch.finish()


def reduce(ch: ShmChannel, t: torch.Tensor, root: int, op: str) -> None:
    red = check_op(op, t.dtype)
    fp = (OP_REDUCE + 100 * red, dtype_code(t.dtype), t.numel(), root)
    for c0, c1 in _chunks(t.numel(), ch.slot_bytes // t.element_size()):
        _bytes_view(ch.begin(fp, f"reduce({op}, root={root})"), t.dtype, c1 - c0).copy_(t[c0:c1])
        ch.publish()
        ch.wait_published()
        if ch.me == root:
            reduce_into(t[c0:c1], [_bytes_view(ch.slot_of(i), t.dtype, c1 - c0) for i in range(ch.size)], op, ch.size)
        ch.finish()


def barrier(ch: ShmChannel) -> None:
    ch.begin((OP_BARRIER, 0, 0, 0), "barrier")
    ch.publish()
    ch.wait_published()
    ch.finish()


def send_recv(ch: ShmChannel, t: torch.Tensor, sender: int) -> None:
    """Two-member channel: member ``sender`` sends ``t``, the other receives into ``t``."""
    fp = (OP_SEND_RECV, dtype_code(t.dtype), t.numel(), sender)
    for c0, c1 in _chunks(t.numel(), ch.slot_bytes // t.element_size()):
        slot = ch.begin(fp, "send/recv")
        if ch.me == sender:
            _bytes_view(slot, t.dtype, c1 - c0).copy_(t[c0:c1])
        ch.publish()
        ch.wait_published()
        if ch.me != sender:
            t[c0:c1].copy_(_bytes_view(ch.slot_of(sender), t.dtype, c1 - c0))
        ch.finish()


def all_to_all_equal(ch: ShmChannel, out: torch.Tensor, inp: torch.Tensor) -> None:
    """Equal splits: one step per chunk of every destination's block, no split exchange (the
    fingerprint already checks that every rank sends the same count)."""
    n, me = ch.size, ch.me
    per = inp.numel() // n
    blocks_in, blocks_out = inp.view(n, per), out.view(n, per)
    fp = (OP_ALL_TO_ALL, dtype_code(inp.dtype), inp.numel(), 1)
    for c0, c1 in _chunks(per, max(1, ch.slot_bytes // (inp.element_size() * n))):
        k = c1 - c0
        _mine(ch, fp, "all_to_all", inp.dtype, n * k).view(n, k).copy_(blocks_in[:, c0:c1])
        ch.publish()
        ch.wait_published()
        for s in range(n):
            blocks_out[s, c0:c1].copy_(ch.typed(s, inp.dtype)[me * k:(me + 1) * k])
        ch.finish()


def all_to_all(ch: ShmChannel, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
    """Uneven all-to-all (splits in elements). Split vectors are exchanged and checked first, so a
    send count that does not match its receiver's count is a clear error on every rank."""
    n, me = ch.size, ch.me
    sizes = _bytes_view(ch.begin((OP_A2A_SIZES, dtype_code(inp.dtype), n, 0), "all_to_all(sizes)"), torch.int64, 2 * n)
    sizes.copy_(torch.tensor(list(in_splits) + list(out_splits), dtype=torch.int64))
    ch.publish()
    ch.wait_published()
    all_in = [_bytes_view(ch.slot_of(i), torch.int64, 2 * n)[:n].tolist() for i in range(n)]
    all_out = [_bytes_view(ch.slot_of(i), torch.int64, 2 * n)[n:].tolist() for i in range(n)]
    ch.finish()
    for s in range(n):
        for r in range(n):
            if all_in[s][r] != all_out[r][s]:
                raise CommMismatchError(
                    f"nxdt.comm: group '{ch.group}' all_to_all: rank {ch.ranks[s]} sends {all_in[s][r]} elements to rank "
                    f"{ch.ranks[r]}, which expects {all_out[r][s]} — input and output split sizes must agree")
    src_offset = [sum(all_in[s][:me]) for s in range(n)]  # where my part starts in each sender's input
    dst_offset = [sum(out_splits[:s]) for s in range(n)]
    window = ch.slot_bytes // inp.element_size()
    rounds = max(1, math.ceil(max(sum(row) for row in all_in) / window))
    fp = (OP_ALL_TO_ALL, dtype_code(inp.dtype), rounds, 0)
    for r in range(rounds):
        w0 = r * window
        w1 = min(inp.numel(), w0 + window)
        slot = _bytes_view(ch.begin(fp, "all_to_all"), inp.dtype, max(0, w1 - w0))
        if w1 > w0:
            slot.copy_(inp[w0:w1])
        ch.publish()
        ch.wait_published()
        for s in range(n):
            lo = max(w0, src_offset[s])
            hi = min(w0 + window, src_offset[s] + all_in[s][me])
            if hi > lo:
                src = _bytes_view(ch.slot_of(s), inp.dtype, window)[lo - w0:hi - w0]
                out[dst_offset[s] + lo - src_offset[s]:dst_offset[s] + hi - src_offset[s]].copy_(src)
        ch.finish()
