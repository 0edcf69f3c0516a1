"""Does the calibrated cpu plan predict this host? (issue 4 acceptance)

1. `nxdt comm-test --calibrate` into a scratch file.
2. All-reduce, 2 ranks, 1-64 MB: the plan's prediction vs a separate `nxdt comm-test` run.
3. llama_tiny DP=2 (and two other shapes): `nxdt plan --calibration` step time vs the median step time
   of a real `nxdt train` run (metrics.csv, first 5 steps skipped as warm-up).

Usage: python experiments/planner-accuracy/run.py [--steps 40]   → results.json + a table on stdout.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
SHAPES = {  # name → overrides (all DP=2 on 2 local ranks)
    "llama_tiny (default)": [],
    "llama_tiny seq 256": ["data.seq_length=256"],
    "llama_tiny hidden 192, 6 layers": ["model.hidden_size=192", "model.num_layers=6", "model.ffn_hidden_size=512"],
}


def sh(*argv: str, cwd: str | None = None) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, cwd=cwd).stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nxdt-accuracy-"))
    calib = work / "calibration.json"
    sh("nxdt", "comm-test", "--calibrate", "-o", str(calib))
    from nxdt.config import compose_config
    from nxdt.planner import node_topology
    from nxdt.planner.calibration import estimate_table, load_calibration

    calibration = load_calibration(calib)
    cfg = compose_config([])
    sizes = [1 << 20, 4 << 20, 16 << 20, 64 << 20]
    predicted = estimate_table("all_reduce", sizes, [0, 1], node_topology(cfg), cfg.instance, 2, 4, calibration)
    sh(
        "nxdt",
        "comm-test",
        "-r",
        "2",
        "-b",
        "1mb",
        "-e",
        "64mb",
        "-f",
        "4",
        "allr",
        "--report-to-json-file",
        str(work / "allr.json"),
    )
    measured = json.loads((work / "allr.json").read_text())["results"]
    comm_rows = [
        {
            "bytes": p["size(B)"],
            "predicted_us": p["time:avg(us)"],
            "measured_us": m["time:avg(us)"],
            "ratio": p["time:avg(us)"] / m["time:avg(us)"],
        }
        for p, m in zip(predicted, measured)
    ]

    step_rows = []
    for name, overrides in SHAPES.items():
        plan = json.loads(sh("nxdt", "plan", "--json", "--calibration", str(calib), *overrides))
        run_root = work / "runs" / str(len(step_rows))
        sh("nxdt", "train", f"trainer.max_steps={args.steps}", f"exp_manager.exp_dir={run_root}", *overrides, cwd=str(work))
        metrics = glob.glob(str(run_root / "*" / "*" / "metrics.csv"))[0]
        steps = [float(r["step_time_s"]) for r in csv.DictReader(open(metrics))][5:]
        real = statistics.median(steps)
        step_rows.append(
            {
                "shape": name,
                "predicted_s": plan["estimate"]["step_time_s"],
                "measured_s": real,
                "ratio": plan["estimate"]["step_time_s"] / real,
            }
        )
    result = {"calibration": calibration, "all_reduce": comm_rows, "step_time": step_rows}
    (HERE / "results.json").write_text(json.dumps(result, indent=1))
    print(f"{'all-reduce bytes':>18} {'predicted µs':>13} {'measured µs':>12} {'pred/meas':>10}")
    for r in comm_rows:
        print(f"{r['bytes']:>18} {r['predicted_us']:>13.1f} {r['measured_us']:>12.1f} {r['ratio']:>10.2f}")
    print(f"\n{'shape (DP=2)':<34} {'predicted ms':>13} {'measured ms':>12} {'pred/meas':>10}")
    for r in step_rows:
        print(f"{r['shape']:<34} {r['predicted_s'] * 1e3:>13.1f} {r['measured_s'] * 1e3:>12.1f} {r['ratio']:>10.2f}")


if __name__ == "__main__":
    sys.exit(main())
