"""nxdt.comm correctness: every op × dtype × reduce op × world size 2/3/4 × awkward sizes, with
exact-sum inputs (small integers, exact in every dtype in any order) and bitwise-identical results on
every rank; half types equal the fp32 sum rounded once; uneven all-to-all; and the failure modes
(mismatched calls, a rank that never arrives, a rank killed mid-collective, stale segments).

Each world size runs the whole matrix inside one spawned world, so the file stays fast.
"""

from __future__ import annotations

import glob
import hashlib
import os
import signal
import time

import numpy as np
import pytest
import torch

from nxdt.comm import CommMismatchError, CommTimeoutError, PeerDiedError
from nxdt.comm.shm import MAGIC, remove_stale_segments
from nxdt.comm.spawn import RankFailed, run_local

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]
OPS = ["sum", "avg", "min", "max", "prod"]
SIZES = [0, 1, 7, 1001]  # empty, single, not divisible by any world size here, several chunks of a slice
BIG = (8 << 20) // 4  # 8 MB of fp32: several shm slots


def _pattern(n: int, rank: int, op: str, dtype: torch.dtype) -> torch.Tensor:
    base = torch.arange(n, dtype=torch.int64)
    values = (base % 2) + 1 if op == "prod" else (base % 7) + rank + 1  # products stay tiny; sums stay exact
    return values.to(dtype)


def _expected(n: int, world: int, op: str, dtype: torch.dtype) -> torch.Tensor:
    stack = torch.stack([_pattern(n, r, op, torch.float64) for r in range(world)])
    ref = {
        "sum": stack.sum(0),
        "avg": stack.sum(0) / world,
        "min": stack.min(0).values,
        "max": stack.max(0).values,
        "prod": stack.prod(0),
    }[op]
    return ref.to(dtype)


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _matrix(world) -> str:
    comm, n, r = world.world, world.world_size, world.rank
    results = []
    for dtype in DTYPES:
        for size in SIZES:
            for op in OPS:
                if op == "avg" and not dtype.is_floating_point:
                    with pytest.raises(TypeError, match="avg"):
                        comm.all_reduce(_pattern(size, r, op, dtype), op)
                    continue
                t = _pattern(size, r, op, dtype)
                comm.all_reduce(t, op)
                exp = _expected(size, n, op, dtype)
                assert torch.equal(t, exp), (dtype, size, op, t[:8], exp[:8])
                results.append(t)
                if op == "avg":
                    continue
                # reduce to a root, reduce-scatter of the same pattern
                root = size % n
                t = _pattern(size, r, op, dtype)
                comm.reduce(t, root, op)
                if r == root:
                    assert torch.equal(t, exp), ("reduce", dtype, size, op)
                inp = torch.cat([_pattern(size, r, op, dtype)] * n)
                out = torch.empty(size, dtype=dtype)
                comm.reduce_scatter(out, inp, op)
                assert torch.equal(out, exp), ("reduce_scatter", dtype, size, op)
                results.append(out)
            x = _pattern(size, r, "sum", dtype)
            gathered = torch.empty(size * n, dtype=dtype)
            comm.all_gather(gathered, x)
            assert torch.equal(gathered, torch.cat([_pattern(size, q, "sum", dtype) for q in range(n)])), (
                "all_gather",
                dtype,
                size,
            )
            b = _pattern(size, r, "sum", dtype)
            comm.broadcast(b, n - 1)
            assert torch.equal(b, _pattern(size, n - 1, "sum", dtype)), ("broadcast", dtype, size)
            results += [gathered, b]
        # uneven all-to-all (torch's test pattern): rank q sends q'+1 rows to rank q'
        in_splits, out_splits = [q + 1 for q in range(n)], [r + 1] * n
        inp = (torch.ones(sum(in_splits), 3) * r).to(dtype)
        out = torch.empty(sum(out_splits), 3, dtype=dtype)
        comm.all_to_all(out, inp, out_splits, in_splits)
        assert torch.equal(out, torch.cat([torch.ones(r + 1, 3) * q for q in range(n)]).to(dtype))
        # equal split, and splits with zeros
        eq_in = torch.arange(2 * n, dtype=torch.int64).to(dtype) + r
        eq_out = torch.empty_like(eq_in)
        comm.all_to_all(eq_out, eq_in)
        assert torch.equal(eq_out, torch.stack([torch.arange(2 * r, 2 * r + 2) + q for q in range(n)]).reshape(-1).to(dtype))
        zeros = [0] * n
        comm.all_to_all(torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype), zeros, zeros)
    # large messages: many slots, both all-reduce algorithms, every op family
    big = torch.full((BIG,), float(r + 1))
    comm.all_reduce(big)
    assert torch.all(big == n * (n + 1) / 2)
    big_out = torch.empty(BIG * n // n)
    comm.reduce_scatter(big_out, torch.ones(BIG * n // n * n))
    assert torch.all(big_out == n)
    gathered = torch.empty(BIG // n * n)
    comm.all_gather(gathered, torch.full((BIG // n,), float(r)))
    assert torch.equal(gathered, torch.arange(n, dtype=torch.float32).repeat_interleave(BIG // n))
    bb = torch.full((BIG,), float(r))
    comm.broadcast(bb, 0)
    assert torch.all(bb == 0)
    a2a = torch.full((BIG // n * n,), float(r))
    a2a_out = torch.empty_like(a2a)
    comm.all_to_all(a2a_out, a2a)
    assert torch.equal(a2a_out, torch.arange(n, dtype=torch.float32).repeat_interleave(BIG // n))
    # above the direct threshold: the slice all-reduce (3+ ranks; reduces each peer as it arrives)
    # and the in-place direct one (members 0/1 reduce into their own tensor), forced both ways
    mid = 40_000  # 80-320 KB: one slot, past DIRECT_ALL_REDUCE_MAX_BYTES
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        for op in OPS:
            if op == "avg" and not dtype.is_floating_point:
                continue
            exp = _expected(mid, n, op, dtype)
            for algorithm in ("auto", "slice", "direct"):
                t = _pattern(mid, r, op, dtype)
                comm.all_reduce(t, op, algorithm=algorithm)
                assert torch.equal(t, exp), ("all_reduce", algorithm, dtype, op)
                results.append(t)
    # send/recv around a ring, bf16 and int64
    for dtype in (torch.bfloat16, torch.int64):
        msg = torch.arange(1000).to(dtype) + r
        got = torch.empty_like(msg)
        if r % 2 == 0:
            comm.send(msg, (r + 1) % n)
            comm.recv(got, (r - 1) % n)
        else:
            comm.recv(got, (r - 1) % n)
            comm.send(msg, (r + 1) % n)
        assert torch.equal(got, torch.arange(1000).to(dtype) + (r - 1) % n)
    comm.barrier()
    return _digest(results)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_op_dtype_and_size_is_exact_and_identical_on_every_rank(world_size):
    digests = run_local(_matrix, world_size, timeout_s=200)
    assert len(set(digests)) == 1  # bitwise-identical results on every rank


def _half_precision(world) -> None:
    g = torch.Generator().manual_seed(world.rank)
    for dtype in (torch.bfloat16, torch.float16):
        for size in (100, 70_000):  # the direct and the slice all-reduce algorithms
            x = torch.randn(size, generator=g).to(dtype)
            inputs = torch.zeros(world.world_size, size, dtype=dtype)
            world.world.all_gather(inputs.view(-1), x)
            want = inputs.float().sum(0).to(dtype)  # fp32 accumulate, rounded once
            world.world.all_reduce(x)
            assert torch.equal(x, want), (dtype, size, (x.float() - want.float()).abs().max())


@pytest.mark.timeout(120)
def test_half_precision_sums_are_the_fp32_sum_rounded_once():
    run_local(_half_precision, 4, timeout_s=100)


def _mismatch(world) -> str:
    t = torch.ones(10 if world.rank == 0 else 20)
    with pytest.raises(CommMismatchError) as info:
        world.world.all_reduce(t)
    return str(info.value)


@pytest.mark.timeout(60)
def test_mismatched_counts_fail_clearly_on_every_rank():
    messages = run_local(_mismatch, 2, timeout_s=40)
    for msg in messages:
        assert "count=10" in msg and "count=20" in msg and "rank 0" in msg and "rank 1" in msg


def stay_alive_until(marker: str, limit_s: float = 50.0) -> None:
    """A rank that is alive but never calls the collective its peer waits in, until the peer has written ``marker``
    (after its timeout). A fixed sleep waited its full length after the peer's 1 s timeout (3 s a run), and on a
    loaded host could end before the peer's wait did: the peer then saw an exit instead of a timeout."""
    deadline = time.monotonic() + limit_s
    while not os.path.exists(marker):
        assert time.monotonic() < deadline, f"the peer never wrote {marker}"
        time.sleep(0.01)


def _absent(world, marker: str) -> str:
    if world.rank == 1:
        stay_alive_until(marker)  # alive, but never calls the collective
        return ""
    start = time.monotonic()
    with pytest.raises(CommTimeoutError) as info:
        world.world.all_reduce(torch.ones(4))
    assert time.monotonic() - start < 2.5
    open(marker, "w").close()
    return str(info.value)


@pytest.mark.timeout(60)
def test_a_rank_that_never_arrives_is_named_after_the_timeout(tmp_path):
    message = run_local(_absent, 2, str(tmp_path / "timed-out"), timeout_s=40, comm_timeout_s=1.0)[0]
    assert "rank(s) [1]" in message and "all_reduce" in message and "world" in message


def _killed(world, report: str) -> None:
    if world.rank == 1:
        world.world.all_reduce(torch.ones(4))  # one good op, then die mid-way through the next
        os.kill(os.getpid(), signal.SIGKILL)
    world.world.all_reduce(torch.ones(4))
    start = time.monotonic()
    try:
        world.world.all_reduce(torch.ones(1 << 20))
    except PeerDiedError as exc:
        with open(report, "w") as fh:
            fh.write(f"{time.monotonic() - start:.3f} {world.run_id} {exc}")
        raise


@pytest.mark.timeout(90)
def test_a_killed_rank_fails_the_others_fast_and_leaves_no_segments(tmp_path):
    report = tmp_path / "rank0.txt"
    with pytest.raises(RankFailed):
        run_local(_killed, 3, str(report), timeout_s=60, comm_timeout_s=30.0)
    elapsed, run_id, message = report.read_text().split(" ", 2)
    assert float(elapsed) < 10 and "rank 1" in message and "exited" in message
    assert glob.glob(f"/dev/shm/nxdt-{run_id}-*") == []  # this run's segments (other jobs may share the host)


def _concurrent(world) -> None:
    r = world.rank
    a = world.new_communicator([0, 1, 2], "a")
    b = world.new_communicator([1, 2, 3], "b")
    works = []
    for i in range(20):
        issue = [("s1", a), ("s2", b)] if r % 2 == 0 else [("s2", b), ("s1", a)]
        for stream, comm in issue:
            if comm is not None:
                t = torch.full((5000,), float(i + r))
                works.append((comm.all_reduce(t, stream=stream, async_op=True), t, comm, i))
    for work, t, comm, i in works:
        work.wait()
        assert torch.all(t == sum(i + q for q in comm.ranks))


@pytest.mark.timeout(90)
def test_overlapping_groups_on_two_streams_with_different_issue_orders_do_not_deadlock():
    run_local(_concurrent, 4, timeout_s=60, comm_timeout_s=30.0)


def _token_chain(world) -> None:
    """after=: a chain of gathers on one stream, each waiting for the previous one's token."""
    comm = world.world
    outs, prev = [], None
    for i in range(6):
        out = torch.empty(world.world_size * 3)
        prev = comm.all_gather(out, torch.full((3,), float(10 * i + world.rank)), stream="fsdp", async_op=True, after=prev)
        outs.append((prev, out, i))
    for work, out, i in outs:
        work.wait()
        assert work.is_completed()
        assert out.view(world.world_size, 3)[:, 0].tolist() == [10 * i + q for q in range(world.world_size)]


@pytest.mark.timeout(60)
def test_async_ops_chained_by_tokens():
    run_local(_token_chain, 2, timeout_s=40)


def _loaded_before_the_optimizer(world) -> list[bool]:
    import sys

    before = ["torch._dynamo" in sys.modules, "sympy" in sys.modules]
    torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]).step()  # Optimizer.__init__/step import torch._dynamo
    return before


def test_ranks_are_forked_with_torch_dynamo_already_imported():
    """Every optimizer's first call imports torch._dynamo (sympy, torch.fx; ≈ 2.5 CPU-s); the fork server imports it
    once, so a rank that builds an optimizer does not pay that again (it was most of a tiny model's test run)."""
    assert run_local(_loaded_before_the_optimizer, 1, timeout_s=40) == [[True, True]]


def _frozen_objects(world) -> int:
    import gc

    return gc.get_freeze_count()


def test_ranks_are_forked_from_a_frozen_heap():
    """The fork server freezes what it imported (nxdt.comm.frozen), so a rank's garbage collections skip the objects it
    shares with the server instead of writing to them page by page (copy-on-write of torch's whole heap per rank)."""
    frozen = run_local(_frozen_objects, 2, timeout_s=40)
    # torch's and nxdt.comm's objects (~285,000 measured); a rank's own objects are not frozen, so both ranks see the
    # server's count
    assert frozen[0] == frozen[1] > 100_000, frozen


def _across_hosts(world) -> str:
    assert world.world.transport == "p2p"
    return _matrix(world)


@pytest.mark.timeout(240)
def test_groups_spanning_hosts_use_p2p_and_are_exact():
    digests = run_local(_across_hosts, 3, timeout_s=200, host_ids=["hostA", "hostA", "hostB"])
    assert len(set(digests)) == 1


def test_stale_segments_of_dead_processes_are_removed(tmp_path):
    path = "/dev/shm/nxdt-stale-test-r0"
    dead_pid = 2**22 + 12345  # above the default pid_max: never a live process
    with open(path, "wb") as fh:
        fh.write(np.array([MAGIC, dead_pid], dtype=np.int64).tobytes() + bytes(64))
    live = "/dev/shm/nxdt-live-test-r0"
    with open(live, "wb") as fh:
        fh.write(np.array([MAGIC, os.getpid()], dtype=np.int64).tobytes() + bytes(64))
    try:
        remove_stale_segments()
        assert not os.path.exists(path) and os.path.exists(live)
    finally:
        for p in (path, live):
            if os.path.exists(p):
                os.unlink(p)


def test_an_exited_but_unreaped_peer_counts_as_dead():
    """The elastic agent reaps a failed job's workers one at a time; a rank waiting for a zombie peer must
    fail at once, not when the agent's 30 s SIGKILL reaches it (a restart then took 33 s instead of 4)."""
    import subprocess

    from nxdt.comm.waiting import pid_alive

    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while pid_alive(child.pid) and time.monotonic() < deadline:  # exits almost at once; stays a zombie until wait()
        time.sleep(0.01)
    assert not pid_alive(child.pid) and child.poll() == 0  # dead before it was reaped
    assert pid_alive(os.getpid())
