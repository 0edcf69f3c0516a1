"""LoRA checkpoints in one process: merge_lora on a model file's tensors (whole and tensor-parallel shards) against
base + (alpha/r)·B·A computed here, the merged model's logits against the adapter model's, and the peft keys'
refusals before anything starts. The runs through ``nxdt train`` are in test_lora_checkpoint_e2e.py.

Tolerances: the merge is W + s·(B·A) in fp32 — each element of B·A is a sum of r = 4 products, so the fold differs
from the float64 reference by a few fp32 ulps of |W| ≈ 0.02..0.1 (≤ 1e-8); atol 1e-6 leaves two orders of margin.
Logits: x·(W + s·B·A) against x·W + s·(x·A)·B — the same sums in another order through 2 layers of O(1)
activations, fp32 rounding ~1e-6 on logits of size ~1; atol 1e-5, rtol 1e-5 (as the PEFT comparison in test_lora.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nxdt.lightning.lora_checkpoint import merged_state_dict, plain_names
from nxdt.models.llama import LlamaForCausalLM
from nxdt.models.lora import LoRALinear, apply_lora

RANK, ALPHA = 4, 12.0
ALL = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def config() -> SimpleNamespace:
    return SimpleNamespace(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=48,
        max_position_embeddings=64,
        rope_theta=10000.0,
        norm_eps=1e-5,
        tie_word_embeddings=False,
        init_method_std=0.02,
        activations_checkpoint_granularity=None,
    )


def trained_lora() -> LlamaForCausalLM:
    """A LoRA Llama whose B are non-zero (as after training; a fresh B = 0 would make any merge look right)."""
    torch.manual_seed(0)
    model = apply_lora(LlamaForCausalLM(config()), rank=RANK, alpha=ALPHA, target_modules=ALL)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.copy_(0.1 * torch.randn(m.lora_B.weight.shape, generator=g))
    return model.eval()


def test_merged_checkpoint_weights_are_base_plus_scaled_b_a_and_give_the_adapter_models_logits():
    model = trained_lora()
    state = {f"model.{k}": v for k, v in model.state_dict().items()}  # as Lightning names a checkpoint's tensors
    merged = merged_state_dict(state, ALPHA / RANK)
    assert not [n for n in merged if ".lora_" in n]
    assert {n for n in merged} == {n for n in state if ".lora_" not in n}  # the base's names, base_layer kept
    adapted = [name for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert len(adapted) == 2 * 7
    for name in adapted:
        w = state[f"model.{name}.base_layer.weight"].double()
        a, b = state[f"model.{name}.lora_A.weight"].double(), state[f"model.{name}.lora_B.weight"].double()
        want = w + (ALPHA / RANK) * torch.einsum("or,ri->oi", b, a)
        torch.testing.assert_close(merged[f"model.{name}.base_layer.weight"].double(), want, rtol=0, atol=1e-6)
    for name, tensor in state.items():  # every weight not adapted is carried over bit for bit
        if ".base_layer." not in name and ".lora_" not in name:
            assert torch.equal(merged[name], tensor), name
    torch.manual_seed(5)
    plain = LlamaForCausalLM(config()).eval()
    plain.load_state_dict({n[len("model.") :]: t for n, t in plain_names(merged).items()})
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids), model(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["column", "row"])
def test_merging_tensor_parallel_shards_equals_sharding_the_merged_weight(mode):
    """A column-parallel base holds rows of W and B (A whole); a row-parallel one columns of W and A (B whole):
    each TP rank's merge of its own shards is its shard of the merged weight, so a TP checkpoint merges shard-wise."""
    g = torch.Generator().manual_seed(7)
    w, a, b = torch.randn(8, 6, generator=g), torch.randn(RANK, 6, generator=g), torch.randn(8, RANK, generator=g)
    full = merged_state_dict({"p.base_layer.weight": w, "p.lora_A.weight": a, "p.lora_B.weight": b}, 2.0)["p.base_layer.weight"]
    dim = 0 if mode == "column" else 1
    shards = []
    for rank in range(2):
        w_r = w.chunk(2, dim)[rank]
        a_r = a if mode == "column" else a.chunk(2, 1)[rank]
        b_r = b.chunk(2, 0)[rank] if mode == "column" else b
        shards.append(
            merged_state_dict({"p.base_layer.weight": w_r, "p.lora_A.weight": a_r, "p.lora_B.weight": b_r}, 2.0)[
                "p.base_layer.weight"
            ]
        )
    torch.testing.assert_close(torch.cat(shards, dim), full, rtol=0, atol=1e-6)


def test_a_base_that_does_not_match_the_adapters_is_refused():
    state = {
        "p.base_layer.weight": torch.zeros(8, 6),
        "p.lora_A.weight": torch.zeros(RANK, 5),
        "p.lora_B.weight": torch.zeros(8, RANK),
    }
    with pytest.raises(ValueError, match=r"p.base_layer.weight has shape \[8, 6\] but its adapters' B·A has \[8, 5\]"):
        merged_state_dict(state, 1.0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model_alignment_strategy.peft.merge_lora=true"],
            "model_alignment_strategy.peft.merge_lora=True: folds the adapters into the saved base weights: set save_lora_base=true",
        ),
        (
            [
                "model_alignment_strategy.peft.merge_lora=true",
                "model_alignment_strategy.peft.save_lora_base=true",
                "exp_manager.resume_if_exists=true",
            ],
            "model_alignment_strategy.peft.merge_lora=True: checkpoints hold the adapters merged into the base, which cannot resume",
        ),
        (
            [
                "model_alignment_strategy.peft.merge_lora=true",
                "model_alignment_strategy.peft.save_lora_base=true",
                "model_alignment_strategy.peft.merge_sharded_lora=true",
            ],
            "model_alignment_strategy.peft.merge_sharded_lora=True: ",
        ),
        (
            ["model_alignment_strategy.peft.load_lora_from_ckpt=true"],
            "model_alignment_strategy.peft.load_lora_from_ckpt=True: loads the adapters of exp_manager.resume_from_checkpoint",
        ),
    ],
)
def test_merge_and_load_keys_that_do_not_fit_together_are_refused_by_name(overrides, message):
    from nxdt.config import ConfigError, compose_config
    from nxdt.config.validate import check_trainable

    with pytest.raises(ConfigError) as info:
        check_trainable(compose_config(["+recipe=lora", *overrides]))
    assert message in str(info.value)


def test_apply_peft_refuses_merge_without_the_base_saved():
    from nxdt.models.lora import apply_peft

    with pytest.raises(
        ValueError, match="merge_lora=True folds the adapters into the saved base weights: it needs save_lora_base"
    ):
        apply_peft(LlamaForCausalLM(config()), {"lora_rank": 2, "merge_lora": True, "save_lora_base": False})
