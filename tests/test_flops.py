"""The one FLOPs count (``nxdt.planner.estimate.flops_per_token``): by hand for llama_tiny and gpt_tiny, and against
torch's FlopCounterMode over a real forward and backward pass of the model hub's models."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from nxdt.config import compose_config
from nxdt.planner import plan
from nxdt.planner.estimate import flops_per_token, forward_flops_per_token, mlp_matrices


def model_cfg(name: str, *over: str):
    return compose_config([f"model={name}", *over], check=False).model


def build(cfg):
    module, cls = cfg.architecture.rsplit(".", 1)
    torch.manual_seed(0)
    return getattr(importlib.import_module(module), cls)(cfg)


def test_llama_tiny_by_hand():
    # h 128, 4 layers, 4 heads of 32, 2 KV heads (GQA), SwiGLU 344, vocab 256, untied head
    m, s = model_cfg("llama_tiny"), 128
    attn = 2 * (128 * 128 + 128 * 128 + 128 * 64 + 128 * 64)  # q, o full width; k, v at 2 heads × 32
    mlp = 2 * 3 * 128 * 344  # gate, up, down
    scores = 2 * 2 * s * 128  # QKᵀ and ·V over the full S×S square
    forward = 4 * (attn + mlp + scores) + 2 * 256 * 128  # + output head; the embedding lookup is free
    assert mlp_matrices(m) == 3
    assert forward_flops_per_token(m, s) == forward
    assert flops_per_token(m, s) == 3 * forward == 5_332_992
    assert flops_per_token(m, s, causal=True) == 3 * (forward - 4 * scores // 2)


def test_gpt_tiny_by_hand():
    # h 128, 4 layers, 4 heads (no GQA), GELU MLP 512 (two matrices, not SwiGLU's three), vocab 256, tied head
    m, s = model_cfg("gpt_tiny"), 128
    attn = 2 * 4 * 128 * 128
    mlp = 2 * 2 * 128 * 512  # up, down
    scores = 2 * 2 * s * 128
    forward = 4 * (attn + mlp + scores) + 2 * 256 * 128  # the tied table is still the head's matmul
    assert mlp_matrices(m) == 2
    assert flops_per_token(m, s) == 3 * forward == 5_701_632  # the SwiGLU formula said 7_274_496 (+28 %)


def test_planner_uses_it():
    cfg = compose_config(["model=gpt_tiny"])
    assert plan(cfg).estimate["flops_per_token"] == flops_per_token(cfg.model, cfg.data.seq_length)


# the families on Llama's block at a tiny size: Qwen2's biases (addmm: the bias add is not a matmul), Qwen3's q/k
# norms (element-wise) and head_dim 32 ≠ hidden/heads = 16, Mistral's window (as long as the positions), Qwen3-MoE's
# experts (top 2 of 4, un-renormalised weights: an element-wise scale)
SMALL = [
    "model.vocab_size=256",
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=4",
    "model.num_kv_heads=2",
]
SMALL += ["model.ffn_hidden_size=96", "model.max_position_embeddings=64"]
FAMILIES = {
    "llama_tiny": [],
    "gpt_tiny": [],
    "mixtral_tiny": [],
    "qwen2_5_7b": SMALL,
    "qwen3_8b": [*SMALL, "model.head_dim=32"],
    "mistral_7b": [*SMALL, "model.sliding_window=64"],
    "qwen3_30b_a3b": [*SMALL, "model.head_dim=32", "model.moe.num_experts=4", "model.moe.top_k=2"],
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_matches_flop_counter(name):
    """FlopCounterMode counts matmuls (mm, addmm, bmm) and nothing element-wise — exactly what the formula counts —
        so forward FLOPs agree exactly (tolerance 1e-9, float rounding only) when the attention scores are matmuls
        (``core_attention: naive``, the full S×S square the formula's convention counts; torch's CPU flash kernel for
        sdpa is not counted by FlopCounterMode). Backward: every matmul's two gradient matmuls cost twice its forward and
        the embedding's gradient is a scatter-add (no matmul), so forward + backward is exactly 3 × forward. Mixtral routes
        every token to exactly top_k experts (no capacity drop), so its count is exact too. The hub models carry no FLOPs
    formula of their own: this one is the planner's, MFU's and ``comm-test --calibrate``'s."""
    cfg = model_cfg(name, "model.core_attention=naive", *FAMILIES[name])
    model = build(cfg)
    b, s = 2, 32
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    with FlopCounterMode(display=False) as forward:
        with torch.no_grad():
            model(ids)
    assert forward.get_total_flops() / (b * s) == pytest.approx(forward_flops_per_token(cfg, s), rel=1e-9)
    with FlopCounterMode(display=False) as training:
        model.loss_fn(model(ids), ids).backward()
    assert training.get_total_flops() / (b * s) == pytest.approx(flops_per_token(cfg, s), rel=1e-9)
