"""Checkpoints Lightning can load (issue 33, item 6), under DDPStrategy (gloo) and NxDStrategy (plain, ZeRO-1, FSDP) in
the same two processes (``torchrun --nproc-per-node 2 lightning_conformance_ckpt.py OUT``); each rank writes what it
saw to ``OUT/rank<k>.json`` and tests/test_lightning_conformance_ckpt.py compares, loads and converts the files.
Not collected by pytest.

Every run trains ``Net`` (hyper-parameters saved, Adam over two param groups, a StepLR schedule, ModelCheckpoint with ``save_last``) for
one epoch and saves ``trainer.save_checkpoint(OUT/<run>/epoch1.ckpt)``; a new Trainer and module then resume it for a
second epoch (``fit(ckpt_path=)``). The plain NxDStrategy run resumes its own file; the ZeRO-1 and FSDP runs write nxdt
directories and resume DDP's file (a Lightning file loaded into sharded optimizers); rank 0 converts their
directories with ``convert_to_lightning_checkpoint``. Two hub-model runs (``CausalLMModule``) save model-parallel
directories — a Llama over 2 pipeline stages, a Mixtral with its experts over 2 expert-parallel ranks — which rank 0
converts too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from nxdt.config import compose_config
from nxdt.config.hf_model import model_meta
from nxdt.config.validate import MODEL_SHAPE_FIELDS
from nxdt.lightning.hf import MODEL_CONFIG_KEY, TOKENIZER_KEY
from nxdt.lightning import NxDStrategy, convert_to_lightning_checkpoint
from nxdt.lightning.datamodule import NxDDataModule
from nxdt.lightning.module import CausalLMModule

FEATURES, SAMPLES, BATCH = 6, 32, 4
# model-parallel layouts only the hub models have (CausalLMModule): their directories converted to one file
HUB_RUNS = {
    "pp2": (["model=llama_tiny", "model.num_layers=2"], {"pipeline_parallel_size": 2}),
    "ep2": (["model=mixtral_tiny", "model.num_layers=2"], {"expert_parallel_size": 2}),
}


def hub_config(overrides: list[str]):
    return compose_config(
        [*overrides, "data=synthetic", "data.seq_length=16", "data.global_batch_size=4", "data.micro_batch_size=1"]
        + ["trainer.max_steps=2", "model.optim.sched.warmup_steps=0", "model.optim.sched.name=constant"]
    )


def checkpoint_meta(cfg) -> dict:
    return {
        "model": {k: getattr(cfg.model, k) for k in MODEL_SHAPE_FIELDS},
        MODEL_CONFIG_KEY: model_meta(cfg.model),
        TOKENIZER_KEY: None,
    }


def hub_module(cfg) -> CausalLMModule:
    """The arguments ``CausalLMModule.load_from_checkpoint`` needs too (it saves no hyper-parameters)."""
    return CausalLMModule(cfg.model, cfg.data.global_batch_size, cfg.data.seq_length, cfg.data.micro_batch_size)


def hub_run(name: str, out: Path) -> dict:
    """Two steps of a tiny hub model on a model-parallel layout, ``trainer.save_checkpoint`` (an nxdt directory);
    reports this rank's weights (its stage, or its experts and the dense layers) by the module's names."""
    overrides, options = HUB_RUNS[name]
    cfg = hub_config(overrides)
    pl.seed_everything(cfg.seed, verbose=False)
    module = hub_module(cfg)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        # what nxdt train records (train.py): the model's shape, checked on load, and what export-hf writes
        strategy=NxDStrategy(**options, checkpoint_meta=checkpoint_meta(cfg)),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    data = NxDDataModule(cfg.data, seed=cfg.seed, vocab_size=cfg.model.vocab_size, step_batches=True)
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(out / f"{name}.ckpt")
    [optimizer] = trainer.strategy.optimizers
    moments = {n: optimizer.state[p]["exp_avg"] for n, p in module.named_parameters() if p in optimizer.state}
    state = {"weights": trainer.strategy.lightning_module_state_dict(), "exp_avg": moments}
    torch.save(state, out / f"{name}-rank{trainer.global_rank}.pt")  # tensors: the test compares them exactly
    trainer.strategy.close()
    return {"weights": sorted(state["weights"])}


class Net(pl.LightningModule):
    """A user's module: hyper-parameters through save_hyperparameters (load_from_checkpoint re-creates it from them)."""

    def __init__(self, hidden: int = 8, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)  # the same initial weights on every rank and in every run
        self.body = nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        # two groups, the first out of the module's order: a file numbers the state in the optimizer's own order
        groups = [{"params": [self.head.bias, self.head.weight]}, {"params": self.body.parameters(), "weight_decay": 0.1}]
        opt = torch.optim.Adam(groups, lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return DataLoader(TensorDataset(x, x.sum(-1) / FEATURES), batch_size=BATCH)


def trainer(strategy, out: Path, epochs: int) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        default_root_dir=out,
        callbacks=[ModelCheckpoint(dirpath=out, save_last=True)],
    )


def run(make_strategy, out: Path, resume_from: Path | None = None) -> dict:
    """Epoch 1 and its checkpoint; then epoch 2 resumed from ``resume_from`` (default: that checkpoint)."""
    first = trainer(make_strategy(), out, 1)
    first.fit(Net(), data(1), data(2))
    first.save_checkpoint(out / "epoch1.ckpt")
    state = first.strategy.lightning_module_state_dict()  # a collective under FSDP: every rank
    report = {"state_keys": list(state), "epoch1_weights": {k: v.reshape(-1).tolist() for k, v in state.items()}}
    second = trainer(make_strategy(), out / "resumed", 2)
    module = Net()
    second.fit(module, data(1), data(2), ckpt_path=resume_from or out / "epoch1.ckpt")
    state = second.strategy.lightning_module_state_dict()
    report["resumed_weights"] = {k: v.reshape(-1).tolist() for k, v in state.items()}
    report["resumed_val_loss"] = float(second.callback_metrics["val_loss"])
    return report


def main(out: Path) -> None:
    ddp = lambda: DDPStrategy(process_group_backend="gloo")  # noqa: E731
    report = {"ddp": run(ddp, out / "ddp")}
    ddp_file = out / "ddp" / "epoch1.ckpt"
    report["nxdt"] = run(lambda: NxDStrategy(), out / "nxdt")
    report["nxdt_zero1"] = run(lambda: NxDStrategy(zero1=True), out / "nxdt_zero1", resume_from=ddp_file)
    report["nxdt_fsdp"] = run(lambda: NxDStrategy(fsdp=True), out / "nxdt_fsdp", resume_from=ddp_file)
    for name in HUB_RUNS:
        report[name] = hub_run(name, out)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        for name in ("nxdt_zero1", "nxdt_fsdp"):
            convert_to_lightning_checkpoint(out / name / "epoch1.ckpt", out / f"{name}-converted.ckpt")
        for name in HUB_RUNS:
            convert_to_lightning_checkpoint(out / f"{name}.ckpt", out / f"{name}-converted.ckpt")
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
