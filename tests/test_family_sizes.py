"""The real sizes of the families added after Llama (conf/model/qwen2_5_7b.yaml, qwen3_8b.yaml, mistral_7b.yaml,
qwen3_30b_a3b.yaml) are planned: ``plan`` prices them on a trn1.32xlarge, and the parameter count behind its memory
model is the published one within 1 % (the model cards: Qwen2.5-7B 7.61 B, Qwen3-8B 8.2 B, Mistral-7B-v0.3 7.25 B,
Qwen3-30B-A3B 30.5 B) and the hub model's own count
(built on the meta device: no memory) within 0.01 % — the planner leaves out Qwen2's q/k/v biases and Qwen3's q/k
norms, O(hidden) tensors per layer."""

from __future__ import annotations

import importlib

import pytest
import torch

from nxdt.config import compose_config
from nxdt.planner import plan
from nxdt.planner.estimate import bytes_per_parameter, model_numbers

PUBLISHED = {"qwen2_5_7b": 7.61e9, "qwen3_8b": 8.2e9, "mistral_7b": 7.25e9, "qwen3_30b_a3b": 30.5e9}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_planner_prices_the_real_size_with_its_published_parameter_count(name):
    cfg = compose_config(
        [f"model={name}", "instance=trn1.32xlarge", "distributed_strategy.tensor_model_parallel_size=4", "data=synthetic"]
    )
    p = plan(cfg)
    assert p.degrees["tp"] == 4 and p.estimate["step_time_s"] > 0 and 0 < p.estimate["mfu"] < 1
    # parameters per rank × TP / bytes per parameter: the planner's whole-model count
    count = p.estimate["memory_per_rank_bytes"]["parameters"] * 4 / bytes_per_parameter(cfg)["params"]
    assert count == pytest.approx(PUBLISHED[name], rel=0.01)
    # the hub's own count at 2 of the layers (every layer is alike; building Qwen3-30B-A3B's 48 × 128 experts, even on
    # the meta device, takes a minute): the planner's count of the same config
    cfg.model.num_layers = 2
    module, _, cls = cfg.model.architecture.rpartition(".")
    with torch.device("meta"):
        hub = getattr(importlib.import_module(module), cls)(cfg.model)
    assert model_numbers(cfg.model)["total"] == pytest.approx(hub.num_parameters(), rel=1e-4)


def test_qwen3_30b_a3b_is_what_its_config_json_says(tmp_path):
    """conf/model/qwen3_30b_a3b.yaml against the fields of Qwen/Qwen3-30B-A3B's config.json (the Hugging Face hub file,
    computation fields as published), read by ``model.model_config`` through the qwen3_moe spec."""
    import json

    from nxdt.config.hf_model import model_meta

    published = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }
    (tmp_path / "config.json").write_text(json.dumps(published))
    read = model_meta(compose_config([f"model.model_config={tmp_path / 'config.json'}", "data=synthetic"]).model)
    shipped = model_meta(compose_config(["model=qwen3_30b_a3b", "data=synthetic"]).model)
    # transformers adds the load-balancing loss only with output_router_logits (false by default, as here): read from
    # the file, its weight is 0; the shipped group keeps the file's 0.001 for training from scratch
    assert read.pop("moe.router_aux_loss_coef") == 0.0 and shipped.pop("moe.router_aux_loss_coef") == 0.001
    assert read == shipped
    (tmp_path / "config.json").write_text(json.dumps({**published, "output_router_logits": True}))
    on = compose_config([f"model.model_config={tmp_path / 'config.json'}", "data=synthetic"]).model
    assert on.moe.router_aux_loss_coef == 0.001
    assert (read["ffn_hidden_size"], read["moe.num_experts"], read["moe.top_k"]) == (768, 128, 8)
