"""Secure by default: a local run listens on loopback only, and bytes from another process are never
unpickled (objects between ranks travel as JSON + raw tensor bytes, see ``nxdt.comm.objects``)."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest
import torch

from nxdt.comm.objects import ObjectCodecError, decode, encode
from shared_runs import RunsCode, run_train


# ----------------------------------------------------------------------------- the object codec
def test_objects_round_trip_exactly():
    obj = {
        "path": Path("/tmp/x"),
        3: [1.5, float("inf"), (True, None)],
        "big": 2**80,
        "raw": b"\x00\xff",
        "nan": float("nan"),
        "dtype": torch.bfloat16,
        "tensors": [
            torch.arange(6, dtype=torch.float32).reshape(2, 3),
            torch.tensor([1.25, -2.0], dtype=torch.bfloat16),
            torch.empty(0, 4, dtype=torch.int64),
            torch.tensor(True),
        ],
    }
    back = decode(encode(obj))
    assert back["path"] == Path("/tmp/x") and back[3][:2] == [1.5, float("inf")] and back[3][2] == (True, None)
    assert back["big"] == 2**80 and back["raw"] == b"\x00\xff" and math.isnan(back["nan"]) and back["dtype"] is torch.bfloat16
    for got, want in zip(back["tensors"], obj["tensors"]):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_objects_refuse_what_is_not_plain_data_by_name():
    class Custom:
        pass

    with pytest.raises(ObjectCodecError, match="type .*Custom cannot be sent between ranks"):
        encode({"a": [Custom()]})


def test_a_pickled_payload_is_rejected_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(RunsCode(str(marker)))
    for forged in (payload, b"\x10\x00\x00\x00\x00\x00\x00\x00" + payload, encode("ok")[:5]):
        with pytest.raises(ObjectCodecError):
            decode(forged)
    assert not marker.exists()


def _exchange_objects(world) -> list:
    sent = {"step": 7, "w": torch.full((3,), float(world.rank))}
    got = world.world.broadcast_object(sent if world.rank == 1 else None, root=1)
    gathered = world.world.all_gather_object(world.rank * 10)
    return [got["step"], got["w"].tolist(), gathered]


def test_broadcast_object_between_ranks_uses_the_codec():
    from nxdt.comm.spawn import run_local

    for result in run_local(_exchange_objects, 2, timeout_s=60):
        assert result == [7, [1.0, 1.0, 1.0], [0, 10]]


# ----------------------------------------------------------------------------- what a local run listens on
@pytest.mark.slow
@pytest.mark.timeout(300)  # the shared launches may start here
def test_a_local_run_listens_nowhere(everyday_runs):
    """The process tree of a training run (shared_runs.py's stopped run, recorded while it trained, before SIGINT)
    and every TCP socket it listens on: none. Its store is a private file of the run directory (on main: a TCP
    store on loopback, which every local user could connect to)."""
    tree, listening = everyday_runs["stopped_tree"], everyday_runs["stopped_listening"]
    assert len(tree) >= 3, tree  # the launcher, its fork server and the workers
    assert listening == [], f"a local run listens on {listening}"


# ----------------------------------------------------------------------------- writing exports
def test_export_hf_refuses_a_non_empty_target_and_never_writes_through_a_link(tmp_path):
    from nxdt.lightning.checkpoint import CheckpointError
    from nxdt.lightning.hf import export_hf

    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "mine.txt").write_text("keep")
    with pytest.raises(CheckpointError, match="not an empty directory"):
        export_hf(tmp_path / "no-checkpoint-needed", occupied)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="symbolic link"):
        export_hf(tmp_path / "no-checkpoint-needed", link)
    assert list(elsewhere.iterdir()) == [] and (occupied / "mine.txt").read_text() == "keep"


@pytest.mark.slow
@pytest.mark.timeout(300)  # the shared launches (shared_runs.py) may start here
def test_hostile_payloads_in_every_store_key_run_no_code(attacked_restart):
    """A process that can write the run's store (since issue 38 only the run's own user can: a private file) and
    knows its run id (the names in /dev/shm) writes a pickled command into every key nxdt and torch's agent read —
    the running attempt's and those of the restart that follows (shared_runs.py's ``attacked_restart``: rank 0 killed
    while saving step 10), before and during their use. Nothing is unpickled, so the command never runs; the job
    ends cleanly (finished, or one line naming what was wrong)."""
    result = attacked_restart["result"]
    assert not attacked_restart["marker"].exists(), "a pickled payload from the store was executed"
    assert "Traceback" not in result.stderr, result.stderr[
        -3000:
    ]  # torch's agent logs its broken exit barrier to logs/launcher.log
    assert result.returncode == 0 or result.stderr.strip().splitlines()[-1].startswith("nxdt:"), result.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_failed_workers_traceback_is_read_from_the_launchers_own_directory_and_removed(tmp_path, short_tmpdir):
    """torch's ``start_processes`` names a file for each worker's traceback in the temporary directory, unlinks it, and
    unpickles whatever has that name once the worker fails: in a shared ``/tmp`` another user could put one there
    first. The launcher points it into a private directory of its own for the launch (``local.agent_tempdir``), so
    the shared one (a private ``TMPDIR`` here) never holds one — on main two were left after this run — and the
    failure is still reported from it."""
    tmp, run = short_tmpdir, tmp_path / "run"
    fail = ["exp_manager.fault_injection.step=2", "exp_manager.fault_injection.rank=1", "exp_manager.fault_injection.kind=raise"]
    args = ["model=llama_tiny", "data=synthetic", "data.seq_length=64", "trainer.max_steps=3", *fail]
    done = run_train(
        [*args, "exp_manager.save_last=false", f"exp_manager.explicit_log_dir={run}"], tmp_path, {"TMPDIR": str(tmp)}
    )
    assert done.returncode == 1, done.stderr[-2000:]
    failure = [line for line in done.stderr.splitlines() if line.startswith("nxdt: rank 1 failed")]
    assert failure and "InjectedFault: injected fault at step 2 on rank 1" in failure[0], done.stderr[-2000:]
    left = sorted(p.name for p in tmp.iterdir() if p.name != "torchinductor_root")  # the workers' compile cache
    assert left == [], left
