"""Typed config schemas (dataclasses in Hydra's ConfigStore), one-line doc per field.

Top-level keys follow NxDT (``name, seed, trainer, exp_manager, distributed_strategy, data, model,
precision``) plus nxdt's own ``instance`` and ``comm``. Pure data: no torch, no processes.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


def doc(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with its one-line documentation (shown by ``nxdt train --help``)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help}, **kwargs)
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": help}, **kwargs)
    if is_dataclass(default):
        return field(default_factory=type(default), metadata={"help": help}, **kwargs)
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass
class TrainerConfig:
    devices: Optional[int] = doc(None, "ranks per node; null = one per (logical) core of the instance (cpu: instance.devices)")
    num_nodes: int = doc(1, "number of nodes")
    max_steps: int = doc(50, "optimizer steps to train (one step = one global batch)")
    max_epochs: int = doc(
        -1,
        "epoch limit: training stops at whichever of max_steps and max_epochs comes first (Lightning's rule); an "
        "epoch is len(train data) // global_batch_size steps; -1 = bounded by max_steps only",
    )
    log_every_n_steps: int = doc(1, "write a metrics.csv row every N steps")
    gradient_clip_val: Optional[float] = doc(1.0, "clip the global gradient norm to this value; null or 0 = no clipping")
    lnc: Optional[int] = doc(None, "logical NeuronCore size: physical cores per rank (Trn2/Trn3); null = the instance default")
    val_check_interval: Optional[int] = doc(
        None, "validate (data.val_dir) every N optimizer steps; null = once, after the last step"
    )
    limit_val_batches: float = doc(
        1.0,
        "validation global batches per check: <= 1 a fraction of data.val_dir's (1.0 = all, "
        "0 = no validation), > 1 that many (an integer)",
    )
    num_sanity_val_steps: int = doc(0, "validation batches run (and discarded) before training, to fail early; 0 = none")


@dataclass
class FaultInjectionConfig:
    step: Optional[int] = doc(None, "fail when this optimizer step starts (reliability drills); null = off")
    rank: Optional[int] = doc(None, "rank that fails; null = every rank")
    kind: str = doc(
        "raise",
        "raise (an exception) | sigkill (the process dies) | sigkill_during_save (dies mid-checkpoint) | hang (stops responding) "
        "| sigstop (the process is stopped: cannot even act on SIGTERM) | nan (the rank's loss at that step is NaN: exercises exp_manager.nan_policy)",
    )
    attempt: int = doc(0, "only in this launch attempt (0 = the first; restarts then run clean)")


@dataclass
class ExpManagerConfig:
    exp_dir: str = doc("outputs", "root of run directories: <exp_dir>/<name>/<timestamp>/")
    explicit_log_dir: Optional[str] = doc(None, "use exactly this run directory instead")
    resume_if_exists: bool = doc(False, "resume from the newest complete checkpoint of the newest run of this name")
    resume_from_checkpoint: Optional[str] = doc(None, "resume from exactly this checkpoints/step-<N> directory")
    max_restarts: int = doc(
        0, "restart all workers this many times after a worker dies; each restart resumes from the newest complete checkpoint"
    )
    checkpoint_every_n_steps: Optional[int] = doc(None, "save checkpoints/step-<N>/ every N steps; null = never")
    keep_last_k: int = doc(2, "keep only the newest k checkpoints")
    save_last: bool = doc(
        True,
        "when training ends (max_steps or max_epochs reached), save checkpoints/step-<N>/ of the last step if it was not "
        "saved already (NeMo's checkpoint_callback_params.save_last); counts toward keep_last_k; false = only every N steps",
    )
    async_checkpointing: bool = doc(
        False,
        "write checkpoints in a background thread: training continues while a snapshot "
        "(tensors copied first) is persisted; older checkpoints are removed only once it is committed",
    )
    create_tensorboard_logger: bool = doc(True, "write TensorBoard event files under tensorboard/")
    log_parameter_norm: bool = doc(False, "add the global parameter norm (all shards) to metrics.csv as param_norm")
    log_gradient_norm: bool = doc(False, "add the global gradient norm (before clipping) to metrics.csv as grad_norm")
    nan_policy: str = doc(
        "stop",
        "a NaN/inf loss or gradient norm: stop (one line naming the step and the ranks; no "
        "checkpoint with non-finite weights is ever written) | skip_step (drop that update; the "
        "run stops after 10 consecutive skips)",
    )
    trace: bool = doc(
        False,
        "write a Chrome trace per rank to trace/rank<k>.json (compute per FSDP unit, every collective "
        "with its stream and token); open it in Perfetto",
    )
    profile_steps: Optional[List[int]] = doc(
        None,
        "[first, last]: record torch.profiler over these optimizer steps (1-based, inclusive) on every rank into "
        "profile/: rank<k>.json (a Chrome trace: Perfetto) and rank<k>.txt (the ops by time and, on a GPU, the share "
        "of those steps' wall time the GPU was busy); null = no profile",
    )
    fault_injection: FaultInjectionConfig = doc(FaultInjectionConfig(), "deliberate worker failure, for testing recovery")
    # NxDT's (NeMo's) tracker keys: Lightning's own loggers on rank 0, fed every metrics.csv value at its step
    create_wandb_logger: bool = doc(
        False, "log every metric, the resolved config and the run directory to Weights & Biases (pip install 'nxdt[trackers]')"
    )
    wandb_logger_kwargs: Dict[str, Any] = doc(
        {}, "keyword arguments of Lightning's WandbLogger (name or project required, as in NxDT); WANDB_MODE=offline works"
    )
    create_mlflow_logger: bool = doc(
        False, "log every metric, the resolved config and the run directory to MLflow (pip install 'nxdt[trackers]')"
    )
    mlflow_logger_kwargs: Dict[str, Any] = doc(
        {},
        "keyword arguments of Lightning's MLFlowLogger: tracking_uri (file:DIR or http(s)://server; null = "
        "file:<exp_dir>/mlruns), experiment_name (null = the run name), tags, ...",
    )
    create_clearml_logger: bool = doc(
        False,
        "log every metric and the resolved config to a ClearML task (pip install clearml; CLEARML_OFFLINE_MODE=1 "
        "keeps the session under <run>/clearml/)",
    )
    clearml_logger_kwargs: Dict[str, Any] = doc(
        {}, "NeMo's ClearMLParams: project (default NeMo), task (default the run name), tags, connect_pytorch"
    )
    create_dllogger_logger: bool = doc(
        False, "DLLogger: true is refused before launch (NxDT never attaches it; metrics.csv holds every value)"
    )


@dataclass
class FSDPConfig:
    enabled: bool = doc(False, "shard parameters, gradients and optimizer state across data-parallel ranks")
    prefetch: str = doc("token_threaded", "all-gather policy: none | eager | token_threaded")
    prefetch_distance: int = doc(1, "units gathered ahead of compute")
    reduce_scatter_delay: int = doc(1, "units a gradient reduce-scatter is chained late")
    reshard_after_forward: bool = doc(True, "free gathered parameters after each unit's forward")
    param_persistence_threshold: int = doc(
        32768,
        "a unit's smaller flats (other param groups, e.g. no-decay norm weights) "
        "under this many elements stay whole on every rank, so a unit costs one "
        "gather and one reduce-scatter per pass; 0 shards everything",
    )


@dataclass
class DistributedStrategyConfig:
    tensor_model_parallel_size: int = doc(1, "TP degree")
    pipeline_model_parallel_size: int = doc(1, "PP degree")
    virtual_pipeline_model_parallel_size: int = doc(1, "model chunks per pipeline stage (interleaved schedule)")
    context_parallel_size: int = doc(
        1, "CP degree: the sequence split over CP ranks, attention as a ring (data.seq_length a multiple of 2·CP)"
    )
    expert_model_parallel_size: int = doc(1, "EP degree (subdivides data parallelism)")
    sequence_parallel: bool = doc(False, "shard activations along the sequence between TP regions")
    zero1: Optional[bool] = doc(
        None,
        "shard optimizer state across data-parallel ranks; null (the default) = on wherever it trains as plain data "
        "parallelism does: data-parallel degree > 1, without FSDP or bf16SR; with expert parallelism each rank's experts "
        "are sharded over their replicas (NxDT's default: true)",
    )
    overlap_grad_reduce: bool = doc(
        True,
        "reduce data-parallel gradients (plain DP, ZeRO-1) in 25 MiB buckets during the last backward, as DDP does; "
        "same bits as after backward (a DP group of 2, or any on one host; larger ones across hosts reduce after it)",
    )
    kv_replicator: int = doc(1, "replicate KV heads this many times so TP can exceed the KV head count")
    placement_order: str = doc("tp-cp-ep-dp-pp", "rank order of the dimensions, fastest-varying first")
    fsdp: FSDPConfig = doc(FSDPConfig(), "fully sharded data parallelism")


@dataclass
class DataConfig:
    source: str = doc(
        "text",
        "synthetic | text | hf_dataset (a tokenized Hugging Face dataset saved with save_to_disk) | "
        "megatron (Megatron's indexed .bin/.idx datasets named by data_prefix) | "
        "instructions (SFT records: .jsonl or save_to_disk; needs model_alignment_strategy.sft) | "
        "preferences (prompt/chosen/rejected records; needs model_alignment_strategy.dpo or .orpo) | "
        "prompts (records with a prompt field; needs model_alignment_strategy.grpo)",
    )
    micro_batch_size: int = doc(4, "samples per forward/backward on one rank (preferences: pairs)")
    global_batch_size: Optional[int] = doc(
        None,
        "samples per optimizer step over all data-parallel ranks; null = "
        "micro_batch_size × DP (one micro-batch per rank per step)",
    )
    seq_length: int = doc(128, "tokens per sample")
    train_dir: Optional[str] = doc(
        None,
        "text: a UTF-8 text file or directory of *.txt (null = the shipped sample text); "
        "hf_dataset: the save_to_disk directory (input_ids, optional labels; needs pyarrow); "
        "instructions, preferences: a .jsonl file, a directory of *.jsonl, or a save_to_disk "
        "directory of records (null = the shipped instruction / preference set)",
    )
    tokenizer: Optional[str] = doc(
        None,
        "path to a Hugging Face tokenizer.json (instructions: its directory, with "
        "tokenizer_config.json: EOS, chat template); null = byte-level (256 ids)",
    )
    num_samples: int = doc(4096, "synthetic source: number of distinct samples")
    # Megatron's indexed datasets (source: megatron; NxDT's megatron_* configs)
    data_prefix: Optional[Any] = doc(
        None,
        "megatron: [weight, prefix, weight, prefix, ...] of PREFIX.bin/.idx datasets "
        "(nxdt data convert-megatron writes them), blended by weight; on the command line "
        "data.data_prefix=[0.3,/data/a_text_document,0.7,/data/b_text_document] (no spaces)",
    )
    index_mapping_dir: Optional[str] = doc(None, "megatron: directory caching the sample index (.npy); null = beside each .idx")
    splits_string: Optional[str] = doc(
        None,
        "megatron: train,validation,test shares of each dataset's documents (e.g. "
        "980,10,10); training reads the leading train share; null = every document",
    )
    val_dir: Optional[str] = doc(
        None,
        "validation data, read like train_dir (text: a file or directory; hf_dataset, "
        "instructions: the same formats); null = no validation",
    )
    dev_choose_samples: Optional[int] = doc(
        None, "instructions, preferences: use only the first N records of train_dir; null = all"
    )
    shuffle: bool = doc(
        True,
        "training samples in a seeded permutation per epoch; false = in order, each epoch from the first sample, "
        "its last partial global batch dropped (NxDT's HF data module: DistributedSampler(shuffle=False), "
        "drop_last); megatron reads its own shuffled sample index either way",
    )
    val_split: float = doc(
        0.0,
        "without data.val_dir: hold out this fraction of train_dir's samples (the last ones) for "
        "validation, never trained on; 0 = none",
    )


@dataclass
class SchedConfig:
    name: str = doc("CosineAnnealing", "CosineAnnealing | LinearAnnealingWithWarmUp | constant")
    warmup_steps: int = doc(10, "linear warm-up steps")
    max_steps: int = doc(MISSING, "steps over which the rate decays (defaults to trainer.max_steps)")
    min_lr: float = doc(0.0, "final learning rate")
    constant_steps: int = doc(0, "steps held at min_lr at the end (the decay ends constant_steps before max_steps)")


@dataclass
class OptimConfig:
    name: str = doc("adamw", "adamw | adamw_fp32OptState")
    lr: float = doc(3e-4, "peak learning rate")
    weight_decay: float = doc(0.01, "decoupled weight decay of the decayed group (see no_weight_decay)")
    no_weight_decay: str = doc(
        "norms_and_biases",
        "parameters with weight decay 0: norms_and_biases (norm weights and biases) | biases | none (every parameter "
        "decayed); NxDT's model.do_layer_norm_weight_decay sets it by model source (docs/migrating-from-nxdt.md)",
    )
    fixed_weight_decay: Optional[float] = doc(
        None,
        "the decayed group's rate in place of weight_decay (NxDT's HF models: 0.01, whatever optim.weight_decay "
        "says; set by the NxDT translation); null = weight_decay",
    )
    betas: List[float] = doc([0.9, 0.95], "Adam betas")
    eps: float = doc(1e-8, "Adam epsilon")
    sched: SchedConfig = doc(SchedConfig(), "learning-rate schedule")


@dataclass
class MoEConfig:
    """Mixture of experts (Mixtral, Qwen3-MoE); dense architectures ignore it."""

    num_experts: int = doc(0, "experts per MoE layer (0 = no experts: a dense model)")
    top_k: int = doc(2, "experts each token is routed to")
    router_aux_loss_coef: float = doc(0.02, "weight of the load-balancing auxiliary loss added to the LM loss")
    router_activation: str = doc(
        "softmax",
        "softmax (Mixtral's router) | sigmoid (NxD's sigmoid affinities, NxDT's Megatron MoE default)",
    )
    normalize_top_k_affinities: bool = doc(
        True,
        "renormalise the chosen experts' weights to sum 1 (Mixtral: always; Qwen3-MoE: config.json's norm_topk_prob)",
    )


@dataclass
class RopeScalingConfig:
    """RoPE scaling (Hugging Face's config.json ``rope_scaling``; read from it with model.model_config)."""

    rope_type: Optional[str] = doc(
        None, "null or default = plain RoPE | llama3 = Llama 3.1's scaling (other HF types are refused)"
    )
    factor: float = doc(
        8.0, "llama3: frequencies with wavelength > original_max_position_embeddings/low_freq_factor are divided by it"
    )
    low_freq_factor: float = doc(1.0, "llama3: the long-wavelength boundary is original_max_position_embeddings/low_freq_factor")
    high_freq_factor: float = doc(
        4.0, "llama3: wavelengths below original_max_position_embeddings/high_freq_factor stay unscaled"
    )
    original_max_position_embeddings: int = doc(8192, "llama3: the context length of pretraining")


@dataclass
class ModelConfig:
    architecture: str = doc("nxdt.models.llama.LlamaForCausalLM", "model class import path (only nxdt.models.* allowed)")
    vocab_size: int = doc(MISSING, "vocabulary size")
    make_vocab_size_divisible_by: int = doc(
        1,
        "under tensor parallelism the embedding and head are padded to a multiple of this × TP (Megatron's rule); "
        "padding logits are masked and checkpoints hold the true vocabulary, so only speed depends on it",
    )
    hidden_size: int = doc(MISSING, "model width")
    num_layers: int = doc(MISSING, "decoder layers")
    num_attention_heads: int = doc(MISSING, "query heads")
    num_kv_heads: Optional[int] = doc(None, "key/value heads (grouped-query attention); null = num_attention_heads")
    ffn_hidden_size: int = doc(MISSING, "SwiGLU inner width")
    head_dim: Optional[int] = doc(
        None, "each attention head's width; null = hidden_size / num_attention_heads (Qwen3 states it, and it may differ)"
    )
    max_position_embeddings: int = doc(MISSING, "longest sequence the model supports")
    rope_theta: float = doc(10000.0, "RoPE base")
    rope_scaling: RopeScalingConfig = doc(RopeScalingConfig(), "RoPE scaling (Llama 3.1: rope_type llama3); off by default")
    norm_eps: float = doc(1e-5, "RMSNorm epsilon")
    tie_word_embeddings: bool = doc(False, "share input embedding and output head")
    sliding_window: Optional[int] = doc(
        None,
        "Mistral's sliding-window attention span (config.json's sliding_window); null = none. Computed as full causal "
        "attention, the same function up to the window: data.seq_length above it is refused",
    )
    init_method_std: float = doc(0.02, "std of the normal weight init")
    activations_checkpoint_granularity: Optional[str] = doc(None, "full | selective | null")
    loss_averaging: str = doc(
        "tokens",
        "pretraining and SFT: tokens = the mean over every labelled token of the global batch (the same for any "
        "micro_batch_size and DP) | micro_batches = the mean of each micro-batch's token mean, as NxDT averages "
        "(lightning_modules/model/base.py forward_backward_step); equal when every micro-batch has as many labels",
    )
    core_attention: str = doc(
        "sdpa",
        "sdpa (torch's scaled_dot_product_attention: its fused flash kernel on CPU, no S×S tensor) "
        "| blockwise (query×key blocks, online softmax, in torch) | naive (the S×S scores "
        "materialised); NxDT's model.fusions.flash_attention: false = naive",
    )
    hf_checkpoint: Optional[str] = doc(
        None,
        "initialise the weights from a Hugging Face checkpoint directory (*.safetensors, HF names); its "
        "config.json sets the architecture and every model field that changes the computation",
    )
    model_config: Optional[str] = doc(
        None,
        "a Hugging Face config.json (or its directory), as NxDT's model.model_config: the architecture and every "
        "model field that changes the computation come from it (no weights are loaded)",
    )
    weight_init_only: bool = doc(
        False,
        "with exp_manager.resume_from_checkpoint: take only the model weights from that nxdt "
        "checkpoint (any layout) and start at step 0 with a fresh optimizer (fine-tuning)",
    )
    moe: MoEConfig = doc(MoEConfig(), "mixture of experts (Mixtral); ignored by dense models")
    optim: OptimConfig = doc(OptimConfig(), "optimizer")


@dataclass
class SFTConfig:
    """Supervised fine-tuning on instruction records (data.source=instructions; nxdt.data.instructions)."""

    packing: bool = doc(
        True,
        "append whole records into each sequence (attention and positions never cross a record); "
        "false = one record per sequence, padded (pad tokens have no loss)",
    )
    truncation: str = doc(
        "truncate",
        "a record longer than data.seq_length: truncate (the prompt's start is cut, keeping "
        "at least half the sequence, then the response's end) | drop; both are counted",
    )
    packing_style: str = doc(
        "per_record",
        "with packing: per_record = prompts masked, attention and positions within each record (as TRL packs) | "
        "concat = NxD Training's ConcatDataset: records joined by EOS, prompts trained, plain causal attention and "
        "positions across the row, records longer than seq_length-1 skipped (truncation not applied)",
    )


@dataclass
class PEFTConfig:
    """LoRA adapters (NxDT's keys and defaults)."""

    lora_rank: int = doc(16, "rank of the LoRA update")
    lora_alpha: float = doc(32, "scale = lora_alpha / lora_rank")
    lora_dropout: float = doc(0.05, "dropout on the adapter's input")
    lora_bias: str = doc("none", "none | all | lora_only")
    lora_verbose: bool = doc(True, "log the adapted modules")
    target_modules: List[str] = doc(["qkv_proj"], "modules to adapt: qkv_proj | o_proj | gate_up_proj | down_proj")
    load_lora_from_ckpt: bool = doc(
        False, "continue from the adapters (and base, if saved) of exp_manager.resume_from_checkpoint"
    )
    save_lora_base: bool = doc(True, "save the base model with the adapter")
    merge_lora: bool = doc(False, "checkpoints hold the adapter merged into the base (needs save_lora_base; not resumable)")
    save_lora_config_adapter: bool = doc(True, "save the LoRA config and adapter in the same checkpoint file")
    merge_sharded_lora: bool = doc(False, "merge the TP-sharded adapter checkpoints into one")


@dataclass
class DPOConfig:
    """Direct Preference Optimization (NxDT's keys and defaults)."""

    kl_beta: float = doc(0.01, "beta: how far the policy may move from the reference model")
    # a name or a list of names (TRL's DPOConfig.loss_type): Any, as OmegaConf has no str-or-list type
    loss_type: Any = doc(
        "sigmoid",
        "sigmoid (the paper's) | hinge | ipo | sigmoid_norm | robust | exo_pair | nca_pair | bco_pair | sppo_hard | "
        "apo_zero | apo_down | discopop | sft, or a list of them added up (TRL's loss types)",
    )
    loss_weights: Optional[List[float]] = doc(None, "one weight per loss_type when it is a list; null = all 1 (TRL's)")
    label_smoothing: float = doc(0.0, "robust: the label-flip probability, in [0, 0.5); exo_pair: its epsilon, in (0, 1)")
    f_divergence_type: str = doc(
        "reverse_kl", "reverse_kl (DPO) | forward_kl | js_divergence | alpha_divergence: f-DPO's regulariser (TRL's)"
    )
    f_alpha_divergence_coef: float = doc(0.5, "alpha of f_divergence_type=alpha_divergence")
    discopop_tau: float = doc(0.05, "temperature of loss_type discopop")
    max_prompt_length: int = doc(2048, "longest prompt, in tokens")
    precompute_ref_log_probs: bool = doc(
        True,
        "true: the reference log-probabilities computed once, before training; false (TRL's default): each step, by a "
        "frozen copy of the starting weights (fresh LoRA adapters: the policy with its adapters off; not with PP)",
    )
    truncation_mode: str = doc("keep_start", "keep_start | keep_end: which end of a too-long prompt is kept")


@dataclass
class ORPOConfig:
    """Odds Ratio Preference Optimization (NxDT's keys and defaults)."""

    beta: float = doc(0.1, "weight of the odds-ratio term")
    max_prompt_length: int = doc(2048, "longest prompt, in tokens")
    truncation_mode: str = doc("keep_start", "keep_start | keep_end: which end of a too-long prompt is kept")
    nll_mean: str = doc(
        "tokens",
        "the NLL term: tokens = TRL's ORPOTrainer (the chosen prompts' and responses' token mean over the global batch); "
        "sequences = NxD Training's base_orpo.py (the mean over pairs of each chosen response's mean token log-prob)",
    )


@dataclass
class GRPOConfig:
    """Group Relative Policy Optimization with TRL's GRPOConfig names and defaults (nxdt.lightning.grpo)."""

    reward_funcs: List[str] = doc(
        [], "reward functions as module:function, TRL's f(prompts, completions, **kwargs) -> list[float]; your own code"
    )
    reward_weights: Optional[List[float]] = doc(None, "one weight per reward function; null = all 1")
    num_generations: int = doc(8, "completions sampled per prompt (a group); must divide data.global_batch_size")
    max_prompt_length: int = doc(512, "longest prompt, in tokens (longer prompts keep their last tokens)")
    max_completion_length: int = doc(256, "most tokens sampled per completion")
    temperature: float = doc(1.0, "sampling temperature (also divides the logits the loss scores)")
    top_p: float = doc(1.0, "nucleus sampling: keep the most likely tokens up to this probability; 1 = all")
    top_k: int = doc(0, "sample among the k most likely tokens; 0 = all")
    beta: float = doc(0.0, "KL coefficient (k3 estimator) to the starting weights; 0 = no reference model")
    epsilon: float = doc(0.2, "clipping range below 1 of the probability ratio")
    epsilon_high: Optional[float] = doc(None, "clipping range above 1; null = epsilon (DAPO: 0.28)")
    loss_type: str = doc("dapo", "grpo | bnpo | dr_grpo | dapo: how token losses are averaged (TRL's)")
    scale_rewards: str = doc("group", "group | batch | none: what the advantages are divided by (TRL's)")
    num_iterations: int = doc(
        1, "optimizer steps on each generation (TRL's mu): its completions reused, ratios to the policy that sampled them"
    )


@dataclass
class ModelAlignmentConfig:
    """NxDT's model_alignment_strategy: the block that is set (not null) picks the recipe; none = pretraining."""

    sft: Optional[SFTConfig] = doc(None, "supervised fine-tuning (instruction records, prompt tokens masked)")
    peft: Optional[PEFTConfig] = doc(None, "LoRA adapters")
    dpo: Optional[DPOConfig] = doc(None, "DPO on preference records")
    orpo: Optional[ORPOConfig] = doc(None, "ORPO on preference records")
    grpo: Optional[GRPOConfig] = doc(None, "GRPO: online RL on prompt records with your reward functions")


@dataclass
class PrecisionConfig:
    """Numeric formats (NxDT's names). fp32: everything fp32. bf16: bf16 weights, gradients, moments and compute;
    AdamW in bf16 arithmetic, results rounded to nearest (updates below half a bf16 ulp of a weight are lost).
    bf16SR: as bf16 (bf16 weights, gradients, compute), but AdamW computes in fp32 from the bf16 weights,
    gradients and moments and writes weights and moments back rounded stochastically to bf16 (unbiased:
    x between bf16 neighbours a < b becomes b with probability (x-a)/(b-a)), so small updates accumulate in
    expectation; moments in bf16, or fp32 with model.optim.name=adamw_fp32OptState. The random bits are a
    function of (seed, optimizer step, parameter index): runs repeat bitwise, resumes continue bitwise, and
    data-parallel replicas stay identical. Activations and gradients are rounded to nearest (on Trainium
    the runtime rounds those stochastically too). mixed_precision: fp32 weights (the master copy), fp32
    gradients and moments, bf16 compute under autocast. mixed_precisionSR: NxDT's mixed_precision with
    stochastic rounding where fp32 is cast to bf16; nxdt's fp32 weights are updated in fp32 and never
    rounded to bf16 between steps, and the bf16 compute copies autocast makes are rebuilt from them every
    step (rounding there is forward noise, never accumulated), so it trains exactly as mixed_precision."""

    type: str = doc(
        "fp32",
        "fp32 | bf16 | bf16SR (bf16 with stochastically rounded updates) | mixed_precision | "
        "mixed_precisionSR (= mixed_precision: fp32 weights, nothing to round)",
    )


@dataclass
class LinkConfig:
    bandwidth_GBps: float = doc(0.0, "per direction, per link (GB/s, decimal)")
    latency_us: float = doc(0.0, "one hop, one message (µs)")
    efficiency: Optional[float] = doc(None, "achieved fraction of bandwidth_GBps on this link; null = instance.link_efficiency")
    ramp_us: float = doc(
        0.0,
        "extra time of a collective crossing this link that grows with the message and saturates "
        "(protocol switch, channels ramping up): ramp_us · S / (S + ramp_bytes); 0 = none (µs)",
    )
    ramp_bytes: float = doc(0.0, "message size (bytes) at which the ramp reaches half of ramp_us")
    message_us: float = doc(
        0.0, "cost to a rank of each message it sends to a peer over this link beyond its bytes (all-to-all: one per peer), µs"
    )
    post_us: float = doc(
        0.0,
        "least time of every step of a ring that crosses this link, the host posting the step's network send "
        "(NCCL tuning.cc: a ring across nodes pays nsteps × the net overhead, × 3 with the Simple protocol); 0 = none (µs)",
    )


@dataclass
class ProvenanceConfig:
    source: str = doc("", "where the value comes from (document, section, measurement)")
    guess: bool = doc(False, "true when no source states the value: a tunable default, not a fact")


@dataclass
class InstanceConfig:
    """One instance type of the catalogue (conf/instance/<name>.yaml); value sources: docs/sources.md."""

    name: str = doc("cpu", "instance type (cpu = worker processes on this host)")
    description: str = doc("", "one line shown by `nxdt topo`")
    accelerator: str = doc(
        "cpu",
        "what a rank computes on: cpu (a worker process; also how Trainium/Inferentia plans run today) | "
        "cuda (an NVIDIA GPU: local rank → cuda:N, nxdt.comm over NCCL for CUDA tensors)",
    )
    env: Dict[str, str] = doc(
        {}, "environment every worker of a run on this instance gets unless already set (NCCL / EFA settings)"
    )
    devices: int = doc(2, "accelerator devices per node (cpu: default worker processes per node)")
    cores_per_device: int = doc(1, "physical cores per device (NeuronCores; GPUs: 1)")
    lnc_options: List[int] = doc([], "logical-NeuronCore sizes the instance accepts; [] = no LNC")
    lnc_default: int = doc(1, "physical cores per rank unless trainer.lnc says otherwise")
    memory_GiB: float = doc(0.0, "device memory (GiB); 0 = unlimited (cpu)")
    peak_tflops_bf16: float = doc(0.0, "dense bf16 peak per device (TFLOP/s)")
    peak_tflops_fp32: float = doc(
        0.0,
        "peak of fp32 training's matmuls per device (TFLOP/s; NVIDIA GPUs from Ampere: TF32 tensor cores, as NVIDIA's containers run them)",
    )
    compute_efficiency: float = doc(0.4, "achieved fraction of peak in a training step, for large GEMMs (cost model)")
    compute_half_size: float = doc(
        0.0,
        "per-rank GEMM width (hidden_size / TP) at which the achieved fraction is half of "
        "compute_efficiency: efficiency = compute_efficiency · g / (g + compute_half_size); 0 = constant",
    )
    compute_efficiency_fp32: Optional[float] = doc(
        None, "achieved fraction of peak_tflops_fp32 in an fp32 step, for large GEMMs; null = compute_efficiency"
    )
    compute_half_tokens: float = doc(
        0.0,
        "tokens per micro-batch (each GEMM's rows on a rank) at which the achieved fraction is half: efficiency is "
        "further multiplied by T / (T + compute_half_tokens); 0 = independent of the micro-batch",
    )
    memory_bandwidth_GBps: float = doc(
        0.0,
        "device memory (HBM) bandwidth, GB/s: the non-matmul work (norms, activations, softmax, residual adds, the loss, "
        "the optimizer step) is priced as the bytes it moves at this rate; 0 = not priced",
    )
    collective_overhead_us: float = doc(0.0, "fixed software cost of every collective (launch, synchronisation), µs")
    collective_overhead_per_rank_us: float = doc(
        0.0, "software cost per further rank of a collective (synchronising with each peer), µs: n ranks add (n - 1) times this"
    )
    nvls_efficiency: float = doc(
        0.0,
        "NVLink SHARP (NVLS, nvswitch graphs): achieved fraction of device_link bandwidth of the all-reduce the switch "
        "reduces (each GPU sends and receives S once); 0 = no NVLS (before Hopper)",
    )
    nvls_latency_us: float = doc(0.0, "latency of one NVLS all-reduce through the switch, µs")
    network_protocols: List[str] = doc(
        ["simple"],
        "NCCL protocols a ring across nodes may use (switch / nvswitch graphs): ll | ll128 | simple; the planner prices "
        "each and takes the cheapest, as NCCL's tuner does (EFA without ordered 128-byte delivery: simple only)",
    )
    graph: str = doc("host", "intra-node graph: host | single | chain | ring | torus2d | torus3d | switch | nvswitch")
    shape: List[int] = doc([], "graph shape, e.g. [4, 4] for a 4x4 torus ([rows, cols], row-major device ids)")
    intra_device: LinkConfig = doc(LinkConfig(), "between ranks on one device (shared memory on cpu)")
    device_link: LinkConfig = doc(
        LinkConfig(), "one scale-up link between neighbouring devices (switch graphs: a device's whole port into the switch)"
    )
    domain_nodes: int = doc(1, "nodes joined by scale-up links into one domain (UltraServer, NVL72)")
    domain_link: LinkConfig = doc(LinkConfig(), "scale-up link between nodes of one domain (per device)")
    inter_node: LinkConfig = doc(LinkConfig(), "scale-out network per node (all NICs together)")
    link_efficiency: float = doc(0.8, "achieved fraction of link bandwidth (cost model)")
    group_sizes: List[int] = doc([], "ranks a group may hold within one node at lnc_default; [] = any")
    multi_node: bool = doc(True, "whether several nodes of this instance can form one job")
    max_nodes: Optional[int] = doc(None, "largest number of nodes; null = unbounded")
    tp_device_orders: Dict[str, str] = doc({}, "TP degree → device order (column_rings | row_pairs) the runtime expects")
    provenance: Dict[str, ProvenanceConfig] = doc({}, "field → source of its value (and whether it is a guess)")


@dataclass
class CommConfig:
    timeout_s: float = doc(120.0, "deadline of every collective wait; a rank that does not arrive is named")
    transport: str = doc(
        "auto",
        "transport of every group's communicator: auto (shm when the group is on one host, else p2p) | "
        "shm | p2p (point-to-point links: shm mailboxes on a host, gloo across) | gloo (torch.distributed's)",
    )
    algorithm: str = doc(
        "auto",
        "run this algorithm for every collective that has one of that name: direct | slice | ring | rhd | "
        "torus[:RxC] | hierarchical | tree | pairwise; auto = the plan's choice where the transport "
        "runs it, else the transport's own (by size and group shape)",
    )
    emulate: Optional[str] = doc(None, "emulate the links of this instance on CPU; null = off")
    emulate_slowdown: float = doc(
        1.0,
        "emulated links take this many times longer (latency × s, bandwidth / s), so "
        "communication is comparable to the CPU's compute in overlap studies",
    )


@dataclass
class LauncherConfig:
    """How the workers start (conf/launcher/<name>.yaml); README "Running on a cluster"."""

    name: str = doc(
        "local",
        "local: this host | torchrun: run the same `nxdt train` on every node (c10d rendezvous) | "
        "slurm: submit a job that runs one agent per node",
    )
    dry_run: bool = doc(False, "print exactly what would run (commands, environment, job script) and start nothing")
    rdzv_endpoint: Optional[str] = doc(
        None,
        "torchrun: HOST[:PORT] of the c10d rendezvous, the same on every node; "
        "null = $PET_RDZV_ENDPOINT, else $MASTER_ADDR:$MASTER_PORT",
    )
    rdzv_id: Optional[str] = doc(
        None, "torchrun: job id, the same on every node (also names the run directory); null = $PET_RDZV_ID, else $SLURM_JOB_ID"
    )
    node_rank: Optional[int] = doc(
        None,
        "torchrun: this node's place in the plan; null = $PET_NODE_RANK / $NODE_RANK / "
        "$SLURM_NODEID, else the UltraServer (server_id, node_id) order, else rendezvous order",
    )
    local_addr: Optional[str] = doc(
        None, "address the other nodes reach this node at; null = the one that routes to the rendezvous"
    )
    port: int = doc(29500, "rendezvous port (slurm: on the job's first node; torchrun: when rdzv_endpoint names none)")
    join_timeout_s: float = doc(600.0, "how long a node waits for every node to join the rendezvous")
    partition: Optional[str] = doc(None, "slurm: sbatch --partition")
    account: Optional[str] = doc(None, "slurm: sbatch --account")
    time_limit: str = doc("01:00:00", "slurm: sbatch --time")
    sbatch_args: List[str] = doc([], "slurm: more #SBATCH options, e.g. ['--exclusive', '--constraint=trn1']")
    gpus_per_node: Optional[int] = doc(
        None,
        "slurm, GPU instances (instance.accelerator=cuda): sbatch --gpus-per-node; null = the GPUs the plan uses on a "
        "node; 0 = leave the option out (a cluster without GPU GRES)",
    )
    wait: bool = doc(False, "slurm: wait until the job ends (sbatch --wait) and exit with its status")


@dataclass
class Config:
    name: str = doc(
        "llama_tiny",
        "run name: one directory under exp_manager.exp_dir (default: the model config's name, e.g. gpt_tiny for model=gpt_tiny; no '/', '..' or control characters)",
    )
    seed: int = doc(1234, "global seed, 0..2**32-1")
    trainer: TrainerConfig = doc(TrainerConfig(), "training loop")
    exp_manager: ExpManagerConfig = doc(ExpManagerConfig(), "run directory, checkpoints, logging")
    distributed_strategy: DistributedStrategyConfig = doc(DistributedStrategyConfig(), "parallel degrees")
    data: DataConfig = doc(DataConfig(), "data source and batch sizes")
    model: ModelConfig = doc(ModelConfig(), "model shape and optimizer")
    precision: PrecisionConfig = doc(PrecisionConfig(), "numeric precision")
    instance: InstanceConfig = doc(InstanceConfig(), "hardware the plan targets")
    comm: CommConfig = doc(CommConfig(), "collectives")
    launcher: LauncherConfig = doc(LauncherConfig(), "how the workers start: local, torchrun (every node), slurm")
    model_alignment_strategy: ModelAlignmentConfig = doc(
        ModelAlignmentConfig(), "fine-tuning recipe (NxDT's key): sft, peft, dpo, orpo; none set = pretraining"
    )


# group name → schema for the group files under conf/<group>/
GROUP_SCHEMAS = {"model": ModelConfig, "data": DataConfig, "instance": InstanceConfig, "launcher": LauncherConfig}


@functools.cache  # once per process: storing the schemas costs ~50 ms, a quarter of a compose
def register_schemas() -> None:
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"{group}_schema", node=schema)


def _optional_block(schema: type, name: str) -> type | None:
    """The dataclass of an ``Optional[<dataclass>]`` field (a block that is off while null), else None."""
    hint = typing.get_type_hints(schema).get(name)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1 and isinstance(args[0], type) and is_dataclass(args[0]):
        return args[0]
    return None


@functools.cache  # once per process: walking the dataclasses' type hints costs ~20 ms, and every compose asks
def field_docs(schema: type = Config, prefix: str = "") -> tuple[tuple[str, str, str], ...]:
    """(dotted key, default, help) for every leaf field, for ``--help``; an optional block's keys are listed as
    its own (the block itself is null until set)."""
    rows: list[tuple[str, str, str]] = []
    for f in fields(schema):
        key = f"{prefix}{f.name}"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        block = _optional_block(schema, f.name) if default is None else None
        if block is not None:
            rows.extend(field_docs(block, key + "."))
        elif is_dataclass(default) and not isinstance(default, type):
            rows.extend(field_docs(type(default), key + "."))
        else:
            rows.append((key, "???" if default is MISSING else repr(default), f.metadata.get("help", "")))
    return tuple(rows)
