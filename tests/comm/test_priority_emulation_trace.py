"""Stream priority (TP before FSDP, bounded yields), link emulation and Chrome tracing in nxdt.comm.

Pure checks run in-process (Tracer, EmulatedLink, the planner's emulated-link figures, the config
key). One 4-rank world (spawning is the expensive part) proves that independent yields cannot
deadlock, then each pair {0,1}, {2,3} checks emulation (modelled time slept, not spun), the token
chain in the trace, a recorded yield and that no FSDP chunk starts while a TP op runs.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from nxdt.comm import EmulatedLink, Tracer
from nxdt.comm.emulate import MAX_CREDIT_S
from nxdt.comm.spawn import run_local

# ------------------------------------------------------------------------------ pure


def test_tracer_writes_chrome_trace_json(tmp_path):
    tracer = Tracer(3)
    with tracer.span("forward", "compute", unit=1):
        pass
    start = Tracer.now()
    tracer.add("all_gather", "fsdp", start, start + 0.0025, token=7, after=[6])
    tracer.add("all_reduce", "tp", start, start + 0.001)
    path = tmp_path / "trace.json"
    tracer.write(path)
    data = json.loads(path.read_text())
    assert data["displayTimeUnit"] == "ms"
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in complete] == ["forward", "all_gather", "all_reduce"]
    assert all(e["pid"] == 3 for e in data["traceEvents"])
    by_name = {e["name"]: e for e in complete}
    assert by_name["forward"]["args"] == {"unit": 1} and by_name["forward"]["cat"] == "compute"
    gather = by_name["all_gather"]
    assert gather["ts"] == pytest.approx(start * 1e6) and gather["dur"] == pytest.approx(2500, rel=1e-6)
    assert gather["args"] == {"token": 7, "after": [6]}
    tids = {e["cat"]: e["tid"] for e in complete}
    assert len(set(tids.values())) == 3  # one row per category
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert names == {tid: cat for cat, tid in tids.items()}


def _own_slice_ns() -> int | None:
    try:
        lines = open("/proc/thread-self/sched").read().splitlines()
    except OSError:
        return None
    values = [int(line.split(":")[1]) for line in lines if line.startswith("se.slice")]
    return values[0] if values else None


def test_stream_threads_run_with_a_short_scheduler_slice():
    """A stream thread asks for a 100 µs slice so its wake-ups preempt the rank's compute (where the
    kernel has per-task slices: Linux >= 6.12, visible in /proc with scheduler debug info)."""
    from nxdt.comm.stream import Stream
    from nxdt.comm.waiting import STREAM_THREAD_SLICE_S

    default = _own_slice_ns()
    if default is None or default == int(STREAM_THREAD_SLICE_S * 1e9):
        pytest.skip("this kernel shows no per-task scheduler slice")
    seen = []
    stream = Stream("probe")
    try:
        stream.submit(lambda: seen.append(_own_slice_ns()), "probe", async_op=True).wait(10)
    finally:
        stream.close()
    assert seen == [int(STREAM_THREAD_SLICE_S * 1e9)]
    assert _own_slice_ns() == default  # the calling (compute) thread keeps the kernel's default


def test_emulated_link_model_and_validation():
    link = EmulatedLink(latency_s=2e-6, bytes_per_s=1e9)
    assert link.seconds(1_000_000) == pytest.approx(2e-6 + 1e-3)
    assert link.seconds(0, hops=2) == pytest.approx(4e-6)
    with pytest.raises(ValueError, match="bytes_per_s"):
        EmulatedLink(1e-6, 0)
    with pytest.raises(ValueError, match="latency_s"):
        EmulatedLink(-1.0, 1e9)


def test_emulated_links_of_a_trn1_plan_use_its_link_classes():
    from nxdt.planner import plan_layout
    from nxdt.planner.cost import efficiency
    from nxdt.planner.links import emulated_links, load_instance
    from nxdt.topology import topology_of

    trn1 = load_instance("trn1.32xlarge")
    topo = topology_of(trn1, 1)
    dev, core, eff = trn1.device_link, trn1.intra_device, trn1.link_efficiency
    # TP=4 on a full node: torus columns [0, 8, 16, 24] — NeuronLink hops between 4 devices, a sub-ring
    # (2 channels) shared by the device's 2 cores
    column = plan_layout(32, tp=4, ranks_per_node=32, topo=topo, instance=trn1, lnc=1)
    assert column.groups["tp"][0] == [0, 8, 16, 24]
    latency, bandwidth = emulated_links(column, topo, trn1)["tp"]
    assert latency == pytest.approx(dev.latency_us * 1e-6)
    assert bandwidth == pytest.approx(2 * dev.bandwidth_GBps * 1e9 * eff / 2)
    # TP=2: both cores of one device — the intra-device link; DP then crosses devices
    pairs = plan_layout(4, tp=2, ranks_per_node=4, topo=topo, instance=trn1, lnc=1)
    links = emulated_links(pairs, topo)  # instance loaded by the plan's name
    assert links["tp"] == pytest.approx((core.latency_us * 1e-6, core.bandwidth_GBps * 1e9 * efficiency(core, trn1)))
    assert links["dp"][0] == pytest.approx(dev.latency_us * 1e-6)
    assert "pp" not in links  # single-rank groups move nothing


def test_comm_emulate_names_a_known_instance_and_is_trainable():
    from nxdt.config import ConfigError, compose_config
    from nxdt.config.validate import check_trainable
    from nxdt.planner.links import emulated_links_for

    with pytest.raises(ConfigError, match=r"comm.emulate='trn9'.*choose one of .*trn1.32xlarge"):
        compose_config(["comm.emulate=trn9"])
    cfg = compose_config(["comm.emulate=trn1.32xlarge", "trainer.devices=4", "distributed_strategy.tensor_model_parallel_size=2"])
    check_trainable(cfg)  # no longer refused
    links = emulated_links_for(cfg)
    assert set(links) >= {"tp", "dp"} and all(lat > 0 and bw > 0 for lat, bw in links.values())
    cfg.comm.emulate = None
    assert emulated_links_for(cfg) == {}


# ------------------------------------------------------------------------------ 4 ranks

SLOT = 64 << 10  # small shm slots: every message below moves in several chunks


def _pair_comm(world, name: str, link=None):
    """This rank's member of the pairs {0,1}, {2,3} (every rank creates both, in order)."""
    pairs = [world.new_communicator([2 * i, 2 * i + 1], f"{name}{i}", link=link) for i in range(world.world_size // 2)]
    return pairs[world.rank // 2]


def _emulation_and_trace(world) -> dict:
    r, out = world.rank, {}
    # 1. an emulated all-gather takes the modelled time, asleep
    link = EmulatedLink(latency_s=1e-3, bytes_per_s=8e6)
    slow = _pair_comm(world, "slow", link)
    warm = torch.zeros(2)
    slow.all_gather(warm, torch.ones(1))  # first use maps the segments
    m = (1 << 20) // 4  # 1 MB of fp32 per rank: 16 chunks
    inp, got = torch.full((m,), float(r + 1)), torch.empty(2 * m)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    slow.all_gather(got, inp)
    out["wall"], out["cpu"] = time.perf_counter() - wall0, time.process_time() - cpu0
    chunk = SLOT // 4
    out["modelled"] = sum(link.seconds((2 - 1) * min(chunk, m - c) * 4) for c in range(0, m, chunk))
    low = r & ~1
    assert torch.equal(got, torch.cat([torch.full((m,), low + 1.0), torch.full((m,), low + 2.0)]))

    # 2. chained async FSDP gathers while a (slow) TP all-reduce runs: trace order and a yield
    tracer = Tracer(r)
    world.set_tracer(tracer)
    fsdp = _pair_comm(world, "fsdp_pair", EmulatedLink(0.0, 8e6))  # 8 ms per chunk, 16 chunks per gather
    tp = _pair_comm(world, "tp_pair", EmulatedLink(0.02, 1e9))  # ≥ 40 ms per all-reduce
    shards = [torch.full((m,), float(10 * i + r)) for i in range(3)]
    full = [torch.empty(2 * m) for _ in shards]
    x = torch.full((8,), float(r + 1))
    # deterministic on a loaded host: the pair meets first, so the ~380 ms of chained gathers are surely
    # under way when the TP op starts right after; a late peer (a stall) may hold the FSDP stream back up
    # to 100 ms instead of the default 5 ms
    world.yield_stall_s = 0.1
    tp.barrier()
    works, prev = [], None
    for shard, dst in zip(shards, full):
        prev = fsdp.all_gather(dst, shard, stream="fsdp", async_op=True, after=prev)
        works.append(prev)
    while works[0].start_s is None:
        time.sleep(1e-3)
    out["tp_overlapped"] = not works[-1].is_completed()
    tp.all_reduce(x, stream="tp")
    for w in works:
        w.wait()
    world.yield_stall_s = 0.005
    world.set_tracer(None)
    assert torch.equal(x, torch.full((8,), 2.0 * low + 3))
    for i, dst in enumerate(full):
        assert torch.equal(dst, torch.cat([torch.full((m,), 10.0 * i + low), torch.full((m,), 10.0 * i + low + 1)]))
    out["ids"] = [w.id for w in works]
    out["events"] = [e for e in tracer.events() if e["ph"] == "X"]
    return out


def _check_emulation_and_trace(res: dict) -> None:
    # modelled time is slept (minus at most the oversleep credit a pacer carries), not spun
    assert res["wall"] >= res["modelled"] - MAX_CREDIT_S, res
    assert res["cpu"] < 0.35 * res["wall"], res
    events = res["events"]
    gathers = sorted((e for e in events if e["name"] == "all_gather" and e["cat"] == "fsdp"), key=lambda e: e["ts"])
    assert [e["args"]["token"] for e in gathers] == res["ids"]
    for one, two in zip(gathers, gathers[1:]):
        assert two["args"]["after"] == [one["args"]["token"]]
        assert two["ts"] >= one["ts"] + one["dur"] - 1e-3  # starts after its token's op completed
    for e in gathers:
        assert (
            e["args"]["group"].startswith("fsdp_pair") and e["args"]["bytes"] == 2 * (1 << 20) and e["args"]["algorithm"] == "shm"
        )  # what ran: auto resolved (shm on one host)
    assert [e["args"]["seq"] for e in gathers] == [0, 1, 2]
    tp_ops = [e for e in events if e["cat"] == "tp"]
    assert len(tp_ops) == 1 and tp_ops[0]["name"] == "all_reduce" and isinstance(tp_ops[0]["args"]["token"], int)
    assert tp_ops[0]["args"]["token"] not in res["ids"]  # inline ops get their own ids
    yields = [e for e in events if e["name"] == "yield"]
    assert res["tp_overlapped"], "the TP op started after every gather had finished: nothing to yield to"
    assert yields and all(e["cat"] == "fsdp" for e in yields)
    tp_start, tp_end = tp_ops[0]["ts"], tp_ops[0]["ts"] + tp_ops[0]["dur"]
    assert any(tp_start - 1e3 <= y["ts"] <= tp_end for y in yields)  # paused while the TP op ran
    # no FSDP transfer runs once the TP op has waited longer than one chunk: the chunk in flight when it
    # started may finish, the next one starts only after it (1 ms slack: the TP op is recorded after it ends)
    chunks = [e for e in events if e["name"] == "chunk" and e["cat"] == "fsdp"]
    assert len(chunks) >= 3 * 16, len(chunks)  # every step of the three 1 MB gathers (64 KB slots)
    one_chunk = max(c["dur"] for c in chunks)
    late = [c for c in chunks if tp_start + one_chunk < c["ts"] < tp_end - 1e3]
    assert not late, (tp_start, tp_end, one_chunk, late)


def _skewed_tp_and_fsdp(world) -> int:
    """TP pairs {0,1},{2,3}, FSDP pairs {0,2},{1,3}. Ranks 0 and 3 run layer i's TP all-reduce before
    waiting for its gather on even layers (1 and 2 on odd ones), the others the other way round: the
    cycle of the stream module's docstring, where unbounded pauses would deadlock."""
    r = world.rank
    tps = [world.new_communicator([0, 1], "tp0"), world.new_communicator([2, 3], "tp1")]
    link = EmulatedLink(0.0, 64e6)  # 1 ms per chunk: gathers are in flight when TP ops start
    fsdps = [world.new_communicator([0, 2], "fsdp0", link=link), world.new_communicator([1, 3], "fsdp1", link=link)]
    tp, fsdp = tps[r // 2], fsdps[r % 2]
    tracer = Tracer(r)
    world.set_tracer(tracer)
    layers, m = 6, (256 << 10) // 4
    shards = [torch.full((m,), float(100 * i + r)) for i in range(layers)]
    full = [torch.empty(2 * m) for _ in range(layers)]
    works, prev = [], None
    for shard, dst in zip(shards, full):
        prev = fsdp.all_gather(dst, shard, stream="fsdp", async_op=True, after=prev)
        works.append(prev)
    first = r in (0, 3)
    peer = r ^ 1  # TP peer
    fsdp_peer = r ^ 2
    for i in range(layers):
        x = torch.full((5,), float(r + 1 + i))
        if first == (i % 2 == 0):
            tp.all_reduce(x, stream="tp")
            works[i].wait()
        else:
            works[i].wait()
            tp.all_reduce(x, stream="tp")
        assert torch.equal(x, torch.full((5,), float(r + 1 + i + peer + 1 + i)))
        lo, hi = min(r, fsdp_peer), max(r, fsdp_peer)
        assert torch.equal(full[i], torch.cat([torch.full((m,), 100.0 * i + lo), torch.full((m,), 100.0 * i + hi)]))
    world.set_tracer(None)
    return sum(1 for e in tracer.events() if e["name"] == "yield")


def _four_ranks(world) -> dict:
    yields = _skewed_tp_and_fsdp(world)
    return {"skewed_yields": yields, **_emulation_and_trace(world)}


@pytest.mark.timeout(120)
def test_bounded_yields_do_not_deadlock_and_emulation_and_trace_behave():
    # comm timeout well above the work (< 1 s) but short: a deadlock fails fast instead of hanging
    results = run_local(_four_ranks, 4, timeout_s=90, comm_timeout_s=20.0, init_options={"slot_bytes": SLOT})
    assert len(results) == 4  # every rank finished the skewed TP/FSDP order with exact sums (asserted inside)
    for res in results:
        _check_emulation_and_trace(res)
