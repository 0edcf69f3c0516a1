"""`nxdt plan --against RUN_DIR`: one tiny real run (2 ranks, TP2 + SP, 3 steps, traced); the comparison's measured
columns are exactly what the run's files hold (recomputed here from metrics.csv and the per-rank traces), the
predicted ones are the plan's, and the ratios are their quotients."""

from __future__ import annotations

import csv
import json
import statistics

import pytest

from nxdt.cli import main
from nxdt.config import load_run_config
from nxdt.planner import node_topology, plan
from nxdt.planner.cost import estimate_collective
from test_train_e2e import TINY, assert_ok, nxdt


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("against") / "run"
    assert_ok(
        nxdt(
            "train",
            *TINY,
            "data=synthetic",
            "trainer.devices=2",
            "trainer.max_steps=3",
            "model.optim.sched.max_steps=3",
            "distributed_strategy.tensor_model_parallel_size=2",
            "distributed_strategy.sequence_parallel=true",
            "exp_manager.trace=true",
            f"exp_manager.explicit_log_dir={path}",
            cwd=path.parent,
        )
    )
    return path


@pytest.mark.timeout(300)
def test_measured_columns_are_the_run_files(run, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no host calibration: the plan uses the catalogue's cpu figures
    assert main(["plan", "--against", str(run), "--json", "--warmup", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["calibrated"] is False

    times = [float(r["step_time_s"]) for r in csv.DictReader(open(run / "metrics.csv", newline=""))]
    assert report["steps"] == len(times) == 3
    assert report["step_time"]["measured_s"] == statistics.median(times[1:])
    cfg = load_run_config(run / "config.yaml")
    the_plan = plan(cfg, None)
    assert report["step_time"]["predicted_s"] == pytest.approx(the_plan.estimate["step_time_s"], rel=1e-12)
    assert report["step_time"]["ratio"] == pytest.approx(report["step_time"]["predicted_s"] / report["step_time"]["measured_s"])

    durations: dict[tuple, list[float]] = {}
    rank0: dict[tuple, int] = {}
    for rank in (0, 1):
        for e in json.loads((run / f"trace/rank{rank}.json").read_text())["traceEvents"]:
            if (
                e.get("ph") == "X"
                and e["name"] in ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
                and "group" in e["args"]
            ):
                key = (e["args"]["group"].rstrip("0123456789"), e["name"], e["args"]["bytes"])
                durations.setdefault(key, []).append(e["dur"] * 1e-6)
                rank0[key] = rank0.get(key, 0) + (rank == 0)
    got = {(r["dim"], r["op"], r["bytes"]): r for r in report["collectives"]}
    assert set(got) == {k for k in durations if k[0] in ("tp", "world")}
    sp_rows = {(r["dim"], r["op"], int(r["bytes"])) for r in the_plan.collectives}
    assert ("tp", "all_gather", 4 * 128 * 128 * 4) in sp_rows & set(got)  # SP gathers: micro-batch 4 × seq 128 × hidden 128, fp32
    topo = node_topology(cfg)
    for key, row in got.items():
        assert row["measured_s"] == statistics.median(durations[key])
        assert row["calls_per_step"] == rank0[key] / 3
        group = list(the_plan.groups["tp"][0]) if key[0] == "tp" else [0, 1]
        assert row["predicted_s"] == estimate_collective(key[1], group, key[2], topo, cfg.instance, the_plan.ranks_per_node)[1]
        assert row["ratio"] == pytest.approx(row["predicted_s"] / row["measured_s"])
        assert row["planned_calls_per_step"] == next(
            (r["count"] for r in the_plan.collectives if (r["dim"], r["op"], int(r["bytes"])) == key), None
        )

    assert main(["plan", "--against", str(run)]) == 0
    text = capsys.readouterr().out
    assert "step time" in text and "all_gather" in text and "pred/meas" in text


def test_refuses_what_is_not_a_run(tmp_path, capsys):
    assert main(["plan", "--against", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no config.yaml there" in err and len(err.splitlines()) == 1
