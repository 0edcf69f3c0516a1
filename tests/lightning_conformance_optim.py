"""Optimizers as Lightning users write them, under DDPStrategy (gloo) and NxDStrategy (plain, ZeRO-1, FSDP) in the same
two processes (``torchrun --nproc-per-node 2 lightning_conformance_optim.py OUT``); each rank writes what it saw to
``OUT/rank<k>.json`` and tests/test_lightning_conformance_optim.py compares. Not collected by pytest.

* ``gan``: Lightning's GAN example (examples/pytorch/domain_templates/generative_adversarial_net.py of the lightning
  repository), shrunk: a generator and a discriminator, one Adam each, manual optimisation with
  ``toggle_optimizer``, each optimizer stepped after its own backward; ``gan_clip`` also clips each optimizer with
  ``self.clip_gradients(opt, ...)`` (active: the limit is below the gradients' norms).
* ``part``: automatic optimisation, the optimizer holds only part of the model (the rest still trains its gradient,
  as a user's auxiliary head does), ``gradient_clip_val`` active; ``on_before_optimizer_step`` records Lightning's
  ``grad_norm`` of the module (what a user logs).
* ``unused``: a layer the forward never uses, AdamW with weight decay; with ``find_unused_parameters=True`` it must stay
  untouched, as under DDP; without, NxDStrategy must refuse, naming it.
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
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import grad_norm

from nxdt.lightning import NxDStrategy

LATENT, IMAGE, SAMPLES, BATCH = 4, 6, 32, 4


def data(seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, IMAGE, generator=g)
    return DataLoader(TensorDataset(x, x.sum(-1, keepdim=True) / IMAGE), batch_size=BATCH, shuffle=True)


def weights(trainer: pl.Trainer) -> dict[str, list[float]]:
    """The final weights by name (NxDStrategy under FSDP gathers them: its model file's names)."""
    state = trainer.strategy.lightning_module_state_dict()
    return {k: v.detach().float().reshape(-1).tolist() for k, v in state.items()}


class GAN(pl.LightningModule):
    """The GAN example's training step and optimizers, with linear layers sized for a test."""

    def __init__(self, clip: float | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(LATENT, 16), nn.LeakyReLU(0.2), nn.Linear(16, IMAGE), nn.Tanh())
        self.discriminator = nn.Sequential(nn.Linear(IMAGE, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())
        self.automatic_optimization = False
        self.clip = clip
        self.record: dict[str, list[float]] = {"g_loss": [], "d_loss": [], "g_norm": [], "d_norm": []}

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def training_step(self, batch, batch_idx: int) -> None:
        imgs, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(imgs.shape[0], LATENT, generator=torch.Generator().manual_seed(1000 + batch_idx))
        valid, fake = torch.ones(imgs.size(0), 1), torch.zeros(imgs.size(0), 1)

        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy(self.discriminator(self(z)), valid)
        self.manual_backward(g_loss)
        if self.clip is not None:
            self.clip_gradients(opt_g, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        real = F.binary_cross_entropy(self.discriminator(imgs), valid)
        fake_loss = F.binary_cross_entropy(self.discriminator(self(z).detach()), fake)
        d_loss = (real + fake_loss) / 2
        self.manual_backward(d_loss)
        if self.clip is not None:
            self.clip_gradients(opt_d, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.record["g_loss"].append(g_loss.item())
        self.record["d_loss"].append(d_loss.item())

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=0.01, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=0.01, betas=(0.5, 0.999))
        return [opt_g, opt_d], []


class Part(pl.LightningModule):
    """A body and an auxiliary head; the optimizer holds the body only (``gradient_clip_val`` clips its norm alone)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(IMAGE, 16), nn.Tanh(), nn.Linear(16, 1))
        self.aux = nn.Sequential(nn.Linear(IMAGE, 8), nn.Tanh(), nn.Linear(8, 1))
        self.record: dict[str, list[float]] = {"loss": [], "grad_norm": [], "strategy_grad_norm": []}

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.body(x), y) + 10.0 * F.mse_loss(self.aux(x), y)
        self.record["loss"].append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        self.record["grad_norm"].append(float(grad_norm(self, norm_type=2)["grad_2.0_norm_total"]))
        if isinstance(self.trainer.strategy, NxDStrategy):  # the same total for every runtime, FSDP's shards included
            self.record["strategy_grad_norm"].append(float(self.trainer.strategy.gradient_norm()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.body.parameters(), lr=0.05, momentum=0.9)


class Unused(pl.LightningModule):
    """AdamW with weight decay over a model one of whose layers the forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Sequential(nn.Linear(IMAGE, 8), nn.Tanh(), nn.Linear(8, 1))
        self.unused = nn.Linear(IMAGE, 1)
        self.record: dict[str, list[float]] = {"loss": []}

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.used(x), y)
        self.record["loss"].append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.5)


def fit(module: pl.LightningModule, make_strategy, **trainer_kwargs) -> dict:
    try:
        strategy = make_strategy()
    except TypeError as exc:
        return {"error": f"TypeError: {exc}"}
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        deterministic=True,
        **trainer_kwargs,
    )
    initial = {k: v.detach().reshape(-1).tolist() for k, v in module.state_dict().items()}
    try:
        trainer.fit(module, data(1))
    except Exception as exc:  # noqa: BLE001 - the refusal is what some runs record
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {**module.record, "initial": initial, "weights": weights(trainer)}


def main(out: Path) -> None:
    ddp = lambda **kw: lambda: DDPStrategy(process_group_backend="gloo", **kw)  # noqa: E731
    nxd = lambda **kw: lambda: NxDStrategy(**kw)  # noqa: E731
    variants = {"nxdt": {}, "nxdt_zero1": {"zero1": True}, "nxdt_fsdp": {"fsdp": True}}
    report: dict[str, dict] = {}
    # the GAN toggles requires_grad per optimizer: DDP needs find_unused_parameters=True for it (Lightning's docs)
    report["gan/ddp"] = fit(GAN(), ddp(find_unused_parameters=True))
    report["gan_clip/ddp"] = fit(GAN(clip=0.05), ddp(find_unused_parameters=True))
    report["part/ddp"] = fit(Part(), ddp(), gradient_clip_val=0.05)
    report["unused/ddp"] = fit(Unused(), ddp(find_unused_parameters=True))
    for name, kw in variants.items():
        report[f"gan/{name}"] = fit(GAN(), nxd(**kw))
        report[f"gan_clip/{name}"] = fit(GAN(clip=0.05), nxd(**kw))
        report[f"part/{name}"] = fit(Part(), nxd(**kw), gradient_clip_val=0.05)
        report[f"unused/{name}"] = fit(Unused(), nxd(find_unused_parameters=True, **kw))
        report[f"unused_refused/{name}"] = fit(Unused(), nxd(**kw))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
