"""Where ``nxdt train``'s wall time goes, from exec to exit, for the peers' whole-run config (run.py's
``nxdt train (2 ranks)``), phase by phase, and what the whole process tree costs in CPU.

    python experiments/peers/startup.py                  # 3 runs, the phase table; writes startup.json
    python experiments/peers/startup.py --runs 5 --ranks 1 --steps 5 --json /tmp/one.json
    python experiments/peers/startup.py --baseline /tmp/old  # interleaved with an older nxdt tree (git archive REV nxdt)

Each run is one fresh ``python -m nxdt.cli train`` under ``strace -f`` restricted (seccomp) to process events: exec,
fork/clone, exit. The phase boundaries are those events plus what the run directory records:

* the launcher's exec; its start of the fork server (the forkserver interpreter's exec: before the config is composed,
  or after it when the command names the launcher); its start of the local launch (the first fork of
  ``launch_local``, its segment watchdog): before it the launcher composes, imports torch, checks the data and model,
  plans and writes the run directory;
* the fork server's first fork of a worker (before it: the server's interpreter and its imports of torch and
  Lightning, running beside the launcher's own work);
* rank 0's "N workers ready" line (``exp_manager``: the Trainer, the strategy's communicator and the data are set up);
* the end of step 1 and of the last step (``metrics.csv``'s ``wall_time``);
* the workers' and the launcher's ``exit_group``.

``--cpu`` runs each launch a second time under ``perf stat -e task-clock`` (every process of the tree, the fork server
and the watchdog included, whether or not anyone waits for them): the CPU-seconds a launch costs a shared host.
strace's own overhead is a few events per process; the timeline run and the CPU run are separate launches.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run import cli_overrides  # noqa: E402  (the whole-run pair's config, as run.py launches it)

EVENT = re.compile(r"^(\d+) +(\d+\.\d+) (.*)$")
PHASES = [
    ("launcher: exec to the fork server's start", "exec", "server_exec"),
    ("launcher: server's start to the local launch (compose, torch, checks, plan, run dir)", "server_exec", "launch_local"),
    ("fork server: interpreter + torch/Lightning imports", "server_exec", "worker_fork"),
    ("  launcher waiting for the server", "launch_local", "worker_fork"),
    ("workers: fork to ready (config, Trainer, strategy, comm, data)", "worker_fork", "ready"),
    ("first step (ready to step 1's end)", "ready", "step1"),
    ("steady steps (step 1's end to the last's)", "step1", "last_step"),
    ("workers: last step to exit", "last_step", "worker_exit"),
    ("launcher: workers' exit to its own exit", "worker_exit", "launcher_exit"),
    ("total (exec to exit)", "exec", "launcher_exit"),
]


def events(trace: Path) -> dict[str, float]:
    """The phase boundaries found in ``strace -f -ttt`` output."""
    launcher = server = None
    found: dict[str, float] = {}
    workers: list[int] = []
    for line in trace.read_text().splitlines():
        m = EVENT.match(line)
        if not m:
            continue
        pid, t, what = int(m.group(1)), float(m.group(2)), m.group(3)
        if what.startswith("execve(") and "nxdt.cli" in what and launcher is None:
            launcher, found["exec"] = pid, t
        elif what.startswith("execve(") and "multiprocessing.forkserver" in what:
            server, found["server_exec"] = pid, t
        elif pid == launcher and what.startswith("clone(") and "launch_local" not in found and "server_exec" in found:
            found["launch_local"] = t  # launch_local's watchdog: the launcher's first fork after the server's exec
        elif pid == server and what.startswith("clone(") and "CLONE_THREAD" not in what:
            m2 = re.search(r"= (\d+)$", what)
            if m2:
                workers.append(int(m2.group(1)))
                found.setdefault("worker_fork", t)
        elif pid in workers and what.startswith("exit_group("):
            found["worker_exit"] = max(found.get("worker_exit", 0.0), t)
        elif pid == launcher and what.startswith("exit_group("):
            found["launcher_exit"] = t
    return found


def run_dir_events(run_dir: Path, started_at: float) -> dict[str, float]:
    rows = list(csv.DictReader(open(run_dir / "metrics.csv", newline="")))
    found = {"step1": float(rows[0]["wall_time"]), "last_step": float(rows[-1]["wall_time"])}
    ready = re.search(r"workers? ready ([0-9.]+) s after Enter", (run_dir / "logs" / "rank0.log").read_text())
    if ready:  # counted from NXDT_STARTED_AT, the launcher process's start (its exec; printed to 0.1 s)
        found["ready"] = started_at + float(ready.group(1))
    found["step_times"] = [float(r["step_time_s"]) for r in rows]  # type: ignore[assignment]
    return found


def launch(args: argparse.Namespace, work: Path, n: int, mode: str, tree: Path | None = None) -> dict[str, Any]:
    """One launch; ``tree``: a directory holding another ``nxdt`` package, imported instead of this one."""
    run_dir = work / f"run{n}-{mode}"
    overrides = [o for o in cli_overrides(args.steps, run_dir) if not o.startswith("trainer.devices=")]
    cmd = [sys.executable, "-m", "nxdt.cli", "train", *overrides, f"trainer.devices={args.ranks}"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}  # as run.py launches it
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    out = work / f"out{n}-{mode}.txt"
    if mode == "trace":
        trace = work / f"trace{n}.txt"
        wrap = ["strace", "-f", "-ttt", "--seccomp-bpf", "-e", "trace=execve,clone,clone3,vfork,exit_group", "-o", str(trace)]
    else:
        trace = work / f"perf{n}.txt"
        wrap = ["perf", "stat", "-x,", "-e", "task-clock", "-o", str(trace)]
    load = os.getloadavg()[0]
    start = time.time()
    proc = subprocess.run([*wrap, *cmd], env=env, cwd=work, stdout=out.open("w"), stderr=subprocess.STDOUT)
    wall = time.time() - start
    if proc.returncode != 0:
        raise SystemExit(f"run {n} failed:\n{out.read_text()[-3000:]}")
    result: dict[str, Any] = {"wall_s": wall, "load_before": load}
    if mode == "trace":
        found = events(trace)
        found.update(run_dir_events(run_dir, found["exec"]))
        result["step_times"] = found.pop("step_times")
        result["phases"] = {name: found[b] - found[a] for name, a, b in PHASES if a in found and b in found}
    else:
        msec = [line.split(",")[0] for line in trace.read_text().splitlines() if "task-clock" in line]
        result["cpu_s"] = float(msec[0]) / 1e3
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--cpu", action="store_true", help="also the CPU-seconds of each launch (perf stat)")
    parser.add_argument("--cpu-only", action="store_true", help="only the CPU-seconds (no timeline launch)")
    parser.add_argument("--baseline", type=Path, help="a directory holding an older nxdt package: its launches interleaved")
    parser.add_argument("--json", type=Path, default=HERE / "startup.json")
    args = parser.parse_args()
    trees: dict[str, Path | None] = {"this tree": None}
    if args.baseline is not None:
        trees = {"baseline": args.baseline.resolve(), **trees}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.runs):
            order = list(trees)[n % len(trees) :] + list(trees)[: n % len(trees)]  # rotated, as run.py's rounds
            for name in order:
                if args.cpu_only:
                    run = launch(args, Path(tmp), n, "cpu", trees[name])
                    run["phases"] = {}
                else:
                    run = launch(args, Path(tmp), n, "trace", trees[name])
                if args.cpu and not args.cpu_only:
                    run["cpu_s"] = launch(args, Path(tmp), n, "cpu", trees[name])["cpu_s"]
                runs[name].append(run)
                print(
                    f"round {n + 1}/{args.runs} {name}: wall {run['wall_s']:.2f} s, cpu {run.get('cpu_s', float('nan')):.2f} s "
                    f"(load {run['load_before']:.1f})",
                    flush=True,
                )
    names = list(trees)
    print(f"\n| phase (s, median of {args.runs}; the runs) | {' | '.join(names)} |\n|---|{'---|' * len(names)}")
    rows = [(name, lambda r, name=name: r["phases"].get(name)) for name, _, _ in PHASES]
    rows.append(("wall time seen by the caller", lambda r: r["wall_s"]))
    if args.cpu or args.cpu_only:
        rows.append(("CPU-s of the process tree (perf stat)", lambda r: r["cpu_s"]))
    for label, get in rows:
        cells = []
        for name in names:
            values = [v for v in map(get, runs[name]) if v is not None]
            cells.append(f"{statistics.median(values):.2f} ({' '.join(f'{v:.2f}' for v in values)})" if values else "—")
        print(f"| {label} | {' | '.join(cells)} |")
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(uptime)
    args.json.write_text(json.dumps({"ranks": args.ranks, "steps": args.steps, "runs": runs, "uptime": uptime}, indent=1))


if __name__ == "__main__":
    main()
