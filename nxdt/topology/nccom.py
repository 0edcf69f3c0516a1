"""nccom-test's table, as nxdt's collectives benchmark prints and writes it: operation names, message sizes, bus-bandwidth
factors, the rank layout line and the JSON report. Shared by the measured benchmark (``nxdt.comm.bench``) and the cost
model's prediction of the same table (``nxdt comm-test --estimate``), which runs nothing and so imports no torch:
this module imports nothing but the standard library.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any, NoReturn

OPS = ("allr", "allg", "redsct", "alltoall", "bcast", "reduce", "sendrecv")
OP_TITLES = {
    "allr": "all_reduce",
    "allg": "all_gather",
    "redsct": "reduce_scatter",
    "alltoall": "all_to_all",
    "bcast": "broadcast",
    "reduce": "reduce",
    "sendrecv": "send_recv",
}
# bytes per element of each ``-d`` data type (nxdt.comm.bench.DTYPES: the torch dtypes of the same names)
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int32": 4, "int64": 8, "uint8": 1}
_UNITS = {"": 1, "b": 1, "kb": 1 << 10, "k": 1 << 10, "mb": 1 << 20, "m": 1 << 20, "gb": 1 << 30, "g": 1 << 30}


class OneLineParser(argparse.ArgumentParser):
    """argparse whose refusal of a bad argument is one line (its own message and where the options are listed),
    exit 2, not the whole usage block before it: bad input is one line everywhere in nxdt. Every nxdt command
    parsed by argparse uses it (comm-test and its --estimate / --calibrate, topo, data convert-megatron)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} ({self.prog} --help lists the options)\n")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?b?)\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"size {text!r}: use a number with an optional unit, e.g. 1024, 1kb, 64mb")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def bus_factor(op: str, n: int) -> float:
    if op == "allr":
        return 2 * (n - 1) / n
    if op in ("allg", "redsct", "alltoall"):
        return (n - 1) / n
    return 1.0


def sizes(minbytes: int, maxbytes: int, factor: float) -> list[int]:
    out, s = [], max(1, minbytes)
    while s <= maxbytes:
        out.append(s)
        s = int(s * factor) if factor > 1 else s + max(1, int(-factor or 1))
    return out


def ranks_per_node(nworkers: int, nodes: int) -> int:
    """nccom-test's split: ``-r`` ranks in all, divided equally over ``-N`` nodes. ValueError (one line) otherwise."""
    if nodes < 1:
        raise ValueError(f"-N {nodes}: need at least one node")
    if nworkers < 2:
        raise ValueError(f"-r {nworkers}: need at least 2 ranks (-r is the total number of ranks over all nodes)")
    if nworkers % nodes:
        per = max(1, round(nworkers / nodes))
        raise ValueError(
            f"-r {nworkers} ranks do not divide equally over -N {nodes} nodes: -r is the total number of ranks, "
            f"as in nccom-test (e.g. -r {per * nodes} -N {nodes} runs {per} on each node)"
        )
    return nworkers // nodes


def layout_text(host_ids: list[Any]) -> str:
    """``host 0: ranks [0, 1] | host 1: ranks [2, 3]`` from the host of each rank."""
    hosts: dict[Any, list[int]] = {}
    for r, h in enumerate(host_ids):
        hosts.setdefault(h, []).append(r)
    return " | ".join(f"host {i}: ranks {g}" for i, g in enumerate(hosts.values()))


def algorithm_bands(by_size: dict[int, str]) -> str:
    """``ring (1KB–64KB); rhd (256KB)``: the algorithm of each size, as runs of sizes."""
    bands: dict[str, list[int]] = {}
    for size, name in sorted(by_size.items()):
        bands.setdefault(name, []).append(size)
    return "; ".join(
        f"{name} ({_size_text(min(s))}–{_size_text(max(s))})" if len(s) > 1 else f"{name} ({_size_text(s[0])})"
        for name, s in bands.items()
    )


def _size_text(nbytes: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes}B"


def report_json(report: dict, nworkers: int, nodes: int, transport: str) -> str:
    """``--report-to-json-file``'s text: the run's settings and rows (measured, or predicted by ``--estimate``), one
    layout. The caller writes it (``nxdt.config.validate.write_output_file``: never through a link, nor into a
    system directory)."""
    report = {"nworkers": nworkers, "nodes": nodes, "transport": transport, **report}
    report["memcpy"] = {str(k): v for k, v in report.get("memcpy", {}).items()}
    if "algorithms" in report:
        report["algorithms"] = {str(k): v for k, v in report["algorithms"].items()}
    return json.dumps(report, indent=1)
