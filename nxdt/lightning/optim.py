"""Optimizer and learning-rate schedule from ``model.optim`` (NxDT/NeMo names)."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from nxdt.parallel.stochastic_rounding import StochasticRoundingAdamW

# NxDT's optimizer names; both are AdamW here. The moments have the parameters' dtype (fp32 with fp32 and
# mixed_precision; bf16 with bf16, whichever name), except with bf16SR, where adamw_fp32OptState keeps them in fp32.
_ADAMW_NAMES = ("adamw", "adamw_fp32OptState")

# precision.type whose optimizer step is not torch's AdamW: bf16SR rounds the fp32 update stochastically to bf16
STOCHASTIC_ROUNDING_TYPES = ("bf16SR",)


def parameter_groups(model: nn.Module, weight_decay: float, decay_everything: bool = False) -> list[dict[str, Any]]:
    """No weight decay on norms, biases and other 1-D parameters (the usual LLM recipe), unless
    ``decay_everything`` (NxDT's ``do_layer_norm_weight_decay``)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 or decay_everything else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, optim_cfg: Any, *, precision: str = "fp32", seed: int = 0) -> torch.optim.Optimizer:
    """AdamW over :func:`parameter_groups`. ``precision`` (a ``precision.type``): bf16SR gives
    :class:`StochasticRoundingAdamW` (fp32 math, bf16 results rounded stochastically, keyed by ``seed``; moments in
    fp32 with adamw_fp32OptState), every other type torch's AdamW."""
    if optim_cfg.name not in _ADAMW_NAMES:
        raise ValueError(f"model.optim.name={optim_cfg.name!r} is not supported; use one of {list(_ADAMW_NAMES)}")
    groups = parameter_groups(model, optim_cfg.weight_decay, getattr(optim_cfg, "decay_norms_and_biases", False))
    if precision in STOCHASTIC_ROUNDING_TYPES:
        return StochasticRoundingAdamW(
            groups,
            lr=optim_cfg.lr,
            betas=tuple(optim_cfg.betas),
            eps=optim_cfg.eps,
            seed=seed,
            fp32_state=optim_cfg.name == "adamw_fp32OptState",
        )
    return torch.optim.AdamW(
        groups,
        lr=optim_cfg.lr,
        betas=tuple(optim_cfg.betas),
        eps=optim_cfg.eps,
        # foreach kernels allocate extra temporaries; per-parameter loops are as fast for small CPU models
        foreach=False,
    )


def lr_lambda(sched_cfg: Any, base_lr: float) -> Callable[[int], float]:
    """Multiplier of the base lr at optimizer step ``step`` (linear warm-up, then the named decay, ending
    ``constant_steps`` before ``max_steps`` at ``min_lr``)."""
    warmup = max(0, sched_cfg.warmup_steps)
    total = max(1, sched_cfg.max_steps - max(0, getattr(sched_cfg, "constant_steps", 0)))
    floor = sched_cfg.min_lr / base_lr if base_lr > 0 else 0.0
    name = sched_cfg.name

    def multiplier(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if name == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if name == "CosineAnnealing":
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        if name == "LinearAnnealingWithWarmUp":
            return floor + (1.0 - floor) * (1.0 - progress)
        raise ValueError(
            f"model.optim.sched.name={name!r} is not supported; use CosineAnnealing, LinearAnnealingWithWarmUp or constant"
        )

    return multiplier


def build_scheduler(optimizer: torch.optim.Optimizer, sched_cfg: Any) -> torch.optim.lr_scheduler.LambdaLR:
    base_lr = optimizer.param_groups[0]["lr"]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(sched_cfg, base_lr))
