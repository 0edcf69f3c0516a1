"""The MoE load-balancing loss through pipeline stages: Mixtral and Qwen3-MoE (4 layers, aux coefficient 0.1) at PP2
— 1F1B with token-weighted micro-batches, interleaved with 2 virtual chunks per stage — and at PP1 with 2 virtual
chunks (handed over in process) give the single-process model's loss (cross-entropy + coef × HF's aux loss over all
layers, ``model.loss_fn``) and gradients. Before, each stage's loss saw only the last stage's router logits: the
first stage's routers got no aux gradient and the loss missed half the term.

Tolerance: both sides compute in fp32 from the same weights; the pipeline evaluates the aux term as a sum over stages
of E/T² · Σ_e C_e S_e instead of one sum over all rows (the counts C are exact integers, so only the order of the
probability sums S over 64 rows and 4 experts changes): a few ulps on a term of ~0.2, the loss of ~4.2 kept at rtol
1e-5 (a tenfold margin); gradients as tests/parallel/test_pipeline.py (rtol 1e-5, atol 1e-7 on values of 1e-4..1e-1).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from nxdt.comm.spawn import run_local
from nxdt.parallel.pipeline import (
    PipelineExecutor,
    build_chunks,
    chunk_parameters,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
)

FAMILIES = {"mixtral": "nxdt.models.mixtral.MixtralForCausalLM", "qwen3_moe": "nxdt.models.qwen3_moe.Qwen3MoeForCausalLM"}
WEIGHTS = (0.5, 1.5, 0.0, 2.0)  # token weights of four micro-batches (SFT's; one without labels)


def _model(family: str) -> torch.nn.Module:
    normalize = family == "mixtral"  # Qwen3-MoE's router keeps the softmax weights (norm_topk_prob false)
    moe = SimpleNamespace(
        num_experts=4, top_k=2, router_aux_loss_coef=0.1, router_activation="softmax", normalize_top_k_affinities=normalize
    )
    cfg = SimpleNamespace(
        vocab_size=64,
        hidden_size=32,
        num_layers=4,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=24,
        head_dim=16 if family == "qwen3_moe" else None,
        max_position_embeddings=64,
        rope_theta=10000.0,
        norm_eps=1e-5,
        tie_word_embeddings=False,
        init_method_std=0.1,  # wide enough that the routers do not split tokens evenly (a zero aux gradient)
        moe=moe,
    )
    module, _, name = FAMILIES[family].rpartition(".")
    torch.manual_seed(0)
    return getattr(importlib.import_module(module), name)(cfg)


def _microbatches(weighted: bool) -> list:
    g = torch.Generator().manual_seed(3)
    out = []
    for w in WEIGHTS:
        ids = torch.randint(0, 64, (2, 8), generator=g)
        labels = torch.randint(0, 64, (2, 8), generator=g)
        labels[:, -1] = -100
        mb = {"input_ids": ids, "labels": labels}
        if weighted:
            mb["loss_weight"] = torch.tensor(w, dtype=torch.float64)
        out.append(mb)
    return out


def _reference(family: str, weighted: bool, with_aux: bool = True) -> tuple[float, dict[str, torch.Tensor], float]:
    """(mean loss, gradients, the aux part of the loss) of the unsharded model, micro-batch by micro-batch."""
    model = _model(family)
    mbs = _microbatches(weighted)
    total = aux = 0.0
    for mb in mbs:
        loss = (model.loss_fn if with_aux else type(model).loss_fn)(model(mb["input_ids"]), mb["labels"])
        aux += model.router_aux_loss_coef * float(model.aux_loss().detach()) / len(mbs)
        scaled = loss * mb["loss_weight"] if weighted else loss
        total += float(scaled) / len(mbs)
        (scaled / len(mbs)).backward()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}, aux


RUNS = [("1f1b", 1, True), ("interleaved", 2, False)]


def _worker(world) -> dict:
    pp = world.new_communicator(list(range(world.world_size)), "pp")
    out = {}
    for family in FAMILIES:
        for kind, virtual, weighted in RUNS:
            model = _model(family)
            chunks = build_chunks(model, pp.rank, pp.size, virtual)
            schedule = one_f_one_b(2, pp.rank, 4) if kind == "1f1b" else interleaved_one_f_one_b(2, pp.rank, 4, virtual)
            loss = PipelineExecutor(chunks, pp, model.loss_fn).run(schedule, _microbatches(weighted))
            grads = {n: p.grad.numpy().copy() for n, p in chunk_parameters(chunks).items()}  # numpy: plain pickles
            out[family, kind] = (loss, grads)
    return out


@pytest.fixture(scope="module")
def pp2() -> list[dict]:
    return run_local(_worker, 2, timeout_s=110)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kind, virtual, weighted", RUNS)
def test_pp2_adds_every_layers_aux_loss_as_the_unsharded_model(pp2, family, kind, virtual, weighted):
    want_loss, want_grads, aux = _reference(family, weighted)
    assert aux > 1e-2  # the term is there to lose: ~0.2 of a loss of ~4.3
    for rank in pp2:
        loss, grads = rank[family, kind]
        assert loss == pytest.approx(want_loss, rel=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(
                torch.from_numpy(grad), want_grads[name], rtol=1e-5, atol=1e-7, msg=f"{family} {kind} {name}"
            )
    assert sorted(n for rank in pp2 for n in rank[family, kind][1]) == sorted(want_grads)  # every parameter once
    routers = [n for n in want_grads if n.endswith(".gate.weight")]
    assert {n.split(".")[1] for n in routers} == {"0", "1", "2", "3"}  # both stages' routers compared


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("with_aux", [True, False])
def test_one_stage_with_virtual_chunks_hands_the_statistics_over_in_process(family, with_aux):
    """``with_aux=False``: an objective whose loss leaves the term out (the class's plain cross-entropy, as DPO's
    log-probabilities do) gets it at no stage: the earlier chunk's share is zeroed too."""
    want_loss, want_grads, _ = _reference(family, weighted=False, with_aux=with_aux)
    chunks = build_chunks(_model(family), stage=0, num_stages=1, virtual=2)
    model = chunks[0].model
    loss_fn = model.loss_fn if with_aux else type(model).loss_fn
    loss = PipelineExecutor(chunks, None, loss_fn).run(gpipe(1, 0, 4, 2), _microbatches(weighted=False))
    assert loss == pytest.approx(want_loss, rel=1e-5)
    for name, p in chunk_parameters(chunks).items():
        torch.testing.assert_close(p.grad, want_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_pipeline_evaluates_with_the_whole_aux_term():
    """Validation (forward only) reports each micro-batch's loss as the unsharded model's loss_fn does."""
    model = _model("mixtral")
    with torch.no_grad():
        want = [float(model.loss_fn(model(mb["input_ids"]), mb["labels"])) for mb in _microbatches(False)]
    chunks = build_chunks(_model("mixtral"), stage=0, num_stages=1, virtual=2)
    got = PipelineExecutor(chunks, None, chunks[0].model.loss_fn).evaluate(_microbatches(False))
    assert got == pytest.approx(want, rel=1e-5)
