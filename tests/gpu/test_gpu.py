"""GPU checks of issue 37 (skipped without a CUDA device, with the reason: tests/gpu/conftest.py).

Every check runs in a fresh process (``nxdt train``, or tests/gpu/device_checks.py): this pytest process never opens a
CUDA context, which would break the workers those launches fork. The CPU suite covers the same seams without a GPU
(tests/test_devices.py)."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# no checkpoint at the end (save_last=false): checkpoints of CUDA runs are the resume check's (test_gpu_layouts.py)
TINY = [
    "exp_manager.save_last=false",
    "model=llama_tiny",
    "trainer.max_steps=8",
    "data.micro_batch_size=4",
    "data.seq_length=128",
    "trainer.log_every_n_steps=1",
]


def train_rows(run_dir: Path, *overrides: str) -> list[dict[str, str]]:
    """metrics.csv's rows of one ``nxdt train OVERRIDES`` into ``run_dir`` (a fresh interpreter: ``python -m
    nxdt.cli``), which must succeed."""
    cmd = [sys.executable, "-m", "nxdt.cli", "train", *overrides, f"exp_manager.explicit_log_dir={run_dir}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (cmd, done.stdout[-3000:], done.stderr[-3000:])
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def nxdt_train(run_dir: Path, *overrides: str) -> dict[int, float]:
    """Losses by step of the tiny run (``TINY``; a ``model=`` among ``overrides`` replaces its model) with ``overrides``."""
    base = [o for o in TINY if not (o.startswith("model=") and any(x.startswith("model=") for x in overrides))]
    return {int(r["step"]): float(r["loss"]) for r in train_rows(run_dir, *base, *overrides) if r.get("loss")}


def test_comm_placement_and_kernels_on_the_gpu():
    done = subprocess.run([sys.executable, str(HERE / "device_checks.py")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if os.environ.get("NXDT_GPU_RESULTS"):  # tests/gpu/check.sh keeps it (the all-reduce times)
        Path(os.environ["NXDT_GPU_RESULTS"]).write_text(json.dumps(result, indent=1))
    assert result["comm"]["solo"]["transport"] == "nccl"
    assert {r["transport"] for r in result["comm"]["pair"]} == {"cuda_ipc"}
    assert result["placement"]["fused"] is True


def test_one_gpu_bf16_matches_the_cpu_fp32_run(tmp_path):
    """The same tiny Llama, seed and data: CPU fp32 vs one GPU with fp32 master weights and bf16 autocast.

    Tolerance, analysed: autocast rounds each matmul's inputs to bf16 (unit roundoff u = 2^-8 ≈ 0.0039) and accumulates
    in fp32, so each matmul output is off by at most ~2u relative, plus u where a branch output is stored in bf16. At
    initialisation (std 0.02) the branches are small beside the fp32 residual stream and the logits (|z| ≲ 0.3: hidden
    128, head std 0.02) carry ≲ 3u relative error: ≲ 0.004 absolute. The loss (log-sum-exp minus the label's logit,
    ≈ ln 256 = 5.5) moves by at most twice the largest logit error: ≲ 0.01 at step 1. Later steps add the update
    difference: AdamW's normalised update sees ~1% (bf16) gradient noise, changing the ~0.5-nat loss drop of 8 steps
    by ~1%: ≲ 0.01 more. 0.05 absolute (< 1% of the loss) is twice that bound; an fp32-vs-fp32 error would be 1e-5."""
    cpu = nxdt_train(tmp_path / "cpu", "instance=cpu", "trainer.devices=1", "precision.type=fp32")
    # the GPU run also profiles two steps (exp_manager.profile_steps: its GPU side is only checked here)
    gpu = nxdt_train(
        tmp_path / "gpu", "instance=gpu", "trainer.devices=1", "precision.type=mixed_precision", "exp_manager.profile_steps=[3,4]"
    )
    assert sorted(cpu) == sorted(gpu) == list(range(1, 9))
    for step in cpu:
        assert gpu[step] == pytest.approx(cpu[step], abs=0.05), (step, cpu, gpu)
    assert gpu[8] < gpu[1]  # it trained
    with open(tmp_path / "gpu" / "metrics.csv", newline="") as f:
        peaks = [float(r["peak_gpu_mb"]) for r in csv.DictReader(f)]
    assert all(0 < p < 140 * 1024 for p in peaks), peaks  # the device's own memory, not the host's, is reported
    table = (tmp_path / "gpu" / "profile" / "rank0.txt").read_text()
    busy = re.search(r"GPU busy [0-9.]+ s: ([0-9.]+) % of the wall time \((\d+) kernels", table)
    assert table.startswith("steps 3-4 on rank 0 (cuda:0)") and busy, table[:1000]
    assert 0 < float(busy.group(1)) <= 100 and int(busy.group(2)) > 0, table[:1000]


def test_bf16sr_on_one_gpu_trains_as_on_the_cpu(tmp_path):
    """``precision.type=bf16SR`` (bf16 weights and moments, updates rounded stochastically with bits drawn on the
    weights' device) on one GPU against the same run on the CPU. Step 1 starts from the same bf16 weights: only the
    kernels' summation order differs (bf16 outputs, u = 2^-8; logits |z| ≲ 0.3 off by ≲ 3u relative: the loss by
    ≲ 0.01). The devices' generators differ (Philox, mt19937), so each update rounds each weight to the other bf16
    neighbour with some probability: an unbiased difference of ≤ 1 ulp (2^-8 relative) per step, a random walk of
    ~sqrt(7)·2^-9 ≈ 0.5 % of a weight by step 8, averaging out over each dot product's fan-in: ≲ 0.01 more (measured
    on the CPU, three runs differing only in their rounding streams: within 0.002 of each other at every step). Bound
    0.05 absolute, as for mixed precision; a run whose GPU updates were lost or biased would leave it within 8 steps."""
    common = ["trainer.devices=1", "precision.type=bf16SR"]
    cpu = nxdt_train(tmp_path / "cpu", "instance=cpu", *common)
    gpu = nxdt_train(tmp_path / "gpu", "instance=gpu", *common)
    assert sorted(cpu) == sorted(gpu) == list(range(1, 9))
    for step in cpu:
        assert gpu[step] == pytest.approx(cpu[step], abs=0.05), (step, cpu, gpu)
    assert gpu[8] < gpu[1] - 0.2, gpu  # it trained (the CPU suite's bf16SR run: > 0.2 in 4 steps)


def test_two_ranks_sharing_one_gpu_match_one_rank_fp32(tmp_path):
    """DP=2 with both ranks on cuda:0 (the staged path: NCCL takes one rank per GPU) vs one rank, the same global
    batch of 8 at fp32: the CPU suite's DP parity bound (tests/test_train_e2e.py, rel 1e-5): the ranks' gradients are
    the single rank's micro-batch gradients summed in another order (and CUDA's embedding backward adds with atomics),
    rounding-level differences only."""
    common = ["instance=gpu", "precision.type=fp32", "data.global_batch_size=8"]
    one = nxdt_train(tmp_path / "dp1", *common, "trainer.devices=1")
    two = nxdt_train(tmp_path / "dp2", *common, "trainer.devices=2", "distributed_strategy.zero1=false")  # plain DP
    assert sorted(one) == sorted(two) == list(range(1, 9))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-5), (step, one, two)


@pytest.mark.parametrize("recipe", ["lora", "dpo"])
def test_fine_tuning_recipes_on_the_gpu_match_the_cpu_at_fp32(recipe, tmp_path):
    """``+recipe=lora`` (adapters beside the frozen base) and ``+recipe=dpo`` (a frozen reference model's log-
    probabilities): one GPU against the CPU at fp32, 4 steps of the recipe's own data. Bound: the CPU suite's
    rounding-level 1e-5 between layouts, and cuBLAS's other summation order in each matmul (~1e-7 relative each) carried
    through 4 AdamW steps: 1e-4."""
    runs = {}
    for where in ("cpu", "gpu"):
        args = [f"+recipe={recipe}", f"instance={where}", "trainer.devices=1", "precision.type=fp32", "trainer.max_steps=4"]
        rows = train_rows(tmp_path / where, *args, "exp_manager.save_last=false")
        runs[where] = {int(r["step"]): float(r["loss"]) for r in rows}
    assert sorted(runs["gpu"]) == sorted(runs["cpu"]) == [1, 2, 3, 4], runs
    for step, loss in runs["cpu"].items():
        assert runs["gpu"][step] == pytest.approx(loss, rel=1e-4), (recipe, step, runs)


def test_grpo_samples_scores_and_trains_on_the_gpu(tmp_path):
    """``+recipe=grpo`` on one GPU: completions sampled on the device (the generator is the model's device's), scored,
    and trained for two steps; two runs of the same command draw the same completions: step 1 the same bits; step 2
    the same rewards and lengths, its loss within 1e-4 (the update between may differ in the order of CUDA's atomic
    additions in the embedding's backward: rounding-level)."""
    rows = []
    for run in ("a", "b"):
        args = ["+recipe=grpo", "instance=gpu", "trainer.devices=1", "trainer.max_steps=2", "exp_manager.save_last=false"]
        rows.append(
            [(r["step"], r["loss"], r["reward"], r["completions/mean_length"]) for r in train_rows(tmp_path / run, *args)]
        )
    assert [r[0] for r in rows[0]] == ["1", "2"] and all(float(r[3]) > 0 for r in rows[0]), rows
    assert rows[0][0] == rows[1][0] and rows[0][1][2:] == rows[1][1][2:], rows
    assert float(rows[0][1][1]) == pytest.approx(float(rows[1][1][1]), rel=1e-4, abs=1e-7), rows


def test_comm_test_on_the_gpu_checks_every_op_exactly():
    """``nxdt comm-test --device cuda``: two ranks sharing the GPU (CUDA IPC from 1 MiB, staged below; sizes on both
    sides), every op checked exactly (nccl-tests' ``#wrong`` column; exit 1 on any wrong element)."""
    cmd = [sys.executable, "-m", "nxdt.cli", "comm-test", "--device", "cuda", "-r", "2", "-b", "4kb", "-e", "4mb"]
    cmd += ["-f", "32", "-n", "5", "-w", "2", "-c", "allr", "allg", "redsct", "alltoall", "bcast", "reduce", "sendrecv"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert "transport cuda_ipc" in done.stdout and "#wrong" in done.stdout, done.stdout[-3000:]
