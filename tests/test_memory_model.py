"""The planner's memory model (issue 19, item 4), each part pinned to a figure computed here by hand.

One small Llama-shaped config throughout, where the arithmetic is easy to follow:

    h = 64 (hidden), L = 8 layers, a = 4 heads, 4 KV heads (head_dim 16), f = 128 (ffn), V = 256 (vocab),
    untied head, s = 128 (sequence), b = 2 (micro-batch)

    parameters of one layer = q,o: 2·h·h + k,v: 2·h·h + gated MLP: 3·h·f + two RMSNorms: 2·h
                            = 8192 + 8192 + 24576 + 128 = 41088
    embedding = head = V·h = 16384; final norm = h = 64
    N = L·41088 + 2·16384 + 64 = 361536

Activation figures are counted tensor by tensor (nxdt/planner/estimate.py: layer_saved_bytes, head_saved_bytes), in
Korthikanti et al. 2022's layout (TP splits heads and ffn columns, TP+SP everything). Per token of this config, one
layer with sdpa keeps, e the activation bytes (2 for mixed_precision, 4 for fp32):

    norms      2 RMSNorms × (fp32 input 4·h + normalised e·h + output e·h + fp32 rstd 4): bf16 2·(256+128+128+4) = 1032
    qkv        q, k after RoPE, v: (h + 2·h)·e                                                        bf16 384
    attention  sdpa's output h·e + fp32 logsumexp 4·a                                                 bf16 128 + 16 = 144
    mlp        SwiGLU's gate, silu(gate), up, product: 4·f·e                                           bf16 1024
                                                                                             total bf16 2584, fp32 4632
(fp32: norms 2·(256 + 256 + 256 + 4) = 1544, qkv 768, attention 256 + 16 = 272, mlp 2048.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nxdt.config import compose_config, compose_nxdt_config
from nxdt.planner import plan
from nxdt.planner.estimate import GiB, head_saved_bytes, in_flight_microbatches, layer_saved_bytes, memory_per_rank

h, L, a, f, V, s, b = 64, 8, 4, 128, 256, 128, 2
LAYER = 2 * h * h + 2 * h * h + 3 * h * f + 2 * h  # 41088
N = L * LAYER + 2 * V * h + h  # 361536
SBH = s * b * h  # 16384 elements of one layer's input

CONFIGS = Path(__file__).parent / "nxdt_configs"


def tiny(*overrides: str):
    return compose_config(
        [
            "model=llama_tiny",
            f"model.hidden_size={h}",
            f"model.num_layers={L}",
            f"model.num_attention_heads={a}",
            f"model.num_kv_heads={a}",
            f"model.ffn_hidden_size={f}",
            f"model.vocab_size={V}",
            "model.core_attention=sdpa",
            f"data.seq_length={s}",
            f"data.micro_batch_size={b}",
            "data.global_batch_size=64",
            *overrides,
        ],
        check=False,
    )


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
    tokens = s * b  # 256
    # SP: each layer's input in the sequence-parallel layout, s/t rows of it: s·b·h/t elements × 2 bytes × L layers
    #     = 16384/4·2·8 = 65536; plus the layer being recomputed, all it keeps, / t: 2584·256/4 = 165376
    assert with_sp == 2 * SBH / t * L + 2584 * tokens / t == 65536 + 165376 == 230912
    # no SP: the whole input on every TP rank, 2·s·b·h·L = 262144 (Table 2's "full activation recomputation: sbh·2"
    #     per layer), plus the recomputed layer with TP alone: the norms' 1032 B whole, the rest (1552 B) / t:
    #     1032·256 + 1552·256/4 = 264192 + 99328
    assert without == 2 * SBH * L + 1032 * tokens + 1552 * tokens / t == 262144 + 363520 == 625664
    # fp32: the inputs double (131072); the recomputed layer keeps 4632 B per token, / t: 296448
    fp32 = memory_per_rank(
        tiny(
            "model.activations_checkpoint_granularity=full", "precision.type=fp32", "distributed_strategy.sequence_parallel=true"
        ),
        degrees(tp=t),
    )["activations"]
    assert fp32 == 4 * SBH / t * L + 4632 * tokens / t == 131072 + 296448 == 427520


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
    # being recomputed, per token (bf16, sdpa; 128 heads, 8 KV heads of 128: g = 1024; ffn 53248):
    #   norms 2·(4·16384 + 4·16384 + 4) = 262152, qkv (16384 + 2048)·2 = 36864, attention 32768 + 4·128 = 33280,
    #   SwiGLU 4·53248·2 = 425984: 758280 B per token, × 8192 / 32 tokens per rank = 194119680
    assert m["activations"] == 2 * S * H / t * layers_on_the_first_stage * pp + 758280 * S / t == GiB + 194119680
    assert 10 < p.estimate["memory_per_device_GiB"] < 32  # 2 ranks per 32 GiB chip
    cfg, _ = compose_nxdt_config(
        CONFIGS,
        "hf_llama3.1_405B_trn1_config",
        ["instance=trn1.32xlarge", "distributed_strategy.sequence_parallel=false"],
        paths=False,
    )
    assert any(w.startswith("does not fit") for w in plan(cfg).warnings)  # 2·s·h per stored layer input: 32 GiB of them


def test_the_8b_trn2_config_fits():
    cfg, _ = compose_nxdt_config(CONFIGS, "hf_llama3_8B_trn2_config", ["instance=trn2.48xlarge"], paths=False)
    p = plan(cfg)
    assert p.degrees == {"tp": 16, "pp": 1, "cp": 1, "ep": 1, "dp": 4} and p.warnings == []
    assert p.estimate["memory_per_device_GiB"] < 96


# ------------------------------------------------------------------------- 2. pipeline micro-batches in flight
def test_1f1b_first_stage_holds_pp_microbatches_of_its_layers():
    t, pp = 4, 4
    cfg = tiny(
        "model.activations_checkpoint_granularity=selective",
        "precision.type=mixed_precision",
        "distributed_strategy.sequence_parallel=true",
        "data.global_batch_size=16",
    )  # m = 16 / (2·1) = 8 micro-batches
    act = memory_per_rank(cfg, degrees(tp=t, pp=pp))["activations"]
    # per layer and micro-batch (selective, TP+SP): sdpa's output and logsumexp are recomputed, o_proj's input h·e stays:
    # 1032 + 384 + 128 + 1024 = 2568 B per token, × 256 / 4 = 164352; L/PP = 2 layers; PP = 4 in flight
    assert act == 2568 * s * b / t * (L // pp) * pp == 164352 * 2 * 4 == 1314816
    # fewer micro-batches than stages: all of them, and no more, are in flight
    few = memory_per_rank(
        tiny(
            "model.activations_checkpoint_granularity=selective",
            "precision.type=mixed_precision",
            "distributed_strategy.sequence_parallel=true",
            "data.global_batch_size=4",
        ),
        degrees(tp=t, pp=pp),
    )
    assert few["activations"] == 164352 * 2 * 2  # m = 4 / 2 = 2


def test_interleaved_first_stage_holds_megatrons_count():
    # Korthikanti et al. 2022 §4.2.3: PP·(1 + (PP-1)/(PP·V)) stage shares; PP 4, V 2: 4·(1 + 3/8) = 5.5
    assert in_flight_microbatches(4, 8, 2) == 4 * (1 + 3 / 8) == 5.5
    assert in_flight_microbatches(4, 8, 1) == 4 and in_flight_microbatches(4, 4, 2) == 4  # m = PP: every micro-batch
    assert in_flight_microbatches(1, 8, 1) == 1
    cfg = tiny(
        "model.activations_checkpoint_granularity=selective",
        "precision.type=mixed_precision",
        "distributed_strategy.sequence_parallel=true",
        "data.global_batch_size=16",
        "distributed_strategy.virtual_pipeline_model_parallel_size=2",
    )
    assert memory_per_rank(cfg, degrees(tp=4, pp=4))["activations"] == 164352 * 2 * 5.5


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


def test_a_frozen_reference_copy_is_priced_as_the_policys_parameters():
    """DPO scoring its reference each step (precompute_ref_log_probs: false) and GRPO's KL (beta != 0) hold a frozen
    copy of the starting weights laid out as the policy: fp32 N·4 on one rank, an FSDP shard N·4/DP; DPO's
    precomputed table, DPO with fresh LoRA adapters and GRPO without KL hold none."""
    dpo, online = "+recipe=dpo", "model_alignment_strategy.dpo.precompute_ref_log_probs=false"
    assert memory_per_rank(tiny(dpo, online), degrees())["reference_model"] == 4 * N
    fsdp = memory_per_rank(tiny(dpo, online, "distributed_strategy.fsdp.enabled=true"), degrees(dp=4))
    assert fsdp["reference_model"] == fsdp["parameters"] == 4 * N / 4
    assert "reference_model" not in memory_per_rank(tiny(dpo), degrees())
    # fresh LoRA adapters: the policy with its adapters off is the reference, no copy
    assert "reference_model" not in memory_per_rank(tiny(dpo, online, "model_alignment_strategy.peft.lora_rank=8"), degrees())
    grpo = "+recipe=grpo"
    assert memory_per_rank(tiny(grpo, "model_alignment_strategy.grpo.beta=0.04"), degrees())["reference_model"] == 4 * N
    assert "reference_model" not in memory_per_rank(tiny(grpo, "model_alignment_strategy.grpo.beta=0"), degrees())
    lora_kl = tiny(grpo, "model_alignment_strategy.grpo.beta=0.04", "model_alignment_strategy.peft.lora_rank=8")
    assert "reference_model" not in memory_per_rank(lora_kl, degrees())


def test_fsdp_shards_everything_and_holds_prefetch_distance_plus_one_units():
    dp = 4
    fsdp = memory_per_rank(tiny("precision.type=mixed_precision", "distributed_strategy.fsdp.enabled=true"), degrees(dp=dp))
    # the fp32 shard is the master copy: 4 B params + 4 B grads + 8 B moments, all / DP (16·N/4 = 4·N)
    assert (fsdp["parameters"], fsdp["gradients"], fsdp["optimizer"]) == (4 * N / dp, 4 * N / dp, 8 * N / dp)
    # gathered in bf16, prefetch_distance 1: two consecutive units; here a layer (41088) outweighs the head (16384 + 64
    # final norm), so the largest pair is two layers: 2·41088 params × 2 B = 164352
    assert fsdp["gathered_parameters"] == 2 * LAYER * 2 == 164352
    far = memory_per_rank(
        tiny(
            "precision.type=mixed_precision",
            "distributed_strategy.fsdp.enabled=true",
            "distributed_strategy.fsdp.prefetch_distance=2",
        ),
        degrees(dp=dp),
    )
    assert far["gathered_parameters"] == 3 * LAYER * 2  # three units
    # a vocabulary of 4096: the head (4096·64 = 262144, + the 64 final-norm weights) outweighs a layer, and the largest
    # pair is the last layer + head: 41088 + 262208 = 303296 params (embedding + first layer: 64 fewer) × 2 B
    big = memory_per_rank(
        tiny("precision.type=mixed_precision", "distributed_strategy.fsdp.enabled=true", "model.vocab_size=4096"), degrees(dp=dp)
    )
    assert big["gathered_parameters"] == (LAYER + 4096 * h + h) * 2 == 606592
    eager = memory_per_rank(
        tiny(
            "precision.type=mixed_precision", "distributed_strategy.fsdp.enabled=true", "distributed_strategy.fsdp.prefetch=eager"
        ),
        degrees(dp=dp),
    )
    assert eager["gathered_parameters"] == N * 2  # every unit, the whole model
    kept = memory_per_rank(
        tiny(
            "precision.type=mixed_precision",
            "distributed_strategy.fsdp.enabled=true",
            "distributed_strategy.fsdp.reshard_after_forward=false",
        ),
        degrees(dp=dp),
    )
    assert kept["gathered_parameters"] == N * 2  # nothing freed between forward and backward
    fp32 = memory_per_rank(tiny("precision.type=fp32", "distributed_strategy.fsdp.enabled=true"), degrees(dp=dp))
    assert (fp32["parameters"], fp32["gradients"], fp32["optimizer"]) == (4 * N / dp, 4 * N / dp, 8 * N / dp)
    assert fp32["gathered_parameters"] == 2 * LAYER * 4  # fp32 units


def test_fsdp_under_pipeline_parallelism_holds_the_stage_and_its_summed_gradients():
    """PP2 × FSDP: a stage gathers each of its units once per step and keeps them (micro-batches' forwards and backwards
    interleave), and sums its gradients unsharded in fp32 until the step's one reduce-scatter."""
    dp, pp = 2, 2
    cfg = tiny("precision.type=mixed_precision", "distributed_strategy.fsdp.enabled=true")
    mem = memory_per_rank(cfg, degrees(dp=dp, pp=pp))
    stage = max(V * h + L // pp * LAYER, L // pp * LAYER + V * h + h)  # the last stage: its layers, the norm and head
    assert mem["gathered_parameters"] == stage * 2  # bf16 gathers
    assert mem["accumulated_gradients"] == N / pp * 4
    assert (mem["parameters"], mem["gradients"], mem["optimizer"]) == (4 * N / pp / dp, 4 * N / pp / dp, 8 * N / pp / dp)
    assert "accumulated_gradients" not in memory_per_rank(cfg, degrees(dp=dp))


def test_fsdp_under_pipeline_parallelism_gathers_and_reduces_each_unit_once_per_step():
    from nxdt.planner.estimate import step_collectives

    def fsdp_counts(*layout: str) -> tuple[int, dict[str, int]]:
        cfg = tiny("distributed_strategy.fsdp.enabled=true", "trainer.devices=4", *layout)
        p = plan(cfg)
        return p.micro_batches, {r["what"]: r["count"] for r in step_collectives(cfg, p) if r["what"].startswith("FSDP ")}

    m, flat = fsdp_counts()  # DP4: every micro-batch gathers each of L + 2 units twice, reduce-scatters each once
    assert (flat["FSDP first gather of a pass"], flat["FSDP gradient reduce-scatter"]) == (2 * m, (L + 2) * m)
    m, staged = fsdp_counts("distributed_strategy.pipeline_model_parallel_size=2")  # a stage: L/2 layers and one end
    assert m > 1 and staged["FSDP first gather of a pass"] == 1
    assert staged["FSDP parameter gathers (prefetched)"] == L // 2 and staged["FSDP gradient reduce-scatter"] == L // 2 + 1

    # 4 experts of 3·h·f = 24576 each per layer, EP 2 (each rank holds 2 experts), DP 4: expert-DP = 4/2 = 2
    cfg_overrides = [
        "model=mixtral_tiny",
        f"model.hidden_size={h}",
        f"model.num_layers={L}",
        f"model.num_attention_heads={a}",
        f"model.num_kv_heads={a}",
        f"model.ffn_hidden_size={f}",
        f"model.vocab_size={V}",
        "model.moe.num_experts=4",
        "precision.type=fp32",
        "distributed_strategy.zero1=true",
    ]
    m = memory_per_rank(tiny(*cfg_overrides), degrees(dp=4, ep=2))
    experts = L * 4 * 3 * h * f  # 786432
    dense = N - L * 3 * h * f + L * 4 * h  # the single MLP out, the routers (h·experts per layer) in: 165888
    assert m["parameters"] == (dense + experts / 2) * 4
    assert m["optimizer"] == (dense / 4 + experts / 2 / 2) * 8  # fp32 moments, dense over DP 4, experts over 2
    # FSDP: everything sharded the same way; a layer's gathered unit holds the rank's 2 experts, not all 4
    fsdp = memory_per_rank(
        tiny(*[o for o in cfg_overrides if o != "distributed_strategy.zero1=true"], "distributed_strategy.fsdp.enabled=true"),
        degrees(dp=4, ep=2),
    )
    assert (fsdp["parameters"], fsdp["optimizer"]) == ((dense / 4 + experts / 4) * 4, (dense / 4 + experts / 4) * 8)
    layer = LAYER - 3 * h * f + 4 * h + 2 * 3 * h * f  # attention, norms, router, two experts
    assert fsdp["gathered_parameters"] == 2 * layer * 4  # two consecutive layers, fp32


def test_expert_gradients_are_priced_over_the_replicas_of_the_same_experts():
    """EP2 on DP8: each rank's experts have 4 replicas (``edp``), over which every runtime moves their gradients —
    the replicated all-reduce, ZeRO-1's reduce-scatter + gather, FSDP's gathers and reduce-scatters per layer — with
    this rank's experts' bytes (a layer's, under FSDP); none when DP = EP (no replicas)."""
    from nxdt.planner.estimate import step_collectives

    experts = L * 4 * 3 * h * f / 2  # this rank's: 2 of each layer's 4 experts

    def expert_rows(*layout: str, devices: int = 8) -> tuple[int, list[tuple[str, str, int, float]]]:
        cfg = tiny(
            "model=mixtral_tiny",
            f"model.num_layers={L}",
            "model.moe.num_experts=4",
            "precision.type=fp32",
            f"trainer.devices={devices}",
            "distributed_strategy.expert_model_parallel_size=2",
            *layout,
        )
        p = plan(cfg)
        rows = [(r["dim"], r["op"], r["count"], r["bytes"]) for r in step_collectives(cfg, p) if "expert" in r["what"]]
        return p.micro_batches, rows

    _, plain = expert_rows("distributed_strategy.zero1=false")
    assert plain == [("edp", "all_reduce", 1, experts * 4)]
    _, zero1 = expert_rows("distributed_strategy.zero1=true")
    assert zero1 == [("edp", "reduce_scatter", 1, experts * 4), ("edp", "all_gather", 1, experts * 4)]
    m, fsdp = expert_rows("distributed_strategy.zero1=false", "distributed_strategy.fsdp.enabled=true")
    assert fsdp == [("edp", "all_gather", 2 * m * L, experts / L * 4), ("edp", "reduce_scatter", m * L, experts / L * 4)]
    assert expert_rows("distributed_strategy.zero1=true", devices=2)[1] == []  # DP2 = EP2: no replicas


# ------------------------------------------------------------------------- 4. bytes per parameter
@pytest.mark.parametrize(
    "kind,optimizer,per_param",
    [
        ("fp32", "adamw", 4 + 4 + 8),  # fp32 params, grads, moments
        ("fp32", "adamw_fp32OptState", 4 + 4 + 8),  # the same: the moments are fp32 already
        ("bf16", "adamw", 2 + 2 + 4),  # bf16 params, grads, moments
        ("bf16SR", "adamw", 2 + 2 + 4),  # SR stores what bf16 stores
        ("bf16", "adamw_fp32OptState", 2 + 2 + 8),  # fp32 moments; the weights stay bf16, no master copy
        ("bf16SR", "adamw_fp32OptState", 2 + 2 + 8),
        ("mixed_precision", "adamw", 2 + 4 + 8 + 4),  # bf16 params, fp32 grads, fp32 moments + fp32 master
        ("mixed_precision", "adamw_fp32OptState", 2 + 4 + 8 + 4),
        ("mixed_precisionSR", "adamw", 2 + 4 + 8 + 4),
        ("mixed_precisionSR", "adamw_fp32OptState", 2 + 4 + 8 + 4),
    ],
)
def test_bytes_per_parameter(kind, optimizer, per_param):
    m = memory_per_rank(tiny(f"precision.type={kind}", f"model.optim.name={optimizer}"), degrees())
    assert m["parameters"] + m["gradients"] + m["optimizer"] == N * per_param


def test_naive_attention_adds_its_kept_probabilities_mask_and_the_peak_layers_score_gradients():
    """naive core attention (no attention dropout) keeps per layer the fp32 softmax probabilities 4·a·s²·b, under
    autocast also their bf16 copy 2·a·s²·b, and the boolean mask s²·b; the peak layer's backward adds two fp32
    S×S gradients 8·a·s²·b once (measured on llama_tiny at 2k tokens: experiments/attention-memory). Here
    s²·b = 128·128·2 = 32768, a = 4: kept fp32 32768·(4·4 + 1) = 557056, mixed_precision 32768·(6·4 + 1) = 819200,
    gradients 8·4·32768 = 1048576. Its per-token tensors differ from sdpa's too: fp32 copies of q and of k, v
    broadcast to every head (3·h·4 = 768 B; sdpa: (h + 2·h)·e) and o_proj's copy of its output (h·e) without a
    logsumexp (sdpa: h·e + 16): fp32 −16 B per token (−4096 per layer), mixed_precision 768 − 384 − 16 = +368 (+94208).
      fp32:              L·(557056 − 4096) + 1048576  = 8·552960 + 1048576 = 5472256
      mixed_precision:   L·(819200 + 94208) + 1048576 = 8·913408 + 1048576 = 8355840
      fp32, TP2:         / 2: 8·276480 + 524288                             = 2736128
      fp32, full recompute: one layer's while it is recomputed + the gradients: 552960 + 1048576 = 1601536"""

    def extra(*overrides: str, tp: int = 1) -> float:
        naive = memory_per_rank(tiny("model.core_attention=naive", *overrides), degrees(tp=tp))["activations"]
        return naive - memory_per_rank(tiny(*overrides), degrees(tp=tp))["activations"]

    assert extra("precision.type=fp32") == 5472256
    assert extra("precision.type=mixed_precision") == 8355840
    assert extra("precision.type=fp32", "distributed_strategy.tensor_model_parallel_size=2", tp=2) == 2736128
    assert extra("precision.type=fp32", "model.activations_checkpoint_granularity=full") == 1601536


# ------------------------------------------------------------------------- 5. each tensor a layer keeps
def test_each_term_of_a_llama_tiny_layer_at_2k_tokens_by_hand():
    """The configuration experiments/attention-memory measures: llama_tiny (h 128, 4 heads of 32 over 2 KV heads:
    g = 64, ffn 344, vocabulary 256), fp32, one sequence of 2048 tokens. Bytes per token:
      norms      2·(4·128 + 4·128 + 4·128 + 4)                         = 3080
      qkv        sdpa, blockwise (128 + 2·64)·4 = 1024; naive 3·128·4 = 1536
      attention  sdpa 128·4 + 4·4 = 528; blockwise + o_proj's copy 512 = 1040; naive the copy only = 512
      mlp        4·344·4                                               = 5504
      head       final norm 4·128 + 4·128 + 4·128 + 4 = 1540, fp32 log-probabilities 4·256 = 1024, and at the
                 start of backward their gradient and the logits' 2·1024 = 2048
    sdpa's layer: 10136 B per token; × 4 layers × 2048 = 83034112 bytes, which with the final norm (1540·2048), the
    token ids (8·2048) and RoPE's cos/sin table (2·2048·32·4) is the 86728704 bytes autograd keeps in
    experiments/attention-memory/saved.json."""
    model = compose_config(["model=llama_tiny"]).model
    per_token = lambda kernel: {k: v / 2048 for k, v in layer_saved_bytes(model, 2048, 1, 1, False, 4, kernel).items()}
    assert per_token("sdpa") == {"norms": 3080, "qkv": 1024, "attention": 528, "scores": 0, "mlp": 5504}
    assert per_token("blockwise") == {"norms": 3080, "qkv": 1024, "attention": 1040, "scores": 0, "mlp": 5504}
    naive = per_token("naive")
    assert naive["qkv"] == 1536 and naive["attention"] == 512
    assert naive["scores"] * 2048 == 2048 * 2048 * (4 * 4 + 1)  # fp32 probabilities of 4 heads + the mask
    assert {k: v / 2048 for k, v in head_saved_bytes(model, 2048, 1, 1, False, 4).items()} == {
        "final_norm": 1540,
        "log_probs": 1024,
        "loss_gradients": 2048,
    }
    assert 4 * 10136 * 2048 + 1540 * 2048 + 8 * 2048 + 2 * 2048 * 32 * 4 == 86728704
    # the sums the planner reports for that run: activations = 4 layers, logits = the head's terms
    cfg = compose_config(
        [
            "model=llama_tiny",
            "data.seq_length=2048",
            "data.micro_batch_size=1",
            "data.global_batch_size=1",
            "precision.type=fp32",
        ],
        check=False,
    )
    m = memory_per_rank(cfg, degrees())
    assert (m["activations"], m["logits"]) == (4 * 10136 * 2048, (1540 + 1024 + 2048) * 2048)


@pytest.mark.parametrize("model_name", ["llama_tiny", "gpt_tiny", "mixtral_tiny"])
def test_the_count_is_what_autograd_keeps_for_one_layer(model_name):
    """One layer of each hub model run forward under saved_tensors_hooks, for each kernel, in fp32 and bf16: the bytes
    of every storage autograd keeps (parameters excluded) equal the planner's count exactly; Mixtral's routing
    indices and weights are not counted (int64 top-k ids, sort order and row index, 3·8·k, and the fp32 weights and
    their normaliser, 4·k + 4: at most 28·k + 4 bytes per token)."""
    import torch

    seq = 64  # one sequence: naive_score_bytes counts the mask per sequence (packed records: [b, s, s])
    cfg = compose_config([f"model={model_name}", f"data.seq_length={seq}"], check=False)
    module, cls = cfg.model.architecture.rsplit(".", 1)
    for kernel in ("sdpa", "blockwise", "naive"):
        for dtype, act in ((torch.float32, 4), (torch.bfloat16, 2)):
            cfg.model.core_attention = kernel
            torch.manual_seed(0)
            model = getattr(__import__(module, fromlist=[cls]), cls)(cfg.model).to(dtype)
            held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
            storages: dict[int, int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            x = torch.randn(1, seq, cfg.model.hidden_size, dtype=dtype, requires_grad=True)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model.run_layer(model.layers[0], x, None)
            kept = sum(n for ptr, n in storages.items() if ptr not in held)
            planned = sum(layer_saved_bytes(cfg.model, seq, 1, 1, False, act, kernel).values())
            if model_name == "mixtral_tiny":
                assert 0 <= kept - planned <= (28 * cfg.model.moe.top_k + 4) * seq, (kernel, dtype)
            else:
                assert kept == planned, (kernel, dtype)
