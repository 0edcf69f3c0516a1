"""``CausalLMModule``: the LightningModule ``nxdt train`` drives — a model-hub model, next-token loss,
optimizer and schedule from ``model.optim``.

Each Lightning batch is one micro-batch; Lightning accumulates ``global_batch / (micro_batch · DP)``
of them per optimizer step, so one Lightning step is one global batch, as in NxDT. The step's loss
(mean over every micro-batch of every data-parallel rank) is published in ``step_metrics`` for the
experiment manager.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import lightning.pytorch as pl

from nxdt.config.validate import ALLOWED_MODEL_PREFIX
from nxdt.lightning.optim import build_optimizer, build_scheduler



def import_architecture(path: str) -> type:
    """Import a model class by its dotted path; only the model hub may be named (a config is not code)."""
    if not path.startswith(ALLOWED_MODEL_PREFIX):
        raise ValueError(f"model.architecture={path!r}: only classes under {ALLOWED_MODEL_PREFIX} may be named")
    module_name, _, class_name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"model.architecture={path!r} cannot be imported ({exc})") from exc


class CausalLMModule(pl.LightningModule):
    def __init__(self, model_cfg: Any, global_batch_size: int, seq_length: int) -> None:
        super().__init__()
        self.model_cfg = model_cfg
        self.model = import_architecture(model_cfg.architecture)(model_cfg)
        self.tokens_per_step = global_batch_size * seq_length
        self.step_metrics: dict[str, float] = {}
        self._loss_sum = torch.zeros((), dtype=torch.float64)
        self._micro_batches = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(batch["input_ids"])
        loss = self.model.loss_fn(logits, batch["labels"])
        self._loss_sum += loss.detach().double()
        self._micro_batches += 1
        if self._micro_batches == self.trainer.accumulate_grad_batches:
            self._finish_step()
        return loss

    def _finish_step(self) -> None:
        """Last micro-batch of the global batch: publish the step's loss (mean over all of it) and lr."""
        local_mean = (self._loss_sum / self._micro_batches).float()
        step_loss = self.trainer.strategy.reduce(local_mean, reduce_op="mean")
        self._loss_sum.zero_()
        self._micro_batches = 0
        lr = self.optimizers().param_groups[0]["lr"]  # the rate this step applies (the schedule steps after it)
        self.step_metrics = {"step": self.trainer.global_step + 1, "loss": float(step_loss), "lr": lr}
        self.log("loss", step_loss, prog_bar=True, logger=False)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = build_optimizer(self.model, self.model_cfg.optim)
        scheduler = build_scheduler(optimizer, self.model_cfg.optim.sched)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
