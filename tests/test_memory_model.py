"""The planner's memory model (issue 19, item 4), each part pinned to a figure computed here by hand.

One small Llama-shaped config throughout, where the arithmetic is easy to follow:

    h = 64 (hidden), L = 8 layers, a = 4 heads, 4 KV heads (head_dim 16), f = 128 (ffn), V = 256 (vocab),
    untied head, s = 128 (sequence), b = 2 (micro-batch)

    parameters of one layer = q,o: 2·h·h + k,v: 2·h·h + gated MLP: 3·h·f + two RMSNorms: 2·h
                            = 8192 + 8192 + 24576 + 128 = 41088
    embedding = head = V·h = 16384; final norm = h = 64
    N = L·41088 + 2·16384 + 64 = 361536

Activation figures follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", Table 2 (bytes for 2-byte activations): s·b·h·(10 + 24/t) with TP, s·b·h·34/t with TP+SP (the S×S
term is absent: sdpa, a flash kernel, materialises no scores).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nxdt.config import compose_config, compose_nxdt_config
from nxdt.planner import plan
from nxdt.planner.estimate import GiB, in_flight_microbatches, memory_per_rank

h, L, a, f, V, s, b = 64, 8, 4, 128, 256, 128, 2
LAYER = 2 * h * h + 2 * h * h + 3 * h * f + 2 * h  # 41088
N = L * LAYER + 2 * V * h + h  # 361536
SBH = s * b * h  # 16384 elements of one layer's input

CONFIGS = Path(__file__).parent / "nxdt_configs"


def tiny(*overrides: str):
    return compose_config(["model=llama_tiny", f"model.hidden_size={h}", f"model.num_layers={L}", f"model.num_attention_heads={a}",
                           f"model.num_kv_heads={a}", f"model.ffn_hidden_size={f}", f"model.vocab_size={V}", "model.core_attention=sdpa",
                           f"data.seq_length={s}", f"data.micro_batch_size={b}", "data.global_batch_size=64", *overrides], check=False)


def degrees(tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1) -> dict[str, int]:
    return {"tp": tp, "pp": pp, "cp": 1, "ep": ep, "dp": dp}


def test_the_hand_count_of_parameters_is_the_planners():
    from nxdt.planner.estimate import model_numbers

    assert N == 361536 and model_numbers(tiny().model)["total"] == N


# ------------------------------------------------------------------------- 1. full recompute with SP
def test_full_recompute_keeps_each_layers_input_sharded_by_sp_plus_one_layer_being_recomputed():
    t = 4
    full = ("model.activations_checkpoint_granularity=full", "precision.type=mixed_precision")  # bf16 activations: 2 bytes
    with_sp = memory_per_rank(tiny(*full, "distributed_strategy.sequence_parallel=true"), degrees(tp=t))["activations"]
    without = memory_per_rank(tiny(*full, "distributed_strategy.sequence_parallel=false"), degrees(tp=t))["activations"]
    # SP: each layer's input in the sequence-parallel layout, s/t rows of it: s·b·h/t elements × 2 bytes × L layers
    #     = 16384/4·2·8 = 65536; plus the layer being recomputed, all its activations: s·b·h·34/t = 16384·34/4 = 139264
    assert with_sp == 2 * SBH / t * L + SBH * 34 / t == 65536 + 139264 == 204800
    # no SP: the whole input on every TP rank, 2·s·b·h·L = 262144 (Table 2's "full activation recomputation: sbh·2"
    #     per layer), plus the recomputed layer with TP alone: s·b·h·(10 + 24/t) = 16384·16 = 262144
    assert without == 2 * SBH * L + SBH * (10 + 24 / t) == 262144 + 262144 == 524288
    # fp32 activations double both parts
    fp32 = memory_per_rank(tiny("model.activations_checkpoint_granularity=full", "precision.type=fp32",
                                "distributed_strategy.sequence_parallel=true"), degrees(tp=t))["activations"]
    assert fp32 == 2 * with_sp


def test_the_405b_trn1_config_fits_with_sp_and_would_not_without_it():
    """NxDT's hf_llama3.1_405B_trn1_config.yaml settings: TP32 × PP32 on 64 trn1.32xlarge (DP 2), SP, full recompute,
    mixed_precision + ZeRO-1, seq 8192, micro-batch 1, global 256 (128 micro-batches per step)."""
    cfg, _ = compose_nxdt_config(CONFIGS, "hf_llama3.1_405B_trn1_config", ["instance=trn1.32xlarge"], paths=False)
    p = plan(cfg)
    assert p.degrees == {"tp": 32, "pp": 32, "cp": 1, "ep": 1, "dp": 2} and p.warnings == []
    m = p.estimate["memory_per_rank_bytes"]
    S, H, t, pp = 8192, 16384, 32, 32
    layers_on_the_first_stage = 4  # ceil(126 / 32)
    # 1F1B: the first stage holds PP = 32 micro-batches of 4 layer inputs, 2·s·h/t bytes each with SP; plus one layer
    # being recomputed, s·h·34/t
    # = 2·2^27/32·4·32 + 2^27·34/32 = 1 GiB + 136 MiB
    assert m["activations"] == 2 * S * H / t * layers_on_the_first_stage * pp + S * H * 34 / t == GiB + 136 * 2**20
    assert 10 < p.estimate["memory_per_device_GiB"] < 32  # 2 ranks per 32 GiB chip
    cfg, _ = compose_nxdt_config(CONFIGS, "hf_llama3.1_405B_trn1_config", ["instance=trn1.32xlarge",
                                                                            "distributed_strategy.sequence_parallel=false"], paths=False)
    assert any(w.startswith("does not fit") for w in plan(cfg).warnings)  # 2·s·h per stored layer input: 32 GiB of them


def test_the_8b_trn2_config_fits():
    cfg, _ = compose_nxdt_config(CONFIGS, "hf_llama3_8B_trn2_config", ["instance=trn2.48xlarge"], paths=False)
    p = plan(cfg)
    assert p.degrees == {"tp": 16, "pp": 1, "cp": 1, "ep": 1, "dp": 4} and p.warnings == []
    assert p.estimate["memory_per_device_GiB"] < 96


# ------------------------------------------------------------------------- 2. pipeline micro-batches in flight
def test_1f1b_first_stage_holds_pp_microbatches_of_its_layers():
    t, pp = 4, 4
    cfg = tiny("model.activations_checkpoint_granularity=selective", "precision.type=mixed_precision",
               "distributed_strategy.sequence_parallel=true", "data.global_batch_size=16")  # m = 16 / (2·1) = 8 micro-batches
    act = memory_per_rank(cfg, degrees(tp=t, pp=pp))["activations"]
    # per layer and micro-batch (selective, TP+SP): s·b·h·34/t = 16384·34/4 = 139264; L/PP = 2 layers; PP = 4 in flight
    assert act == SBH * 34 / t * (L // pp) * pp == 139264 * 2 * 4 == 1114112
    # fewer micro-batches than stages: all of them, and no more, are in flight
    few = memory_per_rank(tiny("model.activations_checkpoint_granularity=selective", "precision.type=mixed_precision",
                               "distributed_strategy.sequence_parallel=true", "data.global_batch_size=4"), degrees(tp=t, pp=pp))
    assert few["activations"] == 139264 * 2 * 2  # m = 4 / 2 = 2


def test_interleaved_first_stage_holds_megatrons_count():
    # Korthikanti et al. 2022 §4.2.3: PP·(1 + (PP-1)/(PP·V)) stage shares; PP 4, V 2: 4·(1 + 3/8) = 5.5
    assert in_flight_microbatches(4, 8, 2) == 4 * (1 + 3 / 8) == 5.5
    assert in_flight_microbatches(4, 8, 1) == 4 and in_flight_microbatches(4, 4, 2) == 4  # m = PP: every micro-batch
    assert in_flight_microbatches(1, 8, 1) == 1
    cfg = tiny("model.activations_checkpoint_granularity=selective", "precision.type=mixed_precision",
               "distributed_strategy.sequence_parallel=true", "data.global_batch_size=16",
               "distributed_strategy.virtual_pipeline_model_parallel_size=2")
    assert memory_per_rank(cfg, degrees(tp=4, pp=4))["activations"] == 139264 * 2 * 5.5


@pytest.mark.parametrize("pp,m,v", [(4, 8, 1), (4, 8, 2), (4, 12, 3), (2, 6, 2), (8, 16, 2), (4, 4, 2)])
def test_the_count_is_what_nxdts_own_schedules_hold(pp, m, v):
    """The formula against the executed schedule: nxdt.parallel.pipeline's simulator counts the chunk activations
    each stage holds (forwards not yet backwarded); a chunk is 1/V of the stage's layers."""
    from nxdt.parallel.pipeline import interleaved_one_f_one_b, one_f_one_b, simulate

    schedules = [one_f_one_b(pp, st, m) if v == 1 else interleaved_one_f_one_b(pp, st, m, v) for st in range(pp)]
    result = simulate(schedules, num_chunks=v)
    assert max(result.peak_in_flight) == result.peak_in_flight[0]  # the first stage is the fullest
    assert result.peak_in_flight[0] / v == pytest.approx(in_flight_microbatches(pp, m, v))


# ------------------------------------------------------------------------- 3. ZeRO-1 vs FSDP
def test_zero1_shards_optimizer_state_and_master_weights_only():
    dp = 4
    plain = memory_per_rank(tiny("precision.type=mixed_precision"), degrees(dp=dp))
    zero1 = memory_per_rank(tiny("precision.type=mixed_precision", "distributed_strategy.zero1=true"), degrees(dp=dp))
    # mixed_precision: bf16 params 2 B, fp32 grads 4 B, fp32 moments 8 B + fp32 master 4 B
    assert (plain["parameters"], plain["gradients"], plain["optimizer"]) == (2 * N, 4 * N, 12 * N)
    assert (zero1["parameters"], zero1["gradients"], zero1["optimizer"]) == (2 * N, 4 * N, 12 * N / dp)
    assert "gathered_parameters" not in zero1


def test_fsdp_shards_everything_and_holds_prefetch_distance_plus_one_units():
    dp = 4
    fsdp = memory_per_rank(tiny("precision.type=mixed_precision", "distributed_strategy.fsdp.enabled=true"), degrees(dp=dp))
    # the fp32 shard is the master copy: 4 B params + 4 B grads + 8 B moments, all / DP (16·N/4 = 4·N)
    assert (fsdp["parameters"], fsdp["gradients"], fsdp["optimizer"]) == (4 * N / dp, 4 * N / dp, 8 * N / dp)
    # gathered in bf16, prefetch_distance 1: two consecutive units; here a layer (41088) outweighs the head (16384 + 64
    # final norm), so the largest pair is two layers: 2·41088 params × 2 B = 164352
    assert fsdp["gathered_parameters"] == 2 * LAYER * 2 == 164352
    far = memory_per_rank(tiny("precision.type=mixed_precision", "distributed_strategy.fsdp.enabled=true",
                               "distributed_strategy.fsdp.prefetch_distance=2"), degrees(dp=dp))
    assert far["gathered_parameters"] == 3 * LAYER * 2  # three units
    # a vocabulary of 4096: the head (4096·64 = 262144, + the 64 final-norm weights) outweighs a layer, and the largest
    # pair is the last layer + head: 41088 + 262208 = 303296 params (embedding + first layer: 64 fewer) × 2 B
    big = memory_per_rank(tiny("precision.type=mixed_precision", "distributed_strategy.fsdp.enabled=true", "model.vocab_size=4096"),
                          degrees(dp=dp))
    assert big["gathered_parameters"] == (LAYER + 4096 * h + h) * 2 == 606592
    eager = memory_per_rank(tiny("precision.type=mixed_precision", "distributed_strategy.fsdp.enabled=true",
                                 "distributed_strategy.fsdp.prefetch=eager"), degrees(dp=dp))
    assert eager["gathered_parameters"] == N * 2  # every unit, the whole model
    kept = memory_per_rank(tiny("precision.type=mixed_precision", "distributed_strategy.fsdp.enabled=true",
                                "distributed_strategy.fsdp.reshard_after_forward=false"), degrees(dp=dp))
    assert kept["gathered_parameters"] == N * 2  # nothing freed between forward and backward
    fp32 = memory_per_rank(tiny("precision.type=fp32", "distributed_strategy.fsdp.enabled=true"), degrees(dp=dp))
    assert (fp32["parameters"], fp32["gradients"], fp32["optimizer"]) == (4 * N / dp, 4 * N / dp, 8 * N / dp)
    assert fp32["gathered_parameters"] == 2 * LAYER * 4  # fp32 units


def test_expert_state_is_sharded_over_the_ranks_holding_the_same_experts():
    # 4 experts of 3·h·f = 24576 each per layer, EP 2 (each rank holds 2 experts), DP 4: expert-DP = 4/2 = 2
    cfg = tiny("model=mixtral_tiny", f"model.hidden_size={h}", f"model.num_layers={L}", f"model.num_attention_heads={a}",
               f"model.num_kv_heads={a}", f"model.ffn_hidden_size={f}", f"model.vocab_size={V}", "model.moe.num_experts=4",
               "precision.type=fp32", "distributed_strategy.zero1=true")
    m = memory_per_rank(cfg, degrees(dp=4, ep=2))
    experts = L * 4 * 3 * h * f  # 786432
    dense = N - L * 3 * h * f + L * 4 * h  # the single MLP out, the routers (h·experts per layer) in: 165888
    assert m["parameters"] == (dense + experts / 2) * 4
    assert m["optimizer"] == (dense / 4 + experts / 2 / 2) * 8  # fp32 moments, dense over DP 4, experts over 2


# ------------------------------------------------------------------------- 4. bytes per parameter
@pytest.mark.parametrize("kind,optimizer,per_param", [
    ("fp32", "adamw", 4 + 4 + 8),                       # fp32 params, grads, moments
    ("fp32", "adamw_fp32OptState", 4 + 4 + 8),          # the same: the moments are fp32 already
    ("bf16", "adamw", 2 + 2 + 4),                       # bf16 params, grads, moments
    ("bf16SR", "adamw", 2 + 2 + 4),                     # SR stores what bf16 stores
    ("bf16", "adamw_fp32OptState", 2 + 2 + 8),          # fp32 moments; the weights stay bf16, no master copy
    ("bf16SR", "adamw_fp32OptState", 2 + 2 + 8),
    ("mixed_precision", "adamw", 2 + 4 + 8 + 4),        # bf16 params, fp32 grads, fp32 moments + fp32 master
    ("mixed_precision", "adamw_fp32OptState", 2 + 4 + 8 + 4),
    ("mixed_precisionSR", "adamw", 2 + 4 + 8 + 4),
    ("mixed_precisionSR", "adamw_fp32OptState", 2 + 4 + 8 + 4),
])
def test_bytes_per_parameter(kind, optimizer, per_param):
    m = memory_per_rank(tiny(f"precision.type={kind}", f"model.optim.name={optimizer}"), degrees())
    assert m["parameters"] + m["gradients"] + m["optimizer"] == N * per_param


def test_naive_attention_adds_its_kept_probabilities_mask_and_the_peak_layers_score_gradients():
    """naive core attention (no attention dropout) keeps per layer the fp32 softmax probabilities 4·a·s²·b, under
    autocast also their bf16 copy 2·a·s²·b, and the boolean mask s²·b; the peak layer's backward adds two fp32
    S×S gradients 8·a·s²·b once (measured on llama_tiny at 2k tokens: experiments/attention-memory). Here
    s²·b = 128·128·2 = 32768, a = 4:
      fp32:              L·32768·(4·4 + 1) + 8·4·32768 = 8·557056 + 1048576 = 5505024
      mixed_precision:   L·32768·(6·4 + 1) + 1048576   = 8·819200 + 1048576 = 7602176
      fp32, TP2:         heads halve: 8·278528 + 524288                       = 2752512
      fp32, full recompute: one layer's kept bytes while it is recomputed + the gradients: 557056 + 1048576 = 1605632"""
    def extra(*overrides: str, tp: int = 1) -> float:
        naive = memory_per_rank(tiny("model.core_attention=naive", *overrides), degrees(tp=tp))["activations"]
        return naive - memory_per_rank(tiny(*overrides), degrees(tp=tp))["activations"]

    assert extra("precision.type=fp32") == 5505024
    assert extra("precision.type=mixed_precision") == 7602176
    assert extra("precision.type=fp32", "distributed_strategy.tensor_model_parallel_size=2", tp=2) == 2752512
    assert extra("precision.type=fp32", "model.activations_checkpoint_granularity=full") == 1605632
