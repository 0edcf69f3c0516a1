"""Recovery drill (issue 7): SIGKILL one worker mid-run and measure what it costs.

Each trial runs `nxdt train` (llama_tiny, synthetic data, 2 local ranks, checkpoint every 5 steps,
exp_manager.max_restarts=1) and kills rank 1 with SIGKILL when step 13 starts. From the run's own logs:

* detect + restart: kill → the restarted worker process starts (the elastic agent notices the dead
  worker, stops the survivor, starts a new attempt);
* restart → first step: new attempt starts → its first completed optimizer step (imports, comm
  init, checkpoint load, one step);
* steps lost: completed steps after the resumed checkpoint that had to be redone.

Usage: python experiments/recovery/run.py [--trials 3]  → results.json + a table.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
KILL_STEP, EVERY = 13, 5


def trial(root: Path) -> dict[str, float]:
    run = root / "run"
    subprocess.run(
        [
            "nxdt",
            "train",
            "data=synthetic",
            "trainer.max_steps=20",
            f"exp_manager.checkpoint_every_n_steps={EVERY}",
            "exp_manager.max_restarts=1",
            f"exp_manager.fault_injection.step={KILL_STEP}",
            "exp_manager.fault_injection.rank=1",
            "exp_manager.fault_injection.kind=sigkill",
            "exp_manager.create_tensorboard_logger=false",
            f"exp_manager.explicit_log_dir={run}",
        ],
        check=True,
        capture_output=True,
        cwd=root,
    )
    log = (run / "logs" / "rank1.log").read_text()
    killed = float(re.search(r"SIGKILL on rank 1 at step \d+ \(t=([\d.]+)\)", log).group(1))
    restarted = float(re.search(r"rank 1 attempt 1 started \(t=([\d.]+)\)", log).group(1))
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    after = [r for r in rows if float(r["wall_time"]) > restarted]
    first = after[0]
    resumed_from = (KILL_STEP - 1) // EVERY * EVERY
    return {
        "detect_and_restart_s": restarted - killed,
        "restart_to_first_step_s": float(first["wall_time"]) - restarted,
        "steps_lost": (KILL_STEP - 1) - resumed_from,
        "first_step_after_restart": int(first["step"]),
        "completed": len(rows) == 20,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    results = [trial(Path(tempfile.mkdtemp(prefix="nxdt-recovery-"))) for _ in range(args.trials)]
    summary = {
        k: statistics.median(r[k] for r in results) for k in ("detect_and_restart_s", "restart_to_first_step_s", "steps_lost")
    }
    (HERE / "results.json").write_text(json.dumps({"trials": results, "median": summary}, indent=1))
    print(f"{'trial':>5} {'detect+restart s':>17} {'restart→first step s':>21} {'steps lost':>11} {'first step':>11}")
    for i, r in enumerate(results):
        print(
            f"{i:>5} {r['detect_and_restart_s']:>17.2f} {r['restart_to_first_step_s']:>21.2f} {r['steps_lost']:>11} "
            f"{r['first_step_after_restart']:>11}"
        )
    print(
        f"median: detect+restart {summary['detect_and_restart_s']:.2f} s, restart→first step {summary['restart_to_first_step_s']:.2f} s, "
        f"steps lost {summary['steps_lost']}"
    )


if __name__ == "__main__":
    main()
