"""Context parallelism (nxdt.parallel.context_parallel): the load-balanced split and ring attention against the
unsplit computation.

One launch per CP degree (2 and 4 ranks) checks, in fp64: one attention layer's output and its gradients dQ, dK,
dV (grouped-query heads: 4 query heads over 2 K/V heads) equal the unsplit causal attention's rows for the rank's
chunks to 1e-6 — in fp64 the ring's only differences are summation order and the log-sum-exp merge, ~1e-15
relative; and a tiny Llama whose core attention is swapped for ring attention gives, for the rank's tokens at
their global positions, the unsplit model's logits and (after the token-share weighting and a sum over CP) the
unsplit model's parameter gradients (to 1e-6 relative: the model's cross-entropy runs in fp32 by design, so these
gradients carry fp32 rounding, ~1e-7). The same with pipeline parallelism (PP2×CP2 on 4 ranks, 1F1B over two
micro-batches, the token share applied on the last stage). A traced run over an emulated slow link shows the ring's K/V transfer in
flight while the block in hand is computed. The split itself is checked without processes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nxdt.comm import EmulatedLink, Tracer
from nxdt.comm.spawn import run_local
from nxdt.models.attention import naive_attention
from nxdt.models.llama import LlamaForCausalLM
from nxdt.parallel.context_parallel import (
    RingAttention,
    apply_context_parallel,
    chunk_ranges,
    load_balanced_positions,
    sequence_means,
    shard_micro_batches,
    weight_by_token_share,
)
from nxdt.parallel.pipeline import PipelineExecutor, build_chunks, one_f_one_b
from nxdt.planner import plan_layout

B, H, HKV, D = 2, 4, 2, 8


def test_load_balanced_split():
    assert chunk_ranges(16, 0, 2) == [(0, 4), (12, 16)] and chunk_ranges(16, 1, 2) == [(4, 8), (8, 12)]
    assert load_balanced_positions(8, 1, 4).tolist() == [1, 6]
    everything = torch.cat([load_balanced_positions(24, r, 3) for r in range(3)])
    assert sorted(everything.tolist()) == list(range(24))  # every token on exactly one rank
    with pytest.raises(ValueError, match="does not split into 2·CP = 4 equal chunks"):
        load_balanced_positions(10, 0, 2)


def _qkv(seq: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, heads, seq, D, generator=g, dtype=dtype) for heads in (H, HKV, HKV))
    grad = torch.randn(B, H, seq, D, generator=g, dtype=dtype)
    return q, k, v, grad


def _tiny_llama_cfg() -> SimpleNamespace:
    return SimpleNamespace(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=64,
        max_position_embeddings=64,
        rope_theta=10000.0,
        norm_eps=1e-5,
        tie_word_embeddings=False,
        init_method_std=0.02,
        activations_checkpoint_granularity=None,
    )


def _tiny_llama():
    torch.manual_seed(3)
    return LlamaForCausalLM(_tiny_llama_cfg()).double()


def _packed(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment ids [B, seq] of packed records (1, 2, ...; 0 on the padding at the end of row 0) and each token's
    position within its record: records that start, end and lie wholly inside one rank's chunks, so some score tiles
    hide every key from some of their rows."""
    segments = torch.zeros(B, seq, dtype=torch.long)
    positions = torch.zeros(B, seq, dtype=torch.long)
    for row, lengths in enumerate(([1, 4, 2, seq - 9], [5, 1, 1, seq - 7])):
        start = 0
        for record, n in enumerate(lengths, start=1):
            segments[row, start : start + n] = record if row or record < len(lengths) else 0  # row 0 ends in padding
            positions[row, start : start + n] = torch.arange(n)
            start += n
    return segments, positions


def _layer_and_model(world, seq: int, block_size: int) -> dict:
    """Errors of one attention layer and of a tiny Llama through the ring against the unsplit computation: plain
    causal sequences, then packed records (keys prefixed ``packed/``)."""
    errors = _ring_errors(world, seq, block_size, None, None)
    segments, positions = _packed(seq)
    errors.update({f"packed/{k}": v for k, v in _ring_errors(world, seq, block_size, segments, positions).items()})
    return errors


def _ring_errors(world, seq: int, block_size: int, segments, positions) -> dict:
    comm = world.new_communicator(list(range(world.world_size)), f"cp{0 if segments is None else 1}")
    index = load_balanced_positions(seq, comm.rank, comm.size)
    mine_segments = None if segments is None else segments[:, index]
    # one attention layer: the unsplit reference, then this rank's rows through the ring
    q, k, v, grad = _qkv(seq)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    naive_attention(*ref, causal=True, segment_ids=segments).backward(grad)
    mine = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
    out = RingAttention(comm, block_size=block_size)(*mine, segment_ids=mine_segments)
    out.backward(grad[:, :, index])
    with torch.no_grad():
        expect_out = naive_attention(q, k, v, causal=True, segment_ids=segments)[:, :, index]
    # dK/dV of this rank's rows gather contributions from every rank's queries: compare them after the ring
    errors = {"out": (out - expect_out).abs().max().item()}
    for name, got, want in zip(("dq", "dk", "dv"), mine, ref):
        errors[name] = (got.grad - want.grad[:, :, index]).abs().max().item()
    # a tiny Llama, ring attention swapped in: logits and parameter gradients of the whole sequence
    reference, model = _tiny_llama(), _tiny_llama()
    assert apply_context_parallel(model, comm) == 2
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 64, (B, seq), generator=g)
    labels = torch.randint(0, 64, (B, seq), generator=g)
    labels[0, : seq // 3] = -100  # unevenly masked labels: the token share must still give the token mean
    full_logits = reference(ids, positions, segments)
    reference.loss_fn(full_logits, labels).backward()
    batch = {"input_ids": ids, "labels": labels}
    if segments is not None:  # packed records carry their own positions, cut with the rest
        batch.update(segment_ids=segments, position_ids=positions)
    [part] = shard_micro_batches([batch], comm)
    logits = model(part["input_ids"], part["position_ids"], part.get("segment_ids"))
    loss = weight_by_token_share(model.loss_fn(logits, part["labels"]), part)
    loss.backward()
    errors["logits"] = (logits - full_logits[:, index]).abs().max().item()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    comm.all_reduce(grads, op="avg")  # what the DP×CP gradient average does
    want = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    errors["param_grads"] = ((grads - want).abs().max() / want.abs().max()).item()
    loss_mean = loss.detach().reshape(1).clone()
    comm.all_reduce(loss_mean, op="avg")
    errors["loss"] = abs(loss_mean.item() - reference.loss_fn(full_logits, labels).item())
    return errors


@pytest.mark.parametrize("cp,block_size", [(2, 256), (4, 2)])
def test_ring_attention_equals_unsplit_attention(cp, block_size):
    seq = 2 * cp * 3  # three tokens per chunk: the diagonal tiles hold partially masked rows
    # block_size 2 cuts each chunk's 3 query rows into tiles of 2 and 1 rows (full, diagonal and skipped ones alike)
    for rank, errors in enumerate(run_local(_layer_and_model, cp, seq, block_size, timeout_s=90)):
        assert len(errors) == 14 and max(errors.values()) < 1e-6, (rank, errors)


def _traced_ring(world, seq: int) -> list[dict]:
    torch.set_num_threads(1)
    tracer = Tracer(world.rank)
    world.set_tracer(tracer)
    # a slow link (0.3 s per transfer), so a transfer outlasts the compute it should hide behind
    comm = world.new_communicator([0, 1], "cp0", link=EmulatedLink(latency_s=0.3, bytes_per_s=1e9))
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 8, seq // 2, 64, generator=g, requires_grad=True) for _ in range(3))
    RingAttention(comm)(q, k, v).sum().backward()
    world.set_tracer(None)
    return [e for e in tracer.events() if e.get("ph") == "X"]


def test_ring_transfer_overlaps_attention_compute():
    for events in run_local(_traced_ring, 2, 1024, timeout_s=90):
        transfers = [e for e in events if e["cat"] == "cp" and e["name"] == "send_recv"]
        computes = {(e["name"], e["args"]["step"]): e for e in events if e["cat"] == "compute"}
        # forward: 1 K/V transfer; backward: 1 K/V transfer and 2 dK/dV hops (the last one home to the owner)
        assert len(transfers) == 4, transfers
        for transfer, compute in (
            (transfers[0], computes["ring_attention.forward", 0]),
            (transfers[1], computes["ring_attention.backward", 0]),
        ):
            t0, t1 = transfer["ts"], transfer["ts"] + transfer["dur"]
            c0, c1 = compute["ts"], compute["ts"] + compute["dur"]
            assert t0 < c1 and c0 < t1, (transfer, compute)  # the next block travelled while this one was computed


def test_a_rank_without_counted_tokens_adds_zero_loss_and_finite_gradients():
    logits = torch.randn(1, 4, 8, requires_grad=True)
    labels = torch.full((1, 4), -100)  # every label of this rank's chunks masked: its mean is 0/0
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 8), labels.reshape(-1), ignore_index=-100)
    weighted = weight_by_token_share(loss, {"cp_token_share": torch.zeros((), dtype=torch.float64)})
    weighted.backward()
    assert weighted.item() == 0.0 and torch.isfinite(logits.grad).all() and not logits.grad.any()
    assert weight_by_token_share(loss, (None, labels)) is loss  # a plain (ids, labels) pair: no context parallelism


def _mixtral_through_the_ring(world, seq: int) -> dict:
    """A tiny Mixtral (router_aux_loss_coef 0.1, routers initialised unevenly) over CP2 against the unsplit model: the
    load-balancing statistics add up over the CP group, so each rank's loss carries the whole sequence's term, and the
    token-share weighted losses' gradients, averaged over CP, are the unsplit model's (labels masked unevenly: the two
    ranks' shares differ, which a backward of ×CP instead of a sum would get wrong); with segment ids marking padding,
    the padding-masked term (DPO's, GRPO's) is the unsplit one too."""
    from nxdt.models.mixtral import MixtralForCausalLM

    comm = world.new_communicator(list(range(world.world_size)), "cp")
    cfg = SimpleNamespace(**vars(_tiny_llama_cfg()), moe=SimpleNamespace(num_experts=4, top_k=2, router_aux_loss_coef=0.1))

    def build() -> MixtralForCausalLM:
        torch.manual_seed(3)
        model = MixtralForCausalLM(cfg)
        for block in model.moe_blocks():
            torch.nn.init.normal_(block.gate.weight, std=0.5)
        return model

    reference, model = build(), build()
    apply_context_parallel(model, comm)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (B, seq), generator=g)
    labels = torch.randint(0, 64, (B, seq), generator=g)
    labels[0, : seq // 3] = -100
    full = reference.loss_fn(reference(ids), labels)
    full.backward()
    [part] = shard_micro_batches([{"input_ids": ids, "labels": labels}], comm)
    loss = weight_by_token_share(model.loss_fn(model(part["input_ids"], part["position_ids"]), part["labels"]), part)
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    comm.all_reduce(grads, op="avg")  # what the DP×CP gradient average does
    want = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    mean = loss.detach().reshape(1).clone()
    comm.all_reduce(mean, op="avg")
    segments = torch.ones_like(ids)
    segments[1, -seq // 4 :] = 0  # a right-padded row
    with torch.no_grad():
        reference(ids, None, segments)
        [part] = shard_micro_batches([{"input_ids": ids, "labels": labels, "segment_ids": segments}], comm)
        model(part["input_ids"], part["position_ids"], part["segment_ids"])
    return {
        "loss": abs(mean.item() - full.item()),
        "param_grads": ((grads - want).abs().max() / want.abs().max()).item(),
        "router_grads": max(float(b.gate.weight.grad.abs().max()) for b in model.moe_blocks()),
        "masked_aux": (float(model.aux_loss(padding_masked=True)), float(reference.aux_loss(padding_masked=True))),
    }


def test_a_mixture_of_experts_models_load_balancing_term_runs_over_whole_sequences():
    for rank, got in enumerate(run_local(_mixtral_through_the_ring, 2, 16, timeout_s=90)):
        # fp32 model: the loss to ~1e-7 relative; the term's weight is 0.1 of a loss of ~4, a per-rank term moves it ~1e-3
        assert got["loss"] < 1e-5, (rank, got)
        assert got["param_grads"] < 1e-5 and got["router_grads"] > 0, (rank, got)
        assert got["masked_aux"][0] == pytest.approx(got["masked_aux"][1], rel=1e-5), (rank, got)


def _pipeline_and_ring(world, seq: int) -> dict:
    """PP2 × CP2: each stage's layers run ring attention over its CP pair; gradients averaged over CP (DP×CP here)."""
    plan = plan_layout(4, pp=2, cp=2)
    comms = {}
    for dim in ("pp", "cp"):
        for i, ranks in enumerate(plan.groups[dim]):
            comm = world.new_communicator(ranks, f"{dim}{i}")
            if comm is not None:
                comms[dim] = comm
    g = torch.Generator().manual_seed(5)
    micro = [
        {"input_ids": torch.randint(0, 64, (1, seq), generator=g), "labels": torch.randint(0, 64, (1, seq), generator=g)}
        for _ in range(2)
    ]
    micro[1]["labels"][0, seq // 2 :] = -100  # masked labels on some CP ranks only
    reference = _tiny_llama()
    for mb in micro:
        (reference.loss_fn(reference(mb["input_ids"]), mb["labels"]) / len(micro)).backward()
    model = _tiny_llama()
    apply_context_parallel(model, comms["cp"])
    pp = comms["pp"]
    executor = PipelineExecutor(build_chunks(model, pp.rank, pp.size), pp, model.loss_fn)
    loss = executor.run(one_f_one_b(pp.size, pp.rank, len(micro)), shard_micro_batches(micro, comms["cp"]))
    mean_loss = torch.tensor([loss], dtype=torch.float64)
    comms["cp"].all_reduce(mean_loss, op="avg")
    want_loss = sum(reference.loss_fn(reference(mb["input_ids"]), mb["labels"]).item() for mb in micro) / len(micro)
    errors = {"loss": abs(mean_loss.item() - want_loss)}
    full = dict(reference.named_parameters())
    for name, p in model.named_parameters():  # this stage's parameters
        grad = p.grad.clone()
        comms["cp"].all_reduce(grad, op="avg")
        errors[name] = ((grad - full[name].grad).abs().max() / full[name].grad.abs().max()).item()
    # validation: forward only through stages and ring, each micro-batch's token mean over the whole sequence on every
    # rank; the third micro-batch leaves CP rank 0 (chunks 0 and 3) no counted token
    unseen = {"input_ids": torch.randint(0, 64, (1, seq), generator=g), "labels": torch.randint(0, 64, (1, seq), generator=g)}
    unseen["labels"][0, : seq // 4] = unseen["labels"][0, 3 * seq // 4 :] = -100
    held_out = [*micro, unseen]
    parts = shard_micro_batches(held_out, comms["cp"])
    means = sequence_means(executor.evaluate(parts), parts, comms["cp"])
    with torch.no_grad():
        want = [reference.loss_fn(reference(mb["input_ids"]), mb["labels"]).item() for mb in held_out]
    errors["validation"] = max(abs(a - b) for a, b in zip(means, want))
    return errors


def test_pipeline_stages_run_the_ring_too():
    for rank, errors in enumerate(run_local(_pipeline_and_ring, 4, 16, timeout_s=90)):
        assert len(errors) > 3 and max(errors.values()) < 1e-6, (rank, errors)  # fp32 cross-entropy: ~1e-7
