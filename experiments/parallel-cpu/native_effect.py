"""What the native shm path (nxdt/comm/_native.c) does to training steps: TP2×DP2 (experiments/parallel-cpu's
layout, 4 ranks) and FSDP2 (experiments/fsdp-overlap's model and layout, 2 ranks, no link emulation), each with
the native path and with the torch fallback, interleaved in one run.

    python experiments/parallel-cpu/native_effect.py --rounds 3      # ≈ 8 min on 2 cores; writes native_effect.json

The fallback runs this same checkout's code without its C extension: a copy of ``nxdt/`` minus ``_native*.so``
first on PYTHONPATH, so ``nxdt.comm.native.lib`` is None in every rank — the path ``init_process(native=False)``
forces and a machine without a compiler takes (each run checks which one it got). The variants alternate round
after round with the order rotated, so the host's drift hits both alike. Step times: parallel-cpu's (rank 0's
wall time between consecutive ``on_train_batch_end``) and fsdp-overlap's (``step_time_s`` in metrics.csv), the
steps after the warm-up, pooled over rounds.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "experiments" / "fsdp-overlap"))
from run import LAYOUTS, MODEL as FSDP_MODEL  # noqa: E402  (fsdp-overlap's model and FSDP2 layout)

PATHS = ("native", "fallback")


def fallback_tree(tmp: Path) -> Path:
    """This checkout's nxdt without the built extension."""
    shutil.copytree(REPO / "nxdt", tmp / "nxdt", ignore=shutil.ignore_patterns("_native*.so", "__pycache__"))
    return tmp


def env_for(path: str, tree: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if path == "fallback":
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    return env


def check_path(path: str, env: dict, cwd: Path) -> None:
    """Which path a run in ``env`` takes (from ``cwd``: not this checkout, which ``python -c`` would put first)."""
    built = subprocess.run(
        [sys.executable, "-c", "from nxdt.comm import native; print(native._built is not None)"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if built != str(path == "native"):
        raise SystemExit(f"{path}: the extension is {'built' if built == 'True' else 'missing'} in this environment")


def tp2_dp2(env: dict, steps: int, warmup: int, work: Path) -> list[float]:
    out = work / "tp.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "bench.py"), "--run", "nxdt TP2xDP2", "--steps", str(steps), "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"TP2xDP2 failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())["step_times"][warmup:]


def fsdp2(env: dict, steps: int, warmup: int, work: Path, tag: str, phases: dict | None = None) -> list[float]:
    """Step times after the warm-up; with ``phases`` (a dict) also the run's traced events of those steps, as
    durations in ms by (category, name, bytes), added to it."""
    run = work / tag
    ranks, overrides, _ = LAYOUTS["FSDP2"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nxdt.cli",
            "train",
            *FSDP_MODEL,
            *overrides,
            "distributed_strategy.fsdp.enabled=true",
            f"trainer.devices={ranks}",
            f"trainer.max_steps={steps}",
            "trainer.log_every_n_steps=1",
            "exp_manager.create_tensorboard_logger=false",
            f"exp_manager.explicit_log_dir={run}",
            f"exp_manager.trace={phases is not None}",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"FSDP2 failed:\n{proc.stderr[-3000:]}")
    times = [float(r["step_time_s"]) for r in csv.DictReader(open(run / "metrics.csv", newline="")) if int(r["step"]) > warmup]
    if phases is not None:
        for rank in range(ranks):
            add_phases(phases, json.loads((run / "trace" / f"rank{rank}.json").read_text()), sum(times))
    return times


def add_phases(phases: dict, trace: dict | list, window_s: float) -> None:
    """Durations (ms) of a rank's traced events in the run's last ``window_s`` seconds (the measured steps;
    events carry no step number), by (category, name, bytes): compute per FSDP unit, its exposed waits, each
    collective and each of its chunks."""
    events = [e for e in (trace["traceEvents"] if isinstance(trace, dict) else trace) if e.get("ph") == "X"]
    end = max(e["ts"] + e["dur"] for e in events)
    for e in events:
        if e["ts"] >= end - window_s * 1e6:
            key = f"{e.get('cat')} {e['name']}" + (f" {e['args']['bytes']} B" if "bytes" in e.get("args", {}) else "")
            phases.setdefault(key, []).append(e["dur"] / 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--layouts", nargs="+", default=["TP2xDP2", "FSDP2"], choices=["TP2xDP2", "FSDP2"])
    p.add_argument("--json", default="native_effect.json", help="results file (in this directory)")
    p.add_argument(
        "--warm-rounds",
        type=int,
        default=1,
        help="unmeasured rounds first: the first launches of a session read cold files and ran up to 1.4× slower",
    )
    p.add_argument(
        "--trace", action="store_true", help="FSDP2 with exp_manager.trace=true: per-phase medians, native vs fallback"
    )
    args = p.parse_args()
    variants = [(layout, path) for layout in args.layouts for path in PATHS]
    times: dict[str, list[list[float]]] = {f"{layout} {path}": [] for layout, path in variants}
    loads = []
    phases: dict[str, dict[str, list[float]]] = {path: {} for path in PATHS}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tree = fallback_tree(work / "fallback")
        envs = {path: env_for(path, tree) for path in PATHS}
        for path in PATHS:
            check_path(path, envs[path], work)
        for r in range(-args.warm_rounds, args.rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for layout, path in order:
                load0 = os.getloadavg()[0]
                start = time.perf_counter()
                if layout == "TP2xDP2":
                    got = tp2_dp2(envs[path], args.steps, args.warmup, work)
                else:
                    traced = phases[path] if args.trace and r >= 0 else None
                    got = fsdp2(envs[path], args.steps, args.warmup, work, f"fsdp-{path}-{r}", traced)
                if r < 0:
                    print(f"warm-up {layout} {path}: {statistics.median(got) * 1e3:.1f} ms (not counted)", flush=True)
                    continue
                times[f"{layout} {path}"].append(got)
                loads.append((f"round {r + 1} {layout} {path}", load0, os.getloadavg()[0]))
                print(
                    f"round {r + 1} {layout:8s} {path:8s} median step {statistics.median(got) * 1e3:7.1f} ms "
                    f"({time.perf_counter() - start:4.0f} s wall, load {load0:.1f} → {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    rows = {}
    for name, rounds in times.items():
        pooled = sorted(t for rd in rounds for t in rd)
        q1, med, q3 = statistics.quantiles(pooled, n=4)
        rows[name] = {
            "median_ms": med * 1e3,
            "p25_ms": q1 * 1e3,
            "p75_ms": q3 * 1e3,
            "round_medians_ms": [statistics.median(rd) * 1e3 for rd in rounds],
        }
    print(f"\n{'variant':<18} {'median ms':>10} {'IQR ms':>17}  round medians")
    for name, row in rows.items():
        print(
            f"{name:<18} {row['median_ms']:>10.1f} {row['p25_ms']:>8.1f}–{row['p75_ms']:<8.1f} "
            + " ".join(f"{x:.1f}" for x in row["round_medians_ms"])
        )
    ratios = {
        f"{layout}: native / fallback step time": rows[f"{layout} native"]["median_ms"] / rows[f"{layout} fallback"]["median_ms"]
        for layout in args.layouts
    }
    # each round's native median over the same round's fallback median: the two ran minutes apart at most
    paired = {
        layout: [
            n / f for n, f in zip(rows[f"{layout} native"]["round_medians_ms"], rows[f"{layout} fallback"]["round_medians_ms"])
        ]
        for layout in args.layouts
    }
    for k, v in ratios.items():
        print(f"{k:42s} {v:6.3f}")
    for layout, rs in paired.items():
        print(f"{layout}: per-round native / fallback  " + " ".join(f"{x:.3f}" for x in rs))
    phase_rows = {}
    if args.trace:  # the phases that take the most fallback time, both ranks, every measured round pooled
        native_ph, fallback_ph = phases["native"], phases["fallback"]
        print(f"\n{'FSDP2 traced phase':<44} {'native ms':>10} {'fallback ms':>12} {'events':>11}")
        for key in sorted(set(native_ph) & set(fallback_ph), key=lambda k: -sum(fallback_ph[k]))[:14]:
            a, b = native_ph[key], fallback_ph[key]
            phase_rows[key] = {
                "native_median_ms": statistics.median(a),
                "fallback_median_ms": statistics.median(b),
                "events": [len(a), len(b)],
            }
            print(f"{key:<44} {statistics.median(a):>10.2f} {statistics.median(b):>12.2f} {len(a):>5d}/{len(b):<5d}")
    (HERE / args.json).write_text(
        json.dumps(
            {
                "steps": args.steps,
                "warmup": args.warmup,
                "rounds": args.rounds,
                "loads": loads,
                "variants": rows,
                "ratios": ratios,
                "paired_round_ratios": paired,
                "warm_rounds": args.warm_rounds,
                "fsdp2_phases": phase_rows,
                "raw_step_times": times,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
