"""Transports behind one interface (nxdt.comm.transport): shm, p2p and gloo give the same exact sums for every
op on one host; ``transport=`` / ``algorithm=`` / ``planned=`` (``comm.transport``, ``comm.algorithm``,
``Plan.algorithms``) change what runs, as the communicator reports it and as the trace records it; bad choices
are one line before any worker starts. One spawned world per world size (cheap)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import warm_cli

from nxdt.comm import CommTimeoutError, Tracer
from nxdt.comm.spawn import run_local
from test_collectives import stay_alive_until
from nxdt.comm.transport import ALGORITHM_NAMES, ALGORITHMS
from nxdt.config import compose_config
from nxdt.config.validate import COMM_ALGORITHMS, ConfigError


def _pattern(n: int, rank: int, op: str, dtype: torch.dtype) -> torch.Tensor:
    base = torch.arange(n, dtype=torch.int64)
    values = (base % 2) + 1 if op == "prod" else (base % 7) + rank + 1  # small integers: exact in any order, any dtype
    return values.to(dtype)


def _every_op(comm) -> str:
    """Every op, a few dtypes and sizes, exact-sum inputs checked against float64 references; the digest of
    every result (so transports can be compared bit for bit)."""
    n, r, h = comm.size, comm.rank, hashlib.sha256()
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for size in (1, 1001, 70_000):
            for op in ("sum", "avg", "max", "prod"):
                if op == "avg" and not dtype.is_floating_point:
                    continue
                stack = torch.stack([_pattern(size, q, op, torch.float64) for q in range(n)])
                want = {"sum": stack.sum(0), "avg": stack.sum(0) / n, "max": stack.max(0).values, "prod": stack.prod(0)}[op].to(
                    dtype
                )
                t = _pattern(size, r, op, dtype)
                comm.all_reduce(t, op)
                assert torch.equal(t, want), (comm.transport, "all_reduce", dtype, size, op)
                out = torch.empty(size, dtype=dtype)
                comm.reduce_scatter(out, torch.cat([_pattern(size, r, op, dtype)] * n), op)
                assert torch.equal(out, want), (comm.transport, "reduce_scatter", dtype, size, op)
                red = _pattern(size, r, op, dtype)
                comm.reduce(red, n - 1, op)
                if r == n - 1:
                    assert torch.equal(red, want), (comm.transport, "reduce", dtype, size, op)
                h.update(t.view(torch.uint8).numpy().tobytes() + out.view(torch.uint8).numpy().tobytes())
            x = _pattern(size, r, "sum", dtype)
            gathered = torch.empty(size * n, dtype=dtype)
            comm.all_gather(gathered, x)
            assert torch.equal(gathered, torch.cat([_pattern(size, q, "sum", dtype) for q in range(n)])), (
                comm.transport,
                "all_gather",
            )
            b = _pattern(size, r, "sum", dtype)
            comm.broadcast(b, 0)
            assert torch.equal(b, _pattern(size, 0, "sum", dtype)), (comm.transport, "broadcast")
            h.update(gathered.view(torch.uint8).numpy().tobytes())
        in_splits, out_splits = [q + 1 for q in range(n)], [r + 1] * n  # uneven all-to-all: q sends q'+1 rows to q'
        a2a = torch.empty(sum(out_splits), 3, dtype=dtype)
        comm.all_to_all(a2a, (torch.ones(sum(in_splits), 3) * r).to(dtype), out_splits, in_splits)
        assert torch.equal(a2a, torch.cat([torch.ones(r + 1, 3) * q for q in range(n)]).to(dtype)), (comm.transport, "all_to_all")
        eq = torch.empty(2 * n, dtype=dtype)
        comm.all_to_all(eq, torch.arange(2 * n).to(dtype) + r)
        assert torch.equal(eq, torch.stack([torch.arange(2 * r, 2 * r + 2) + q for q in range(n)]).reshape(-1).to(dtype))
    got = torch.empty(5)
    comm.send_recv(torch.full((5,), float(r)), (r + 1) % n, got, (r - 1) % n)
    assert torch.all(got == (r - 1) % n)
    comm.barrier()
    return h.hexdigest()


def _traced(comm, call) -> list[tuple[str, str, str]]:
    """(op, algorithm, transport) of every collective ``call()`` issued, as the trace records them."""
    tracer = Tracer(comm.world.rank)
    comm.world.set_tracer(tracer)
    try:
        call()
    finally:
        comm.world.set_tracer(None)
    return [(e["name"], e["args"]["algorithm"], e["args"]["transport"]) for e in tracer.events() if e.get("ph") == "X"]


def _transports(world) -> dict:
    ranks = list(range(world.world_size))
    shm = world.new_communicator(ranks, "t-shm", transport="shm")
    p2p = world.new_communicator(ranks, "t-p2p", transport="p2p")
    gloo = world.new_communicator(ranks, "t-gloo", transport="gloo")
    ring = world.new_communicator(ranks, "t-ring", algorithm="ring")
    planned = {"all_reduce": "ring", "all_gather": "direct", "broadcast": "tree"}
    shm_planned = world.new_communicator(ranks, "t-shm-planned", planned=planned)
    p2p_planned = world.new_communicator(ranks, "t-p2p-planned", transport="p2p", planned=planned)
    overridden = world.new_communicator(ranks, "t-override", transport="p2p", algorithm="rhd", planned=planned)
    digests = {c.transport: _every_op(c) for c in (shm, p2p, gloo)}
    small, big = torch.ones(256), torch.ones(1 << 17)  # 1 KB, 512 KB

    def ops(c):
        return lambda: (
            c.all_reduce(small),
            c.all_reduce(big),
            c.all_gather(torch.empty(256 * c.size), small),
            c.broadcast(small),
        )

    seen = {
        name: _traced(c, ops(c))
        for name, c in (
            ("auto", world.world),
            ("shm", shm),
            ("p2p", p2p),
            ("gloo", gloo),
            ("ring", ring),
            ("shm_planned", shm_planned),
            ("p2p_planned", p2p_planned),
            ("overridden", overridden),
        )
    }
    defaults = {
        name: c.algorithms
        for name, c in (("ring", ring), ("shm_planned", shm_planned), ("p2p_planned", p2p_planned), ("overridden", overridden))
    }
    return {
        "digests": digests,
        "seen": seen,
        "defaults": defaults,
        "empty_shared": world.heap.locate(shm.empty(16)) is not None,
        "p2p_empty_shared": world.heap.locate(p2p.empty(16)) is not None,
    }


@pytest.mark.timeout(200)
def test_transports_agree_and_each_choice_changes_what_runs():
    results = run_local(_transports, 3, timeout_s=190)
    r = results[0]
    # the same exact sums, bit for bit, on every transport and every rank (p2p on one host: shm mailboxes)
    assert len({d for res in results for d in res["digests"].values()}) == 1
    seen = r["seen"]
    A = ("all_reduce", "all_reduce", "all_gather", "broadcast")
    # auto on one host is shm, whose direct algorithms run
    assert seen["auto"] == seen["shm"] == list(zip(A, ["shm"] * 4, ["shm"] * 4))
    # p2p: the generic algorithms, rhd for small all-reduces and ring above 256 KB; gloo: gloo's own
    assert seen["p2p"] == list(zip(A, ["rhd", "ring", "ring", "tree"], ["p2p"] * 4))
    assert seen["gloo"] == list(zip(A, ["gloo"] * 4, ["gloo"] * 4))
    # comm.algorithm=ring: every op that has a ring runs it (over shm mailboxes); broadcast has none and keeps auto
    assert seen["ring"] == list(zip(A, ["ring", "ring", "ring", "shm"], ["shm"] * 4))
    assert r["defaults"]["ring"] == {"all_reduce": "ring", "all_gather": "ring", "reduce_scatter": "ring"}
    # the plan's choices: taken by p2p where it has them (ring even for 1 KB, where auto runs rhd), not by shm
    # (the planner models the instance's links; on one host's shared memory the direct algorithms are the fast path)
    assert seen["shm_planned"] == seen["shm"] and r["defaults"]["shm_planned"] == {}
    assert seen["p2p_planned"] == list(zip(A, ["ring", "ring", "ring", "tree"], ["p2p"] * 4))
    assert r["defaults"]["p2p_planned"] == {"all_reduce": "ring", "broadcast": "tree"}  # the planner's "direct" is shm's: auto
    # an explicit comm.algorithm beats the plan
    assert [a for _, a, _ in seen["overridden"]] == ["rhd", "rhd", "ring", "tree"]
    assert r["empty_shared"] and not r["p2p_empty_shared"]


def _gloo_absent(world, marker: str) -> str:
    comm = world.new_communicator([0, 1], "g", transport="gloo")
    if world.rank == 1:
        stay_alive_until(marker)  # alive, never calls the collective
        return ""
    with pytest.raises(CommTimeoutError) as info:
        comm.all_reduce(torch.ones(4))
    open(marker, "w").close()
    return str(info.value)


@pytest.mark.timeout(60)
def test_gloo_transport_times_out_with_one_line_naming_the_group(tmp_path):
    message = run_local(_gloo_absent, 2, str(tmp_path / "timed-out"), timeout_s=40, comm_timeout_s=1.0)[0]
    assert "group 'g'" in message and "gloo" in message and "\n" not in message


def _bad_choices(world) -> list[str]:
    out = []
    for kwargs in ({"transport": "nccl"}, {"algorithm": "rign"}, {"transport": "gloo", "algorithm": "ring"}):
        with pytest.raises(ValueError) as info:
            world.new_communicator([0, 1], f"bad{len(out)}", **kwargs)
        out.append(str(info.value))
    return out


@pytest.mark.timeout(60)
def test_unknown_transport_or_algorithm_is_refused_when_the_communicator_is_made():
    nccl, rign, gloo_ring = run_local(_bad_choices, 2, timeout_s=40)[0]
    assert "transport 'nccl' unknown" in nccl and "'shm'" in nccl
    assert "'rign' unknown" in rign and "ring" in rign
    assert "gloo's own algorithms" in gloo_ring


def test_the_config_knows_every_algorithm_of_nxdt_comm():
    assert set(COMM_ALGORITHMS) == set(ALGORITHM_NAMES) == {n for names in ALGORITHMS.values() for n in names}


@pytest.mark.parametrize(
    "overrides, key, needle",
    [
        (["comm.algorithm=rign"], "comm.algorithm", "use one of auto, direct"),
        (["comm.algorithm=torus:2y2"], "comm.algorithm", "torus:RxC"),
        (["comm.transport=gloo", "comm.algorithm=ring"], "comm.algorithm", "gloo's own algorithms"),
        (["comm.transport=shm", "trainer.num_nodes=2"], "comm.transport", "one host"),
    ],
)
def test_bad_comm_choices_are_one_config_error(overrides, key, needle):
    with pytest.raises(ConfigError) as info:
        compose_config(overrides, paths=False)
    assert str(info.value).startswith(f"config error: {key}=") and needle in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_comm_keys_reach_the_workers_communicators(tmp_path):
    """``nxdt train comm.transport=p2p comm.algorithm=ring``: the data-parallel gradient all-reduce runs ring
    over p2p (the trace the workers write says so), and the run trains."""
    # a fork of the suite's pre-imported nxdt (tests/warm_cli.py): the fresh interpreter is not what this checks
    result = warm_cli.run(
        [
            "train",
            "-q",
            "trainer.max_steps=2",
            "data=synthetic",
            "comm.transport=p2p",
            "comm.algorithm=ring",
            "exp_manager.trace=true",
            f"exp_manager.exp_dir={tmp_path}",
        ],
        cwd=tmp_path,
        timeout=110,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    trace = json.loads(next(tmp_path.glob("*/*/trace/rank0.json")).read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    dp = {
        (e["name"], e["args"]["algorithm"], e["args"]["transport"])
        for e in events
        if e.get("ph") == "X" and e.get("args", {}).get("group") == "dp0"
    }
    assert ("all_reduce", "ring", "p2p") in dp, dp
    assert {t for _, _, t in dp} == {"p2p"}
