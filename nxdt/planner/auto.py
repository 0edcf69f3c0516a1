"""``distributed_strategy=auto``: plan every TP × PP layout of the world, keep the ones the topology
accepts and memory holds, rank them by estimated tokens/s.

TP runs over divisors of the ranks per node (TP across nodes is never worth it), PP over divisors of
the layer count; DP is what remains. ``kv_replicator`` is raised when TP exceeds the KV heads (as a
user would) and sequence parallelism comes with TP > 1, as NxDT configs do; every other key (batch, precision, zero1, FSDP, checkpointing) is the user's.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from nxdt.config import ConfigError, compose_config
from nxdt.config.validate import devices_per_node, validate
from nxdt.planner import plan


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def auto_layouts(overrides: list[str], top: int = 10, compose: Callable[[list[str]], Any] | None = None) -> dict[str, Any]:
    """``compose``: overrides → Config (default: nxdt's config tree; ``nxdt plan --config-path`` passes NxDT's)."""
    base = (compose or (lambda o: compose_config(o, paths=False)))(overrides)
    devices = devices_per_node(base)
    world = devices * base.trainer.num_nodes
    model = base.model
    kv = model.num_kv_heads or model.num_attention_heads
    ranked, rejected = [], {}
    for tp in _divisors(devices):
        if model.num_attention_heads % tp:
            continue
        for pp in _divisors(model.num_layers):
            if world % (tp * pp):
                continue
            cfg = copy.deepcopy(base)
            ds = cfg.distributed_strategy
            ds.tensor_model_parallel_size, ds.pipeline_model_parallel_size = tp, pp
            ds.kv_replicator = max(1, tp // kv) if tp > kv else 1
            ds.sequence_parallel = tp > 1  # NxDT pairs TP with SP: activations outside TP regions are sharded too
            label = f"TP{tp} PP{pp} DP{world // (tp * pp)}"
            try:
                validate(cfg, paths=False)  # a plan needs no data or weight files
                p = plan(cfg)
            except ConfigError as exc:
                rejected[label] = exc.fix
                continue
            if any(w.startswith("does not fit") for w in p.warnings):
                rejected[label] = f"does not fit ({p.estimate['memory_per_device_GiB']:.0f} GiB per device)"
                continue
            e = p.estimate
            ranked.append(
                {
                    "tp": tp,
                    "pp": pp,
                    "dp": p.dp,
                    "tokens_per_s": e["tokens_per_s"],
                    "step_time_s": e["step_time_s"],
                    "mfu": e["mfu"],
                    "memory_per_device_GiB": e["memory_per_device_GiB"],
                    "device_order": p.device_order,
                    "overrides": [
                        f"distributed_strategy.tensor_model_parallel_size={tp}",
                        f"distributed_strategy.pipeline_model_parallel_size={pp}",
                    ]
                    + ([f"distributed_strategy.kv_replicator={ds.kv_replicator}"] if ds.kv_replicator > 1 else [])
                    + (["distributed_strategy.sequence_parallel=true"] if tp > 1 else []),
                }
            )
    ranked.sort(key=lambda r: -r["tokens_per_s"])
    return {
        "instance": base.instance.name,
        "world_size": world,
        "layouts": ranked[:top],
        "valid": len(ranked),
        "rejected": rejected,
    }


def render_ranking(result: dict[str, Any]) -> str:
    lines = [
        f"{result['instance']}: {result['world_size']} ranks — {result['valid']} valid layouts that fit, "
        f"{len(result['rejected'])} rejected; best first:"
    ]
    lines.append(f"  {'layout':<18}{'tokens/s':>12}{'step':>10}{'MFU':>7}{'GiB/dev':>9}  order")
    for r in result["layouts"]:
        lines.append(
            f"  {'TP%d PP%d DP%d' % (r['tp'], r['pp'], r['dp']):<18}{r['tokens_per_s']:>12.4g}{r['step_time_s']:>9.3g}s"
            f"{100 * r['mfu']:>6.1f}%{r['memory_per_device_GiB']:>9.1f}  {r['device_order']}"
        )
    if result["layouts"]:
        lines.append("run the best with: " + " ".join(result["layouts"][0]["overrides"]))
    else:
        lines.append("no layout fits; reasons: " + "; ".join(f"{k}: {v}" for k, v in list(result["rejected"].items())[:6]))
    return "\n".join(lines)
