"""A Hugging Face ``config.json`` as nxdt ``model`` fields (pure: a dict in, a dict and notes out).

NxDT's HF-style configs name the model by ``model.model_config`` (a ``config.json``); nxdt reads the
shape from it once, at compose time, so the resolved run config holds every field and workers never
read the file again. Only Llama-family decoders the model hub implements are accepted; fields that
would change the math in a way the hub does not implement are refused by name rather than ignored
(RoPE scaling: ``llama3`` is implemented, every other ``rope_type`` is refused).
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
        raise HFConfigError(
            f"head_dim={head_dim} differs from hidden_size/num_attention_heads = {hidden}/{heads}; "
            "the model hub derives the head size from them"
        )
    out.update(rope_fields(hf))
    return out, []


# rope_scaling types the hub implements (null and "default" are plain RoPE); transformers also has linear,
# dynamic, yarn, longrope, proportional: each changes the math, so each is refused by name
ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """``rope_scaling.*`` (and ``rope_theta``) from config.json: Llama 3.1's ``rope_scaling`` (transformers 4
    files) or ``rope_parameters`` (transformers 5 files, which carry rope_theta inside)."""
    field = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    rope = hf.get(field)
    if rope is not None and not isinstance(rope, Mapping):
        raise HFConfigError(f"{field}={rope!r}: expected an object with rope_type and its parameters")
    rope = rope or {}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise HFConfigError(f"partial_rotary_factor={partial}: the model hub rotates the whole head")
    out: dict[str, Any] = {}
    if hf.get("rope_theta") is None and rope.get("rope_theta") is not None:
        out["rope_theta"] = rope["rope_theta"]
    kind = rope.get("rope_type", rope.get("type"))  # "type": older config.json files
    if kind not in (None, *ROPE_TYPES):
        raise HFConfigError(f"{field}.rope_type={kind!r} is not implemented; nxdt implements llama3 (Llama 3.1) and default")
    if kind == "llama3":
        missing = [k for k in LLAMA3_KEYS if rope.get(k) is None]
        if missing:
            raise HFConfigError(f"{field}: rope_type llama3 needs {', '.join(missing)}")
        out["rope_scaling.rope_type"] = "llama3"
        out.update({f"rope_scaling.{k}": rope[k] for k in LLAMA3_KEYS})
    return out
