"""GPT (GPT-2 style): learned absolute position embeddings, pre-LayerNorm blocks, GELU MLP, biases everywhere
except the output head, tied input/output embeddings when ``tie_word_embeddings`` (GPT-2's choice).

Positions are *learned* (GPT-2), not rotary: ``embed_positions`` is a [max_position_embeddings, hidden]
table added to the token embeddings. GELU is GPT-2's tanh approximation. Names follow the rest of the
hub (``embed_tokens``, ``layers.N.self_attn.{q,k,v,o}_proj``, ``layers.N.mlp.{fc_in,fc_out}``,
``layers.N.{input,post_attention}_layernorm``, ``norm``, ``lm_head``) with separate q/k/v projections, cut by
the gpt2 family's plan (``nxdt.config.hf_model``, ``ModelSpec.parallel``) as Megatron's GPT is (tensor and sequence
parallelism).

Block: x + o(attn(ln1(x))), then + fc_out(gelu(fc_in(ln2(x)))). The public forward pieces are Llama's:
``embed(ids)`` (token + position embeddings), ``run_layer(layer, x)``, ``head(x)``, ``loss_fn(logits, labels)``.

Parameter count (V vocab, P positions, h hidden, f ffn, L layers)::

    V·h + P·h + L·(4h² + 4h  +  2hf + f + h  +  4h) + 2h  [+ V·h if untied]
       tokens, positions; attention w+b; MLP w+b; two LayerNorms; final LayerNorm; head

Config: the ``model`` schema's ``vocab_size, hidden_size, num_layers, num_attention_heads, ffn_hidden_size,
max_position_embeddings, norm_eps (LayerNorm eps), tie_word_embeddings, init_method_std,
activations_checkpoint_granularity`` (``full``: each block recomputed in backward; ``selective``: only the attention
core, as Llama and NxDT's Megatron GPT; null), ``core_attention`` (sdpa |
blockwise | naive: :func:`nxdt.models.attention.core_attention`). ``num_kv_heads``, ``rope_theta`` and
``rope_scaling`` are ignored.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nxdt.models.attention import (
    DEFAULT_IMPL,
    CoreAttention,
    KVCache,
    SequenceLayout,
    cached_attention,
    check_impl,
    layout_cache,
    layout_fields,
)
from nxdt.models.llama import CHECKPOINT_GRANULARITIES, DecoderOnlyLM, _opt, check_positions


class GPTAttention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.head_dim = h // cfg.num_attention_heads
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.o_proj = nn.Linear(h, h)
        self.core = CoreAttention(_opt(cfg, "core_attention", None) or DEFAULT_IMPL)  # the seam ring attention swaps
        self.checkpoint_core = _opt(cfg, "activations_checkpoint_granularity", None) == "selective"

    def forward(self, x: torch.Tensor, segment_ids: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        # shapes from the projections' outputs: under TP they hold this rank's heads, under SP x is a sequence
        # shard while q/k/v span the whole sequence
        q, k, v = (proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj))
        b, s, _ = q.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if cache is not None:  # incremental decoding: attend over every cached token
            k, v, k_segments = cache.extend(self, k, v, segment_ids)
            out = cached_attention(q, k, v, segment_ids, k_segments)
        elif self.checkpoint_core and torch.is_grad_enabled():  # selective: recompute softmax(QKᵀ)V in backward
            out = checkpoint(self.core, q, k, v, segment_ids, use_reentrant=False)
        else:
            out = self.core(q, k, v, segment_ids)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class GPTMLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.fc_in = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size)
        self.fc_out = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))


class GPTBlock(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        eps = _opt(cfg, "norm_eps", 1e-5)
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=eps)
        self.self_attn = GPTAttention(cfg)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=eps)
        self.mlp = GPTMLP(cfg)

    def forward(self, x: torch.Tensor, segment_ids: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), segment_ids, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def check_gpt_config(cfg: Any) -> None:
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ValueError(
            f"model.hidden_size={cfg.hidden_size} must be divisible by model.num_attention_heads={cfg.num_attention_heads}"
        )
    granularity = _opt(cfg, "activations_checkpoint_granularity", None)
    if granularity not in CHECKPOINT_GRANULARITIES:
        raise ValueError(f"model.activations_checkpoint_granularity={granularity!r}: use one of full, selective, null")
    check_impl(_opt(cfg, "core_attention", None) or DEFAULT_IMPL)


class GPTForCausalLM(DecoderOnlyLM):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        check_gpt_config(cfg)
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.layers = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=_opt(cfg, "norm_eps", 1e-5))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if _opt(cfg, "tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight
        self.checkpoint_layers = _opt(cfg, "activations_checkpoint_granularity", None) == "full"
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2's init from torch's global RNG, in parameter order: weights normal(0, std), residual outputs
        (o_proj, fc_out) std/√(2·layers), biases 0, LayerNorm weights 1."""
        std = _opt(self.cfg, "init_method_std", 0.02)
        out_std = std / math.sqrt(2 * self.cfg.num_layers)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.ndim == 1:
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "fc_out.weight")):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, std)

    def embedding_modules(self) -> list[nn.Module]:
        return [self.embed_tokens, self.embed_positions]

    def embed(self, input_ids: torch.Tensor, layout: SequenceLayout | None = None) -> torch.Tensor:
        """input_ids [B, S] → token + position embeddings [B, S, hidden] (positions 0..S-1 or ``layout``'s)."""
        check_positions(input_ids, layout, self.embed_positions.num_embeddings)
        positions = layout_fields(layout)[0]
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.embed_tokens(input_ids) + self.embed_positions(positions)

    def run_layer(self, layer: nn.Module, x: torch.Tensor, layout: SequenceLayout | None = None) -> torch.Tensor:
        segments = layout_fields(layout)[1]
        cache = layout_cache(layout)
        if cache is not None:  # decoding: no backward, so no checkpointing
            return layer(x, segments, cache)
        if self.checkpoint_layers and torch.is_grad_enabled():
            return checkpoint(layer, x, segments, use_reentrant=False)
        return layer(x, segments)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Distinct parameters (a tied embedding counts once). ``exclude_embeddings`` drops the lookup
        tables (token table unless tied, and the position table): the weights used in matmuls remain."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.embed_positions.weight.numel()
            if not self.tied:
                total -= self.embed_tokens.weight.numel()
        return total
