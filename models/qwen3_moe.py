"""Qwen3-MoE (transformers' ``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B): Qwen3's attention (an RMSNorm over each
query and key head before RoPE, an explicit ``head_dim``) with a sparse mixture of SwiGLU experts as every layer's
feed-forward — Mixtral's block (``nxdt.models.mixtral``: router, dispatch, expert parallelism, aux loss) under
Hugging Face's attribute name ``mlp``.

What differs from Mixtral, as transformers' ``Qwen3MoeTopKRouter`` computes it: softmax over the experts in fp32,
top-k, and the chosen weights renormalised only when config.json's ``norm_topk_prob`` is true
(``model.moe.normalize_top_k_affinities``; Qwen3-30B-A3B has it on, ``Qwen3MoeConfig``'s default is off). An expert's
inner width is config.json's ``moe_intermediate_size`` (``model.ffn_hidden_size``). Dense layers between sparse ones
(``decoder_sparse_step`` > 1, a non-empty ``mlp_only_layers``) are refused by the family's spec
(``nxdt.config.hf_model``), which also maps the experts' names: ours ``mlp.experts.E.w1 / w3 / w2`` are Hugging Face's
``gate_proj / up_proj / down_proj``.
"""

from __future__ import annotations

from nxdt.models.llama import AttentionOptions
from nxdt.models.mixtral import MixtralDecoderLayer, MixtralForCausalLM


class Qwen3MoeDecoderLayer(MixtralDecoderLayer):
    """Mixtral's block with the MoE under transformers' name for it, ``mlp``."""

    ffn_name = "mlp"


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    """Qwen3's q/k-normed attention + Mixtral's sparse MoE in every layer."""

    layer_class = Qwen3MoeDecoderLayer
    attention_options = AttentionOptions(qk_norm=True)
