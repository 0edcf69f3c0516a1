"""NxD Training's 22 example configs as test cases, written here as facts rather than stored as copies.

Each case names the upstream file it stands for (aws-neuron/neuronx-distributed-training, release 2.26.0,
``examples/conf/<name>.yaml``; compare key by key there) and says what makes it an interesting case. Its content
is a base (one of this project's NxDT-format examples, ``nxdt/NAME`` for ``conf/nxdt/NAME.yaml``, or another case)
plus the keys the upstream file sets otherwise (``changes``) and the keys it does not have (``removed``), all in
NxDT's dotted key names. Together these reproduce every key and value of the upstream file, comments aside; the Hugging Face
``model.model_config`` stays ``/home/ubuntu/config.json`` as upstream, and the tests point it at the public
config.json kept in ``conf/nxdt/`` (``hf_config``). ``write_cases`` writes each case as an NxDT YAML file, so the
tests read it through ``--config-path``/``--config-name`` as a user's file would be read.

The Megatron configs have no base in ``conf/nxdt/``: ``megatron_llama_7B_config`` is written out in full below
and the other Megatron cases start from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

EXAMPLES = Path(__file__).resolve().parents[1] / "conf" / "nxdt"


@dataclass(frozen=True)
class Case:
    name: str  # the upstream file's stem
    why: str  # what this case exercises
    base: str | None  # nxdt/NAME: the example conf/nxdt/NAME.yaml; NAME: another case
    changes: dict[str, Any] = field(default_factory=dict)
    removed: tuple[str, ...] = ()
    instance: str = "trn1.32xlarge"  # the instance its authors run it on
    hf_config: str | None = None  # conf/nxdt/<hf_config>_config.json: the public config.json the file's path names


def _flatten(node: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _example(name: str) -> dict[str, Any]:
    """conf/nxdt/NAME.yaml with interpolations as written and its Hydra defaults merged under it (the examples list
    other examples only, then ``_self_``: Hydra's order, so the file's own keys win)."""
    cfg = OmegaConf.load(EXAMPLES / f"{name}.yaml")
    defaults = cfg.pop("defaults", [])
    assert all(isinstance(d, str) for d in defaults) and list(defaults)[-1:] in ([], ["_self_"]), defaults
    keys: dict[str, Any] = {}
    for base in defaults[:-1]:
        keys.update(_example(base))
    raw = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(raw, dict)
    keys.update(_flatten(raw))
    return keys


def keys_of(name: str) -> dict[str, Any]:
    """Every (dotted key, value) of the upstream file ``name``."""
    case = CASE[name]
    if case.base is None:
        keys: dict[str, Any] = {}
    elif case.base.startswith("nxdt/"):
        keys = _example(case.base.removeprefix("nxdt/"))
    else:
        keys = keys_of(case.base)
    keys.update(case.changes)
    for key in case.removed:
        del keys[key]
    return keys


def write_cases(directory: Path) -> Path:
    """Each case as ``directory/<name>.yaml``, an NxDT config file."""
    for name in CASE:
        nested: dict[str, Any] = {}
        for key, value in keys_of(name).items():
            *parents, leaf = key.split(".")
            node = nested
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(nested, sort_keys=False))
    return directory


# megatron_llama_7B_config, every key: the base of the other Megatron cases
MEGATRON_LLAMA_7B = {
    "name": "megatron_llama",
    "model_source": "megatron",
    "seed": 1234,
    "trainer.check_val_every_n_epoch": None,
    "trainer.devices": 32,
    "trainer.gradient_clip_val": 1.0,
    "trainer.limit_test_batches": 1,
    "trainer.limit_val_batches": 1,
    "trainer.log_every_n_steps": 1,
    "trainer.max_epochs": -1,
    "trainer.max_steps": 20000,
    "trainer.num_nodes": 1,
    "trainer.num_sanity_val_steps": 0,
    "trainer.val_check_interval": 20000,
    "distributed_strategy.pipeline_model_parallel_size": 1,
    "distributed_strategy.sequence_parallel": True,
    "distributed_strategy.tensor_model_parallel_size": 8,
    "distributed_strategy.virtual_pipeline_model_parallel_size": 1,
    "distributed_strategy.zero1": True,
    "model.activation": "swiglu",
    "model.activations_checkpoint_granularity": "selective",
    "model.activations_checkpoint_recompute": ["CoreAttention"],
    "model.apply_query_key_layer_scaling": True,
    "model.attention_dropout": 0,
    "model.do_layer_norm_weight_decay": False,
    "model.encoder_seq_length": 4096,
    "model.ffn_dropout": 0,
    "model.ffn_hidden_size": 11008,
    "model.fusions.flash_attention": False,
    "model.fusions.softmax": True,
    "model.has_bias": False,
    "model.hidden_dropout": 0,
    "model.hidden_size": 4096,
    "model.init_method_std": 0.021,
    "model.kv_channels": None,
    "model.layernorm_epsilon": 1e-05,
    "model.make_vocab_size_divisible_by": 8,
    "model.max_position_embeddings": "${.encoder_seq_length}",
    "model.normalization": "rmsnorm",
    "model.num_attention_heads": 32,
    "model.num_kv_heads": 32,
    "model.num_layers": 32,
    "model.persist_layer_norm": True,
    "model.position_embedding_type": "rope",
    "model.rotary_percentage": 1,
    "model.share_embeddings_and_output_weights": False,
    "model.transformer_block_type": "pre_ln",
    "model.use_cpu_initialization": True,
    "model.use_scaled_init_method": True,
    "model.optim.betas": [0.9, 0.95],
    "model.optim.capturable": True,
    "model.optim.lr": 0.0003,
    "model.optim.name": "adamw",
    "model.optim.sched.constant_steps": 0,
    "model.optim.sched.min_lr": 3e-05,
    "model.optim.sched.name": "CosineAnnealing",
    "model.optim.sched.warmup_steps": 2000,
    "model.optim.weight_decay": 0.1,
    "data.data_impl": "mmap",
    "data.data_prefix": [1.0, "/home/ubuntu/examples_datasets/llama/book.jsonl-processed_text_document"],
    "data.dataloader_type": "single",
    "data.eod_mask_loss": False,
    "data.global_batch_size": 1024,
    "data.index_mapping_dir": None,
    "data.micro_batch_size": 1,
    "data.no_seqlen_plus_one_input_tokens": False,
    "data.num_workers": 1,
    "data.pad_samples_to_global_batch_size": False,
    "data.reset_attention_mask": False,
    "data.reset_position_ids": False,
    "data.seq_length": "${model.encoder_seq_length}",
    "data.skip_warmup": True,
    "data.splits_string": "980,10,10",
    "data.tokenizer.delimiter": None,
    "data.tokenizer.library": "huggingface",
    "data.tokenizer.merge_file": None,
    "data.tokenizer.model": None,
    "data.tokenizer.sentencepiece_legacy": False,
    "data.tokenizer.type": "/home/ubuntu/llama_tokenizer",
    "data.tokenizer.use_fast": False,
    "data.tokenizer.vocab_file": None,
    "data.validation_drop_last": True,
    "precision.fp32_grad_acc": False,
    "precision.master_weights": False,
    "precision.neuron_rt_stochastic_rounding_en": "0",
    "precision.type": "mixed_precision",
    "precision.xla_downcast_bf16": "0",
    "precision.xla_use_bf16": "0",
    "exp_manager.async_checkpointing": False,
    "exp_manager.checkpoint_callback_params.every_n_train_steps": 200,
    "exp_manager.checkpoint_callback_params.filename": "megatron_llama--{step}-{consumed_samples}",
    "exp_manager.checkpoint_callback_params.mode": "max",
    "exp_manager.checkpoint_callback_params.model_parallel_size": "${multiply:${distributed_strategy.tensor_model_parallel_size}, ${distributed_strategy.pipeline_model_parallel_size}}",
    "exp_manager.checkpoint_callback_params.monitor": "step",
    "exp_manager.checkpoint_callback_params.save_last": False,
    "exp_manager.checkpoint_callback_params.save_top_k": 1,
    "exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt": False,
    "exp_manager.create_checkpoint_callback": True,
    "exp_manager.create_tensorboard_logger": True,
    "exp_manager.enable_recovery_time_instrumentation": False,
    "exp_manager.exp_dir": None,
    "exp_manager.explicit_log_dir": None,
    "exp_manager.load_xser": True,
    "exp_manager.log_gradient_norm": True,
    "exp_manager.log_local_rank_0_only": True,
    "exp_manager.log_parameter_norm": True,
    "exp_manager.name": "megatron_llama",
    "exp_manager.resume_from_checkpoint": None,
    "exp_manager.resume_if_exists": True,
    "exp_manager.resume_ignore_no_checkpoint": True,
    "exp_manager.save_bf16": False,
    "exp_manager.save_xser": True,
    "aync_exec_max_inflight_requests": 5,
    "bucket_size_collectives": 1024,
    "compiler_cache_url": "/home/ubuntu/neuron_cache",
    "compiler_flags": "--model-type transformer --distribution-strategy=llm-training",
    "neuron_experimental_compress_rg": False,
    "neuron_rt_exec_timeout": 100,
}


CASES = (
    Case(
        "hf_llama3.1_405B_trn1_config",
        "the largest layout: TP32 × PP32 × DP2 over 64 nodes, full recompute, a 128k-position model",
        hf_config="llama3.1_405B",
        base="nxdt/hf_llama3.1_405B_trn1_config",
        changes={
            "model.activations_checkpoint_recompute": None,
            "model.model_config": "/home/ubuntu/config.json",
        },
        removed=("distributed_strategy.context_parallel_size", "model.activations_checkpoint_recompute_mlp", "model.fuse_qkv"),
    ),
    Case(
        "hf_llama3.1_70B_config",
        "TP32 × PP8 × DP4 on 32 nodes; weight_decay 0.1, which NxDT's hf models replace by 0.01",
        hf_config="llama3.1_70B",
        base="nxdt/hf_llama3_70B_CP_config",
        changes={
            "trainer.num_nodes": 32,
            "model.fusions.flash_attention": True,
            "model.max_position_embeddings": 131072,
            "model.model_config": "/home/ubuntu/config.json",
            "precision.xla_downcast_bf16": "1",
            "exp_manager.checkpoint_callback_params.every_n_train_steps": 30000,
            "exp_manager.checkpoint_callback_params.filename": "hf_llama3.1_70B--{step}-{consumed_samples}",
            "aync_exec_max_inflight_requests": 7,
        },
        removed=("distributed_strategy.context_parallel_size", "model.fuse_qkv", "model.fusions.ring_attention"),
    ),
    Case(
        "hf_llama3.1_8B_config",
        "an 8B model at TP32 × DP32 on 32 nodes, 128k positions trained on 8k-token sequences",
        hf_config="llama3.1_8B",
        base="nxdt/hf_llama3_70B_CP_config",
        changes={
            "trainer.num_nodes": 32,
            "distributed_strategy.pipeline_model_parallel_size": 1,
            "model.fusions.flash_attention": True,
            "model.hidden_size": 4096,
            "model.max_position_embeddings": 131072,
            "model.model_config": "/home/ubuntu/config.json",
            "model.num_layers": 32,
            "precision.xla_downcast_bf16": "1",
            "exp_manager.checkpoint_callback_params.every_n_train_steps": 30000,
            "exp_manager.checkpoint_callback_params.filename": "hf_llama3.1_8B--{step}-{consumed_samples}",
            "aync_exec_max_inflight_requests": 3,
        },
        removed=("distributed_strategy.context_parallel_size", "model.fuse_qkv", "model.fusions.ring_attention"),
    ),
    Case(
        "hf_llama3_70B_CP_config",
        "context parallelism: TP32 × CP2 × PP8, ring attention",
        hf_config="llama3_70B",
        base="nxdt/hf_llama3_70B_CP_config",
        changes={
            "model.model_config": "/home/ubuntu/config.json",
        },
    ),
    Case(
        "hf_llama3_70B_config",
        "TP32 × PP8 × DP2 on 16 nodes with flash attention",
        hf_config="llama3_70B",
        base="nxdt/hf_llama3_70B_CP_config",
        changes={
            "distributed_strategy.context_parallel_size": 1,
            "model.fusions.flash_attention": True,
            "model.model_config": "/home/ubuntu/config.json",
        },
        removed=("model.fusions.ring_attention",),
    ),
    Case(
        "hf_llama3_70B_trn2_config",
        "trn2 with LNC 2, explicit pipeline_cuts, a bf16 reduce dtype for the parallel layers",
        instance="trn2.48xlarge",
        hf_config="llama3_70B",
        base="nxdt/hf_llama3_70B_trn2_config",
        changes={
            "model.activations_checkpoint_recompute": ["LlamaRMSNorm", "ActivationMultiplyMLP"],
            "model.model_config": "/home/ubuntu/config.json",
            "model.pipeline_cuts": ["model.layers.18", "model.layers.39", "model.layers.60"],
            "precision.parallel_layers_reduce_dtype": "bf16",
            "compiler_cache_url": "/workspace/neuron_cache",
            "compiler_flags": "--model-type transformer",
        },
        removed=("distributed_strategy.context_parallel_size", "model.fusions.softmax"),
    ),
    Case(
        "hf_llama3_8B_DPO_config",
        "DPO from a pretrained checkpoint (weight_init_only), JSONL preference records, a tokenizer directory",
        hf_config="llama3_8B",
        base="nxdt/hf_llama3_8B_DPO_config",
        changes={
            "model.model_config": "/home/ubuntu/config.json",
        },
        removed=("distributed_strategy.context_parallel_size",),
    ),
    Case(
        "hf_llama3_8B_ORPO_config",
        "ORPO: no reference model, 4k tokens",
        hf_config="llama3_8B",
        base="nxdt/hf_llama3_8B_ORPO_config",
        changes={
            "model.model_config": "/home/ubuntu/config.json",
        },
        removed=("distributed_strategy.context_parallel_size",),
    ),
    Case(
        "hf_llama3_8B_SFT_config",
        "SFT with packing, a validation file and dev_choose_samples",
        hf_config="llama3_8B",
        base="nxdt/hf_llama3_8B_SFT_config",
        changes={
            "model.model_config": "/home/ubuntu/config.json",
        },
        removed=("distributed_strategy.context_parallel_size",),
    ),
    Case(
        "hf_llama3_8B_SFT_lora_config",
        "LoRA on qkv_proj: autocast precision, ZeRO-1 off",
        hf_config="llama3_8B",
        base="nxdt/hf_llama3_8B_SFT_lora_config",
        changes={
            "model.model_config": "/home/ubuntu/config.json",
        },
        removed=(
            "distributed_strategy.context_parallel_size",
            "model.transpose_nki_inputs",
            "exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt",
        ),
    ),
    Case(
        "hf_llama3_8B_config",
        "the plain pretraining layout: TP32 × DP4, kv_replicator 4",
        hf_config="llama3_8B",
        base="nxdt/hf_llama3_8B_config",
        changes={
            "model.model_config": "/home/ubuntu/config.json",
        },
    ),
    Case(
        "hf_llama3_8B_trn2_config",
        "one trn2 node, LNC 2, TP16 × DP4, no recompute",
        instance="trn2.48xlarge",
        hf_config="llama3_8B",
        base="nxdt/hf_llama3_8B_trn2_config",
        changes={
            "model.model_config": "/home/ubuntu/config.json",
            "compiler_cache_url": "/workspace/neuron_cache",
        },
        removed=("distributed_strategy.context_parallel_size", "model.activations_checkpoint_recompute"),
    ),
    Case(
        "hf_llama_7B_config",
        "Llama 2 7B cut to 4 layers by the config, TP8, no qkv_linear, no rope_theta key",
        hf_config="llama2_7B",
        base="nxdt/hf_llama3_8B_config",
        changes={
            "trainer.log_every_n_steps": 1,
            "trainer.num_nodes": 1,
            "distributed_strategy.kv_replicator": 1,
            "distributed_strategy.tensor_model_parallel_size": 8,
            "model.encoder_seq_length": 4096,
            "model.fusions.flash_attention": False,
            "model.max_position_embeddings": "${.encoder_seq_length}",
            "model.model_config": "/home/ubuntu/config.json",
            "model.num_layers": 4,
            "model.qkv_linear": False,
            "model.optim.lr": 0.0003,
            "data.train_dir": "/home/ubuntu/examples_datasets/wikicorpus_llama2_7B_tokenized_4k",
            "exp_manager.checkpoint_callback_params.filename": "hf_llama--{step}-{consumed_samples}",
        },
        removed=("distributed_strategy.context_parallel_size", "model.fuse_qkv", "model.rope_theta"),
    ),
    Case(
        "hf_mixtral_8x7b_config",
        "Mixtral at TP32 with capacity factor 2 (tokens dropped): 8 KV heads below TP without kv_replicator",
        hf_config="mixtral_8x7B",
        base="nxdt/hf_mixtral_8x7b_ep_config",
        changes={
            "trainer.num_nodes": 8,
            "distributed_strategy.expert_model_parallel_size": 1,
            "distributed_strategy.tensor_model_parallel_size": 32,
            "model.activations_checkpoint_recompute": None,
            "model.model_config": "/home/ubuntu/config.json",
            "model.moe.capacity_factor": 2.0,
            "model.moe.dropless": False,
            "data.global_batch_size": 128,
            "exp_manager.checkpoint_callback_params.every_n_train_steps": 200000,
            "exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt": False,
            "compiler_cache_url": "/home/ubuntu/neuron_cache",
        },
    ),
    Case(
        "hf_mixtral_8x7b_dropless_config",
        "the same at TP32, dropless",
        hf_config="mixtral_8x7B",
        base="nxdt/hf_mixtral_8x7b_ep_config",
        changes={
            "name": "hf_mixtral_dropless",
            "trainer.num_nodes": 8,
            "distributed_strategy.expert_model_parallel_size": 1,
            "distributed_strategy.tensor_model_parallel_size": 32,
            "model.activations_checkpoint_recompute": None,
            "model.model_config": "/home/ubuntu/config.json",
            "data.global_batch_size": 128,
            "exp_manager.checkpoint_callback_params.every_n_train_steps": 200000,
            "exp_manager.name": "hf_mixtral_dropless",
        },
    ),
    Case(
        "megatron_gpt_config",
        "a Megatron GPT: layernorm, gelu, biases, learned positions, tied embeddings, dropout, GPT2BPETokenizer",
        base="megatron_llama_7B_config",
        changes={
            "name": "megatron_gpt",
            "model.activation": "gelu",
            "model.attention_dropout": 0.1,
            "model.encoder_seq_length": 2048,
            "model.ffn_dropout": 0.1,
            "model.ffn_hidden_size": 16384,
            "model.has_bias": True,
            "model.hidden_dropout": 0.1,
            "model.normalization": "layernorm",
            "model.persist_layer_norm": False,
            "model.position_embedding_type": "learned_absolute",
            "model.share_embeddings_and_output_weights": True,
            "model.optim.lr": 0.00015,
            "model.optim.name": "adamw_fp32OptState",
            "model.optim.sched.constant_steps": 80000,
            "model.optim.sched.min_lr": 1e-05,
            "model.optim.sched.warmup_steps": 750,
            "model.optim.weight_decay": 0.01,
            "data.data_prefix": [1.0, "/home/ubuntu/examples_datasets/gpt2/my-gpt2_text_document"],
            "data.tokenizer.library": "megatron",
            "data.tokenizer.merge_file": "/home/ubuntu/examples_datasets/gpt2/gpt2-merges.txt",
            "data.tokenizer.type": "GPT2BPETokenizer",
            "data.tokenizer.vocab_file": "/home/ubuntu/examples_datasets/gpt2/gpt2-vocab.json",
            "exp_manager.checkpoint_callback_params.filename": "megatron_gpt--{step}-{consumed_samples}",
            "exp_manager.name": "megatron_gpt",
            "compiler_flags": "--model-type transformer",
        },
        removed=("model.kv_channels",),
    ),
    Case(
        "megatron_llama2_7B_SFT_config",
        "Megatron Llama on SFT records (use_sft_style_data_module, packing), $HOME in its paths",
        base="megatron_llama_7B_config",
        changes={
            "trainer.max_steps": 5000,
            "trainer.val_check_interval": 500,
            "model.weight_init_only": True,
            "model.optim.sched.warmup_steps": 10,
            "data.dev_choose_samples": 10000,
            "data.global_batch_size": 64,
            "data.packing": True,
            "data.train_dir": "$HOME/training.jsonl",
            "data.use_sft_style_data_module": True,
            "data.val_dir": "$HOME/validation.jsonl",
            "exp_manager.resume_from_checkpoint": "$HOME/tmp/",
            "compiler_flags": "--model-type transformer",
        },
        removed=("data.data_prefix", "data.splits_string"),
    ),
    Case(
        "megatron_llama_70b_config",
        "Megatron Llama 70B: GQA 64 heads over 8, PP16 on 8 nodes, full recompute",
        base="megatron_llama_7B_config",
        changes={
            "trainer.num_nodes": 8,
            "distributed_strategy.pipeline_model_parallel_size": 16,
            "model.activations_checkpoint_granularity": "full",
            "model.activations_checkpoint_recompute": None,
            "model.ffn_hidden_size": 28672,
            "model.hidden_size": 8192,
            "model.init_method_std": 0.02,
            "model.num_attention_heads": 64,
            "model.num_kv_heads": 8,
            "model.num_layers": 80,
            "data.global_batch_size": 512,
            "compiler_flags": "--model-type transformer",
        },
    ),
    Case(
        "megatron_llama_7B_config",
        "Megatron Llama 7B on one node, TP8, indexed data by data_prefix, a tokenizer directory for its vocabulary",
        base=None,
        changes=MEGATRON_LLAMA_7B,
    ),
    Case(
        "megatron_mistral_config",
        "Mistral as a Megatron model: GQA 8 KV heads, sliding_window_size equal to the sequence",
        base="megatron_llama_7B_config",
        changes={
            "name": "megatron_mistral",
            "model.ffn_hidden_size": 14336,
            "model.init_method_std": 0.02,
            "model.num_kv_heads": 8,
            "model.sliding_window_size": 4096,
            "exp_manager.checkpoint_callback_params.filename": "megatron_mistral--{step}-{consumed_samples}",
            "exp_manager.name": "megatron_mistral",
            "compiler_flags": "--model-type transformer",
        },
    ),
    Case(
        "megatron_mixtral_8x7b_config",
        "Megatron Mixtral: a sigmoid router, capacity factor 2, sinkhorn keys, token_shuffle_group_size",
        base="megatron_llama_7B_config",
        changes={
            "name": "megatron_mixtral",
            "trainer.max_steps": 22500,
            "trainer.num_nodes": 16,
            "trainer.val_check_interval": 22500,
            "distributed_strategy.expert_model_parallel_size": 1,
            "distributed_strategy.pipeline_model_parallel_size": 4,
            "distributed_strategy.tensor_model_parallel_size": 32,
            "distributed_strategy.token_shuffle_group_size": 1,
            "model.activations_checkpoint_granularity": "full",
            "model.activations_checkpoint_recompute": None,
            "model.ffn_hidden_size": 14336,
            "model.moe.capacity_factor": 2.0,
            "model.moe.dropless": False,
            "model.moe.dropout": 0.0,
            "model.moe.frequency": 1,
            "model.moe.normalize_top_k_affinities": True,
            "model.moe.num_experts": 8,
            "model.moe.output_router_logits": True,
            "model.moe.router_activation": "sigmoid",
            "model.moe.router_aux_loss_coef": 0.02,
            "model.moe.routing_algorithm": "top_k",
            "model.moe.sinkhorn_iterations": 30,
            "model.moe.sinkhorn_tol": "None",
            "model.moe.top_k": 2,
            "model.optim.sched.warmup_steps": 4000,
            "data.global_batch_size": 128,
            "data.skip_warmup": False,
            "data.tokenizer.library": "megatron",
            "precision.fp32_grad_acc": True,
            "precision.fp32_grads_cc": False,
            "precision.master_weights": True,
            "precision.xla_downcast_bf16": "1",
            "exp_manager.checkpoint_callback_params.every_n_train_steps": 200000,
            "exp_manager.checkpoint_callback_params.filename": "megatron_mixtral--{step}-{consumed_samples}",
            "exp_manager.name": "megatron_mixtral",
            "aync_exec_max_inflight_requests": 7,
            "compiler_flags": "--model-type transformer --enable-saturate-infinity",
        },
        removed=("exp_manager.save_bf16",),
    ),
    Case(
        "megatron_mixtral_8x7b_dropless_config",
        "the same, dropless",
        base="megatron_mixtral_8x7b_config",
        changes={
            "name": "megatron_mixtral_dropless",
            "model.moe.capacity_factor": 0.0,
            "model.moe.dropless": True,
            "exp_manager.name": "megatron_mixtral_dropless",
            "compiler_cache_url": "neuron_cache",
        },
        removed=("exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt",),
    ),
)
CASE = {case.name: case for case in CASES}
