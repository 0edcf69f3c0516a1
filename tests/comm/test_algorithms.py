"""The generic algorithms (ring, rhd, torus, tree, pairwise, hierarchical) selected by name, over shm
mailboxes on one host and over mixed shm + gloo links across (pretend) hosts; plus the point-to-point
mailboxes themselves. Exact-sum inputs, bitwise-identical results on every rank, p = 3 and 4 (rhd's
non-power-of-two fold), each world size batched into one spawned world."""

from __future__ import annotations

import hashlib

import pytest
import torch

from nxdt.comm import CommMismatchError
from nxdt.comm.spawn import run_local

SIZES = [0, 1, 7, 1001, 300_001]  # 300_001 fp32 > one mailbox slot: several chunks per message


def _pattern(n: int, rank: int, op: str, dtype: torch.dtype) -> torch.Tensor:
    base = torch.arange(n, dtype=torch.int64)
    values = (base % 2) + 1 if op == "prod" else (base % 7) + rank + 1
    return values.to(dtype)


def _expected(n: int, ranks: list[int], op: str, dtype: torch.dtype) -> torch.Tensor:
    stack = torch.stack([_pattern(n, r, op, torch.float64) for r in ranks])
    ref = {
        "sum": stack.sum(0),
        "avg": stack.sum(0) / len(ranks),
        "min": stack.min(0).values,
        "max": stack.max(0).values,
        "prod": stack.prod(0),
    }[op]
    return ref.to(dtype)


def _check_comm(comm, algorithms: list[str]) -> list[torch.Tensor]:
    r, ranks, n = comm.rank, list(range(comm.size)), comm.size
    kept = []
    for algorithm in algorithms:
        for dtype, ops in (
            (torch.float32, ["sum", "avg", "max"]),
            (torch.bfloat16, ["sum", "avg"]),
            (torch.int64, ["sum", "min", "prod"]),
        ):
            for size in SIZES:
                if size > 2000 and dtype != torch.float32:
                    continue
                for op in ops:
                    t = _pattern(size, r, op, dtype)
                    comm.all_reduce(t, op, algorithm=algorithm)
                    assert torch.equal(t, _expected(size, ranks, op, dtype)), (algorithm, dtype, size, op, t[:6])
                    kept.append(t)
    for size in (0, 5, 1001):
        x = _pattern(size, r, "sum", torch.float32)
        out = torch.empty(size * n)
        comm.all_gather(out, x, algorithm="ring")
        assert torch.equal(out, torch.cat([_pattern(size, q, "sum", torch.float32) for q in ranks])), ("ring all_gather", size)
        rs_out = torch.empty(size, dtype=torch.bfloat16)
        comm.reduce_scatter(rs_out, torch.cat([_pattern(size, r, "sum", torch.bfloat16)] * n), algorithm="ring")
        assert torch.equal(rs_out, _expected(size, ranks, "sum", torch.bfloat16)), ("ring reduce_scatter", size)
        for root in range(n):
            b = _pattern(size, r, "sum", torch.int32)
            comm.broadcast(b, root, algorithm="tree")
            assert torch.equal(b, _pattern(size, root, "sum", torch.int32)), ("tree broadcast", size, root)
            red = _pattern(size, r, "sum", torch.float16)
            comm.reduce(red, root, "sum", algorithm="tree")
            if r == root:
                assert torch.equal(red, _expected(size, ranks, "sum", torch.float16)), ("tree reduce", size, root)
        kept += [out, rs_out]
    in_splits, out_splits = [q + 1 for q in ranks], [r + 1] * n
    inp = torch.ones(sum(in_splits), 3) * r
    out = torch.empty(sum(out_splits), 3)
    comm.all_to_all(out, inp, out_splits, in_splits, algorithm="pairwise")
    assert torch.equal(out, torch.cat([torch.ones(r + 1, 3) * q for q in ranks])), "pairwise all_to_all"
    return kept


def _point_to_point(comm) -> None:
    r, n = comm.rank, comm.size
    # small sends complete without the receiver (mailbox slots): everyone sends first, then receives
    msg = torch.arange(10, dtype=torch.float32) + r
    got = torch.empty(10)
    comm.send(msg, (r + 1) % n)
    comm.recv(got, (r - 1) % n)
    assert torch.equal(got, torch.arange(10, dtype=torch.float32) + (r - 1) % n)
    # a large ring shift needs send and receive at once
    big = torch.full((3 << 20,), float(r), dtype=torch.float32)
    into = torch.empty_like(big)
    comm.send_recv(big, (r + 1) % n, into, (r - 1) % n)
    assert torch.all(into == (r - 1) % n)
    # FIFO per peer and stream, async on a named stream (two messages fit the mailbox's two slots; a
    # third would wait for the receiver, whose recv is queued behind its own sends on this stream)
    works = [comm.send(torch.full((3,), float(i)), (r + 1) % n, stream="pp", async_op=True) for i in range(2)]
    for i in range(2):
        t = torch.empty(3)
        comm.recv(t, (r - 1) % n, stream="pp")
        assert torch.all(t == i)
    for w in works:
        w.wait()


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _single_host(world) -> tuple[str, str]:
    three = world.new_communicator([0, 1, 2], "three")
    kept4 = _check_comm(world.world, ["ring", "rhd", "torus", "torus:2x2", "torus:1x4", "direct", "slice"])
    _point_to_point(world.world)
    d3 = ""
    if three is not None:
        d3 = _digest(_check_comm(three, ["ring", "rhd", "torus:3x1"]))
        _point_to_point(three)
    return _digest(kept4), d3


@pytest.mark.timeout(150)
def test_generic_algorithms_on_one_host_are_exact_for_3_and_4_ranks():
    results = run_local(_single_host, 4, timeout_s=140)
    assert len({d for d, _ in results}) == 1
    assert len({d for d, _ in results[:3]} | set()) == 1 and len({d3 for _, d3 in results[:3]}) == 1


def _two_hosts(world) -> tuple[str, str]:
    assert world.world.transport == "p2p"
    three = world.new_communicator([0, 1, 2], "three")  # hosts A, A, B: uneven host groups
    kept = _check_comm(world.world, ["auto", "hierarchical", "ring", "rhd", "torus:2x2"])
    _point_to_point(world.world)
    d3 = _digest(_check_comm(three, ["auto", "ring"])) if three is not None else ""
    return _digest(kept), d3


@pytest.mark.timeout(200)
def test_hierarchical_and_routed_links_across_hosts_are_exact():
    results = run_local(_two_hosts, 4, timeout_s=190, host_ids=["hostA", "hostA", "hostB", "hostB"])
    assert len({d for d, _ in results}) == 1 and len({d3 for _, d3 in results[:3]}) == 1


def _mismatched_recv(world) -> str:
    if world.rank == 0:
        world.world.send(torch.ones(10), 1)
        return ""
    with pytest.raises(CommMismatchError) as info:
        world.world.recv(torch.empty(12), 0)
    return str(info.value)


@pytest.mark.timeout(60)
def test_send_and_recv_of_different_counts_fail_clearly():
    msg = run_local(_mismatched_recv, 2, timeout_s=50)[1]
    assert "count=10" in msg and "count=12" in msg and "rank 0" in msg
