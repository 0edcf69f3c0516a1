"""The ``p2p`` transport: collectives for groups spanning hosts, over torch.distributed point-to-point
(gloo on CPU). Ring all-reduce (reduce-scatter + all-gather), ring all-gather and reduce-scatter,
binomial-tree broadcast and reduce, pairwise all-to-all. fp16/bf16 are reduced in fp32 and rounded
once; every element is reduced by exactly one chain, so all ranks hold identical bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nxdt.comm.errors import CommMismatchError, CommTimeoutError
from nxdt.comm.reduce import check_op, reduce_into

if TYPE_CHECKING:
    from nxdt.comm.world import Communicator


def _wait_all(comm: "Communicator", works: list, what: str) -> None:
    try:
        for w in works:
            w.wait()
    except RuntimeError as exc:
        raise CommTimeoutError(f"nxdt.comm: group '{comm.name}' {what} over p2p failed: {str(exc).splitlines()[0]}") from exc


def _exchange(comm: "Communicator", send: torch.Tensor | None, to: int, recv: torch.Tensor | None, frm: int, tag: int, what: str) -> None:
    works = []
    if recv is not None and recv.numel():
        works.append(dist.irecv(recv, comm.ranks[frm], tag=tag))
    if send is not None and send.numel():
        works.append(dist.isend(send.contiguous(), comm.ranks[to], tag=tag))
    _wait_all(comm, works, what)


def _bounds(count: int, n: int, i: int) -> tuple[int, int]:
    per = -(-count // n) if count else 0
    return min(count, i * per), min(count, (i + 1) * per)


def _combine(op: str):
    return {"sum": torch.add, "avg": torch.add, "min": torch.minimum, "max": torch.maximum, "prod": torch.mul}[op]


def all_reduce(comm: "Communicator", t: torch.Tensor, op: str, stream: str) -> None:
    check_op(op, t.dtype)
    n, r, tag = comm.size, comm.rank, comm._tag(stream)
    work = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t.clone()
    fn = _combine(op)
    right, left = (r + 1) % n, (r - 1) % n
    for k in range(n - 1):  # reduce-scatter: after n-1 steps chunk (r+1)%n is complete here
        s0, s1 = _bounds(work.numel(), n, (r - k) % n)
        d0, d1 = _bounds(work.numel(), n, (r - k - 1) % n)
        incoming = torch.empty(d1 - d0, dtype=work.dtype)
        _exchange(comm, work[s0:s1], right, incoming, left, tag, "all_reduce")
        work[d0:d1] = fn(work[d0:d1], incoming)
    if op == "avg":
        work.div_(n)
    for k in range(n - 1):  # all-gather of the completed chunks
        s0, s1 = _bounds(work.numel(), n, (r + 1 - k) % n)
        d0, d1 = _bounds(work.numel(), n, (r - k) % n)
        _exchange(comm, work[s0:s1].clone(), right, work[d0:d1], left, tag, "all_reduce")
    t.copy_(work)


def all_gather(comm: "Communicator", out: torch.Tensor, inp: torch.Tensor, stream: str) -> None:
    n, r, m, tag = comm.size, comm.rank, inp.numel(), comm._tag(stream)
    out[r * m:(r + 1) * m].copy_(inp)
    for k in range(n - 1):
        s, d = (r - k) % n, (r - k - 1) % n
        _exchange(comm, out[s * m:(s + 1) * m].clone(), (r + 1) % n, out[d * m:(d + 1) * m], (r - 1) % n, tag, "all_gather")


def reduce_scatter(comm: "Communicator", out: torch.Tensor, inp: torch.Tensor, op: str, stream: str) -> None:
    check_op(op, inp.dtype)
    n, r, m, tag = comm.size, comm.rank, out.numel(), comm._tag(stream)
    acc = (inp.float() if inp.dtype in (torch.float16, torch.bfloat16) else inp.clone()).view(n, m)
    fn = _combine(op)
    for k in range(n - 1):
        s, d = (r - k - 1) % n, (r - k - 2) % n
        incoming = torch.empty(m, dtype=acc.dtype)
        _exchange(comm, acc[s], (r + 1) % n, incoming, (r - 1) % n, tag, "reduce_scatter")
        acc[d] = fn(acc[d], incoming)
    result = acc[r] / n if op == "avg" else acc[r]
    out.copy_(result)


def broadcast(comm: "Communicator", t: torch.Tensor, root: int, stream: str) -> None:
    n, tag = comm.size, comm._tag(stream)
    rel = (comm.rank - root) % n
    mask = 1
    while mask < n:  # receive from the parent
        if rel & mask:
            _exchange(comm, None, 0, t, (comm.rank - mask) % n, tag, "broadcast")
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:  # send to the children
        if rel + mask < n:
            _exchange(comm, t, (comm.rank + mask) % n, None, 0, tag, "broadcast")
        mask >>= 1


def reduce(comm: "Communicator", t: torch.Tensor, root: int, op: str, stream: str) -> None:
    check_op(op, t.dtype)
    n, tag = comm.size, comm._tag(stream)
    rel = (comm.rank - root) % n
    acc = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t.clone()
    fn = _combine(op)
    mask = 1
    while mask < n:
        if rel & mask:
            _exchange(comm, acc, (comm.rank - mask) % n, None, 0, tag, "reduce")
            break
        if rel + mask < n:
            incoming = torch.empty_like(acc)
            _exchange(comm, None, 0, incoming, (comm.rank + mask) % n, tag, "reduce")
            acc = fn(acc, incoming)
        mask <<= 1
    if comm.rank == root:
        t.copy_(acc / n if op == "avg" else acc)


def all_to_all(comm: "Communicator", out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], stream: str) -> None:
    n, r, tag = comm.size, comm.rank, comm._tag(stream)
    table = torch.zeros(n * 2 * n, dtype=torch.int64)
    all_gather(comm, table, torch.tensor(in_splits + out_splits, dtype=torch.int64), stream)
    rows = table.view(n, 2 * n)
    for s in range(n):
        for d in range(n):
            if rows[s, d] != rows[d, n + s]:
                raise CommMismatchError(f"nxdt.comm: group '{comm.name}' all_to_all: rank {comm.ranks[s]} sends {int(rows[s, d])} elements "
                                        f"to rank {comm.ranks[d]}, which expects {int(rows[d, n + s])}")
    in_off = [sum(in_splits[:i]) for i in range(n)]
    out_off = [sum(out_splits[:i]) for i in range(n)]
    out[out_off[r]:out_off[r] + out_splits[r]].copy_(inp[in_off[r]:in_off[r] + in_splits[r]])
    for k in range(1, n):
        to, frm = (r + k) % n, (r - k) % n
        _exchange(comm, inp[in_off[to]:in_off[to] + in_splits[to]], to, out[out_off[frm]:out_off[frm] + out_splits[frm]], frm, tag, "all_to_all")


def send_recv(comm: "Communicator", t: torch.Tensor, peer: int, sending: bool, stream: str) -> None:
    tag = comm._tag(stream)
    if sending:
        _exchange(comm, t, peer, None, 0, tag, "send")
    else:
        _exchange(comm, None, 0, t, peer, tag, "recv")


def barrier(comm: "Communicator", stream: str) -> None:
    token = torch.zeros(1, dtype=torch.int32)
    all_reduce(comm, token, "sum", stream)
