"""Data-parallel training step time: nxdt's NxDStrategy vs Lightning's DDPStrategy (gloo), same run.

    python experiments/dp-training/compare.py            # runs both, 2 ranks each, prints a table + writes results.json

Same model (llama_tiny widened to hidden 256 so the gradient all-reduce is ~12 MB), same synthetic data, same
global batch, same seed; each strategy is launched the way a user runs it (`python script.py`, the strategy
starts its second worker). Reported: median step time over steps 6..N (warm-up excluded) and the losses, which
must agree between the two (both average gradients over the two ranks).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

STEPS = 40
OVERRIDES = [
    "data=synthetic",
    "model.hidden_size=256",
    "model.ffn_hidden_size=688",
    "data.global_batch_size=8",
    "data.micro_batch_size=4",
    "data.seq_length=128",
    f"trainer.max_steps={STEPS}",
    "trainer.devices=2",
]


def run(strategy_name: str, out: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy

    from nxdt.config import compose_config
    from nxdt.lightning import NxDStrategy
    from nxdt.lightning.datamodule import NxDDataModule
    from nxdt.lightning.module import CausalLMModule

    cfg = compose_config(OVERRIDES)
    pl.seed_everything(cfg.seed, verbose=False)

    class StepTimes(Callback):
        def __init__(self):
            self.times, self.losses, self.last = [], [], None

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            now = time.perf_counter()
            if self.last is not None:
                self.times.append(now - self.last)
            self.last = now
            self.losses.append(module.step_metrics["loss"])

    timer = StepTimes()
    strategy = NxDStrategy() if strategy_name == "nxdt" else DDPStrategy(process_group_backend="gloo")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[timer],
    )
    # CausalLMModule optimizes manually (micro-batches, clipping inside its step): clipping is its argument, not the
    # Trainer's (Lightning refuses gradient_clip_val under manual optimization)
    module = CausalLMModule(
        cfg.model, cfg.data.global_batch_size, cfg.data.seq_length, cfg.data.micro_batch_size, gradient_clip_val=1.0
    )
    trainer.fit(module, datamodule=NxDDataModule(cfg.data, seed=cfg.seed, vocab_size=cfg.model.vocab_size))
    if trainer.is_global_zero:
        n_params = sum(p.numel() for p in module.parameters())
        out.write_text(
            json.dumps({"strategy": strategy_name, "params": n_params, "step_times": timer.times, "losses": timer.losses})
        )


def main() -> None:
    here = Path(__file__).resolve().parent
    if len(sys.argv) == 3 and sys.argv[1] == "--run":
        run(sys.argv[2], here / f".{sys.argv[2]}.json")
        return
    results = {}
    for name in ("nxdt", "ddp"):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # 2 ranks on 2 cores: one intra-op thread each, for both
        subprocess.run([sys.executable, __file__, "--run", name], check=True, env=env, capture_output=True)
        results[name] = json.loads((here / f".{name}.json").read_text())
        (here / f".{name}.json").unlink()
    med = {k: statistics.median(v["step_times"][5:]) for k, v in results.items()}
    diff = max(abs(a - b) / abs(b) for a, b in zip(results["nxdt"]["losses"], results["ddp"]["losses"]))
    print(
        f"model: {results['nxdt']['params'] / 1e6:.2f} M parameters (fp32 gradient all-reduce {results['nxdt']['params'] * 4 / 2**20:.1f} MB/step), 2 ranks, {STEPS} steps"
    )
    print(f"{'strategy':<22} {'median step (ms)':>17} {'steps/s':>8}")
    for k, label in (("nxdt", "NxDStrategy (nxdt.comm)"), ("ddp", "DDPStrategy (gloo)")):
        print(f"{label:<22} {med[k] * 1e3:>17.1f} {1 / med[k]:>8.2f}")
    print(f"speed-up nxdt vs ddp: {med['ddp'] / med['nxdt']:.2f}x; max relative loss difference: {diff:.2e}")
    (here / "results.json").write_text(json.dumps({"median_step_s": med, "max_rel_loss_diff": diff, **results}, indent=1))


if __name__ == "__main__":
    main()
