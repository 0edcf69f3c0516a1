"""A mixture-of-experts model on plain data parallelism (no expert parallelism): the router leaves some experts without
a token on one rank, and some without a token anywhere in the batch. Every data-parallel runtime — replicated, ZeRO-1,
FSDP — trains it as one process does (no "unused parameters" refusal: routing, not the user, decides who gets a
gradient): a missing expert gradient counts as zero in the average, and an expert no rank routed a token to is left
untouched (torch's SGD skips a parameter whose gradient is None; the sharded runtimes restore its slice of the flat and
of the momentum). Dense parameters without a gradient are still refused by name.

Two ranks, one sequence each of 8 tokens, 16 experts, top-1: 16 routed rows for 16 experts. Then the same on
expert parallelism with a router whose every score ties, so one EP rank's experts receive no row at all and one of them
runs on the empty rows (what the all-to-all's backward needs): a zero gradient that is no token, left untouched too
(the runtimes read the blocks' routing counts, not gradient presence).
"""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch

from nxdt.comm.spawn import run_local
from nxdt.models.mixtral import MixtralForCausalLM
from nxdt.parallel.data_parallel import ModelParallel, data_parallel_runtime
from hf_reference import TINY_LLAMA

CFG = types.SimpleNamespace(  # the parity tests' tiny Llama, narrower, with 16 single-choice experts
    **{**TINY_LLAMA, "hidden_size": 16, "num_attention_heads": 2, "ffn_hidden_size": 16, "max_position_embeddings": 32},
    moe=types.SimpleNamespace(num_experts=16, top_k=1, router_aux_loss_coef=0.0),
)
KINDS = {"replicated": {}, "zero1": {"zero1": True}, "fsdp": {"fsdp": {"param_persistence_threshold": 0}}}
SEQ, STEPS, LR, MOMENTUM, DECAY = 8, 3, 0.5, 0.9, 0.1


def _model() -> MixtralForCausalLM:
    torch.manual_seed(0)
    return MixtralForCausalLM(CFG)


def _tokens(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, CFG.vocab_size, (1, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _sgd(model: torch.nn.Module) -> torch.optim.SGD:
    # momentum and decay: a step taken on an expert that should have been skipped moves it (a step counter, as
    # AdamW's, is per flat under ZeRO-1/FSDP: docs/lightning-conformance.md names that difference)
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=DECAY)


def train_with_runtime(
    model: torch.nn.Module, rank: int, options: dict, mp: ModelParallel, optimizer: Any, steps: int, max_norm: float | None = None
) -> tuple[dict[str, torch.Tensor], Any]:
    """``model`` trained ``steps`` steps on this rank's tokens through the data-parallel runtime of ``options``, as
    NxDStrategy drives it (finish_gradients, clip, step, after_step): its full state by the model's own names, and the
    runtime."""
    module = torch.nn.Module()  # as NxDStrategy holds it: a module whose ``model`` is the hub model
    module.model = model
    rt = data_parallel_runtime(**options)
    rt.bind(mp)
    opt = rt.shard_optimizer(optimizer(model), module)
    rt.shard_model(module, [opt])
    for step in range(steps):
        ids, labels = _tokens(rank, step)
        model.loss_fn(model(ids), labels).backward()
        rt.finish_gradients(module)
        if max_norm is not None:
            rt.clip_grad_norm_(module, max_norm)
        opt.step()
        rt.after_step(opt)
        opt.zero_grad()
    return {k.removeprefix("model."): v for k, v in rt.model_state_dict(module).items()}, rt


def mismatches(state: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 1e-6) -> list[str]:
    """The tensors of ``state`` that differ from one process's (``want``) beyond fp32 reordering."""
    return sorted(n for n, v in state.items() if n in want and not torch.allclose(v, want[n], rtol=1e-5, atol=atol))


def _experts(model: torch.nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if ".experts." in n]


def _worker(world) -> dict:
    rank, size = world.rank, world.world_size
    report: dict = {}
    # one process on both ranks' tokens: which experts get a gradient on this rank, anywhere, and the weights
    ref = _model()
    ref_opt = _sgd(ref)
    routing = {"mine": [], "anywhere": []}
    for step in range(STEPS):
        ref_opt.zero_grad()
        probe = copy.deepcopy(ref)  # this rank's tokens alone
        probe.loss_fn(probe(_tokens(rank, step)[0]), _tokens(rank, step)[1]).backward()
        routing["mine"].append({n for n, p in probe.named_parameters() if p.grad is not None})
        for r in range(size):
            ids, labels = _tokens(r, step)
            (ref.loss_fn(ref(ids), labels) / size).backward()
        routing["anywhere"].append({n for n, p in ref.named_parameters() if p.grad is not None})
        ref_opt.step()
    experts = set(_experts(ref))
    report["partly"] = [len(experts & (anywhere - mine)) for mine, anywhere in zip(routing["mine"], routing["anywhere"])]
    report["nowhere"] = [len(experts - anywhere) for anywhere in routing["anywhere"]]
    want = {k: v.clone() for k, v in ref.state_dict().items()}
    for kind, options in KINDS.items():
        state, _ = train_with_runtime(_model(), rank, options, ModelParallel(dp=world.world, dp_size=size), _sgd, STEPS)
        report[kind] = mismatches(state, want)
    # a dense parameter without gradient (the last layer's MLP-free path: its norm unused here) is still refused
    model = _model()
    rt = data_parallel_runtime()
    rt.bind(ModelParallel(dp=world.world, dp_size=size))
    opt = rt.shard_optimizer(_sgd(model), model)
    rt.shard_model(model, [opt])
    ids, labels = _tokens(rank, 0)
    model.loss_fn(model(ids), labels).backward()
    model.norm.weight.grad = None
    try:
        rt.finish_gradients(model)
        report["dense_unused"] = "no error"
    except ValueError as exc:
        report["dense_unused"] = str(exc)
    return report


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_local(_worker, 2, timeout_s=120)


@pytest.mark.timeout(180)
def test_the_router_left_experts_without_tokens_on_one_rank_and_everywhere(reports):
    for rank, report in enumerate(reports):  # the scenario the next test needs, on both ranks
        assert sum(report["partly"]) > 0 and sum(report["nowhere"]) > 0, (rank, report["partly"], report["nowhere"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_runtime_trains_routed_experts_as_one_process(reports, kind):
    for rank, report in enumerate(reports):
        assert report[kind] == [], (rank, kind)


@pytest.mark.timeout(180)
def test_a_dense_parameter_without_gradient_is_still_refused_by_name(reports):
    for report in reports:
        assert "norm.weight" in report["dense_unused"] and "find_unused_parameters=True" in report["dense_unused"]


def _tied_router_worker(world) -> dict:
    """EP2 on DP2 with every router weight zero: each token's scores tie and top-1 takes the same expert, which EP rank 1
    holds; EP rank 0's experts receive no row, and one of them runs on the empty rows (the all-to-all's backward needs
    the path), a zero gradient where one process has none. Every runtime must leave those experts untouched."""
    rank, size = world.rank, world.world_size
    ep = world.new_communicator([0, 1], "ep")
    edp = [world.new_communicator([r], f"edp{r}") for r in range(size)][rank]
    tied = types.SimpleNamespace(**{**vars(CFG), "moe": types.SimpleNamespace(num_experts=4, top_k=1, router_aux_loss_coef=0.0)})

    def build() -> MixtralForCausalLM:
        torch.manual_seed(0)
        m = MixtralForCausalLM(tied)
        with torch.no_grad():
            for block in m.moe_blocks():
                block.gate.weight.zero_()
        return m

    ref = build()
    ref_opt = _sgd(ref)
    for step in range(2):
        ref_opt.zero_grad()
        for r in range(size):
            ids, labels = _tokens(r, step)
            (ref.loss_fn(ref(ids), labels) / size).backward()
        ref_opt.step()
    want = {k: v.clone() for k, v in ref.state_dict().items()}
    report = {
        "reached": sorted(
            {n.split(".experts.")[1].split(".")[0] for n, p in ref.named_parameters() if ".experts." in n and p.grad is not None}
        )
    }
    from nxdt.parallel.expert_parallel import apply_expert_parallel

    for kind, options in KINDS.items():
        model = apply_expert_parallel(build(), ep)
        state, _ = train_with_runtime(model, rank, options, ModelParallel(dp=world.world, dp_size=size, ep=ep, edp=edp), _sgd, 2)
        report[kind] = mismatches(state, want)
    return report


@pytest.fixture(scope="module")
def tied_reports() -> list[dict]:
    return run_local(_tied_router_worker, 2, timeout_s=120)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", list(KINDS))
def test_an_expert_run_on_no_token_is_left_untouched_under_expert_parallelism(tied_reports, kind):
    assert tied_reports[0]["reached"] == ["2"]  # one expert, on EP rank 1: EP rank 0's got no row
    for rank, report in enumerate(tied_reports):
        assert report[kind] == [], (rank, kind)
