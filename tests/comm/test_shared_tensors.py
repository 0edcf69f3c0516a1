"""Zero-copy collectives on shared tensors (``World.shared_empty``, nxdt.comm.heap).

Peers read a shared tensor in place instead of through the slot, so what can go wrong is a race:
a peer reading data its owner already changed, or an owner returning while a peer still reads.
Every op runs with every member's tensor shared and with only some members' shared (the kinds mix
within one call), over groups of 2, 3 and 4 ranks, with exact-sum inputs; results must equal the
reference bitwise, equal the plain-tensor results, and match on every rank. After each call the
owner overwrites its input at once: a peer still reading it would produce a wrong sum.
"""

from __future__ import annotations

import glob
import hashlib

import pytest
import torch

from nxdt.comm.spawn import run_local
from test_algorithms import _expected, _pattern  # the same exact-sum inputs

SIZES = [0, 1, 7, 1001, 40_000, (5 << 20) // 4]  # empty … more than one 4 MB slot (chunked steps)


def _shared_matrix(world) -> dict:
    r = world.rank
    groups = [world.world, world.new_communicator([0, 1], "pair"), world.new_communicator([1, 2, 3], "trio")]
    digests = {}
    for comm in groups:
        if comm is None:
            continue
        n, me = comm.size, comm.rank
        for mode in ("all", "mixed"):
            shared = mode == "all" or me % 2 == 0

            def put(t: torch.Tensor) -> torch.Tensor:
                if not shared:
                    return t.clone()
                s = world.shared_empty(t.shape, t.dtype)
                s.copy_(t)
                return s

            h = hashlib.sha256()
            for dtype in (torch.float32, torch.bfloat16, torch.int32):
                for size in SIZES:
                    # more than one slot (chunked steps): float32, on the 4-rank world (both modes) only
                    if size > 50_000 and (dtype != torch.float32 or comm is not world.world):
                        continue
                    for op in ("sum", "avg", "max", "prod"):
                        if (
                            op == "avg"
                            and not dtype.is_floating_point
                            or (size > 50_000 or dtype == torch.bfloat16)
                            and op in ("max", "prod")
                        ):
                            continue
                        exp = _expected(size, comm.ranks, op, dtype)
                        algorithms = ("auto", "slice", "direct") if size == 40_000 else ("auto",)
                        for algorithm in algorithms:
                            t = put(_pattern(size, r, op, dtype))
                            comm.all_reduce(t, op, algorithm=algorithm)
                            got = t.clone()
                            t.fill_(99)  # a peer still reading t would now see garbage
                            assert torch.equal(got, exp), (comm.name, mode, "all_reduce", algorithm, dtype, size, op)
                            h.update(got.view(torch.uint8).numpy().tobytes())
                    if dtype == torch.bfloat16:
                        continue
                    x = put(_pattern(size, r, "sum", dtype))
                    out = torch.empty(size * n, dtype=dtype)
                    comm.all_gather(out, x)
                    x.fill_(99)
                    assert torch.equal(out, torch.cat([_pattern(size, q, "sum", dtype) for q in comm.ranks])), (
                        comm.name,
                        mode,
                        "all_gather",
                        size,
                    )
                    inp = put(torch.cat([_pattern(size, r, "sum", dtype)] * n))
                    red = torch.empty(size, dtype=dtype)
                    comm.reduce_scatter(red, inp)
                    inp.fill_(99)
                    assert torch.equal(red, _expected(size, comm.ranks, "sum", dtype)), (comm.name, mode, "reduce_scatter", size)
                    b = put(_pattern(size, r, "sum", dtype))
                    comm.broadcast(b, n - 1)
                    got = b.clone()
                    b.fill_(99)
                    assert torch.equal(got, _pattern(size, comm.ranks[-1], "sum", dtype)), (comm.name, mode, "broadcast", size)
                    t = put(_pattern(size, r, "sum", dtype))
                    comm.reduce(t, 0)
                    got = t.clone()
                    t.fill_(99)
                    if me == 0:
                        assert torch.equal(got, _expected(size, comm.ranks, "sum", dtype)), (comm.name, mode, "reduce", size)
                    per = size // n + 1
                    a = put(torch.arange(per * n, dtype=torch.int64).to(dtype) + r)
                    a_out = torch.empty_like(a)
                    comm.all_to_all(a_out, a)
                    a.fill_(99)
                    want = torch.stack([torch.arange(me * per, (me + 1) * per) + q for q in comm.ranks]).reshape(-1).to(dtype)
                    assert torch.equal(a_out, want), (comm.name, mode, "all_to_all", size)
                    # in place: all-gather into a shared output, all-to-all on one shared buffer
                    g = put(torch.zeros(size * n, dtype=dtype))
                    g[me * size : (me + 1) * size] = _pattern(size, r, "sum", dtype)
                    comm.all_gather(g, g[me * size : (me + 1) * size])
                    got = g.clone()
                    g.fill_(99)
                    assert torch.equal(got, torch.cat([_pattern(size, q, "sum", dtype) for q in comm.ranks])), (
                        comm.name,
                        mode,
                        "all_gather in place",
                    )
                    a = put(torch.arange(per * n, dtype=torch.int64).to(dtype) + r)
                    comm.all_to_all(a, a)
                    assert torch.equal(a, want), (comm.name, mode, "all_to_all in place", size)
                    a.fill_(99)
            digests[(comm.name, mode)] = h.hexdigest()
    world.world.barrier()
    return {"run_id": world.run_id, **{f"{k[0]}/{k[1]}": v for k, v in digests.items()}}


@pytest.mark.timeout(240)
def test_shared_tensors_give_exact_results_with_any_mix_of_members():
    per_rank = run_local(_shared_matrix, 4, timeout_s=200)
    for key in ("world/all", "world/mixed", "pair/all", "pair/mixed", "trio/all", "trio/mixed"):
        seen = {d[key] for d in per_rank if key in d}
        assert len(seen) == 1, key  # bitwise-identical all-reduce results on every member
    # shared and mixed members produce the same bits as each other
    assert per_rank[0]["world/all"] == per_rank[0]["world/mixed"]
    # blocks removed when the worlds closed (this run's segments: other jobs may share the host)
    assert not glob.glob(f"/dev/shm/nxdt-{per_rank[0]['run_id']}-heap*")


def _located(world) -> tuple:
    s = world.shared_empty((4, 3), torch.float32)
    plain = torch.empty(12)
    first, second = world.heap.locate(s[0]), world.heap.locate(s[2])
    return s.shape, s.dtype, first[0] == second[0], second[1] - first[1], world.heap.locate(plain), world.heap.locate(s[:0])


def test_shared_empty_allocates_located_blocks():
    shape, dtype, same_block, offset, plain, empty = run_local(_located, 1, timeout_s=60)[0]
    assert shape == (4, 3) and dtype == torch.float32 and same_block and offset == 2 * 3 * 4
    assert plain is None and empty is None


def test_only_ranks_with_a_core_each_spin_long():
    from nxdt.comm.waiting import DEFAULT_WAIT, policy_for

    assert policy_for(1).spin_s > 0  # a rank alone on this host has a core to itself
    assert policy_for(10_000) == DEFAULT_WAIT  # oversubscribed: short spins, then the futex
