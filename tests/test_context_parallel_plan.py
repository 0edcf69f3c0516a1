"""The planner's price of context parallelism (nxdt/planner/estimate.py), pinned by hand-computed numbers.

llama_tiny (hidden 128, 4 heads of 32, 2 KV heads, 4 layers, vocabulary 256), sequence 512, CP2 on 2 ranks, fp32,
micro-batch 1, global batch 2 (DP1: 2 micro-batches per step). Each rank holds 256 tokens, as two chunks of 128.

* a K/V block: K and V × 1 row × 256 tokens × 2 KV heads × 32 × 4 bytes = 131,072 bytes;
* per layer and micro-batch (4 × 2 = 8): CP−1 = 1 K/V block forward, 1 backward, CP = 2 dK/dV hops (fp32: 131,072
  bytes too) → counts 8, 8, 16 → 32 × 131,072 = 4 MiB sent per rank and step;
* each transfer hides behind the attention of the block in hand: two 128×128 tiles of 4 heads × 32,
  tile = 2·128²·32·4 = 4,194,304 FLOPs, forward 2 tiles × 2 products = 16,777,216, backward 2 tiles × 5 products =
  41,943,040, shared by the backward's K/V block and dK/dV accumulator (20,971,520 each);
* activations saved (planner/estimate.py's per-token terms, fp32): a layer keeps 10,136 bytes per token (+512 under
  the ring: o_proj's copy of its attention output), the head 4,612 — CP1 4·10136·512 + 4612·512 = 23,119,872,
  CP2 4·10648·256 + 4612·256 = 12,084,224: 11,035,648 bytes saved.
"""

from __future__ import annotations

import pytest

from nxdt.config import compose_config
from nxdt.planner import plan
from nxdt.planner.estimate import memory_per_rank, ring_attention_flops

CP2 = [
    "model=llama_tiny",
    "trainer.devices=2",
    "distributed_strategy.context_parallel_size=2",
    "data.seq_length=512",
    "model.max_position_embeddings=512",
    "data.global_batch_size=2",
    "data.micro_batch_size=1",
    "precision.type=fp32",
]


def test_ring_bytes_overlap_and_memory_saved_by_hand():
    cfg = compose_config(CP2)
    p = plan(cfg)
    ring = [r for r in p.collectives if r["dim"] == "cp"]
    assert [(r["op"], r["bytes"], r["count"]) for r in ring] == [
        ("send_recv", 131072, 8),
        ("send_recv", 131072, 8),
        ("send_recv", 131072, 16),
    ]
    assert ring_attention_flops(1, 128, 4, 32) == {"forward": 16_777_216, "backward": 41_943_040}
    assert [r["hidden_by_flops"] for r in ring] == [16_777_216, 20_971_520, 20_971_520]
    figures = p.estimate["context_parallel"]
    assert figures["ring_bytes_per_step"] == 4 * 2**20
    # per token, fp32 llama_tiny (planner/estimate.py's layer_saved_bytes): a layer keeps 10136 bytes at CP1; the ring
    # adds o_proj's copy of its [b, a, s, d] output (512); the head keeps 4612. CP1: 512 tokens, CP2: 256 per rank.
    cp1 = 4 * 10136 * 512 + 4612 * 512
    cp2 = 4 * (10136 + 512) * 256 + 4612 * 256
    assert figures["activation_bytes_saved"] == cp1 - cp2 == 11_035_648
    # each transfer is exposed only by what its block's compute does not cover (the instance's achieved rate)
    rate = cfg.instance.peak_tflops_fp32 * 1e12 * cfg.instance.compute_efficiency
    exposed = sum(max(0.0, r["seconds"] - r["hidden_by_flops"] / rate) * r["count"] for r in ring)
    assert figures["ring_exposed_s"] == pytest.approx(exposed, rel=1e-12)
    assert figures["ring_s"] == pytest.approx(sum(r["seconds"] * r["count"] for r in ring), rel=1e-12)
    # the gradients are averaged over DP × CP (here the CP pair), not hidden: exposed in full
    [grads] = [r for r in p.collectives if r["dim"] == "dp_cp"]
    assert grads["op"] == "all_reduce" and grads["group_size"] == 2
    assert p.estimate["exposed_comm_s"] == pytest.approx(exposed + grads["total_s"], rel=1e-12)


def test_a_slow_link_exposes_the_ring():
    """Over an emulated link 1000× slower than the cpu instance's, a transfer outlasts its block's compute."""
    p = plan(compose_config([*CP2, "comm.emulate=trn1.32xlarge", "comm.emulate_slowdown=1000"]))
    figures = p.estimate["context_parallel"]
    assert figures["ring_exposed_s"] > 0 and figures["ring_hidden_pct"] < 100


def test_zero1_and_fsdp_shard_over_dp_times_cp():
    """CP ranks are replicas of the weights: two CP ranks shard optimizer state (ZeRO-1) or everything (FSDP) as two
    DP ranks do; the activations are those of S/CP tokens."""
    for sharding in ("distributed_strategy.zero1=true", "distributed_strategy.fsdp.enabled=true"):
        cfg = compose_config([*CP2, sharding, "data.global_batch_size=4"])
        cp2 = memory_per_rank(cfg, {"tp": 1, "pp": 1, "cp": 2, "ep": 1, "dp": 1})
        dp2 = memory_per_rank(cfg, {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 2})
        for key in ("parameters", "gradients", "optimizer"):
            assert cp2[key] == dp2[key], (sharding, key)
        # half the tokens each, plus the ring's copy of its attention output for o_proj (sdpa keeps none):
        # 4 layers × 512 tokens × 128 hidden × 4 bytes
        assert cp2["activations"] * 2 == dp2["activations"] + 4 * 512 * 128 * 4


def test_ring_attention_holds_no_score_matrix_whatever_core_attention_says():
    """Under CP the ring replaces core attention (it saves out and logsumexp only): model.core_attention=naive adds
    its S×S term at CP1 but not at CP2."""
    degrees = {"tp": 1, "pp": 1, "ep": 1, "dp": 1}
    naive, sdpa = compose_config([*CP2, "model.core_attention=naive"]), compose_config(CP2)
    assert (
        memory_per_rank(naive, {**degrees, "cp": 1})["activations"] > memory_per_rank(sdpa, {**degrees, "cp": 1})["activations"]
    )
    assert (
        memory_per_rank(naive, {**degrees, "cp": 2})["activations"] == memory_per_rank(sdpa, {**degrees, "cp": 2})["activations"]
    )
