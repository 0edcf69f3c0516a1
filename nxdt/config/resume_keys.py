"""What may change when a run is resumed: every config key in one of four classes (``RESUME_KEYS``), and the
comparison of a resumed run's config with the config of the run it continues.

* ``model`` — what the weights mean (shapes, RoPE, norms, experts). Refused on every resume,
  ``model.weight_init_only`` included: weights read under another model definition compute another function without
  a word.
* ``training`` — how the weights are trained (precision, objective, data and tokenizer, optimizer, schedule shape,
  seed). Refused when a run continues (``resume_if_exists``, ``resume_from_checkpoint``, restarts); free when a new
  run only starts from the weights (``weight_init_only``). The optimizer's hyperparameters are here rather than free because a
  resume restores them from the checkpoint (torch's ``Optimizer.load_state_dict`` keeps the saved param groups'
  ``lr``, ``betas``, ``eps``, ``weight_decay``; Lightning restores ``LambdaLR.base_lrs``), so a changed value would
  be half applied (the schedule's shape from the config, its base from the checkpoint) and silently.
* ``noted`` — allowed, with a line saying what the change means: ``data.global_batch_size`` (the data stream
  continues at the samples consumed, each step then takes the new count, as Megatron's
  ``MegatronPretrainingSampler`` resumes at ``consumed_samples``; the schedule still counts steps) and ``model.optim.sched.max_steps`` (it
  follows ``trainer.max_steps``, so extending a run stretches the rest of its schedule).
* ``free`` — no effect on what is computed: logging, checkpoint cadence, run length, validation, the parallel
  layout (a checkpoint reshards), kernels that compute the same function, the hardware, the launcher.

Keys are exact dotted names; an entry ending in ``.`` covers a whole section (only ``instance.``: the hardware
catalogue). ``tests/test_resume_keys.py`` fails on a schema key with no class, so a new key is classified when it
is added. Pure data: no torch, no processes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

MODEL, TRAINING, NOTED, FREE = "model", "training", "noted", "free"

_MODEL_KEYS = (
    "model.architecture",
    "model.vocab_size",
    "model.hidden_size",
    "model.num_layers",
    "model.num_attention_heads",
    "model.num_kv_heads",
    "model.ffn_hidden_size",
    "model.head_dim",
    "model.max_position_embeddings",
    "model.rope_theta",
    "model.rope_scaling.rope_type",
    "model.rope_scaling.factor",
    "model.rope_scaling.low_freq_factor",
    "model.rope_scaling.high_freq_factor",
    "model.rope_scaling.original_max_position_embeddings",
    "model.norm_eps",
    "model.tie_word_embeddings",
    "model.sliding_window",
    "model.moe.num_experts",
    "model.moe.top_k",
    "model.moe.router_activation",
    "model.moe.normalize_top_k_affinities",
)

_TRAINING_KEYS = (
    "seed",  # the data order, dropout, bf16SR's rounding bits
    "precision.type",
    "trainer.gradient_clip_val",
    "model.init_method_std",  # what is initialised on a resume: fresh LoRA adapters, an adapters-only run's base
    "model.hf_checkpoint",  # the starting weights: an adapters-only checkpoint's base, DPO's reference model
    "model.moe.router_aux_loss_coef",
    "model.optim.name",
    "model.optim.lr",
    "model.optim.weight_decay",
    "model.optim.no_weight_decay",
    "model.optim.fixed_weight_decay",
    "model.optim.betas",
    "model.optim.eps",
    "model.optim.sched.name",
    "model.optim.sched.warmup_steps",
    "model.optim.sched.min_lr",
    "model.optim.sched.constant_steps",
    "model.loss_averaging",
    "data.source",
    "data.shuffle",
    "data.train_dir",
    # the token ids: a model key in spirit, but a fine-tuning run names the same tokenizer otherwise (a
    # directory with its chat template instead of its tokenizer.json), so it is compared only when a run continues
    "data.tokenizer",
    "data.seq_length",
    "data.num_samples",
    "data.data_prefix",
    "data.splits_string",
    "data.dev_choose_samples",
    "data.val_split",  # the held-out samples leave the training set
    # the objective: a block switched on or off, and each of its keys
    "model_alignment_strategy.sft",
    "model_alignment_strategy.sft.packing",
    "model_alignment_strategy.sft.truncation",
    "model_alignment_strategy.sft.packing_style",
    "model_alignment_strategy.peft",
    "model_alignment_strategy.peft.lora_rank",
    "model_alignment_strategy.peft.lora_alpha",
    "model_alignment_strategy.peft.lora_dropout",
    "model_alignment_strategy.peft.lora_bias",
    "model_alignment_strategy.peft.target_modules",
    "model_alignment_strategy.dpo",
    "model_alignment_strategy.dpo.kl_beta",
    "model_alignment_strategy.dpo.loss_type",
    "model_alignment_strategy.dpo.loss_weights",
    "model_alignment_strategy.dpo.label_smoothing",
    "model_alignment_strategy.dpo.f_divergence_type",
    "model_alignment_strategy.dpo.f_alpha_divergence_coef",
    "model_alignment_strategy.dpo.discopop_tau",
    "model_alignment_strategy.dpo.max_prompt_length",
    "model_alignment_strategy.dpo.precompute_ref_log_probs",
    "model_alignment_strategy.dpo.truncation_mode",
    "model_alignment_strategy.orpo",
    "model_alignment_strategy.orpo.beta",
    "model_alignment_strategy.orpo.max_prompt_length",
    "model_alignment_strategy.orpo.truncation_mode",
    "model_alignment_strategy.orpo.nll_mean",
    "model_alignment_strategy.grpo",
    "model_alignment_strategy.grpo.reward_funcs",
    "model_alignment_strategy.grpo.reward_weights",
    "model_alignment_strategy.grpo.num_generations",
    "model_alignment_strategy.grpo.max_prompt_length",
    "model_alignment_strategy.grpo.max_completion_length",
    "model_alignment_strategy.grpo.temperature",
    "model_alignment_strategy.grpo.top_p",
    "model_alignment_strategy.grpo.top_k",
    "model_alignment_strategy.grpo.beta",
    "model_alignment_strategy.grpo.epsilon",
    "model_alignment_strategy.grpo.epsilon_high",
    "model_alignment_strategy.grpo.loss_type",
    "model_alignment_strategy.grpo.scale_rewards",
    "model_alignment_strategy.grpo.num_iterations",
)

_NOTED_KEYS = {
    "data.global_batch_size": (
        "the data stream continues at the samples the checkpoint consumed, each step now takes {now} samples "
        "(was {was}); the learning-rate schedule still counts steps"
    ),
    "model.optim.sched.max_steps": (
        "the rest of the learning-rate schedule is stretched to {now} steps (was {was}); "
        "keep the old one with model.optim.sched.max_steps={was}"
    ),
}

_FREE_KEYS = (
    "name",
    "trainer.devices",
    "trainer.num_nodes",
    "trainer.lnc",
    "trainer.max_steps",
    "trainer.max_epochs",
    "trainer.log_every_n_steps",
    "trainer.val_check_interval",
    "trainer.limit_val_batches",
    "trainer.num_sanity_val_steps",
    "exp_manager.exp_dir",
    "exp_manager.explicit_log_dir",
    "exp_manager.resume_if_exists",
    "exp_manager.resume_from_checkpoint",  # which checkpoint is resumed: its own run's config is compared
    "exp_manager.max_restarts",
    "exp_manager.checkpoint_every_n_steps",
    "exp_manager.keep_last_k",
    "exp_manager.save_last",
    "exp_manager.async_checkpointing",
    "exp_manager.create_tensorboard_logger",
    "exp_manager.log_parameter_norm",
    "exp_manager.log_gradient_norm",
    "exp_manager.nan_policy",  # what happens on a non-finite loss, not what a finite step computes
    "exp_manager.trace",
    "exp_manager.profile_steps",
    "exp_manager.fault_injection.step",
    "exp_manager.fault_injection.rank",
    "exp_manager.fault_injection.kind",
    "exp_manager.fault_injection.attempt",
    # trackers: where metrics are sent; a resumed run continues its tracker run (nxdt.lightning.trackers)
    "exp_manager.create_wandb_logger",
    "exp_manager.wandb_logger_kwargs",
    "exp_manager.create_mlflow_logger",
    "exp_manager.mlflow_logger_kwargs",
    "exp_manager.create_clearml_logger",
    "exp_manager.clearml_logger_kwargs",
    "exp_manager.create_dllogger_logger",
    # the layout: a checkpoint reshards onto another one; the losses agree to rounding (tests/test_reshard.py)
    "distributed_strategy.tensor_model_parallel_size",
    "distributed_strategy.pipeline_model_parallel_size",
    "distributed_strategy.virtual_pipeline_model_parallel_size",
    "distributed_strategy.context_parallel_size",
    "distributed_strategy.expert_model_parallel_size",
    "distributed_strategy.sequence_parallel",
    "distributed_strategy.zero1",
    "distributed_strategy.overlap_grad_reduce",  # the same bits either way: when the reduction runs
    "distributed_strategy.kv_replicator",
    "distributed_strategy.placement_order",
    "distributed_strategy.fsdp.enabled",
    "distributed_strategy.fsdp.prefetch",
    "distributed_strategy.fsdp.prefetch_distance",
    "distributed_strategy.fsdp.reduce_scatter_delay",
    "distributed_strategy.fsdp.reshard_after_forward",
    "distributed_strategy.fsdp.param_persistence_threshold",
    # the loss is a mean over the global batch, whatever its split into micro-batches (with
    # model.loss_averaging=micro_batches, NxDT's mean of means, the split weighs tokens: a documented NxDT trait)
    "data.micro_batch_size",
    "data.index_mapping_dir",  # where Megatron's sample index is cached
    "data.val_dir",
    "model.activations_checkpoint_granularity",  # recomputes the same activations
    "model.core_attention",  # the same attention, another kernel
    "model.model_config",  # where the model keys came from: the keys themselves are compared
    "model.make_vocab_size_divisible_by",  # padded rows are masked and trimmed: a checkpoint reshards across paddings
    "model.weight_init_only",  # with resume_from_checkpoint: which run is started; the run directory choice compares it
    "model_alignment_strategy.peft.lora_verbose",
    "model_alignment_strategy.peft.load_lora_from_ckpt",  # checked against the checkpoint (cli.check_lora_checkpoint)
    "model_alignment_strategy.peft.save_lora_base",  # what later checkpoints hold
    "model_alignment_strategy.peft.merge_lora",
    "model_alignment_strategy.peft.save_lora_config_adapter",
    "model_alignment_strategy.peft.merge_sharded_lora",
    "comm.timeout_s",
    "comm.transport",
    "comm.algorithm",
    "comm.emulate",
    "comm.emulate_slowdown",
    "launcher.name",
    "launcher.dry_run",
    "launcher.rdzv_endpoint",
    "launcher.rdzv_id",
    "launcher.node_rank",
    "launcher.local_addr",
    "launcher.port",
    "launcher.join_timeout_s",
    "launcher.partition",
    "launcher.account",
    "launcher.time_limit",
    "launcher.sbatch_args",
    "launcher.gpus_per_node",
    "launcher.wait",
    "instance.",  # the hardware the plan targets
)

# dotted key (or section ending in '.') -> class: THE table a resume is judged by
RESUME_KEYS: dict[str, str] = {
    **{k: MODEL for k in _MODEL_KEYS},
    **{k: TRAINING for k in _TRAINING_KEYS},
    **{k: NOTED for k in _NOTED_KEYS},
    **{k: FREE for k in _FREE_KEYS},
}


def key_class(key: str) -> str | None:
    """The class of a dotted key: its own entry, else the longest section entry above it; None = unclassified."""
    if key in RESUME_KEYS:
        return RESUME_KEYS[key]
    sections = [s for s in RESUME_KEYS if s.endswith(".") and key.startswith(s)]
    return RESUME_KEYS[max(sections, key=len)] if sections else None


@dataclass(frozen=True)
class Change:
    key: str
    was: Any
    now: Any
    kind: str  # MODEL | TRAINING | NOTED | FREE

    def refused(self, weight_init_only: bool) -> bool:
        """Whether this change stops a resume (``weight_init_only``: a new run from the weights: model keys only)."""
        return self.kind == MODEL or (self.kind == TRAINING and not weight_init_only)

    def text(self) -> str:
        return f"{self.key} {show(self.was)} → {show(self.now)}"

    def note(self) -> str | None:
        """What a ``noted`` change means, in words."""
        if self.kind != NOTED:
            return None
        return f"{self.key} {show(self.was)} → {show(self.now)}: " + _NOTED_KEYS[self.key].format(
            was=show(self.was), now=show(self.now)
        )


def show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
    return str(value)


def _is_block(key: str) -> bool:
    """An optional block (``model_alignment_strategy.dpo``): classified itself (null or set) and its keys too."""
    return key in RESUME_KEYS and any(k.startswith(key + ".") for k in RESUME_KEYS)


def _leaves(node: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf. An optional block is a leaf too (null, or "set" with its keys below), so
    switching it on or off is one change; a dict-valued key that is classified (e.g. ``data.data_prefix``) is one
    value."""
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and (key not in RESUME_KEYS or _is_block(key)):
            if key in RESUME_KEYS:
                yield key, "set"
            yield from _leaves(v, key + ".")
        else:
            yield key, v


def config_changes(previous: dict[str, Any], current: dict[str, Any]) -> list[Change]:
    """Every key whose value differs between two resolved configs (plain nested dicts, as
    ``OmegaConf.to_container`` gives them), with its class. A key one side lacks (a config written before the key
    existed, or the keys of a block that is null on one side) is not compared. An unclassified key counts as a
    model key: refused, so nothing unjudged slips through. The hardware catalogue's figures are left out."""
    was, now = dict(_leaves(previous)), dict(_leaves(current))
    return [
        Change(key, was[key], value, key_class(key) or MODEL)
        for key, value in now.items()
        if key in was and not _same(was[key], value) and (key == "instance.name" or not key.startswith("instance."))
    ]


def _same(a: Any, b: Any) -> bool:
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return float(a) == float(b)  # 1e4 in one file, 10000.0 in the other
    return bool(a == b)


def refusal(changes: list[Change], weight_init_only: bool) -> Change | None:
    """The first change that stops the resume: model keys before training keys (a model change is the one to fix)."""
    refused = [c for c in changes if c.refused(weight_init_only)]
    refused.sort(key=lambda c: c.kind != MODEL)
    return refused[0] if refused else None


def summary(changes: list[Change]) -> str:
    """The changed keys in one line (``trainer.max_steps 5 → 12, ...``), or that nothing changed."""
    return ", ".join(c.text() for c in changes) if changes else "no config key changed"
