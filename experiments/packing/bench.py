"""SFT packing vs padding on the shipped instruction set: real tokens per second, same model and layout, both
variants measured in one run, rounds interleaved (the order rotated each round).

    python experiments/packing/bench.py             # ≈ 4 min on 2 cores; writes results.json
    python experiments/packing/bench.py --quick     # smoke test (1 round, few steps)

The run is ``+recipe=sft`` (llama_tiny, byte-level tokens, ``nxdt/data/samples/instructions.jsonl``, 128-token
sequences, global batch 8, micro-batch 2) on 2 ranks of replicated data parallelism, through the Lightning API
(``CausalLMModule`` + SFT's data module from ``nxdt.lightning.registry`` + ``NxDStrategy``, the classes ``nxdt train`` builds); the only
difference between the variants is ``model_alignment_strategy.sft.packing``. Measured on rank 0 per optimizer step:

* step time: wall time between consecutive ``on_train_batch_end`` (the first ``--warmup`` intervals dropped);
* real tokens: labelled, non-pad tokens of the whole global batch (``labels != -100`` summed over both ranks) —
  what the loss trains on; prompt and pad positions are not counted;
* real tokens/s = real tokens of the step / its step time, and, for the whole run, Σ real tokens / Σ step time.
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
VARIANTS = {"packing": True, "padding": False}


def run_variant(name: str, steps: int, out: Path) -> None:
    import torch
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from nxdt.config import compose_config
    from nxdt.lightning import NxDStrategy
    from nxdt.lightning.module import CausalLMModule
    from nxdt.lightning.registry import objective_spec

    torch.set_num_threads(THREADS)
    cfg = compose_config(["+recipe=sft", f"model_alignment_strategy.sft.packing={VARIANTS[name]}", f"trainer.max_steps={steps}"])
    pl.seed_everything(cfg.seed, verbose=False)

    class StepTokens(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.real: list[int] = []
            self.positions: list[int] = []
            self.last: float | None = None

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            counts = torch.tensor([(batch["labels"] != -100).sum().item(), batch["labels"].numel()], dtype=torch.float64)
            counts = trainer.strategy.reduce(counts, reduce_op="sum")  # the whole global batch (both DP ranks)
            now = time.perf_counter()
            if self.last is not None:  # the interval ending with this step
                self.times.append(now - self.last)
                self.real.append(int(counts[0]))
                self.positions.append(int(counts[1]))
            self.last = now

    module = CausalLMModule(
        cfg.model,
        cfg.data.global_batch_size,
        cfg.data.seq_length,
        cfg.data.micro_batch_size,
        seed=cfg.seed,
    )
    meter = StepTokens()
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
        callbacks=[meter],
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    data = objective_spec(cfg).build_datamodule(cfg)  # SFT's instruction records (nxdt.lightning.registry)
    trainer.fit(module, datamodule=data)
    if trainer.is_global_zero:
        stats = data.dataset.stats
        out.write_text(
            json.dumps(
                {
                    "step_times": meter.times,
                    "real_tokens": meter.real,
                    "positions": meter.positions,
                    "sequences": stats.sequences,
                    "records": stats.records,
                    "label_tokens_in_set": stats.label_tokens,
                    "pad_tokens_in_set": stats.pad_tokens,
                }
            )
        )
    trainer.strategy.close()


def summarise(runs: list[dict], warmup: int) -> dict:
    times = [t for r in runs for t in r["step_times"][warmup:]]
    real = [n for r in runs for n in r["real_tokens"][warmup:]]
    positions = [n for r in runs for n in r["positions"][warmup:]]
    per_round = [sum(r["real_tokens"][warmup:]) / sum(r["step_times"][warmup:]) for r in runs]
    return {
        "real_tokens_per_s": sum(real) / sum(times),
        "round_real_tokens_per_s": per_round,
        "median_step_ms": statistics.median(times) * 1e3,
        "real_tokens_per_step": sum(real) / len(real),
        "real_fraction_of_positions": sum(real) / sum(positions),
        "positions_per_step": positions[0],
        "sequences_in_set": runs[0]["sequences"],
        "records_in_set": runs[0]["records"],
        "load_before_rounds": [r["load_before"] for r in runs],
    }


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
    rows = {name: summarise(rs, args.warmup) for name, rs in runs.items()}
    ratio = rows["packing"]["real_tokens_per_s"] / rows["padding"]["real_tokens_per_s"]
    print(f"\n{'variant':<8} {'real tok/s':>11} {'median step ms':>15} {'real tok/step':>14} {'real/positions':>15}")
    for n, r in rows.items():
        print(
            f"{n:<8} {r['real_tokens_per_s']:>11.0f} {r['median_step_ms']:>15.1f} {r['real_tokens_per_step']:>14.1f} "
            f"{r['real_fraction_of_positions']:>15.3f}"
        )
    print(f"packing / padding real tokens/s: {ratio:.2f}")
    elapsed = time.time() - started
    result = {
        "cpus": os.cpu_count(),
        "threads_per_rank": THREADS,
        "steps": args.steps,
        "warmup": args.warmup,
        "reps": args.reps,
        "wall_s": elapsed,
        "load_end": os.getloadavg()[0],
        "variants": rows,
        "packing_over_padding": ratio,
        "raw": runs,
    }
    (HERE / ("results.json" if not args.quick else "results-quick.json")).write_text(json.dumps(result, indent=1))
    print(f"\n{elapsed:.0f} s, load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
