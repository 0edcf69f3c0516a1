"""CP2 vs CP1: step time and peak memory of llama_tiny at sequence 2k and 4k, side by side in one run.

Every variant is a real `nxdt train` run (data=synthetic, fp32, micro-batch 1, global batch 2, AdamW). CP1 is one
rank (2 intra-op threads: `nxdt train` gives each rank cores / ranks); CP2 is two ranks of one thread each, the
sequence split in 2·CP chunks with ring attention. The variants run in interleaved rounds (CP1, CP2, CP1, CP2, …
per sequence length) because the shared host's speed drifts; each figure is the median over steps 3.. of all
rounds (`step_time_s`), and the largest `peak_rss_mb` (rank 0, per step) seen. The planner's activation + logits
bytes per rank come from `nxdt plan --json` for the same config.

    python experiments/context-parallel/run.py [--rounds 2] [--steps 6]    # writes results.json beside this file
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def config(seq: int, cp: int, steps: int) -> list[str]:
    return [
        "model=llama_tiny",
        f"model.max_position_embeddings={seq}",
        "data=synthetic",
        f"data.seq_length={seq}",
        "data.micro_batch_size=1",
        "data.global_batch_size=2",
        "precision.type=fp32",
        f"trainer.max_steps={steps}",
        f"model.optim.sched.max_steps={steps}",
        "trainer.log_every_n_steps=1",
        "exp_manager.create_tensorboard_logger=false",
        f"trainer.devices={cp}",
        f"distributed_strategy.context_parallel_size={cp}",
    ]


def nxdt(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nxdt.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        timeout=1800,
    )


def train(seq: int, cp: int, steps: int, root: Path, tag: str) -> list[dict[str, float]]:
    run = root / tag
    result = nxdt("train", *config(seq, cp, steps), f"exp_manager.explicit_log_dir={run}", cwd=root)
    if result.returncode:
        raise RuntimeError(f"{tag}: exit {result.returncode}\n{result.stderr[-2000:]}")
    with open(run / "metrics.csv", newline="") as fh:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(fh)]


def planned(seq: int, cp: int, root: Path) -> dict[str, float]:
    result = nxdt("plan", "--json", *config(seq, cp, 1), cwd=root)
    if result.returncode:
        raise RuntimeError(result.stderr[-2000:])
    estimate = json.loads(result.stdout)["estimate"]
    mem = estimate["memory_per_rank_bytes"]
    return {
        "activations_logits_MiB": (mem["activations"] + mem["logits"]) / 2**20,
        "step_time_s": estimate["step_time_s"],
        **(
            {
                "ring_MiB_per_step": estimate["context_parallel"]["ring_bytes_per_step"] / 2**20,
                "ring_hidden_pct": estimate["context_parallel"]["ring_hidden_pct"],
            }
            if cp > 1
            else {}
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load = os.getloadavg()
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for seq in args.seq:
            rows: dict[int, list[dict[str, float]]] = {1: [], 2: []}
            for r in range(args.rounds):
                for cp in (1, 2):
                    rows[cp] += train(seq, cp, args.steps, root, f"s{seq}-cp{cp}-r{r}")
                    print(f"seq {seq} CP{cp} round {r} done", flush=True)
            for cp in (1, 2):
                times = [row["step_time_s"] for row in rows[cp] if row["step"] >= 3]
                out[f"seq{seq}_cp{cp}"] = {
                    "seq": seq,
                    "cp": cp,
                    "step_time_s_median": statistics.median(times),
                    "step_times_s": times,
                    "peak_rss_mb": max(row["peak_rss_mb"] for row in rows[cp]),
                    "losses_round0": [row["loss"] for row in rows[cp][: args.steps]],
                    "planner": planned(seq, cp, root),
                }
    result = {
        "started": started,
        "load_average_at_start": load,
        "cpus": os.cpu_count(),
        "rounds": args.rounds,
        "steps": args.steps,
        "variants": out,
    }
    (HERE / "results.json").write_text(json.dumps(result, indent=1))
    for key, v in out.items():
        print(
            f"{key}: step {v['step_time_s_median'] * 1e3:.0f} ms, peak RSS {v['peak_rss_mb']:.0f} MB, planner activations+logits "
            f"{v['planner']['activations_logits_MiB']:.1f} MiB"
        )


if __name__ == "__main__":
    main()
