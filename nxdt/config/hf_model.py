"""A Hugging Face ``config.json`` as nxdt ``model`` fields (pure: a dict in, a dict and notes out).

NxDT's HF-style configs name the model by ``model.model_config`` (a ``config.json``); nxdt reads the
shape from it once, at compose time, so the resolved run config holds every field and workers never
read the file again. Only Llama-family decoders the model hub implements are accepted; fields that
would change the math in a way the hub does not implement are refused by name rather than ignored.
"""

from __future__ import annotations

from typing import Any, Mapping

# HF model_type → model-hub class
ARCHITECTURES = {
    "llama": "nxdt.models.llama.LlamaForCausalLM",
    "mixtral": "nxdt.models.mixtral.MixtralForCausalLM",
}

# config.json field → nxdt model field (dotted below model.)
FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_kv_heads",
    "intermediate_size": "ffn_hidden_size",
    "max_position_embeddings": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
    "initializer_range": "init_method_std",
    # Mixtral
    "num_local_experts": "moe.num_experts",
    "num_experts_per_tok": "moe.top_k",
    "router_aux_loss_coef": "moe.router_aux_loss_coef",
}


class HFConfigError(ValueError):
    """``str()`` names the config.json field and what to do."""


def model_fields(hf: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(flat ``{nxdt model field: value}``, notes) from a parsed ``config.json``."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise HFConfigError(f"model_type={model_type!r} is not in the model hub; supported: {', '.join(ARCHITECTURES)}")
    out: dict[str, Any] = {"architecture": ARCHITECTURES[model_type]}
    for src, dst in FIELDS.items():
        if hf.get(src) is not None:
            out[dst] = hf[src]
    if out.get("num_kv_heads") is None:
        out.pop("num_kv_heads", None)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise HFConfigError(f"hidden_act={act!r}: the model hub's {model_type} uses SwiGLU (silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise HFConfigError(f"{flag}=true: the model hub's {model_type} has no biases")
    if model_type == "mixtral" and hf.get("sliding_window") not in (None, 0):
        raise HFConfigError(f"sliding_window={hf['sliding_window']}: sliding-window attention is not implemented; set it to null")
    head_dim, hidden, heads = hf.get("head_dim"), hf.get("hidden_size"), hf.get("num_attention_heads")
    if head_dim is not None and hidden and heads and head_dim != hidden // heads:
        raise HFConfigError(f"head_dim={head_dim} differs from hidden_size/num_attention_heads = {hidden}/{heads}; "
                            "the model hub derives the head size from them")
    notes = []
    if hf.get("rope_scaling"):
        kind = hf["rope_scaling"].get("rope_type", hf["rope_scaling"].get("type", "?")) if isinstance(hf["rope_scaling"], Mapping) else "?"
        notes.append(f"model.model_config: rope_scaling ({kind}) is not implemented; nxdt uses plain RoPE with rope_theta")
    return out, notes

