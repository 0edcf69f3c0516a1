"""One LoRA training through the Lightning API (``CausalLMModule(peft=...)`` + ``NxDStrategy``), run as a user runs
it: ``python lora_lightning_run.py LAYOUT OUT STEPS [RESUME]`` (Lightning starts the other workers). Writes
``OUT/losses.json`` (step → loss), ``OUT/ckpt`` (``trainer.save_checkpoint`` at the end) and ``OUT/adapter`` (the PEFT
adapter gathered from every shard). Used by test_lora_lightning.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from nxdt.config import compose_config
from nxdt.lightning import NxDStrategy
from nxdt.lightning.datamodule import NxDDataModule
from nxdt.lightning.module import CausalLMModule
from nxdt.lightning.peft_export import export_peft_adapter

LAYOUTS = {
    "single": (1, {}),
    "tp2": (2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "fsdp2": (2, {"fsdp": {"param_persistence_threshold": 0}}),
    "zero1": (2, {"zero1": True}),
}
PEFT = {
    "lora_rank": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.0,
    "target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
}


def config(steps: int):
    """llama_tiny with 2 layers; AdamW with eps=1 and a constant lr: for these gradients (|g| ≪ 1) its update
    lr·m̂/(√v̂+1) ≈ lr·m̂ is linear in the gradient, like momentum SGD, so fp32 reduction-order differences between
    layouts stay ~1e-7 relative instead of being amplified by Adam's normalisation of near-zero gradients."""
    return compose_config(
        [
            "model=llama_tiny",
            "model.num_layers=2",
            "data=synthetic",
            "data.seq_length=32",
            "data.global_batch_size=4",
            "data.micro_batch_size=1",
            f"trainer.max_steps={steps}",
            "model.optim.sched.warmup_steps=0",
            "model.optim.sched.name=constant",
            "model.optim.lr=0.5",
            "model.optim.eps=1.0",
            "model.optim.weight_decay=0.0",
        ]
    )


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses[module.step_metrics["step"]] = module.step_metrics["loss"]


def main(layout: str, out: Path, steps: int, resume: str | None) -> None:
    devices, options = LAYOUTS[layout]
    cfg = config(steps)
    pl.seed_everything(cfg.seed, verbose=False)
    module = CausalLMModule(cfg.model, cfg.data.global_batch_size, cfg.data.seq_length, cfg.data.micro_batch_size, peft=PEFT)
    losses = Losses()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=NxDStrategy(**options),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[losses],
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(
        module,
        datamodule=NxDDataModule(cfg.data, seed=cfg.seed, vocab_size=cfg.model.vocab_size, step_batches=True),
        ckpt_path=resume,
    )
    trainer.save_checkpoint(str(out / "ckpt"))
    adapters = trainer.strategy.trainable_state_dict()  # collective: every rank gathers
    if trainer.is_global_zero:
        export_peft_adapter(module.model, out / "adapter", adapters=adapters)
        (out / "losses.json").write_text(json.dumps(losses.losses))
    trainer.strategy.close()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
