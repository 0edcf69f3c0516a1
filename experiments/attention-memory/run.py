"""Peak RSS of a 2k-token llama_tiny step with naive vs memory-efficient core attention, against the planner.

For each ``model.core_attention`` in (naive, sdpa, blockwise) a real `nxdt train` run on one rank: the shipped
llama_tiny (hidden 128, 4 layers, 4 heads over 2 KV heads, ffn 344, vocabulary 256; position table raised to the
sequence length), data=synthetic, fp32, micro-batch 1 = global batch 1, AdamW, a few steps. metrics.csv's
``peak_rss_mb`` is rank 0's high-water resident set (getrusage ru_maxrss / 1024, so MiB despite the name), which includes the process itself
(Python, torch, Lightning, nxdt: several hundred MB that the planner does not model).

Decomposition (like with like): each configuration also runs at a short sequence (``--base-seq``, 128) where the
attention and activation bytes are small; the sequence-dependent memory is

    measured Δ = peak_rss(2048) − peak_rss(base)      planned Δ = estimate(2048) − estimate(base)

with ``estimate`` the planner's total bytes per rank (`nxdt plan --json`, instance cpu by default: parameters,
gradients and optimizer state cancel in Δ, leaving activations + logits). The ratio planned Δ / measured Δ is what
the acceptance's "within 25 %" is checked against; the naive − sdpa difference (the S×S scores alone) is compared
the same way. The planner's absolute total is reported next to peak − baseline as well.

Two allocator settings (``--malloc``): ``default`` is glibc as shipped, whose dynamic mmap threshold rises to the
size of the largest tensor freed so far, after which tensors come from the heap and freed ones stay there (peak RSS
then exceeds the live tensors by what the heap keeps and fragments, and grows from step to step); ``pinned`` runs the
worker with ``MALLOC_MMAP_THRESHOLD_=131072`` (glibc's initial threshold, fixed), so every tensor of 128 KiB or more
is mmapped and unmapped when freed and peak RSS follows the live tensors — what the planner models, and what a
device's allocator holds.

    python experiments/attention-memory/run.py [--seq 2048] [--base-seq 128] [--steps 3] [--malloc default pinned]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MiB = 2**20  # metrics.csv's peak_rss_mb is ru_maxrss (KiB) / 1024: MiB, so the planner's bytes are too
IMPLS = ("naive", "sdpa", "blockwise")
MALLOC = {"default": {}, "pinned": {"MALLOC_MMAP_THRESHOLD_": "131072"}}


def config(seq: int, impl: str, steps: int) -> list[str]:
    return [
        "model=llama_tiny",
        f"model.max_position_embeddings={seq}",
        f"model.core_attention={impl}",
        "data=synthetic",
        f"data.seq_length={seq}",
        "data.micro_batch_size=1",
        "data.global_batch_size=1",
        "precision.type=fp32",
        f"trainer.max_steps={steps}",
        f"model.optim.sched.max_steps={steps}",
        "trainer.log_every_n_steps=1",
        "exp_manager.create_tensorboard_logger=false",
        "exp_manager.checkpoint_every_n_steps=1000",
        "trainer.devices=1",
    ]


def nxdt(*args: str, cwd: Path, malloc: str = "default") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nxdt.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **MALLOC[malloc]},
        timeout=1800,
    )


def measured_peak_mb(seq: int, impl: str, steps: int, root: Path, malloc: str) -> dict:
    run = root / f"{impl}-{seq}-{malloc}"
    load = [round(x, 2) for x in os.getloadavg()]
    result = nxdt("train", *config(seq, impl, steps), f"exp_manager.explicit_log_dir={run}", cwd=root, malloc=malloc)
    if result.returncode:
        raise RuntimeError(f"{impl} {seq}: exit {result.returncode}\n{result.stderr[-2000:]}")
    with open(run / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    return {
        "peak_rss_mb": max(float(r["peak_rss_mb"]) for r in rows),
        "per_step_peak_rss_mb": [float(r["peak_rss_mb"]) for r in rows],
        "step_time_s": [float(r["step_time_s"]) for r in rows],
        "load_avg_before": load,
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
    }


def planned_mb(seq: int, impl: str, root: Path) -> dict:
    result = nxdt("plan", "--json", *config(seq, impl, 1), cwd=root)
    if result.returncode:
        raise RuntimeError(result.stderr[-2000:])
    mem = json.loads(result.stdout)["estimate"]["memory_per_rank_bytes"]
    parts = {k: v / MiB for k, v in mem.items() if isinstance(v, (int, float))}
    return {"parts_mb": parts, "total_mb": sum(v for k, v in parts.items() if k != "total")}


def compare(runs: dict, seq: int, base: int) -> dict:
    """Δ measured and Δ planned (sequence-dependent memory) per kernel, and naive − each memory-efficient kernel."""
    out = {}
    for impl, r in runs.items():
        d_meas = r[seq]["measured"]["peak_rss_mb"] - r[base]["measured"]["peak_rss_mb"]
        d_plan = r[seq]["planned"]["total_mb"] - r[base]["planned"]["total_mb"]
        out[impl] = {
            "by_seq": {str(k): v for k, v in r.items()},
            "measured_delta_mb": d_meas,
            "planned_delta_mb": d_plan,
            "planned_over_measured": d_plan / d_meas,
        }
    for eff in ("sdpa", "blockwise") if "naive" in out else ():
        if eff in out:
            dm = out["naive"]["measured_delta_mb"] - out[eff]["measured_delta_mb"]
            dp = out["naive"]["planned_delta_mb"] - out[eff]["planned_delta_mb"]
            out[f"naive_minus_{eff}"] = {"measured_mb": dm, "planned_mb": dp, "planned_over_measured": dp / dm}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--base-seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    ap.add_argument("--malloc", nargs="+", choices=list(MALLOC), default=list(MALLOC))
    args = ap.parse_args()
    out: dict = {
        "when_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "seq": args.seq,
        "base_seq": args.base_seq,
        "steps": args.steps,
        "config": config(args.seq, "<impl>", args.steps),
        "malloc_env": MALLOC,
        "by_malloc": {},
    }
    with tempfile.TemporaryDirectory(prefix="attn-mem-") as tmp:
        root = Path(tmp)
        planned = {(impl, seq): planned_mb(seq, impl, root) for impl in args.impls for seq in (args.base_seq, args.seq)}
        for malloc in args.malloc:
            runs = {}
            for impl in args.impls:
                runs[impl] = {
                    seq: {"measured": measured_peak_mb(seq, impl, args.steps, root, malloc), "planned": planned[impl, seq]}
                    for seq in (args.base_seq, args.seq)
                }
                for seq, r in runs[impl].items():
                    print(
                        f"{malloc} {impl} seq {seq}: peak RSS {r['measured']['peak_rss_mb']:.0f} MiB (per step "
                        f"{r['measured']['per_step_peak_rss_mb']}), planner total {r['planned']['total_mb']:.1f} MiB, "
                        f"load {r['measured']['load_avg_after']}",
                        flush=True,
                    )
            out["by_malloc"][malloc] = compare(runs, args.seq, args.base_seq)
            for key, c in out["by_malloc"][malloc].items():
                meas = c.get("measured_delta_mb", c.get("measured_mb"))
                plan = c.get("planned_delta_mb", c.get("planned_mb"))
                print(f"{malloc} {key}: Δ measured {meas:.1f} MiB, Δ planned {plan:.1f} MiB, ratio {plan / meas:.2f}", flush=True)
    name = os.environ.get("ATTN_MEM_RESULTS", "results.json")
    (HERE / name).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
