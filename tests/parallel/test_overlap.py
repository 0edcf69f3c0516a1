"""Data-parallel gradient reduction overlapped with backward (nxdt.parallel.overlap): the same bits as after backward.

One spawned 2-rank world trains (3 and 4 ranks: a wider MLP, see below), for plain DP and ZeRO-1, each model twice from the same start — the reduction after
backward (``overlap_grad_reduce=False``, the path nxdt always had) and in DDP's buckets during the last backward —
with gradient accumulation 2 (the strategy arms only the last micro-batch's backward), AdamW and clipping, and
compares the weights with ``torch.equal`` after every step. No tolerance: with two DP members every element is one
fp32 addition (commutative) and a halving on every path, so any difference is a bug (a stale or missed gradient, a
wrong bucket offset), not rounding. The models: an MLP with a frozen layer and a layer rank 1 uses only in the first
micro-batch (its gradient comes from accumulation, never from a hook in the armed backward) and one rank 0 never
uses (``find_unused_parameters``: the 1/0 presence flags); and a LoRA Llama (frozen base, adapters trained) with
full activation checkpointing (recomputation inside backward: each hook must still fire once). Small bucket caps make
several buckets, and the test checks that buckets left during backward, not all at the end.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from nxdt.comm.spawn import run_local
from nxdt.models.llama import LlamaForCausalLM
from nxdt.models.lora import apply_lora
from nxdt.parallel.data_parallel import ModelParallel, data_parallel_runtime
from nxdt.parallel.overlap import cap_elements, plan_buckets
from nxdt.config.hf_model import tensor_parallel_plan_of

from hf_reference import TINY_LLAMA

STEPS, MICRO, MAX_NORM = 3, 2, 0.5
TINY = {**TINY_LLAMA, "activations_checkpoint_granularity": "full"}  # the parity tests' shape, recomputed


class _Net(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        # registered first, so in the bucket issued last: its gradient, missing from the armed backward on both ranks,
        # holds back only that bucket (buckets leave in order, as DDP's)
        self.side = nn.Linear(width, 4)  # rank 1: first micro-batch only; rank 0: never
        self.first = nn.Linear(8, width)
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.middle = nn.Linear(width, width)
        self.last = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        h = torch.tanh(self.middle(torch.tanh(self.frozen(torch.tanh(self.first(x))))))
        return self.last(h) + (self.side(h) if side else 0)


def _mlp_loss(model: nn.Module, rank: int, step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x, y = torch.randn(4, 8, generator=g) * 3, torch.randn(4, 4, generator=g)
    return nn.functional.mse_loss(model(x, side=rank == 1 and micro == 0), y)


def _llama_loss(model: nn.Module, rank: int, step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    ids = torch.randint(0, TINY["vocab_size"], (2, 16), generator=g)
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


def _wide_mlp() -> nn.Module:
    """18,696 trainable parameters: the after-backward buffer (75 KB) is past shm's 64 KB direct limit, so 3 and 4
    members reduce it by slices, owners 2 and 3 included, while the buckets (mostly below it) take the direct path."""
    torch.manual_seed(0)
    return _Net(width=128)


def _llama() -> nn.Module:
    torch.manual_seed(0)
    model = apply_lora(LlamaForCausalLM(SimpleNamespace(**TINY)), rank=4, alpha=8, target_modules=("qkv_proj", "down_proj"))
    with torch.no_grad():  # B = 0 at the start would leave A's gradient zero
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape))
    return model


# (model, loss, bucket_cap_mb: a few buckets, find_unused_parameters)
MODELS = {"mlp": (_mlp, _mlp_loss, 2e-3, True), "lora_llama": (_llama, _llama_loss, 1e-3, False)}


def _train(world, build, loss_fn, zero1: bool, overlap: bool, cap: float, unused: bool) -> dict:
    rank = world.rank
    model = build()
    rt = data_parallel_runtime(zero1=zero1, overlap_grad_reduce=overlap, bucket_cap_mb=cap, find_unused_parameters=unused)
    rt.bind(ModelParallel(dp=world.world, dp_size=world.world_size))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = rt.shard_optimizer(torch.optim.AdamW(trainable, lr=1e-2, foreach=False), model)
    rt.shard_model(model, [opt])
    weights, issued = [], []
    for step in range(STEPS):
        for micro in range(MICRO):
            rt.before_backward(last=micro == MICRO - 1)  # what NxDStrategy.pre_backward says
            loss_fn(model, rank, step, micro).div(MICRO).backward()
        rt.finish_gradients(model)
        issued.append([r.issued_in_backward if r.used else -1 for r in rt._reductions])  # -1: fell back after backward
        rt.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        rt.after_step(opt)
        opt.zero_grad()
        weights.append([p.detach().clone() for p in model.parameters()])
    buckets = [len(r.buckets) for r in rt._reductions]
    return {"weights": weights, "issued": issued, "buckets": buckets, "off": rt.overlap_off}


def _worker(world) -> dict:
    out = {}
    for name, (build, loss_fn, cap, unused) in MODELS.items():
        for zero1 in (False, True):
            runs = {overlap: _train(world, build, loss_fn, zero1, overlap, cap, unused) for overlap in (False, True)}
            out[(name, zero1)] = {
                "equal": [
                    all(torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(runs[False]["weights"], runs[True]["weights"])
                ],
                "moved": not all(torch.equal(a, b) for a, b in zip(runs[True]["weights"][0], build().parameters())),
                "issued": runs[True]["issued"],
                "buckets": runs[True]["buckets"],
                "off": (runs[False]["off"], runs[True]["off"]),
            }
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_local(_worker, 2, timeout_s=240)


@pytest.mark.parametrize("zero1", [False, True], ids=["replicated", "zero1"])
@pytest.mark.parametrize("name", list(MODELS))
def test_overlapped_reduction_is_bitwise_the_post_backward_one(results, name, zero1):
    for rank, per_rank in enumerate(results):
        got = per_rank[(name, zero1)]
        assert got["off"] == ("overlap_grad_reduce is off", None), (rank, got["off"])
        assert got["moved"], "the weights did not train"
        assert all(got["equal"]), f"rank {rank}: weights differ from the post-backward path at steps {got['equal']}"
        (buckets,) = got["buckets"]
        assert buckets >= 3, f"the bucket cap made only {buckets} bucket(s)"
        # buckets leave during the armed backward, not all after it (the first layer's bucket completes last)
        assert all(0 < issued[0] <= buckets for issued in got["issued"]), got["issued"]


def test_buckets_follow_backward_order_and_cap():
    assert plan_buckets([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]
    assert plan_buckets([3, 20, 2, 2, 9], 8) == [[0], [1], [2, 3], [4]]  # a larger one alone; nothing split
    assert plan_buckets([0, 5, 0], 5) == [[0, 1, 2]]
    assert plan_buckets([], 8) == []
    assert cap_elements(None, 4) == 25 * (1 << 20) // 4  # DDP's default bucket_cap_mb, 25 MiB
    assert cap_elements(1, 2) == (1 << 20) // 2
    with pytest.raises(ValueError, match="cap_elements"):
        plan_buckets([1], 0)


def _wide_worker(world) -> dict:
    out = {}
    for zero1 in (False, True):
        runs = {overlap: _train(world, _wide_mlp, _mlp_loss, zero1, overlap, 0.02, True) for overlap in (False, True)}
        out[zero1] = {
            "equal": [
                all(torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(runs[False]["weights"], runs[True]["weights"])
            ],
            "issued": runs[True]["issued"],
            "buckets": runs[True]["buckets"],
            "off": (runs[False]["off"], runs[True]["off"]),
        }
    return out


@pytest.mark.parametrize("world_size", [3, 4])
def test_groups_of_three_and_four_overlap_with_the_same_bits(world_size):
    """On one host shm adds every element's contributions in member order, whichever slice, chunk or bucket it falls
    in (tests/comm/test_native.py), so 3 and 4 members overlap too, again equal with ``torch.equal``: before that order
    was fixed, the slices owned by members 2 and 3 of the whole buffer were summed owner first, and ZeRO-1's reduce to
    owners 2 and 3 root first, which differ from the buckets' and the reduce-scatter's member order in the last bit."""
    for rank, per_rank in enumerate(run_local(_wide_worker, world_size, timeout_s=240)):
        for zero1, got in per_rank.items():
            assert got["off"] == ("overlap_grad_reduce is off", None), (rank, zero1, got["off"])
            assert all(got["equal"]), f"rank {rank} zero1={zero1}: weights differ at steps {got['equal']}"
            (buckets,) = got["buckets"]
            assert buckets >= 3 and all(0 < issued[0] <= buckets for issued in got["issued"]), (buckets, got["issued"])


class _Holder(nn.Module):
    """What NxDStrategy hands the runtimes: a module whose ``model`` is the hub model (its parameter names)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def _tp_train(world, tp, dp, lora: bool, zero1: bool, overlap: bool) -> dict:
    from nxdt.parallel.tensor_parallel import apply_tensor_parallel, norm_weights, partial_grad_names

    if lora:  # LoRA under TP: the adapters' replicated halves are partial sums over TP
        model = apply_tensor_parallel(m := _llama(), tp, sequence_parallel=False, plan=tensor_parallel_plan_of(m))
    else:  # sequence parallelism: the replicated norms' gradients are partial sums over TP
        torch.manual_seed(0)
        model = apply_tensor_parallel(
            m := LlamaForCausalLM(SimpleNamespace(**TINY_LLAMA)), tp, sequence_parallel=True, plan=tensor_parallel_plan_of(m)
        )
    holder, partial = _Holder(model), partial_grad_names(model)
    rt = data_parallel_runtime(zero1=zero1, overlap_grad_reduce=overlap, bucket_cap_mb=2e-3)
    rt.bind(
        ModelParallel(
            dp=dp, dp_size=2, tp=tp, sequence_parallel=not lora, norm_weights=norm_weights(model, 2), tp_partial_grads=partial
        )
    )
    opt = rt.shard_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2), holder)
    rt.shard_model(holder, [opt])
    weights, issued = [], []
    for step in range(STEPS):
        for micro in range(MICRO):
            rt.before_backward(last=micro == MICRO - 1)
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + dp.rank)  # the same on both TP ranks
            ids, labels = torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)
            model.loss_fn(model(ids), labels).div(MICRO).backward()
        rt.finish_gradients(holder)
        issued.append([r.issued_in_backward if r.used else -1 for r in rt._reductions])  # -1: fell back after backward
        rt.clip_grad_norm_(holder, MAX_NORM)
        opt.step()
        rt.after_step(opt)
        opt.zero_grad()
        weights.append([p.detach().clone() for p in model.parameters()])
    return {"weights": weights, "issued": issued, "off": rt.overlap_off, "partial": len(partial)}


def _tp_worker(world) -> dict:
    rank = world.rank
    tp = world.new_communicator([rank - rank % 2, rank - rank % 2 + 1], f"tp{rank // 2}")
    dp = world.new_communicator([rank % 2, rank % 2 + 2], f"dp{rank % 2}")
    out = {}
    # SP with ZeRO-1 (NxDT's usual layout), LoRA under TP with plain DP: each runtime's way of deferring partial ones
    for lora, zero1 in ((False, True), (True, False)):
        runs = {overlap: _tp_train(world, tp, dp, lora, zero1, overlap) for overlap in (False, True)}
        out[(lora, zero1)] = {
            "equal": [
                all(torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(runs[False]["weights"], runs[True]["weights"])
            ],
            "issued": runs[True]["issued"],
            "off": (runs[False]["off"], runs[True]["off"]),
            "partial": runs[True]["partial"],
        }
    return out


def test_tp_partial_gradients_wait_for_their_tp_sum_and_the_rest_overlaps():
    """TP2 × DP2 (4 ranks): sequence parallelism's norms and LoRA's replicated halves have gradients that are partial
    sums over TP until ``finish_gradients`` adds them, so they stay out of the buckets and are averaged after it; every
    other gradient is reduced during backward. Weights after every step equal the after-backward path's
    (``torch.equal``; SP with ZeRO-1, LoRA with plain DP), accumulation 2."""
    for rank, per_rank in enumerate(run_local(_tp_worker, 4, timeout_s=240)):
        for (lora, zero1), got in per_rank.items():
            tag = f"rank {rank} lora={lora} zero1={zero1}"
            assert got["partial"] > 0, tag
            assert got["off"] == ("overlap_grad_reduce is off", None), (tag, got["off"])
            assert all(got["equal"]), f"{tag}: weights differ from the post-backward path at steps {got['equal']}"
            assert all(issued and issued[0] > 0 for issued in got["issued"]), (tag, got["issued"])


def _pp_train(pp, dp, zero1: bool, overlap: bool) -> dict:
    from nxdt.parallel.pipeline import PipelineExecutor, build_chunks, one_f_one_b

    torch.manual_seed(0)
    chunks = build_chunks(LlamaForCausalLM(SimpleNamespace(**TINY_LLAMA)), pp.rank, pp.size, 1)
    stage = nn.ModuleList(chunks)
    executor = PipelineExecutor(chunks, pp, LlamaForCausalLM.loss_fn)
    rt = data_parallel_runtime(zero1=zero1, overlap_grad_reduce=overlap, bucket_cap_mb=2e-3)
    rt.bind(ModelParallel(dp=dp, dp_size=2, pp=pp))
    opt = rt.shard_optimizer(torch.optim.AdamW(stage.parameters(), lr=1e-2), stage)
    rt.shard_model(stage, [opt])
    weights, issued = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + dp.rank)
        mbs = [(torch.randint(0, 64, (1, 8), generator=g), torch.randint(0, 64, (1, 8), generator=g)) for _ in range(3)]
        executor.run(one_f_one_b(pp.size, pp.rank, len(mbs)), mbs, rt.before_backward)
        rt.finish_gradients(stage)
        issued.append([r.issued_in_backward if r.used else -1 for r in rt._reductions])  # -1: fell back after backward
        rt.clip_grad_norm_(stage, MAX_NORM)
        opt.step()
        rt.after_step(opt)
        opt.zero_grad()
        weights.append([p.detach().clone() for p in stage.parameters()])
    return {"weights": weights, "issued": issued, "off": rt.overlap_off}


def _pp_worker(world) -> dict:
    rank = world.rank
    pp = world.new_communicator([rank - rank % 2, rank - rank % 2 + 1], f"pp{rank // 2}")
    dp = world.new_communicator([rank % 2, rank % 2 + 2], f"dp{rank % 2}")
    out = {}
    for zero1 in (False, True):
        runs = {overlap: _pp_train(pp, dp, zero1, overlap) for overlap in (False, True)}
        out[zero1] = {
            "equal": [
                all(torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(runs[False]["weights"], runs[True]["weights"])
            ],
            "issued": runs[True]["issued"],
            "off": (runs[False]["off"], runs[True]["off"]),
        }
    return out


def test_pipeline_stages_reduce_during_their_last_micro_batch_backward():
    """PP2 × DP2 (4 ranks), 1F1B over 3 micro-batches: the executor arms only the last micro-batch's backward on each
    stage (``before_backward``), whose buckets then leave during it; weights equal the after-backward path's."""
    for rank, per_rank in enumerate(run_local(_pp_worker, 4, timeout_s=240)):
        for zero1, got in per_rank.items():
            tag = f"rank {rank} zero1={zero1}"
            assert got["off"] == ("overlap_grad_reduce is off", None), (tag, got["off"])
            assert all(got["equal"]), f"{tag}: weights differ from the post-backward path at steps {got['equal']}"
            assert all(issued and issued[0] > 0 for issued in got["issued"]), (tag, got["issued"])


def _three_across_hosts(world) -> tuple[str | None, int]:
    model = _mlp()
    rt = data_parallel_runtime()
    dp = world.new_communicator(list(range(world.world_size)), "dp_p2p", transport="p2p")
    rt.bind(ModelParallel(dp=dp, dp_size=world.world_size))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    rt.shard_model(model, [opt])
    return rt.overlap_off, len(rt._reductions)


def test_a_group_of_three_on_point_to_point_links_reduces_after_backward():
    """Three members over p2p (what a group across hosts gets): its ring and rhd add an element's contributions in an
    order set by its position, which bucket boundaries would move, so no hooks are set up and the reason names it."""
    for off, reductions in run_local(_three_across_hosts, 3, timeout_s=60):
        assert reductions == 0
        assert off is not None and "group of 3 on the p2p transport" in off, off


def test_strategy_refuses_a_non_boolean_switch():
    from nxdt.lightning import NxDStrategy

    with pytest.raises(ValueError, match=r"overlap_grad_reduce='yes'\): must be True or False"):
        NxDStrategy(overlap_grad_reduce="yes")  # type: ignore[arg-type]
