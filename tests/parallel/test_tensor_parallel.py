"""nxdt.parallel.tensor_parallel against a single-process model of the same seed.

Every spawned rank builds the reference model and the tensor-parallel one from the same seed, runs both on
the same batch and checks: logits (vocab shards gathered), loss, every parameter gradient gathered to full
shape, the gathered state dict, and 5 AdamW steps (same losses, same final full parameters). Cases: TP2
(KV heads sharded), TP2 + sequence parallelism, TP2 with one KV head replicated and tied embeddings, TP4
with 2 KV heads (each replicated on two ranks), with and without SP. The vocab-parallel cross-entropy is
checked alone against F.cross_entropy, ignore_index included. Bad layouts fail with messages naming the
module and the sizes, checked without processes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nxdt.comm import Tracer
from nxdt.comm.spawn import run_local
from nxdt.models.gpt import GPTForCausalLM
from nxdt.models.llama import LlamaForCausalLM
from nxdt.models.objectives import token_log_probs
from nxdt.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    apply_tensor_parallel,
    gather_from_tensor_parallel_region,
    gather_full_grads,
    gather_full_state_dict,
    shard_layout,
    sync_replicated_grads,
    vocab_parallel_cross_entropy,
)
from nxdt.config.hf_model import tensor_parallel_plan_of

BATCH, SEQ = 2, 8


def config(**overrides) -> SimpleNamespace:
    base = dict(
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
    return SimpleNamespace(**{**base, **overrides})


def batch(step: int, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels[0, :3] = -100  # ignored positions must not count in the mean
    return ids, labels


def build(cfg: SimpleNamespace) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms start at 1: perturb them so a wrong norm gradient or slicing cannot hide
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return model


def close(actual, expected, what, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _check_activation_collectives(comm, cfg, sequence_parallel: bool, tag: str) -> None:
    """One forward + backward moves activations over TP exactly as often as Megatron's layout does: per layer
    one reduction after attention and one after the MLP (forward), one input-gradient reduction for q/k/v
    together and one for gate/up together (backward), plus the embedding's and the head's. Without SP these
    are all-reduces of [B, S, H]; with SP, all-gathers and reduce-scatters of its sequence shards."""
    tracer, _ = comm.world.tracer, comm.world.set_tracer(None)
    if cfg.activations_checkpoint_granularity == "full":
        return  # recomputation repeats (part of) the forward's collectives, as many as torch's checkpoint needs
    activation = BATCH * SEQ * cfg.hidden_size * 4
    names = [
        e["name"] for e in tracer.events() if e.get("ph") == "X" and e["cat"] == "tp" and e["args"].get("bytes") == activation
    ]
    expected = 4 * cfg.num_layers + 2
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    if comm.size > cfg.num_kv_heads and cfg.num_kv_heads * head_dim * cfg.hidden_size * 4 == activation:
        expected_kv_sums = 2 * cfg.num_layers  # k and v weight gradients summed over replicas: the same size here
    else:
        expected_kv_sums = 0
    if sequence_parallel:
        assert (names.count("all_gather"), names.count("reduce_scatter")) == (expected, expected), (tag, names)
    else:
        assert names.count("all_reduce") == expected + expected_kv_sums, (tag, names)


def _check_case(comm, overrides: dict, sequence_parallel: bool, steps: int) -> dict:
    cfg = config(**overrides)
    ref = build(cfg)
    model = apply_tensor_parallel(m := build(cfg), comm, sequence_parallel=sequence_parallel, plan=tensor_parallel_plan_of(m))
    tag = f"tp{comm.size} sp={sequence_parallel} {overrides}"

    # the layout: what each rank holds
    attn = model.layers[0].self_attn
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_local = max(cfg.num_kv_heads // comm.size, 1) * head_dim
    assert isinstance(attn.q_proj, ColumnParallelLinear) and isinstance(attn.o_proj, RowParallelLinear)
    assert isinstance(model.embed_tokens, VocabParallelEmbedding) and isinstance(model.lm_head, VocabParallelHead)
    assert attn.q_proj.weight.shape == (cfg.hidden_size // comm.size, cfg.hidden_size)
    assert attn.k_proj.weight.shape == (kv_local, cfg.hidden_size), (tag, attn.k_proj.weight.shape)
    local_vocab = padded_vocab(cfg, comm.size) // comm.size
    assert model.lm_head.weight.shape == model.embed_tokens.weight.shape == (local_vocab, cfg.hidden_size)
    assert model.tied == cfg.tie_word_embeddings
    replicated_kv = comm.size > cfg.num_kv_heads
    kv_rows = slice(None)
    if replicated_kv:  # rank r holds the KV head its query heads use
        kv_head = comm.rank // (comm.size // cfg.num_kv_heads)
        kv_rows = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
        close(attn.k_proj.weight, ref.layers[0].self_attn.k_proj.weight[kv_rows], tag)
    full = gather_full_state_dict(model, comm)
    assert full.keys() == ref.state_dict().keys()
    for name, value in ref.state_dict().items():
        assert torch.equal(full[name], value), (tag, name)

    # lr 1e-3: Adam normalises each update, so a weight whose gradient is ~0 turns fp32 rounding noise into an
    # update of up to ~lr; at 1e-3 that stays inside atol 1e-6 while 5 steps still move every weight visibly
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    losses = []
    for step in range(max(steps, 1)):
        ids, labels = batch(step, cfg.vocab_size)
        opt_ref.zero_grad()
        opt.zero_grad()
        ref_logits = ref(ids)
        ref_loss = ref.loss_fn(ref_logits, labels)
        ref_loss.backward()
        if step == 0:
            comm.world.set_tracer(Tracer(comm.rank))
        logits = model(ids)
        assert logits.shape == (BATCH, SEQ, local_vocab)
        loss = model.loss_fn(logits, labels)
        loss.backward()
        if step == 0:
            _check_activation_collectives(comm, cfg, sequence_parallel, tag)
        synced = sync_replicated_grads(model, comm)
        assert (synced > 0) == sequence_parallel, (tag, synced)
        tol = dict(rtol=1e-5, atol=1e-6) if step == 0 else dict(rtol=1e-4, atol=1e-5)
        close(loss, ref_loss, f"{tag} loss step {step}", **tol)
        if step == 0:
            every = gather_from_tensor_parallel_region(logits.detach(), comm)
            close(every[..., : cfg.vocab_size], ref_logits.detach(), f"{tag} logits")
            assert torch.isneginf(every[..., cfg.vocab_size :]).all(), tag  # padding: no probability, in loss or sampling
            grads = gather_full_grads(model, comm)
            ref_grads = {n: p.grad for n, p in ref.named_parameters()}
            assert grads.keys() == ref_grads.keys(), (tag, sorted(grads), sorted(ref_grads))
            for name, g in ref_grads.items():
                close(grads[name], g, f"{tag} grad {name}", atol=1e-7)
            if replicated_kv:  # gathering keeps one replica per head: check this rank's own copy too
                close(
                    attn.v_proj.weight.grad,
                    ref.layers[0].self_attn.v_proj.weight.grad[kv_rows],
                    f"{tag} local KV grad",
                    atol=1e-7,
                )
        losses.append(loss.item())
        if steps:
            opt_ref.step()
            opt.step()
    if steps:
        full = gather_full_state_dict(model, comm)
        for name, p in ref.named_parameters():
            assert (p.detach() - initial[name]).abs().max() > 1e-3, (tag, name)  # the steps moved every weight
        for name, value in ref.state_dict().items():
            close(full[name], value, f"{tag} parameter {name} after {steps} AdamW steps", rtol=1e-4, atol=1e-6)
        if replicated_kv:
            close(attn.v_proj.weight, ref.layers[0].self_attn.v_proj.weight[kv_rows], f"{tag} local KV weight", rtol=1e-4)
        _check_padding_stays_zero(model, cfg, comm, tag)
    return {"case": tag, "losses": losses}


def padded_vocab(cfg, tp: int) -> int:
    """Megatron's _vocab_size_with_padding: the vocabulary rounded up to a multiple of make_vocab_size_divisible_by × TP."""
    multiple = getattr(cfg, "make_vocab_size_divisible_by", 1) * tp
    return -(-cfg.vocab_size // multiple) * multiple


def _check_padding_stays_zero(model, cfg, comm, tag: str) -> None:
    """Padding rows get no gradient (never looked up; -inf logits), so AdamW with weight decay leaves them zero:
    nothing of them can leak into the trimmed full tensors or the next TP degree's slices."""
    start = comm.rank * model.lm_head.weight.shape[0]
    for table in (model.embed_tokens.weight, model.lm_head.weight):
        padding = table[max(cfg.vocab_size - start, 0) :]
        assert padding.abs().max().item() == 0 if padding.numel() else True, tag


def _cross_entropy_alone(comm) -> None:
    g = torch.Generator().manual_seed(7)
    full = (torch.randn(3, 5, 64, generator=g) * 3).requires_grad_()
    labels = torch.randint(0, 64, (3, 5), generator=g)
    labels[1, 1:4] = -100
    labels[2, 0] = 63  # the last id: lives on the last rank
    ref = F.cross_entropy(full.reshape(-1, 64), labels.reshape(-1), ignore_index=-100)
    ref.backward()
    shard = full.detach().chunk(comm.size, -1)[comm.rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, labels, comm)
    loss.backward()
    close(loss, ref, "vocab-parallel cross-entropy")
    close(shard.grad, full.grad.chunk(comm.size, -1)[comm.rank], "vocab-parallel cross-entropy gradient")
    # bf16 logits are reduced in fp32 as the model's loss does
    loss16 = vocab_parallel_cross_entropy(shard.detach().bfloat16(), labels, comm)
    close(loss16, F.cross_entropy(full.detach().bfloat16().float().reshape(-1, 64), labels.reshape(-1)), "bf16 logits")
    every_ignored = torch.full((2, 3), -100)
    assert torch.isnan(vocab_parallel_cross_entropy(shard[:2, :3].detach(), every_ignored, comm))
    with pytest.raises(ValueError, match="must agree"):
        vocab_parallel_cross_entropy(shard, labels[:, :4], comm)


def _token_log_probs_alone(comm) -> None:
    """DPO/ORPO's per-token log-probabilities from vocab-sharded logits equal log_softmax of the full logits (0 where the
    label is -100), and so do the gradients of a weighted sum of them (a sequence score)."""
    g = torch.Generator().manual_seed(8)
    full = (torch.randn(2, 5, 64, generator=g) * 3).requires_grad_()
    labels = torch.randint(0, 64, (2, 5), generator=g)
    labels[0, :2] = -100
    labels[1, 4] = 63
    ref = token_log_probs(full, labels)
    weights = torch.randn(2, 5, generator=g)
    (ref * weights).sum().backward()
    head = VocabParallelHead.from_full(nn.Linear(4, 64, bias=False), comm)
    shard = full.detach().chunk(comm.size, -1)[comm.rank].clone().requires_grad_()
    mine = head.token_log_probs(shard, labels)
    (mine * weights).sum().backward()
    close(mine, ref, "vocab-parallel token log-probs")
    assert (mine[0, :2] == 0).all()
    close(shard.grad, full.grad.chunk(comm.size, -1)[comm.rank], "vocab-parallel token log-probs gradient")


def _sequence_length_must_divide(comm) -> None:
    model = apply_tensor_parallel(m := build(config()), comm, sequence_parallel=True, plan=tensor_parallel_plan_of(m))
    with pytest.raises(ValueError, match="multiple of the tensor-parallel size"):
        model(torch.zeros(1, 2 * comm.size + 1, dtype=torch.long))


def _biased_mlp(comm) -> None:
    """Column → row with biases (Llama has none): the column bias is sharded, the row bias replicated and,
    under SP, summed over the sequence shards by sync_replicated_grads; input gradients too."""
    for sequence_parallel in (False, True):
        torch.manual_seed(1)
        ref = _Toy({"up": "colwise", "down": "rowwise"})
        torch.manual_seed(1)
        toy = apply_tensor_parallel(_Toy({"up": "colwise", "down": "rowwise"}), comm, sequence_parallel=sequence_parallel)
        x = torch.randn(2, 4 * comm.size, 4, generator=torch.Generator().manual_seed(5), requires_grad=True)
        expected = ref(x)
        (expected**2).sum().backward()
        mine = x.detach().chunk(comm.size, 1)[comm.rank].clone() if sequence_parallel else x.detach().clone()
        mine.requires_grad_()
        out = toy(mine)
        (out**2).sum().backward()
        sync_replicated_grads(toy, comm)
        tag = f"biased MLP sp={sequence_parallel}"
        if sequence_parallel:
            close(out, expected.detach().chunk(comm.size, 1)[comm.rank], tag)
            close(mine.grad, x.grad.chunk(comm.size, 1)[comm.rank], f"{tag} input grad")
        else:
            close(out, expected.detach(), tag)
            close(mine.grad, x.grad, f"{tag} input grad")
        grads = gather_full_grads(toy, comm)
        for name, p in ref.named_parameters():
            close(grads[name], p.grad, f"{tag} grad {name}")
    # gather_output: the full features on every rank, gradient flowing back to this rank's slice only
    torch.manual_seed(1)
    up = nn.Linear(4, 8)
    col = ColumnParallelLinear.from_full(up, comm, gather_output=True)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(6))
    close(col(x), up(x), "gather_output")
    col(x).sum().backward()
    up(x).sum().backward()
    close(col.weight.grad, up.weight.grad.chunk(comm.size)[comm.rank], "gather_output weight grad")


def _world(world, cases: list[tuple[dict, bool, int]], extras: bool, gpt_cases: tuple = ()) -> list[dict]:
    comm = world.new_communicator(list(range(world.world_size)), "tp")
    if extras:
        _cross_entropy_alone(comm)
        _token_log_probs_alone(comm)
        _sequence_length_must_divide(comm)
        _biased_mlp(comm)
    return [_check_case(comm, *case) for case in cases] + [_check_gpt_case(comm, *case) for case in gpt_cases]


def gpt_config(**overrides) -> SimpleNamespace:
    base = dict(
        vocab_size=23,  # no multiple of 2 or 4: padded under TP
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        ffn_hidden_size=64,
        max_position_embeddings=16,
        norm_eps=1e-5,
        tie_word_embeddings=True,  # GPT-2's and NxDT's megatron_gpt_config's choice
        init_method_std=0.02,
        activations_checkpoint_granularity=None,
    )
    return SimpleNamespace(**{**base, **overrides})


def build_gpt(cfg: SimpleNamespace) -> GPTForCausalLM:
    torch.manual_seed(0)
    model = GPTForCausalLM(cfg)
    with torch.no_grad():  # LayerNorms start at 1 and biases at 0: perturb both so a wrong slice or sum cannot hide
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return model


def _check_gpt_case(comm, overrides: dict, sequence_parallel: bool, steps: int) -> dict:
    """Megatron GPT under TP (+SP) against the single-process model: loss, every gradient, the weights after AdamW
    steps. Tolerances as Llama's above: the same fp32 math summed in another order (row-parallel partial sums,
    the vocabulary's log-sum-exp in pieces), ~1e-7 relative per reduction, far inside rtol 1e-5. The steps are
    plain SGD: a weight then differs by lr × the gradients' difference (~1e-8 here). Adam would not do: it divides
    each gradient by its own magnitude, so a gradient that is zero up to rounding (GELU's flat tail, the key bias)
    becomes a ±lr step whose sign is the rounding's — measured 6e-6 apart after 5 steps at lr 1e-3."""
    cfg = gpt_config(**overrides)
    ref = build_gpt(cfg)
    model = apply_tensor_parallel(m := build_gpt(cfg), comm, sequence_parallel=sequence_parallel, plan=tensor_parallel_plan_of(m))
    tag = f"GPT tp{comm.size} sp={sequence_parallel} {overrides}"
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert isinstance(attn.q_proj, ColumnParallelLinear) and isinstance(attn.o_proj, RowParallelLinear), tag
    assert isinstance(mlp.fc_in, ColumnParallelLinear) and isinstance(mlp.fc_out, RowParallelLinear), tag
    assert attn.q_proj.bias.shape == (cfg.hidden_size // comm.size,) and attn.o_proj.bias.shape == (cfg.hidden_size,)
    assert model.tied == cfg.tie_word_embeddings, tag
    full = gather_full_state_dict(model, comm)
    assert full.keys() == ref.state_dict().keys()
    for name, value in ref.state_dict().items():
        assert torch.equal(full[name], value), (tag, name)  # trimmed back to the true vocabulary
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    losses = []
    for step in range(max(steps, 1)):
        ids, labels = batch(step, cfg.vocab_size)
        opt_ref.zero_grad()
        opt.zero_grad()
        ref_loss = ref.loss_fn(ref(ids), labels)
        ref_loss.backward()
        loss = model.loss_fn(model(ids), labels)
        loss.backward()
        assert (sync_replicated_grads(model, comm) > 0) == sequence_parallel, tag
        close(loss, ref_loss, f"{tag} loss step {step}")
        if step == 0:
            grads = gather_full_grads(model, comm)
            ref_grads = {n: p.grad for n, p in ref.named_parameters()}
            assert grads.keys() == ref_grads.keys(), (tag, sorted(grads), sorted(ref_grads))
            for name, g in ref_grads.items():
                close(grads[name], g, f"{tag} grad {name}", atol=1e-7)
        losses.append(loss.item())
        if steps:
            opt_ref.step()
            opt.step()
    if steps:
        full = gather_full_state_dict(model, comm)
        for name, p in ref.named_parameters():
            # the steps moved every weight but the key bias: softmax is blind to a shift every key shares, so its
            # gradient is exactly zero (the gradients themselves were compared at step 0, atol 1e-7)
            if not name.endswith("k_proj.bias"):
                assert not torch.equal(p.detach(), initial[name]), (tag, name)
        for name, value in ref.state_dict().items():
            close(full[name], value, f"{tag} parameter {name} after {steps} SGD steps")
        _check_padding_stays_zero(model, cfg, comm, tag)
    return {"case": tag, "losses": losses}


@pytest.mark.timeout(120)
def test_tp2_matches_single_process():
    cases = [
        ({}, False, 5),  # KV heads sharded (2 heads, 2 ranks)
        ({}, True, 5),  # + sequence parallelism
        ({"num_kv_heads": 1, "tie_word_embeddings": True}, True, 0),  # one KV head on both ranks; tied table
        ({"activations_checkpoint_granularity": "full"}, True, 0),  # recompute in backward: same collectives
        ({"vocab_size": 23}, False, 5),  # padded to 24: the last rank holds one padding row
        ({"vocab_size": 23, "tie_word_embeddings": True, "make_vocab_size_divisible_by": 8}, True, 0),  # 32: 9 rows
    ]
    gpt_cases = [({}, True, 5), ({"tie_word_embeddings": False}, False, 0)]  # Megatron GPT TP2+SP, TP2
    results = run_local(_world, 2, cases, True, gpt_cases, timeout_s=110)
    assert [r["losses"] for r in results[0]] == [r["losses"] for r in results[1]]  # every rank computes the same loss


@pytest.mark.timeout(120)
def test_tp4_replicated_kv_heads_match_single_process():
    # process start-up dominates (4 ranks on 2 cores); the cases themselves cost ~1 s
    cases = [
        ({"num_kv_heads": 2}, False, 0),
        ({"num_kv_heads": 2}, True, 5),
        ({"num_kv_heads": 2, "vocab_size": 23, "make_vocab_size_divisible_by": 8}, False, 0),  # 32: rank 3 all padding
    ]
    results = run_local(_world, 4, cases, False, [({}, True, 0)], timeout_s=110)
    assert len({tuple(r[0]["losses"]) for r in results}) == 1


# ---------------------------------------------------------------------------------------------- no processes
def fake_comm(size: int, rank: int = 0) -> SimpleNamespace:
    """Building shards needs only the group's size and rank: layout errors are checked without a world."""
    return SimpleNamespace(size=size, rank=rank)


def test_shards_tile_the_full_weights():
    cfg = config(num_kv_heads=1)
    ref = build(cfg)
    shards = [apply_tensor_parallel(m := build(cfg), fake_comm(2, r), plan=tensor_parallel_plan_of(m)) for r in range(2)]
    q = torch.cat([s.layers[1].self_attn.q_proj.weight for s in shards])
    o = torch.cat([s.layers[1].self_attn.o_proj.weight for s in shards], dim=1)
    emb = torch.cat([s.embed_tokens.weight for s in shards])
    assert torch.equal(q, ref.layers[1].self_attn.q_proj.weight)
    assert torch.equal(o, ref.layers[1].self_attn.o_proj.weight)
    assert torch.equal(emb, ref.embed_tokens.weight)
    for s in shards:  # the single KV head is held whole by both ranks
        assert torch.equal(s.layers[1].self_attn.v_proj.weight, ref.layers[1].self_attn.v_proj.weight)
        assert torch.equal(s.norm.weight, ref.norm.weight)


def test_any_vocabulary_splits_padded_and_gathers_trimmed():
    """A vocabulary no multiple of TP (a tokenizer with one added token) is padded as Megatron pads
    (_vocab_size_with_padding: up to a multiple of make_vocab_size_divisible_by × TP) with zero rows; the shards
    tile the padded table, and the checkpoint layout records the true length so full tensors are trimmed."""
    torch.manual_seed(0)
    table = nn.Embedding(23, 8)
    for tp, multiple, padded in ((3, 1, 24), (2, 1, 24), (4, 8, 32), (2, 128, 256)):
        shards = [VocabParallelEmbedding.from_full(table, fake_comm(tp, r), block=multiple) for r in range(tp)]
        emb = torch.cat([s.weight for s in shards])
        assert emb.shape == (padded, 8), (tp, multiple)
        assert torch.equal(emb[:23], table.weight) and not emb[23:].any(), (tp, multiple)
        spec = shards[0].shard_specs["weight"]
        assert spec.layout() == [0, 1, 23, padded] and spec.padded == padded
        assert torch.equal(spec.slice(table.weight, tp - 1), shards[-1].weight)  # what resharding cuts for a new TP
    cfg = config(vocab_size=23, make_vocab_size_divisible_by=128)
    model = apply_tensor_parallel(
        m := build(cfg), fake_comm(4, 3), plan=tensor_parallel_plan_of(m)
    )  # 128 × 4 = 512 rows, 128 per rank
    assert shard_layout(model)["lm_head.weight"] == [0, 1, 23, 512] and shard_layout(model)["layers.0.mlp.up_proj.weight"] == [
        0,
        1,
    ]
    assert model.lm_head.padding_columns == 128  # rank 3 holds rows 384..511: padding only
    logits = model.lm_head(torch.randn(2, cfg.hidden_size))
    assert logits.shape == (2, 128) and torch.isneginf(logits).all()


def test_gpt_declares_megatrons_tensor_parallel_plan():
    """GPT's plan (NxDT's megatron_gpt_config trains at TP8): attention and MLP column → row pairs with their
    biases, the learned positions replicated; the shards tile the full model."""
    cfg = SimpleNamespace(
        vocab_size=23, hidden_size=32, num_layers=1, num_attention_heads=4, ffn_hidden_size=64, max_position_embeddings=16
    )
    torch.manual_seed(0)
    ref = GPTForCausalLM(cfg)
    shards = []
    for r in range(2):
        torch.manual_seed(0)
        shards.append(apply_tensor_parallel(m := GPTForCausalLM(cfg), fake_comm(2, r), plan=tensor_parallel_plan_of(m)))
    layer = [s.layers[0] for s in shards]
    assert torch.equal(torch.cat([x.self_attn.q_proj.bias for x in layer]), ref.layers[0].self_attn.q_proj.bias)
    assert torch.equal(torch.cat([x.mlp.fc_out.weight for x in layer], 1), ref.layers[0].mlp.fc_out.weight)
    assert torch.equal(layer[1].mlp.fc_out.bias, ref.layers[0].mlp.fc_out.bias)  # replicated, added after the reduction
    assert torch.equal(shards[1].embed_positions.weight, ref.embed_positions.weight)
    assert shard_layout(shards[0]) == {
        "embed_tokens.weight": [0, 1, 23, 24],
        "layers.0.self_attn.q_proj.weight": [0, 1],
        "layers.0.self_attn.q_proj.bias": [0, 1],
        "layers.0.self_attn.k_proj.weight": [0, 1],
        "layers.0.self_attn.k_proj.bias": [0, 1],
        "layers.0.self_attn.v_proj.weight": [0, 1],
        "layers.0.self_attn.v_proj.bias": [0, 1],
        "layers.0.self_attn.o_proj.weight": [1, 1],
        "layers.0.mlp.fc_in.weight": [0, 1],
        "layers.0.mlp.fc_in.bias": [0, 1],
        "layers.0.mlp.fc_out.weight": [1, 1],
        "lm_head.weight": [0, 1, 23, 24],
    }


def test_layouts_that_cannot_be_split_fail_clearly():
    # 6 query heads split over 3 ranks, but 2 KV heads neither divide nor are divided by 3
    cfg = config(vocab_size=66, hidden_size=36, num_attention_heads=6, num_kv_heads=2, ffn_hidden_size=48)
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.k_proj \(colwise_kv:6\): 2 block\(s\) of 6.*multiple of"):
        apply_tensor_parallel(m := build(cfg), fake_comm(3), plan=tensor_parallel_plan_of(m))
    with pytest.raises(ValueError, match=r"q_proj \(colwise:8\): 4 block\(s\) of 8 along dim 0 cannot be split over 8"):
        apply_tensor_parallel(
            m := build(config(vocab_size=64, ffn_hidden_size=64)), fake_comm(8), plan=tensor_parallel_plan_of(m)
        )
    with pytest.raises(TypeError, match="not a member"):
        apply_tensor_parallel(m := build(config()), None, plan=tensor_parallel_plan_of(m))


class _Toy(nn.Module):
    def __init__(self, plan: dict[str, str]) -> None:
        super().__init__()
        self.up, self.down, self.plan = nn.Linear(4, 8), nn.Linear(8, 4), plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))

    def tensor_parallel_plan(self) -> dict[str, str]:
        return self.plan


def test_bad_plans_fail_clearly():
    with pytest.raises(TypeError, match="declares no tensor_parallel_plan"):
        apply_tensor_parallel(nn.Linear(4, 4), fake_comm(2))
    with pytest.raises(ValueError, match="style 'diagonal' unknown"):
        apply_tensor_parallel(_Toy({"up": "diagonal"}), fake_comm(2))
    with pytest.raises(ValueError, match=r"\['mlp\.\*'\] match no module"):
        apply_tensor_parallel(_Toy({"up": "colwise", "mlp.*": "rowwise"}), fake_comm(2))
    with pytest.raises(TypeError, match="style 'vocab_embedding' needs a torch.nn.Embedding"):
        apply_tensor_parallel(_Toy({"up": "vocab_embedding"}), fake_comm(2))
    with pytest.raises(ValueError, match="matches several entries"):
        apply_tensor_parallel(_Toy({"up": "colwise", "u*": "colwise"}), fake_comm(2))
    toy = apply_tensor_parallel(_Toy({"up": "colwise", "down": "rowwise"}), fake_comm(2, 1))
    assert toy.up.weight.shape == (4, 4) and toy.up.bias.shape == (4,) and toy.down.weight.shape == (4, 4)
    assert toy.down.bias.shape == (4,)  # row-parallel bias is replicated, added once after the reduction
    with pytest.raises(TypeError, match="already parallelised"):
        apply_tensor_parallel(toy, fake_comm(2, 1))
    with pytest.raises(ValueError, match="'input_region' block but holds no column-parallel layer"):
        apply_tensor_parallel(_Toy({"": "input_region", "down": "rowwise"}), fake_comm(2))
    region = apply_tensor_parallel(_Toy({"": "input_region", "up": "colwise", "down": "rowwise"}), fake_comm(2))
    assert region.up.input_in_region  # the block enters the region; its column layer does not enter again
    with pytest.raises(TypeError, match="its input must be its first positional argument"):
        region(x=torch.zeros(1, 4))
