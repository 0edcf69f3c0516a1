"""Step-time and memory estimates of a Plan: the collectives one optimizer step issues, the compute,
pipeline bubble and overlap, and the bytes each device holds. Pure arithmetic on the config.

Model size comes from the config (a decoder-only transformer: attention with grouped KV heads,
gated MLP of ``ffn_hidden_size``, optional ``moe`` experts), not from building the model.

Activation memory per layer and micro-batch follows Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models"), for 16-bit activations of a GPT block:
``s·b·h·(34 + 5·a·s/h)`` bytes, with TP ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``, with TP+SP
``s·b·h·(34 + 5·a·s/h)/t``; selective recomputation drops the ``5·a·s/h`` term, full recomputation
keeps only the layer input ``2·s·b·h``. It is an approximation for SwiGLU blocks (noted in the plan).
The ``5·a·s/h`` term is the S×S attention scores (QKᵀ, softmax, dropout mask): it is counted only with
``model.core_attention: naive``; ``sdpa`` (a fused flash kernel) and ``blockwise`` keep no S×S tensor, only
a logsumexp per query row (4·a·s·b bytes, negligible, not counted).
"""

from __future__ import annotations

from typing import Any

from nxdt.planner.cost import bus_bandwidth, estimate_collective
from nxdt.topology import Topology

GiB = 1024**3


def model_numbers(model: Any) -> dict[str, float]:
    """Parameter counts of a decoder-only transformer config."""
    h, layers, vocab = model.hidden_size, model.num_layers, model.vocab_size
    heads = model.num_attention_heads
    kv = model.num_kv_heads or heads
    head_dim = h // heads
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2  # q, o + k, v
    moe = getattr(model, "moe", None)
    experts = getattr(moe, "num_experts", 0) or 0
    top_k = getattr(moe, "top_k", 0) or 0
    mlp_one = 3 * h * model.ffn_hidden_size
    mlp_total = mlp_one * experts + h * experts if experts else mlp_one
    mlp_active = mlp_one * top_k + h * experts if experts else mlp_one
    per_layer = attn + mlp_total + 2 * h
    embed = vocab * h
    head = 0 if model.tie_word_embeddings else vocab * h
    total = layers * per_layer + embed + head + h
    matmul_active = layers * (attn + mlp_active) + vocab * h  # weights used in matmuls per token (output head included)
    return {"total": total, "per_layer": per_layer, "embedding": embed, "head": head, "expert_params": layers * mlp_one * experts,
            "matmul_active": matmul_active, "experts": experts, "top_k": top_k}


def flops_per_token(model: Any, seq_length: int) -> float:
    """Training FLOPs per token (6·N_active + 12·L·h·s, the Megatron/PaLM MFU convention)."""
    n = model_numbers(model)
    return 6.0 * n["matmul_active"] + 12.0 * model.num_layers * model.hidden_size * seq_length


def _kind(cfg: Any) -> str:
    """precision.type as the memory model sees it: the SR types store what their base types store."""
    return cfg.precision.type.removesuffix("SR")


def _bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def memory_per_rank(cfg: Any, degrees: dict[str, int]) -> dict[str, float]:
    """Bytes one rank holds: parameters, gradients, optimizer state, activations."""
    model, ds, data = cfg.model, cfg.distributed_strategy, cfg.data
    tp, pp, dp, ep = degrees["tp"], degrees["pp"], degrees["dp"], degrees["ep"]
    n = model_numbers(model)
    dense = n["total"] - n["expert_params"]
    params = dense / (tp * pp) + n["expert_params"] / (tp * pp * ep)
    precision = _kind(cfg)
    p_bytes = _bytes(precision)
    g_bytes = 4 if precision in ("fp32", "mixed_precision") else 2
    state_bytes = 8 if (precision != "bf16" or model.optim.name == "adamw_fp32OptState") else 4
    master = 4 if precision == "mixed_precision" else 0
    fsdp = ds.fsdp.enabled
    shard = dp if fsdp else 1
    mem = {"parameters": params * p_bytes / shard, "gradients": params * g_bytes / shard,
           "optimizer": params * (state_bytes + master) / (dp if (ds.zero1 or fsdp) else 1)}
    if fsdp:  # gathered units held at once: the running one plus the prefetched ones (eager: all of them)
        held = model.num_layers / pp if ds.fsdp.prefetch == "eager" else 1 + ds.fsdp.prefetch_distance
        mem["gathered_parameters"] = held * n["per_layer"] / tp * p_bytes
    s, b, h, a = data.seq_length, data.micro_batch_size, model.hidden_size, model.num_attention_heads
    s_local = s / degrees["cp"]
    # the S×S scores exist only when core attention materialises them (naive); sdpa and blockwise work in tiles
    attention_quadratic = 5 * a * s_local / h if getattr(model, "core_attention", "sdpa") == "naive" else 0.0
    granularity = model.activations_checkpoint_granularity
    if granularity == "full":
        per_layer = 2 * s_local * b * h
    else:
        quad = 0 if granularity == "selective" else attention_quadratic
        if ds.sequence_parallel:
            per_layer = s_local * b * h * (34 + quad) / tp
        else:
            per_layer = s_local * b * h * (10 + 24 / tp + quad / tp)
    per_layer *= 2 if precision == "fp32" else 1
    microbatches = data.global_batch_size // (data.micro_batch_size * dp)
    in_flight = min(pp, microbatches) if pp > 1 else 1
    layers_here = model.num_layers / pp
    mem["activations"] = per_layer * layers_here * in_flight
    if granularity == "full":  # one layer's full activations exist during its recomputation
        mem["activations"] += s_local * b * h * (34 + attention_quadratic) / tp * (2 if precision == "fp32" else 1)
    mem["logits"] = s_local * b * model.vocab_size / tp * 4 * 2  # fp32 logits and their gradient on the last stage
    return mem


def step_collectives(cfg: Any, plan: Any) -> list[dict[str, Any]]:
    """(dim, op, bytes, count per step, exposed?) for each kind of collective one optimizer step issues."""
    model, ds, data = cfg.model, cfg.distributed_strategy, cfg.data
    d = plan.degrees
    act = _bytes(_kind(cfg))
    n = model_numbers(model)
    b, s, h = data.micro_batch_size, data.seq_length // d["cp"], model.hidden_size
    microbatches = data.global_batch_size // (data.micro_batch_size * d["dp"])
    layers = model.num_layers // d["pp"]
    recompute = 1.5 if model.activations_checkpoint_granularity == "full" else 1.0
    rows = []
    activation = b * s * h * act
    if d["tp"] > 1:
        per = int(4 * layers * microbatches * recompute)
        if ds.sequence_parallel:
            rows += [dict(dim="tp", op="all_gather", bytes=activation, count=per, what="SP gather before attention/MLP"),
                     dict(dim="tp", op="reduce_scatter", bytes=activation, count=per, what="SP scatter after attention/MLP")]
        else:
            rows.append(dict(dim="tp", op="all_reduce", bytes=activation, count=per, what="row-parallel outputs and column-parallel input grads"))
    if d["cp"] > 1:
        kv = model.num_kv_heads or model.num_attention_heads
        kv_bytes = 2 * b * data.seq_length * kv * (h // model.num_attention_heads) * act / d["tp"]
        rows += [dict(dim="cp", op="all_gather", bytes=kv_bytes, count=layers * microbatches, what="K/V of the whole sequence"),
                 dict(dim="cp", op="reduce_scatter", bytes=kv_bytes, count=layers * microbatches, what="K/V gradients")]
    if d["ep"] > 1 and n["experts"]:
        rows.append(dict(dim="ep", op="all_to_all", bytes=activation * n["top_k"], count=4 * layers * microbatches,
                         what="token dispatch and combine, forward and backward"))
    if d["pp"] > 1:
        rows.append(dict(dim="pp", op="send_recv", bytes=activation, count=2 * microbatches, what="activations forward, gradients backward"))
    if d["dp"] > 1:
        dense = n["total"] - n["expert_params"]
        params = dense / (d["tp"] * d["pp"])
        grad_bytes = 4 if _kind(cfg) in ("fp32", "mixed_precision") else 2
        if ds.fsdp.enabled:
            # units: the embedding, each layer, the head (merged with the embedding when tied); every micro-batch
            # gathers each unit for forward and again for backward (eager: once per step, all held) and
            # reduce-scatters its gradient. Behind compute except the first gather of each pass (nothing to hide it)
            units = layers + (1 if model.tie_word_embeddings else 2)
            unit = params / units
            policy = ds.fsdp.prefetch
            passes = 1 if policy == "eager" else 2 * microbatches
            hidden = policy != "none"
            rows.append(dict(dim="dp", op="all_gather", bytes=unit * act, count=passes, what="FSDP first gather of a pass"))
            rows += [dict(dim="dp", op="all_gather", bytes=unit * act, count=passes * (units - 1) if policy != "eager" else units - 1,
                          what="FSDP parameter gathers (prefetched)" if hidden else "FSDP parameter gathers", overlap=hidden),
                     dict(dim="dp", op="reduce_scatter", bytes=unit * grad_bytes, count=units * microbatches,
                          what="FSDP gradient reduce-scatter", overlap=hidden)]
            if 2 * h < ds.fsdp.param_persistence_threshold:  # norm weights ride along their unit, kept whole
                rows.append(dict(dim="dp", op="all_reduce", bytes=(2 * layers + 1) * h * grad_bytes, count=1,
                                 what="FSDP norm weights kept whole: gradients averaged once per step"))
        elif ds.zero1:
            rows += [dict(dim="dp", op="reduce_scatter", bytes=params * grad_bytes, count=1, what="ZeRO-1 gradients"),
                     dict(dim="dp", op="all_gather", bytes=params * act, count=1, what="ZeRO-1 updated parameters")]
        else:
            rows.append(dict(dim="dp", op="all_reduce", bytes=params * grad_bytes, count=1, what="gradients (one fp32 bucket)"))
    return rows


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
        rows.append({**row, "group_size": len(group), "algorithm": algorithm, "seconds": seconds,
                     "busbw_GBps": bus_bandwidth(row["op"], len(group), row["bytes"], seconds) / 1e9,
                     "total_s": seconds * row["count"], "overlap": row.get("overlap", False)})
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
    compute = flops_rank / (per_rank_peak * inst.compute_efficiency) if per_rank_peak else 0.0
    microbatches = data.global_batch_size // (data.micro_batch_size * d["dp"])
    v = cfg.distributed_strategy.virtual_pipeline_model_parallel_size
    bubble = compute * (d["pp"] - 1) / (v * microbatches) if d["pp"] > 1 else 0.0
    comm = sum(r["total_s"] for r in rows)
    overlappable = sum(r["total_s"] for r in rows if r["overlap"])
    # what prefetched FSDP traffic can hide behind: compute, and with token_threaded (its own stream, on the DP
    # links) also the blocking collectives of the other dimensions (TP, ...); eager's gathers queue on the TP stream
    cover = compute
    fsdp = cfg.distributed_strategy.fsdp
    if fsdp.enabled and fsdp.prefetch == "token_threaded":
        cover += sum(r["total_s"] for r in rows if not r["overlap"] and r["dim"] != "dp")
    exposed = comm - overlappable + max(0.0, overlappable - cover)
    step = compute + bubble + exposed
    mem = memory_per_rank(cfg, d)
    per_rank = sum(mem.values())
    per_device = per_rank * (plan.ranks_per_device if topo.graph != "host" else 1)
    plan.estimate = {
        "step_time_s": step, "compute_s": compute, "bubble_s": bubble, "comm_s": comm, "exposed_comm_s": exposed,
        "tokens_per_s": tokens / step if step else 0.0,
        "mfu": fpt * tokens / (step * plan.world_size * per_rank_peak) if step and per_rank_peak else 0.0,
        "flops_per_token": fpt, "memory_per_rank_bytes": mem, "memory_per_device_GiB": per_device / GiB,
        "device_memory_GiB": inst.memory_GiB, "calibrated": bool(calibration and topo.graph == "host"),
    }
    if inst.memory_GiB and per_device > inst.memory_GiB * GiB:
        plan.warnings.append(f"does not fit: {per_device / GiB:.1f} GiB per device estimated, a {inst.name} device has "
                             f"{inst.memory_GiB:g} GiB (raise TP/PP, enable zero1/fsdp or activation checkpointing)")
