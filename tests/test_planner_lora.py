"""The planner's memory model of a LoRA run: the base model is frozen, so only the adapters have gradients, optimizer
state and data-parallel gradient traffic (before: a LoRA plan equalled the full fine-tuning plan)."""

from __future__ import annotations

import pytest
from nxdt.config import compose_config
from nxdt.lightning.module import import_architecture
from nxdt.models.lora import NXDT_TARGETS, apply_peft
from nxdt.planner import plan
from nxdt.planner.estimate import LORA_TARGETS, bytes_per_parameter, lora_trainable_per_rank, memory_per_rank

LLAMA = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=96",
]


def lora_cfg(*more: str):
    return compose_config(["+recipe=lora", *LLAMA, *more])


def test_the_planners_target_table_is_the_hubs():
    assert LORA_TARGETS == NXDT_TARGETS


@pytest.mark.parametrize(
    "targets, architecture, more",
    [
        ("[qkv_proj,o_proj]", "nxdt.models.llama.LlamaForCausalLM", []),
        ("[qkv_proj,o_proj,gate_up_proj,down_proj]", "nxdt.models.llama.LlamaForCausalLM", []),
        # GPT's attention has no grouped KV heads (its MLP, fc_in/fc_out, no LoRA target reaches: refused by name)
        ("[qkv_proj,o_proj]", "nxdt.models.gpt.GPTForCausalLM", ["model.num_kv_heads=null"]),
    ],
)
def test_trainable_count_is_the_models_after_apply_peft(targets, architecture, more):
    """The planner's count (TP1, PP1) equals the parameters left trainable by apply_peft on the hub model."""
    cfg = lora_cfg(f"model_alignment_strategy.peft.target_modules={targets}", f"model.architecture={architecture}", *more)
    model = import_architecture(cfg.model.architecture)(cfg.model)
    apply_peft(model, cfg.model_alignment_strategy.peft)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_trainable_per_rank(cfg, 1, 1) == trainable


def test_under_tp_each_adapter_splits_as_its_base():
    """q (column-parallel, 64 → 64): A whole (64·8), B split (8·64/2); o (row-parallel): A split, B whole — per layer
    and TP rank 2·(512 + 256) for q and o, plus k, v (64 → 32 each: 512 + 128 each); two layers over PP 2 = one."""
    cfg = lora_cfg()
    assert lora_trainable_per_rank(cfg, 2, 2) == (2 * (512 + 256) + 2 * (512 + 128)) * 1


def test_the_lora_plan_counts_gradients_and_optimizer_state_for_the_adapters_only():
    cfg = lora_cfg("trainer.devices=2", "distributed_strategy.zero1=true")
    full = compose_config(["+recipe=sft", *LLAMA, "trainer.devices=2", "distributed_strategy.zero1=true"])
    degrees = {"tp": 1, "pp": 1, "dp": 2, "ep": 1, "cp": 1}
    lora_mem, full_mem = memory_per_rank(cfg, degrees), memory_per_rank(full, degrees)
    adapters = lora_trainable_per_rank(cfg, 1, 1)
    per = bytes_per_parameter(cfg)
    assert lora_mem["gradients"] == adapters * per["grads"]
    assert lora_mem["optimizer"] == adapters / 2 * (per["moments"] + per["master"])  # ZeRO-1 over DP 2
    assert lora_mem["parameters"] == full_mem["parameters"] + adapters * per["params"]  # the base is still held
    # rank 8 on q, k, v, o of a 64-wide model: 7.6 % of its parameters (rank 16 on an 8B Llama's: 0.2 %)
    assert lora_mem["gradients"] < full_mem["gradients"] / 10 and lora_mem["optimizer"] < full_mem["optimizer"] / 10
    # data parallelism reduces the adapters' gradients only
    rows = {r["what"]: r["bytes"] for r in plan(cfg).collectives if r["dim"] == "dp"}
    assert rows["ZeRO-1 gradients"] == adapters * 4  # fp32 gradients
