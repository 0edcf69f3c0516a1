"""Host calibration for the ``cpu`` instance, and cost-model tables in nccom-test's layout.

``nxdt comm-test --calibrate`` measures this host's collectives (and a small transformer's achieved
FLOP/s); ``fit_calibration`` turns the measurements into ``T(op, n, S) = a + S·b`` per op and group
size, stored as JSON (default ``$XDG_CACHE_HOME/nxdt/calibration-<host>.json``). A plan uses a calibration only when
asked (``nxdt plan --calibration PATH|auto``, the same flag on ``plan --against`` and ``comm-test --estimate``;
``auto``: this host's default file), never because a file happens to exist, and says which file it used and when it
was measured (``Plan.estimate["calibration"]``, the printed plan's ``calibration:`` line).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np

from nxdt.config.validate import ConfigError, read_json_object
from nxdt.planner.cost import bus_bandwidth, estimate_collective
from nxdt.topology import Topology

BENCH_OPS = {
    "allr": "all_reduce",
    "allg": "all_gather",
    "redsct": "reduce_scatter",
    "alltoall": "all_to_all",
    "bcast": "broadcast",
    "sendrecv": "send_recv",
}


def default_path() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "nxdt" / f"calibration-{socket.gethostname()}.json"


AUTO = "auto"  # --calibration auto: this host's default file


def load_calibration(path: str | Path | None) -> dict[str, Any] | None:
    """The calibration the user asked for: None when not asked (``path`` None), the file ``path``, or with ``auto``
    this host's default file; either must exist. The returned data also names its ``file``."""
    if path is None:
        return None
    target = default_path() if str(path) == AUTO else Path(path).expanduser()
    if not target.is_file():
        if str(path) == AUTO:
            raise ConfigError(
                "--calibration", AUTO, f"no calibration of this host at {target}; write one with `nxdt comm-test --calibrate`"
            )
        what = "not a regular file (a FIFO, device or directory)" if target.exists() else "no such file"
        raise ConfigError("--calibration", str(path), f"{what}; write one with `nxdt comm-test --calibrate`")
    try:
        data = read_json_object(target)  # size-capped, no FIFO blocked on
        assert isinstance(data.get("ops"), dict)
    except (OSError, ValueError, AssertionError, AttributeError) as exc:
        why = f" ({exc.strerror or exc})" if isinstance(exc, OSError) else f" ({exc})" if str(exc) else ""
        raise ConfigError(
            "--calibration", str(target), f"not a calibration file{why}; rewrite it with `nxdt comm-test --calibrate`"
        ) from None
    return {**data, "file": str(target)}


def provenance(calibration: dict[str, Any]) -> dict[str, Any]:
    """What a plan records of the calibration it used: the file, when and where it was measured."""
    return {"file": calibration.get("file"), "date": calibration.get("date"), "host": calibration.get("host")}


def fit_line(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """``T = a + S·b`` minimising the relative error (each point weighted by 1/T), a, b ≥ 0."""
    s, t = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float)
    design = np.stack([np.ones_like(s), s], axis=1) / t[:, None]
    (a, b), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if a < 0 or b < 0:  # fall back to the two ends of the sweep
        b = max((t[-1] - t[0]) / max(s[-1] - s[0], 1.0), 0.0)
        a = max(t[0] - s[0] * b, 0.0)
    return float(a), float(b)


def fit_calibration(reports: dict[int, dict[str, Any]], flops_per_s: float | None = None, flops_ranks: int = 2) -> dict[str, Any]:
    """Calibration JSON from ``nxdt comm-test`` reports keyed by group size; ``flops_per_s``: one rank's rate
    while ``flops_ranks`` ranks computed at once on this host's ``cpus`` cores."""
    ops: dict[str, dict[str, list[float]]] = {}
    for n, report in reports.items():
        for op in dict.fromkeys(r["op"] for r in report["results"]):
            rows = [r for r in report["results"] if r["op"] == op]
            a, b = fit_line([r["size(B)"] for r in rows], [r["time:avg(us)"] * 1e-6 for r in rows])
            ops.setdefault(BENCH_OPS[op], {})[str(n)] = [a, b]
    ar = ops.get("all_reduce", {})
    a, b = ar[min(ar, key=int)] if ar else (1e-5, 2.5e-10)
    n = int(min(ar, key=int)) if ar else 2
    # effective alpha/bw of a 2-step ring with these end points (used for ops without their own fit)
    return {
        "host": socket.gethostname(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "latency_s": a / 2,
        "bandwidth_Bps": (2 * (n - 1) / n) / b if b else 1e12,
        "ops": ops,
        "flops_per_s": flops_per_s,
        "flops_ranks": flops_ranks,
        "cpus": os.cpu_count() or 1,
    }


def save_calibration(data: dict[str, Any], path: str | Path | None = None) -> Path:
    target = Path(path).expanduser() if path else default_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    # a new file (O_EXCL | O_NOFOLLOW: never through a planted link) renamed over the target (which replaces a link)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with open(fd, "w") as fh:
            fh.write(json.dumps(data, indent=1))
        tmp.replace(target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def estimate_table(
    op: str,
    sizes: list[int],
    group: list[int],
    topo: Topology,
    instance: Any,
    ranks_per_node: int,
    element_bytes: int,
    calibration: dict | None = None,
) -> list[dict[str, Any]]:
    """Rows of an nccom-test table predicted by the cost model (``nxdt comm-test --estimate``)."""
    rows = []
    for nbytes in sizes:
        algorithm, seconds, _ = estimate_collective(op, group, nbytes, topo, instance, ranks_per_node, calibration)
        rows.append(
            {
                "size(B)": nbytes,
                "count(elems)": nbytes // element_bytes,
                "time:avg(us)": seconds * 1e6,
                "algbw(GB/s)": nbytes / seconds / 1e9 if seconds else 0.0,
                "busbw(GB/s)": bus_bandwidth(op, len(group), nbytes, seconds) / 1e9,
                "algorithm": algorithm,
            }
        )
    return rows
