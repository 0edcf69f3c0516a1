"""LoRA vs full fine-tuning on llama_tiny, same layout (DP2, replicated data parallelism): optimizer-state memory
and step time, both variants measured in one run, repetitions interleaved.

    python experiments/lora/bench.py            # ≈ 3 min on 2 cores; writes results.json
    python experiments/lora/bench.py --quick    # smoke test (1 round, few steps)

Every variant is one ``python bench.py --run VARIANT`` process tree launched the way a user runs a Lightning
script (``NxDStrategy`` starts the second rank), with the same ``CausalLMModule`` (AdamW, synthetic data, global
batch, seed), the only difference being ``peft=`` (``nxdt.models.lora.apply_peft``). Measured on rank 0:

* optimizer state bytes: every tensor in the optimizer's state after the run (AdamW: exp_avg, exp_avg_sq and the
  step counters), i.e. what the optimizer really allocated, not a formula;
* trainable / total parameters;
* step time: wall time between consecutive ``on_train_batch_end``, the first ``--warmup`` intervals dropped.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from harness import apply_quick, bench_arguments, interleaved_runs  # noqa: E402

THREADS = 1  # intra-op threads per rank (2 ranks on 2 cores)
SEQ = 128
GBS, MBS = 8, 4
ALL = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
VARIANTS: dict[str, dict | None] = {
    "full fine-tuning": None,
    "LoRA r16 qkv_proj (NxDT default)": {"lora_rank": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": ["qkv_proj"]},
    "LoRA r16 all four targets": {"lora_rank": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": ALL},
}


def run_variant(name: str, steps: int, out: Path) -> None:
    import torch
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from nxdt.config import compose_config
    from nxdt.lightning import NxDStrategy
    from nxdt.lightning.datamodule import NxDDataModule
    from nxdt.lightning.module import CausalLMModule

    torch.set_num_threads(THREADS)
    cfg = compose_config(
        [
            "model=llama_tiny",
            "data=synthetic",
            f"data.seq_length={SEQ}",
            f"data.global_batch_size={GBS}",
            f"data.micro_batch_size={MBS}",
            f"trainer.max_steps={steps}",
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

    module = CausalLMModule(cfg.model, GBS, SEQ, MBS, peft=VARIANTS[name])
    timer = StepTimes()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=NxDStrategy(),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[timer],
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=NxDDataModule(cfg.data, seed=cfg.seed, vocab_size=cfg.model.vocab_size, step_batches=True))
    optimizer = trainer.optimizers[0]
    state_bytes = sum(
        v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    )
    params = list(module.model.parameters())
    if trainer.is_global_zero:
        out.write_text(
            json.dumps(
                {
                    "step_times": timer.times,
                    "losses": timer.losses,
                    "optimizer_state_bytes": state_bytes,
                    "trainable": sum(p.numel() for p in params if p.requires_grad),
                    "total": sum(p.numel() for p in params),
                }
            )
        )
    trainer.strategy.close()


def main() -> None:
    args = bench_arguments(__doc__.splitlines()[0]).parse_args()
    if args.run:
        run_variant(args.run, args.steps, args.out)
        return
    apply_quick(args)
    names = list(VARIANTS)
    started = time.time()
    print(
        f"{len(names)} variants × {args.reps} rounds × {args.steps} steps, DP2, {THREADS} thread/rank, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    runs = interleaved_runs(__file__, names, args.reps, args.steps, THREADS)
    rows = {}
    for name, rs in runs.items():
        timed = sorted(t for r in rs for t in r["step_times"][args.warmup :])
        q1, med, q3 = statistics.quantiles(timed, n=4) if len(timed) > 1 else (timed[0],) * 3
        rows[name] = {
            "median_step_ms": med * 1e3,
            "p25_ms": q1 * 1e3,
            "p75_ms": q3 * 1e3,
            "optimizer_state_bytes": rs[0]["optimizer_state_bytes"],
            "trainable": rs[0]["trainable"],
            "total": rs[0]["total"],
            "round_medians_ms": [statistics.median(r["step_times"][args.warmup :]) * 1e3 for r in rs],
            "losses": rs[0]["losses"],
        }
    full = rows["full fine-tuning"]
    ratios = {
        name: {
            "optimizer_state": r["optimizer_state_bytes"] / full["optimizer_state_bytes"],
            "step_time": r["median_step_ms"] / full["median_step_ms"],
        }
        for name, r in rows.items()
        if r is not full
    }
    print(f"\n{'variant':<34} {'trainable':>10} {'opt. state B':>13} {'median ms':>10} {'IQR ms':>15}")
    for n, r in rows.items():
        print(
            f"{n:<34} {r['trainable']:>10} {r['optimizer_state_bytes']:>13} {r['median_step_ms']:>10.1f} "
            f"{r['p25_ms']:>7.1f}–{r['p75_ms']:<7.1f}"
        )
    for n, x in ratios.items():
        print(f"{n:<34} optimizer state / full {x['optimizer_state']:.4f}   step time / full {x['step_time']:.3f}")
    elapsed = time.time() - started
    result = {
        "label": args.label,
        "cpus": os.cpu_count(),
        "threads_per_rank": THREADS,
        "seq_length": SEQ,
        "global_batch": GBS,
        "micro_batch": MBS,
        "steps": args.steps,
        "warmup": args.warmup,
        "reps": args.reps,
        "wall_s": elapsed,
        "load_end": os.getloadavg()[0],
        "variants": rows,
        "ratios": ratios,
        "raw_step_times": {n: [r["step_times"] for r in rs] for n, rs in runs.items()},
    }
    (HERE / ("results.json" if not args.quick else "results-quick.json")).write_text(json.dumps(result, indent=1))
    print(f"\n{elapsed:.0f} s, load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
