"""The worker side of ``nxdt train``: resolved config + Plan → Lightning Trainer → run directory.

Workers never re-enter Hydra: ``nxdt.launch.worker`` reads ``config.yaml`` and ``plan.json`` from the
run directory and calls :func:`run_training` in every rank.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from nxdt.config.hf_model import model_meta
from nxdt.config.validate import MODEL_SHAPE_FIELDS, check_trainable
from nxdt.lightning.hf import MODEL_CONFIG_KEY, TOKENIZER_KEY
from nxdt.lightning.exp_manager import agreed_resume_checkpoint, build_callbacks, build_loggers, launch_attempt, validates
from nxdt.lightning.registry import objective_spec, reference_meta
from nxdt.lightning.strategy import NxDStrategy
from nxdt.lightning.lora_checkpoint import LORA_META_KEY, lora_meta
from nxdt.parallel.devices import export_worker_environment, node_devices
from nxdt.models.lora import LoRAConfig, PeftConfig, lora_layers, resolve_targets
from nxdt.planner import Plan
from nxdt.planner.links import emulated_links_for


# precision.type (NxDT names) → Lightning precision: bf16 = pure bf16 weights and compute;
# mixed_precision = bf16 compute under autocast with fp32 master weights and fp32 gradient reduction.
# The SR types add stochastic rounding where an update is rounded to bf16 (build_optimizer, given the type by
# CausalLMModule): bf16SR rounds every weight and moment update; mixed_precisionSR has fp32 weights and
# moments, nothing to round between steps, so it trains exactly as mixed_precision (see the schema's precision.type).
PRECISION = {
    "fp32": "32-true",
    "bf16": "bf16-true",
    "bf16SR": "bf16-true",
    "mixed_precision": "bf16-mixed",
    "mixed_precisionSR": "bf16-mixed",
}


def rank_devices(cfg: Any, plan: Plan, gpus: int) -> list[torch.device] | None:
    """This node's ranks' devices under the device policy (``nxdt.parallel.devices``), for NxDStrategy's
    ``parallel_devices``; None on the CPU (Lightning's CPU accelerator, exactly as before GPUs existed)."""
    if cfg.instance.accelerator == "cpu":
        return None
    return [torch.device(d) for d in node_devices(cfg.instance.accelerator, plan.ranks_per_node, gpus)]


def build_trainer(
    cfg: Any,
    plan: Plan,
    run_dir: Path,
    tokens_per_step: int,
    *,
    show_progress: bool = True,
    devices: list[torch.device] | None = None,
) -> pl.Trainer:
    """The run's Trainer and NxDStrategy; ``devices``: this node's ranks' devices in place of the device policy's (the
    tests' emulated accelerator)."""
    model_shape = {k: getattr(cfg.model, k) for k in MODEL_SHAPE_FIELDS}
    ds, peft = cfg.distributed_strategy, cfg.model_alignment_strategy.peft
    fsdp = {
        "prefetch": ds.fsdp.prefetch,
        "prefetch_distance": ds.fsdp.prefetch_distance,
        "reduce_scatter_delay": ds.fsdp.reduce_scatter_delay,
        "reshard_after_forward": ds.fsdp.reshard_after_forward,
        "param_persistence_threshold": ds.fsdp.param_persistence_threshold,
    }
    lora = (
        {}
        if peft is None
        else {
            LORA_META_KEY: lora_meta(
                LoRAConfig(
                    peft.lora_rank,
                    float(peft.lora_alpha),
                    float(peft.lora_dropout),
                    peft.lora_bias,
                    tuple(peft.target_modules),
                    resolve_targets(peft.target_modules),
                ),
                merged=peft.merge_lora,
            )
        }
    )  # what export-hf needs (lora_alpha) of the adapters
    # what export-hf writes as config.json (every computation field) and the tokenizer files it copies
    tokenizer = cfg.data.tokenizer
    export = {
        MODEL_CONFIG_KEY: model_meta(cfg.model),
        TOKENIZER_KEY: None if tokenizer is None else str(Path(tokenizer).expanduser().resolve()),
    }
    # what a resume checks: the same reference model (registry.check_resume_reference)
    reference = reference_meta(cfg)
    # instance.devices: the GPUs the launcher checked this host has (instance=gpu: the number it found)
    devices = devices or rank_devices(cfg, plan, cfg.instance.devices)
    strategy = NxDStrategy(
        plan=plan,
        timeout_s=cfg.comm.timeout_s,
        checkpoint_meta={"model": model_shape, **export, **lora, **reference},
        virtual_pipeline_size=ds.virtual_pipeline_model_parallel_size,
        sequence_parallel=ds.sequence_parallel,
        zero1=ds.zero1,
        overlap_grad_reduce=ds.overlap_grad_reduce,
        fsdp=fsdp if ds.fsdp.enabled else False,
        trace_dir=str(run_dir / "trace") if cfg.exp_manager.trace else None,
        emulated_links=emulated_links_for(cfg),
        async_checkpointing=cfg.exp_manager.async_checkpointing,
        peft_adapter_in_checkpoints=peft is not None and peft.save_lora_config_adapter,
        comm_transport=cfg.comm.transport,
        comm_algorithm=cfg.comm.algorithm,
        broadcast_buffers=False,  # the hub models' only buffers (RoPE tables) are constants computed alike on every rank
        torch_process_group=False,  # CausalLMModule calls no torch.distributed: no gloo listener beside the store
        checkpoint_format="directory",  # the run directory's checkpoints: keep_last_k, checksums, resume on any layout
        parallel_devices=devices,
    )
    spec = objective_spec(cfg)
    return pl.Trainer(
        accelerator=cfg.instance.accelerator,
        precision=PRECISION[cfg.precision.type],
        # several ranks may share a GPU: Lightning is asked for the distinct GPUs, the strategy holds every rank's
        devices=cfg.trainer.devices if devices is None else len(set(devices)),
        num_nodes=cfg.trainer.num_nodes,
        strategy=strategy,
        max_steps=cfg.trainer.max_steps,
        max_epochs=cfg.trainer.max_epochs,
        # one Lightning batch = one global batch; the module splits micro-batches, clips and steps itself
        accumulate_grad_batches=1,
        log_every_n_steps=cfg.trainer.log_every_n_steps,
        use_distributed_sampler=False,  # the global-batch sampler shards by data-parallel rank itself
        # validation (data.val_dir): every val_check_interval steps (null: after the last), counted in steps across
        # the endless training epoch; the data module limits the batches itself (trainer.limit_val_batches)
        limit_val_batches=1.0 if validates(cfg) else 0,
        val_check_interval=cfg.trainer.val_check_interval or cfg.trainer.max_steps,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=cfg.trainer.num_sanity_val_steps if validates(cfg) else 0,
        enable_checkpointing=bool(cfg.exp_manager.checkpoint_every_n_steps or cfg.exp_manager.save_last),
        enable_progress_bar=show_progress,
        enable_model_summary=False,
        logger=build_loggers(cfg, run_dir),
        callbacks=build_callbacks(
            cfg,
            run_dir,
            tokens_per_step,
            show_progress=show_progress,
            objective_metrics=spec.metrics(spec.block(cfg)),
            objective_console=spec.console,
        ),
        default_root_dir=str(run_dir),
    )


def initial_weights_checkpoint(cfg: Any, resume: Path | None) -> str | None:
    """``model.weight_init_only``: the nxdt checkpoint whose model weights the run starts from — unless the run
    resumes a checkpoint of its own (a restart, ``resume_if_exists``), which holds everything. An objective with a
    reference model (DPO; GRPO with beta != 0) loads them on a resume too: its reference is the starting weights (taken
    before the checkpoint is restored)."""
    if not cfg.model.weight_init_only or cfg.exp_manager.resume_from_checkpoint is None:
        return None
    if resume is not None and not objective_spec(cfg).keeps_reference(cfg):
        return None
    return str(Path(cfg.exp_manager.resume_from_checkpoint).expanduser())


def lora_summary(model: Any) -> str:
    """``lora_verbose``: which modules carry adapters and how many parameters train (before any sharding)."""
    adapted = [name for name, _ in lora_layers(model)]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return (
        f"LoRA on {len(adapted)} modules ({', '.join(sorted({n.rpartition('.')[2] for n in adapted}))}; e.g. {adapted[0]}): "
        f"{trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.3f}%)"
    )


def build_module(cfg: Any, data_parallel_size: int, init_checkpoint: str | None = None) -> pl.LightningModule:
    """The run's LightningModule as ``cfg`` describes it: its objective's module class (pretraining, SFT, DPO, ORPO or
    GRPO) over the model, with the optimizer, precision and LoRA settings (``init_checkpoint``: weights to start from)."""
    mas = cfg.model_alignment_strategy
    return objective_spec(cfg).build_module(
        cfg,
        data_parallel_size,
        cfg.model,
        cfg.data.global_batch_size,
        cfg.data.seq_length,
        cfg.data.micro_batch_size,
        cfg.trainer.gradient_clip_val,
        log_gradient_norm=cfg.exp_manager.log_gradient_norm,
        log_parameter_norm=cfg.exp_manager.log_parameter_norm,
        nan_policy=cfg.exp_manager.nan_policy,
        precision=cfg.precision.type,
        seed=cfg.seed,
        init_checkpoint=init_checkpoint,
        peft=PeftConfig.pick(mas.peft) if mas.peft is not None else None,
    )


def run_training(cfg: Any, plan: Plan, run_dir: str | Path, devices: list[torch.device] | None = None) -> pl.LightningModule:
    """One worker's run (``nxdt train``'s workers call it; in one process it is a one-rank run); the trained module.
    ``devices``: as :func:`build_trainer`'s."""
    check_trainable(cfg)
    run_dir = Path(run_dir)
    export_worker_environment(cfg.instance.env, os.environ)  # NCCL / EFA settings, before the first NCCL group
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    ckpt_path = agreed_resume_checkpoint(cfg, run_dir)
    mas = cfg.model_alignment_strategy
    spec = objective_spec(cfg)  # pretraining, SFT, DPO, ORPO or GRPO: its module class, loss and data module
    module = build_module(cfg, plan.dp, initial_weights_checkpoint(cfg, ckpt_path))
    datamodule = spec.build_datamodule(cfg)
    trainer = build_trainer(cfg, plan, run_dir, module.tokens_per_step, devices=devices)
    em = cfg.exp_manager
    if trainer.is_global_zero and (em.create_wandb_logger or em.create_mlflow_logger or em.create_clearml_logger):
        from nxdt.lightning.trackers import tracker_loggers  # rank 0 only, imported only when asked for

        trainer.loggers = [*trainer.loggers, *tracker_loggers(cfg, run_dir)]
    if mas.peft is not None and mas.peft.lora_verbose and trainer.is_global_zero:
        print(f"nxdt: {lora_summary(module.model)}", flush=True)
    attempt = launch_attempt()
    if attempt > 0 and trainer.is_global_zero:  # the agent restarted every worker after a failure: say so
        print(
            f"nxdt: restart {attempt} of {cfg.exp_manager.max_restarts} after a worker failed (see logs/agent); "
            f"{f'resuming from {Path(ckpt_path).name}' if ckpt_path else 'no checkpoint yet: starting from step 0'}",
            flush=True,
        )
    elif ckpt_path is not None and trainer.is_global_zero:  # in place of Lightning's two lines (its rank log only)
        print(f"nxdt: resuming from {ckpt_path}", flush=True)
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(ckpt_path) if ckpt_path else None)
    trainer.strategy.close()  # the worker is forked: no atexit handler would do it
    return module
