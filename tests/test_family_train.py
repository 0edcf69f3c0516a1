"""`nxdt train model.hf_checkpoint=DIR` alone trains each family added after Llama/Mixtral/GPT (Qwen2 with its tied
head, Qwen3 with q/k norms and head_dim ≠ hidden/heads, Mistral with a sliding window as long as the sequence,
Qwen3-MoE with its experts renamed and un-renormalised top-k weights, under TP's token region): one
sweep command, one job per family, each at TP2 with sequence parallelism (2 ranks), and the run config holds the
family's hub class and config.json's fields. Numbers equal to transformers' are checked in-process
(tests/parallel/test_family_parity.py); this is the launcher's path: compose from config.json, the pre-launch tensor
check in the family's names, the workers' loading, the 'head_norm' gradients in the real runtime."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from test_train_e2e import assert_ok, losses, nxdt

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
FAMILIES = {
    "qwen2": lambda: transformers.Qwen2Config(
        **SHAPE, intermediate_size=96, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True
    ),
    "qwen3": lambda: transformers.Qwen3Config(
        **SHAPE, intermediate_size=96, num_key_value_heads=2, head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6
    ),
    "mistral": lambda: transformers.MistralConfig(
        **SHAPE, intermediate_size=96, num_key_value_heads=2, sliding_window=128, rope_theta=1e6, rms_norm_eps=1e-5
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SHAPE,
        moe_intermediate_size=48,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
    ),
}
CLASSES = {
    "qwen2": "llama.Qwen2ForCausalLM",
    "qwen3": "llama.Qwen3ForCausalLM",
    "mistral": "llama.MistralForCausalLM",
    "qwen3_moe": "qwen3_moe.Qwen3MoeForCausalLM",
}


@pytest.mark.timeout(400)
def test_hf_checkpoint_alone_trains_every_family_at_tp2_sp(tmp_path):
    for family, make in FAMILIES.items():
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(make()).save_pretrained(tmp_path / family)
    result = nxdt(
        "train",
        "-m",
        "model.hf_checkpoint=" + ",".join(str(tmp_path / f) for f in FAMILIES),  # no model group, no model keys
        "data=synthetic",
        "trainer.devices=2",
        "distributed_strategy.tensor_model_parallel_size=2",
        "distributed_strategy.sequence_parallel=true",
        "trainer.max_steps=3",
        "trainer.log_every_n_steps=1",
        "model.optim.lr=1e-2",
        "exp_manager.create_tensorboard_logger=false",
        "exp_manager.exp_dir=out",
        cwd=tmp_path,
        timeout=390,
    )
    assert_ok(result)
    (sweep,) = (tmp_path / "out" / "multirun").glob("*/*")
    for n, family in enumerate(FAMILIES):
        run = sweep / str(n)
        model = yaml.safe_load((run / "config.yaml").read_text())["model"]
        assert model["architecture"] == f"nxdt.models.{CLASSES[family]}"
        assert (model["rope_theta"], model["hidden_size"]) == (1e6, 64)
        loss = losses(run)
        assert sorted(loss) == [1, 2, 3] and all(math.isfinite(v) for v in loss.values()), (family, loss)
        assert loss[1] == pytest.approx(math.log(256), abs=0.5), (family, loss)  # a fresh model of 256 tokens
    qwen3 = yaml.safe_load((sweep / "1" / "config.yaml").read_text())["model"]
    assert qwen3["head_dim"] == 32
    mistral = yaml.safe_load((sweep / "2" / "config.yaml").read_text())["model"]
    assert mistral["sliding_window"] == 128
    moe = yaml.safe_load((sweep / "3" / "config.yaml").read_text())["model"]
    assert (moe["ffn_hidden_size"], moe["moe"]["num_experts"], moe["moe"]["normalize_top_k_affinities"]) == (48, 4, False)
