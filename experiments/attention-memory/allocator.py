"""Step time and peak RSS of a 2k-token llama_tiny step under glibc's allocator settings, interleaved.

The question: should `nxdt train`'s workers fix glibc's mmap threshold at start-up (``mallopt``) so that freed
activations go back to the OS and peak RSS follows the live tensors (what the planner models), and at what cost?

Each measurement is a fresh process (``--child``) that applies one allocator setting, builds the shipped llama_tiny
(position table raised to the sequence length, fp32, batch 1) and runs ``--steps`` training steps (forward, loss,
backward, AdamW step, gradients set to None, as Lightning does), timing each and counting its minor page faults.
``--threads`` torch threads (default 1: what each of two ranks gets on a 2-core host, and far less disturbed by
other users of a shared host than two threads on two cores). Settings:

* ``default``: glibc as shipped (its mmap threshold starts at 128 KiB and rises to the largest mmapped block freed,
  up to 32 MiB; the trim threshold follows at twice that);
* ``128k``, ``512k``, ``1m``: ``mallopt(M_MMAP_THRESHOLD, T)`` and ``mallopt(M_TRIM_THRESHOLD, T)`` at start-up
  (fixing them turns their dynamic growth off): every block of T or more is its own mapping, unmapped when freed;
  ``128k`` is the same as the environment's ``MALLOC_MMAP_THRESHOLD_=131072``;
* ``trim``: glibc as shipped, plus ``malloc_trim(0)`` after every step (inside the timed step).

The parent alternates: every round runs every (kernel, setting) once, the settings in a rotated order per round, so
load from other users of the host falls on all settings alike; medians over rounds of each run's median step time
(first step excluded: warm-up) and of each run's peak RSS (``ru_maxrss``, MiB). ``uptime`` is recorded per round.

    python experiments/attention-memory/allocator.py [--rounds 5] [--steps 5] [--threads 1]   # writes allocator.json
    ALLOCATOR_RESULTS=allocator-train.json python experiments/attention-memory/allocator.py --nxdt-train \
        --kernels sdpa blockwise --settings default 128k --rounds 3     # the same through real `nxdt train` runs
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MiB = 2**20
KERNELS = ("sdpa", "blockwise", "naive")
SETTINGS = ("default", "128k", "512k", "1m", "trim")
THRESHOLDS = {"128k": 128 * 1024, "512k": 512 * 1024, "1m": 1024 * 1024}
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>


def rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB


def child(kernel: str, setting: str, seq: int, steps: int, threads: int) -> dict:
    libc = ctypes.CDLL(None)
    if setting in THRESHOLDS:  # glibc only (mallopt returns 1 when it accepts a setting)
        assert libc.mallopt(M_MMAP_THRESHOLD, THRESHOLDS[setting]) == 1
        assert libc.mallopt(M_TRIM_THRESHOLD, THRESHOLDS[setting]) == 1
    import torch

    from nxdt.config import compose_config
    from nxdt.models.llama import LlamaForCausalLM

    torch.set_num_threads(threads)
    cfg = compose_config(
        ["model=llama_tiny", f"model.max_position_embeddings={seq}", f"model.core_attention={kernel}", f"data.seq_length={seq}"],
        check=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.model.vocab_size, (1, seq))
    times, rss_after, faults = [], [], []
    for _ in range(steps):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        loss = model.loss_fn(model(ids), ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
        if setting == "trim":
            libc.malloc_trim(0)
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        rss_after.append(rss_mib())
    return {
        "step_time_s": times,
        "rss_after_step_mib": rss_after,
        "minor_faults_per_step": faults,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def run_child(kernel: str, setting: str, seq: int, steps: int, threads: int) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            kernel,
            setting,
            "--seq",
            str(seq),
            "--steps",
            str(steps),
            "--threads",
            str(threads),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_train(kernel: str, setting: str, seq: int, steps: int, root: Path) -> dict:
    """One real one-rank `nxdt train` (run.py's config; the worker's own torch threads: cores // ranks), the
    threshold set through glibc's environment variables, which the fork server and its workers inherit."""
    from run import config  # beside this file

    env = dict(os.environ)
    if setting != "default":
        env |= {"MALLOC_MMAP_THRESHOLD_": str(THRESHOLDS[setting]), "MALLOC_TRIM_THRESHOLD_": str(THRESHOLDS[setting])}
    run = root / f"{kernel}-{setting}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "nxdt.cli", "train", *config(seq, kernel, steps), f"exp_manager.explicit_log_dir={run}"]
    subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=True, timeout=1800)
    with open(run / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    return {
        "step_time_s": [float(r["step_time_s"]) for r in rows],
        "peak_rss_mib": max(float(r["peak_rss_mb"]) for r in rows),
        "per_step_peak_rss_mib": [float(r["peak_rss_mb"]) for r in rows],
        "minor_faults_per_step": [],
    }


def summarise(runs: list[dict]) -> dict:
    step = [statistics.median(r["step_time_s"][1:]) for r in runs]
    peak = [r["peak_rss_mib"] for r in runs]
    return {
        "median_step_time_s": statistics.median(step),
        "median_peak_rss_mib": statistics.median(peak),
        "per_run_median_step_time_s": step,
        "per_run_peak_rss_mib": peak,
        "median_minor_faults_per_step": statistics.median([f for r in runs for f in r["minor_faults_per_step"][1:]] or [0]),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=2, metavar=("KERNEL", "SETTING"))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nxdt-train", action="store_true", help="time real one-rank `nxdt train` runs (no page-fault counts)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a worker gets cores // ranks on the host)")
    ap.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    ap.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.seq, args.steps, args.threads)))
        return
    if args.nxdt_train and "trim" in args.settings:
        ap.error("--nxdt-train: the trim setting needs a hook in the step; use the default and threshold settings")
    root = Path(tempfile.mkdtemp(prefix="allocator-"))  # nxdt train's run directories (kept: metrics.csv, logs)
    raw: dict = {k: {s: [] for s in args.settings} for k in args.kernels}
    uptimes = []
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    for rnd in range(args.rounds):
        uptimes.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
        print(f"round {rnd}: {uptimes[-1]}", flush=True)
        order = args.settings[rnd % len(args.settings) :] + args.settings[: rnd % len(args.settings)]
        for kernel in args.kernels:
            for setting in order:
                if args.nxdt_train:
                    r = run_train(kernel, setting, args.seq, args.steps, root)
                else:
                    r = run_child(kernel, setting, args.seq, args.steps, args.threads)
                raw[kernel][setting].append(r)
                print(
                    f"  {kernel:9s} {setting:7s} step {statistics.median(r['step_time_s'][1:]):.3f} s "
                    f"faults {r['minor_faults_per_step'][-1:]} peak RSS {r['peak_rss_mib']:.1f} MiB, RSS per step {[round(x) for x in r.get('rss_after_step_mib', r.get('per_step_peak_rss_mib'))]}",
                    flush=True,
                )
    uptimes.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    summary = {k: {s: summarise(rs) for s, rs in by.items()} for k, by in raw.items()}
    if "default" in args.settings:  # each run against the default run of its own round: load shared alike
        for kernel, by in summary.items():
            base = by["default"]["per_run_median_step_time_s"]
            for s in by.values():
                s["median_paired_time_ratio"] = statistics.median(t / b for t, b in zip(s["per_run_median_step_time_s"], base))
    for kernel, by in summary.items():
        base = by.get("default")
        for setting, s in by.items():
            rel = f" (paired {s['median_paired_time_ratio']:.2f}x time, " if base else " ("
            rel += f"{s['median_peak_rss_mib'] - base['median_peak_rss_mib']:+.1f} MiB)" if base else ")"
            print(
                f"{kernel:9s} {setting:7s} median step {s['median_step_time_s']:.3f} s, peak RSS {s['median_peak_rss_mib']:.1f} MiB{rel}"
            )
    out = {
        "started_utc": started,
        "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "seq": args.seq,
        "steps": args.steps,
        "rounds": args.rounds,
        "cpu_count": os.cpu_count(),
        "mode": "nxdt train, one rank" if args.nxdt_train else "in-process steps",
        "threads": "cores // ranks (the worker's)" if args.nxdt_train else args.threads,
        "uptime_per_round": uptimes,
        "summary": summary,
        "raw": raw,
    }
    (HERE / os.environ.get("ALLOCATOR_RESULTS", "allocator.json")).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
