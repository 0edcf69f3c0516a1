"""Llama (2/3 family): RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention — and the families built
on the same block, each a small class at the end of this file: Mistral (a sliding window, honoured up to the
sequence), Qwen2/2.5 (q/k/v biases), Qwen3 (per-head q/k RMSNorm); what a family changes is its
:class:`AttentionOptions`, its Hugging Face mapping and its parallel plans are its spec in ``nxdt.config.hf_model``.

Attribute names mirror Hugging Face's ``LlamaForCausalLM`` (``embed_tokens``, ``layers.N.self_attn.q_proj``,
``mlp.gate_proj``, ``norm``, ``lm_head``) so checkpoints map by name, and RoPE uses HF's rotate-half
layout so HF weights need no permutation. ``layers`` is the list pipeline stages and FSDP units are cut
from; every projection is a plain named ``nn.Linear`` that tensor parallelism can swap for a parallel one.

The config is any object with the ``model`` schema's attributes (``vocab_size``, ``hidden_size``,
``num_layers``, ``num_attention_heads``, ``num_kv_heads``, ``ffn_hidden_size``, ``head_dim``, ``sliding_window``,
``max_position_embeddings``, ``rope_theta``, ``rope_scaling``, ``norm_eps``, ``tie_word_embeddings``,
``init_method_std``, ``activations_checkpoint_granularity``, ``core_attention``); the optional ones fall back to
the schema's defaults.

RoPE scaling (``rope_scaling``, Hugging Face's ``config.json`` field): ``rope_type: llama3`` is Llama 3.1's
frequency-dependent scaling (see :func:`llama3_inv_freq`); null or ``default`` is plain RoPE; other types
(linear, dynamic, yarn, longrope, ...) are refused by name.

Core attention (``core_attention``: sdpa | blockwise | naive) is :func:`nxdt.models.attention.core_attention`,
the one attention function of every hub model.

Activation checkpointing (``activations_checkpoint_granularity``): ``"full"`` recomputes each decoder
layer in backward, ``"selective"`` only the attention core (softmax(QKᵀ)V: with ``core_attention: naive``
the S² part of the activations, cheap to recompute; sdpa and blockwise keep no S² tensor anyway), as in
NxDT/Megatron. Both use non-reentrant ``torch.utils.checkpoint`` and give bit-identical loss and gradients
to no checkpointing.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

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
from nxdt.models.objectives import token_log_probs

CHECKPOINT_GRANULARITIES = (None, "full", "selective")
ROPE_TYPES = (None, "default", "llama3")  # rope_scaling.rope_type values the hub implements (None/default: plain RoPE)
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _opt(cfg: Any, name: str, default: Any) -> Any:
    """An optional config attribute (plain namespaces in tests need not carry every schema key)."""
    return getattr(cfg, name, default)


def _field(node: Any, name: str, default: Any = None) -> Any:
    """``name`` of a config node that may be a mapping (dict, DictConfig) or an object (dataclass, namespace)."""
    if isinstance(node, Mapping):
        return node.get(name, default)
    return getattr(node, name, default)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 for stability under bf16 compute (as HF does)
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_scaling_params(rope_scaling: Any) -> dict[str, float] | None:
    """The llama3 parameters of a ``rope_scaling`` node (mapping or object), or None for plain RoPE
    (null, or ``rope_type`` null/``default``). Any other type is refused by name."""
    if rope_scaling is None:
        return None
    kind = _field(rope_scaling, "rope_type") or _field(rope_scaling, "type")  # HF's older spelling: "type"
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"model.rope_scaling.rope_type={kind!r} is not implemented; nxdt implements llama3 (Llama 3.1) "
            "and default (plain RoPE)"
        )
    if kind != "llama3":
        return None
    params = {key: _field(rope_scaling, key) for key in LLAMA3_ROPE_KEYS}
    missing = [key for key, value in params.items() if value is None]
    if missing:
        raise ValueError(f"model.rope_scaling: rope_type llama3 needs {', '.join(missing)}")
    if not 0 < params["low_freq_factor"] < params["high_freq_factor"]:
        raise ValueError(
            f"model.rope_scaling: llama3 needs 0 < low_freq_factor < high_freq_factor, got "
            f"{params['low_freq_factor']} and {params['high_freq_factor']}"
        )
    if not params["factor"] > 0 or not params["original_max_position_embeddings"] > 0:
        raise ValueError("model.rope_scaling: llama3 needs factor > 0 and original_max_position_embeddings > 0")
    return params


def llama3_inv_freq(
    inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float, original_max_position_embeddings: int
) -> torch.Tensor:
    """Llama 3.1's RoPE scaling of the inverse frequencies (Meta's ``apply_scaling``, HF's ``llama3`` rope type).

    With L = original_max_position_embeddings, a frequency whose wavelength 2π/f is shorter than
    L/high_freq_factor is kept (it already turns many times within the pretraining context); one longer than
    L/low_freq_factor is divided by ``factor`` (position interpolation); in between, the two are blended
    linearly in L/wavelength: f·((1-t)/factor + t) with t = (L/wavelength - low_freq_factor)/(high_freq_factor -
    low_freq_factor), which is 0 at the low boundary and 1 at the high one (the band's edges included)."""
    wavelength = 2 * math.pi / inv_freq
    context = float(original_max_position_embeddings)
    t = (context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = inv_freq * ((1 - t) / factor + t)
    scaled = torch.where(wavelength > context / low_freq_factor, inv_freq / factor, blended)
    return torch.where(wavelength < context / high_freq_factor, inv_freq, scaled)


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: Any = None) -> torch.Tensor:
    """RoPE's inverse frequencies theta^(-2i/head_dim), i < head_dim/2 (fp64), scaled by ``rope_scaling``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    params = rope_scaling_params(rope_scaling)
    return inv_freq if params is None else llama3_inv_freq(inv_freq, **params)


def rope_tables(head_dim: int, max_positions: int, theta: float, rope_scaling: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim] in HF's rotate-half layout (frequencies repeated twice), computed
    in fp64 on the CPU whatever device the model is built on (the caller moves them): the same tables everywhere, and
    a model built on ``meta`` for its shapes does not pay meta ``arange``'s first call (it imports torch._dynamo)."""
    inv_freq = rope_inv_freq(head_dim, theta, rope_scaling)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64, device="cpu"), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, S, D]; cos/sin: [S, D] (positions 0..S-1) or [B, S, D] (each token's own position)."""
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


def head_dim(cfg: Any) -> int:
    """Each attention head's width: ``model.head_dim``, or hidden_size / num_attention_heads when null (Qwen3 and
    Mistral Nemo state it, and it may differ from that quotient)."""
    return _opt(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


@dataclass(frozen=True)
class AttentionOptions:
    """What a Llama-architecture family changes in attention (a hub class's ``attention_options``; its Hugging Face
    spec in ``nxdt.config.hf_model`` names the class): ``qkv_bias`` — q, k and v projections with biases, o without
    (Qwen2's ``Qwen2Attention``); ``qk_norm`` — an RMSNorm over each head's query and key, weights [head_dim] shared
    by the heads, before RoPE (Qwen3's ``q_norm`` / ``k_norm``)."""

    qkv_bias: bool = False
    qk_norm: bool = False


class Attention(nn.Module):
    def __init__(self, cfg: Any, options: AttentionOptions = AttentionOptions()) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = _opt(cfg, "num_kv_heads", None) or cfg.num_attention_heads
        self.head_dim = head_dim(cfg)
        bias = options.qkv_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        if options.qk_norm:
            eps = _opt(cfg, "norm_eps", 1e-5)
            self.q_norm = RMSNorm(self.head_dim, eps)
            self.k_norm = RMSNorm(self.head_dim, eps)
        self.qk_norm = options.qk_norm
        self.core = CoreAttention(_opt(cfg, "core_attention", None) or DEFAULT_IMPL)
        self.checkpoint_core = _opt(cfg, "activations_checkpoint_granularity", None) == "selective"

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segment_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        # head counts come from the projections' sizes, so a tensor-parallel swap (fewer local heads) keeps working;
        # so does the sequence length: under sequence parallelism x is a sequence shard and q/k/v the full sequence
        # (cos/sin are the table [max_positions, D], cut to S here, or already one row per token [B, S, D])
        q = self.q_proj(x)
        b, s, _ = q.shape
        q = q.view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        if self.qk_norm:  # per head, over head_dim: the same under TP, where a rank holds whole heads
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if cos.dim() == 2:
            cos, sin = cos[:s], sin[:s]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # grouped-query attention (fewer KV heads: KV head j serves query heads [j·g, (j+1)·g)) is core attention's
        if cache is not None:  # incremental decoding: attend over every cached token, not just this call's
            k, v, k_segments = cache.extend(self, k, v, segment_ids)
            out = cached_attention(q, k, v, segment_ids, k_segments)
        elif self.checkpoint_core and torch.is_grad_enabled():
            out = checkpoint(self.core, q, k, v, segment_ids, use_reentrant=False)
        else:
            out = self.core(q, k, v, segment_ids)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x))."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(x)). Subclasses swap the feed-forward block
    (``ffn_name`` keeps Hugging Face's attribute name, e.g. Mixtral's ``block_sparse_moe``)."""

    ffn_name = "mlp"

    def __init__(self, cfg: Any, attention: AttentionOptions = AttentionOptions()) -> None:
        super().__init__()
        eps = _opt(cfg, "norm_eps", 1e-5)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = Attention(cfg, attention)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.add_module(self.ffn_name, self.make_ffn(cfg))

    def make_ffn(self, cfg: Any) -> nn.Module:
        return MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segment_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, segment_ids, cache)
        return x + getattr(self, self.ffn_name)(self.post_attention_layernorm(x))


def check_config(cfg: Any) -> None:
    """Shape rules the model needs; one clear message naming the key instead of a reshape error later."""
    heads, kv = cfg.num_attention_heads, _opt(cfg, "num_kv_heads", None) or cfg.num_attention_heads
    explicit = _opt(cfg, "head_dim", None)
    if explicit is None and cfg.hidden_size % heads:
        raise ValueError(f"model.hidden_size={cfg.hidden_size} must be divisible by model.num_attention_heads={heads}")
    if explicit is not None and explicit < 2:
        raise ValueError(f"model.head_dim={explicit} must be at least 2 (null: hidden_size/num_attention_heads)")
    if head_dim(cfg) % 2:
        raise ValueError(f"head dim {head_dim(cfg)} must be even for rotary embeddings")
    window = _opt(cfg, "sliding_window", None)
    if window is not None and window < 1:
        raise ValueError(f"model.sliding_window={window} must be at least 1 (null: attention over the whole sequence)")
    if heads % kv:
        raise ValueError(f"model.num_kv_heads={kv} must divide model.num_attention_heads={heads} (grouped-query attention)")
    granularity = _opt(cfg, "activations_checkpoint_granularity", None)
    if granularity not in CHECKPOINT_GRANULARITIES:
        raise ValueError(f"model.activations_checkpoint_granularity={granularity!r}: use one of full, selective, null")
    check_impl(_opt(cfg, "core_attention", None) or DEFAULT_IMPL)
    rope_scaling_params(_opt(cfg, "rope_scaling", None))


def check_positions(input_ids: torch.Tensor, layout: SequenceLayout | None, max_positions: int) -> None:
    """A clear error for tokens past the model's position table (instead of an index error in a layer)."""
    positions, segments = layout_fields(layout)
    for name, ids in (("position_ids", positions), ("segment_ids", segments)):
        if ids is not None and ids.shape != input_ids.shape:
            raise ValueError(f"{name} {tuple(ids.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
    if positions is None:
        if input_ids.shape[1] > max_positions:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds model.max_position_embeddings={max_positions}")
    elif positions.numel() and (int(positions.max()) >= max_positions or int(positions.min()) < 0):
        raise ValueError(
            f"position ids {int(positions.min())}..{int(positions.max())} fall outside "
            f"model.max_position_embeddings={max_positions}"
        )


def check_window(input_ids: torch.Tensor, layout: SequenceLayout | None, window: int | None) -> None:
    """Sliding-window attention (Mistral's ``sliding_window``: query i sees key j only when i - j < window) is
    computed as full causal attention, which is the same function while no two tokens of a sequence are ``window``
    or more positions apart; a longer sequence is refused by name rather than computed differently."""
    if window is None:
        return
    positions, _ = layout_fields(layout)
    span = input_ids.shape[1] if positions is None else int(positions.max()) + 1 if positions.numel() else 0
    if span > window:
        raise ValueError(
            f"sequence of {span} positions exceeds model.sliding_window={window}: sliding-window attention is not "
            "implemented (full causal attention equals it only up to the window); use data.seq_length <= the window"
        )


class _instance_or_static:
    """A method that also works called on the class: ``Model.loss_fn(logits, labels)`` gets ``self=None``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __get__(self, obj: Any, owner: type | None = None) -> Callable[..., Any]:
        return functools.partial(self.fn, obj)


def next_token_loss(head: nn.Module | None, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32, mean over tokens, -100 ignored; a vocabulary-sharding head (tensor
    parallelism) computes it across its group."""
    if getattr(head, "shards_vocab", False):
        return head.cross_entropy(logits, labels, ignore_index=-100)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def next_token_log_probs(head: nn.Module | None, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token log-probability of each label in fp32 (0 where it is -100); a vocabulary-sharding head (tensor
    parallelism) computes it across its group."""
    if getattr(head, "shards_vocab", False):
        return head.token_log_probs(logits, labels, ignore_index=-100)
    return token_log_probs(logits, labels, ignore_index=-100)


class DecoderOnlyLM(nn.Module):
    """What every hub model shares: the forward as embed → run_layer per layer → head, and the loss.
    Subclasses provide ``embed_tokens``, ``layers``, ``norm``, ``lm_head``, ``embed`` and ``run_layer``."""

    @property
    def tied(self) -> bool:
        return self.lm_head.weight is self.embed_tokens.weight

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and output projection: hidden [B, S, hidden] → logits [B, S, vocab]."""
        return self.lm_head(self.norm(x))

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """input_ids [B, S] → logits [B, S, vocab]; ``position_ids`` / ``segment_ids`` [B, S] as
        :class:`~nxdt.models.attention.SequenceLayout` (packed records, context-parallel shards); ``kv_cache``
        for incremental decoding (``input_ids`` then holds only the tokens not yet cached)."""
        layout = SequenceLayout.of(position_ids, segment_ids, kv_cache)
        x = self.embed(input_ids, layout)
        for layer in self.layers:
            x = self.run_layer(layer, x, layout)
        return self.head(x)

    def embedding_modules(self) -> list[nn.Module]:
        """The modules ``embed`` runs, in call order."""
        return [self.embed_tokens]

    def fsdp_units(self) -> list[list[nn.Module]]:
        """FSDP units in forward order: the embedding, each layer, the final norm with the head."""
        return [self.embedding_modules(), *[[layer] for layer in self.layers], [self.norm, self.lm_head]]

    @_instance_or_static
    def loss_fn(self: "DecoderOnlyLM | None", logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy in fp32, mean over tokens. Labels are already shifted by the data
        pipeline (labels[t] is the token after input_ids[t]); positions labelled -100 are ignored.

        On a model whose head shards the vocabulary (tensor parallelism) the logits are [..., vocab/tp] and
        the head computes the loss across the group; called on the class, the plain unsharded loss."""
        return next_token_loss(self.lm_head if self is not None else None, logits, labels)

    @_instance_or_static
    def token_log_probs(self: "DecoderOnlyLM | None", logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token label log-probabilities [B, S] (0 where labels are -100), the sequence scores of preference
        objectives; vocab-sharded logits under tensor parallelism, full ones otherwise (or called on the class)."""
        return next_token_log_probs(self.lm_head if self is not None else None, logits, labels)


class LlamaForCausalLM(DecoderOnlyLM):
    # what a family member (Mixtral) changes: its block, its config rules, its residual-branch outputs
    layer_class: type[nn.Module] = DecoderLayer
    check_config = staticmethod(check_config)
    residual_outputs: tuple[str, ...] = ("o_proj.weight", "down_proj.weight")
    attention_options = AttentionOptions()

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.check_config(cfg)
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg, self.attention_options) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, _opt(cfg, "norm_eps", 1e-5))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if _opt(cfg, "tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight  # one Parameter, two users
        cos, sin = rope_tables(
            head_dim(cfg),
            cfg.max_position_embeddings,
            _opt(cfg, "rope_theta", 10000.0),
            _opt(cfg, "rope_scaling", None),
        )
        # not persistent: derived from the config, so checkpoints hold weights only (as HF's)
        device = self.embed_tokens.weight.device  # the device the model is built on (a torch.device context's)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        self.checkpoint_layers = _opt(cfg, "activations_checkpoint_granularity", None) == "full"
        self.sliding_window = _opt(cfg, "sliding_window", None)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """normal(0, std) from torch's global RNG, in parameter order, so equal seeds give equal weights
        in every process; residual-branch outputs (``residual_outputs``: o_proj, down_proj) get
        std/√(2·layers) (GPT-2 style) so the residual stream's scale does not grow with depth; norms start at 1,
        biases (Qwen2's q/k/v) at 0."""
        std = _opt(self.cfg, "init_method_std", 0.02)
        out_std = std / math.sqrt(2 * self.cfg.num_layers)
        for name, p in self.named_parameters():  # a tied weight is listed (and drawn) once
            if name.endswith(".bias"):
                p.zero_()
            elif p.ndim == 1:
                p.fill_(1.0)
            elif name.endswith(self.residual_outputs):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, std)

    # The forward pass in three public pieces, so pipeline stages and FSDP units can run a slice of the
    # model without re-implementing it: embed → run_layer for each owned layer → head.
    def embed(self, input_ids: torch.Tensor, layout: SequenceLayout | None = None) -> torch.Tensor:
        """input_ids [B, S] → hidden states [B, S, hidden] (positions are RoPE's, applied in each layer)."""
        check_positions(input_ids, layout, self.rope_cos.shape[0])
        check_window(input_ids, layout, self.sliding_window)
        return self.embed_tokens(input_ids)

    def rope(self, layout: SequenceLayout | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary cos/sin: the whole [max_positions, D] table, or [B, S, D] rows at ``layout.position_ids``."""
        positions, _ = layout_fields(layout)
        if positions is None:
            return self.rope_cos, self.rope_sin
        return self.rope_cos[positions], self.rope_sin[positions]

    def run_layer(self, layer: nn.Module, x: torch.Tensor, layout: SequenceLayout | None = None) -> torch.Tensor:
        """One decoder layer (with full activation checkpointing if configured); x [B, S, hidden] (or
        [B, S/tp, hidden] under sequence parallelism: attention takes the RoPE rows its full sequence needs)."""
        cos, sin = self.rope(layout)
        segments = layout_fields(layout)[1]
        cache = layout_cache(layout)
        if cache is not None:  # decoding: no backward, so no checkpointing
            return layer(x, cos, sin, segments, cache)
        if self.checkpoint_layers and torch.is_grad_enabled():
            return checkpoint(layer, x, cos, sin, segments, use_reentrant=False)
        return layer(x, cos, sin, segments)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Distinct parameters (a tied embedding counts once). ``exclude_embeddings`` drops the input
        embedding table unless it is tied, i.e. keeps exactly the weights used in matmuls."""
        total = sum(p.numel() for p in self.parameters())  # parameters() already de-duplicates
        if exclude_embeddings and not self.tied:
            total -= self.embed_tokens.weight.numel()
        return total


# Families with Llama's architecture: each is the hub class its Hugging Face spec (nxdt.config.hf_model.FAMILIES)
# names, so an export writes the family it was imported as; what one changes is its attention options.
class MistralForCausalLM(LlamaForCausalLM):
    """Mistral 7B (transformers' ``MistralForCausalLM``): Llama's computation; config.json's ``sliding_window`` is
    ``model.sliding_window``, honoured by refusing sequences longer than the window (:func:`check_window`)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 (transformers' ``Qwen2ForCausalLM``): Llama with biases on the q, k and v projections."""

    attention_options = AttentionOptions(qkv_bias=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (transformers' ``Qwen3ForCausalLM``): Llama with an RMSNorm over each query and key head before RoPE and an
    explicit ``head_dim`` (Qwen3-0.6B: 128 with hidden_size 1024 and 16 heads)."""

    attention_options = AttentionOptions(qk_norm=True)
