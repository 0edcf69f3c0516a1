"""Where a step's wall time goes, from run.py's outputs (README, "Where a step's time goes").

    python experiments/peers/analyse.py share RESULTS.json        # CPU per step, and the CPU share of a core it got
    python experiments/peers/analyse.py phases RESULTS.json       # plain-loop variants: per-phase times per rank
    python experiments/peers/analyse.py trace DIR STEPS           # a --trace run's 2 ranks: collectives and their waits
    python experiments/peers/analyse.py sessions                  # the scheduler's share: 2 busy processes, 1 or 2 sessions

``share``: a rank's CPU seconds per step divided by its step time: the fraction of one core it ran on. Where a rank
is always runnable this is what the scheduler gives it; below that, the rank sleeps (waiting for its peer).
``trace``: every collective of the two ranks' Chrome traces matched by (group, stream, sequence number); the skew is
rank 1's start minus rank 0's, i.e. how long the rank that arrived first waited for the other (a collective's
duration on the first rank includes that wait; on the later one it is the transfer itself).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path
from typing import Any


def share(results: dict[str, Any], warmup: int) -> None:
    for name, runs in results["runs"].items():
        for k, run in enumerate(runs):
            step = statistics.median(run["step_times"][warmup:])
            cpu = [statistics.median(c[warmup:]) for c in run.get("cpu_times", [])]
            print(
                f"{name:<40} round {k + 1}: step {step * 1e3:6.0f} ms, CPU s/step/rank {[round(c, 3) for c in cpu]}, "
                f"share of a core {[round(c / step, 2) for c in cpu]}, sessions {run.get('sessions')}, "
                f"load {run['load_before']:.1f}"
            )


def phases(results: dict[str, Any], warmup: int) -> None:
    for name, runs in results["runs"].items():
        for k, run in enumerate(runs):
            if "phases" not in run:
                continue
            print(f"{name} round {k + 1}: median step {statistics.median(run['step_times'][warmup:]) * 1e3:.0f} ms")
            for rank, steps in enumerate(run["phases"]):
                steps = steps[warmup + 1 :]  # phases[0] is the first step (not an interval of step_times)
                med = {x: statistics.median(s.get(x, 0.0) for s in steps) for x in {x for s in steps for x in s}}
                print(
                    f"   rank {rank} (ms): "
                    + ", ".join(f"{x} {v * 1e3:.0f}" for x, v in sorted(med.items(), key=lambda kv: -kv[1]))
                )


def trace(folder: Path, steps: int) -> None:
    ranks = {
        int(f.stem[4:]): [e for e in json.loads(f.read_text())["traceEvents"] if e["ph"] == "X"]
        for f in sorted(folder.glob("rank*.json"))
    }
    for rank, events in ranks.items():
        total: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
        for e in events:
            total[(e["cat"], e["name"])][0] += 1
            total[(e["cat"], e["name"])][1] += e["dur"] / 1e3
        print(f"rank {rank}, per step (whole run / {steps}):")
        for (cat, name), (n, ms) in sorted(total.items(), key=lambda kv: -kv[1][1]):
            print(f"   {cat:>8} {name:<18} {n / steps:5.1f} ops {ms / steps:8.1f} ms")
    if len(ranks) != 2:
        return
    key = lambda e: (e["args"].get("group"), e["cat"], e["args"].get("seq"))  # noqa: E731
    a, b = ({key(e): e for e in ranks[r] if "seq" in e["args"]} for r in (0, 1))
    skews: dict[tuple[str, str], list[tuple[float, float, float]]] = collections.defaultdict(list)
    for k in a.keys() & b.keys():
        skews[(k[1], a[k]["name"])].append(((b[k]["ts"] - a[k]["ts"]) / 1e3, a[k]["dur"] / 1e3, b[k]["dur"] / 1e3))
    print("matched collectives (ms, means): |start skew|, duration rank 0 / rank 1, the shorter of the two")
    for (cat, name), v in sorted(skews.items()):
        n = len(v)
        print(
            f"   {cat:>8} {name:<18} n={n:4d} |skew| {sum(abs(x[0]) for x in v) / n:6.2f}  duration "
            f"{sum(x[1] for x in v) / n:6.2f} / {sum(x[2] for x in v) / n:6.2f}  shorter {sum(min(x[1:]) for x in v) / n:6.2f}"
        )


BUSY = "import os, time\nend = time.time() + {s}\nwhile time.time() < end: pass\nprint(time.process_time())"


def sessions(seconds: float = 4.0, rounds: int = 3) -> None:
    """Two always-runnable processes, both in this session or each in a new one (as torchrun starts its workers),
    alternated: the CPU each got. Linux's autogroup shares the CPU between sessions, so on a host loaded by other
    sessions two processes of one session get about half of what two sessions get; on an idle host both get a core."""
    import os
    import subprocess
    import sys

    for r in range(rounds):
        for new in (False, True):
            procs = [
                subprocess.Popen(
                    [sys.executable, "-c", BUSY.format(s=seconds)], stdout=subprocess.PIPE, text=True, start_new_session=new
                )
                for _ in range(2)
            ]
            cpu = [float(p.communicate()[0]) for p in procs]
            print(
                f"round {r + 1}, {'a session each' if new else 'one session   '}: CPU s in {seconds:.0f} s of wall "
                f"{[round(c, 2) for c in cpu]} (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["share", "phases", "trace", "sessions"])
    parser.add_argument("path", type=Path, nargs="?", help="run.py's --json file, or (trace) a folder of rank<k>.json")
    parser.add_argument("steps", type=int, nargs="?", default=10, help="trace: the run's steps")
    parser.add_argument("--warmup", type=int, default=3, help="step intervals skipped (as run.py's --warmup)")
    args = parser.parse_args()
    if args.what == "sessions":
        return sessions()
    if args.what == "trace":
        return trace(args.path, args.steps)
    results = json.loads(args.path.read_text())
    (share if args.what == "share" else phases)(results, args.warmup)


if __name__ == "__main__":
    main()
