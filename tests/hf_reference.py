"""Shared by the parity tests: a ``transformers.LlamaConfig`` with the shape of an nxdt tiny Llama config."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any


# the tiny Llama shape the parity tests share (nxdt's model keys)
TINY_LLAMA = dict(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=64,
    max_position_embeddings=64,
    rope_theta=10000.0,
    norm_eps=1e-5,
    tie_word_embeddings=False,
    init_method_std=0.02,
    activations_checkpoint_granularity=None,
)


def llama_config(transformers: Any, shape: dict) -> Any:
    """The transformers config equal to ``shape`` (nxdt's model keys), eager attention, untied, no biases. transformers 5
    moved rope_theta into rope_parameters; 4.x takes it directly."""
    c = SimpleNamespace(**shape)
    if "rope_parameters" in inspect.signature(transformers.LlamaConfig.__init__).parameters:
        rope = {"rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta}}
    else:
        rope = {"rope_theta": c.rope_theta}
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.ffn_hidden_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_kv_heads,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.norm_eps,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        **rope,
    )
    config._attn_implementation = "eager"
    return config
