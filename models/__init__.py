"""The model hub, installed as ``nxdt.models`` (one module + one config per model).

A config names its class by import path (``model.architecture``); nothing dispatches on names.

    attention.py core_attention — the one attention function of every model: sdpa | blockwise | naive
               (``model.core_attention``), grouped-query heads without K/V copies
    llama.py   LlamaForCausalLM — Llama 2/3/3.1: RMSNorm, RoPE (HF layout; ``rope_scaling`` llama3), SwiGLU,
               grouped-query attention, full/selective activation checkpointing; conf/model/llama_tiny.yaml,
               llama3_8b.yaml, llama3_70b.yaml; the families on its block:
               MistralForCausalLM (mistral_7b.yaml), Qwen2ForCausalLM (q/k/v biases; qwen2_5_7b.yaml),
               Qwen3ForCausalLM (per-head q/k RMSNorm, explicit head_dim; qwen3_8b.yaml)
    mixtral.py MixtralForCausalLM — Llama attention + top-k routed mixture of experts with the load-balancing
               loss (HF names); expert parallelism in nxdt.parallel.expert_parallel; mixtral_tiny.yaml, mixtral_8x7b.yaml
    gpt.py     GPTForCausalLM — GPT-2 style: learned positions, LayerNorm, GELU MLP, biases; gpt_tiny.yaml
    meta.py    shapes_only() — a model built for its names and shapes (meta device, no fills): the launcher's check
"""
