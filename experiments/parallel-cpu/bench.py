"""Parallel layouts on CPU: tokens/s and step time of one Llama model on 4 ranks (DP4, TP2×DP2, PP2×DP2,
TP2+SP×DP2, ZeRO-1 DP4) against Lightning's own DDPStrategy (gloo), plus data-parallel scaling (1 rank vs
DP2) and nxdt DP2 vs DDP DP2 — all measured in one run, repetitions interleaved.

    python experiments/parallel-cpu/bench.py                 # ≈ 8 min on 2 cores; writes results.json + plot.png
    python experiments/parallel-cpu/bench.py --quick         # smoke test (1 repetition, few steps)

Every variant is one ``python bench.py --run VARIANT`` process tree launched the way a user runs a
Lightning script (the strategy starts the other ranks), with the same LightningModule family
(``nxdt.lightning.CausalLMModule`` and its model hub Llama), the same synthetic data, global batch, seed,
optimizer and clipping, and ``torch.set_num_threads(THREADS)`` in every rank. The DDP peer differs only
where it must: Lightning's automatic optimization (DDP syncs gradients in backward hooks of its forward).
Step time = wall time between consecutive ``on_train_batch_end`` on rank 0, steps after the warm-up only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
THREADS = 1  # intra-op threads per rank, for every variant (2 cores here; 4-rank layouts oversubscribe 2×)
SEQ = 128
# llama_tiny widened so compute dominates the per-step fixed costs: 4 layers, hidden 256 → 3.2 M parameters
MODEL = [
    "model=llama_tiny",
    "model.hidden_size=256",
    "model.ffn_hidden_size=688",
    "model.num_attention_heads=8",
    "model.num_kv_heads=4",
]
GLOBAL_4 = 16  # global batch (sequences) of every 4-rank layout

# name → (strategy, ranks, degrees/options, global batch, micro batch)
VARIANTS: dict[str, dict] = {
    "nxdt DP4": dict(strategy="nxdt", ranks=4, gbs=GLOBAL_4, mbs=4),
    "nxdt TP2xDP2": dict(strategy="nxdt", ranks=4, tp=2, gbs=GLOBAL_4, mbs=8),
    "nxdt TP2+SPxDP2": dict(strategy="nxdt", ranks=4, tp=2, sp=True, gbs=GLOBAL_4, mbs=8),
    "nxdt PP2xDP2": dict(strategy="nxdt", ranks=4, pp=2, gbs=GLOBAL_4, mbs=2),  # 4 micro-batches per stage
    "nxdt ZeRO-1 DP4": dict(strategy="nxdt", ranks=4, zero1=True, gbs=GLOBAL_4, mbs=4),
    "DDP DP4": dict(strategy="ddp", ranks=4, gbs=GLOBAL_4, mbs=4),
    # data-parallel scaling: the same per-rank batch (4 sequences) on 1 rank and on 2
    "nxdt 1 rank": dict(strategy="nxdt", ranks=1, gbs=4, mbs=4),
    # the ceiling of DP2 on this host: two independent 1-rank runs at once, no communication at all — what
    # sharing the memory system and the cores' package costs by itself
    "nxdt 1 rank, twin running": dict(strategy="nxdt", ranks=1, gbs=4, mbs=4, concurrent=2),
    "nxdt DP2": dict(strategy="nxdt", ranks=2, gbs=8, mbs=4),
    "DDP DP2": dict(strategy="ddp", ranks=2, gbs=8, mbs=4),
}


# ---------------------------------------------------------------------------------------------- one variant
def run_variant(name: str, steps: int, out: Path) -> None:
    """Train ``steps`` steps of one variant in this process (and the ranks Lightning starts); rank 0 writes
    the step times and losses to ``out``."""
    import torch

    torch.set_num_threads(THREADS)
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy

    from nxdt.config import compose_config
    from nxdt.lightning import NxDStrategy
    from nxdt.lightning.datamodule import NxDDataModule
    from nxdt.lightning.module import CausalLMModule
    from nxdt.lightning.optim import build_optimizer, build_scheduler

    class DDPPeerModule(CausalLMModule):
        """The same module under Lightning's automatic optimization: one forward/backward of this rank's
        batch per step (its micro-batch *is* the local batch in every DDP variant), DDP averaging the
        gradients in its backward hooks, Lightning clipping and stepping."""

        def __init__(self, *args) -> None:
            super().__init__(*args)
            self.automatic_optimization = True

        def training_step(self, batch, batch_idx):
            loss = self.model.loss_fn(self(batch["input_ids"]), batch["labels"])
            self.step_metrics = {"step": self.trainer.global_step, "loss": float(loss.detach())}
            return loss

        def configure_optimizers(self):
            optimizer = build_optimizer(self.model, self.model_cfg.optim)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": build_scheduler(optimizer, self.model_cfg.optim.sched), "interval": "step"},
            }

    v = VARIANTS[name]
    cfg = compose_config(
        [
            *MODEL,
            "data=synthetic",
            f"data.seq_length={SEQ}",
            f"data.global_batch_size={v['gbs']}",
            f"data.micro_batch_size={v['mbs']}",
            f"trainer.max_steps={steps}",
            f"trainer.devices={v['ranks']}",
            f"distributed_strategy.tensor_model_parallel_size={v.get('tp', 1)}",
            f"distributed_strategy.pipeline_model_parallel_size={v.get('pp', 1)}",
        ]
    )
    pl.seed_everything(cfg.seed, verbose=False)

    class StepTimes(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self.last: float | None = None

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            now = time.perf_counter()
            if self.last is not None:
                self.times.append(now - self.last)
            self.last = now
            self.losses.append(module.step_metrics["loss"])

    if v["strategy"] == "nxdt":
        strategy = NxDStrategy(
            tensor_parallel_size=v.get("tp", 1),
            pipeline_parallel_size=v.get("pp", 1),
            sequence_parallel=v.get("sp", False),
            zero1=v.get("zero1", False),
        )
        module = CausalLMModule(
            cfg.model, cfg.data.global_batch_size, SEQ, cfg.data.micro_batch_size, cfg.trainer.gradient_clip_val
        )
        clip = None  # the module clips by the global norm itself
    else:
        strategy = DDPStrategy(process_group_backend="gloo")
        module = DDPPeerModule(cfg.model, cfg.data.global_batch_size, SEQ, cfg.data.micro_batch_size)
        clip = cfg.trainer.gradient_clip_val
    timer = StepTimes()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=v["ranks"],
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[timer],
        gradient_clip_val=clip,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=NxDDataModule(cfg.data, seed=cfg.seed, vocab_size=cfg.model.vocab_size, step_batches=True))
    if trainer.is_global_zero:
        out.write_text(json.dumps({"variant": name, "step_times": timer.times, "losses": timer.losses}))


# ---------------------------------------------------------------------------------------------- the study
def measure(names: list[str], reps: int, steps: int) -> dict[str, list[list[float]]]:
    """Step times of each variant, ``reps`` rounds; each round runs every variant once, the order rotated
    per round so slow phases of the machine hit every variant alike."""
    times: dict[str, list[list[float]]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {}
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "PYTHONWARNINGS": "ignore"}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            outs = [HERE / f".run-{os.getpid()}-{k}.json" for k in range(VARIANTS[name].get("concurrent", 1))]
            start = time.perf_counter()
            procs = [
                subprocess.Popen(
                    [sys.executable, __file__, "--run", name, "--steps", str(steps), "--out", str(out)],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for out in outs
            ]
            for proc in procs:
                _, err = proc.communicate()
                if proc.returncode != 0:
                    raise RuntimeError(f"variant {name!r} failed:\n{err[-3000:]}")
            result = json.loads(outs[0].read_text())
            for out in outs:
                out.unlink()
            times[name].append(result["step_times"])
            losses[name] = result["losses"]
            print(
                f"  round {rep + 1}/{reps} {name:<18} {time.perf_counter() - start:5.1f} s wall, "
                f"median step {statistics.median(result['step_times']) * 1e3:7.1f} ms",
                flush=True,
            )
    return {"times": times, "losses": losses}


def summarise(times: dict[str, list[list[float]]], warmup: int) -> dict[str, dict]:
    """Per variant: median step time over every timed step of every round (after ``warmup`` steps of each
    round), its spread (25th–75th percentile), tokens/s from the median, and the per-round medians."""
    rows = {}
    for name, rounds in times.items():
        timed = sorted(t for r in rounds for t in r[warmup:])
        q1, med, q3 = statistics.quantiles(timed, n=4) if len(timed) > 1 else (timed[0],) * 3
        tokens = VARIANTS[name]["gbs"] * SEQ
        rows[name] = {
            "median_step_ms": med * 1e3,
            "p25_ms": q1 * 1e3,
            "p75_ms": q3 * 1e3,
            "tokens_per_s": tokens / med,
            "round_medians_ms": [statistics.median(r[warmup:]) * 1e3 for r in rounds],
            "ranks": VARIANTS[name]["ranks"],
            "global_batch": VARIANTS[name]["gbs"],
        }
    return rows


def ratios(rows: dict[str, dict]) -> dict[str, float]:
    tps = {n: r["tokens_per_s"] for n, r in rows.items()}
    out = {}
    if "DDP DP4" in tps:
        out.update({f"{n} / DDP DP4": tps[n] / tps["DDP DP4"] for n in tps if rows[n]["ranks"] == 4})
    if {"nxdt DP2", "nxdt 1 rank"} <= set(tps):
        out["DP scaling efficiency = nxdt DP2 / (2 × 1 rank)"] = tps["nxdt DP2"] / (2 * tps["nxdt 1 rank"])
    if {"nxdt 1 rank, twin running", "nxdt 1 rank"} <= set(tps):
        out["ceiling: 1 rank with a twin running / 1 rank alone"] = tps["nxdt 1 rank, twin running"] / tps["nxdt 1 rank"]
    if {"nxdt DP2", "nxdt 1 rank, twin running"} <= set(tps):
        out["nxdt DP2 / (2 × 1 rank with a twin running)"] = tps["nxdt DP2"] / (2 * tps["nxdt 1 rank, twin running"])
    if {"DDP DP2", "nxdt 1 rank"} <= set(tps):
        out["DDP scaling efficiency = DDP DP2 / (2 × 1 rank)"] = tps["DDP DP2"] / (2 * tps["nxdt 1 rank"])
    if {"nxdt DP2", "DDP DP2"} <= set(tps):
        out["nxdt DP2 / DDP DP2"] = tps["nxdt DP2"] / tps["DDP DP2"]
    return out


def plot(rows: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    tps = [rows[n]["tokens_per_s"] for n in names]
    # tokens/s spread from the step-time quartiles (slow quartile → low tokens/s)
    lo = [t - VARIANTS[n]["gbs"] * SEQ / (rows[n]["p75_ms"] / 1e3) for n, t in zip(names, tps)]
    hi = [VARIANTS[n]["gbs"] * SEQ / (rows[n]["p25_ms"] / 1e3) - t for n, t in zip(names, tps)]
    colors = ["tab:gray" if n.startswith("DDP") else "tab:blue" for n in names]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(range(len(names)), tps, yerr=[lo, hi], color=colors, capsize=3)
    ax.set_xticks(range(len(names)), [f"{n}\n({rows[n]['ranks']} rk)" for n in names], fontsize=7)
    ax.set_ylabel("tokens/s (median, IQR bars)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=25, help="steps per run (default 25)")
    parser.add_argument("--warmup", type=int, default=5, help="step intervals skipped per run (default 5)")
    parser.add_argument("--reps", type=int, default=2, help="interleaved rounds (default 2)")
    parser.add_argument("--only", nargs="*", choices=list(VARIANTS), help="a subset of the variants")
    parser.add_argument("--quick", action="store_true", help="1 round of 8 steps (warm-up 3): validates the script")
    parser.add_argument("--label", default="", help="conditions written into results.json (e.g. 'under load')")
    args = parser.parse_args()
    if args.run:
        run_variant(args.run, args.steps, args.out)
        return
    if args.quick:
        args.steps, args.warmup, args.reps = 8, 3, 1
    names = args.only or list(VARIANTS)
    started = time.time()
    print(
        f"{len(names)} variants × {args.reps} rounds × {args.steps} steps (first {args.warmup} intervals skipped), "
        f"{THREADS} thread(s) per rank, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    measured = measure(names, args.reps, args.steps)
    rows = summarise(measured["times"], args.warmup)
    rel = ratios(rows)
    print(f"\n{'variant':<18} {'ranks':>5} {'batch':>5} {'median step ms':>15} {'IQR ms':>15} {'tokens/s':>9}")
    for n, r in rows.items():
        print(
            f"{n:<18} {r['ranks']:>5} {r['global_batch']:>5} {r['median_step_ms']:>15.1f} "
            f"{r['p25_ms']:>7.1f}–{r['p75_ms']:<7.1f} {r['tokens_per_s']:>9.0f}"
        )
    print()
    for k, x in rel.items():
        print(f"{k:<52} {x:6.3f}")
    elapsed = time.time() - started
    print(f"\n{elapsed:.0f} s, load average at the end {os.getloadavg()[0]:.1f}")
    result = {
        "label": args.label,
        "threads_per_rank": THREADS,
        "cpus": os.cpu_count(),
        "seq_length": SEQ,
        "model_overrides": MODEL,
        "steps": args.steps,
        "warmup": args.warmup,
        "reps": args.reps,
        "wall_s": elapsed,
        "load_end": os.getloadavg()[0],
        "variants": rows,
        "ratios": rel,
        "losses": measured["losses"],
        "raw_step_times": measured["times"],
    }
    suffix = "" if not args.only and not args.quick else "-partial"
    (HERE / f"results{suffix}.json").write_text(json.dumps(result, indent=1))
    plot(
        rows,
        HERE / f"plot{suffix}.png",
        f"llama (hidden 256, 4 layers, seq {SEQ}), {THREADS} thread/rank, {os.cpu_count()} CPUs {args.label}",
    )


if __name__ == "__main__":
    main()
