"""The planner's rank layout (pure): worked examples, partitions, EP inside DP, JSON round trip."""

import pytest

from nxdt.planner import Plan, plan, plan_layout
from nxdt.config import compose_config


def test_docstring_example_tp2_pp2():
    p = plan_layout(8, tp=2, pp=2)
    assert p.groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert p.groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert p.groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert p.groups["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert p.coords(5).as_dict() == {
        "tp": 1,
        "cp": 0,
        "ep": 0,
        "dp": 0,
        "edp": 0,
        "dp_cp": 0,
        "pp": 1,
        "mp": 3,
        "world": 5,
        "edp_cp": 0,
    }


@pytest.mark.parametrize(
    "world,kw",
    [
        (16, dict(tp=2, pp=2, cp=2)),
        (16, dict(tp=4, ep=2)),
        (12, dict(tp=3, pp=2)),
        (8, dict(tp=2, order="dp-tp-cp-ep-pp")),
        (16, dict(tp=2, cp=2, ep=2)),
    ],
)
def test_every_dimension_partitions_the_world(world, kw):
    p = plan_layout(world, **kw)
    for dim, groups in p.groups.items():
        members = sorted(r for g in groups for r in g)
        assert members == list(range(world)), dim
        assert all(len(g) == p.degrees.get(dim, len(g)) for g in groups) or dim in ("mp", "world")


def test_the_replicas_of_an_experts_weights_span_cp_too():
    """EP with CP: an expert's replicas are the ranks with its EP coordinate in every EP group and every CP position
    (``edp_cp``, cp fastest: its gradients are summed and its ZeRO-1 state sharded there); planned only then."""
    p = plan_layout(8, cp=2, ep=2)
    assert p.groups["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert p.groups["edp_cp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert p.degree("edp_cp") == 4 and p.coords(5).edp_cp == 3
    assert "edp_cp" not in plan_layout(8, ep=2).groups and "edp_cp" not in plan_layout(8, cp=2).groups


def test_ep_subdivides_dp():
    p = plan_layout(8, tp=2, ep=2)  # DP = 4, split into expert groups of 2
    assert p.groups["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert p.groups["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_order_changes_which_dimension_is_fastest():
    p = plan_layout(4, tp=2, order="dp-tp-cp-ep-pp")
    assert p.groups["dp"] == [[0, 1], [2, 3]] and p.groups["tp"] == [[0, 2], [1, 3]]


@pytest.mark.parametrize(
    "kw,needle", [(dict(tp=3), "does not divide"), (dict(tp=2, ep=3), "EP=3"), (dict(order="tp-dp"), "order")]
)
def test_invalid_layouts_name_the_problem(kw, needle):
    with pytest.raises(ValueError, match=needle):
        plan_layout(8, **kw)


def test_json_round_trip_and_plan_from_config(tmp_path):
    p = plan(
        compose_config(
            [
                "trainer.devices=4",
                "trainer.num_nodes=2",
                "distributed_strategy.pipeline_model_parallel_size=2",
                "data.global_batch_size=16",
            ]
        )
    )
    assert p.world_size == 8 and p.num_nodes == 2 and p.place(5) == {"rank": 5, "node": 1, "device": 1, "core": 1}
    p.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == p


def test_65536_ranks():
    p = plan_layout(65536, tp=8, pp=8, ep=4, ranks_per_node=64)
    assert p.degrees["dp"] == 1024 and len(p.groups["tp"]) == 8192 and p.num_nodes == 1024


def test_token_threaded_prefetch_hides_behind_compute_and_tp_collectives_eager_only_behind_compute():
    """TP2×FSDP2 with emulated links slow enough that the prefetched FSDP traffic exceeds compute: token_threaded's
    own stream on the DP links also overlaps the blocking TP collectives; eager's gathers queue on the TP stream."""
    common = [
        "trainer.devices=4",
        "distributed_strategy.tensor_model_parallel_size=2",
        "distributed_strategy.fsdp.enabled=true",
        "comm.emulate=trn1.32xlarge",
        "comm.emulate_slowdown=1000",
        "model.num_layers=8",
        "model.hidden_size=256",
    ]
    est = {
        pol: plan(compose_config([*common, f"distributed_strategy.fsdp.prefetch={pol}"])) for pol in ("token_threaded", "eager")
    }
    rows = est["token_threaded"].collectives
    compute = est["token_threaded"].estimate["compute_s"]
    blocking = sum(r["total_s"] for r in rows if not r["overlap"])
    other_dims = sum(r["total_s"] for r in rows if not r["overlap"] and r["dim"] != "dp")
    overlappable = sum(r["total_s"] for r in rows if r["overlap"])
    assert overlappable > compute  # the regime this checks: compute alone cannot hide the prefetches
    token = est["token_threaded"].estimate["exposed_comm_s"]
    assert token == pytest.approx(blocking + max(0.0, overlappable - compute - other_dims))
    eager = est["eager"].collectives
    eager_blocking = sum(r["total_s"] for r in eager if not r["overlap"])
    eager_overlappable = sum(r["total_s"] for r in eager if r["overlap"])
    assert est["eager"].estimate["exposed_comm_s"] == pytest.approx(eager_blocking + max(0.0, eager_overlappable - compute))
