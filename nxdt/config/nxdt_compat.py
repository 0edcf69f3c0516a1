"""NxDT configs as they are: an NxD Training YAML (as a plain dict) in, an nxdt config dict out.

Pure: no files, no Hydra, no processes. :func:`translate` takes the NxDT config (already composed and
resolved) and, for ``model.model_config``, the parsed Hugging Face ``config.json``; it returns the nxdt
config as a nested dict plus what the user should hear about. The loader around it
(``nxdt.config.compose_nxdt_config``) reads the files and merges the result onto nxdt's typed schema.

Every key NxDT documents or its example configs use has exactly one rule in :data:`RULES`:

* ``map``      — sets an nxdt key (the same name when NxDT and nxdt agree);
* ``custom``   — read together with related keys by a section function below (precision, optimizer,
  schedule, model shape, MoE, checkpointing);
* ``agree``    — nxdt always behaves like one value of it (e.g. ``monitor: step``); that value is
  accepted silently, any other is reported (a note, or an error when the model itself would differ);
* ``ignored``  — a Neuron compiler / runtime / XLA setting or an NxDT internal with nothing to act on
  here; all of them are listed in ONE warning;
* ``derived``  — NxDT itself computes or never reads it (e.g. ``model_parallel_size``): accepted silently.

Keys of nxdt's own schema may appear in an NxDT config too (``data.source: synthetic``,
``exp_manager.max_restarts``, ``model.vocab_size``, ...) and win over what the translation derived.
Anything else is an error naming the key and the closest known key. ``docs/migrating-from-nxdt.md``
holds the table this module renders with :func:`mapping_table`.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from nxdt.config.hf_model import FAMILIES, HFConfigError, model_fields
from nxdt.config.schema import field_docs
from nxdt.config.validate import ConfigError

MAP, CUSTOM, AGREE, IGNORED, DERIVED = "map", "custom", "agree", "ignored", "derived"


@dataclass(frozen=True)
class Rule:
    kind: str
    doc: str
    to: str | None = None  # MAP: the nxdt key (None = the same name)
    agree: tuple = ()  # AGREE: values nxdt behaves as
    error: bool = False  # AGREE: another value is an error (the model or data would differ), not a note


def _map(doc: str = "", to: str | None = None) -> Rule:
    return Rule(MAP, doc, to=to)


def _custom(doc: str) -> Rule:
    return Rule(CUSTOM, doc)


def _agree(doc: str, *values: Any, error: bool = False) -> Rule:
    return Rule(AGREE, doc, agree=values, error=error)


def _ignored(doc: str) -> Rule:
    return Rule(IGNORED, doc)


def _derived(doc: str) -> Rule:
    return Rule(DERIVED, doc)


MEGATRON_MODEL = "Megatron-model key; an hf model's shape comes from model.model_config (NxDT ignores it there too)"

# NxDT key → rule. Order is the order of the migration guide's table.
RULES: dict[str, Rule] = {
    # --- top level ---
    "name": _map(
        "run name: outputs/<name>/<timestamp>/ (exp_manager.name wins when both are set; nxdt's own configs default it to the model config's name)"
    ),
    "model_source": _custom(
        "hf: the model from model.model_config; megatron: from the Megatron model keys below (Llama, "
        "Mixtral or GPT by normalization, activation, position_embedding_type, has_bias)"
    ),
    "seed": _map(),
    "compiler_flags": _ignored("Neuron compiler flags"),
    "compiler_cache_url": _ignored("Neuron compile cache"),
    "aync_exec_max_inflight_requests": _ignored("Neuron runtime queue depth (NxDT's spelling)"),
    "bucket_size_collectives": _ignored("XLA collective bucketing; nxdt's collectives chunk by size themselves"),
    "neuron_rt_exec_timeout": _ignored("Neuron runtime timeout; nxdt's is comm.timeout_s"),
    "neuron_experimental_compress_rg": _ignored("Neuron replica-group compression"),
    "xla_*": _ignored("XLA environment settings"),
    # --- trainer ---
    "trainer.devices": _map("ranks per node (one per logical NeuronCore on Trainium)"),
    "trainer.num_nodes": _map(),
    "trainer.max_steps": _map("optimizer steps; the LR schedule spans it, as in NxDT"),
    "trainer.max_epochs": _map("stops at whichever of max_steps and max_epochs comes first, as Lightning does in NxDT"),
    "trainer.log_every_n_steps": _map("a metrics.csv row every N steps"),
    "trainer.gradient_clip_val": _map("global-norm clipping; absent = no clipping (Lightning's default, as in NxDT)"),
    "trainer.lnc": _map("logical NeuronCore size; also picks the instance when `instance=` is not given"),
    "trainer.sequential_move_factor": _ignored("NxDT weight-initialisation pacing for PP on device"),
    "trainer.accelerator": _ignored("Lightning accelerator (NxDT: tpu/XLA); nxdt runs on CPU ranks"),
    "trainer.accumulate_grad_batches": _agree(
        "gradient accumulation comes from global_batch_size/(micro_batch_size·DP); NxDT rejects other values too", 1, error=True
    ),
    "trainer.limit_val_batches": _map("validation global batches per check: <= 1 a fraction (0 = no validation), > 1 a count"),
    "trainer.num_sanity_val_steps": _map("validation batches run before training (results discarded)"),
    "trainer.limit_test_batches": _agree("nxdt runs no test loop", 0, 0.0),
    "trainer.val_check_interval": _map("validate every N optimizer steps (val_loss in metrics.csv); null = after the last step"),
    "trainer.check_val_every_n_epoch": _agree(
        "validation is scheduled by steps (trainer.val_check_interval), as NxDT's example configs do", None
    ),
    # --- exp_manager ---
    "exp_manager.name": _map("run directory name", to="name"),
    "exp_manager.exp_dir": _custom("exp_manager.exp_dir, the root of run directories; null = outputs/"),
    "exp_manager.explicit_log_dir": _map("exactly this run directory"),
    "exp_manager.create_tensorboard_logger": _map("TensorBoard event files under tensorboard/"),
    "exp_manager.resume_if_exists": _map("resume from the newest complete checkpoint of the newest run of this name"),
    "exp_manager.resume_from_checkpoint": _map("an nxdt checkpoints/step-<N> directory (NxDT's own checkpoints do not load)"),
    "exp_manager.resume_ignore_no_checkpoint": _agree("with nothing to resume nxdt starts fresh", True),
    "exp_manager.create_checkpoint_callback": _custom("false = no checkpoints (exp_manager.checkpoint_every_n_steps: null)"),
    "exp_manager.checkpoint_callback_params.every_n_train_steps": _custom("exp_manager.checkpoint_every_n_steps"),
    "exp_manager.checkpoint_callback_params.save_top_k": _custom("exp_manager.keep_last_k (0 = no checkpoints; -1 is refused)"),
    "exp_manager.checkpoint_callback_params.monitor": _agree("nxdt keeps the newest checkpoints", "step"),
    "exp_manager.checkpoint_callback_params.mode": _agree("nxdt keeps the newest checkpoints", "max"),
    "exp_manager.checkpoint_callback_params.save_last": _custom(
        "exp_manager.save_last: the last step's checkpoint when training ends (absent: true, NeMo's default)"
    ),
    "exp_manager.checkpoint_callback_params.filename": _ignored("checkpoint file pattern; nxdt writes checkpoints/step-<N>/"),
    "exp_manager.checkpoint_callback_params.model_parallel_size": _derived("TP×PP, computed from the degrees"),
    "exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt": _agree(
        "checkpoints hold the training parameters", False
    ),
    "exp_manager.checkpoint_callback_params.every_n_epochs": _agree("checkpoints are step-based", None),
    "exp_manager.checkpoint_callback_params.train_time_interval": _agree("checkpoints are step-based", None),
    "exp_manager.checkpoint_callback_params.save_last_n_optim_states": _agree("every checkpoint holds its optimizer state", None),
    "exp_manager.checkpoint_callback_params.enable_version_counter": _derived("nxdt names checkpoints by step"),
    "exp_manager.log_parameter_norm": _map("param_norm column in metrics.csv"),
    "exp_manager.log_gradient_norm": _map("grad_norm column in metrics.csv (before clipping)"),
    "exp_manager.log_local_rank_0_only": _ignored("nxdt writes logs/rank<k>.log per rank; the console shows rank 0"),
    "exp_manager.enable_recovery_time_instrumentation": _agree("no recovery-time instrumentation", False),
    "exp_manager.save_xser": _ignored("torch-xla serialization; nxdt saves safetensors"),
    "exp_manager.load_xser": _ignored("torch-xla serialization; nxdt saves safetensors"),
    "exp_manager.save_bf16": _derived("never read by NxDT"),
    "exp_manager.async_checkpointing": _map("write checkpoints in a background thread from a snapshot"),
    "exp_manager.ckpt_ptl_version": _ignored("NxDT checkpoint-format version"),
    "exp_manager.create_wandb_logger": _map(
        "Lightning's WandbLogger on rank 0: every metric at its step, the config, the run dir"
    ),
    "exp_manager.wandb_logger_kwargs": _map(
        "WandbLogger's arguments (name or project required, as in NxDT); id kept for resumes"
    ),
    "exp_manager.create_mlflow_logger": _map(
        "Lightning's MLFlowLogger on rank 0: every metric at its step, the config, the run dir"
    ),
    "exp_manager.mlflow_logger_kwargs": _map(
        "MLFlowLogger's arguments; tracking_uri null = file:<exp_dir>/mlruns (NxDT: ./mlruns), experiment_name null = the run name"
    ),
    "exp_manager.create_clearml_logger": _map(
        "a ClearML task on rank 0 (with clearml installed): every metric at its step, the config; NxDT hands it to NeMo as false"
    ),
    "exp_manager.clearml_logger_kwargs": _map(
        "NeMo's ClearMLParams: project, task, tags, connect_pytorch; task id kept for resumes"
    ),
    "exp_manager.create_dllogger_logger": _map("true is refused before launch: NxDT hands it to NeMo as false (see notes)"),
    "exp_manager.dllogger_logger_kwargs.*": _ignored("DLLogger's parameters: nxdt attaches no DLLogger"),
    # --- distributed_strategy ---
    "distributed_strategy.tensor_model_parallel_size": _map(),
    "distributed_strategy.pipeline_model_parallel_size": _map(),
    "distributed_strategy.virtual_pipeline_model_parallel_size": _custom("same key; null = 1"),
    "distributed_strategy.context_parallel_size": _map(),
    "distributed_strategy.expert_model_parallel_size": _map("EP degree, a subdivision of data parallelism"),
    "distributed_strategy.zero1": _map("ZeRO-1; absent = true, NxDT's default"),
    "distributed_strategy.sequence_parallel": _map(),
    "distributed_strategy.kv_replicator": _map("KV-head replication so TP can exceed the KV heads"),
    "distributed_strategy.token_shuffle_group_size": _agree("no MoE token shuffling", 1),
    "distributed_strategy.pipeline_model_parallel_split_rank": _agree("no encoder/decoder pipeline split", 0, None),
    # --- data ---
    "data.micro_batch_size": _map(),
    "data.global_batch_size": _map("gradient accumulation = global/(micro·DP), as in NxDT"),
    "data.seq_length": _custom(
        "data.seq_length (must agree with model.encoder_seq_length when both are set; with "
        "model_alignment_strategy: the fine-tuning length, at most encoder_seq_length, as in NxDT)"
    ),
    "data.train_dir": _custom(
        "data.train_dir with data.source=hf_dataset (a datasets.save_to_disk directory), read in order "
        "(data.shuffle: false) as NxDT's HF data module does; "
        "set data.source=text for text files; with model_alignment_strategy.sft: "
        "data.source=instructions (.jsonl, or save_to_disk, records); with .dpo / .orpo: "
        "data.source=preferences (prompt/chosen/rejected records)"
    ),
    "data.val_dir": _map("validation data, read like data.train_dir; val_loss (token-weighted over all of it) in metrics.csv"),
    "data.dev_choose_samples": _map("the first N records of data.train_dir (instruction records)"),
    # NxDT's Megatron SFT config (megatron_llama2_7B_SFT): instruction records for the Megatron model, as its comments say
    "data.use_sft_style_data_module": _custom(
        "true: the Megatron model trains on instruction records from data.train_dir "
        "(data.source=instructions with model_alignment_strategy.sft, packed as "
        "data.packing says), not on data.data_prefix; false = indexed data"
    ),
    "data.packing": _custom(
        "model_alignment_strategy.sft.packing, read with data.use_sft_style_data_module: true (absent = "
        "true); without it there are no instruction records to pack (noted)"
    ),
    "data.tokenizer.type": _map(
        "a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json: EOS, chat template)", to="data.tokenizer"
    ),
    "data.test_dir": _derived("nxdt runs no test loop"),
    "data.num_workers": _ignored("data is read in the rank process"),
    # Megatron indexed data (model_source: megatron)
    "data.data_prefix": _custom(
        "data.source=megatron with data.data_prefix: [weight, prefix, ...] of PREFIX.bin/.idx "
        "(nxdt data convert-megatron writes them), blended by weight"
    ),
    "data.data_prefix.train": _custom("the dict form of data.data_prefix: its train entry is read"),
    "data.data_prefix.validation": _derived("the validation entry is not read (validation data is data.val_dir)"),
    "data.data_prefix.test": _derived("nxdt runs no test loop"),
    "data.index_mapping_dir": _map("where the sample index .npy files are cached; null = beside each .idx"),
    "data.splits_string": _map("training reads each dataset's leading train share of documents, as Megatron's split"),
    "data.data_impl": _agree("the mmap indexed format is read", "mmap", error=True),
    "data.skip_warmup": _ignored("Megatron's mmap page warm-up"),
    "data.dataloader_type": _agree("samples are read in order of the shuffled sample index (Megatron's single)", "single"),
    "data.reset_position_ids": _agree("positions run through a sample across documents", False, error=True),
    "data.reset_attention_mask": _agree("attention crosses document boundaries inside a sample", False, error=True),
    "data.eod_mask_loss": _agree("end-of-document tokens are trained on", False, error=True),
    "data.no_seqlen_plus_one_input_tokens": _agree("samples are seq_length + 1 tokens", False, error=True),
    "data.validation_drop_last": _derived("the validation split of data_prefix is not read"),
    "data.pad_samples_to_global_batch_size": _derived("the sample stream never ends in a partial global batch"),
    "data.tokenizer.library": _agree(
        "tokenizers are read as Hugging Face's (megatron's GPT2BPETokenizer by its vocabulary)", "huggingface", "megatron"
    ),
    "data.tokenizer.vocab_file": _custom("GPT2BPETokenizer's vocab.json: its size is the vocabulary"),
    "data.tokenizer.merge_file": _derived("BPE merges: the data is already tokenized"),
    "data.tokenizer.model": _derived("sentencepiece model file: the data is already tokenized"),
    "data.tokenizer.delimiter": _derived("tabular tokenizer only"),
    "data.tokenizer.sentencepiece_legacy": _derived("sentencepiece only"),
    "data.tokenizer.use_fast": _derived("tokenizer implementation choice: the data is already tokenized"),
    # --- model (HF style) ---
    "model.model_config": _custom(
        "a Hugging Face config.json (or its directory): architecture and every shape field; "
        "relative paths: from the working directory, else from the config file's directory"
    ),
    "model.encoder_seq_length": _custom("data.seq_length"),
    "model.max_position_embeddings": _custom("max(config.json's, this), as in NxDT"),
    "model.num_layers": _custom("overrides config.json's num_hidden_layers (-1 = keep)"),
    "model.hidden_size": _custom("overrides config.json's hidden_size (-1 = keep)"),
    "model.rope_theta": _custom("overrides config.json's rope_theta (-1 = keep)"),
    "model.qkv_linear": _ignored("NxD's fused GQA QKV module; kv_replicator applies without it"),
    "model.fuse_qkv": _ignored("NxD's fused QKV weight layout"),
    "model.transpose_nki_inputs": _ignored("NKI kernel layout"),
    "model.use_cpu_initialization": _ignored("nxdt always initialises on CPU"),
    "model.weight_init_only": _map(
        "with exp_manager.resume_from_checkpoint: its model weights only (any layout), a fresh optimizer, step 0"
    ),
    "model.pipeline_cuts": _agree("nxdt cuts pipeline stages into equal layer counts", None),
    "model.activations_checkpoint_granularity": _map("full | selective (recomputes core attention) | null"),
    "model.activations_checkpoint_recompute": _ignored("NxDT module class names; selective recomputes core attention"),
    "model.activations_checkpoint_recompute_mlp": _agree("selective recomputation covers core attention only", False),
    "model.fusions.softmax": _ignored("Neuron fused-softmax kernel"),
    "model.fusions.flash_attention": _custom(
        "true (NxDT: its flash-attention kernel) = model.core_attention sdpa, nxdt's "
        "default (or blockwise, if the file says so); false = model.core_attention "
        "naive, the S×S attention scores materialised as NxDT's non-flash path does"
    ),
    "model.fusions.ring_attention": _derived("nxdt's context parallelism always runs ring attention"),
    "model.do_layer_norm_weight_decay": _custom(
        "model.optim.no_weight_decay, by model source as NxDT reads it: hf (hf_models/base_model.py) true = "
        "norms_and_biases, false/absent = biases, the decayed group at 0.01 (model.optim.fixed_weight_decay); "
        "megatron (megatron_gpt_model.py) true = none (every parameter decayed), false/absent = norms_and_biases"
    ),
    "model.save_logits": _agree("logits are not saved", False),
    "model.optim.name": _custom("adamw | adamw_fp32OptState (both AdamW with fp32 state here); others are refused"),
    "model.optim.lr": _map(),
    "model.optim.weight_decay": _map(
        "absent = 0, NeMo's default; NxDT's hf models decay at 0.01 whatever it says (noted; "
        "model.optim.fixed_weight_decay=null uses it)"
    ),
    "model.optim.betas": _map("absent = [0.9, 0.999], NeMo's default"),
    "model.optim.eps": _map(),
    "model.optim.amsgrad": _agree("AMSGrad is not implemented", False, error=True),
    "model.optim.capturable": _ignored("CUDA-graph/XLA optimizer flag"),
    "model.optim.sched.name": _custom(
        "LinearAnnealingWithWarmUp | CosineAnnealing | WarmupPolicy, WarmupHoldPolicy (= constant "
        "after warm-up); absent sched = constant"
    ),
    "model.optim.sched.warmup_steps": _map("absent = 0"),
    "model.optim.sched.warmup_ratio": _custom("warmup_steps = ratio × trainer.max_steps"),
    "model.optim.sched.max_steps": _custom("NxDT replaces it by trainer.max_steps; so does nxdt (a different value is noted)"),
    "model.optim.sched.min_lr": _map(),
    "model.optim.sched.constant_steps": _map("steps held at min_lr at the end of the schedule"),
    "model.optim.sched.hold_steps": _derived("WarmupHoldPolicy holds the peak after warm-up; constant either way"),
    "model.optim.sched.last_epoch": _agree("schedules start at step 0 (a resume restores them)", -1),
    "model.moe.num_experts": _map("overrides config.json's num_local_experts"),
    "model.moe.top_k": _map("overrides config.json's num_experts_per_tok"),
    "model.moe.router_aux_loss_coef": _custom(
        "÷ top_k: NxD's load-balancing loss is Hugging Face's over top_k, nxdt computes Hugging Face's (absent: 0.02, "
        "as NxDT's hf models; config.json's is not read)"
    ),
    "model.moe.output_router_logits": _custom(
        "false = no load-balancing loss (router_aux_loss_coef 0); absent: true for hf models, false for Megatron ones, as in NxDT"
    ),
    "model.moe.frequency": _agree("every layer of nxdt's Mixtral is a MoE layer", 1, error=True),
    "model.moe.routing_algorithm": _agree("routing is top-k", "top_k", error=True),
    "model.moe.normalize_top_k_affinities": _map(
        "false: the chosen experts' softmax weights as they are (Qwen3-MoE's norm_topk_prob)"
    ),
    "model.moe.dropout": _agree("nxdt has no dropout", 0, 0.0),
    "model.moe.capacity_factor": _custom("nxdt's MoE is dropless; a capacity factor without dropless: true is noted"),
    "model.moe.dropless": _derived("nxdt's MoE is always dropless"),
    "model.moe.router_activation": _map(
        "softmax or sigmoid affinities; absent with model_source: megatron = sigmoid, NxDT's Megatron default"
    ),
    "model.moe.sinkhorn_iterations": _derived("read only with routing_algorithm: sinkhorn"),
    "model.moe.sinkhorn_tol": _derived("read only with routing_algorithm: sinkhorn"),
    # Megatron-model keys (model_source: megatron); an hf model's shape comes from model.model_config
    "model.normalization": _custom(MEGATRON_MODEL + ": rmsnorm (Llama, Mixtral) or layernorm (GPT)"),
    "model.activation": _custom(MEGATRON_MODEL + ": swiglu (Llama, Mixtral) or gelu (GPT)"),
    "model.position_embedding_type": _custom(MEGATRON_MODEL + ": rope (Llama, Mixtral) or learned_absolute (GPT)"),
    "model.has_bias": _custom(MEGATRON_MODEL + ": false (Llama, Mixtral) or true (GPT)"),
    "model.share_embeddings_and_output_weights": _custom("megatron: model.tie_word_embeddings"),
    "model.layernorm_epsilon": _custom("megatron: model.norm_eps"),
    "model.make_vocab_size_divisible_by": _custom(
        "megatron: model.make_vocab_size_divisible_by (absent: 128, NxDT's data module default): under TP the "
        "embedding and head are padded to a multiple of this × TP as Megatron pads, but the padding logits are "
        "masked; model.vocab_size is the tokenizer's true count"
    ),
    "model.kv_channels": _agree("the head dimension is hidden_size / num_attention_heads", None, error=True),
    "model.rotary_percentage": _agree("RoPE rotates every head dimension", 1, 1.0, error=True),
    "model.transformer_block_type": _agree("pre-norm blocks", "pre_ln", error=True),
    "model.use_scaled_init_method": _agree("output projections start at init_method_std/√(2·num_layers)", True, error=True),
    "model.apply_query_key_layer_scaling": _derived(
        "Megatron divides QKᵀ by the layer number and multiplies it back inside the fp32 softmax: the same attention"
    ),
    "model.hidden_dropout": _agree("nxdt has no dropout", 0, 0.0),
    "model.attention_dropout": _agree("nxdt has no dropout", 0, 0.0),
    "model.ffn_dropout": _agree("nxdt has no dropout", 0, 0.0),
    "model.persist_layer_norm": _ignored("Megatron's persistent layer-norm kernel"),
    "model.sliding_window_size": _custom(
        "sliding-window attention: accepted when the window covers data.seq_length (then it "
        "is full causal attention), otherwise refused"
    ),
    # --- model_alignment_strategy (the block that is present picks the recipe) ---
    "model_alignment_strategy.sft.packing": _map(
        "records appended into each sequence, attention and positions per record (NxDT's ConcatDataset layout: "
        "model_alignment_strategy.sft.packing_style=concat, noted); false = one record per sequence, padded"
    ),
    # peft: LoRA on any recipe (nxdt.models.lora.apply_peft; targets checked on the model before workers start)
    "model_alignment_strategy.peft.lora_rank": _map("rank r of each adapter (A: r×in, B: out×r)"),
    "model_alignment_strategy.peft.lora_alpha": _map("the update is scaled by lora_alpha / lora_rank"),
    "model_alignment_strategy.peft.lora_dropout": _map("dropout on the adapter's input (training only)"),
    "model_alignment_strategy.peft.lora_bias": _map("none | all | lora_only: which biases train (as PEFT)"),
    "model_alignment_strategy.peft.lora_verbose": _map("rank 0 prints the adapted modules and trainable / total parameters"),
    "model_alignment_strategy.peft.target_modules": _map(
        "NxDT's qkv_proj / o_proj / gate_up_proj / down_proj (or HF's "
        "projection names); split by tensor parallelism like the base layer"
    ),
    "model_alignment_strategy.peft.load_lora_from_ckpt": _map(
        "true: continue from the adapters of exp_manager.resume_from_checkpoint "
        "(a LoRA run's checkpoint; with weight_init_only a new run at step 0, "
        "adapters-only ones on the model.hf_checkpoint base); its rank, "
        "targets and alpha must match (refused by name before launch)"
    ),
    "model_alignment_strategy.peft.save_lora_base": _map("false: checkpoints hold the adapters (trainable tensors) alone"),
    "model_alignment_strategy.peft.merge_lora": _map(
        "true (with save_lora_base): checkpoints hold W + (alpha/r)·B·A per TP shard, "
        "no adapters — to deploy or start from, not to resume (resume_if_exists, "
        "max_restarts refused); export-hf --merge merges any LoRA checkpoint"
    ),
    "model_alignment_strategy.peft.save_lora_config_adapter": _map(
        "true: every checkpoint directory is also a Hugging Face "
        "PEFT adapter (adapter_config.json, adapter_model."
        "safetensors, under its checksums; under PP gathered over the "
        "stages); not with lora_bias other than none (refused by name)"
    ),
    "model_alignment_strategy.peft.merge_sharded_lora": _map(
        "accepted, either value: the PEFT adapter is always gathered "
        "over TP and FSDP into one file (true with merge_lora true is "
        "refused: NxD then saves the adapters alone)"
    ),
    # dpo / orpo: preference records (data.source=preferences), each sample a pair in one micro-batch
    "model_alignment_strategy.dpo.kl_beta": _map(
        "β of the DPO loss −log σ(β·[(log π − log π_ref)(chosen) − (…)(rejected)]); "
        "rewards/* in metrics.csv are β·(log π − log π_ref)"
    ),
    "model_alignment_strategy.dpo.loss_type": _map(
        "sigmoid (the paper's loss, NxDT's only), or TRL's DPOTrainer losses by name or as a weighted list "
        "(loss_weights); aot / aot_unpaired are refused by name"
    ),
    "model_alignment_strategy.dpo.max_prompt_length": _map(
        "a longer prompt keeps max_prompt_length tokens (truncation_mode says which end); counted before launch"
    ),
    "model_alignment_strategy.dpo.precompute_ref_log_probs": _map(
        "true: the reference log-probabilities are computed once before training by the same model, sharded like the "
        "policy; false (TRL's default): each step by a frozen copy of the starting weights, the same numbers (refused "
        "with PP)"
    ),
    "model_alignment_strategy.dpo.truncation_mode": _map("keep_start | keep_end: which end of a too-long prompt is kept"),
    "model_alignment_strategy.orpo.beta": _map(
        "weight of the odds-ratio term: loss = NLL(chosen; TRL's token mean over the global batch, prompt included) "
        "− beta·mean log σ(log-odds ratio); no reference model"
    ),
    "model_alignment_strategy.orpo.max_prompt_length": _map("as dpo.max_prompt_length"),
    "model_alignment_strategy.orpo.truncation_mode": _map("as dpo.truncation_mode"),
    # --- precision ---
    "precision.type": _custom(
        "fp32 → fp32; bf16SR → bf16SR (optimizer updates rounded stochastically, noted); autocast, "
        "mixed_precision → mixed_precision (bf16 compute, fp32 weights); mixed_precisionSR → "
        "mixed_precisionSR (trains as mixed_precision, noted); mixed_precision_SR (the orchestrator's "
        "spelling, for which NxDT's model keeps no master weights) → bf16SR, noted; with zero1: false "
        "NxDT keeps no fp32 master weights, so mixed_precision(SR) → bf16(SR), noted (autocast: noted); "
        "manual → from the flags below"
    ),
    "precision.master_weights": _custom(
        "read only with type: manual (as in NxDT; otherwise named in the one warning): true + bf16 → "
        "mixed_precision (mixed_precisionSR with the SR flag), bf16 without ZeRO-1 as in NxDT (noted)"
    ),
    "precision.fp32_grad_acc": _custom(
        "read only with type: manual (otherwise named in the one warning); nxdt accumulates gradients in the "
        "weights' dtype, and a value that says otherwise (with ZeRO-1, as NxDT reads it) is noted"
    ),
    "precision.xla_use_bf16": _custom("XLA flag: with type: manual, '1' = bf16 compute; otherwise named in the one warning"),
    "precision.xla_downcast_bf16": _custom("XLA flag: with type: manual, '1' = bf16 compute; otherwise named in the one warning"),
    "precision.neuron_rt_stochastic_rounding_en": _custom(
        "Neuron runtime flag: with type: manual, '1' + bf16 → bf16SR (or "
        "mixed_precisionSR), '1' with fp32 is an error; otherwise named in "
        "the one warning"
    ),
    "precision.parallel_layers_reduce_dtype": _ignored("dtype of NxD's TP reductions"),
    "precision.fp32_grads_cc": _derived("never read by NxDT"),
}

# what nxdt's stochastic rounding covers, against the Neuron runtime's (every fp32 → bf16 cast on the device)
SR_NOTES = {
    "bf16SR": "nxdt rounds the optimizer's weight and moment updates stochastically to bf16; activations and "
    "gradients are rounded to nearest (the Neuron runtime rounds those stochastically too)",
    "mixed_precisionSR": "nxdt's mixed precision keeps fp32 weights and moments and rounds no update to bf16, "
    "so there is nothing to round stochastically: it trains exactly as mixed_precision",
}


@dataclass
class Translation:
    config: dict[str, Any]  # nested, nxdt's schema
    ignored: list[str] = field(default_factory=list)  # NxDT keys with no effect here (one warning)
    notes: list[str] = field(default_factory=list)  # differences worth a line each
    instance: str | None = None  # an `instance: <name>` line in the file (nxdt's key)

    def warnings(self) -> list[str]:
        lines = []
        if self.ignored:
            lines.append(
                f"nxdt: {len(self.ignored)} NxDT keys have no effect here (Neuron compiler/runtime/XLA settings "
                f"and NxDT internals): {', '.join(self.ignored)}"
            )
        return lines + [f"nxdt: note: {n}" for n in self.notes]


# ------------------------------------------------------------------------------------------------
# helpers


def flatten(node: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted leaf keys; lists and scalars are leaves, empty mappings vanish."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dotted, value in flat.items():
        node = out
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def rule_for(key: str) -> Rule | None:
    rule = RULES.get(key)
    if rule is not None:
        return rule
    for pattern, rule in RULES.items():
        if "*" in pattern and fnmatch.fnmatchcase(key, pattern):
            return rule
    return None


@functools.lru_cache(maxsize=1)
def _our_keys() -> tuple[frozenset[str], tuple[str, ...]]:
    docs = field_docs()
    free_form = tuple(k + "." for k, default, _ in docs if default == "{}")  # dict-valued fields take any sub-key
    return frozenset(k for k, _, _ in docs), free_form


def is_our_key(key: str) -> bool:
    known, free_form = _our_keys()
    return key in known or key.startswith(free_form)


def closest_key(key: str) -> str | None:
    """The known key (NxDT's or nxdt's) nearest to a misspelt one, compared among keys of the same depth."""
    known, _ = _our_keys()
    candidates = {k for k in RULES if "*" not in k} | known
    # a known key under another section first (NxDT's docs list model.do_layer_norm_weight_decay under fusions.)
    leaf = key.rsplit(".", 1)[-1]
    moved = sorted(k for k in candidates if k.rsplit(".", 1)[-1] == leaf)
    if len(moved) == 1:
        return moved[0]
    # a setting that is a section of its own here (Lightning's trainer.precision is NxDT's precision.type)
    if "." in key and f"{leaf}.type" in candidates:
        return f"{leaf}.type"
    depth = key.count(".")
    same_depth = sorted(k for k in candidates if k.count(".") == depth)
    match = difflib.get_close_matches(key, same_depth, n=1, cutoff=0.6)
    return match[0] if match else None


def unknown_key_error(key: str) -> ConfigError:
    match = closest_key(key)
    hint = f" (did you mean '{match}'?)" if match else ""
    return ConfigError(key, "", f"unknown key{hint}: neither an NxDT key nor nxdt's; see docs/migrating-from-nxdt.md")


def _is(value: Any, allowed: Iterable[Any]) -> bool:
    # 0 == False and 1 == True in Python; compare types too so `monitor: 1` is not `True`
    return any(value == a and (type(value) is type(a) or {type(value), type(a)} <= {int, float}) for a in allowed)


# ------------------------------------------------------------------------------------------------
# translation

PRECISION = {
    "fp32": "fp32",
    "bf16": "bf16",
    "bf16SR": "bf16SR",
    "autocast": "mixed_precision",
    "mixed_precision": "mixed_precision",
    "mixed_precisionSR": "mixed_precisionSR",
    "mixed_precision_SR": "bf16SR",  # what NxDT computes for its orchestrator's spelling (noted)
}
OPTIMIZERS = {"adamw": "adamw", "adamw_fp32OptState": "adamw_fp32OptState"}
SCHEDULES = {
    "LinearAnnealingWithWarmUp": "LinearAnnealingWithWarmUp",
    "CosineAnnealing": "CosineAnnealing",
    "WarmupPolicy": "constant",
    "WarmupHoldPolicy": "constant",
    "constant": "constant",
}
# what NxDT (or NeMo / Lightning underneath it) does when a key is absent, where nxdt's default differs
NXDT_DEFAULTS = {
    "distributed_strategy.zero1": True,
    "trainer.gradient_clip_val": None,
    "model.optim.weight_decay": 0.0,
    "model.optim.betas": [0.9, 0.999],
    "model.optim.sched.name": "constant",
    "model.optim.sched.warmup_steps": 0,
    "model.optim.sched.min_lr": 0.0,
}


def check_keys(nxdt: Mapping[str, Any]) -> None:
    """Every key is NxDT's or nxdt's; the first that is neither fails, naming the closest known key. Run on the
    unresolved config too, so a misspelt key is reported rather than the interpolation it breaks."""
    for key in flatten(nxdt):
        if key != "instance" and rule_for(key) is None and not is_our_key(key):
            raise unknown_key_error(key)


def translate(nxdt: Mapping[str, Any], hf_config: Mapping[str, Any] | None = None) -> Translation:
    """The nxdt config (nested dict) for an NxDT config; ``hf_config``: the parsed ``model.model_config``."""
    check_keys(nxdt)
    leaves = flatten(nxdt)
    instance = leaves.pop("instance", None)
    if instance is not None and not isinstance(instance, str):
        raise ConfigError("instance", instance, "name an instance type, e.g. instance: trn1.32xlarge")
    mapped: dict[str, Any] = {}
    ours: dict[str, Any] = {}
    ignored: list[str] = []
    notes: list[str] = []
    for key, value in leaves.items():
        rule = rule_for(key)
        if rule is None:  # nxdt's own key (check_keys refused the rest)
            ours[key] = value
        elif rule.kind == MAP:
            mapped[rule.to or key] = value
        elif rule.kind == IGNORED:
            ignored.append(key)
        elif rule.kind == AGREE and not _is(value, rule.agree):
            if rule.error:
                raise ConfigError(key, value, f"not supported here: {rule.doc}")
            notes.append(f"{key}={value!r} has no effect: {rule.doc}")
    if leaves.get("exp_manager.exp_dir") is not None:
        mapped["exp_manager.exp_dir"] = leaves["exp_manager.exp_dir"]
    if "name" in leaves and "exp_manager.name" in leaves:
        mapped["name"] = leaves["exp_manager.name"]

    checkpointing, data = _checkpointing(leaves), _data(leaves, ours)
    if "data.packing" in leaves and not leaves.get("data.use_sft_style_data_module"):
        notes.append(
            f"data.packing={leaves['data.packing']!r} has no effect: it packs instruction records, read with "
            "data.use_sft_style_data_module: true"
        )
    out = {k: v for k, v in NXDT_DEFAULTS.items()}
    if leaves.get("model_source", "hf") not in ("hf", "megatron"):
        raise ConfigError(
            "model_source", leaves["model_source"], "must be hf (model.model_config) or megatron (Megatron model keys)"
        )
    model = _model(leaves, hf_config, notes)
    if "model.model_config" in leaves and not model.get("model.moe.num_experts"):
        # a dense config.json: NxDT's hf Llama reads no model.moe key; nxdt would plan experts the model never builds
        dense = sorted(k for k in mapped if k.startswith("model.moe."))
        for key in dense:
            del mapped[key]
        if dense:
            notes.append(
                f"{', '.join(dense)} {'has' if len(dense) == 1 else 'have'} no effect: {model['model.architecture']} has no experts"
            )
    out.update(model)
    out.update(mapped)
    out.update(_aux_loss_weight(leaves, out, notes))
    out.update(_precision(leaves, notes, ignored, ours))
    _check_max_steps(leaves)
    out.update(_optimizer(leaves, notes))
    out.update(checkpointing)
    out.update(data)
    if out.get("model_alignment_strategy.sft.packing") is True and "model_alignment_strategy.sft.packing_style" not in ours:
        notes.append(
            "model_alignment_strategy.sft.packing=True: nxdt packs per record (prompts masked, attention and positions "
            "within each record); NxDT's ConcatDataset trains prompts and attends across records: "
            "model_alignment_strategy.sft.packing_style=concat reproduces it"
        )
    if data.get("data.source") == "hf_dataset":  # NxDT's HFDataModule: DistributedSampler(shuffle=False), drop_last
        out["data.shuffle"] = False
    vpp = leaves.get("distributed_strategy.virtual_pipeline_model_parallel_size")
    out["distributed_strategy.virtual_pipeline_model_parallel_size"] = 1 if vpp is None else vpp  # NxDT: None means 1

    # nxdt's own keys in the file win over config.json, but must not contradict an NxDT key of the same file
    from_file = {**mapped, **checkpointing, **data}
    for key, value in ours.items():
        if key in from_file and from_file[key] != value:
            sources = [k for k in leaves if getattr(rule_for(k), "to", None) == key or k in COUNTERPARTS.get(key, (key,))]
            raise ConfigError(
                key,
                value,
                f"contradicts the NxDT key {sources[0] if sources else key}={from_file[key]!r} in the same "
                "config; keep one of them",
            )
        out[key] = value
    return Translation(config=unflatten(out), ignored=ignored, notes=notes, instance=instance)


# nxdt keys set by NxDT keys of another name (besides MAP rules' `to`), for naming a contradiction
COUNTERPARTS = {
    "exp_manager.checkpoint_every_n_steps": (
        "exp_manager.checkpoint_callback_params.every_n_train_steps",
        "exp_manager.create_checkpoint_callback",
    ),
    "exp_manager.keep_last_k": ("exp_manager.checkpoint_callback_params.save_top_k",),
    "exp_manager.save_last": (
        "exp_manager.checkpoint_callback_params.save_last",
        "exp_manager.create_checkpoint_callback",
        "exp_manager.checkpoint_callback_params.save_top_k",
    ),
    "data.seq_length": ("data.seq_length", "model.encoder_seq_length"),
}


def _model(leaves: Mapping[str, Any], hf: Mapping[str, Any] | None, notes: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "model.model_config" in leaves:
        if hf is None:
            raise ConfigError(
                "model.model_config", leaves["model.model_config"], "the Hugging Face config.json could not be read"
            )
        try:
            fields, hf_notes = model_fields(hf)
        except HFConfigError as exc:
            raise ConfigError("model.model_config", leaves["model.model_config"], str(exc)) from None
        out.update({f"model.{k}": v for k, v in fields.items()})
        notes.extend(hf_notes)
    elif leaves.get("model_source", "hf") == "megatron":
        out.update(_megatron_model(leaves))
    elif not is_complete_model(leaves):
        raise ConfigError(
            "model.model_config",
            "",
            "missing: an NxDT hf config names its Hugging Face config.json here "
            "(or give nxdt's model keys: model.architecture, vocab_size, hidden_size, ...)",
        )
    for key in ("model.num_layers", "model.hidden_size", "model.rope_theta"):
        value = leaves.get(key, -1)
        if value is not None and value != -1:  # NxDT: -1 (or absent) keeps config.json's value
            out[key] = value
    if leaves.get("model.max_position_embeddings") is not None:
        out["model.max_position_embeddings"] = max(
            out.get("model.max_position_embeddings", 0), leaves["model.max_position_embeddings"]
        )
    flash = leaves.get("model.fusions.flash_attention")
    if flash is not None:
        ours = leaves.get("model.core_attention")  # nxdt's own key in the same file: must agree
        if ours is not None and (ours == "naive") == bool(flash):
            raise ConfigError(
                "model.core_attention",
                ours,
                f"contradicts the NxDT key model.fusions.flash_attention={flash!r} in the "
                "same config (flash attention: sdpa or blockwise; without: naive); keep one of them",
            )
        if not flash:
            out["model.core_attention"] = "naive"
    capacity = leaves.get("model.moe.capacity_factor")
    if capacity not in (None, 0, 0.0) and not leaves.get("model.moe.dropless", False):
        notes.append(f"model.moe.capacity_factor={capacity!r}: nxdt's MoE is dropless (every token reaches its top-k experts)")
    return out


def _aux_loss_weight(leaves: Mapping[str, Any], out: Mapping[str, Any], notes: list[str]) -> dict[str, Any]:
    """``model.moe.router_aux_loss_coef`` giving the loss NxDT computes. NxDT's models take ``output_router_logits``
    and ``router_aux_loss_coef`` from the yaml's ``moe`` block alone (hf models: True and 0.02 when absent, whatever
    config.json says; Megatron models: False and 0.0), and add ``coef ·`` NxD's ``load_balancing_loss_func``, which is
    Hugging Face's divided by ``top_k`` (it scales by E/k where transformers scales by E). nxdt computes Hugging Face's,
    so the weight is divided by ``top_k`` here, and said so; no load-balancing loss: 0."""
    experts = out.get("model.moe.num_experts") or 0
    if experts <= 1:
        return {}
    megatron = leaves.get("model_source", "hf") == "megatron"
    enabled = leaves.get("model.moe.output_router_logits", not megatron)
    coef = float(leaves.get("model.moe.router_aux_loss_coef", 0.0 if megatron else 0.02))
    top_k = int(out.get("model.moe.top_k") or 1)
    if not enabled or coef == 0:
        return {"model.moe.router_aux_loss_coef": 0.0}
    weight = coef / top_k
    if top_k != 1:
        notes.append(
            f"model.moe.router_aux_loss_coef={coef:g} is nxdt's {weight:g}: NxD's load_balancing_loss_func is Hugging "
            f"Face's divided by top_k={top_k}, nxdt computes Hugging Face's, so the loss is NxDT's"
        )
    return {"model.moe.router_aux_loss_coef": weight}


# (normalization, activation, position_embedding_type, has_bias) → hub family; Megatron's defaults are GPT's
MEGATRON_FAMILIES = {("rmsnorm", "swiglu", "rope", False): "llama", ("layernorm", "gelu", "learned_absolute", True): "gpt"}
MEGATRON_SHAPE_KEYS = (
    ("normalization", "layernorm"),
    ("activation", "gelu"),
    ("position_embedding_type", "learned_absolute"),
    ("has_bias", True),
)


def _megatron_model(leaves: Mapping[str, Any]) -> dict[str, Any]:
    """model_source: megatron — the hub model from Megatron's model keys (the vocabulary comes from the tokenizer,
    read by the loader; its padding to make_vocab_size_divisible_by × TP happens in the tensor-parallel layers)."""
    shape = tuple(leaves.get(f"model.{k}", default) for k, default in MEGATRON_SHAPE_KEYS)
    family = MEGATRON_FAMILIES.get(shape)
    if family is None:
        given = ", ".join(f"{k}={v!r}" for (k, _), v in zip(MEGATRON_SHAPE_KEYS, shape))
        raise ConfigError(
            "model.activation",
            shape[1],
            f"no hub model has {given}; nxdt has Llama/Mixtral (rmsnorm, swiglu, "
            "rope, has_bias false) and GPT (layernorm, gelu, learned_absolute, has_bias true)",
        )
    experts = leaves.get("model.moe.num_experts") or 0
    if family == "gpt" and experts:
        raise ConfigError("model.moe.num_experts", experts, "the hub's mixture of experts is Mixtral's (rmsnorm, swiglu, rope)")
    spec = FAMILIES["gpt2" if family == "gpt" else "mixtral" if experts else "llama"]  # the hub class by its spec
    out: dict[str, Any] = {"model.architecture": spec.architecture}
    if experts and "model.moe.router_activation" not in leaves:
        out["model.moe.router_activation"] = "sigmoid"  # NxDT's Megatron MoE default (HF Mixtral's router is softmax)
    # NxDT's data module pads with this, default 128 (lightning_modules/data/base.py, _vocab_size_with_padding)
    out["model.make_vocab_size_divisible_by"] = int(leaves.get("model.make_vocab_size_divisible_by", 128))
    if leaves.get("model.layernorm_epsilon") is not None:
        out["model.norm_eps"] = leaves["model.layernorm_epsilon"]
    if leaves.get("model.share_embeddings_and_output_weights") is not None:
        out["model.tie_word_embeddings"] = bool(leaves["model.share_embeddings_and_output_weights"])
    window = leaves.get("model.sliding_window_size")
    seq = leaves.get("data.seq_length", leaves.get("model.encoder_seq_length"))
    if window is not None and seq is not None and window < seq:
        raise ConfigError(
            "model.sliding_window_size",
            window,
            f"sliding-window attention is not implemented; a window of at least data.seq_length={seq} is plain causal attention",
        )
    return out


GPT2_BPE_VOCAB = 50257  # Megatron's GPT2BPETokenizer is GPT-2's byte-level BPE: 50257 ids (Hugging Face gpt2 config.json)


def is_complete_model(leaves: Mapping[str, Any]) -> bool:
    required = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings")
    return all(f"model.{k}" in leaves for k in required)


def _precision(leaves: Mapping[str, Any], notes: list[str], ignored: list[str], ours: Mapping[str, Any]) -> dict[str, Any]:
    """NxDT's precision block (examples/training_orchestrator.py sets the XLA/runtime flags per type;
    lightning_modules/model/base.py ``_initialize_nxd_config`` picks master weights and fp32 gradient accumulation,
    both only with ZeRO-1: neuronx-distributed's ``initialize_parallel_optimizer`` keeps no master copy without it)."""
    kind = leaves.get("precision.type", "fp32")
    flags = ("precision.xla_use_bf16", "precision.xla_downcast_bf16", "precision.neuron_rt_stochastic_rounding_en")
    manual_only = ("precision.master_weights", "precision.fp32_grad_acc")
    zero1 = bool(leaves.get("distributed_strategy.zero1", True)) or bool(ours.get("distributed_strategy.fsdp.enabled"))
    if kind == "manual":
        bf16 = any(str(leaves.get(k, "0")) == "1" for k in flags[:2])
        master = bool(leaves.get("precision.master_weights", False))
        if bf16 and master and not zero1:
            notes.append(
                "precision.master_weights=True with distributed_strategy.zero1=False: NxDT keeps no fp32 master "
                "weights without ZeRO-1 (lightning_modules/model/base.py), so the weights train in bf16 here too; "
                "zero1: true keeps them"
            )
            master = False
        ours_type = ("mixed_precision" if master else "bf16") if bf16 else "fp32"
        if str(leaves.get(flags[2], "0")) == "1":
            if not bf16:
                raise ConfigError(
                    flags[2],
                    "1",
                    "stochastic rounding rounds to bf16, and with xla_use_bf16 and "
                    "xla_downcast_bf16 '0' training is fp32, nothing to round; set one of them to '1' "
                    "(bf16SR; with master_weights: true, mixed_precisionSR) or this flag to '0'",
                )
            ours_type += "SR"
            notes.append(f"precision.neuron_rt_stochastic_rounding_en='1' (precision.type {ours_type}): {SR_NOTES[ours_type]}")
        # NxDT accumulates gradients in fp32 only with fp32_grad_acc and ZeRO-1; nxdt in the weights' dtype
        fp32_acc = bool(leaves.get("precision.fp32_grad_acc", False)) and zero1
        if bf16 and fp32_acc != ours_type.startswith("mixed_precision"):
            here, there = ("bf16", "fp32") if fp32_acc else ("fp32", "bf16")
            notes.append(
                f"precision.fp32_grad_acc={fp32_acc}: NxDT accumulates gradients in {there} "
                f"(lightning_modules/model/base.py); nxdt accumulates them in the weights' dtype, {here} for "
                f"precision.type {ours_type}"
            )
        return {"precision.type": ours_type}
    if kind not in PRECISION:
        raise ConfigError("precision.type", kind, f"must be one of {', '.join([*PRECISION, 'manual'])}")
    # flags NxDT reads only for type: manual (the orchestrator sets them from the type otherwise)
    ignored.extend(k for k in (*flags, *manual_only) if k in leaves)
    ours_type = PRECISION[kind]
    if kind == "mixed_precision_SR":  # the orchestrator's spelling; base.py compares with "mixed_precisionSR"
        notes.append(
            "precision.type=mixed_precision_SR: NxDT's orchestrator sets bf16 compute and stochastic rounding for it, "
            "but its model (lightning_modules/model/base.py, which tests 'mixed_precisionSR') then keeps no fp32 "
            f"master weights: bf16 weights with stochastically rounded updates, nxdt's bf16SR; {SR_NOTES['bf16SR']}"
        )
    elif kind in ("mixed_precision", "mixed_precisionSR") and not zero1:
        ours_type = "bf16SR" if kind.endswith("SR") else "bf16"
        notes.append(
            f"precision.type={kind} with distributed_strategy.zero1=False: NxDT keeps fp32 master weights and fp32 "
            "gradients only with ZeRO-1 (lightning_modules/model/base.py: use_master_weights and zero_one_enabled; "
            "every fp32 tensor is bf16 on the device, XLA_DOWNCAST_BF16=1), so nxdt trains bf16 weights "
            f"(precision.type {ours_type}) as NxDT does; zero1: true keeps fp32 master weights"
        )
    elif kind == "autocast" and not zero1 and leaves.get("model_source", "hf") == "hf":
        notes.append(
            "precision.type=autocast with distributed_strategy.zero1=False: NxDT's hf Llama casts the model to bf16 "
            "(lightning_modules/model/hf_models/llama_model.py) and keeps no fp32 master copy without ZeRO-1; nxdt "
            "keeps fp32 weights under autocast (mixed_precision); precision.type=bf16 trains bf16 weights"
        )
    if ours_type in SR_NOTES and kind != "mixed_precision_SR":
        notes.append(f"precision.type={kind}: {SR_NOTES[ours_type]}")
    return {"precision.type": ours_type}


# NxD Training's HF models put the decayed parameters in a group with this rate, whatever model.optim.weight_decay
# says (utils/model_utils.py get_param_groups_by_weight_decay: the group's own "weight_decay" key overrides the
# optimizer's default, which is where optim.weight_decay goes)
HF_WEIGHT_DECAY = 0.01


def _weight_decay(leaves: Mapping[str, Any], notes: list[str]) -> dict[str, Any]:
    """``model.do_layer_norm_weight_decay`` means opposite things by model source. hf (hf_models/base_model.py
    setup_optimizer_param_groups): no decay on names with "bias", plus "norm"/"LayerNorm" when true; the rest at 0.01.
    megatron (megatron_gpt_model.py, NeMo's get_all_params_for_weight_decay_optimization /
    get_params_for_weight_decay_optimization): true decays every parameter, false exempts norms and biases; the rate
    is optim.weight_decay."""
    norms_too = bool(leaves.get("model.do_layer_norm_weight_decay", False))
    if leaves.get("model_source", "hf") == "megatron":
        return {"model.optim.no_weight_decay": "none" if norms_too else "norms_and_biases"}
    given = leaves.get("model.optim.weight_decay")
    if given is not None and given != HF_WEIGHT_DECAY:
        notes.append(
            f"model.optim.weight_decay={given!r}: NxDT's hf models decay at {HF_WEIGHT_DECAY} whatever it says "
            "(utils/model_utils.py), and so does nxdt; model.optim.fixed_weight_decay=null decays at "
            f"{given!r} instead"
        )
    return {
        "model.optim.no_weight_decay": "norms_and_biases" if norms_too else "biases",
        "model.optim.fixed_weight_decay": HF_WEIGHT_DECAY,
    }


def _check_max_steps(leaves: Mapping[str, Any]) -> None:
    """Epochs alone do not end an NxDT run: its schedule is built over trainer.max_steps (lightning_modules/model/
    base.py asserts it is set and hands it to the scheduler as it is; Lightning's -1 would be a negative length)."""
    if "trainer.max_steps" not in leaves and "trainer.max_epochs" not in leaves:
        return
    steps = leaves.get("trainer.max_steps")
    if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1:
        return
    epochs = leaves.get("trainer.max_epochs")
    fix = (
        f"to stop after trainer.max_epochs={epochs}, give a max_steps at least that many epochs long (training stops "
        "at whichever comes first)"
        if isinstance(epochs, int) and epochs > 0
        else "give the number of optimizer steps"
    )
    raise ConfigError(
        "trainer.max_steps",
        steps,
        f"must be a step count >= 1: NxDT's learning-rate schedule spans it (lightning_modules/model/base.py); {fix}",
    )


def _optimizer(leaves: Mapping[str, Any], notes: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = _weight_decay(leaves, notes)
    name = leaves.get("model.optim.name", "adamw")
    if name not in OPTIMIZERS:
        raise ConfigError("model.optim.name", name, f"not supported; nxdt trains with {' or '.join(OPTIMIZERS)}")
    out["model.optim.name"] = OPTIMIZERS[name]
    sched = leaves.get("model.optim.sched.name")
    if sched is not None:
        if sched not in SCHEDULES:
            raise ConfigError("model.optim.sched.name", sched, f"not supported; nxdt has {', '.join(SCHEDULES)}")
        out["model.optim.sched.name"] = SCHEDULES[sched]
    # NxDT sets the schedule's length to trainer.max_steps, whatever sched.max_steps says
    out["model.optim.sched.max_steps"] = "${trainer.max_steps}"
    max_steps = leaves.get("trainer.max_steps")
    if max_steps is not None:
        given = leaves.get("model.optim.sched.max_steps")
        if given is not None and given != max_steps:
            notes.append(f"model.optim.sched.max_steps={given} is replaced by trainer.max_steps={max_steps}, as NxDT does")
        ratio = leaves.get("model.optim.sched.warmup_ratio")
        if ratio is not None:
            out["model.optim.sched.warmup_steps"] = int(ratio * max_steps)
    return out


def _checkpointing(leaves: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    params = "exp_manager.checkpoint_callback_params."
    every = leaves.get(params + "every_n_train_steps")
    top_k = leaves.get(params + "save_top_k")
    if top_k is not None:
        if top_k < 0:
            raise ConfigError(params + "save_top_k", top_k, "keeping every checkpoint is not supported; give how many to keep")
        if top_k > 0:
            out["exp_manager.keep_last_k"] = top_k
    save_last = leaves.get(params + "save_last")
    if save_last is not None:
        out["exp_manager.save_last"] = bool(save_last)
    if leaves.get("exp_manager.create_checkpoint_callback", True) is False or top_k == 0:
        every = None
        out["exp_manager.save_last"] = False  # no checkpoint callback at all: no last checkpoint either
    if every is not None or params + "every_n_train_steps" in leaves or "exp_manager.create_checkpoint_callback" in leaves:
        out["exp_manager.checkpoint_every_n_steps"] = every
    return out


def _data(leaves: Mapping[str, Any], ours: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    seq, enc = leaves.get("data.seq_length"), leaves.get("model.encoder_seq_length")
    aligning = any(k.startswith("model_alignment_strategy.") for k in leaves) or bool(
        leaves.get("data.use_sft_style_data_module")
    )
    if aligning and seq is not None and enc is not None and seq > enc:
        raise ConfigError(
            "data.seq_length",
            seq,
            f"exceeds model.encoder_seq_length={enc}, the model's context; fine-tuning sequences must fit it",
        )
    if not aligning and seq is not None and enc is not None and seq != enc:
        raise ConfigError(
            "data.seq_length",
            seq,
            f"differs from model.encoder_seq_length={enc}; NxDT's HF models train at encoder_seq_length: make them equal",
        )
    if seq is not None or enc is not None:
        out["data.seq_length"] = seq if seq is not None else enc
    sft_style = bool(leaves.get("data.use_sft_style_data_module"))
    if sft_style:  # Megatron SFT: the SFT recipe on instruction records, packing from data.packing
        packing = leaves.get("data.packing", True)
        theirs = leaves.get("model_alignment_strategy.sft.packing")
        if theirs is not None and theirs != packing:
            raise ConfigError(
                "data.packing",
                packing,
                f"contradicts model_alignment_strategy.sft.packing={theirs!r} in the same config; keep one of them",
            )
        out["model_alignment_strategy.sft.packing"] = packing
    if leaves.get("data.train_dir") is not None:
        sft = sft_style or any(k.startswith("model_alignment_strategy.sft.") for k in leaves)
        pairs = any(k.startswith(("model_alignment_strategy.dpo.", "model_alignment_strategy.orpo.")) for k in leaves)
        source = ours.get("data.source", "instructions" if sft else "preferences" if pairs else "hf_dataset")
        out["data.source"] = source
        if source != "synthetic":  # synthetic tokens read no files
            out["data.train_dir"] = leaves["data.train_dir"]
    prefix = leaves.get("data.data_prefix", leaves.get("data.data_prefix.train"))  # a list, or a dict's train entry
    if prefix is not None:  # Megatron indexed data
        out["data.source"] = ours.get("data.source", "megatron")
        out["data.data_prefix"] = prefix
    return out


# ------------------------------------------------------------------------------------------------
# instance


def infer_instance(devices: int | None, lnc: int | None, catalogue: Mapping[str, Mapping[int, int]]) -> str:
    """The Trainium instance whose node runs ``devices`` ranks at ``lnc`` — NxDT configs name no instance.

    ``catalogue``: instance name → {lnc: ranks per node} (the lnc values it accepts, its default under
    key 0). Ambiguity is an error asking for ``instance=<name>``: trn1/trn1n and trn2/trn2u nodes look
    the same to a config, but not to the plan (their networks differ)."""
    if devices is None:
        raise ConfigError(
            "instance",
            "",
            "NxDT configs name no instance and trainer.devices is not set; add instance=<name> "
            "(e.g. instance=trn1.32xlarge, or instance=cpu to run here)",
        )
    fits = sorted(name for name, per_lnc in catalogue.items() if per_lnc.get(lnc if lnc is not None else 0) == devices)
    if len(fits) == 1:
        return fits[0]
    where = f"trainer.devices={devices}" + (f", trainer.lnc={lnc}" if lnc is not None else "")
    if fits:
        raise ConfigError(
            "instance",
            "",
            f"{where} fits {' and '.join(fits)}; NxDT configs name no instance: add "
            f"instance={fits[0]} (or another) to the command",
        )
    raise ConfigError(
        "instance",
        "",
        f"no Trainium node runs {where}; NxDT configs name no instance: add instance=<name> (instance=cpu runs on this host)",
    )


# ------------------------------------------------------------------------------------------------
# the migration guide's table


def mapping_table() -> str:
    """The Markdown table of every NxDT key (docs/migrating-from-nxdt.md includes it verbatim)."""
    rows = ["| NxDT key | in nxdt | notes |", "|---|---|---|"]
    for key, rule in RULES.items():
        if rule.kind == MAP:
            what = f"`{rule.to or key}`"
        elif rule.kind == AGREE and rule.agree:
            shown = " or ".join(f"`{_yaml(v)}`" for v in rule.agree)
            what = f"accepted as {shown}; other values " + ("are an error" if rule.error else "noted")
        else:
            what = {
                CUSTOM: "translated (see notes)",
                AGREE: "error",
                IGNORED: "no effect: named in the one warning",
                DERIVED: "accepted, nothing to do",
            }[rule.kind]
        rows.append(f"| `{key}` | {what} | {rule.doc} |")
    return "\n".join(rows)


def _yaml(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


if __name__ == "__main__":  # regenerate the table in docs/migrating-from-nxdt.md
    print(mapping_table())
