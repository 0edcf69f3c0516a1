"""Step-time and memory estimates of a Plan: the collectives one optimizer step issues, the compute,
pipeline bubble and overlap, and the bytes each device holds. Pure arithmetic on the config.

Model size comes from the config (a decoder-only transformer: attention with grouped KV heads,
gated MLP of ``ffn_hidden_size``, optional ``moe`` experts), not from building the model.

Activation memory is counted from first principles, tensor by tensor, for nxdt's blocks: what autograd keeps for
backward in one layer (:func:`layer_saved_bytes`: RMSNorm's fp32 input, normalised input and output; q and k after
RoPE and v; the attention kernel's output and logsumexp; SwiGLU's gate, silu(gate), up and their product), what the
head and loss keep (:func:`head_saved_bytes`: the final norm's tensors, the fp32 log-probabilities) and what the
backward pass adds at its peak (the log-probabilities' and the logits' gradients; naive attention's two S×S
gradients). The layout follows Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models"): TP splits heads and ffn columns (the norms' tensors stay whole on every TP rank), TP+SP splits everything
by t; selective recomputation drops what the attention kernel alone keeps (S×S scores, logsumexp); full
recomputation keeps only each layer's input (``e·s·b·h``, ``/t`` with SP: the layer boundary is in the
sequence-parallel layout) plus one layer's saved tensors while it is recomputed. Pipeline stages hold the
activations of the micro-batches in flight (:func:`in_flight_microbatches`: PP for 1F1B, ``PP·(1 + (PP-1)/(PP·V))``
interleaved). Korthikanti's ``34·s·b·h`` (2-byte) is written for a GELU 4h MLP; a Llama block with ffn 3.5h keeps
``(20·h + 4·g + 8·f)·s·b`` bytes in bf16 (g = KV heads × head_dim), 1.3× more. Measured against peak memory on
llama_tiny at 2k tokens: experiments/attention-memory. Bytes per parameter: :func:`bytes_per_parameter`.
The S×S bytes of ``model.core_attention: naive`` are :func:`naive_score_bytes` (what ``naive_attention`` keeps:
fp32 probabilities, the bf16 copy autocast makes of them, the boolean mask; plus the two fp32 S×S gradients the
peak layer's backward holds at once); ``sdpa`` (a fused flash kernel) and ``blockwise`` keep no S×S tensor, only a
logsumexp per query row and head.

Context parallelism (CP ranks hold S/CP tokens each: the activations and logits above shrink by CP; ZeRO-1 and
FSDP shard over DP × CP) is priced as the ring it runs (:func:`ring_rows`): per layer and micro-batch, CP − 1 K/V
block transfers in forward, CP − 1 again in backward plus CP hops of the dK/dV accumulators (fp32 for 16-bit
activations), each hidden behind the attention compute of the block in hand and exposed only by what exceeds it
(:func:`ring_attention_flops`). ``plan.estimate["context_parallel"]`` holds the bytes each rank sends per step,
how much of that time is hidden, and the activation memory CP saves per rank.
"""

from __future__ import annotations

import math
from typing import Any

from nxdt.config.hf_model import spec_of
from nxdt.planner.calibration import provenance
from nxdt.planner.cost import bus_bandwidth, estimate_collective
from nxdt.topology import Topology

GiB = 1024**3


def head_width(model: Any) -> int:
    """Each attention head's width: ``model.head_dim``, or hidden / heads when null (as the hub models)."""
    return getattr(model, "head_dim", None) or model.hidden_size // model.num_attention_heads


def model_numbers(model: Any) -> dict[str, float]:
    """Parameter counts of a decoder-only transformer config, its family's block from its spec (MLP matrices, experts,
    GPT's learned positions); O(hidden) tensors per layer other than the two norms — Qwen2's q/k/v biases, Qwen3's q/k
    norms, GPT's biases and LayerNorm shifts — are left out: under 0.01 % of any real size."""
    h, layers, vocab = model.hidden_size, model.num_layers, model.vocab_size
    heads = model.num_attention_heads
    kv = model.num_kv_heads or heads
    head_dim = head_width(model)
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2  # q, o + k, v
    experts, top_k = moe_experts(model)
    mlp_one = mlp_matrices(model) * h * model.ffn_hidden_size
    mlp_total = mlp_one * experts + h * experts if experts else mlp_one
    mlp_active = mlp_one * top_k + h * experts if experts else mlp_one
    per_layer = attn + mlp_total + 2 * h
    embed = vocab * h + (model.max_position_embeddings * h if spec_of(model).block.learned_positions else 0)
    head = 0 if model.tie_word_embeddings else vocab * h
    total = layers * per_layer + embed + head + h
    matmul_active = layers * (attn + mlp_active) + vocab * h  # weights used in matmuls per token (output head included)
    return {
        "total": total,
        "per_layer": per_layer,
        "embedding": embed,
        "head": head,
        "expert_params": layers * mlp_one * experts,
        "matmul_active": matmul_active,
        "experts": experts,
        "top_k": top_k,
    }


def mlp_matrices(model: Any) -> int:
    """Weight matrices of one MLP (or one expert) of ``model``'s family (its spec's block: SwiGLU 3, GELU 2)."""
    return spec_of(model).block.mlp_matrices


def moe_experts(model: Any) -> tuple[int, int]:
    """(experts per layer, experts per token) of a MoE family's config; (0, 0) for a dense family, whose hub class
    ignores ``model.moe``."""
    moe = getattr(model, "moe", None)
    if not spec_of(model).block.moe:
        return 0, 0
    return getattr(moe, "num_experts", 0) or 0, getattr(moe, "top_k", 0) or 0


# LoRA: NxDT's target names → the hub's projections (models/lora.py NXDT_TARGETS; the planner does not import the
# hub: tests/test_planner_lora.py keeps the two equal). GPT's MLP (fc_in, fc_out) and the MoE families' experts
# (w1, w2, w3) have none of the MLP names: the spec's ``block.lora_mlp`` says which families' MLPs are adapted.
LORA_TARGETS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


def lora_trainable_per_rank(cfg: Any, tp: int, pp: int) -> float | None:
    """Trainable parameters one rank holds in a LoRA run (``model_alignment_strategy.peft``), None without one: rank
    r adapters A (in × r) and B (r × out) on each targeted projection of every layer, split as their base is (a
    column-parallel base: A whole, B split over TP; row-parallel: A split, B whole), layers spread over PP stages.
    The base model, embedding and head are frozen: no gradient, no optimizer state. LoRA's trainable biases
    (lora_bias all / lora_only) exist only in GPT, the hub's one model with biases, and are left out (h-sized)."""
    mas = getattr(cfg, "model_alignment_strategy", None)
    peft = getattr(mas, "peft", None)
    if peft is None:
        return None
    model = cfg.model
    h, heads = model.hidden_size, model.num_attention_heads
    kv = model.num_kv_heads or heads
    head_dim = head_width(model)
    mlp = spec_of(model).block.lora_mlp
    # projection → (in, out, row-parallel)
    shapes = {
        "q_proj": (h, heads * head_dim, False),
        "k_proj": (h, kv * head_dim, False),
        "v_proj": (h, kv * head_dim, False),
        "o_proj": (heads * head_dim, h, True),
        "gate_proj": (h, model.ffn_hidden_size, False),
        "up_proj": (h, model.ffn_hidden_size, False),
        "down_proj": (model.ffn_hidden_size, h, True),
    }
    wanted = {p for t in peft.target_modules for p in LORA_TARGETS.get(t, (t,))}
    if not mlp:
        wanted -= {"gate_proj", "up_proj", "down_proj"}
    r = peft.lora_rank
    per_layer = sum(
        r * (fan_in / tp + fan_out) if row else r * (fan_in + fan_out / tp)
        for name, (fan_in, fan_out, row) in shapes.items()
        if name in wanted
    )
    return per_layer * model.num_layers / pp


def forward_flops_per_token(model: Any, seq_length: int, *, causal: bool = False) -> float:
    """Forward FLOPs per token of a decoder-only transformer config, 2 per multiply-add, counted from the config:

    - attention projections: q and o (h × heads·head_dim each), k and v (h × kv_heads·head_dim each: grouped-query
      attention shrinks these two only);
    - attention scores: QKᵀ and the weighted sum with V, 2·2·seq·heads·head_dim per layer and token, over the full
      S×S square (the Megatron/PaLM MFU convention) — ``causal=True`` halves it (the work a causal kernel needs);
    - MLP: ``mlp_matrices`` matrices of h × ffn_hidden_size (SwiGLU 3, GELU 2); with ``moe.num_experts`` the router
      (h × experts) and ``moe.top_k`` experts per token;
    - the output head (vocab × h) whether or not it is tied to the input embedding (a tied table is still one matmul);
      embedding look-ups (tokens, GPT's learned positions) are no matmuls and cost nothing.
    Norms, biases, activations, softmax and the residual adds are element-wise (O(h) per token) and not counted."""
    h, layers = model.hidden_size, model.num_layers
    heads = model.num_attention_heads
    kv = getattr(model, "num_kv_heads", None) or heads
    head_dim = head_width(model)
    projections = 2 * h * head_dim * (2 * heads + 2 * kv)
    experts, top_k = moe_experts(model)
    mlp = 2 * mlp_matrices(model) * h * model.ffn_hidden_size
    if experts:
        mlp = mlp * top_k + 2 * h * experts
    scores = 4 * seq_length * heads * head_dim * (0.5 if causal else 1.0)
    return float(layers * (projections + mlp + scores) + 2 * model.vocab_size * h)


def flops_per_token(model: Any, seq_length: int, *, causal: bool = False) -> float:
    """Training FLOPs per token, the numerator of MFU: 3 × ``forward_flops_per_token`` (the backward pass costs two
    forwards: gradients of the activations and of the weights). Without recomputation; for a dense SwiGLU model it
    is the familiar 6·N_matmul + 12·layers·hidden·seq. The one FLOPs count of nxdt: planner, metrics, benchmarks."""
    return 3.0 * forward_flops_per_token(model, seq_length, causal=causal)


def _kind(cfg: Any) -> str:
    """precision.type as the memory model sees it: the SR types store what their base types store."""
    return cfg.precision.type.removesuffix("SR")


def _bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


# Bytes per parameter one rank stores for each precision.type (``_kind``: bf16SR as bf16, mixed_precisionSR as
# mixed_precision), NxD Training's storage on Trainium:
#   kind             parameters  gradients  moments (m, v)                     fp32 master   sum (no sharding)
#   fp32             4           4          4+4                                -             16
#   bf16             2           2          2+2 (adamw) / 4+4 (fp32OptState)   -             8 / 12
#   mixed_precision  2 (bf16)    4 (fp32)   4+4                                4             18
# mixed_precision is NxD's "standard mixed precision" (bf16 weights, fp32 gradient accumulation, fp32 master
# weights and optimizer state held by the ZeRO-1 optimizer; awsdocs-neuron standard_mixed_precision).
# adamw_fp32OptState is NxD's AdamW_FP32OptimParams: the moments in fp32 (zeros_like(p, dtype=double), downcast
# to fp32 under XLA_DOWNCAST_BF16), the weights stay in the parameters' dtype: it adds no master copy; fp32
# master weights come with mixed_precision only. With fp32 and mixed_precision the moments are fp32 whichever name.
def bytes_per_parameter(cfg: Any) -> dict[str, int]:
    """``params``, ``grads``, ``moments``, ``master`` bytes per parameter for ``cfg``'s precision and optimizer."""
    kind = _kind(cfg)
    if kind == "fp32":
        return {"params": 4, "grads": 4, "moments": 8, "master": 0}
    if kind == "mixed_precision":
        return {"params": 2, "grads": 4, "moments": 8, "master": 4}
    return {"params": 2, "grads": 2, "moments": 8 if cfg.model.optim.name == "adamw_fp32OptState" else 4, "master": 0}


def in_flight_microbatches(pp: int, microbatches: int, virtual: int = 1) -> float:
    """Micro-batches whose activations the first pipeline stage holds at once, in units of the stage's whole
    share of layers (its V chunks together).

    1F1B (PipeDream-flush): PP - 1 warm-up forwards plus the one in steady state, so ``min(PP, m)``.
    Interleaved 1F1B with V chunks per stage: Megatron's schedule runs 2·(PP-1) + (V-1)·PP warm-up forwards of a
    chunk (L/(PP·V) layers) before its first backward, so 2·(PP-1) + (V-1)·PP + 1 chunk activations are held:
    ``PP·(1 + (PP-1)/(PP·V))`` stage shares — Korthikanti et al. 2022, §4.2.3 ("the first stage has to store
    activations for L·(1 + (p-1)/(p·m)) layers", m = interleaving stages); capped at m micro-batches (all of them
    are then in flight, as when m = PP)."""
    if pp <= 1:
        return 1.0
    held = pp if virtual <= 1 else pp * (1 + (pp - 1) / (pp * virtual))
    return float(min(held, microbatches))


def _norm_bytes(model: Any, act: int) -> float:
    """Bytes per token one norm keeps: RMSNorm (Llama, Mixtral) its input upcast to fp32 (4·h; at fp32 the input
    itself), the normalised input its weight multiplies (e·h), its output (e·h: the next projections' input) and the
    fp32 reciprocal RMS (4); LayerNorm (GPT) its input and output (2·e·h) and its mean and reciprocal std (2·e)."""
    h = model.hidden_size
    return 2 * act * h + 2 * act if spec_of(model).block.norm == "layernorm" else 4 * h + 2 * act * h + 4


def layer_saved_bytes(
    model: Any,
    s: float,
    b: int,
    tp: int,
    sequence_parallel: bool,
    act: int,
    kernel: str,
    *,
    selective: bool = False,
    autocast: bool = False,
) -> dict[str, float]:
    """Bytes one decoder layer keeps for backward for one micro-batch of s·b tokens, tensor by tensor (what
    ``torch.autograd.graph.saved_tensors_hooks`` lists for nxdt's blocks: experiments/attention-memory/saved_tensors.py).
    Per token, with e = ``act`` bytes per activation element, h hidden, g = KV heads × head_dim, f ffn, a heads:

    ``norms``      the block's two norms, 2 × :func:`_norm_bytes` (RMSNorm: 2·(4·h + 2·e·h + 4)).
    ``qkv``        q and k after RoPE, and v: the attention kernel's inputs, (h + 2·g)·e (GPT: g = h). ``naive``
                   computes in fp32 (f = 4 bytes) with batched matmuls that fold the head dimensions, which keep
                   contiguous copies of q, and of k and v broadcast to every query head: 3·h·f.
    ``attention``  the kernel's output, o_proj's input, h·e; ``blockwise`` and the CP ring return it as [b, a, s, d],
                   which o_proj's transpose copies (h·e more; sdpa's CPU flash kernel lays its output out as
                   [b, s, a, d] already, the transpose is a view; naive keeps the copy only); sdpa, blockwise and
                   the ring also keep the fp32 logsumexp of each query row and head (4·a). With ``selective``
                   recomputation only o_proj's input h·e stays; the kernel's own tensors are recomputed.
    ``scores``     ``naive`` only, not with ``selective``: :func:`naive_score_bytes`' ``kept``.
    ``mlp``        SwiGLU: gate, silu(gate), up and silu(gate)·up, 4·f·e; GELU (GPT): fc_in's output and gelu's,
                   2·f·e; MoE with k experts per token: each expert a token visits keeps SwiGLU's 4·f·e plus its
                   gathered input row, its output row and that row times the routing weight (3·h·e), the router its
                   logits and fp32 probabilities ((e + 4)·E): k·(4·f + 3·h)·e + (e + 4)·E (the routing indices and
                   weights, at most 28·k + 4 bytes, are not counted).

    TP splits heads and ffn columns: everything but ``norms`` is divided by t; with SP the norms' too (they run on the
    sequence shard; Korthikanti et al.'s layout, where the projections' gathered input is not kept either)."""
    h, a = model.hidden_size, model.num_attention_heads
    head_dim = head_width(model)
    g = (model.num_kv_heads or a) * head_dim
    q = a * head_dim  # = h unless model.head_dim says otherwise (Qwen3-0.6B: 2048 for h 1024)
    copies = 1 if kernel in ("sdpa", "naive") or selective else 2  # the kernel's output, o_proj's transposed copy
    lse = 0 if selective or kernel == "naive" else 4 * a
    qkv = 3 * q * 4 if kernel == "naive" and not selective else (q + 2 * g) * act
    experts, top_k = moe_experts(model)
    if experts:
        mlp = top_k * (4 * model.ffn_hidden_size + 3 * h) * act + (act + 4) * experts
    else:
        mlp = (4 if mlp_matrices(model) == 3 else 2) * model.ffn_hidden_size * act
    tokens = s * b
    scores = naive_score_bytes(s, b, a, autocast)["kept"] if kernel == "naive" and not selective else 0.0
    return {
        "norms": 2 * _norm_bytes(model, act) * tokens / (tp if sequence_parallel else 1),
        "qkv": qkv * tokens / tp,
        "attention": (copies * q * act + lse) * tokens / tp,
        "scores": scores / tp,
        "mlp": mlp * tokens / tp,
    }


def padded_vocab_size(model: Any, tp: int) -> int:
    """The rows the embedding and head hold under TP: the vocabulary padded to a multiple of
    make_vocab_size_divisible_by × TP (nxdt.parallel.tensor_parallel.ShardSpec). Memory counts them; FLOPs and
    MFU do not (their logits are masked, the work a run is credited with is the true vocabulary's)."""
    if tp == 1:
        return int(model.vocab_size)
    multiple = int(getattr(model, "make_vocab_size_divisible_by", 1)) * tp
    return -(-int(model.vocab_size) // multiple) * multiple


def head_saved_bytes(model: Any, s: float, b: int, tp: int, sequence_parallel: bool, act: int) -> dict[str, float]:
    """Bytes the final norm, the output head and the loss hold for one micro-batch of s·b tokens, V the vocabulary:
    ``final_norm``, :func:`_norm_bytes` (/ t with SP); ``log_probs``, the fp32 log-probabilities cross-entropy keeps
    (4·V/t per token; the logits themselves are not kept); ``loss_gradients``, at the start of backward their gradient
    and the logits' gradient (log-softmax backward holds both with its saved output: 8·V/t per token) — the peak
    of the backward pass with a flash kernel (with naive attention the peak layer's S×S gradients come later, when
    these are freed again: counting both over-states naive's peak by at most this term)."""
    tokens = s * b
    vocab = 4 * padded_vocab_size(model, tp) / tp * tokens
    return {
        "final_norm": _norm_bytes(model, act) * tokens / (tp if sequence_parallel else 1),
        "log_probs": vocab,
        "loss_gradients": 2 * vocab,
    }


def naive_score_bytes(s: float, b: int, heads: float, autocast: bool) -> dict[str, float]:
    """S×S bytes of ``models.attention.naive_attention`` for ``heads`` query heads (a rank's, under TP).

    ``kept`` per layer, for backward: the softmax probabilities, fp32 whatever the precision (scores are computed in
    fp32; softmax saves its output and the V matmul reuses it): 4·a·s²·b; under autocast (mixed_precision) also the
    bf16 copy autocast makes of them for the V matmul: + 2·a·s²·b; and the boolean mask ``masked_fill`` keeps:
    s²·b (its [s, s] is not per head; b counts the packed-segment case's [b, s, s]).
    ``transient``, once per step: the peak layer's backward holds the probabilities' gradient and the scores'
    gradient (softmax backward) at once, two fp32 [b, a, s, s] tensors: 8·a·s²·b. (Measured on llama_tiny at 2k
    tokens, fp32: experiments/attention-memory.)"""
    square = s * s * b
    return {"kept": square * (heads * (6 if autocast else 4) + 1), "transient": 8 * heads * square}


def _fsdp_gathered(cfg: Any, n: dict[str, float], tp: int, pp: int, gather_bytes: int, ep: int = 1) -> float:
    """Bytes of gathered (unsharded) FSDP units one rank holds at the peak: ``prefetch_distance + 1`` consecutive
    units (the running one and the prefetched ones), the largest such window of the stage's unit sequence
    (embedding, layers, final norm + head); ``eager``, ``reshard_after_forward: false`` or pipeline parallelism (each
    unit gathered once per step: nxdt.parallel.fsdp) keep every unit of the stage gathered; a tied embedding/head is
    one resident unit that stays gathered for the whole step."""
    model, fsdp = cfg.model, cfg.distributed_strategy.fsdp
    layers = math.ceil(model.num_layers / pp)
    layer = n["per_layer"] - n["expert_params"] / model.num_layers * (1 - 1 / ep)  # a layer's unit holds its E/EP experts
    if model.tie_word_embeddings:
        resident, ends = n["embedding"] + model.hidden_size, (0.0, 0.0)
    else:
        resident, ends = 0.0, (n["embedding"], n["head"] + model.hidden_size)
    # the fullest stage: the first (embedding + layers) or the last (layers + head); with PP 1 both ends
    stages = [[ends[0], *[layer] * layers, ends[1]]] if pp == 1 else [[ends[0], *[layer] * layers], [*[layer] * layers, ends[1]]]
    if fsdp.prefetch == "eager" or not fsdp.reshard_after_forward or pp > 1:
        held = max(sum(units) for units in stages)
    else:
        window = 1 + fsdp.prefetch_distance
        held = max(sum(units[i : i + window]) for units in stages for i in range(max(1, len(units) - window + 1)))
    return (held + resident) / tp * gather_bytes


def memory_per_rank(cfg: Any, degrees: dict[str, int]) -> dict[str, float]:
    """Bytes one rank holds: parameters, gradients, optimizer state (fp32 master weights included), activations,
    logits, and with FSDP the gathered units.

    Sharding over data parallelism: ZeRO-1 shards the optimizer state (moments and fp32 master weights) over DP
    and keeps whole parameters and gradients; FSDP shards parameters, gradients and optimizer state over DP (its
    parameter shard *is* the master copy with mixed_precision: an fp32 shard, 4 + 4 + 8 bytes / DP, gathered in
    bf16 for compute) plus the gathered units (:func:`_fsdp_gathered`). Expert parameters are replicated over
    DP / EP ranks only (EP subdivides DP), so that is what their state is sharded over."""
    model, ds, data = cfg.model, cfg.distributed_strategy, cfg.data
    tp, pp, dp, ep = degrees["tp"], degrees["pp"], degrees["dp"], degrees["ep"]
    replicas = dp * degrees.get("cp", 1)  # what ZeRO-1 / FSDP shard over: CP ranks hold the same weights as DP ranks
    n = model_numbers(model)
    dense = (n["total"] - n["expert_params"]) / (tp * pp)  # per rank, before any DP sharding
    experts = n["expert_params"] / (tp * pp * ep)
    edp = max(1, dp // ep) * degrees.get("cp", 1)  # ranks holding the same experts (over DP and CP: edp_cp)
    per = bytes_per_parameter(cfg)
    fsdp = ds.fsdp.enabled
    lora = lora_trainable_per_rank(cfg, tp, pp)
    if fsdp:  # everything sharded; the fp32 shard of mixed_precision is the master copy (no separate one)
        p_bytes = 4 if _kind(cfg) == "mixed_precision" else per["params"]
        state = per["moments"]
        held = dense / replicas + experts / edp
        trained = held if lora is None else lora / replicas  # LoRA: the adapters only
        mem = {
            "parameters": (held + (lora or 0.0) / replicas) * p_bytes,
            "gradients": trained * per["grads"],
            "optimizer": trained * state,
            "gathered_parameters": _fsdp_gathered(cfg, n, tp, pp, per["params"], ep),
        }
        if pp > 1:  # the stage's gradients summed unsharded over the step's micro-batches, in fp32 (the reduce dtype)
            mem["accumulated_gradients"] = (dense + experts if lora is None else lora) * 4
    else:
        state = per["moments"] + per["master"]
        trained = dense + experts if lora is None else lora  # LoRA: the adapters only
        sharded = (dense / replicas + experts / edp if lora is None else lora / replicas) if ds.zero1 else trained
        mem = {
            "parameters": (dense + experts + (lora or 0.0)) * per["params"],
            "gradients": trained * per["grads"],
            "optimizer": sharded * state,
        }
    s, b, h, a = data.seq_length, data.micro_batch_size, model.hidden_size, model.num_attention_heads
    s_local = s / degrees.get("cp", 1)
    act_bytes = _bytes(_kind(cfg))  # activations: fp32 with fp32, bf16 otherwise (mixed_precision computes in bf16)
    # the S×S scores exist only when core attention materialises them (naive); sdpa and blockwise work in tiles, and
    # so does ring attention under context parallelism (whatever core_attention says: it saves out and lse only)
    kernel = "ring" if degrees.get("cp", 1) > 1 else getattr(model, "core_attention", "sdpa")
    autocast = _kind(cfg) == "mixed_precision"
    granularity = model.activations_checkpoint_granularity
    sp = bool(ds.sequence_parallel) and tp > 1
    layer = lambda selective: sum(
        layer_saved_bytes(model, s_local, b, tp, sp, act_bytes, kernel, selective=selective, autocast=autocast).values()
    )
    if granularity == "full":
        # only each layer's input is kept: s·b·h elements (Korthikanti et al. 2022, Table 2: 2·s·b·h bytes), in
        # the sequence-parallel layout with SP (each TP rank holds s/t rows: 2·s·b·h/t)
        per_layer = s_local * b * h * act_bytes / (tp if sp else 1)
    else:
        per_layer = layer(granularity == "selective")
    microbatches = data.global_batch_size // (data.micro_batch_size * dp)
    in_flight = in_flight_microbatches(pp, microbatches, ds.virtual_pipeline_model_parallel_size)
    layers_here = math.ceil(model.num_layers / pp)  # the fullest stage
    mem["activations"] = per_layer * layers_here * in_flight
    if granularity == "full":  # one layer's full activations exist while it is recomputed in backward
        mem["activations"] += layer(False)
    if kernel == "naive":  # the peak layer's S×S gradients (heads split by TP)
        mem["activations"] += naive_score_bytes(s_local, b, a, autocast)["transient"] / tp
    # the last stage's final norm, fp32 log-probabilities and, at the start of backward, the loss's gradients
    mem["logits"] = sum(head_saved_bytes(model, s_local, b, tp, sp, act_bytes).values())
    if keeps_frozen_reference(cfg):  # a frozen copy of the starting weights, laid out as the policy's parameters
        mem["reference_model"] = mem["parameters"]
    return mem


def keeps_frozen_reference(cfg: Any) -> bool:
    """Whether training holds a frozen copy of the starting weights: DPO scoring its reference each step
    (``precompute_ref_log_probs: false``) or GRPO's KL (``beta`` != 0); with fresh LoRA adapters the policy with its
    adapters off is that reference, no copy."""
    mas = getattr(cfg, "model_alignment_strategy", None)
    dpo, grpo, peft = getattr(mas, "dpo", None), getattr(mas, "grpo", None), getattr(mas, "peft", None)
    fresh_adapters = peft is not None and not peft.load_lora_from_ckpt
    online_dpo = dpo is not None and not dpo.precompute_ref_log_probs
    return (online_dpo or (grpo is not None and grpo.beta != 0)) and not fresh_adapters


def ring_attention_flops(b: int, chunk: int, heads: float, head_dim: int) -> dict[str, float]:
    """Attention FLOPs of one ring step after the first (the block of another rank) for one layer and micro-batch:
    the queries' two chunks see two whole chunk×chunk tiles of it (the load-balanced split), each 2·c²·d for QKᵀ and
    2·c²·d for P·V per head in forward; backward recomputes QKᵀ and runs four more such products (dV, dP, dQ, dK)."""
    tile = 2 * chunk * chunk * head_dim * heads * b
    return {"forward": 2 * 2 * tile, "backward": 2 * 5 * tile}


def ring_rows(cfg: Any, plan: Any) -> list[dict[str, Any]]:
    """The ring's transfers of one optimizer step (context parallelism): per layer and micro-batch, CP − 1 K/V
    blocks in forward (twice with activation recomputation), CP − 1 in backward and CP hops of the dK/dV
    accumulators (the last one home). A K/V block is this rank's S/CP tokens × its KV heads (÷ TP, at least one: KV
    heads are replicated when fewer than TP) × head_dim, K and V, in the activations' dtype; dK/dV travel in fp32
    for 16-bit activations. ``hidden_by_flops``: the attention compute of the block in hand, which the transfer
    runs behind (:func:`ring_attention_flops`; in backward the K/V block and the accumulator share it)."""
    model, data = cfg.model, cfg.data
    cp = plan.cp
    if cp <= 1:
        return []
    act = _bytes(_kind(cfg))
    b, s_local = data.micro_batch_size, data.seq_length // cp
    head_dim = head_width(model)
    kv_heads = max(1.0, (model.num_kv_heads or model.num_attention_heads) / plan.tp)
    block = 2 * b * s_local * kv_heads * head_dim
    per_pass = model.num_layers // plan.pp * plan.micro_batches
    recompute = 2 if model.activations_checkpoint_granularity in ("full", "selective") else 1  # the ring runs again
    flops = ring_attention_flops(b, s_local // 2, model.num_attention_heads / plan.tp, head_dim)
    return [
        dict(
            dim="cp",
            op="send_recv",
            bytes=block * act,
            count=per_pass * (cp - 1) * recompute,
            overlap=True,
            hidden_by_flops=flops["forward"],
            what="ring: K/V blocks, forward",
        ),
        dict(
            dim="cp",
            op="send_recv",
            bytes=block * act,
            count=per_pass * (cp - 1),
            overlap=True,
            hidden_by_flops=flops["backward"] / 2,
            what="ring: K/V blocks, backward",
        ),
        dict(
            dim="cp",
            op="send_recv",
            bytes=block * 4,
            count=per_pass * cp,
            overlap=True,
            hidden_by_flops=flops["backward"] / 2,
            what="ring: dK/dV accumulators, backward",
        ),
    ]


def step_collectives(cfg: Any, plan: Any) -> list[dict[str, Any]]:
    """(dim, op, bytes, count per step, exposed?) for each kind of collective one optimizer step issues."""
    model, ds, data = cfg.model, cfg.distributed_strategy, cfg.data
    act = _bytes(_kind(cfg))
    n = model_numbers(model)
    b, s, h = data.micro_batch_size, data.seq_length // plan.cp, model.hidden_size
    microbatches = plan.micro_batches
    layers = model.num_layers // plan.pp
    recompute = 1.5 if model.activations_checkpoint_granularity == "full" else 1.0
    rows = []
    activation = b * s * h * act
    if plan.tp > 1:
        per = int(4 * layers * microbatches * recompute)
        if ds.sequence_parallel:
            rows += [
                dict(dim="tp", op="all_gather", bytes=activation, count=per, what="SP gather before attention/MLP"),
                dict(dim="tp", op="reduce_scatter", bytes=activation, count=per, what="SP scatter after attention/MLP"),
            ]
        else:
            rows.append(
                dict(
                    dim="tp",
                    op="all_reduce",
                    bytes=activation,
                    count=per,
                    what="row-parallel outputs and column-parallel input grads",
                )
            )
    rows += ring_rows(cfg, plan)
    if plan.ep > 1 and n["experts"]:
        rows.append(
            dict(
                dim="ep",
                op="all_to_all",
                bytes=activation * n["top_k"],
                count=4 * layers * microbatches,
                what="token dispatch and combine, forward and backward",
            )
        )
    if plan.pp > 1:
        # with SP the stage boundary is in the sequence-parallel layout: each TP rank sends its s/t rows, not a copy
        boundary = activation / plan.tp if ds.sequence_parallel and plan.tp > 1 else activation
        rows.append(
            dict(dim="pp", op="send_recv", bytes=boundary, count=2 * microbatches, what="activations forward, gradients backward")
        )
    if plan.dp * plan.cp > 1:
        dp_dim = "dp_cp" if plan.cp > 1 else "dp"  # CP ranks are weight replicas: DP × CP reduces and shards
        dense = n["total"] - n["expert_params"]
        params = dense / (plan.tp * plan.pp)
        lora = lora_trainable_per_rank(cfg, plan.tp, plan.pp)
        trained = params if lora is None else lora  # LoRA: only the adapters' gradients are reduced
        grad_bytes = 4 if _kind(cfg) in ("fp32", "mixed_precision") else 2
        if ds.fsdp.enabled:
            # units: the embedding, each layer, the head (merged with the embedding when tied); every micro-batch
            # gathers each unit for forward and again for backward (eager: once per step, all held) and
            # reduce-scatters its gradient. Behind compute except the first gather of each pass (nothing to hide it).
            # Under PP a stage (its layers and one end) gathers each unit once per step and reduce-scatters once
            per_step = plan.pp > 1
            units = layers + (1 if per_step or model.tie_word_embeddings else 2)
            unit = params / units
            policy = ds.fsdp.prefetch
            passes = 1 if policy == "eager" or per_step else 2 * microbatches
            hidden = policy != "none"
            rows.append(dict(dim=dp_dim, op="all_gather", bytes=unit * act, count=passes, what="FSDP first gather of a pass"))
            rows += [
                dict(
                    dim=dp_dim,
                    op="all_gather",
                    bytes=unit * act,
                    count=passes * (units - 1) if policy != "eager" else units - 1,
                    what="FSDP parameter gathers (prefetched)" if hidden else "FSDP parameter gathers",
                    overlap=hidden,
                ),
                dict(
                    dim=dp_dim,
                    op="reduce_scatter",
                    bytes=trained / units * grad_bytes,
                    count=units * (1 if per_step else microbatches),
                    what="FSDP gradient reduce-scatter",
                    overlap=hidden,
                ),
            ]
            if lora is None and 2 * h < ds.fsdp.param_persistence_threshold:  # norm weights kept whole (LoRA: frozen)
                rows.append(
                    dict(
                        dim=dp_dim,
                        op="all_reduce",
                        bytes=(2 * layers + 1) * h * grad_bytes,
                        count=1,
                        what="FSDP norm weights kept whole: gradients averaged once per step",
                    )
                )
        elif ds.zero1:
            rows += [
                dict(
                    dim=dp_dim,
                    op="reduce_scatter",
                    bytes=trained * grad_bytes,
                    count=1,
                    what="ZeRO-1 gradients",
                    **_behind_backward(cfg, plan, dp_dim),
                ),
                dict(dim=dp_dim, op="all_gather", bytes=trained * act, count=1, what="ZeRO-1 updated parameters"),
            ]
        else:
            rows.append(
                dict(
                    dim=dp_dim,
                    op="all_reduce",
                    bytes=trained * grad_bytes,
                    count=1,
                    what="gradients (one fp32 bucket)",
                    **_behind_backward(cfg, plan, dp_dim),
                )
            )
    rows += _expert_replica_rows(cfg, plan, n, layers, microbatches, act)
    return rows


def _expert_replica_rows(cfg: Any, plan: Any, n: dict[str, float], layers: int, microbatches: int, act: int) -> list[dict]:
    """Expert parallelism with more data-parallel ranks than EP: each rank's experts have replicas (``edp``, over CP
    too: ``edp_cp``), over which their gradients are summed — after backward (``reduce_expert_gradients``), in
    ZeRO-1's expert buckets (reduce-scatter, then the updated shards gathered) or in FSDP's expert flats (gathered per
    pass like their units, reduce-scattered per micro-batch; once per step under PP). LoRA trains no expert."""
    ds = cfg.distributed_strategy
    replicas = plan.dp // plan.ep * plan.cp
    if plan.ep == 1 or replicas == 1 or not n["experts"] or lora_trainable_per_rank(cfg, plan.tp, plan.pp) is not None:
        return []
    dim = "edp_cp" if plan.cp > 1 else "edp"
    experts = n["expert_params"] / (plan.tp * plan.pp * plan.ep)  # this rank's
    grad_bytes = 4 if _kind(cfg) in ("fp32", "mixed_precision") else 2
    if ds.fsdp.enabled:
        per_step = plan.pp > 1
        passes = 1 if ds.fsdp.prefetch == "eager" or per_step else 2 * microbatches
        hidden = ds.fsdp.prefetch != "none"
        unit = experts / layers
        return [
            dict(dim=dim, op="all_gather", bytes=unit * act, count=passes * layers, what="FSDP expert gathers", overlap=hidden),
            dict(
                dim=dim,
                op="reduce_scatter",
                bytes=unit * grad_bytes,
                count=layers * (1 if per_step else microbatches),
                what="FSDP expert gradient reduce-scatter",
                overlap=hidden,
            ),
        ]
    if ds.zero1:
        return [
            dict(dim=dim, op="reduce_scatter", bytes=experts * grad_bytes, count=1, what="ZeRO-1 expert gradients"),
            dict(dim=dim, op="all_gather", bytes=experts * act, count=1, what="ZeRO-1 updated experts"),
        ]
    return [dict(dim=dim, op="all_reduce", bytes=experts * grad_bytes, count=1, what="expert gradients over their replicas")]


DDP_BUCKET_BYTES = 25 << 20  # torch DDP's default bucket_cap_mb, which nxdt.parallel.overlap's buckets follow


def _behind_backward(cfg: Any, plan: Any, dp_dim: str) -> dict[str, Any]:
    """``{"behind_backward": True}`` where nxdt reduces the DP gradients in DDP's buckets during the last micro-batch's
    backward (nxdt.parallel.overlap, ``overlap_grad_reduce``): where cutting the reduction keeps its bits — a DP group
    of 2, or one inside a node (one host's shm) — and not with an interleaved pipeline or ZeRO-1 with EP (what
    ``NxDStrategy.overlap_off`` names). Else ``{}``: the reduction runs after backward, all of it exposed."""
    ds = cfg.distributed_strategy
    if not getattr(ds, "overlap_grad_reduce", False):
        return {}
    if ds.virtual_pipeline_model_parallel_size > 1 or (ds.zero1 and plan.ep > 1):
        return {}
    group = plan.groups[dp_dim][0]
    one_node = len({r // plan.ranks_per_node for r in group}) == 1
    return {"behind_backward": True} if len(group) == 2 or one_node else {}


def exposed_behind_backward(comm_s: float, backward_s: float, buckets: int) -> float:
    """What stays exposed of a DP gradient reduction of ``comm_s`` issued in ``buckets`` equal buckets during a backward
    of ``backward_s`` (DDP's reducer): gradients arrive evenly over the backward, bucket k (1-based) is full at
    k/buckets of it, and the buckets run one after another on the communication stream, each starting when it is full
    and the one before has finished. Exposed: how far the last one ends after the backward (at least the last bucket's
    time, whose gradients — the embedding's — come last)."""
    if comm_s <= 0:
        return 0.0
    buckets = max(1, buckets)
    each, end = comm_s / buckets, 0.0
    for k in range(1, buckets + 1):
        end = max(end, backward_s * k / buckets) + each
    return max(0.0, end - backward_s)


def context_parallel_figures(
    cfg: Any, degrees: dict[str, int], ring: list[dict[str, Any]], mem: dict[str, float]
) -> dict[str, float]:
    """What the ring costs and saves per rank and step: bytes sent (each transfer also receives as many), its time,
    how much of it hides behind attention compute, and the activation (and logits) bytes CP saves against CP = 1."""
    unsplit = memory_per_rank(cfg, {**degrees, "cp": 1})
    held = lambda m: m["activations"] + m["logits"]
    total = sum(r["total_s"] for r in ring)
    hidden = sum(r["hidden_s"] for r in ring)
    return {
        "ring_bytes_per_step": sum(r["bytes"] * r["count"] for r in ring),
        "ring_s": total,
        "ring_exposed_s": total - hidden,
        "ring_hidden_pct": 100.0 * hidden / total if total else 100.0,
        "activation_bytes_saved": held(unsplit) - held(mem),
    }


def _emulated_links(cfg: Any) -> dict[str, tuple[float, float]]:
    if getattr(cfg, "comm", None) is None or cfg.comm.emulate is None:
        return {}
    from nxdt.planner.links import emulated_links_for  # (links plans the emulated instance with this package)

    return emulated_links_for(cfg)


def emulated_seconds(op: str, n: int, nbytes: float, link: tuple[float, float]) -> float:
    """What nxdt.comm's link emulation adds to one collective of ``nbytes`` (the full buffer) on ``n`` ranks:
    latency once per shared-memory step (one step below the slot size) and the bytes each rank receives over
    the link's bandwidth — the one-shot (direct) formula of the cost model."""
    latency, bandwidth = link
    if n <= 1 or nbytes <= 0:
        return 0.0
    hops = 2 if op == "all_reduce" else 1
    moved = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0, "send_recv": 1.0}.get(op, (n - 1) / n) * nbytes
    return hops * latency + moved / bandwidth


def compute_efficiency(instance: Any, model: Any, tp: int, precision: str = "bf16", tokens: float = 0.0) -> float:
    """Achieved fraction of peak FLOP/s of the matmuls: ``E · g / (g + compute_half_size) · T / (T + compute_half_tokens)``
    with ``E`` the instance's ``compute_efficiency`` (``compute_efficiency_fp32`` for fp32 training, against
    ``peak_tflops_fp32``: fitted apart, its kernels and peak differ), ``g`` the per-rank GEMM width ``hidden_size / TP``
    (the narrowest dimension of the tensor-parallel matmuls) and ``T`` the tokens of one micro-batch on a rank (every
    GEMM's rows): narrow or short GEMMs keep a systolic array or tensor cores less busy and spend relatively more time
    moving operands (NVIDIA's "Matrix Multiplication Background" guide: throughput rises with each GEMM dimension until
    the device is full)."""
    return matmul_efficiency(instance, model.hidden_size / max(1, tp), precision, tokens)


def matmul_efficiency(instance: Any, width: float, precision: str = "bf16", tokens: float = 0.0) -> float:
    """:func:`compute_efficiency` for a per-rank GEMM width ``width`` (the fit's closed form uses it too)."""
    eff = instance.compute_efficiency
    fp32 = getattr(instance, "compute_efficiency_fp32", None)
    if precision == "fp32" and fp32 is not None:
        eff = fp32
    half = getattr(instance, "compute_half_size", 0.0)
    if half:
        eff *= width / (width + half)
    half_tokens = getattr(instance, "compute_half_tokens", 0.0)
    if half_tokens and tokens:
        eff *= tokens / (tokens + half_tokens)
    return eff


def memory_bound_bytes(cfg: Any, plan: Any) -> dict[str, float]:
    """Bytes one rank moves through device memory per optimizer step in the work that is no matmul (priced at the
    device's memory bandwidth, not its FLOP/s), counted per token from the tensors each kernel reads and writes
    (e bytes per activation element; h hidden, f ffn, S sequence, a heads, V vocabulary):

    ``elementwise``  per layer and token in forward: the two norms (read h, write h each: 4h), the two residual adds
                     (read 2h, write h: 6h), the MLP's activation (SwiGLU reads gate and up, writes f: 3f; GELU 2f),
                     and with ``core_attention: naive`` the S×S scores' scale, mask and softmax, three kernels each
                     reading and writing S·a (6·S·a: models/attention.py naive_attention runs them as three torch ops,
                     as unfused BERT-era attention does; a fused or flash kernel keeps them on chip); backward twice
                     that, full recomputation one more forward. TP splits the MLP and attention parts; the norms and
                     residual adds too with SP.
    ``loss``         per token: the head's logits read and the fp32 log-probabilities written in forward, read and the
                     logits' gradient written in backward: (2·e + 8)·V / TP.
    ``optimizer``    once per step, every parameter this rank updates (sharded by ZeRO-1 / FSDP): read and write the
                     weights, the fp32 master copy and the two moments, read the gradient (:func:`bytes_per_parameter`)."""
    model, data, ds = cfg.model, cfg.data, cfg.distributed_strategy
    kind = _kind(cfg)
    e = _bytes(kind)
    h, f, heads, vocab = model.hidden_size, model.ffn_hidden_size, model.num_attention_heads, model.vocab_size
    s = data.seq_length
    tp, pp = plan.tp, plan.pp
    tokens = data.global_batch_size * s / (plan.dp * plan.cp)  # this rank's tokens per step (CP: its S/CP of each)
    activation = (3 if mlp_matrices(model) == 3 else 2) * f
    scores = 6 * s * heads if model.core_attention == "naive" else 0.0
    whole = 10 * h / (tp if ds.sequence_parallel else 1)
    passes = 3 + (1 if model.activations_checkpoint_granularity == "full" else 0)
    elementwise = tokens * model.num_layers / pp * passes * e * (whole + (activation + scores) / tp)
    loss = tokens * (2 * e + 8) * vocab / tp / pp  # the last stage's, spread over the stages as the FLOPs are
    n = model_numbers(model)
    params = (n["total"] - n["expert_params"]) / (tp * pp)
    lora = lora_trainable_per_rank(cfg, tp, pp)
    updated = params if lora is None else lora
    if ds.zero1 or ds.fsdp.enabled:
        updated /= plan.dp * plan.cp
    per = bytes_per_parameter(cfg)
    optimizer = updated * (2 * (per["params"] + per["master"] + per["moments"]) + per["grads"])
    return {"elementwise": elementwise, "loss": loss, "optimizer": optimizer}


def estimate_plan(plan: Any, cfg: Any, topo: Topology, calibration: dict[str, Any] | None = None) -> None:
    """Fill ``plan.algorithms``, ``plan.collectives``, ``plan.estimate`` and memory warnings in place."""
    inst, data = cfg.instance, cfg.data
    d = plan.degrees
    rows = []
    emulated = _emulated_links(cfg)
    for row in step_collectives(cfg, plan):
        group = plan.groups[row["dim"]][0]
        algorithm, seconds, _ = estimate_collective(row["op"], group, row["bytes"], topo, inst, plan.ranks_per_node, calibration)
        if row["dim"] in emulated:  # comm.emulate: every transfer also sleeps the emulated link's time
            seconds += emulated_seconds(row["op"], len(group), row["bytes"], emulated[row["dim"]])
        plan.algorithms.setdefault(row["dim"], {})[row["op"]] = algorithm
        rows.append(
            {
                **row,
                "group_size": len(group),
                "algorithm": algorithm,
                "seconds": seconds,
                "busbw_GBps": bus_bandwidth(row["op"], len(group), row["bytes"], seconds) / 1e9,
                "total_s": seconds * row["count"],
                "overlap": row.get("overlap", False),
            }
        )
    plan.collectives = rows

    precision = _kind(cfg)
    peak = (inst.peak_tflops_fp32 if precision == "fp32" else inst.peak_tflops_bf16) * 1e12
    if calibration and topo.graph == "host" and calibration.get("flops_per_s"):
        peak = calibration["flops_per_s"] / inst.compute_efficiency  # measured rate is already the achieved one
        # ranks outnumbering the host's cores share them: scale from the calibration's ranks to this plan's
        cpus = calibration.get("cpus") or 1
        share = lambda ranks: min(1.0, cpus / max(1, ranks))
        peak *= share(plan.ranks_per_node) / share(calibration.get("flops_ranks", 2))
    per_rank_peak = peak / plan.ranks_per_device if topo.graph != "host" else peak
    tokens = data.global_batch_size * data.seq_length
    fpt = flops_per_token(cfg.model, data.seq_length)
    recompute = 4 / 3 if cfg.model.activations_checkpoint_granularity == "full" else 1.0
    flops_rank = fpt * tokens * recompute / plan.world_size
    tokens_mb = data.micro_batch_size * data.seq_length / plan.cp
    efficiency = compute_efficiency(inst, cfg.model, plan.tp, precision, tokens_mb)
    matmul = flops_rank / (per_rank_peak * efficiency) if per_rank_peak else 0.0
    hbm = getattr(inst, "memory_bandwidth_GBps", 0.0) * 1e9 / (plan.ranks_per_device if topo.graph != "host" else 1)
    moved = memory_bound_bytes(cfg, plan) if hbm else {}
    memory_bound = sum(moved.values()) / hbm if hbm else 0.0
    compute = matmul + memory_bound
    microbatches = plan.micro_batches
    v = cfg.distributed_strategy.virtual_pipeline_model_parallel_size
    bubble = compute * (plan.pp - 1) / (v * microbatches) if plan.pp > 1 else 0.0
    comm = sum(r["total_s"] for r in rows)
    ring = [r for r in rows if "hidden_by_flops" in r]  # context parallelism: each transfer hides behind its own block
    rate = per_rank_peak * inst.compute_efficiency
    for r in ring:
        r["hidden_s"] = min(r["seconds"], r["hidden_by_flops"] / rate if rate else 0.0) * r["count"]
    ring_total, ring_exposed = sum(r["total_s"] for r in ring), sum(r["total_s"] - r["hidden_s"] for r in ring)
    overlappable = sum(r["total_s"] for r in rows if r["overlap"] and "hidden_by_flops" not in r)
    # what prefetched FSDP traffic can hide behind: compute, and with token_threaded (its own stream, on the DP
    # links) also the blocking collectives of the other dimensions (TP, ...); eager's gathers queue on the TP stream
    cover = compute
    fsdp = cfg.distributed_strategy.fsdp
    if fsdp.enabled and fsdp.prefetch == "token_threaded":
        cover += sum(r["total_s"] for r in rows if not r["overlap"] and r["dim"] != "dp")
    exposed = comm - ring_total - overlappable + max(0.0, overlappable - cover) + ring_exposed
    # DP gradients reduced during the last micro-batch's backward (about 2/3 of its compute; 3/4 with full
    # recomputation, whose backward reruns the forward) in 25 MiB buckets: only what outlasts it is exposed
    backward_share = 3 / 4 if cfg.model.activations_checkpoint_granularity == "full" else 2 / 3
    last_backward = compute / max(1, microbatches) * backward_share
    for r in rows:
        if r.get("behind_backward"):
            buckets = math.ceil(r["bytes"] / DDP_BUCKET_BYTES)
            r["exposed_s"] = exposed_behind_backward(r["total_s"], last_backward, buckets)
            exposed -= r["total_s"] - r["exposed_s"]
    step = compute + bubble + exposed
    mem = memory_per_rank(cfg, d)
    per_rank = sum(mem.values())
    per_device = per_rank * (plan.ranks_per_device if topo.graph != "host" else 1)
    plan.estimate = {
        "step_time_s": step,
        "compute_s": compute,
        "memory_bound_s": memory_bound,  # of compute_s: the non-matmul work at the memory's bandwidth
        "bubble_s": bubble,
        "comm_s": comm,
        "exposed_comm_s": exposed,
        "tokens_per_s": tokens / step if step else 0.0,
        "mfu": fpt * tokens / (step * plan.world_size * per_rank_peak) if step and per_rank_peak else 0.0,
        "flops_per_token": fpt,
        "memory_per_rank_bytes": mem,
        "memory_per_device_GiB": per_device / GiB,
        "device_memory_GiB": inst.memory_GiB,
        "calibrated": bool(calibration and topo.graph == "host"),
    }
    if plan.estimate["calibrated"]:  # which measurement the figures come from (nxdt.planner.calibration)
        plan.estimate["calibration"] = provenance(calibration or {})
    if ring:
        plan.estimate["context_parallel"] = context_parallel_figures(cfg, d, ring, mem)
    if inst.memory_GiB and per_device > inst.memory_GiB * GiB:
        plan.warnings.append(
            f"does not fit: {per_device / GiB:.1f} GiB per device estimated, a {inst.name} device has "
            f"{inst.memory_GiB:g} GiB (raise TP/PP, enable zero1/fsdp or activation checkpointing)"
        )
