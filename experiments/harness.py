"""What the side-by-side benchmarks in experiments/ share: their command line and the interleaved rounds.

A benchmark script runs each variant in a fresh process (``script --run NAME --steps N --out FILE``, which writes one
JSON object) and repeats the set ``reps`` times with the order rotated each round, so a slow phase of a shared
machine hits every variant alike. Scripts import this file with ``sys.path.insert(0, str(HERE.parent))``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any


def bench_arguments(description: str, *, steps: int = 25, warmup: int = 5, reps: int = 3) -> argparse.ArgumentParser:
    """The options every interleaved benchmark takes (``--run``/``--out`` are the worker's, hidden)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=steps, help=f"steps per run (default {steps})")
    parser.add_argument("--warmup", type=int, default=warmup, help=f"step intervals skipped per run (default {warmup})")
    parser.add_argument("--reps", type=int, default=reps, help=f"interleaved rounds (default {reps})")
    parser.add_argument("--quick", action="store_true", help="1 round of 8 steps (warm-up 3): validates the script")
    parser.add_argument("--label", default="", help="conditions written into results.json (e.g. 'under load')")
    return parser


def apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.steps, args.warmup, args.reps = 8, 3, 1


def interleaved_runs(script: str, names: list[str], reps: int, steps: int, threads: int) -> dict[str, list[dict[str, Any]]]:
    """Each variant's run results (``load_before`` added: the 1-minute load average when it started), ``reps`` rounds."""
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
    out = Path(script).resolve().parent / f".run-{os.getpid()}.json"
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]  # rotated: slow phases hit every variant
        for name in order:
            load = os.getloadavg()[0]
            proc = subprocess.run(
                [sys.executable, script, "--run", name, "--steps", str(steps), "--out", str(out)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"variant {name!r} failed:\n{proc.stderr[-3000:]}")
            run = json.loads(out.read_text())
            out.unlink()
            run["load_before"] = load
            runs[name].append(run)
            print(
                f"  round {rep + 1}/{reps} {name:<34} median step {statistics.median(run['step_times']) * 1e3:7.1f} ms "
                f"(load {load:.1f})",
                flush=True,
            )
    return runs
