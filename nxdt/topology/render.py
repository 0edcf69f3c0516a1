"""Text pictures of a topology for ``nxdt topo``: a neuron-ls ``--topology``-style device table and an
ASCII drawing of the graph (wrap-around links marked ``*``, as neuron-ls does)."""

from __future__ import annotations

import json
from typing import Any

from nxdt.topology import Topology


def _core_span(ids: range) -> str:
    return str(ids.start) if len(ids) == 1 else f"{ids.start}-{ids.stop - 1}"


def device_rows(topo: Topology, instance: Any) -> list[dict[str, Any]]:
    """One record per device: the columns of ``neuron-ls --topology`` (and of ``nxdt topo --json``)."""
    return [
        {
            "device": d,
            "cores": topo.ranks_per_device,
            "core_ids": list(topo.core_ids(d)),
            "memory_GiB": instance.memory_GiB,
            "connected_devices": topo.neighbours(d),
        }
        for d in range(topo.devices)
    ]


def device_table(topo: Topology, instance: Any) -> str:
    headers = [("NEURON", "DEVICE"), ("NEURON", "CORES"), ("NEURON", "CORE IDS"), ("NEURON", "MEMORY"), ("CONNECTED", "DEVICES")]
    if instance.cores_per_device == 1 and not instance.lnc_options:  # GPUs / CPU workers: no Neuron wording
        headers = [("", "DEVICE"), ("", "CORES"), ("", "CORE IDS"), ("", "MEMORY"), ("CONNECTED", "DEVICES")]
    memory = "-" if not instance.memory_GiB else f"{instance.memory_GiB:g} GiB"
    many = topo.graph in ("switch", "nvswitch", "host") and topo.devices > 2
    rows = [
        [
            str(r["device"]),
            str(r["cores"]),
            _core_span(topo.core_ids(r["device"])),
            memory,
            "all (switch)" if many else ", ".join(map(str, r["connected_devices"])),
        ]
        for r in device_rows(topo, instance)
    ]
    widths = [max(len(h[0]), len(h[1]), *(len(r[i]) for r in rows)) + 2 for i, h in enumerate(headers)]
    rule = "+" + "+".join("-" * w for w in widths) + "+"
    out = [rule]
    for line in (0, 1):
        out.append("|" + "|".join(h[line].center(w) for h, w in zip(headers, widths)) + "|")
    out.append(rule)
    out += ["|" + "|".join(f" {cell}".ljust(w) for cell, w in zip(r, widths)) + "|" for r in rows]
    out.append(rule)
    return "\n".join(out)


def _torus_plane(rows: int, cols: int, offset: int = 0) -> list[str]:
    width = len(str(offset + rows * cols - 1))
    cell = lambda d: f"[{d:>{width}}]"
    pad = " " * (len(cell(0)) // 2)
    gap = "--"
    top = "    " + pad + (" " * (len(cell(0)) - 1 + len(gap))).join("*" for _ in range(cols))
    lines = [top]
    for r in range(rows):
        lines.append("*-- " + gap.join(cell(offset + r * cols + c) for c in range(cols)) + " --*")
        if r < rows - 1:
            lines.append("    " + pad + (" " * (len(cell(0)) - 1 + len(gap))).join("|" for _ in range(cols)))
    lines.append(top)
    return lines


def picture(topo: Topology) -> str:
    """ASCII drawing of the per-node graph (``*`` marks a wrap-around link to the opposite end)."""
    n = topo.devices
    if topo.graph in ("single", "host") or n == 1:
        what = "worker processes, shared memory" if topo.graph == "host" else "one device"
        return " ".join(f"[{d}]" for d in range(n)) + f"   ({what})"
    if topo.graph == "chain":
        return "--".join(f"[{d}]" for d in range(n)) + "   (chain: no link between the ends)"
    if topo.graph == "ring":
        return "*--" + "--".join(f"[{d}]" for d in range(n)) + "--*   (ring: * joins the ends)"
    if topo.graph in ("switch", "nvswitch"):
        kind = "NVSwitch" if topo.graph == "nvswitch" else "switch"
        cells = "  ".join(f"[{d}]" for d in range(n))
        lines = [cells, "=" * len(cells), kind.center(len(cells))]
        if topo.domain_nodes > 1:
            lines.append(f"(one node of a {topo.domain_nodes}-node scale-up domain through the same fabric)")
        return "\n".join(lines)
    rows, cols = topo.grid
    lines = [f"{rows}x{cols} torus ('*' = wrap-around link to the opposite edge)"] + _torus_plane(rows, cols)
    if topo.graph == "torus3d":
        lines.append(
            f"z: device d of each of the {topo.domain_nodes} nodes of a domain forms a ring (node k ↔ node k±1, wrapping)"
        )
    return "\n".join(lines)


def topo_json(topo: Topology, instance: Any) -> str:
    return json.dumps(
        {
            "instance": instance.name,
            "graph": topo.graph,
            "shape": list(topo.shape),
            "devices": topo.devices,
            "ranks_per_device": topo.ranks_per_device,
            "domain_nodes": topo.domain_nodes,
            "device_table": device_rows(topo, instance),
        },
        indent=1,
    )
