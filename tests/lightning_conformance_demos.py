"""Modules this project did not write, under DDPStrategy (gloo) and NxDStrategy (plain, ZeRO-1, FSDP) in the same two
processes (``torchrun --nproc-per-node 2 lightning_conformance_demos.py OUT``); each rank writes what it saw to
``OUT/rank<k>.json`` and tests/test_lightning_conformance_demos.py compares. Not collected by pytest.

The modules are Lightning's own, used as shipped (``lightning.pytorch.demos``: ``BoringModel``,
``ManualOptimBoringModel``, ``DemoModel``, ``LightningTransformer``), with only their data swapped where the demo
downloads it (WikiText2 → random tokens of its shape), and Lightning's GAN example
(examples/pytorch/domain_templates/generative_adversarial_net.py of github.com/Lightning-AI/pytorch-lightning) written
from it: the same generator (BatchNorm1d with eps 0.8 in three blocks), discriminator, loss, two Adams and
``toggle_optimizer`` steps, on 4x4 random images, without its torchvision image logging.

A callback logs each step's loss (``sync_dist=True``) and records it with the final weights, and what the module's own
``state_dict()`` gives inside ``on_save_checkpoint`` (``trainer.save_checkpoint`` after fit) and after fit; every run
starts from
``seed_everything(7)`` (both strategies reset the seed in ``setup_environment``: the same dropout masks and noise).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.demos import LightningTransformer
from lightning.pytorch.demos.boring_classes import BoringModel, DemoModel, ManualOptimBoringModel, RandomDataset
from lightning.pytorch.strategies import DDPStrategy

import lightning_conformance_heldout as heldout
from nxdt.lightning import NxDStrategy

VOCAB, BLOCK = 32, 12


class Tokens(Dataset):
    """WikiText2's items (inputs, the next tokens) cut from a fixed random token stream."""

    def __init__(self, n: int) -> None:
        self.data = torch.randint(VOCAB, (n * BLOCK + 1,), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return (len(self.data) - 1) // BLOCK

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * BLOCK : (i + 1) * BLOCK + 1]
        return chunk[:-1], chunk[1:]


class Transformer(LightningTransformer):
    """The demo as shipped, but for its data: ``prepare_data`` would download WikiText2."""

    def prepare_data(self) -> None:
        pass

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(16), batch_size=2)


class Generator(nn.Module):
    def __init__(self, latent_dim: int, img_shape: tuple) -> None:
        super().__init__()
        self.img_shape = img_shape

        def block(in_feat, out_feat, normalize=True):
            layers = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(latent_dim, 128, normalize=False),
            *block(128, 256),
            *block(256, 512),
            *block(512, 1024),
            nn.Linear(1024, int(math.prod(img_shape))),
            nn.Tanh(),
        )

    def forward(self, z):
        img = self.model(z)
        return img.view(img.size(0), *self.img_shape)


class Discriminator(nn.Module):
    def __init__(self, img_shape: tuple) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(int(math.prod(img_shape)), 512),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(512, 256),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(256, 1),
        )

    def forward(self, img):
        return self.model(img.view(img.size(0), -1))


class GAN(pl.LightningModule):
    def __init__(self, img_shape: tuple = (1, 4, 4), lr: float = 0.0002, b1: float = 0.5, b2: float = 0.999, latent_dim: int = 8):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator(latent_dim=self.hparams.latent_dim, img_shape=img_shape)
        self.discriminator = Discriminator(img_shape=img_shape)

    def forward(self, z):
        return self.generator(z)

    @staticmethod
    def adversarial_loss(y_hat, y):
        return F.binary_cross_entropy_with_logits(y_hat, y)

    def training_step(self, batch):
        imgs, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim).type_as(imgs)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)
        self.toggle_optimizer(opt_g)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})
        return {"loss": g_loss + d_loss}

    def configure_optimizers(self):
        lr, b1, b2 = self.hparams.lr, self.hparams.b1, self.hparams.b2
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
        return opt_g, opt_d


class Record(pl.Callback):
    """Each step's loss, logged with ``sync_dist=True`` (the logged mean over ranks) and kept as this rank saw it."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.saved_state: dict[str, torch.Tensor] = {}

    def on_save_checkpoint(self, trainer, module, checkpoint) -> None:
        self.saved_state = flat(module.state_dict())  # a user's hook reading the module's own state dict

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
        module.log("logged_loss", loss.detach(), sync_dist=True, on_step=True, on_epoch=True)


def flat(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


def images() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    return DataLoader(TensorDataset(torch.rand(32, 1, 4, 4, generator=g) * 2 - 1, torch.zeros(32)), batch_size=4)


MODULES = {
    "boring": (BoringModel, None, {}),
    "manual_boring": (ManualOptimBoringModel, None, {}),
    "demo": (DemoModel, lambda: DataLoader(RandomDataset(32, 64), batch_size=4), {}),
    "transformer": (lambda: Transformer(vocab_size=VOCAB), None, {}),
    # Lightning's docs: a GAN toggling requires_grad needs find_unused_parameters=True under DDP
    "gan": (GAN, images, {"find_unused_parameters": True}),
}


def fit(name: str, make_strategy, out: Path) -> dict:
    make_module, make_data, _ = MODULES[name]
    pl.seed_everything(7, verbose=False)
    module, record = make_module(), Record()
    trainer = pl.Trainer(
        strategy=make_strategy(),
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        limit_train_batches=4,
        limit_val_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[record],
    )
    trainer.fit(module, make_data() if make_data else None)
    states = {
        "weights": flat(trainer.strategy.lightning_module_state_dict()),
        "own_state": flat(module.state_dict()),  # after fit, on every rank, as a DDP script does
    }
    trainer.save_checkpoint(out / f"{name}.ckpt")
    states["saved_state"] = record.saved_state
    torch.save(states, out / f"{name}-rank{trainer.global_rank}.pt")  # tensors: compared as tensors
    return {"losses": record.losses, "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}}


def main(out: Path) -> None:
    variants = {"nxdt": {}, "nxdt_zero1": {"zero1": True}, "nxdt_fsdp": {"fsdp": True}}
    report: dict[str, dict] = {}
    for name, (_, _, ddp_options) in MODULES.items():
        report[f"{name}/ddp"] = fit(name, lambda: DDPStrategy(process_group_backend="gloo", **ddp_options), out / "ddp")
        for variant, kw in variants.items():
            report[f"{name}/{variant}"] = fit(name, lambda: NxDStrategy(**kw), out / variant)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    # the held-out modules (tests/lightning_conformance_heldout.py) in the same launch
    heldout.run_all(out, {v: (lambda kw=kw: NxDStrategy(**kw)) for v, kw in variants.items()}, report, rank)
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
