"""Llama (2/3 family): RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention.

Attribute names mirror Hugging Face's ``LlamaForCausalLM`` (``embed_tokens``, ``layers.N.self_attn.q_proj``,
``mlp.gate_proj``, ``norm``, ``lm_head``) so checkpoints map by name. ``layers`` is the list pipeline
stages and FSDP units are cut from. The config is any object with the ``model`` schema's attributes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 for stability under bf16 compute
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(head_dim: int, max_positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # HF's rotate-half layout
    return angles.cos().float(), angles.sin().float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, S, D]; cos/sin: [S, D]."""
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


class CoreAttention(nn.Module):
    """Softmax(QKᵀ)V with a causal mask: the part ``selective`` activation checkpointing recomputes."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_kv_heads or cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // self.num_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.core = CoreAttention()
        self.checkpoint_core = cfg.activations_checkpoint_granularity == "selective"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.num_kv_heads != self.num_heads:  # grouped-query attention: each KV head serves a group of queries
            repeat = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        if self.checkpoint_core and self.training:
            out = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            out = self.core(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(cfg.hidden_size // cfg.num_attention_heads, cfg.max_position_embeddings, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.checkpoint_layers = cfg.activations_checkpoint_granularity == "full"
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.cfg.init_method_std
        # residual-branch outputs scaled down with depth (GPT-2 style) so activations stay O(1)
        out_std = std / math.sqrt(2 * self.cfg.num_layers)
        for name, p in self.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            if self.checkpoint_layers and self.training:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))

    @staticmethod
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy (labels are already shifted), fp32, mean over tokens."""
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token: 6·N for the weights plus the attention score/value matmuls."""
        c = self.cfg
        return 6.0 * self.num_parameters() + 12.0 * c.num_layers * c.hidden_size * seq_length
