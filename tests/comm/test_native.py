"""The shm transport's native fast path (nxdt/comm/_native.c) and its torch fallback.

Every op × dtype × group size with exact-sum inputs (small integers: exact in every dtype and any order)
through both paths; random half-precision inputs give bit-identical results on both paths (the native
kernel accumulates in fp32 and rounds once, like the fallback), and a native and a fallback rank reduce together
(the direct and slice algorithms are chosen from the call, not from the extension). The failure tests of test_collectives.py
(timeouts, dead peers, mismatches) run on the native path whenever it is built, which the last test checks.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import sysconfig

import pytest
import torch

from nxdt.comm import CommError, CommMismatchError, CommTimeoutError, PeerDiedError, native
from nxdt.comm.spawn import RankFailed, run_local
from test_collectives import stay_alive_until

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32]
SIZES = [5, 1000, 20_000]  # one element per member and then some; one small step; past the 64 KB direct limit (3+ members slice)
SLICE_SIZE = 20_000  # also all-reduced with algorithm="slice": the native slice step at every group size, 2 members too
needs_native = pytest.mark.skipif(native._built is None, reason="the C extension is not built here")


def _value(size: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    return ((torch.arange(size) % 5) + rank + 1).to(dtype)  # at most 4 * 9: exact in bf16's 8-bit mantissa


def _exact_ops(world, expect_native: bool) -> None:
    assert (native.lib is not None) == expect_native
    comm, n, r = world.world, world.world_size, world.rank
    for dtype in DTYPES:
        for size in SIZES:
            everyone = [_value(size, q, dtype) for q in range(n)]
            total = sum(v.to(torch.int64) for v in everyone).to(dtype)
            t = _value(size, r, dtype)
            comm.all_reduce(t)
            assert torch.equal(t, total), ("all_reduce", dtype, size)
            t = _value(size, r, dtype)
            comm.all_reduce(t, "max")
            assert torch.equal(t, everyone[-1]), ("all_reduce max", dtype, size)
            if size == SLICE_SIZE:
                for op, want in (("sum", total), ("min", everyone[0])):
                    t = _value(size, r, dtype)
                    comm.all_reduce(t, op, algorithm="slice")
                    assert torch.equal(t, want), ("all_reduce slice", op, dtype, size)
            t = _value(size, r, dtype)
            comm.reduce(t, size % n)
            assert torch.equal(t, total if r == size % n else _value(size, r, dtype)), ("reduce", dtype, size)
            out = torch.empty(size, dtype=dtype)
            comm.reduce_scatter(out, torch.cat([_value(size, r, dtype) + q for q in range(n)]))
            assert torch.equal(out, (total.to(torch.int64) + n * r).to(dtype)), ("reduce_scatter", dtype, size)
            gathered = torch.empty(n * size, dtype=dtype)
            comm.all_gather(gathered, _value(size, r, dtype))
            assert torch.equal(gathered, torch.cat(everyone)), ("all_gather", dtype, size)
            t = _value(size, r, dtype)
            comm.broadcast(t, n - 1)
            assert torch.equal(t, everyone[-1]), ("broadcast", dtype, size)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("use_native", [pytest.param(True, marks=needs_native, id="native"), pytest.param(False, id="fallback")])
def test_every_op_and_dtype_is_exact_on_both_paths(world_size, use_native):
    run_local(_exact_ops, world_size, use_native, timeout_s=180, init_options={"native": use_native})


def _random_half(world) -> tuple[str, str]:
    comm, reduced, scattered = world.world, hashlib.sha256(), hashlib.sha256()
    g = torch.Generator().manual_seed(world.rank)
    for dtype in (torch.bfloat16, torch.float16):
        for size in (100, 40_000):  # direct; slice (past 64 KB: 3+ members, and 2 members in fp16/bf16)
            for op in ("sum", "avg", "max", "prod"):
                t = torch.randn(size, generator=g).to(dtype)
                comm.all_reduce(t, op)
                out = torch.empty(size // world.world_size, dtype=dtype)
                comm.reduce_scatter(out, t)
                reduced.update(t.view(torch.uint8).numpy().tobytes())
                scattered.update(out.view(torch.uint8).numpy().tobytes())
    return reduced.hexdigest(), scattered.hexdigest()


@needs_native
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_native_and_fallback_give_identical_bits_on_random_half_inputs(world_size):
    on = run_local(_random_half, world_size, timeout_s=100, init_options={"native": True})
    off = run_local(_random_half, world_size, timeout_s=100, init_options={"native": False})
    assert len({all_reduced for all_reduced, _ in on}) == 1  # identical on every member
    assert on == off  # and the same bits on both paths, member by member


def _member_order(world) -> None:
    """Every reduction adds an element's contributions in member order, whatever slice, chunk or piece it falls in:
    random fp32 inputs (order-sensitive: (a+b)+c differs from (c+a)+b in about a fifth of the elements) reduced whole,
    in pieces at odd offsets, sliced, from shared memory, to each root and scattered all equal one reference sum."""
    comm, n, r = world.world, world.world_size, world.rank
    assert comm.sums_in_member_order("all_reduce", "reduce_scatter", "reduce")
    size = 48_000  # 192 KB: past the 64 KB direct limit (slices, owners 2 and 3 included), several pieces below it
    everyone = [torch.randn(size, generator=torch.Generator().manual_seed(q)) for q in range(n)]
    total = everyone[0] + everyone[1]
    for q in range(2, n):
        total = total + everyone[q]  # member order, one rounding per addition
    avg = total / n
    mine = everyone[r]
    for algorithm in ("auto", "slice", "direct"):
        t = mine.clone()
        comm.all_reduce(t, "avg", algorithm=algorithm)
        assert torch.equal(t, avg), ("whole", algorithm)
    shared = comm.empty(size, torch.float32).copy_(mine)  # peers read it in place (the gradient buckets' buffers)
    comm.all_reduce(shared, "avg")
    assert torch.equal(shared, avg), "shared"
    cuts = [0, 7, 20_001, 20_002, 33_333, size]  # pieces of 7, 20k (slices), 1, 13k and 14k elements
    pieces = [mine[a:b].clone() for a, b in zip(cuts, cuts[1:])]
    works = [comm.all_reduce(p, "avg", stream="dp", async_op=True) for p in pieces]
    for w in works:
        w.wait()
    assert torch.equal(torch.cat(pieces), avg), "pieces"
    for root in range(n):  # ZeRO-1's pieces: each owner's part reduced to it
        t = mine.clone()
        comm.reduce(t, root, "avg")
        if r == root:
            assert torch.equal(t, avg), ("reduce", root)
    per = size // n
    out = torch.empty(per)
    comm.reduce_scatter(out, mine, "avg")
    assert torch.equal(out, avg[r * per : (r + 1) * per]), "reduce_scatter"
    across = world.new_communicator(list(range(n)), "order_p2p", transport="p2p")  # ring / rhd: order by position
    assert not across.sums_in_member_order("all_reduce")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("use_native", [pytest.param(True, marks=needs_native, id="native"), pytest.param(False, id="fallback")])
def test_reductions_add_in_member_order_wherever_an_element_falls(world_size, use_native):
    run_local(_member_order, world_size, timeout_s=180, init_options={"native": use_native})


def _mixed(world) -> str:
    """Rank 1 on the torch fallback, rank 0 native, in one group: the algorithm is chosen from the call alone, so the
    native direct and slice steps meet their Python counterparts (same slots, milestones and operand order)."""
    if world.rank == 1:
        native.use(False)  # before the communicator below opens its channels
    comm, r = world.new_communicator([0, 1], "mixed"), world.rank
    assert (comm._transport.channel("default").native is None) == (r == 1)
    g, digest = torch.Generator().manual_seed(r), hashlib.sha256()
    for dtype, size in ((torch.bfloat16, 100), (torch.bfloat16, 40_000), (torch.float16, 40_000), (torch.float32, 40_000)):
        for op in ("sum", "max"):  # direct; slice (2 members, fp16/bf16 past 64 KB); fp32 direct
            t = _value(size, r, dtype)
            comm.all_reduce(t, op)
            want = _value(size, 0, dtype) + _value(size, 1, dtype) if op == "sum" else _value(size, 1, dtype)
            assert torch.equal(t, want), ("mixed", dtype, size, op)
        x = torch.randn(size, generator=g).to(dtype)
        comm.all_reduce(x, "avg")
        digest.update(x.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@needs_native
@pytest.mark.timeout(60)
def test_a_native_and_a_fallback_rank_reduce_together():
    digests = run_local(_mixed, 2, timeout_s=50)
    assert digests[0] == digests[1]  # each element reduced once, by its slice's owner or by both in member order


def _repeated_calls(world, report: str) -> None:
    """A call shaped like an earlier one skips the Communicator's checks and plan (its cached one-step path):
    results, argument errors, mismatches, timeouts and dead peers must be what the first call would give."""
    comm, r = world.world, world.rank
    for _ in range(3):  # the 2nd and 3rd calls of each shape take the cached path
        t = _value(100, r, torch.bfloat16).view(10, 10)
        comm.all_reduce(t)
        assert torch.equal(t.view(-1), (_value(100, 0, torch.bfloat16) + _value(100, 1, torch.bfloat16))), "2-D, bf16"
        p = torch.nn.Parameter(_value(7, r, torch.float32), requires_grad=False)
        comm.all_reduce(p, "max")
        assert torch.equal(p.data, _value(7, 1, torch.float32)), "a Parameter, max"
    assert len(comm._one_step) == 2  # both shapes took the cached path on the later calls
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(torch.ones(10, 10).t())  # same dtype and numel as a cached shape
    # a mismatch met on the cached path: op differs (rank 0 cached "sum" for this shape)
    with pytest.raises(CommMismatchError):
        comm.all_reduce(_value(100, r, torch.bfloat16), "sum" if r == 0 else "min")
    with pytest.raises(CommError, match="unusable after an earlier failure"):
        comm.all_reduce(_value(100, r, torch.bfloat16))  # the group is broken, cached path or not
    other = world.new_communicator([0, 1], "again")
    for _ in range(2):
        other.all_reduce(torch.ones(4))
    if r == 1:
        stay_alive_until(report + ".timed-out")  # alive, but late: rank 0's cached call times out naming rank 1
    else:
        with pytest.raises(CommTimeoutError, match=r"rank\(s\) \[1\]"):
            other.all_reduce(torch.ones(4))
        open(report + ".timed-out", "w").close()
    third = world.new_communicator([0, 1], "third")
    for _ in range(2):
        third.all_reduce(torch.ones(4))
    if r == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        third.all_reduce(torch.ones(4))
    except PeerDiedError as exc:
        with open(report, "w") as fh:
            fh.write(str(exc))
        raise


@needs_native
@pytest.mark.timeout(90)
def test_repeated_calls_keep_results_and_errors(tmp_path):
    report = tmp_path / "rank0.txt"
    with pytest.raises(RankFailed):
        run_local(_repeated_calls, 2, str(report), timeout_s=60, comm_timeout_s=1.0)
    assert "rank 1" in report.read_text() and "exited" in report.read_text()


def test_the_extension_is_built_where_a_compiler_is():
    """Where ``pip install`` could compile it, it did: a broken build must not silently leave the slow fallback."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    if not (compiler and headers and os.uname().sysname == "Linux"):
        pytest.skip("no C compiler or Python headers here: the torch fallback is expected")
    assert native._built is not None, "nxdt/comm/_native.c was not built: run `pip install -e .` and read its compiler output"
