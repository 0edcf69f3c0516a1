"""Generic collective algorithms, written once against :class:`nxdt.comm.p2p.Links` (so they run over
shm mailboxes on one host, gloo point-to-point across hosts, or a mix).

Each function takes ``members`` (group-local ranks, in algorithm order) and ``i`` (my index in it),
so the same code serves a whole group, a row or column of a 2-D torus, or the leaders of hosts.

* ``ring``: all-reduce = ring reduce-scatter + ring all-gather (bandwidth-optimal, 2(p-1) steps);
* ``rhd``: recursive halving-doubling (Rabenseifner) with the MPICH pre/post step for p not a power
  of two (2·lg p steps: best for small/medium messages);
* ``torus``: 2-D X×Y grid — reduce-scatter along rows, all-reduce along columns, all-gather along rows;
* ``tree``: binomial-tree broadcast and reduce;
* ``pairwise``: all-to-all in p-1 exchange rounds (round k: send to i+k, receive from i-k).

Reductions accumulate in fp32 for fp16/bf16 (the caller passes a float work buffer) and every element
is reduced by exactly one chain, then copied, so all members hold identical bits.
"""

from __future__ import annotations

from typing import Sequence

import torch

from nxdt.comm.p2p import Links
from nxdt.comm.reduce import _combine_

ALL_REDUCE = ("ring", "rhd", "torus")


def bounds(count: int, parts: int) -> list[tuple[int, int]]:
    per = -(-count // parts) if count else 0
    return [(min(count, b * per), min(count, (b + 1) * per)) for b in range(parts)]


def _blk(work: torch.Tensor, bl: list[tuple[int, int]], b: int) -> torch.Tensor:
    lo, hi = bl[b]
    return work[lo:hi]


def ring_reduce_scatter_blocks(
    links: Links, members: Sequence[int], i: int, work: torch.Tensor, bl: list[tuple[int, int]], op: str
) -> None:
    """After this, member ``i`` holds the complete reduction of block ``i`` of ``work``."""
    p = len(members)
    right, left = members[(i + 1) % p], members[(i - 1) % p]
    tmp = torch.empty(max((hi - lo for lo, hi in bl), default=0), dtype=work.dtype)
    for k in range(p - 1):
        s, r = (i - 1 - k) % p, (i - 2 - k) % p
        dst = _blk(work, bl, r)
        incoming = tmp[: dst.numel()]
        links.exchange([(right, _blk(work, bl, s))], [(left, incoming)])
        _combine_(dst, incoming, op)


def ring_all_gather_blocks(links: Links, members: Sequence[int], i: int, work: torch.Tensor, bl: list[tuple[int, int]]) -> None:
    """Member ``i`` holds block ``i``; afterwards everyone holds every block."""
    p = len(members)
    right, left = members[(i + 1) % p], members[(i - 1) % p]
    for k in range(p - 1):
        s, r = (i - k) % p, (i - k - 1) % p
        links.exchange([(right, _blk(work, bl, s))], [(left, _blk(work, bl, r))])


def ring_all_reduce(links: Links, members: Sequence[int], i: int, work: torch.Tensor, op: str, divisor: int) -> None:
    p = len(members)
    if p == 1:
        if op == "avg":
            work.div_(divisor)
        return
    bl = bounds(work.numel(), p)
    ring_reduce_scatter_blocks(links, members, i, work, bl, op)
    if op == "avg":
        _blk(work, bl, i).div_(divisor)
    ring_all_gather_blocks(links, members, i, work, bl)


def rhd_all_reduce(links: Links, members: Sequence[int], i: int, work: torch.Tensor, op: str, divisor: int) -> None:
    p = len(members)
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    # pre-step: fold the first 2·rem members pairwise so a power of two remains
    if i < 2 * rem:
        if i % 2 == 0:
            links.exchange([(members[i + 1], work)], [])
            newrank = -1
        else:
            tmp = torch.empty_like(work)
            links.exchange([], [(members[i - 1], tmp)])
            _combine_(work, tmp, op)
            newrank = i // 2
    else:
        newrank = i - rem

    def real(nr: int) -> int:
        return members[nr * 2 + 1 if nr < rem else nr + rem]

    if newrank >= 0:
        bl = bounds(work.numel(), pof2)

        def region(b0: int, b1: int) -> torch.Tensor:
            return work[bl[b0][0] : bl[b1 - 1][1]] if b1 > b0 else work[:0]

        lo, hi = 0, pof2
        mask = pof2 // 2
        tmp = torch.empty(work.numel(), dtype=work.dtype)
        while mask >= 1:  # recursive halving: reduce-scatter
            mid = (lo + hi) // 2
            keep, give = ((mid, hi), (lo, mid)) if newrank & mask else ((lo, mid), (mid, hi))
            kept = region(*keep)
            incoming = tmp[: kept.numel()]
            links.exchange([(real(newrank ^ mask), region(*give))], [(real(newrank ^ mask), incoming)])
            _combine_(kept, incoming, op)
            lo, hi = keep
            mask //= 2
        if op == "avg":
            region(lo, hi).div_(divisor)
        mask = 1
        while mask < pof2:  # recursive doubling: all-gather
            other = (lo - mask, lo) if newrank & mask else (hi, hi + mask)
            links.exchange([(real(newrank ^ mask), region(lo, hi))], [(real(newrank ^ mask), region(*other))])
            lo, hi = min(lo, other[0]), max(hi, other[1])
            mask *= 2
    elif op == "avg":
        pass  # receives the finished (divided) result below
    if i < 2 * rem:  # post-step: hand the result back to the folded members
        if i % 2 == 1:
            links.exchange([(members[i - 1], work)], [])
        else:
            links.exchange([], [(members[i + 1], work)])


def torus_all_reduce(
    links: Links, members: Sequence[int], i: int, work: torch.Tensor, op: str, divisor: int, grid: tuple[int, int]
) -> None:
    rows, cols = grid
    if rows * cols != len(members):
        raise ValueError(f"torus grid {rows}x{cols} does not match the group size {len(members)}")
    x, y = divmod(i, cols)
    row = [members[x * cols + c] for c in range(cols)]
    col = [members[r * cols + y] for r in range(rows)]
    bl = bounds(work.numel(), cols)
    if cols > 1:
        ring_reduce_scatter_blocks(links, row, y, work, bl, op)
    mine = _blk(work, bl, y)
    ring_all_reduce(links, col, x, mine, "sum" if op == "avg" else op, 1)
    if op == "avg":
        mine.div_(divisor)
    if cols > 1:
        ring_all_gather_blocks(links, row, y, work, bl)


def default_grid(p: int) -> tuple[int, int]:
    r = int(p**0.5)
    while p % r:
        r -= 1
    return r, p // r


def tree_broadcast(links: Links, members: Sequence[int], i: int, t: torch.Tensor, root: int) -> None:
    p = len(members)
    rel = (i - root) % p
    mask = 1
    while mask < p:  # receive from the parent
        if rel & mask:
            links.exchange([], [(members[(i - mask) % p], t)])
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:  # send to the children
        if rel + mask < p:
            links.exchange([(members[(i + mask) % p], t)], [])
        mask >>= 1


def tree_reduce(links: Links, members: Sequence[int], i: int, work: torch.Tensor, root: int, op: str) -> bool:
    """Binomial-tree reduce into ``work``; returns True on the root (which then holds the result)."""
    p = len(members)
    rel = (i - root) % p
    tmp = None
    mask = 1
    while mask < p:
        if rel & mask:
            links.exchange([(members[(i - mask) % p], work)], [])
            return False
        if rel + mask < p:
            if tmp is None:
                tmp = torch.empty_like(work)
            links.exchange([], [(members[(i + mask) % p], tmp)])
            _combine_(work, tmp, op)
        mask <<= 1
    return True


def pairwise_all_to_all(
    links: Links,
    members: Sequence[int],
    i: int,
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
) -> None:
    p = len(members)
    in_off = [sum(in_splits[:j]) for j in range(p)]
    out_off = [sum(out_splits[:j]) for j in range(p)]
    out[out_off[i] : out_off[i] + out_splits[i]].copy_(inp[in_off[i] : in_off[i] + in_splits[i]])
    for k in range(1, p):
        to, frm = (i + k) % p, (i - k) % p
        links.exchange(
            [(members[to], inp[in_off[to] : in_off[to] + in_splits[to]])],
            [(members[frm], out[out_off[frm] : out_off[frm] + out_splits[frm]])],
        )
