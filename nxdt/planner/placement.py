"""Placement rules: which device orders a node may use and whether every communicator group of a
layout is one the hardware can run. Pure numpy; no processes.

Ranks are cores: rank r runs on logical core ``r % ranks_per_node`` of node ``r // ranks_per_node``
(as Neuron and torchrun number them). What the planner chooses is which ranks form a group: the grid
of parallel dimensions is laid over *positions*, and a device order maps positions to cores.

Device orders (per node, positions → cores), for a 4x4 torus with 2 cores per device (trn1):

* ``identity``: position p is core p. TP=8 groups are torus rows: [0..7] = devices 0-3.
* ``column_rings``: one core per device walking down a column first, as NxD does for trn1 TP=4:
  positions 0,1,2,3 → cores 0, 8, 16, 24 (devices 0, 4, 8, 12, a column ring); DP groups become rows.
* ``row_pairs``: rows visited in the order 0, 3, 1, 2, as NxD's "Logic 2" for trn2 TP=32 at LNC=2
  (TP groups = rows {0,3} and {1,2}, both rings through the wrap-around link), so that two-member
  DP/PP groups pair vertically adjacent devices (0↔4) instead of devices two rows apart (0↔8).

The first order under which every group is valid wins: the instance's preferred order for this TP
degree (``instance.tp_device_orders``), then identity, row_pairs, column_rings.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nxdt.topology import Topology

DEVICE_ORDERS = ("identity", "row_pairs", "column_rings")
CHECKED_DIMENSIONS = ("tp", "cp", "ep", "dp", "pp")


def local_order(name: str, topo: Topology) -> np.ndarray:
    """Cores of one node in visiting order (a permutation of ``range(ranks_per_node)``)."""
    rpd, rpn = topo.ranks_per_device, topo.ranks_per_node
    if name == "identity" or topo.graph not in ("torus2d", "torus3d"):
        return np.arange(rpn)
    rows, cols = topo.grid
    cores = np.arange(rpn).reshape(rows, cols, rpd)  # [row, col, core-in-device]
    if name == "row_pairs":
        order = [r for i in range((rows + 1) // 2) for r in (i, rows - 1 - i)][:rows]
        return cores[order].reshape(-1)
    if name == "column_rings":
        return cores.transpose(1, 2, 0).reshape(-1)  # col, then core, then row fastest
    raise ValueError(f"unknown device order {name!r}; use one of {', '.join(DEVICE_ORDERS)}")


def candidate_orders(instance: Any, topo: Topology, tp: int, lnc: int) -> list[str]:
    preferred = instance.tp_device_orders.get(f"{lnc}:{tp}") or instance.tp_device_orders.get(str(tp))
    names = [preferred] if preferred else []
    if topo.graph in ("torus2d", "torus3d"):
        names += [n for n in DEVICE_ORDERS if n not in names]
    return names or ["identity"]


def accepted_sizes(instance: Any, lnc: int) -> set[int] | None:
    """Group sizes (ranks within one node) the runtime accepts at this LNC; None = any."""
    if not instance.group_sizes:
        return None
    scale = instance.lnc_default / lnc
    return {1} | {int(s * scale) for s in instance.group_sizes if s * scale >= 1}


def _pattern_violation(local: np.ndarray, topo: Topology, sizes: set[int] | None) -> str | None:
    """Rule broken by one node's share of a group (local core ids), or None."""
    n = len(local)
    if sizes is not None and n not in sizes:
        return f"{n} ranks per node is not a group size {topo.name} accepts ({', '.join(map(str, sorted(sizes)))})"
    devices, counts = np.unique(local // topo.ranks_per_device, return_counts=True)
    if topo.graph in ("chain", "ring") and n > 1 and n % 2:
        return f"{n} ranks: groups on {topo.name} must hold an even number of ranks on consecutive devices"
    if len(set(counts.tolist())) > 1:
        return f"devices {devices.tolist()} hold unequal numbers of the group's ranks"
    return topo.subring_reason(devices.tolist())


def group_violation(
    groups: np.ndarray, topo: Topology, sizes: set[int] | None, ranks_per_node: int | None = None
) -> tuple[str, list[int]] | None:
    """First rule a set of groups (rows of ranks) breaks, with an offending group; vectorised so that
    planning 100k+ ranks stays fast (only distinct per-node patterns are checked one by one)."""
    count, n = groups.shape
    if n == 1:
        return None
    rpn = ranks_per_node or topo.ranks_per_node  # a job may use only the first cores of each node
    ranks = np.sort(groups, axis=1)
    nodes = ranks // rpn
    per_node = (nodes == nodes[:, :1]).sum(axis=1)
    m = int(per_node[0])
    if (per_node != m).any() or n % m:
        bad = int(np.argmax(per_node != m))
        return "groups spanning nodes must hold the same number of ranks on each node", groups[bad].tolist()
    local = (ranks % rpn).reshape(count, n // m, m)
    if n // m > 1:
        chunk_nodes = nodes.reshape(count, n // m, m)
        if (chunk_nodes != chunk_nodes[:, :, :1]).any() or (local != local[:, :1, :]).any():
            bad = int(np.argmax((local != local[:, :1, :]).any(axis=(1, 2))))
            return "groups spanning nodes must use the same cores on every node", groups[bad].tolist()
    patterns, first = np.unique(local[:, 0, :], axis=0, return_index=True)
    for pattern, index in zip(patterns, first):
        reason = _pattern_violation(pattern, topo, sizes)
        if reason:
            return reason, groups[index].tolist()
    return None
