"""nxdt.parallel.expert_parallel: Mixtral with experts split over EP = 2 ranks, each rank with its own tokens,
equals the single-process model applied to each rank's tokens — logits, losses (with the aux loss), dense
gradients, expert gradients (owner holds the sum over the ranks' per-batch gradients), the documented
reduction (dense avg + ``reduce_expert_gradients``) = the gradient of the mean loss, and 5 AdamW steps;
full activation checkpointing (bit-identical gradients); the raw dispatcher with crafted uneven splits (a
rank sending nothing to a peer, an expert with no rows). On 4 ranks (EP 2 × expert-DP 2) the reduction
with an expert-data-parallel group gives the gradient of the 4-rank mean loss. Bad input: one clear message.

Every rank runs the single-process reference itself (same seed), so one spawned world checks everything.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

from nxdt.comm.spawn import run_local
from nxdt.models.mixtral import MixtralForCausalLM, SparseMoeBlock, local_dispatch
from nxdt.parallel.expert_parallel import (
    apply_expert_parallel,
    is_expert_parameter,
    reduce_expert_gradients,
    split_expert_parameters,
)
from nxdt.config.hf_model import tensor_parallel_plan_of

MOE = types.SimpleNamespace(num_experts=4, top_k=2, router_aux_loss_coef=0.05)
CFG = types.SimpleNamespace(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=48,
    max_position_embeddings=64,
    rope_theta=10000.0,
    norm_eps=1e-5,
    tie_word_embeddings=False,
    init_method_std=0.02,
    activations_checkpoint_granularity=None,
    moe=MOE,
)
EP, BATCH, SEQ, STEPS, LR = 2, 2, 8, 5, 3e-3
SGD_LR = 0.5  # EP×TP parity: large enough that 5 steps move weights by ~1e-3 (see _ep_tp_worker)


def _model() -> MixtralForCausalLM:
    torch.manual_seed(0)
    return MixtralForCausalLM(CFG)


def _tokens(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s own micro-batch at ``step`` (different on every rank: EP subdivides DP)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    return bool(torch.allclose(a, b, rtol=rtol, atol=atol))


def _ep_worker(world) -> dict:
    rank = world.rank
    ep = world.new_communicator(list(range(world.world_size)), "ep")
    report: dict = {}

    # ---- single-process reference: the full model on each rank's tokens, one backward per rank's batch
    reference = _model()
    ref_logits, ref_loss, ref_grads = [], [], []
    for r in range(EP):
        reference.zero_grad(set_to_none=True)
        ids, labels = _tokens(r, 0)
        logits = reference(ids)
        loss = reference.loss_fn(logits, labels)
        loss.backward()
        ref_logits.append(logits.detach())
        ref_loss.append(loss.item())
        ref_grads.append(_grads(reference))

    # ---- expert parallel: experts sliced from the same-seed full model
    model = apply_expert_parallel(_model(), ep)
    names = dict(model.named_parameters())
    report["experts"] = [b.expert_ids for b in model.modules() if isinstance(b, SparseMoeBlock)]
    report["expert_names_kept"] = all(n in dict(reference.named_parameters()) for n in names)
    report["flagged"] = sorted(n for n, p in names.items() if is_expert_parameter(p)) == sorted(
        n for n in names if ".experts." in n
    )
    ids, labels = _tokens(rank, 0)
    logits = model(ids)
    loss = model.loss_fn(logits, labels)
    loss.backward()
    report["logits_diff"] = _maxdiff(logits.detach(), ref_logits[rank])
    report["loss"], report["ref_loss"] = loss.item(), ref_loss[rank]
    grads = _grads(model)
    bad = []
    for n, g in grads.items():
        want = sum(rg[n] for rg in ref_grads) if ".experts." in n else ref_grads[rank][n]
        if not _close(g, want, 1e-5, 1e-7):
            bad.append((n, _maxdiff(g, want)))
    report["local_grad_mismatch"] = bad

    # full activation checkpointing re-runs the exchanges during backward, in the same order on every rank
    ckpt = apply_expert_parallel(_model(), ep)
    ckpt.checkpoint_layers = True
    ckpt.loss_fn(ckpt(ids), labels).backward()
    report["checkpointed_grad_diff"] = max(_maxdiff(g, grads[n]) for n, g in _grads(ckpt).items())

    # ---- the documented reduction: dense avg over DP (= the EP group here) + expert sum/DP → grad of mean loss
    dense, experts = split_expert_parameters(model)
    for p in dense:
        ep.all_reduce(p.grad, "avg")
    reduce_expert_gradients(model, data_parallel_size=EP)
    bad = []
    for n, p in model.named_parameters():
        want = sum(rg[n] for rg in ref_grads) / EP
        if not _close(p.grad, want, 1e-5, 1e-7):
            bad.append((n, _maxdiff(p.grad, want)))
    report["reduced_grad_mismatch"] = bad

    # ---- 5 AdamW steps: EP (each rank its tokens) vs one process on the mean of the ranks' losses
    model, reference = apply_expert_parallel(_model(), ep), _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    losses, ref_losses = [], []
    for step in range(1, STEPS + 1):
        opt.zero_grad(set_to_none=True)
        ids, labels = _tokens(rank, step)
        loss = model.loss_fn(model(ids), labels)
        loss.backward()
        dense, _ = split_expert_parameters(model)
        for p in dense:
            ep.all_reduce(p.grad, "avg")
        reduce_expert_gradients(model, data_parallel_size=EP)
        opt.step()
        mean = loss.detach().clone()
        ep.all_reduce(mean, "avg")
        losses.append(float(mean))

        ref_opt.zero_grad(set_to_none=True)
        total = 0.0
        for r in range(EP):
            ids_r, labels_r = _tokens(r, step)
            ref_loss_r = reference.loss_fn(reference(ids_r), labels_r) / EP
            ref_loss_r.backward()
            total += ref_loss_r.item()
        ref_opt.step()
        ref_losses.append(total)
    ref_params = dict(reference.named_parameters())
    report["train_losses"], report["ref_train_losses"] = losses, ref_losses
    report["train_param_mismatch"] = [
        (n, _maxdiff(p.detach(), ref_params[n].detach()))
        for n, p in model.named_parameters()
        # atol 1e-5 ≪ one AdamW step (lr 3e-3): Adam's normalisation turns the
        # rounding of near-zero expert gradients into ~1e-5 weight differences
        if not _close(p.detach(), ref_params[n].detach(), 1e-4, 1e-5)
    ]

    # ---- the raw dispatcher, crafted uneven splits: rank 0 sends nothing to rank 1, expert 2 gets no rows
    torch.manual_seed(1)
    full_block = SparseMoeBlock(CFG)
    holder = torch.nn.Module()
    holder.block = copy.deepcopy(full_block)
    apply_expert_parallel(holder, ep)
    counts = torch.tensor([3, 1, 0, 0]) if rank == 0 else torch.tensor([0, 2, 0, 3])
    g = torch.Generator().manual_seed(50 + rank)
    rows = torch.randn(int(counts.sum()), CFG.hidden_size, generator=g)
    upstream = torch.randn(rows.shape, generator=g)
    rows_ep, rows_ref = rows.clone().requires_grad_(), rows.clone().requires_grad_()
    out_ep = holder.block.dispatcher(holder.block, rows_ep, counts)
    (out_ep * upstream).sum().backward()
    out_ref = local_dispatch(full_block, rows_ref, counts)
    (out_ref * upstream).sum().backward()
    report["dispatch_out_diff"] = _maxdiff(out_ep.detach(), out_ref.detach())
    report["dispatch_row_grad_diff"] = _maxdiff(rows_ep.grad, rows_ref.grad)
    # owner's expert grads = sum over both ranks' reference grads: gather the reference grads of every rank
    ref_expert = torch.cat(
        [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in full_block.experts.parameters()]
    )
    ep.all_reduce(ref_expert, "sum")
    offsets, off = {}, 0
    for n, p in full_block.experts.named_parameters():
        offsets[n] = (off, p.numel())
        off += p.numel()
    diffs = []
    for n, p in holder.block.experts.named_parameters():
        o, k = offsets[n]
        got = p.grad.reshape(-1) if p.grad is not None else torch.zeros(k)
        diffs.append(_maxdiff(got, ref_expert[o : o + k]))
    report["dispatch_expert_grad_diff"] = max(diffs)
    return report


@pytest.mark.timeout(120)
def test_expert_parallel_matches_single_process():
    reports = run_local(_ep_worker, EP, timeout_s=110)
    for rank, rep in enumerate(reports):
        assert rep["experts"] == [[2 * rank, 2 * rank + 1]] * CFG.num_layers, rep["experts"]
        assert rep["expert_names_kept"] and rep["flagged"]
        assert rep["logits_diff"] < 1e-5, rep["logits_diff"]
        assert rep["loss"] == pytest.approx(rep["ref_loss"], rel=1e-5)
        assert not rep["local_grad_mismatch"], rep["local_grad_mismatch"]
        assert rep["checkpointed_grad_diff"] == 0.0, rep["checkpointed_grad_diff"]
        assert not rep["reduced_grad_mismatch"], rep["reduced_grad_mismatch"]
        assert rep["train_losses"] == pytest.approx(rep["ref_train_losses"], rel=1e-4)
        assert not rep["train_param_mismatch"], rep["train_param_mismatch"]
        assert rep["dispatch_out_diff"] < 1e-6 and rep["dispatch_row_grad_diff"] < 1e-6
        assert rep["dispatch_expert_grad_diff"] < 1e-6
    assert reports[0]["loss"] != reports[1]["loss"]  # the ranks really had different tokens
    assert reports[0]["train_losses"] == pytest.approx(reports[1]["train_losses"], rel=1e-6)


def _ep_dp_worker(world) -> dict:
    """DP = 4 = EP 2 × expert-DP 2: EP groups {0,1}, {2,3}; expert-DP groups {0,2}, {1,3}."""
    from nxdt.parallel.zero1 import Zero1Optimizer, consolidate_shard_states

    rank, size = world.rank, world.world_size
    dp = world.new_communicator(list(range(size)), "dp")
    eps = [world.new_communicator([0, 1], "ep0"), world.new_communicator([2, 3], "ep1")]
    edps = [world.new_communicator([0, 2], "edp0"), world.new_communicator([1, 3], "edp1")]
    ep, edp = eps[rank // 2], edps[rank % 2]
    report: dict = {}
    reference = _model()
    for r in range(size):  # gradient of the mean of the four ranks' losses
        ids_r, labels_r = _tokens(r, 7)
        (reference.loss_fn(reference(ids_r), labels_r) / size).backward()
    model = apply_expert_parallel(_model(), ep)
    ids, labels = _tokens(rank, 7)
    model.loss_fn(model(ids), labels).backward()
    dense, _ = split_expert_parameters(model)
    for p in dense:
        dp.all_reduce(p.grad, "avg")
    reduce_expert_gradients(model, data_parallel_size=dp.size, expert_dp_comm=edp)
    want = dict(reference.named_parameters())
    report["reduced"] = [
        (n, _maxdiff(p.grad, want[n].grad)) for n, p in model.named_parameters() if not _close(p.grad, want[n].grad, 1e-5, 1e-7)
    ]

    # ---- ZeRO-1 over DP 4: dense state in 4 shards, each rank's experts in 2 (over expert-DP); 3 clipped SGD steps
    # (SGD: see _ep_tp_worker; momentum: a state to consolidate) with decay / no-decay groups = one process on the
    # mean of the four ranks' losses
    def groups(m: torch.nn.Module) -> list[dict]:
        named = list(m.named_parameters())
        return [
            {"params": [p for _, p in named if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.dim() <= 1], "weight_decay": 0.0},
        ]

    model, reference = apply_expert_parallel(_model(), ep), _model()
    opt = Zero1Optimizer(
        groups(model), torch.optim.SGD, dp, model=model, expert_parallel_size=2, expert_dp_comm=edp, lr=SGD_LR, momentum=0.5
    )
    ref_opt = torch.optim.SGD(groups(reference), lr=SGD_LR, momentum=0.5)
    norms, ref_norms = [], []
    for step in range(1, 4):
        opt.zero_grad()
        ids, labels = _tokens(rank, step)
        model.loss_fn(model(ids), labels).backward()
        norms.append(float(opt.clip_grad_norm_(0.05)))  # below the gradients' norm: every step is clipped
        opt.step()
        if step == 2:
            state_after_two = copy.deepcopy(opt.state_dict())
            weights_after_two = {n: p.detach().clone() for n, p in model.named_parameters()}
        ref_opt.zero_grad()
        for r in range(size):
            ids_r, labels_r = _tokens(r, step)
            (reference.loss_fn(reference(ids_r), labels_r) / size).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)))
        ref_opt.step()
    # a resume: the shards saved after step 2 and loaded into a new optimizer of a model at step 2's weights take
    # step 3 to the same bits as the uninterrupted one
    twin = apply_expert_parallel(_model(), ep)
    twin.load_state_dict(weights_after_two)
    twin_opt = Zero1Optimizer(
        groups(twin), torch.optim.SGD, dp, model=twin, expert_parallel_size=2, expert_dp_comm=edp, lr=SGD_LR, momentum=0.5
    )
    twin_opt.load_state_dict(state_after_two)
    ids, labels = _tokens(rank, 3)
    twin.loss_fn(twin(ids), labels).backward()
    twin_opt.clip_grad_norm_(0.05)
    twin_opt.step()
    report["resumed_equal"] = all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in twin.named_parameters())
    want = dict(reference.named_parameters())
    report["zero1_norms"], report["ref_norms"] = norms, ref_norms
    report["zero1_mismatch"] = [
        (n, _maxdiff(p.detach(), want[n].detach()))
        for n, p in model.named_parameters()
        if not _close(p.detach(), want[n].detach(), 1e-5, 2e-6)
    ]
    report["zero1_moved"] = max(_maxdiff(p.detach(), _model().state_dict()[n]) for n, p in model.named_parameters())
    report["expert_shard"] = [(b.size, b.shard.numel() * 2 == b.flat.numel()) for b in opt._buckets if b.experts]
    # the saved shards joined as a checkpoint reader does: dense from every DP rank, experts from this EP rank's replicas
    shards = dp.all_gather_object(opt.state_dict())
    joined_state = consolidate_shard_states(shards, experts=shards[rank % 2 :: 2])
    joined = joined_state["state"]
    # and cut again (what a reshard onto this layout does: each rank's part of its optimizer's full state): the shards
    twin = apply_expert_parallel(_model(), ep)
    twin.load_state_dict({n: p.detach() for n, p in model.named_parameters()})
    again = Zero1Optimizer(
        groups(twin), torch.optim.SGD, dp, model=twin, expert_parallel_size=2, expert_dp_comm=edp, lr=SGD_LR, momentum=0.5
    )
    again.load_state_dict(joined_state)
    mine, cut = opt.state_dict()["inner"]["state"], again.state_dict()["inner"]["state"]
    report["recut_equal"] = sorted(mine) == sorted(cut) and all(
        torch.equal(mine[b]["momentum_buffer"], cut[b]["momentum_buffer"]) for b in mine
    )
    order = [n for n, p in model.named_parameters() if p.dim() > 1] + [n for n, p in model.named_parameters() if p.dim() <= 1]
    ref_order = [n for n, p in reference.named_parameters() if p.dim() > 1] + [
        n for n, p in reference.named_parameters() if p.dim() <= 1
    ]
    ref_state = ref_opt.state_dict()["state"]
    report["momentum_mismatch"] = [
        n
        for i, n in enumerate(order)
        if not _close(joined[i]["momentum_buffer"], ref_state[ref_order.index(n)]["momentum_buffer"], 1e-5, 1e-7)
    ]
    refused = []  # no one rank holds every expert's state
    for consolidate in (opt.consolidated_state_dict, lambda: consolidate_shard_states(shards)):
        try:
            consolidate()
        except ValueError as exc:
            refused.append(str(exc))
    report["consolidation_refused"] = refused

    # ---- an expert some replicas route nothing to, and one no rank routes anything to (AdamW, weight decay):
    # the first steps with Σ of the replicas' gradients / DP, the second stays put, as one process skips it
    def holder() -> torch.nn.Module:
        m = torch.nn.Module()
        m.dense, m.used, m.unused = (torch.nn.Parameter(torch.full((n,), 1.0 + k)) for k, n in enumerate((3, 5, 2)))
        m.used.expert_parallel = m.unused.expert_parallel = True
        return m

    def local_grads(m: torch.nn.Module) -> None:
        m.dense.grad = torch.full((3,), rank + 1.0)
        m.used.grad = None if rank == 3 else torch.full((5,), rank + 1.0)
        m.unused.grad = None

    wanted = {"dense": torch.full((3,), 2.5), "used": torch.full((5,), (1.0 + 3.0) / 4 if rank % 2 == 0 else 2.0 / 4)}
    ref = holder()
    for n, g in wanted.items():
        getattr(ref, n).grad = g.clone()
    torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1).step()
    m = holder()
    z = Zero1Optimizer(
        list(m.parameters()), torch.optim.AdamW, dp, expert_parallel_size=2, expert_dp_comm=edp, lr=0.1, weight_decay=0.1
    )
    local_grads(m)
    z.step()
    report["unused_expert"] = [(n, _maxdiff(p.detach(), getattr(ref, n).detach())) for n, p in m.named_parameters()]
    full = holder()  # full_gradients: every .grad the reduced one, the unused expert's None
    z = Zero1Optimizer(list(full.parameters()), torch.optim.AdamW, dp, expert_parallel_size=2, expert_dp_comm=edp, lr=0.1)
    z.full_gradients = True
    local_grads(full)
    z.reduce_gradients()
    report["full_gradients"] = [
        _maxdiff(full.dense.grad, wanted["dense"]),
        _maxdiff(full.used.grad, wanted["used"]),
        full.unused.grad,
    ]
    plain = holder()  # the replicated path's reduction: the same
    local_grads(plain)
    reduce_expert_gradients(plain, data_parallel_size=4, expert_dp_comm=edp)
    report["replicated"] = [_maxdiff(plain.used.grad, wanted["used"]), plain.unused.grad]
    return report


@pytest.mark.timeout(120)
def test_expert_data_parallel_replicas_reduce_and_shard_zero1_as_one_process():
    for rank, report in enumerate(run_local(_ep_dp_worker, 4, timeout_s=110)):
        assert report["reduced"] == [], rank
        assert report["zero1_norms"] == pytest.approx(report["ref_norms"], rel=1e-5), rank
        assert not report["zero1_mismatch"], (rank, report["zero1_mismatch"])
        assert report["zero1_moved"] > 1e-3, rank  # the steps moved weights far beyond the tolerance
        assert report["expert_shard"] == [(2, True)], rank  # one expert bucket (decay group), in 2 shards (expert-DP)
        assert report["momentum_mismatch"] == [], rank
        assert report["resumed_equal"] and report["recut_equal"], rank
        assert len(report["consolidation_refused"]) == 2 and all(
            "per rank" in m or "pass experts=" in m for m in report["consolidation_refused"]
        ), report["consolidation_refused"]
        assert dict(report["unused_expert"]) == pytest.approx({"dense": 0.0, "used": 0.0, "unused": 0.0}, abs=1e-7), rank
        assert report["full_gradients"] == [0.0, 0.0, None], rank
        assert report["replicated"] == [0.0, None], rank


def test_expert_parallel_bad_input():
    fake = types.SimpleNamespace(size=3, rank=0)
    with pytest.raises(ValueError, match="num_experts=4 is not divisible by expert_model_parallel_size=3"):
        apply_expert_parallel(_model(), fake)
    with pytest.raises(ValueError, match="no MoE block"):
        apply_expert_parallel(torch.nn.Linear(2, 2), types.SimpleNamespace(size=2, rank=0))
    model = apply_expert_parallel(_model(), types.SimpleNamespace(size=2, rank=1))  # slicing needs no communication
    assert [b.expert_ids for b in model.moe_blocks()] == [[2, 3]] * CFG.num_layers
    with pytest.raises(ValueError, match="apply it once"):
        apply_expert_parallel(model, types.SimpleNamespace(size=2, rank=1))
    assert apply_expert_parallel(_model(), None).moe_blocks()[0].expert_ids == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="data_parallel_size"):
        reduce_expert_gradients(model, 0)
    # the full model's parameter count does not change when it holds a slice of the experts
    assert model.num_parameters() == _model().num_parameters()


def _ep_tp_worker(world) -> dict:
    """EP 2 × TP 2 on 4 ranks (TP fastest): TP groups {0,1}, {2,3}; EP = data-parallel groups {0,2}, {1,3}.
    Experts are sliced over EP, then each expert's w1/w3 column- and w2 row-parallel over TP; a TP pair shares
    its tokens, the two pairs have their own. 5 SGD steps (reduced as NxDStrategy does) = one process on the
    mean of both pairs' losses; with and without sequence parallelism.

    SGD, not AdamW: TP sums each matmul's partial products in another order, so gradients differ from the
    reference by rounding (~1e-7 relative; how much depends on the CPU's kernels — AMD and Intel differ).
    Adam divides by sqrt(v): for a gradient element that is itself near zero, that rounding can flip the
    sign of a full lr-sized step, so no tolerance below the lr holds on every host. SGD moves each weight by
    lr·g, so after 5 steps the rounding part is ≤ 5·lr·1e-6·|g| ≈ 1e-7 here, while a reduction error (a
    missing average, a gradient left on one rank) moves weights by ~lr·|g| ≈ 1e-3: atol 2e-6 separates them."""
    from nxdt.parallel.tensor_parallel import apply_tensor_parallel, gather_full_state_dict, sync_replicated_grads

    rank = world.rank
    tp = [world.new_communicator([0, 1], "tp0"), world.new_communicator([2, 3], "tp1")][rank // 2]
    ep = [world.new_communicator([0, 2], "ep0"), world.new_communicator([1, 3], "ep1")][rank % 2]
    dp_rank, dp = rank // 2, 2
    report = {}
    for sequence_parallel in (False, True):
        model = apply_expert_parallel(
            apply_tensor_parallel(m := _model(), tp, sequence_parallel=sequence_parallel, plan=tensor_parallel_plan_of(m)), ep
        )
        reference = _model()
        opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=SGD_LR)
        losses, ref_losses = [], []
        for step in range(1, STEPS + 1):
            opt.zero_grad(set_to_none=True)
            ids, labels = _tokens(dp_rank, step)
            loss = model.loss_fn(model(ids), labels)
            loss.backward()
            sync_replicated_grads(model, tp)
            dense, _ = split_expert_parameters(model)
            for p in dense:
                ep.all_reduce(p.grad, "avg")  # the EP group is the whole data-parallel group here
            reduce_expert_gradients(model, data_parallel_size=dp)
            opt.step()
            mean = loss.detach().clone()
            ep.all_reduce(mean, "avg")
            losses.append(float(mean))

            ref_opt.zero_grad(set_to_none=True)
            total = 0.0
            for r in range(dp):
                ids_r, labels_r = _tokens(r, step)
                ref_loss = reference.loss_fn(reference(ids_r), labels_r) / dp
                ref_loss.backward()
                total += ref_loss.item()
            ref_opt.step()
            ref_losses.append(total)
        # the load-balancing loss over real tokens (DPO's, GRPO's): under SP each rank routes its sequence shard and the
        # rows are gathered with their mask, in the order the logits are
        ids, _ = _tokens(dp_rank, 9)
        segments = torch.ones_like(ids)
        segments[0, -2:], segments[-1, :3] = 0, 0  # a right-padded row, a left-padded one
        with torch.no_grad():
            model(ids, segment_ids=segments)
            reference(ids, segment_ids=segments)
        masked = (float(model.aux_loss(padding_masked=True)), float(reference.aux_loss(padding_masked=True)))
        full, want = gather_full_state_dict(model, tp), reference.state_dict()
        report[sequence_parallel] = {
            "masked_aux": masked,
            "experts": [b.expert_ids for b in model.moe_blocks()],
            "losses": losses,
            "ref_losses": ref_losses,
            # atol 2e-6: the rounding of 5 SGD steps is ~1e-7, a reduction error ~1e-3 (see the docstring)
            "param_mismatch": [(n, _maxdiff(t, want[n])) for n, t in full.items() if not _close(t, want[n], 1e-5, 2e-6)],
            "moved": max(_maxdiff(t, _model().state_dict()[n]) for n, t in full.items()),
        }
    return report


@pytest.mark.timeout(120)
def test_expert_parallel_with_tensor_parallel_matches_single_process():
    for rank, report in enumerate(run_local(_ep_tp_worker, 4, timeout_s=110)):
        for sequence_parallel, rep in report.items():
            where = f"rank {rank}, EP2×TP2, sequence_parallel={sequence_parallel}"
            assert rep["experts"] == [[2 * (rank // 2), 2 * (rank // 2) + 1]] * CFG.num_layers, where  # EP rank = pair
            assert rep["losses"] == pytest.approx(rep["ref_losses"], rel=1e-4), where
            assert not rep["param_mismatch"], (where, rep["param_mismatch"])
            assert rep["moved"] > 1e-3, (where, rep["moved"])  # the steps moved weights far beyond the tolerance
            assert rep["masked_aux"][0] == pytest.approx(rep["masked_aux"][1], rel=1e-5), where


def test_a_rank_that_receives_no_rows_returns_the_experts_dtype_under_autocast():
    """Under expert parallelism a rank whose experts receive no rows still sends its (empty) outputs back; under bf16
    autocast they must be bf16 like a peer's non-empty ones, or the all-to-all's dtype check stops the run (seen with
    NxDT's hf_mixtral_8x7b_ep_config shrunk: rank 0 bf16, rank 1 float32)."""
    block = SparseMoeBlock(CFG)
    ids = block.expert_ids
    rows = torch.randn(3, CFG.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        some = block.run_experts(rows, [3] + [0] * (len(ids) - 1), ids)
        none = block.run_experts(rows[:0], [0] * len(ids), ids)
    assert some.dtype == none.dtype == torch.bfloat16
    assert none.shape == (0, CFG.hidden_size)
