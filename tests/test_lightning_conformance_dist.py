"""BatchNorm buffers, ``sync_batchnorm``, torch.distributed for third-party code (torchmetrics, a user's
DistributedSampler and all_reduce), ``strategy.reduce`` of integers and a script's second Trainer under NxDStrategy as
under Lightning's DDPStrategy(gloo), on 2 CPU ranks (issue 33, items 4, 5, 8) — the runs are in
tests/lightning_conformance_dist.py, started as a user's script is (``python script.py``: Lightning's own launcher
starts rank 1, and every NxDStrategy run after the first is a new Trainer in the same script).

Tolerance: rtol 1e-5, atol 1e-7 (elements near zero). Both strategies run the same fp32 operations on the same data:
BatchNorm's forward on the same batch and buffers, a 2-rank gradient average (exact: halving is exact, the sum rounds
once), SGD with momentum, and the metrics' sums over 2 ranks. Measured: plain and ZeRO-1 bit for bit (0.0), since
rank 1 runs with DDP's intra-op thread count (Lightning's launcher sets it; before, rank 1 kept every core's threads
and the matmuls' sums rounded differently: ≤ 4.5e-7). FSDP ≤ 6.5e-7 relative: it reduce-scatters each micro-batch's
gradient in backward, (a1+b1)/2 + (a2+b2)/2, where DDP averages the accumulated ((a1+a2)+(b1+b2))/2 — a few fp32
ulps (6e-8) per step carried by momentum over 12 micro-batches; a buffer not broadcast moves rank 1's running mean by 600% and val_loss by 11%. ``sync_batchnorm`` is compared with one process normalising each
global batch at once (DDP cannot: torch's SyncBatchNorm refuses CPU tensors): the statistics are summed per rank and
then over ranks instead of in one pass, ≤ a few fp32 ulps (1e-7 relative) per statistic, which 12 micro-batches of
SGD carry to ≤ 1.2e-6 relative in losses, statistics and weights (measured); a missing sync changes them by percent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
RTOL, ATOL = 1e-5, 1e-7
NXDT = ("nxdt", "nxdt_zero1", "nxdt_fsdp")
LAUNCH_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("conformance_dist")
    # a user's shell: no launcher's variables (Lightning's launcher then starts rank 1 itself)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("TORCHELASTIC_")}
    result = subprocess.run(
        [sys.executable, str(HERE / "lightning_conformance_dist.py"), str(out)],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=580,
        env={**env, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _flat(value):
    """``val`` (one dict of logged metrics per validation) as one list of numbers; other values as they are."""
    return [x for e in value for x in e.values()] if isinstance(value, list) and value and isinstance(value[0], dict) else value


def _same(got: dict, want: dict, keys: tuple[str, ...]) -> None:
    assert "error" not in got, got.get("error")
    for key in keys:
        assert _flat(got[key]) == pytest.approx(_flat(want[key]), rel=RTOL, abs=ATOL), key


@pytest.mark.parametrize("run", NXDT)
def test_batchnorm_buffers_are_broadcast_as_ddp_does(reports, run):
    """DDP broadcasts rank 0's buffers before each forward that follows a reduced training forward: rank 1's running
    statistics, val_loss and the torchmetrics values equal DDP's on each rank. Each NxDStrategy run after the first
    is a new Trainer in the same script, after ``strategy.close()`` (it used to fail: "Address already in use")."""
    for rep in reports:
        _same(rep[run], rep["ddp"], ("losses", "val", "train_mse", "running_mean", "running_var", "num_batches_tracked"))
        # Lightning's launcher gives every process cpus // processes intra-op threads, rank 1 (started by it) too
        assert rep[run]["threads"] == rep["ddp"]["threads"], (run, rep[run]["threads"], rep["ddp"]["threads"])
    # what the broadcast decides: without it rank 1 keeps its own statistics (the same without it under both)
    assert reports[1]["ddp_no_broadcast"]["running_mean"] != pytest.approx(reports[1]["ddp"]["running_mean"], rel=1e-3)
    for rep in reports:
        _same(rep["nxdt_no_broadcast"], rep["ddp_no_broadcast"], ("losses", "val", "running_mean", "running_var"))


def test_third_party_code_finds_torch_distributed(reports):
    """torchmetrics syncs its states over torch.distributed, a DistributedSampler() takes its rank from it, a user's
    all_reduce sums over it: initialised in every step, as under DDP. After fit the group is still there, as DDP's
    (DDPStrategy.teardown leaves it): a user's all_reduce after ``trainer.fit`` works (it used to find no group);
    ``strategy.close()`` destroys it."""
    for rank, rep in enumerate(reports):
        for run in (*NXDT, "ddp"):
            got = rep[run]
            assert got["dist_initialized"] and all(got["dist_initialized"]), run
            assert got["all_reduce"] == 3.0, run  # 1 + 2
            assert got["after_teardown"] is True and got["all_reduce_after_fit"] == 3.0, run
        for run in NXDT:
            assert rep[run]["after_close"] is False, run
    # the metric is the global one: the same value on both ranks (each rank's own data would give two)
    assert reports[0]["nxdt"]["val"] == reports[1]["nxdt"]["val"]
    assert reports[0]["nxdt"]["train_mse"] == reports[1]["nxdt"]["train_mse"]


def test_integer_mean_keeps_ddps_dtype(reports):
    """``strategy.reduce(int64 tensor, "mean")``: (3 + 6) / 2 truncated, int64, as Lightning's _sync_ddp over gloo,
    and reduced in place (the tensor passed is the one returned, holding the result), as DDP's (it returned a copy)."""
    for rep in reports:
        assert (rep["ddp"]["int_mean"], rep["ddp"]["int_mean_dtype"]) == ([4], "torch.int64")
        assert rep["ddp"]["reduced_in_place"] is True
        for run in NXDT:
            assert (rep[run]["int_mean"], rep[run]["int_mean_dtype"]) == ([4], "torch.int64"), run
            assert rep[run]["reduced_in_place"] is True, run


def test_nxdt_after_ddp_in_one_script_trains_as_in_a_fresh_process(reports):
    """A DDPStrategy fit earlier in the script left its torch.distributed group and its store on MASTER_PORT: the next
    NxDStrategy joins through that store (it used to fail: the port in use) and trains exactly as the script's first,
    fresh NxDStrategy run; DDP's group is still there afterwards, the same group (nxdt destroys only the group it made).
    DDP after NxD (after ``strategy.close()``) is the ``ddp`` run itself, equal to the NxDStrategy runs above."""
    for rep in reports:
        got = rep["nxdt_after_ddp"]
        assert "error" not in got, got.get("error")
        _same(got, rep["nxdt"], ("losses", "val", "train_mse", "running_mean", "running_var"))
        for name, values in rep["nxdt"]["weights"].items():
            assert got["weights"][name] == pytest.approx(values, rel=RTOL, abs=ATOL), name
        assert got["after_teardown"] is True and got["group_kept"] is True
        assert got["all_reduce"] == 3.0  # the user's all_reduce runs over DDP's group


@pytest.mark.parametrize("run", ["nxdt_sync_bn", "nxdt_zero1_sync_bn"])
def test_sync_batchnorm_normalises_over_the_global_batch(reports, run):
    """``Trainer(sync_batchnorm=True)``: each rank's loss pair averages to the loss of one process normalising both
    ranks' samples in one BatchNorm; running statistics and weights equal that process's, on both ranks. DDP on CPU
    cannot run it (torch's SyncBatchNorm refuses CPU tensors: recorded below)."""
    from lightning_conformance_dist import full_batch_reference

    want = full_batch_reference()
    for rep in reports:
        got = rep[run]
        assert "error" not in got, got.get("error")
        assert got["bn_class"] == "BatchNorm1d"  # reverted after fit, as DDP reverts torch's
        for key in ("running_mean", "running_var", "num_batches_tracked"):
            assert got[key] == pytest.approx(want[key], rel=RTOL, abs=ATOL), key
        for name, values in want["weights"].items():
            assert got["weights"][name] == pytest.approx(values, rel=RTOL, abs=ATOL), name
    pairs = [(a + b) / 2 for a, b in zip(reports[0][run]["losses"], reports[1][run]["losses"])]
    assert pairs == pytest.approx(want["losses"], rel=RTOL)
    assert "SyncBatchNorm layers only work with GPU modules" in reports[0]["ddp_sync_bn"]["error"]


def test_sync_batchnorm_with_fsdp_is_refused_by_name(reports):
    """``sync_batchnorm=True`` with ``fsdp=True``: refused at setup on both ranks, naming both and the alternatives (it
    used to fail after fit with "cannot assign 'torch.FloatTensor' as parameter 'weight'": the layers' revert)."""
    for rep in reports:
        error = rep["nxdt_fsdp_sync_bn"]["error"]
        assert error.startswith("NotImplementedError: NxDStrategy(fsdp=True) with Trainer(sync_batchnorm=True)"), error
        assert "use zero1=True" in error and "\n" not in error


def test_two_nodes_on_one_host_are_named_with_the_fix(reports):
    """``num_nodes=2`` with no second node: ranks 2, 3 never join; the error names node 1 and NODE_RANK, and no
    longer blames LOCAL_RANK (which Lightning's launcher set itself). Rank 1 started later, so its deadline is later:
    when rank 0 has given up and closed the store first, rank 1 says that in one line instead of "Failed to recv"."""
    for rank, rep in enumerate(reports):
        error = rep["two_nodes"]["error"]
        if rank > 0 and "the rank serving the rendezvous store stopped" in error:
            continue  # rank 0 (serving the store) gave up first, with the full message checked below
        assert "rank(s) [2, 3] never joined" in error and "node(s) [1]" in error and "NODE_RANK" in error, error
        assert "LOCAL_RANK=" not in error, error


@pytest.mark.timeout(60)
def test_ddp_options_are_accepted_and_bad_values_refused_by_name():
    """A script written for DDPStrategy passes DDP's options: accepted (broadcast_buffers honoured, the others without
    effect, see NxDStrategy's docstring); a value of the wrong kind is one line naming the option."""
    from nxdt.lightning import NxDStrategy

    NxDStrategy(
        find_unused_parameters=True,
        static_graph=True,
        process_group_backend="gloo",
        gradient_as_bucket_view=True,
        bucket_cap_mb=25,
        broadcast_buffers=False,
    )
    for kwargs, fragment in (
        ({"process_group_backend": "nccl"}, "NxDStrategy(process_group_backend='nccl'): "),
        ({"static_graph": "yes"}, "NxDStrategy(static_graph='yes'): must be True or False"),
        ({"bucket_cap_mb": 0}, "NxDStrategy(bucket_cap_mb=0): must be a positive number"),
    ):
        with pytest.raises(ValueError) as failure:
            NxDStrategy(**kwargs)
        assert str(failure.value).startswith(fragment) and "\n" not in str(failure.value)


@pytest.mark.timeout(60)
def test_torch_distributed_rendezvous_values_are_signed():
    """The gloo group's rendezvous goes through the run's store, signed with the run's secret: a value written
    without it (another local process) is refused, never handed to gloo as a peer's address."""
    import torch.distributed as dist

    from nxdt.comm.store import SignedKeys, SignedStore, StoreForgeryError

    raw = dist.HashStore()
    store = SignedStore(SignedKeys(raw, b"s" * 32, 0.2))
    store.set("rank_0", b"127.0.0.1:1234")
    assert store.get("rank_0") == b"127.0.0.1:1234"
    assert raw.get("rank_0") != b"127.0.0.1:1234"  # stored with its tag
    raw.set("rank_1", b"10.0.0.66:4444")
    with pytest.raises(StoreForgeryError, match="'rank_1' held only values not signed"):
        store.get("rank_1")
