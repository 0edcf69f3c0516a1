"""Alpha-beta cost model of collectives on a planned group.

Each group gets effective link figures — latency ``alpha`` per step and bandwidth ``bw`` per rank and
direction — from the slowest link class it spans, the channels the topology offers (a full 4x4 torus
node builds 4 rings, a sub-ring 2 [S42]) and how many groups of the same dimension share those links.
Every algorithm that can run on the group is estimated and the cheapest is chosen.

With n ranks, S bytes (the full buffer: all-reduce input, all-gather output, reduce-scatter input):

    ring all-reduce       2(n-1)·α + 2(n-1)/n · S/bw
    rhd (n = 2^k)         2·log2(n)·α + 2(n-1)/n · S/bw · h      h = mean hops of non-neighbour partners
    direct (one-shot)     2·α + 2(n-1)/n · S/bw · h
    torus2d (a×b grid)    ring along a, ring along b on 1/a of the data (two link sets)
    hierarchical          intra-node reduce-scatter → inter-node all-reduce of S/m → intra all-gather
    ring across k nodes   2(n-k)·α_intra + 2(k-1)·α_net + 2(n-1)/n · S / min(node's network share, intra bw)
    all-gather / reduce-scatter: half the all-reduce terms; all-to-all (pairwise): (n-1)·α + (n-1)/n·S/bw·h
    all-to-all across k nodes  α_intra + α_net + max((m-1)/n·S / bw_intra, (n-m)/n·S / node's network share)
    NVLS (NVLink SHARP)   nvls_latency + S / (port bw · nvls_efficiency)     (the switch reduces: S out, S in)
    inside one switched node every algorithm adds device_link's ramp  ramp_us · S/(S + ramp_bytes)  (channels and
    chunks NCCL shrinks for smaller messages; 0 where not set)
    tree across k nodes   2·((m-1)·α_intra + ⌈log2 k⌉·α_net) + (2 or, for k = 2, 1)·S / node's network bandwidth
    broadcast: binomial tree ⌈log2 n⌉·(α + S/bw) or a pipelined ring; send/recv: α + S/bw

Across nodes the ring is laid out node by node (:func:`_node_ring`: only its node-crossing steps use the network),
against the hierarchical algorithm, which sends fewer bytes through the network (2(k-1)/k·S per node instead of
2(n-1)/n·S) but pays a ramp ``ramp_us · S/(S + ramp_bytes)``: on switched GPU nodes, where NCCL pipelines it, the
fill and drain of that pipeline (so the ring wins up to tens of MB and the hierarchical algorithm beyond, as NCCL's
ring/tree choice does); elsewhere the network's cost per transfer (small messages travel eagerly, larger ones pay a
handshake that saturates), paid by every algorithm crossing nodes. Every estimate adds the runtime's software cost
per collective, ``collective_overhead_us`` plus ``collective_overhead_per_rank_us`` for each further rank (launch
and synchronisation: paid whatever the algorithm). Each link's ``efficiency`` (default the instance's
``link_efficiency``) scales its bandwidth. Where these values are fitted to published measurements
(experiments/planner-accuracy), the catalogue says so in its provenance.

On switched GPU nodes (``switch``/``nvswitch``) the candidates are NCCL's (src/graph/tuning.cc, ncclTopoTuneModel:
latency + size / bandwidth per algorithm): inside a node the ring and, where the switch reduces (``nvls_efficiency``
> 0: NVSwitch gen3 on H100/H200, gen4 on B200), NVLS — no one-shot or halving-doubling algorithm, which NCCL does not
run; across nodes the node-laid ring and the double binary tree (``tree``: its latency grows with log2 of the nodes,
its traffic does not — each node sends and receives 2·S, S on two nodes, where tuning.cc doubles the tree's
inter-node bandwidth). The tree is pipelined, as NCCL's trees and rings across nodes are: chunks flow through the
intra- and inter-node stages at once, so the slower stage's transfer sets the pace, and its pipeline fills once per
tree level (the ramp, times ⌈log2 k⌉). All-to-all sends to all peers at once (NCCL groups the n-1 sends and
receives): the intra-node share over NVLink and the rest through the node's NICs run side by side.

On the ``cpu`` instance a calibration (``nxdt comm-test --calibrate``) replaces the formulas by the
measured per-op fit ``T = a + S·b`` of nxdt's shared-memory algorithms on this host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nxdt.topology import Topology

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per step
    bw: float  # bytes per second per rank and direction
    hops: float = 1.0  # mean hop count of all-pairs traffic (contention factor of direct/mesh algorithms)
    rhd_hops: float = 1.0  # the same for recursive halving-doubling partners (a 4x4 torus is a 4-cube: neighbours)
    ramp: float = 0.0  # seconds a collective crossing this link adds at most (see the module docstring)
    ramp_bytes: float = 0.0  # message size at which the ramp is half its maximum
    message: float = 0.0  # seconds each message to another node costs this rank beyond its bytes (all-to-all)
    post: float = 0.0  # seconds every step of a ring crossing this link takes at least (the send's posting)


@dataclass(frozen=True)
class GroupShape:
    size: int
    nodes: int  # nodes the group spans
    per_node: int  # members on each node
    devices: int  # devices the per-node part spans
    sharing: int  # groups of the same dimension sharing those devices' links
    domain: bool  # all nodes in one scale-up domain
    grid: tuple[int, int] | None  # torus rows × cols covered, when the per-node part is a full grid


def shape_of(group: list[int], topo: Topology, ranks_per_node: int) -> GroupShape:
    nodes = sorted({r // ranks_per_node for r in group})
    first = [r % ranks_per_node for r in group if r // ranks_per_node == nodes[0]]
    devs = sorted({topo.device_of(c) for c in first})
    per_device = len(first) // max(len(devs), 1)
    sharing = max(1, topo.ranks_per_device // max(per_device, 1)) if topo.graph != "host" else 1
    domain = topo.domain_nodes > 1 and len({n // topo.domain_nodes for n in nodes}) == 1
    grid = None
    if topo.graph in ("torus2d", "torus3d") and len(devs) > 4:
        rows, cols = topo.grid
        used_rows = len({d // cols for d in devs})
        grid = (used_rows, len(devs) // used_rows)
    return GroupShape(len(group), len(nodes), len(first), len(devs), sharing, domain, grid)


def efficiency(link: Any, instance: Any) -> float:
    """Achieved fraction of ``link``'s bandwidth: its own ``efficiency``, else the instance's ``link_efficiency``."""
    own = getattr(link, "efficiency", None)
    return instance.link_efficiency if own is None else own


def intra_link(shape: GroupShape, topo: Topology, instance: Any, calibration: dict | None) -> Link:
    """Figures of the per-node part of a group."""
    if shape.devices <= 1 or topo.graph == "host":
        link = instance.intra_device
        if topo.graph == "host" and calibration:
            return Link(calibration["latency_s"], calibration["bandwidth_Bps"])
        return Link(link.latency_us * 1e-6, link.bandwidth_GBps * 1e9 * efficiency(link, instance))
    link = instance.device_link
    eff = efficiency(link, instance)
    rhd_hops = 1.0
    if topo.graph in ("torus2d", "torus3d"):
        channels = 4 if shape.devices == topo.devices else 2  # 2 Hamiltonian cycles × 2 directions on a full node [S35,S42]
        hops = 1.0 if shape.devices <= 4 else topo.mean_distance
        rhd_hops = 1.1  # "partial over-subscription" [S35]
    elif topo.graph == "ring":
        channels, hops = (2 if shape.devices == topo.devices else 1), max(1.0, shape.devices / 4)
        rhd_hops = hops
    elif topo.graph == "chain":
        channels, hops = 1, max(1.0, shape.devices / 3)
        rhd_hops = hops
    else:  # switch / nvswitch: device_link is the device's whole port into the switch
        channels, hops = 1, 1.0
    ramp = getattr(link, "ramp_us", 0.0) or 0.0  # inside one switched node only (_switched_node)
    return Link(
        link.latency_us * 1e-6,
        channels * link.bandwidth_GBps * 1e9 * eff / shape.sharing,
        hops,
        max(rhd_hops, 1.0),
        ramp=ramp * 1e-6,
        ramp_bytes=getattr(link, "ramp_bytes", 0.0) or 0.0,
    )


def inter_link(shape: GroupShape, topo: Topology, instance: Any, ranks_per_node: int) -> Link:
    """Figures between nodes: domain links, or the node's NICs shared by all its ranks."""
    if shape.domain:
        link = instance.domain_link
        per = max(1, topo.ranks_per_device)
    else:
        link = instance.inter_node
        per = ranks_per_node
    return Link(
        link.latency_us * 1e-6,
        link.bandwidth_GBps * 1e9 * efficiency(link, instance) / per,
        ramp=getattr(link, "ramp_us", 0.0) * 1e-6,
        ramp_bytes=getattr(link, "ramp_bytes", 0.0),
        message=getattr(link, "message_us", 0.0) * 1e-6,
        post=getattr(link, "post_us", 0.0) * 1e-6,
    )


def _log2(n: int) -> int:
    return max(1, math.ceil(math.log2(n)))


def _pow2(n: int) -> bool:
    return n & (n - 1) == 0


def flat_estimates(op: str, n: int, nbytes: float, link: Link) -> dict[str, float]:
    """Seconds per algorithm for one flat (single link class) group."""
    a, bw, h, hr = link.alpha, link.bw, link.hops, link.rhd_hops
    if n <= 1 or nbytes <= 0:
        return {"none": 0.0}
    frac = (n - 1) / n
    if op == "all_reduce":
        est = {"ring": 2 * (n - 1) * a + 2 * frac * nbytes / bw, "direct": 2 * a + 2 * frac * nbytes / bw * h}
        if _pow2(n):
            est["rhd"] = 2 * _log2(n) * a + 2 * frac * nbytes / bw * hr
        return est
    if op in ("all_gather", "reduce_scatter"):
        est = {"ring": (n - 1) * a + frac * nbytes / bw, "direct": a + frac * nbytes / bw * h}
        if _pow2(n):
            est["rhd"] = _log2(n) * a + frac * nbytes / bw * hr
        return est
    if op == "all_to_all":
        return {"pairwise": (n - 1) * a + frac * nbytes / bw * h}
    if op == "broadcast":
        chunks = 8
        return {"tree": _log2(n) * (a + nbytes / bw), "ring": (n - 2 + chunks) * (a + nbytes / chunks / bw)}
    if op == "send_recv":
        return {"p2p": a + nbytes / bw}
    raise ValueError(f"unknown collective {op!r}")


def _calibrated(op: str, n: int, nbytes: float, calibration: dict) -> float | None:
    fits = calibration.get("ops", {}).get(op)
    if not fits:
        return None
    sizes = sorted(int(k) for k in fits)
    near = min(sizes, key=lambda s: abs(s - n))  # closest measured group size, scaled by the (n-1)/n traffic
    a, b = fits[str(near)]
    scale = ((n - 1) / n) / ((near - 1) / near) if near > 1 and n > 1 else 1.0
    return a + nbytes * b * scale


def estimate_collective(
    op: str, group: list[int], nbytes: float, topo: Topology, instance: Any, ranks_per_node: int, calibration: dict | None = None
) -> tuple[str, float, dict[str, float]]:
    """(best algorithm, its seconds, every candidate's seconds) for one collective on one group."""
    n = len(group)
    if n <= 1 or nbytes <= 0:
        return "none", 0.0, {"none": 0.0}
    shape = shape_of(group, topo, ranks_per_node)
    intra = intra_link(shape, topo, instance, calibration)
    if shape.nodes == 1:
        if topo.graph == "host" and calibration:
            t = _calibrated(op, n, nbytes, calibration)
            if t is not None:
                return "auto", t, {"auto": t}
        est = flat_estimates(op, n, nbytes, intra)
        if topo.graph in ("switch", "nvswitch"):
            est = _switched_node(op, n, nbytes, intra, est, instance)
        if shape.grid and op in ("all_reduce", "all_gather", "reduce_scatter"):
            rows, cols = shape.grid
            line = Link(intra.alpha, intra.bw / 2)  # each dimension's ring uses half the channels
            first = flat_estimates(op, cols, nbytes, line)["ring"]
            est[f"torus:{rows}x{cols}"] = first + flat_estimates(op, rows, nbytes / cols, line)["ring"]
    else:
        inter = inter_link(shape, topo, instance, ranks_per_node)
        m, k = shape.per_node, shape.nodes
        est = flat_estimates(op, n, nbytes, inter)  # flat across hosts: every step at network speed
        est.pop("direct", None)
        pipelined = topo.graph in ("switch", "nvswitch")
        if op == "all_to_all" and m > 1:
            est = {"pairwise": _split_all_to_all(n, m, nbytes, intra, inter)}
        if pipelined and m == 1 and op in ("all_reduce", "all_gather", "reduce_scatter"):
            # one GPU per node (a DP group across rails): NCCL's ring and (all-reduce) tree, no halving-doubling
            est = {"ring": est["ring"]}
            if op == "all_reduce":
                est["tree"] = _tree(k, 1, nbytes, intra, inter)
        if m > 1 and op in ("all_reduce", "all_gather", "reduce_scatter"):
            protocols = tuple(getattr(instance, "network_protocols", None) or ("simple",)) if pipelined else ("simple",)
            est["ring"] = _node_ring(op, n, k, m, nbytes, intra, inter, protocols)
            if pipelined:  # NCCL: the node-laid ring and (all-reduce) the double binary tree; no rhd, no flat ring
                est = {"ring": est["ring"]}
                if op == "all_reduce":
                    nvls = getattr(instance, "nvls_efficiency", 0.0) or 0.0
                    est["nvls_tree" if nvls else "tree"] = _tree(k, m, nbytes, intra, inter, nvls)
            else:
                stages = [
                    _split(o, size, nbytes_, link)
                    for o, size, nbytes_, link in _hierarchical_stages(op, m, k, nbytes, intra, inter)
                ]
                est["hierarchical"] = sum(s[0] + s[1] for s in stages)
        ramp = inter.ramp * nbytes / (nbytes + inter.ramp_bytes) if inter.ramp else 0.0
        # pipelined (NCCL on switched nodes): the ramp is the tree pipeline's fill and drain, once per tree level,
        # which a ring does not pay; otherwise it is the network's cost per transfer, which every algorithm crossing
        # nodes pays
        est = {name: t + (ramp if name in ("tree", "nvls_tree") else 0.0 if pipelined else ramp) for name, t in est.items()}
    overhead = (
        getattr(instance, "collective_overhead_us", 0.0) + getattr(instance, "collective_overhead_per_rank_us", 0.0) * (n - 1)
    ) * 1e-6
    est = {name: t + overhead for name, t in est.items()}
    best = min(est, key=lambda name: est[name])
    return best, est[best], est


def _switched_node(op: str, n: int, nbytes: float, intra: Link, flat: dict[str, float], instance: Any) -> dict[str, float]:
    """NCCL's algorithms inside one switched GPU node: the ring (a one-shot or halving-doubling exchange is not among
    them; all-to-all sends to every peer at once) and, for all-reduce on a switch that reduces in the fabric, NVLS: each GPU writes its S bytes into the
    switch's multicast buffer and reads the reduced S back, at ``nvls_efficiency`` of its port (tuning.cc:
    nvlsEfficiency, 0.85 on Hopper), after ``nvls_latency_us`` (tuning.cc: hwLatencies NVLINK/NVLS, 25 µs)."""
    # The ramp (device_link.ramp_us at most, half of it at ramp_bytes): what a message below the saturating size
    # costs beyond the alpha-beta terms. NCCL runs a small message on fewer channels (src/enqueue.cc,
    # topoGetAlgoInfo: nc-- while nBytes < nc * nThreads * threadThreshold) in smaller chunks (calcCollChunking:
    # chunk / 2 or / 4 below 8 steps' worth), so its bandwidth grows with the size and its pipeline through the
    # ring's steps fills and drains over a chunk that grows with it; NCCL's own tuning model leaves this out
    # (src/graph/tuning.cc: "waiting for proper chunk modeling").
    ramp = intra.ramp * nbytes / (nbytes + intra.ramp_bytes) if intra.ramp else 0.0
    if op == "all_to_all":  # the n-1 transfers at once through the switch, one latency
        return {"pairwise": intra.alpha + (n - 1) / n * nbytes / intra.bw + ramp}
    est = {"ring": flat["ring"] + ramp} if "ring" in flat else {k: v + ramp for k, v in flat.items()}
    eff = getattr(instance, "nvls_efficiency", 0.0) or 0.0
    if op == "all_reduce" and eff > 0:
        est["nvls"] = getattr(instance, "nvls_latency_us", 0.0) * 1e-6 + nbytes / (intra.bw * eff) + ramp
    return est


def _split_all_to_all(n: int, m: int, nbytes: float, intra: Link, inter: Link) -> float:
    """All-to-all of S bytes per rank over m ranks on each of n/m nodes: S/n goes to each peer, all at once (NCCL
    groups the sends and receives), (m-1)/n·S over the node's links and (n-m)/n·S through its network (inter.bw is
    this rank's share of the NICs); the two parts run side by side, the slower sets the time."""
    inside = (m - 1) / n * nbytes / intra.bw
    across = (n - m) / n * nbytes / inter.bw + (n - m) * inter.message
    return intra.alpha + inter.alpha + max(inside, across)


def _tree(k: int, m: int, nbytes: float, intra: Link, inter: Link, nvls: float = 0.0) -> float:
    """NCCL's double binary tree all-reduce across k nodes (tuning.cc): latency 2·((m-1)·α_intra + ⌈log2 k⌉·α_net);
    each node sends and receives 2·S through its NICs (interior in one tree, leaf in the other, each tree carrying half
    of S up and down; on two nodes S, where tuning.cc doubles the tree's inter-node bandwidth), pipelined with the part inside the node: a chain through the m GPUs (each sends
    S up and S down at the intra link's bandwidth), or with NVLS (``nvls`` > 0, NCCL's NVLS_TREE) one pass through
    the switch (S each way at ``nvls`` of the port; latency one NVLS step instead of the chain's m-1 hops)."""
    node_bw = inter.bw * m  # the node's NICs together
    network = (nbytes if k == 2 else 2 * nbytes) / node_bw
    if m == 1:  # one rank per node: the tree of nodes alone
        return 2 * _log2(k) * inter.alpha + network
    if nvls:
        return 2 * _log2(k) * inter.alpha + intra.alpha + max(network, nbytes / (intra.bw * nvls))
    return 2 * ((m - 1) * intra.alpha + _log2(k) * inter.alpha) + max(network, 2 * nbytes / intra.bw)


# NCCL's three protocols as its tuning model prices a ring (src/graph/tuning.cc at 5067397c, ncclTopoTuneModel):
# the hardware latency of one ring step over NVLink and over the network (hwLatencies NVLINK / NET, Ring), the
# per-call base latency (baseLatencies, Ring), the fraction of the link bandwidth the protocol carries (LL sends
# 8-byte lines of 4 data + 4 flag bytes: busBw · 0.5; LL128 120 of every 128 bytes: 0.92), and the factor on the
# network post of every step (getNetOverhead × 3 with Simple only). The fitted network latency and per-call cost are
# Simple's (the protocol large transfers run); LL / LL128 differ from them by NCCL's constant differences.
NCCL_RING_PROTOCOLS = {
    # name: (NVLink step µs, network step µs, base latency µs, bandwidth fraction, post factor)
    "ll": (0.6, 2.7, 6.6, 0.5, 1.0),
    "ll128": (1.9, 4.0, 14.0, 0.92, 1.0),
    "simple": (3.4, 14.0, 8.4, 1.0, 3.0),
}


def _node_ring(
    op: str, n: int, k: int, m: int, nbytes: float, intra: Link, inter: Link, protocols: tuple[str, ...] = ("simple",)
) -> float:
    """A ring laid out node by node (m ranks on each of k nodes, NCCL's ring across nodes): of its 2(n-1) steps
    (n-1 for all-gather / reduce-scatter) only 2(k-1) (k-1) cross nodes and pay the network's latency; each step moves
    S/n per rank, over NVLink/NeuronLink inside a node and, at each node boundary, through the node's network
    (its m ranks' share of the NICs together: 2(n-1)/n·S leave each node in all, against the hierarchical
    algorithm's 2(k-1)/k·S). The steps inside a node take at least ``inter.post``: the ring's steps run in lockstep
    and each one waits for the host to post the network send of the step at the node boundary (NCCL's tuning model,
    src/graph/tuning.cc ncclTopoTuneModel: "Inter-node rings still have to launch nsteps * net overhead", intraLat =
    max(intraLat, netOverhead), getNetOverhead 1 µs on Intel and 2 µs on AMD hosts, ×3 with the Simple protocol).

    ``protocols``: the NCCL protocols allowed across the network (NCCL_RING_PROTOCOLS); each is priced and the
    cheapest taken, as NCCL's tuner does: LL and LL128 post each step once and have shorter network latencies,
    Simple carries the full bandwidth. The result is relative to Simple's per-call cost (which the caller adds)."""
    steps = (2 if op == "all_reduce" else 1) * (n - 1)
    crossing = (2 if op == "all_reduce" else 1) * (k - 1)
    chunk = nbytes / n
    transfer = steps * max(chunk / (inter.bw * m), chunk / intra.bw)
    _, simple_net, simple_base, _, _ = NCCL_RING_PROTOCOLS["simple"]
    best = math.inf
    for name in protocols:
        nvlink, net, base, share, post = NCCL_RING_PROTOCOLS[name]
        inside = max(intra.alpha, nvlink * 1e-6, post * inter.post)
        across = max(net * 1e-6, inter.alpha + (net - simple_net) * 1e-6)
        t = (base - simple_base) * 1e-6 + (steps - crossing) * inside + crossing * across + transfer / share
        best = min(best, t)
    return best


def _hierarchical_stages(op: str, m: int, k: int, nbytes: float, intra: Link, inter: Link) -> list[tuple[str, int, float, Link]]:
    """(op, ranks, bytes, link) of each stage: all-reduce = intra reduce-scatter, inter all-reduce of S/m, intra
    all-gather; all-gather / reduce-scatter = the intra stage and the inter stage of S/m."""
    if op == "all_reduce":
        return [("reduce_scatter", m, nbytes, intra), ("all_reduce", k, nbytes / m, inter), ("all_gather", m, nbytes, intra)]
    return [(op, m, nbytes, intra), (op, k, nbytes / m, inter)]


def _split(op: str, n: int, nbytes: float, link: Link) -> tuple[float, float]:
    """(latency, transfer) seconds of the cheapest flat algorithm for one stage."""
    est = flat_estimates(op, n, nbytes, link)
    best = min(est, key=lambda name: est[name])
    latency = flat_estimates(op, n, nbytes, Link(link.alpha, math.inf, link.hops, link.rhd_hops))[best]
    return latency, est[best] - latency


def bus_bandwidth(op: str, n: int, nbytes: float, seconds: float) -> float:
    """nccom-test / nccl-tests bus bandwidth (bytes/s) for a measured or estimated time."""
    if seconds <= 0 or n <= 1:
        return 0.0
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_to_all": (n - 1) / n,
    }.get(op, 1.0)
    return nbytes / seconds * factor
