"""Typed dimensions on the Plan (``Dim``, ``plan.tp``-style accessors, cached ``coords``), plan.json unchanged
byte for byte, and the micro-batch count read from ``Plan.batch`` only.

The plans under tests/golden/plans were written by the code before ``Dim`` existed (string keys everywhere):
today's planner must write the same bytes, and loading and saving one must not change a byte. One intended change
since: the ``dp_cp`` groups (DP × CP, the replicas of the weights under context parallelism), added to the goldens;
a plan.json without them (an older nxdt's) loads with them derived from its dp and cp groups."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nxdt.config import compose_config
from nxdt.config.validate import DIMENSIONS, Dim, batch_plan
from nxdt.planner import Coords, Plan, plan, plan_layout

GOLDEN = Path(__file__).resolve().parent / "golden" / "plans"
MIXTRAL_TRN1 = [
    "model=mixtral_tiny",
    "instance=trn1.32xlarge",
    "trainer.devices=32",
    "distributed_strategy.tensor_model_parallel_size=4",
    "distributed_strategy.kv_replicator=2",
    "distributed_strategy.expert_model_parallel_size=2",
    "data.global_batch_size=32",
]
LLAMA_TP2_PP2 = [
    "model=llama_tiny",
    "trainer.devices=8",
    "distributed_strategy.tensor_model_parallel_size=2",
    "distributed_strategy.pipeline_model_parallel_size=2",
    "data.global_batch_size=16",
]


def test_dim_is_the_json_key():
    assert [d.value for d in DIMENSIONS] == ["tp", "cp", "ep", "dp", "pp"]
    assert Dim.TP == "tp" and hash(Dim.TP) == hash("tp") and {"tp": 3}[Dim.TP] == 3 and str(Dim.EDP) == "edp"
    assert json.dumps({Dim.TP: 1}) == json.dumps({"tp": 1})


@pytest.mark.parametrize(
    "name,make",
    [
        ("plan_layout_tp4_ep2.json", lambda: plan_layout(16, tp=4, ep=2)),
        ("plan_llama_tiny_tp2_pp2.json", lambda: plan(compose_config(LLAMA_TP2_PP2), estimate=False)),
        ("plan_mixtral_tiny_trn1_tp4_ep2.json", lambda: plan(compose_config(MIXTRAL_TRN1), estimate=False)),
    ],
)
def test_plan_json_is_byte_compatible(name, make, tmp_path):
    golden = (GOLDEN / name).read_text()
    assert make().to_json() == golden  # written today == written before typed dimensions
    loaded = Plan.load(GOLDEN / name)
    loaded.coords(0)  # the coordinate cache is no field: it must not reach plan.json
    loaded.save(tmp_path / name)
    assert (tmp_path / name).read_bytes() == (GOLDEN / name).read_bytes()
    assert all(type(k) is str for k in json.loads(golden)["degrees"])


def test_dp_cp_groups_join_the_replicas_of_the_weights():
    p = plan_layout(8, tp=2, cp=2)  # dp = 2
    assert p.groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]] and p.groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert p.groups["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]] and p.dp_cp == 4  # cp fastest, then dp
    assert p.coords(6).dp_cp == 3 and p.coords(6)[Dim.DP_CP] == 3
    assert plan_layout(8, tp=2).groups["dp_cp"] == plan_layout(8, tp=2).groups["dp"]  # CP 1: the DP groups
    old = json.loads(p.to_json())
    del old["groups"]["dp_cp"]  # a plan.json written before dp_cp existed
    assert Plan.from_json(json.dumps(old)).groups["dp_cp"] == p.groups["dp_cp"]
    q = plan_layout(16, tp=2, cp=2, ep=2, order="cp-tp-ep-dp-pp")
    old = json.loads(q.to_json())
    del old["groups"]["dp_cp"]
    assert Plan.from_json(json.dumps(old)).groups["dp_cp"] == q.groups["dp_cp"]


def test_full_plan_round_trips_bytes():
    p = plan(compose_config(LLAMA_TP2_PP2))
    text = p.to_json()
    assert Plan.from_json(text).to_json() == text


def test_accessors_and_coords():
    p = plan_layout(16, tp=2, pp=2, ep=2)  # dp = 4, edp = 2
    assert (p.tp, p.cp, p.ep, p.dp, p.pp, p.edp, p.mp) == (2, 1, 2, 4, 2, 2, 4)
    assert all(p.degree(d) == p.degrees[d.value] for d in DIMENSIONS)
    for rank in range(16):
        c = p.coords(rank)
        assert isinstance(c, Coords)
        for dim in p.groups:  # the cache agrees with the groups
            assert c[dim] == getattr(c, dim) == p.group_of(dim, rank).index(rank)
        assert c[Dim.DP] == c.dp
    assert p.coords(5) is not p.coords(5) and p.coords(5) == p.coords(5)
    with pytest.raises(KeyError):
        p.coords(16)


def test_micro_batches_come_from_plan_batch():
    cfg = compose_config(LLAMA_TP2_PP2)
    p = plan(cfg, estimate=False)
    assert p.batch == batch_plan(cfg.data, p.dp) == {"global": 16, "micro": 4, "seq_length": 128, "micro_batches": 2}
    assert p.micro_batches == 2
    assert "× 2 micro-batches per step" in p.summary()
