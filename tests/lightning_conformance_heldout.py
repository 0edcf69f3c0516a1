"""Held-out LightningModules (issue 33: "held-out modules this project did not write must pass too"): eight modules
written the way Lightning users write them, each using an API the other conformance scripts do not — several
validation dataloaders, ``self.all_gather``, ``configure_gradient_clipping``, schedulers with ``interval``/
``frequency`` and ReduceLROnPlateau under ``LearningRateMonitor``, gradient accumulation by hand in manual
optimisation, a ``training_step`` returning a dict with ``save_hyperparameters``/``ModelCheckpoint(monitor=)``/
``EarlyStopping``, tied weights, and ``on_epoch``/``reduce_fx`` logging with ``limit_train_batches`` and
``val_check_interval``. tests/lightning_conformance_demos.py runs each under DDPStrategy (gloo) and NxDStrategy (plain,
ZeRO-1, FSDP) in its one launch; tests/test_lightning_conformance_demos.py compares. Not collected by pytest.

Each run reports, on each rank: every step's loss as the rank saw it, every ``log_metrics`` call a logger received
(step and values), ``trainer.callback_metrics`` after fit, what the module's own extra entry points returned
(``trainer.test``, ``trainer.predict``, the checkpoint callback's choices), and saves the final weights.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import Logger

FEATURES, BATCH = 6, 4


def points(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    return TensorDataset(x, x @ torch.linspace(-1, 1, FEATURES) + 0.1 * torch.randn(n, generator=g))


def loader(n: int, seed: int, shuffle: bool = False) -> DataLoader:
    return DataLoader(points(n, seed), batch_size=BATCH, shuffle=shuffle)


class Memory(Logger):
    """A logger keeping every ``log_metrics`` call on every rank (Lightning's own loggers write on rank 0 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append({"step": step, **{k: float(v) for k, v in metrics.items()}})


class Regression(pl.LightningModule):
    """The common part: a small MLP regressor; each held-out module below adds what a user's module would."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, 12), nn.Tanh(), nn.Linear(12, 1))
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return loader(40, 1, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return loader(14, 2)


class MultiVal(Regression):
    """Two validation dataloaders (``dataloader_idx``), ``on_step``+``on_epoch`` logging, then ``trainer.test`` and
    ``trainer.predict`` (``return_predictions``) after fit."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.losses.append(loss.item())
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_mae", F.l1_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def val_dataloader(self) -> list[DataLoader]:
        return [loader(14, 2), loader(10, 3)]


class Gathered(Regression):
    """``self.all_gather`` of a tensor in the step and of a dict of each rank's outputs at epoch end: the R² of the
    whole validation set, computed the same on every rank, logged without ``sync_dist``."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.losses.append(loss.item())
        self.log("gathered_loss", self.all_gather(loss.detach()).mean())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.outputs.append((self(x), y))

    def on_validation_epoch_end(self) -> None:
        preds, ys = (torch.cat(t) for t in zip(*self.outputs))
        self.outputs.clear()
        every = self.all_gather({"pred": preds, "y": ys})  # [world, n] each
        pred, y = every["pred"].flatten(), every["y"].flatten()
        self.log("val_r2", 1 - ((pred - y) ** 2).sum() / ((y - y.mean()) ** 2).sum())
        self.log("gathered_rows", float(pred.numel()))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.02)


class ClipOverride(Regression):
    """``configure_gradient_clipping`` overridden as Lightning's docs show it: the Trainer's clipping (by value) from
    epoch 1 on, none in epoch 0."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        if self.current_epoch > 0:
            self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm)


class Schedules(Regression):
    """StepLR stepped every 2 optimizer steps (``interval: step``, ``frequency: 2``) and ReduceLROnPlateau on
    ``val_loss`` per epoch over one Adam; ``LearningRateMonitor`` logs the learning rate every step."""

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.05)
        step = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.5)
        return [opt], [
            {"scheduler": step, "interval": "step", "frequency": 2, "name": "lr-step"},
            {"scheduler": plateau, "monitor": "val_loss", "interval": "epoch", "name": "lr-plateau"},
        ]


class ManualAccumulation(Regression):
    """Manual optimisation accumulating two batches by hand (Lightning refuses ``accumulate_grad_batches`` there):
    ``manual_backward`` each batch, clip and step every second one, the scheduler stepped with it."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt, sched = self.optimizers(), self.lr_schedulers()
        loss = self.loss(batch)
        self.losses.append(loss.item())
        self.manual_backward(loss / 2)
        if (batch_idx + 1) % 2 == 0:
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            sched.step()
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.03, weight_decay=0.1)
        return [opt], [torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)]


class Checkpointed(Regression):
    """``save_hyperparameters``; ``training_step`` returns a dict (the loss and a detached extra);
    ``ModelCheckpoint(monitor="val_loss", save_top_k=2)`` and ``EarlyStopping(monitor="val_loss")``."""

    def __init__(self, hidden: int = 12, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self(x)
        loss = F.mse_loss(pred, y)
        self.losses.append(loss.item())
        return {"loss": loss, "pred_mean": pred.mean().detach()}

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.log("pred_mean", outputs["pred_mean"], sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class Tied(pl.LightningModule):
    """A tiny language model whose output projection is its embedding (``head.weight = embed.weight``), AdamW with
    weight decay: the shared tensor gets both uses' gradients and one update."""

    VOCAB, WIDTH, LENGTH = 16, 8, 6

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(self.VOCAB, self.WIDTH)
        self.mix = nn.Linear(self.WIDTH, self.WIDTH)
        self.head = nn.Linear(self.WIDTH, self.VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.losses: list[float] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))))

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, self.VOCAB), tokens[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(4)
        return DataLoader(TensorDataset(torch.randint(self.VOCAB, (32, self.LENGTH), generator=g)), batch_size=BATCH)


class EpochLogging(Regression):
    """Step and epoch aggregates as users log them: ``on_step``+``on_epoch`` with ``reduce_fx="max"``, ``log_dict``,
    and an epoch-end mean over the step outputs the module collected itself."""

    def __init__(self) -> None:
        super().__init__()
        self.step_losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.losses.append(loss.item())
        self.step_losses.append(loss.detach())
        self.log("worst_loss", loss, on_step=True, on_epoch=True, reduce_fx="max", sync_dist=True)
        self.log_dict({"loss_x2": 2 * loss.detach(), "batch_size": float(len(batch[0]))}, on_step=False, on_epoch=True)
        return loss

    def on_train_epoch_end(self) -> None:
        self.log("epoch_mean_loss", torch.stack(self.step_losses).mean(), sync_dist=True)
        self.step_losses.clear()


# name: (module factory, Trainer arguments beyond the common ones, DDPStrategy options)
MODULES: dict[str, tuple[Any, dict[str, Any], dict[str, Any]]] = {
    "multi_val": (MultiVal, {}, {}),
    "all_gather": (Gathered, {}, {}),
    "clip_override": (ClipOverride, {"gradient_clip_val": 0.02, "gradient_clip_algorithm": "value"}, {}),
    "schedules": (Schedules, {"max_epochs": 3, "limit_train_batches": 4}, {}),
    "manual_accumulation": (ManualAccumulation, {}, {}),
    "checkpointed": (Checkpointed, {"max_epochs": 5}, {}),
    "tied": (Tied, {}, {}),
    "epoch_logging": (EpochLogging, {"limit_train_batches": 3, "val_check_interval": 2}, {}),
}


def callbacks(name: str, root: Path) -> list[pl.Callback]:
    if name == "schedules":
        return [LearningRateMonitor(logging_interval="step")]
    if name == "checkpointed":
        best = ModelCheckpoint(dirpath=root / "best", monitor="val_loss", save_top_k=2, filename="{epoch}-{val_loss:.4f}")
        return [best, EarlyStopping(monitor="val_loss", min_delta=0.02, patience=0)]
    return []


def fit(name: str, make_strategy, root: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """One held-out module fitted under the strategy; what the run showed, and its final weights."""
    make_module, trainer_args, _ = MODULES[name]
    pl.seed_everything(7, verbose=False)
    module, logger = make_module(), Memory()
    trainer = pl.Trainer(
        **{
            "strategy": make_strategy(),
            "accelerator": "cpu",
            "devices": 2,
            "max_epochs": 2,
            "logger": logger,
            "log_every_n_steps": 1,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "enable_checkpointing": name == "checkpointed",
            "default_root_dir": root / name,
            "callbacks": callbacks(name, root / name),
            **trainer_args,
        }
    )
    trainer.fit(module)
    report: dict[str, Any] = {
        "losses": module.losses,
        "logged": logger.calls,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
    }
    if name == "multi_val":
        report["test"] = [{k: float(v) for k, v in r.items()} for r in trainer.test(module, loader(18, 4), verbose=False)]
        predictions = trainer.predict(module, loader(10, 5), return_predictions=True)
        report["predict"] = [p.tolist() for p in predictions]
    if name == "checkpointed":
        ckpt = trainer.checkpoint_callback
        report["best"] = {
            "path": Path(ckpt.best_model_path).name,
            "score": float(ckpt.best_model_score),
            "top_k": sorted(Path(p).name for p in ckpt.best_k_models),
            "stopped_epoch": trainer.early_stopping_callback.stopped_epoch,
        }
    weights = {k: v.detach().clone() for k, v in trainer.strategy.lightning_module_state_dict().items()}
    return report, weights


def run_all(out: Path, variants: dict[str, Any], report: dict[str, Any], rank: int) -> None:
    """Every held-out module under DDP and each NxDStrategy variant: ``report["<module>/<run>"]`` and
    ``OUT/<run>/<module>-rank<k>.pt`` (the final weights)."""
    from lightning.pytorch.strategies import DDPStrategy

    for name, (_, _, ddp_options) in MODULES.items():
        runs = {"ddp": lambda: DDPStrategy(process_group_backend="gloo", **ddp_options), **variants}
        for run, make_strategy in runs.items():
            (out / run).mkdir(parents=True, exist_ok=True)
            try:
                report[f"{name}/{run}"], weights = fit(name, make_strategy, out / run)
            except Exception as exc:  # noqa: BLE001 — the test names what was raised
                traceback.print_exc()
                report[f"{name}/{run}"] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            torch.save(weights, out / run / f"{name}-rank{rank}.pt")


if __name__ == "__main__":  # by hand: torchrun --nproc-per-node 2 tests/lightning_conformance_heldout.py OUT [MODULE...]
    import json
    import os
    import sys

    from nxdt.lightning import NxDStrategy

    out, rank = Path(sys.argv[1]), int(os.environ.get("RANK", "0"))
    for extra in set(MODULES) - set(sys.argv[2:] or MODULES):
        del MODULES[extra]
    variants = {"nxdt": NxDStrategy, "nxdt_zero1": lambda: NxDStrategy(zero1=True), "nxdt_fsdp": lambda: NxDStrategy(fsdp=True)}
    result: dict[str, Any] = {}
    run_all(out, variants, result, rank)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
