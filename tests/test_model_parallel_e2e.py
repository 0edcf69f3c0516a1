"""Model parallelism through `nxdt train`: the same per-step losses as one process (fp32), sharded
checkpoints that a restarted job resumes from exactly (resuming on another layout: test_reshard.py), and
an expert-parallel checkpoint (EP × PP, ZeRO-1) consolidated and resumed on one process.

Runs are expensive (each is a launcher plus workers), so each one checks several things: the killed
runs prove parity, sharded checkpoint files, automatic restart and exact resume at once."""

from __future__ import annotations

import csv
import json
from unittest import mock

import pytest
import torch

from nxdt.lightning.checkpoint import check_layout
from nxdt.lightning.reshard import read_full_state
from test_train_e2e import TINY, assert_ok, losses, nxdt

# 4 steps (were 6): step 1's loss checks the forward, steps 2-4 each checks one more backward, reduction and update;
# the killed runs save step 2, lose rank 1 at step 3 and recompute steps 3-4 after the restart
COMMON = [
    *TINY,
    "data=synthetic",
    "trainer.max_steps=4",
    "model.optim.sched.max_steps=4",
    "data.global_batch_size=8",
    "data.micro_batch_size=2",
    "trainer.gradient_clip_val=0.5",
    "exp_manager.checkpoint_every_n_steps=2",
]
KILL_AT_STEP_3 = [
    "exp_manager.max_restarts=1",
    "exp_manager.fault_injection.step=3",
    "exp_manager.fault_injection.rank=1",
    "exp_manager.fault_injection.kind=sigkill",
]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    run = tmp_path_factory.mktemp("single") / "run"
    assert_ok(nxdt("train", *COMMON, "trainer.devices=1", f"exp_manager.explicit_log_dir={run}", cwd=run.parent))
    return losses(run)


def _assert_same_losses(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)


@pytest.mark.parametrize(
    "layout,files",
    [
        (
            [
                "trainer.devices=4",
                "distributed_strategy.tensor_model_parallel_size=2",
                "distributed_strategy.sequence_parallel=true",
                "distributed_strategy.pipeline_model_parallel_size=2",
                "distributed_strategy.virtual_pipeline_model_parallel_size=2",
            ],
            {"model-mp0.safetensors", "model-mp3.safetensors"},
        ),
        (  # PP2 and ZeRO-1 over DP2 were two launches of 2 ranks, each training the whole batch: one of 4, half the
            # compute, a wrong pipeline hand-off or ZeRO-1 shard still moves the losses (ZeRO-1 alone: test_reshard.py)
            [
                "trainer.devices=4",
                "distributed_strategy.pipeline_model_parallel_size=2",
                "distributed_strategy.zero1=true",
                *KILL_AT_STEP_3,
            ],
            {"model-mp0.safetensors", "model-mp1.safetensors", "trainer_state-mp0-dp1.pt", "trainer_state-mp1-dp0.pt"},
        ),
        (
            [
                "trainer.devices=4",
                "distributed_strategy.tensor_model_parallel_size=2",
                "distributed_strategy.sequence_parallel=true",
                "distributed_strategy.fsdp.enabled=true",
                "exp_manager.trace=true",
                *KILL_AT_STEP_3,
            ],
            {"model-mp0.safetensors", "model-mp1.safetensors", "trainer_state-mp0-dp0.pt", "trainer_state-mp1-dp1.pt"},
        ),
    ],
    ids=[
        "tp2-sp-x-pp2-interleaved",
        "pp2-x-zero1-dp2-killed-and-restarted",
        "tp2-sp-x-fsdp2-killed-and-restarted",
    ],
)
@pytest.mark.timeout(300)
def test_parallel_losses_equal_single_process(tmp_path, single, layout, files):
    run = tmp_path / "run"
    result = nxdt("train", *COMMON, *layout, f"exp_manager.explicit_log_dir={run}", cwd=tmp_path)
    assert_ok(result)
    _assert_same_losses(losses(run), single)
    assert files | {"done", "meta.json"} <= {p.name for p in (run / "checkpoints/step-4").iterdir()}
    if "distributed_strategy.fsdp.enabled=true" in layout:  # per-step FSDP figures and a Perfetto trace per rank
        rows = list(csv.DictReader(open(run / "metrics.csv", newline="")))
        assert all(float(r["peak_gathered_bytes"]) > 0 and 0 <= float(r["overlap_pct"]) <= 100 for r in rows)
        trace = json.loads((run / "trace/rank0.json").read_text())["traceEvents"]
        assert {"forward", "backward", "all_gather", "reduce_scatter"} <= {e["name"] for e in trace}
        assert {"fsdp", "tp", "compute"} <= {e.get("cat") for e in trace}
    if "exp_manager.max_restarts=1" in layout:  # the kill happened, the job restarted from step 2 by itself
        out = result.stdout + result.stderr
        assert "SIGKILL on rank 1 at step 3" in (run / "logs/rank1.log").read_text() and "checkpoints/step-2" in out


MIXTRAL = [*COMMON, "model=mixtral_tiny"]


@pytest.fixture(scope="module")
def single_mixtral(tmp_path_factory):
    run = tmp_path_factory.mktemp("single_mixtral") / "run"
    assert_ok(nxdt("train", *MIXTRAL, "trainer.devices=1", f"exp_manager.explicit_log_dir={run}", cwd=run.parent))
    return run


def _mixtral_on_four_ranks(tmp_path, name: str, *layout: str):
    """A 4-rank Mixtral launch of ``layout`` (ZeRO-1 by default): its run directory and console output."""
    run = tmp_path / name
    result = nxdt("train", *MIXTRAL, "trainer.devices=4", *layout, f"exp_manager.explicit_log_dir={run}", cwd=tmp_path)
    assert_ok(result)
    return run, result.stdout + result.stderr


def _mixtral_equals_one_process(tmp_path, single, name: str, banner: str, states: set[str], *layout: str):
    """A 4-rank EP2 Mixtral launch of ``layout`` whose banner says ``banner``: its losses are one process's, its
    checkpoint holds a model file per EP rank and the trainer-state files ``states``, and it consolidates to one
    process's state. Returns its run directory."""
    run, said = _mixtral_on_four_ranks(tmp_path, name, *layout)
    assert banner in said
    _assert_same_losses(losses(run), losses(single))
    files = {p.name for p in (run / "checkpoints/step-4").iterdir()}
    assert {"model-ep0.safetensors", "model-ep1.safetensors"} | states <= files
    _assert_consolidates_to(run, single)
    return run


def _assert_consolidates_to(run, single) -> None:
    """The checkpoint consolidated (what `nxdt checkpoint consolidate` and export-hf read) holds one process's tensors and
    optimizer state. Per tensor ‖a − b‖ / ‖b‖ < 0.05: 4 AdamW steps round differently (an element whose gradient is at
    rounding level can move by up to 2·lr the other way, lr ≤ 2e-3, against tensors of norm ≳ 0.1), a wrong expert or a
    shard out of place is ~1 (different weights, moments of other elements)."""
    got, want = read_full_state(run / "checkpoints/step-4"), read_full_state(single / "checkpoints/step-4")
    assert list(got.model) == list(want.model) and got.optimizers[0]["param_groups"] == want.optimizers[0]["param_groups"]
    pairs = [(got.model[n], t) for n, t in want.model.items()]
    moments, want_moments = got.optimizers[0]["state"], want.optimizers[0]["state"]
    pairs += [(moments[i][k], t) for i, state in want_moments.items() for k, t in state.items() if t.dim()]
    assert all(float((a - b).norm() / b.norm()) < 0.05 for a, b in pairs if b.norm() > 0)


@pytest.mark.timeout(300)
def test_mixtral_expert_parallel_with_pipeline_and_zero1_equals_single_process(tmp_path, single_mixtral):
    """EP2 × PP2 on 4 ranks (DP2 = EP2: each rank of a stage holds half the experts), ZeRO-1 by default (dense state in
    2 shards, each rank's experts whole): the load-balancing statistics cross the stages, the tokens cross the EP ranks,
    and the losses are one process's; the checkpoint consolidates to one process's state, and one process resumed from
    it continues the uninterrupted losses. (Its optimizer shards saved and loaded again: tests/parallel/test_moe.py.)"""
    two, said = _mixtral_on_four_ranks(
        tmp_path,
        "ep2",
        "distributed_strategy.expert_model_parallel_size=2",
        "distributed_strategy.pipeline_model_parallel_size=2",
    )
    assert "TP1 PP2 DP2 CP1 EP2 · FSDP off · ZeRO-1" in said
    _assert_same_losses(losses(two), losses(single_mixtral))
    files = {p.name for p in (two / "checkpoints/step-4").iterdir()}
    assert {f"model-mp{s}-ep{e}.safetensors" for s in (0, 1) for e in (0, 1)} <= files
    assert {f"trainer_state-mp{s}-ep{e}-dp{e}.pt" for s in (0, 1) for e in (0, 1)} <= files  # a ZeRO-1 shard per rank
    _assert_consolidates_to(two, single_mixtral)
    # resumed on one process (resharded: each rank takes its experts and their ZeRO-1 state by name), steps 3-4 are the
    # uninterrupted run's
    resumed = tmp_path / "resumed"
    assert check_layout(two / "checkpoints/step-2", {"tp": 1, "cp": 1, "ep": 1, "dp": 1, "pp": 1}, False)
    assert_ok(
        nxdt(
            "train",
            *MIXTRAL,
            "trainer.devices=1",
            f"exp_manager.resume_from_checkpoint={two / 'checkpoints/step-2'}",
            f"exp_manager.explicit_log_dir={resumed}",
            cwd=tmp_path,
        )
    )
    _assert_same_losses(losses(resumed), {s: v for s, v in losses(single_mixtral).items() if s > 2})


@pytest.mark.timeout(300)
def test_mixtral_context_with_expert_parallelism_equals_single_process(tmp_path, single_mixtral):
    """CP2 × EP2 on 4 ranks (DP2): each rank half of every sequence (ring attention), its half of the experts (the
    tokens of the two ranks of an EP group exchanged), the load-balancing statistics added up over the CP pair, an
    expert's gradients summed over its replicas in both DP and CP (``edp_cp``) and its ZeRO-1 state sharded there; the
    losses are one process's and the checkpoint (one model file per EP rank, a ZeRO-1 shard per rank) consolidates to
    one process's state."""
    _mixtral_equals_one_process(
        tmp_path,
        single_mixtral,
        "cp2-ep2",
        "TP1 PP1 DP2 CP2 EP2 · FSDP off · ZeRO-1",
        {f"trainer_state-ep{d // 2}-dp{d}.pt" for d in range(4)},
        "distributed_strategy.context_parallel_size=2",
        "distributed_strategy.expert_model_parallel_size=2",
    )


@pytest.mark.timeout(300)
def test_mixtral_expert_parallel_with_fsdp_equals_single_process(tmp_path, single_mixtral):
    """EP2 × FSDP on 4 ranks (DP4: each rank half the experts, its dense flats sharded over the 4, its expert flats over
    the 2 replicas of the same experts): the losses are one process's and the checkpoint (a model file per EP rank, a
    flat-shard file per rank) consolidates to one process's state; one process's step-2 checkpoint resumed as EP2 × FSDP
    (each rank's experts and their moments cut into its expert flats) continues the uninterrupted losses."""
    run = _mixtral_equals_one_process(
        tmp_path,
        single_mixtral,
        "ep2-fsdp",
        "TP1 PP1 DP4 CP1 EP2 · FSDP token_threaded",
        {f"trainer_state-ep{d % 2}-dp{d}.pt" for d in range(4)},
        "distributed_strategy.expert_model_parallel_size=2",
        "distributed_strategy.fsdp.enabled=true",
    )
    with mock.patch("torch.load", wraps=torch.load) as load:  # each rank's trainer state read once, not once per EP rank
        read_full_state(run / "checkpoints/step-4")
    assert load.call_count == 4
    resumed, _ = _mixtral_on_four_ranks(
        tmp_path,
        "resumed",
        "distributed_strategy.expert_model_parallel_size=2",
        "distributed_strategy.fsdp.enabled=true",
        f"exp_manager.resume_from_checkpoint={single_mixtral / 'checkpoints/step-2'}",
    )
    _assert_same_losses(losses(resumed), {s: v for s, v in losses(single_mixtral).items() if s > 2})
