"""FSDP with expert parallelism: DP4 = EP2 × EDP2 on 4 ranks. Each rank keeps half the experts of every MoE layer
(EP); its dense flats are sharded over DP4, its expert flats over the two replicas of the same experts (EDP2), whose
gradients are summed there and divided by DP (an expert's local gradient is already its EP group's sum).

Three clipped steps of momentum SGD with weight decay (a step wrongly taken on an expert moves it) on a Mixtral with
16 experts, top-1, 8 tokens a rank — so the router leaves experts without a token on some rank, and some without one
anywhere, which must stay untouched as one process's SGD skips them — equal one process on all four ranks' tokens:
dense weights, every expert (each EP rank's, gathered over its replicas), under token-threaded and no prefetch. The
experts' w2 are in a second param group (no decay) small enough to be kept whole on both replicas (a replicated expert
flat: summed over them, divided by DP once per step).

NxD Core's layout [DP = EP × EDP]: EP groups {0, 1}, {2, 3}; EDP groups {0, 2}, {1, 3}; DP = all four.
"""

from __future__ import annotations

import pytest
import torch
from test_moe_routing_dp import CFG, _model, _tokens, mismatches, train_with_runtime  # its sparse Mixtral (16, top-1)

from nxdt.comm.spawn import run_local
from nxdt.parallel.data_parallel import ModelParallel
from nxdt.parallel.expert_parallel import apply_expert_parallel

SEQ, STEPS, LR, MOMENTUM, DECAY, MAX_NORM = 8, 3, 0.5, 0.9, 0.1, 0.5
WORLD = 4


def _sgd(model: torch.nn.Module) -> torch.optim.SGD:
    named = list(model.named_parameters())
    return torch.optim.SGD(
        [
            {"params": [p for n, p in named if ".w2." not in n], "weight_decay": DECAY},
            {"params": [p for n, p in named if ".w2." in n], "weight_decay": 0.0},
        ],
        lr=LR,
        momentum=MOMENTUM,
    )


def _reference() -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """One process on every rank's tokens (the mean over ranks), clipped; how many experts got no token, per step."""
    ref = _model()
    opt = _sgd(ref)
    untouched = []
    for step in range(STEPS):
        opt.zero_grad()
        for r in range(WORLD):
            ids, labels = _tokens(r, step)
            (ref.loss_fn(ref(ids), labels) / WORLD).backward()
        untouched.append(sum(1 for n, p in ref.named_parameters() if ".experts." in n and p.grad is None))
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        opt.step()
    return {k: v.clone() for k, v in ref.state_dict().items()}, {"untouched": untouched}


def _train(world, dp, ep, edp, policy: str) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """NxDStrategy's FSDP runtime (``train_with_runtime``: the experts a step left untouched noted in finish_gradients
    and put back after it, the clip over the whole model): the state, and the kinds of expert flats it built."""
    model = apply_expert_parallel(_model(), ep)
    options = {"fsdp": {"prefetch": policy, "param_persistence_threshold": 4096}}
    mp = ModelParallel(dp=dp, dp_size=dp.size, ep=ep, edp=edp)
    state, rt = train_with_runtime(model, world.rank, options, mp, _sgd, STEPS, MAX_NORM)
    flats = rt.fsdp.flats()
    kinds = {
        "expert_sharded": sum(1 for f in flats if f.expert and not f.replicated),
        "expert_replicated": sum(1 for f in flats if f.expert and f.replicated),
    }
    return state, kinds


def _worker(world) -> dict:
    rank = world.rank
    dp = world.new_communicator(list(range(WORLD)), "dp")
    ep = [world.new_communicator([0, 1], "ep0"), world.new_communicator([2, 3], "ep1")][rank // 2]
    edp = [world.new_communicator([0, 2], "edp0"), world.new_communicator([1, 3], "edp1")][rank % 2]
    want, facts = _reference() if rank == 0 else (None, None)
    want, facts = world.world.all_gather_object((want, facts))[0]
    report = {"facts": facts}
    for policy in ("token_threaded", "none"):
        state, kinds = _train(world, dp, ep, edp, policy)
        experts = {n for n in state if ".experts." in n}
        report[policy] = {
            "kinds": kinds,
            "experts_held": len(experts),
            "missing": sorted(set(want) - set(state) - {"rope_cos", "rope_sin"} - {n for n in want if ".experts." in n}),
            # 1e-5: only the order of fp32 additions differs (local experts' sums, then over replicas and DP)
            "mismatch": mismatches(state, want, atol=1e-5),
        }
    return report


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_local(_worker, WORLD, timeout_s=180)


@pytest.mark.timeout(240)
def test_some_experts_get_no_token_in_a_step(reports):
    assert sum(reports[0]["facts"]["untouched"]) > 0, reports[0]["facts"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("policy", ["token_threaded", "none"])
def test_ep2_x_fsdp_equals_one_process(reports, policy):
    for rank, report in enumerate(reports):
        got = report[policy]
        assert got["mismatch"] == [] and got["missing"] == [], (rank, got["mismatch"], got["missing"])
        # half the experts of each of the 2 layers, 3 tensors each; expert flats of both kinds in play
        assert got["experts_held"] == 2 * (CFG.moe.num_experts // 2) * 3, (rank, got["experts_held"])
        assert got["kinds"]["expert_sharded"] == 2 and got["kinds"]["expert_replicated"] == 2, (rank, got["kinds"])
