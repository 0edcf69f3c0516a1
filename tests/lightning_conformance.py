"""One LightningModule and its DataLoaders under Lightning's DDPStrategy (gloo) and under NxDStrategy, in the
same two processes (``torchrun --nproc-per-node 2 lightning_conformance.py OUT``); each rank writes what it
saw to ``OUT/rank<k>.json`` and tests/test_lightning_conformance.py compares. Not collected by pytest.

The module records every training loss and every sample index it was given; the runs exercise a shuffled
DistributedSampler, uneven validation data (the sampler pads), ``self.log(sync_dist=True)``, gradient
accumulation, norm clipping that is active, a step LR schedule, ModelCheckpoint and EarlyStopping,
validate/test/predict, manual optimisation, and resume from ``trainer.save_checkpoint``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from nxdt.lightning import NxDStrategy

FEATURES, TRAIN, VAL, BATCH, EPOCHS = 8, 48, 19, 4, 2


class Points(Dataset):
    """y = x·w/8 + noise; the sample's index travels with it, so a rank's share of the data is visible."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = self.x @ torch.arange(1.0, FEATURES + 1) / FEATURES + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "index": i}


class Regressor(pl.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank and in every run
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
        self.automatic_optimization = not manual
        self.losses: list[float] = []
        self.seen: list[list[int]] = [[] for _ in range(EPOCHS)]

    def _loss(self, batch: dict) -> torch.Tensor:
        return F.mse_loss(self.net(batch["x"]).squeeze(-1), batch["y"])

    def training_step(self, batch: dict, batch_idx: int):
        loss = self._loss(batch)
        self.losses.append(loss.item())
        self.seen[self.current_epoch] += batch["index"].tolist()
        self.log("train_loss", loss, sync_dist=True)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.3, gradient_clip_algorithm="norm")
        opt.step()
        self.lr_schedulers().step()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.net(batch["x"]).squeeze(-1)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loaders() -> tuple[DataLoader, DataLoader]:
    return (DataLoader(Points(TRAIN, 1), batch_size=BATCH, shuffle=True), DataLoader(Points(VAL, 2), batch_size=BATCH))


def trainer(strategy, out: Path, name: str, epochs: int = EPOCHS, manual: bool = False) -> pl.Trainer:
    automatic = {} if manual else {"accumulate_grad_batches": 2, "gradient_clip_val": 0.3}
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        default_root_dir=out / name,
        **automatic,
        callbacks=[
            ModelCheckpoint(dirpath=out / name / "best", monitor="val_loss", save_top_k=1),
            EarlyStopping(monitor="val_loss", patience=50),
        ],
    )


def metrics(results: list[dict]) -> dict:
    return {k: float(v) for r in results for k, v in r.items()}


def run(make_strategy, out: Path, name: str, *, manual: bool = False, evaluate: bool = False) -> dict:
    module = Regressor(manual)
    train, val = loaders()
    t = trainer(make_strategy(), out, name, manual=manual)
    t.fit(module, train, val)
    report = {
        "losses": module.losses,
        "seen": module.seen,
        "val_loss": float(t.callback_metrics["val_loss"]),
        "train_loss": float(t.callback_metrics["train_loss"]),
        "best_checkpoint": t.checkpoint_callback.best_model_path,
    }
    if evaluate:
        report["validate"] = metrics(t.validate(module, val, verbose=False))
        report["test"] = metrics(t.test(module, val, verbose=False))
        report["predict"] = torch.cat(t.predict(module, val)).tolist()
    return report


def resumed(make_strategy, out: Path, name: str) -> dict:
    """Epoch 1, ``trainer.save_checkpoint``, then a new Trainer and module continue to epoch 2 from it."""
    first = Regressor()
    train, val = loaders()
    t = trainer(make_strategy(), out, name + "-first", epochs=1)
    t.fit(first, train, val)
    path = out / name / "after-epoch-1.ckpt"
    t.save_checkpoint(path)
    second = Regressor()
    t = trainer(make_strategy(), out, name, epochs=EPOCHS)
    t.fit(second, *loaders(), ckpt_path=path)
    return {"losses": first.losses + second.losses}


def main(out: Path) -> None:
    ddp = lambda: DDPStrategy(process_group_backend="gloo")  # noqa: E731
    nxd = lambda **kw: lambda: NxDStrategy(**kw)  # noqa: E731
    report = {
        "ddp": run(ddp, out, "ddp", evaluate=True),
        "nxdt": run(nxd(), out, "nxdt", evaluate=True),
        "nxdt_zero1": run(nxd(zero1=True), out, "nxdt_zero1"),
        "nxdt_fsdp": run(nxd(fsdp=True), out, "nxdt_fsdp"),
        "ddp_manual": run(ddp, out, "ddp_manual", manual=True),
        "nxdt_manual": run(nxd(), out, "nxdt_manual", manual=True),
        "nxdt_resumed": resumed(nxd(), out, "nxdt_resumed"),
    }
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
