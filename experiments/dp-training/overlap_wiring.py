"""Does NxDStrategy arm the overlapped reduction where it should? Two ranks, as a user's script (``python script.py``:
Lightning's launcher starts rank 1), four Trainers in turn:

    python experiments/dp-training/overlap_wiring.py OUT_DIR      # writes OUT_DIR/rank<k>.json and prints rank 0's

* nxdt's CausalLMModule (manual optimization, micro-batches inside ``NxDStrategy.forward_backward``), plain DP and
  ZeRO-1, 4 micro-batches per rank per step: how many buckets left during the last backward, of how many;
* a plain LightningModule with ``accumulate_grad_batches=2`` (Lightning's ``block_backward_sync`` on the first
  micro-batch), overlap on and off: the same, and whether the weights after the epoch are bitwise equal.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from nxdt.lightning import NxDStrategy

QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


class Probe(Callback):
    """After each Lightning batch: [buckets issued in the last armed backward, ...] + [buckets, ...]."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        reductions = trainer.strategy._dp._reductions
        self.seen.append([r.issued_in_backward for r in reductions] + [len(r.buckets) for r in reductions])


def causal(zero1: bool) -> dict:
    from nxdt.config import compose_config
    from nxdt.lightning.datamodule import NxDDataModule
    from nxdt.lightning.module import CausalLMModule

    cfg = compose_config(
        ["data=synthetic", "data.global_batch_size=16", "data.micro_batch_size=2", "data.seq_length=64", "trainer.devices=2"]
    )
    probe, strategy = Probe(), NxDStrategy(zero1=zero1, bucket_cap_mb=0.5)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=3, use_distributed_sampler=False, callbacks=[probe], **QUIET
    )
    module = CausalLMModule(cfg.model, cfg.data.global_batch_size, cfg.data.seq_length, cfg.data.micro_batch_size)
    trainer.fit(module, datamodule=NxDDataModule(cfg.data, seed=cfg.seed, vocab_size=cfg.model.vocab_size, step_batches=True))
    strategy.close()
    return {"overlap_off": strategy.overlap_off, "issued/buckets": probe.seen}


class Accumulating(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 2, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4)


def accumulating(overlap: bool) -> dict:
    probe, strategy = Probe(), NxDStrategy(bucket_cap_mb=0.01, overlap_grad_reduce=overlap)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, accumulate_grad_batches=2, callbacks=[probe], **QUIET
    )
    module = Accumulating()
    trainer.fit(module)
    strategy.close()
    weights = [p.detach().reshape(-1).tolist() for p in module.parameters()]
    return {"overlap_off": strategy.overlap_off, "issued/buckets": probe.seen, "weights": weights}


def main(out: Path) -> None:
    report = {
        "causal_lm": causal(False),
        "causal_lm_zero1": causal(True),
        "accumulate2_on": accumulating(True),
        "accumulate2_off": accumulating(False),
    }
    report["accumulate2_bitwise_equal"] = report["accumulate2_on"]["weights"] == report["accumulate2_off"]["weights"]  # type: ignore[index]
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # Lightning's launcher sets it for the ranks it starts
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    if rank == 0:
        for name, value in report.items():
            print(name, {k: v for k, v in value.items() if k != "weights"} if isinstance(value, dict) else value)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
