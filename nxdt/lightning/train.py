"""The worker side of ``nxdt train``: resolved config + Plan → Lightning Trainer → run directory.

Workers never re-enter Hydra: ``nxdt.launch.worker`` reads ``config.yaml`` and ``plan.json`` from the
run directory and calls :func:`run_training` in every rank.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from nxdt.lightning.datamodule import NxDDataModule
from nxdt.lightning.exp_manager import build_callbacks, build_loggers, resume_checkpoint
from nxdt.lightning.module import CausalLMModule
from nxdt.lightning.strategy import NxDStrategy
from nxdt.planner import Plan

log = logging.getLogger(__name__)


# precision.type (NxDT names) → Lightning precision: bf16 = pure bf16 weights and compute;
# mixed_precision = bf16 compute under autocast with fp32 master weights and fp32 gradient reduction.
PRECISION = {"fp32": "32-true", "bf16": "bf16-true", "mixed_precision": "bf16-mixed"}


class NotYetSupported(ValueError):
    """A valid config asking for a feature this version cannot train with yet (it can still be planned)."""


def check_trainable(cfg: Any) -> None:
    """Refuse, before any worker starts, what would otherwise train silently wrong."""
    ds = cfg.distributed_strategy
    unsupported = [(key, value) for key, value in (
        ("tensor_model_parallel_size", ds.tensor_model_parallel_size), ("pipeline_model_parallel_size", ds.pipeline_model_parallel_size),
        ("context_parallel_size", ds.context_parallel_size), ("expert_model_parallel_size", ds.expert_model_parallel_size),
        ("virtual_pipeline_model_parallel_size", ds.virtual_pipeline_model_parallel_size)) if value != 1]
    unsupported += [(key, True) for key, value in (("sequence_parallel", ds.sequence_parallel), ("zero1", ds.zero1),
                                                   ("fsdp.enabled", ds.fsdp.enabled)) if value]
    if cfg.comm.emulate is not None:
        unsupported.append(("comm.emulate", cfg.comm.emulate))
    if unsupported:
        key, value = unsupported[0]
        shown = key if key.startswith("comm.") else f"distributed_strategy.{key}"
        raise NotYetSupported(f"config error: {shown}={value!r}: training with it is not implemented yet in this version "
                              f"(`nxdt plan` accepts it); use data parallelism (the default) to train now")


def build_trainer(cfg: Any, plan: Plan, run_dir: Path, tokens_per_step: int, *, show_progress: bool = True) -> pl.Trainer:
    dp = plan.degrees["dp"]
    accumulate = cfg.data.global_batch_size // (cfg.data.micro_batch_size * dp)
    strategy = NxDStrategy(plan=plan, timeout_s=cfg.comm.timeout_s)
    return pl.Trainer(
        accelerator="cpu",
        precision=PRECISION[cfg.precision.type],
        devices=cfg.trainer.devices,
        num_nodes=cfg.trainer.num_nodes,
        strategy=strategy,
        max_steps=cfg.trainer.max_steps,
        max_epochs=cfg.trainer.max_epochs,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=cfg.trainer.gradient_clip_val,
        log_every_n_steps=cfg.trainer.log_every_n_steps,
        use_distributed_sampler=False,  # the global-batch sampler shards by data-parallel rank itself
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=bool(cfg.exp_manager.checkpoint_every_n_steps),
        enable_progress_bar=show_progress,
        enable_model_summary=False,
        logger=build_loggers(cfg, run_dir),
        callbacks=build_callbacks(cfg, run_dir, tokens_per_step, show_progress=show_progress),
        default_root_dir=str(run_dir),
    )


def run_training(cfg: Any, plan: Plan, run_dir: str | Path) -> None:
    check_trainable(cfg)
    run_dir = Path(run_dir)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    module = CausalLMModule(cfg.model, cfg.data.global_batch_size, cfg.data.seq_length)
    datamodule = NxDDataModule(cfg.data, seed=cfg.seed, vocab_size=cfg.model.vocab_size)
    trainer = build_trainer(cfg, plan, run_dir, module.tokens_per_step)
    ckpt_path = resume_checkpoint(run_dir) if cfg.exp_manager.resume_if_exists else None
    if ckpt_path is not None and trainer.is_global_zero:
        log.info("resuming from %s", ckpt_path)
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(ckpt_path) if ckpt_path else None)
