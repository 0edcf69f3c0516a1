"""Optimizer and learning-rate schedule from ``model.optim`` (NxDT/NeMo names)."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from nxdt.config.validate import CHOICES
from nxdt.parallel.devices import adamw_options
from nxdt.parallel.stochastic_rounding import StochasticRoundingAdamW

# NxDT's optimizer names; both are AdamW here. The moments have the parameters' dtype (fp32 with fp32 and
# mixed_precision; bf16 with bf16, whichever name), except with bf16SR, where adamw_fp32OptState keeps them in fp32.
_ADAMW_NAMES = ("adamw", "adamw_fp32OptState")

# precision.type whose optimizer step is not torch's AdamW: bf16SR rounds the fp32 update stochastically to bf16
STOCHASTIC_ROUNDING_TYPES = ("bf16SR",)


# model.optim.no_weight_decay: which parameters go in the weight-decay-0 group
NO_WEIGHT_DECAY = CHOICES["model.optim.no_weight_decay"]


def _exempt(name: str, p: nn.Parameter, no_weight_decay: str) -> bool:
    """Whether parameter ``name`` gets no weight decay. Biases are the parameters named ``bias`` (torch's and nxdt's
    tensor-parallel layers' name); norm weights are the other 1-D parameters (the hub's only other 1-D tensors: RMSNorm
    and LayerNorm weights). NxD Training tells them apart by substrings of the name ("bias", "norm"); the hub's names
    of both kinds contain those too (``input_layernorm.weight``, ``norm.weight``)."""
    if no_weight_decay == "none":
        return False
    if name.rpartition(".")[2] == "bias":
        return True
    return no_weight_decay == "norms_and_biases" and p.ndim < 2


def parameter_groups(model: nn.Module, weight_decay: float, no_weight_decay: str = "norms_and_biases") -> list[dict[str, Any]]:
    """[decayed at ``weight_decay``, not decayed] over the trainable parameters; ``no_weight_decay`` names which go in
    the second group (:data:`NO_WEIGHT_DECAY`). Empty groups are left out."""
    if no_weight_decay not in NO_WEIGHT_DECAY:
        raise ValueError(f"model.optim.no_weight_decay={no_weight_decay!r}: use one of {', '.join(map(str, NO_WEIGHT_DECAY))}")
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if _exempt(name, p, no_weight_decay) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def decayed_rate(optim_cfg: Any) -> float:
    """The decayed group's rate: ``fixed_weight_decay`` when set (NxD Training's HF models: 0.01 whatever
    optim.weight_decay says), else ``weight_decay``."""
    fixed = getattr(optim_cfg, "fixed_weight_decay", None)
    return optim_cfg.weight_decay if fixed is None else fixed


def build_optimizer(model: nn.Module, optim_cfg: Any, *, precision: str = "fp32", seed: int = 0) -> torch.optim.Optimizer:
    """AdamW over :func:`parameter_groups`. ``precision`` (a ``precision.type``): bf16SR gives
    :class:`StochasticRoundingAdamW` (fp32 math, bf16 results rounded stochastically, keyed by ``seed``; moments in
    fp32 with adamw_fp32OptState), every other type torch's AdamW."""
    if optim_cfg.name not in _ADAMW_NAMES:
        raise ValueError(f"model.optim.name={optim_cfg.name!r} is not supported; use one of {list(_ADAMW_NAMES)}")
    groups = parameter_groups(model, decayed_rate(optim_cfg), getattr(optim_cfg, "no_weight_decay", "norms_and_biases"))
    if precision in STOCHASTIC_ROUNDING_TYPES:
        return StochasticRoundingAdamW(
            groups,
            lr=optim_cfg.lr,
            betas=tuple(optim_cfg.betas),
            eps=optim_cfg.eps,
            seed=seed,
            fp32_state=optim_cfg.name == "adamw_fp32OptState",
        )
    device = next((p.device.type for g in groups for p in g["params"]), "cpu")
    return torch.optim.AdamW(
        groups,
        lr=optim_cfg.lr,
        betas=tuple(optim_cfg.betas),
        eps=optim_cfg.eps,
        **adamw_options(device),  # torch's fused kernel, as Hugging Face's Trainer (nxdt.parallel.devices)
    )


def lr_lambda(sched_cfg: Any, base_lr: float) -> Callable[[int], float]:
    """Multiplier of the base lr at optimizer step ``step`` (counted from 0): a linear warm-up, then the named decay,
    ending ``constant_steps`` before ``max_steps`` at ``min_lr``.

    The warm-up follows each schedule's NxDT namesake. CosineAnnealing and constant (NxDT's WarmupPolicy,
    WarmupHoldPolicy) are NeMo's (nemo/core/optim/lr_scheduler.py, nemo_toolkit 2.1.0 as NxD Training pins it):
    ``(step+1)/(warmup+1)`` for steps 0..warmup, the peak reached at step ``warmup``, the cosine from step ``warmup``
    over ``max_steps - warmup``; with ``constant_steps`` NeMo's CosineAnnealing switches to Megatron's form,
    ``step/warmup`` (0 at step 0), the cosine over ``max_steps - constant_steps - warmup``. LinearAnnealingWithWarmUp
    warms up as ``(step+1)/warmup`` (NxDT's: ``step/warmup``; docs/migrating-from-nxdt.md, "What differs")."""
    warmup = max(0, sched_cfg.warmup_steps)
    constant = max(0, getattr(sched_cfg, "constant_steps", 0))
    total = max(1, sched_cfg.max_steps - constant)
    floor = sched_cfg.min_lr / base_lr if base_lr > 0 else 0.0
    name = sched_cfg.name
    if name not in ("constant", "CosineAnnealing", "LinearAnnealingWithWarmUp"):
        raise ValueError(
            f"model.optim.sched.name={name!r} is not supported; use CosineAnnealing, LinearAnnealingWithWarmUp or constant"
        )

    def warming(step: int) -> float | None:
        """The warm-up multiplier at ``step``, None once it is over."""
        if not warmup:
            return None
        if name == "LinearAnnealingWithWarmUp":
            return (step + 1) / warmup if step < warmup else None
        if step > warmup:
            return None
        return step / warmup if name == "CosineAnnealing" and constant else (step + 1) / (warmup + 1)

    def multiplier(step: int) -> float:
        ramp = warming(step)
        if ramp is not None:
            return ramp
        if name == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if name == "CosineAnnealing":
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (1.0 - floor) * (1.0 - progress)

    return multiplier


def build_scheduler(optimizer: torch.optim.Optimizer, sched_cfg: Any) -> torch.optim.lr_scheduler.LambdaLR:
    base_lr = optimizer.param_groups[0]["lr"]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(sched_cfg, base_lr))
