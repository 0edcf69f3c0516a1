"""Device topology of an instance: which device a rank sits on, who its neighbours are, how far apart
two devices are and which link class joins two ranks. Pure: built from the instance catalogue entry
(conf/instance/*.yaml, schema ``InstanceConfig``); no processes, no torch.

Graphs (``instance.graph``):

* ``host``: worker processes on one CPU host; every pair talks through shared memory.
* ``single``: one device (trn1.2xlarge, inf2.xlarge); its cores talk on-chip.
* ``chain`` / ``ring``: devices 0..n-1 in a line / a cycle (inf2.24xlarge / inf2.48xlarge).
* ``torus2d`` ``[rows, cols]``: device d at (d // cols, d % cols), links to its row and column neighbours
  with wrap-around. Neighbours are listed in neuron-ls order north, west, south, east; on trn1.32xlarge
  device 0 → 12, 3, 4, 1 and device 5 → 1, 4, 9, 6.
* ``torus3d`` ``[rows, cols, depth]``: a torus2d per node, plus a ring along z through the nodes of one
  domain (Trn2 UltraServer: 4 nodes, chips with equal (row, col) form the z ring).
* ``switch`` / ``nvswitch``: every device reaches every other through a switch in one hop.

Link classes between two ranks, cheapest first: ``core`` (same device), ``device`` (same node),
``domain`` (other node of the same scale-up domain), ``network`` (scale-out NICs).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable

GRAPHS = ("host", "single", "chain", "ring", "torus2d", "torus3d", "switch", "nvswitch")
LINK_CLASSES = ("core", "device", "domain", "network")


class TopologyError(ValueError):
    """An instance entry or LNC choice the topology cannot be built from (one line, with the fix)."""


def ranks_per_device(instance: Any, lnc: int | None = None) -> int:
    """Ranks (logical cores) per device at ``lnc`` physical cores per rank."""
    lnc = lnc or instance.lnc_default
    if instance.cores_per_device % lnc:
        raise TopologyError(f"LNC {lnc} does not divide the {instance.cores_per_device} cores of a {instance.name} device")
    return instance.cores_per_device // lnc


def check_lnc(instance: Any, lnc: int | None) -> int:
    """The LNC to use; raises TopologyError for a value the instance does not accept."""
    if lnc is None or lnc == instance.lnc_default:
        return instance.lnc_default
    if not instance.lnc_options:
        raise TopologyError(
            f"instance {instance.name} has no logical-NeuronCore setting (LNC applies to Trn2/Trn3); remove trainer.lnc"
        )
    if lnc not in instance.lnc_options:
        raise TopologyError(f"instance {instance.name} accepts LNC {', '.join(map(str, instance.lnc_options))}")
    return lnc


@dataclass(frozen=True)
class Topology:
    """The intra-node graph of one instance at one LNC, plus the domain (multi-node scale-up) size."""

    name: str
    graph: str
    shape: tuple[int, ...]
    devices: int
    ranks_per_device: int
    domain_nodes: int = 1

    @property
    def ranks_per_node(self) -> int:
        return self.devices * self.ranks_per_device

    # ------------------------------------------------------------------ devices and neighbours
    def device_of(self, local_rank: int) -> int:
        return local_rank // self.ranks_per_device

    def core_ids(self, device: int) -> range:
        """Logical core ids of a device (neuron-ls 'NEURON CORE IDS')."""
        return range(device * self.ranks_per_device, (device + 1) * self.ranks_per_device)

    @property
    def grid(self) -> tuple[int, int]:
        """(rows, cols) of the per-node torus plane."""
        return self.shape[0], self.shape[1]

    def neighbours(self, device: int) -> list[int]:
        """Directly linked devices on the same node; torus order north, west, south, east (neuron-ls)."""
        n = self.devices
        if self.graph in ("torus2d", "torus3d"):
            rows, cols = self.grid
            r, c = divmod(device, cols)
            around = [
                ((r - 1) % rows) * cols + c,
                r * cols + (c - 1) % cols,
                ((r + 1) % rows) * cols + c,
                r * cols + (c + 1) % cols,
            ]
            return list(dict.fromkeys(d for d in around if d != device))  # tiny tori: no duplicates or self-links
        if self.graph == "ring":
            return list(dict.fromkeys(d for d in ((device - 1) % n, (device + 1) % n) if d != device))
        if self.graph == "chain":
            return [d for d in (device - 1, device + 1) if 0 <= d < n]
        if self.graph in ("switch", "nvswitch", "host"):
            return [d for d in range(n) if d != device]
        return []

    def distance(self, a: int, b: int) -> int:
        """Hops between two devices of one node."""
        if a == b:
            return 0
        if self.graph in ("torus2d", "torus3d"):
            rows, cols = self.grid
            (ra, ca), (rb, cb) = divmod(a, cols), divmod(b, cols)
            dr, dc = abs(ra - rb), abs(ca - cb)
            return min(dr, rows - dr) + min(dc, cols - dc)
        if self.graph == "ring":
            d = abs(a - b)
            return min(d, self.devices - d)
        if self.graph == "chain":
            return abs(a - b)
        return 1

    @cached_property
    def mean_distance(self) -> float:
        """Mean hop count over all device pairs (contention of routed, non-neighbour traffic)."""
        n = self.devices
        if n < 2:
            return 1.0
        return sum(self.distance(a, b) for a in range(n) for b in range(n) if a != b) / (n * (n - 1))

    def link_class(self, rank_a: int, rank_b: int) -> str:
        """Cheapest link class joining two global ranks (node-major numbering)."""
        rpn = self.ranks_per_node
        na, nb = rank_a // rpn, rank_b // rpn
        if na != nb:
            return "domain" if self.domain_nodes > 1 and na // self.domain_nodes == nb // self.domain_nodes else "network"
        return "core" if self.device_of(rank_a % rpn) == self.device_of(rank_b % rpn) else "device"

    # ------------------------------------------------------------------ group shapes
    def subring_reason(self, devices: Iterable[int]) -> str | None:
        """None when the set of devices can host one collective group, else the rule it breaks.

        Torus: one device, two direct neighbours, one row or column, two adjacent rows (or columns),
        or the whole node. Ring/chain: consecutive devices. Switched or host graphs: anything."""
        ds = sorted(set(devices))
        k = len(ds)
        if k <= 1 or self.graph in ("host", "single", "switch", "nvswitch"):
            return None
        if self.graph in ("chain", "ring"):
            consecutive = ds == list(range(ds[0], ds[0] + k))
            if self.graph == "ring" and not consecutive:  # may wrap around: the missing devices are consecutive
                missing = sorted(set(range(self.devices)) - set(ds))
                consecutive = not missing or missing == list(range(missing[0], missing[0] + len(missing)))
            return None if consecutive else f"devices {ds} are not consecutive on the {self.graph}"
        rows, cols = self.grid
        if k == 2:
            return None if self.distance(*ds) == 1 else f"devices {ds} are not direct neighbours"
        if k == self.devices:
            return None
        row_sets = [set(range(r * cols, (r + 1) * cols)) for r in range(rows)]
        col_sets = [set(range(c, self.devices, cols)) for c in range(cols)]
        s = set(ds)
        if s in row_sets or s in col_sets:
            return None
        for lines in (row_sets, col_sets):
            n = len(lines)
            for i in range(n):
                if n > 2 and s == lines[i] | lines[(i + 1) % n]:
                    return None
        return (
            f"devices {ds} are not a torus ring (one device, two neighbours, a row or column, two adjacent rows, the whole node)"
        )


def topology_of(instance: Any, lnc: int | None = None, ranks_per_node: int | None = None) -> Topology:
    """The Topology of a catalogue entry. ``host`` graphs take their size from ``ranks_per_node``."""
    if instance.graph not in GRAPHS:
        raise TopologyError(f"instance {instance.name}: graph {instance.graph!r} is not one of {', '.join(GRAPHS)}")
    lnc = check_lnc(instance, lnc)
    if instance.graph == "host":
        n = ranks_per_node or instance.devices
        return Topology(instance.name, "host", (n,), n, 1, instance.domain_nodes)
    shape = tuple(instance.shape) or (instance.devices,)
    if instance.graph in ("torus2d", "torus3d"):
        if len(shape) < 2 or shape[0] * shape[1] != instance.devices:
            raise TopologyError(f"instance {instance.name}: torus shape {list(shape)} does not hold {instance.devices} devices")
    return Topology(
        instance.name, instance.graph, shape, instance.devices, ranks_per_device(instance, lnc), instance.domain_nodes
    )
