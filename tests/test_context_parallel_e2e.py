"""Context parallelism through `nxdt train`: the CP1 losses and validation losses at fp32 (rtol 1e-4), and
checkpoints that reshard to and from CP.

llama_tiny at seq_length 512 (its position table raised to 512), shrunk by overrides to keep the launches short on
a loaded 2-core host: 2 layers, hidden 64, ffn 128 (4 heads over 2 KV heads as shipped), 8 steps rather than the
issue's 30 (every step after the first checks one more ring backward and update; the resumed runs 4 of them). Four
launches, each checking several things:

* CP1 on one rank, 8 steps: the reference, with a checkpoint at step 4;
* CP2 on 2 ranks from scratch, traced: the reference's 8 losses; its checkpoint is a DP2 run's (model.safetensors
  written once, meta degrees dp=2 cp=1), so it loads into any split of the replicas;
* CP2×TP2 with sequence parallelism (4 ranks) resumed from the CP1 checkpoint (resharded to TP and CP):
  steps 5-8 equal the reference's;
* DP2×CP2 with FSDP (4 ranks; the sharding group is DP×CP, 4 optimizer-state shards) resumed from the CP2
  checkpoint (from CP into FSDP shards): steps 5-8 equal the reference's.

Every launch validates at steps 4 and 8 (``data.val_split``: 40 held-out sequences, 20 global batches, forward only
through the ring): each CP rank's mean over its own tokens combines into the sequence's token mean, so val_loss
equals the reference's at every check, on every layout (measured: within 2e-8 relative).

PP2×CP2 is checked in process (tests/parallel/test_context_parallel.py), CP with EP is refused.

Why rtol 1e-4 holds on any x86 host: the parallel runs compute the same fp32 sums in other orders (attention
merged over ring blocks by log-sum-exp, gradients averaged over DP×CP, TP partial sums), each ~1e-7 relative;
AdamW's normalised update keeps the relative error of an update near that of its gradient, so after 12 steps the
losses differed by ~1e-6 relative (measured: < 2e-7 here), 100× inside the bound; fewer steps accumulate less.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from test_train_e2e import TINY, assert_ok, losses, nxdt

pytestmark = pytest.mark.slow

STEPS = 8
COMMON = [
    *TINY,
    "data=synthetic",
    "data.seq_length=512",
    "model.max_position_embeddings=512",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    f"trainer.max_steps={STEPS}",
    f"model.optim.sched.max_steps={STEPS}",
    "data.global_batch_size=2",
    "data.micro_batch_size=1",
    f"exp_manager.checkpoint_every_n_steps={STEPS // 2}",
    "data.val_split=0.01",
    f"trainer.val_check_interval={STEPS // 2}",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    out = {}
    for name, layout in (
        ("cp1", ["trainer.devices=1"]),
        ("cp2", ["trainer.devices=2", "distributed_strategy.context_parallel_size=2", "exp_manager.trace=true"]),
    ):
        out[name] = root / name
        assert_ok(nxdt("train", *COMMON, *layout, f"exp_manager.explicit_log_dir={out[name]}", cwd=root, timeout=300))
    return out


def _assert_same_losses(got: dict[int, float], want: dict[int, float], steps: range) -> None:
    assert sorted(got) == list(steps), got
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=1e-4), (step, got, want)


def val_losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as fh:
        return {int(row["step"]): float(row["val_loss"]) for row in csv.DictReader(fh) if row.get("val_loss")}


def _assert_same_validation(run: Path, reference: Path, steps: list[int]) -> None:
    """``run``'s validation losses are at ``steps`` and equal the reference's there (the training losses' rtol)."""
    got, want = val_losses(run), val_losses(reference)
    assert sorted(got) == steps, got
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=1e-4), (step, got, want)


@pytest.mark.timeout(400)
def test_cp2_equals_cp1_and_writes_a_data_parallel_checkpoint(runs):
    _assert_same_losses(losses(runs["cp2"]), losses(runs["cp1"]), range(1, STEPS + 1))
    _assert_same_validation(runs["cp2"], runs["cp1"], [STEPS // 2, STEPS])
    step = runs["cp2"] / f"checkpoints/step-{STEPS // 2}"
    meta = json.loads((step / "meta.json").read_text())
    assert meta["degrees"] == {"tp": 1, "cp": 1, "ep": 1, "dp": 2, "pp": 1} and meta["dp_format"] == "replicated"
    assert {p.name for p in step.glob("*.safetensors")} == {"model.safetensors", "rng-rank0.safetensors", "rng-rank1.safetensors"}
    # the trace (exp_manager.trace) holds the ring's transfers on their own stream and its blocks' compute
    trace = json.loads((runs["cp2"] / "trace/rank1.json").read_text())["traceEvents"]
    assert {("ring_attention.forward", "compute"), ("ring_attention.backward", "compute"), ("send_recv", "cp")} <= {
        (e["name"], e.get("cat")) for e in trace
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "source,layout,files",
    [
        (
            "cp1",
            [
                "trainer.devices=4",
                "distributed_strategy.context_parallel_size=2",
                "distributed_strategy.tensor_model_parallel_size=2",
                "distributed_strategy.sequence_parallel=true",
            ],
            {"model-mp0.safetensors", "model-mp1.safetensors"},
        ),
        (
            "cp2",
            ["trainer.devices=4", "distributed_strategy.context_parallel_size=2", "distributed_strategy.fsdp.enabled=true"],
            {"model.safetensors", *(f"trainer_state-dp{d}.pt" for d in range(4))},
        ),
    ],
    ids=["cp2-x-tp2-sp-resumed-from-cp1", "dp2-x-cp2-fsdp-resumed-from-cp2"],
)
def test_resumed_on_another_cp_layout_continues_the_cp1_losses(runs, tmp_path, source, layout, files):
    run = tmp_path / "run"
    start = runs[source] / f"checkpoints/step-{STEPS // 2}"
    result = nxdt(
        "train",
        *COMMON,
        *layout,
        f"exp_manager.resume_from_checkpoint={start}",
        f"exp_manager.explicit_log_dir={run}",
        cwd=tmp_path,
        timeout=280,
    )
    assert_ok(result)
    assert "reshards it" in result.stdout + result.stderr  # another layout: every rank cut its part of the full state
    _assert_same_losses(losses(run), losses(runs["cp1"]), range(STEPS // 2 + 1, STEPS + 1))
    _assert_same_validation(run, runs["cp1"], [STEPS])
    assert files <= {p.name for p in (run / f"checkpoints/step-{STEPS}").iterdir()}
