"""``nxdt plan --against RUN_DIR``: the plan's predictions beside what a finished run measured.

The run's own ``config.yaml`` is planned again (with the host calibration when ``--calibration PATH|auto`` asks
for one, so a ``comm-test --calibrate`` after the run can count), then compared with the run's files:

- step time: the median ``step_time_s`` of ``metrics.csv`` after ``warmup`` steps (the first steps include
  start-up work no plan models);
- collectives, from the Chrome traces of ``exp_manager.trace=true`` (``trace/rank<k>.json``, written by
  nxdt.comm's tracer): every collective the cost model prices, keyed by the dimension of its group, the operation
  and the buffer size; measured = the median duration over all ranks and calls, predicted = the cost model for that
  group, operation and size; calls per step = rank 0's calls / the steps in metrics.csv, beside the plan's count
  where the plan models that collective (same dimension, operation and size); the collectives the plan models,
  per step: predicted time × the plan's calls beside the median time × the run's calls.
Nothing here changes the run directory.
"""

from __future__ import annotations

import csv
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

from nxdt.config import ConfigError, load_run_config
from nxdt.planner import node_topology, plan
from nxdt.planner.cost import OPS, estimate_collective

METRICS, TRACE_DIR, CONFIG = "metrics.csv", "trace", "config.yaml"
TRACE_LIMIT = 1 << 30  # bytes of one rank's Chrome trace read back (a long traced run writes hundreds of MB)


def step_times(run_dir: Path) -> list[float]:
    """``step_time_s`` of every row of the run's metrics.csv, in order."""
    from nxdt.launch.runs import read_run_text

    path = run_dir / METRICS
    if not path.is_file():
        raise ConfigError("--against", str(run_dir), f"no {METRICS} there; pass a run directory written by `nxdt train`")
    try:  # a run directory may be crafted: read as `nxdt runs` reads it (no link, no FIFO, size-capped)
        rows = csv.DictReader(read_run_text(path).splitlines())
        times = [_float(row.get("step_time_s")) for row in rows]
    except (OSError, csv.Error) as exc:
        raise ConfigError("--against", str(run_dir), f"{METRICS} cannot be read: {exc}") from None
    return [t for t in times if t is not None and math.isfinite(t) and t > 0]


def _float(text: Any) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def measured_step_time(times: list[float], warmup: int) -> float:
    """Median step time after ``warmup`` steps (all steps when the run has no more than that)."""
    kept = times[warmup:] if len(times) > warmup else times
    return statistics.median(kept)


def group_dim(name: str) -> str:
    """The dimension of a communicator name: ``tp0`` → ``tp``, ``dp3`` → ``dp``, ``world`` → ``world``."""
    return re.sub(r"\d+$", "", name)


def trace_collectives(run_dir: Path) -> dict[tuple[str, str, int], dict[str, Any]]:
    """``(dim, op, bytes)`` → durations (seconds, every rank and call) and rank 0's number of calls, for every traced
    collective the cost model prices. {} when the run was not traced."""
    files = sorted((run_dir / TRACE_DIR).glob("rank*.json"))
    out: dict[tuple[str, str, int], dict[str, Any]] = {}
    from nxdt.launch.runs import read_run_file

    for path in files:
        try:  # a trace as nxdt writes it; anything else (crafted, cut short) is named, not a traceback
            rank = int(path.stem.removeprefix("rank"))
            for event in json.loads(read_run_file(path, TRACE_LIMIT))["traceEvents"]:
                args = event.get("args") or {}
                if event.get("ph") != "X" or event.get("name") not in OPS or "group" not in args:
                    continue
                key = (group_dim(str(args["group"])), event["name"], int(args.get("bytes") or 0))
                entry = out.setdefault(key, {"durations": [], "rank0_calls": 0})
                entry["durations"].append(float(event["dur"]) * 1e-6)
                entry["rank0_calls"] += rank == 0
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError("--against", str(run_dir), f"{path.name} is not a trace nxdt wrote ({exc})") from None
    return out


def _group(the_plan: Any, dim: str) -> list[int]:
    if dim == "world":
        return list(range(the_plan.world_size))
    groups = the_plan.groups.get(dim)
    return list(groups[0]) if groups else []


def _ratio(predicted: float, measured: float) -> float | None:
    return predicted / measured if measured > 0 else None


def compare(run_dir: str | Path, calibration: dict[str, Any] | None, warmup: int = 1) -> dict[str, Any]:
    """The comparison as a JSON-able dict (see the module docstring); ConfigError for a directory that is no run."""
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG).is_file():
        raise ConfigError("--against", str(run_dir), f"no {CONFIG} there; pass a run directory written by `nxdt train`")
    if warmup < 0:
        raise ConfigError("--warmup", warmup, "must be 0 or more steps")
    times = step_times(run_dir)
    if not times:
        raise ConfigError("--against", str(run_dir), f"{METRICS} has no step yet; compare after the run logged steps")
    cfg = load_run_config(run_dir / CONFIG)
    topo = node_topology(cfg)
    calibration = calibration if topo.graph == "host" else None
    the_plan = plan(cfg, calibration)
    est = the_plan.estimate
    measured_step = measured_step_time(times, warmup)
    steps = len(times)
    traced = trace_collectives(run_dir)
    planned = {(r["dim"], r["op"], int(r["bytes"])): r["count"] for r in the_plan.collectives}
    rows = []
    for (dim, op, nbytes), entry in sorted(traced.items()):
        group = _group(the_plan, dim)
        if len(group) < 2:
            continue
        _, predicted, _ = estimate_collective(op, group, nbytes, topo, cfg.instance, the_plan.ranks_per_node, calibration)
        measured = statistics.median(entry["durations"])
        rows.append(
            {
                "dim": dim,
                "op": op,
                "bytes": nbytes,
                "ranks": len(group),
                "calls_per_step": entry["rank0_calls"] / steps,
                "planned_calls_per_step": planned.get((dim, op, nbytes)),
                "measured_s": measured,
                "predicted_s": predicted,
                "ratio": _ratio(predicted, measured),
            }
        )
    modelled = [r for r in rows if r["planned_calls_per_step"] is not None]  # what the plan's step time counts
    measured_comm = sum(r["measured_s"] * r["calls_per_step"] for r in modelled)
    predicted_comm = sum(r["predicted_s"] * r["planned_calls_per_step"] for r in modelled)
    return {
        "run_dir": str(run_dir),
        "instance": cfg.instance.name,
        "world_size": the_plan.world_size,
        "calibrated": est["calibrated"],
        "calibration": est.get("calibration"),  # the file and when it was measured, when asked for
        "steps": steps,
        "warmup": warmup if steps > warmup else 0,
        "traced": bool(traced),
        "step_time": {
            "predicted_s": est["step_time_s"],
            "measured_s": measured_step,
            "ratio": _ratio(est["step_time_s"], measured_step),
        },
        "collective_time_per_step": {
            "predicted_s": predicted_comm,
            "measured_s": measured_comm,
            "ratio": _ratio(predicted_comm, measured_comm),
        }
        if modelled
        else None,
        "collectives": rows,
    }


def _time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def _r(ratio: float | None) -> str:
    return "-" if ratio is None or not math.isfinite(ratio) else f"{ratio:.2f}"


def _source(report: dict[str, Any]) -> str:
    """Where the plan's figures come from: the calibration asked for (file, when measured), else the catalogue."""
    used = report.get("calibration")
    if not report["calibrated"] or not used:
        return "catalogue figures"
    return f"calibration {used.get('file')} measured {used.get('date')}"


def render(report: dict[str, Any]) -> str:
    """The comparison as text: step time, collective time per step, then one line per traced collective."""
    lines = [
        f"plan vs run {report['run_dir']} ({report['world_size']} ranks on {report['instance']}, "
        f"{_source(report)}; {report['steps']} steps, "
        f"median after {report['warmup']} warm-up)",
        f"{'':28}{'predicted':>12}{'measured':>12}{'pred/meas':>11}",
    ]
    rows = [("step time", report["step_time"])]
    if report["collective_time_per_step"]:
        rows.append(("planned collectives per step", report["collective_time_per_step"]))
    for label, v in rows:
        lines.append(f"{label:28}{_time(v['predicted_s']):>12}{_time(v['measured_s']):>12}{_r(v['ratio']):>11}")
    if not report["traced"]:
        lines.append("per collective: no trace in this run (train with exp_manager.trace=true to compare each collective)")
        return "\n".join(lines)
    lines += [
        "",
        "per collective (median over ranks and calls; calls per step: run / plan)",
        f"{'dim':6}{'op':16}{'bytes':>12}{'ranks':>6}{'calls/step':>16}{'predicted':>12}{'measured':>12}{'pred/meas':>11}",
    ]
    for r in report["collectives"]:
        planned = r["planned_calls_per_step"]
        calls = f"{r['calls_per_step']:g} / " + ("-" if planned is None else f"{planned:g}")
        lines.append(
            f"{r['dim']:6}{r['op']:16}{r['bytes']:>12}{r['ranks']:>6}{calls:>16}{_time(r['predicted_s']):>12}"
            f"{_time(r['measured_s']):>12}{_r(r['ratio']):>11}"
        )
    return "\n".join(lines)
