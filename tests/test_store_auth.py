"""The run's rendezvous store against other local processes (issue 38). A local run's store is a private file
(torch ``FileStore``, 0600, in the 0700 run directory; ``nxdt.comm.store.create_file_store``): nothing listens, so
another user has nothing to connect to and cannot open the file. Where a TCP store remains (several hosts, a script
under torchrun) any local process can connect, but nothing it writes is acted on — every value nxdt
reads back is signed with the launch's secret (HMAC-SHA256, ``SignedKeys``), and the checkpoint a restarted rank
resumes from is a ``step-<N>`` directory of the run's own ``checkpoints/``."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from nxdt.comm import CommTimeoutError
from nxdt.comm.store import (
    LOOPBACK,
    SECRET_ENV,
    STORE_FILE_ENV,
    SignedKeys,
    StoreAccessError,
    StoreForgeryError,
    connect_store,
    create_file_store,
    new_secret,
    open_file_store,
    serve_store,
)
from nxdt.launch.rundir import STORE_FILE, STORE_SECRET_FILE, StoreSecretError, read_store_secret, write_store_secret
from nxdt.lightning import checkpoint as ckpt_io
from nxdt.lightning.exp_manager import agreed_resume_checkpoint
from shared_runs import NOBODY, RELIABILITY, as_other_user, opens, processes_left, run_segments, start_train, wait_training
from test_train_e2e import assert_ok, losses


@pytest.fixture
def store():
    server = serve_store(LOOPBACK, 0, None, timedelta(seconds=10))
    yield server
    del server


def _intruder(server: dist.TCPStore) -> dist.TCPStore:
    """Another local process: it found the port, it has no secret."""
    return dist.TCPStore(LOOPBACK, server.port, is_master=False, timeout=timedelta(seconds=5))


def test_a_value_without_the_runs_secret_is_never_returned(store):
    secret = new_secret()
    keys = SignedKeys(store, secret, timeout_s=5)
    intruder = _intruder(store)
    intruder.set("nxdt/x", b"forged")  # before the writer: the reader waits past it for the genuine value
    writer = threading.Timer(0.3, keys.set, ("nxdt/x", "genuine"))
    writer.start()
    assert keys.get("nxdt/x") == b"genuine"
    writer.join()
    # a genuine value copied to another key, or signed with another run's secret, is no value either
    intruder.set("nxdt/y", store.get("nxdt/x"))
    with pytest.raises(StoreForgeryError, match="'nxdt/y' held only values not signed with this run's secret"):
        keys.get("nxdt/y", timeout_s=0.3)
    SignedKeys(store, new_secret(), 5).set("nxdt/z", "other run")
    with pytest.raises(StoreForgeryError):
        keys.get("nxdt/z", timeout_s=0.3)
    with pytest.raises(CommTimeoutError, match="no value for 'nxdt/never'"):
        keys.get("nxdt/never", timeout_s=0.2)


def _run_with_checkpoints(tmp_path: Path, steps: tuple[int, ...]) -> Path:
    run = tmp_path / "run"
    for step in steps:
        ckpt_io.save(
            {"state_dict": {"w": torch.full((2,), float(step))}, "global_step": step}, run / "checkpoints" / f"step-{step}"
        )
    return run


def _cfg() -> SimpleNamespace:
    return SimpleNamespace(
        exp_manager=SimpleNamespace(resume_from_checkpoint=None, resume_if_exists=False),
        model=SimpleNamespace(weight_init_only=False),
        comm=SimpleNamespace(timeout_s=5.0),
    )


def _rank_env(store: dist.TCPStore, rank: int, secret: bytes) -> dict[str, str]:
    """A restarted worker's environment (attempt 1) under nxdt's local agent."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": "xrun",
        "TORCHELASTIC_RESTART_COUNT": "1",
        SECRET_ENV: secret.hex(),
    }


def test_a_planted_resume_key_redirects_no_rank(tmp_path, store):
    """The attack measured on main: set ``nxdt/resume/<run_id>/1`` before the restarted ranks read it. Rank 1 then
    resumed from the checkpoint the intruder chose (or waited 120 s for one). Now it resumes from rank 0's choice."""
    run = _run_with_checkpoints(tmp_path, (2, 4))
    elsewhere = _run_with_checkpoints(tmp_path / "intruder", (9,)) / "checkpoints" / "step-9"
    secret = new_secret()
    intruder = _intruder(store)
    for planted in (str(elsewhere).encode(), b"step-2"):  # another directory, and this run's older checkpoint
        intruder.set("xrun/nxdt/resume/xrun/1", planted)
        intruder.set("nxdt/resume/xrun/1", planted)
        result: dict[str, object] = {}
        rank1 = threading.Thread(
            target=lambda: result.update(got=agreed_resume_checkpoint(_cfg(), run, env=_rank_env(store, 1, secret)))
        )
        rank1.start()  # reads first: only the forged value is there
        time.sleep(0.3)
        assert rank1.is_alive(), "rank 1 acted on the planted value"
        chosen = agreed_resume_checkpoint(_cfg(), run, env=_rank_env(store, 0, secret))
        rank1.join(timeout=10)
        assert chosen == run / "checkpoints" / "step-4" and result["got"] == chosen


def test_a_resume_name_from_the_store_must_be_a_checkpoint_of_this_run(tmp_path, store):
    """Even a signed value only names a ``step-<N>`` directory of the run's ``checkpoints/``: no path from the
    store reaches outside the run."""
    run = _run_with_checkpoints(tmp_path, (2,))
    secret = new_secret()
    for name in ("../../elsewhere/step-9", str(tmp_path / "elsewhere"), "step-7"):
        SignedKeys(store, secret, 5).set("nxdt/resume/xrun/1", name)
        with pytest.raises(ckpt_io.CheckpointError, match="is not a step-<N> directory of"):
            agreed_resume_checkpoint(_cfg(), run, env=_rank_env(store, 1, secret))


def test_the_secret_file_is_private_and_never_read_through_a_link(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    secret = new_secret()
    path = write_store_secret(run, secret)
    assert path.stat().st_mode & 0o777 == 0o600 and read_store_secret(run) == secret
    path.unlink()
    assert read_store_secret(run) is None
    target = tmp_path / "planted"
    target.write_text(new_secret().hex())
    target.chmod(0o600)
    (run / STORE_SECRET_FILE).symlink_to(target)
    with pytest.raises(StoreSecretError):
        read_store_secret(run)
    write_store_secret(run, secret)  # replaces the link, never writes through it
    assert not (run / STORE_SECRET_FILE).is_symlink() and target.read_text() != secret.hex()
    os.chmod(run / STORE_SECRET_FILE, 0o644)
    with pytest.raises(StoreSecretError, match="not a private file"):
        read_store_secret(run)


# ----------------------------------------------------------------------------- a local run's store: a private file
def test_a_local_store_is_a_private_file_that_serves_every_store_operation(tmp_path):
    """What the agent (rank assignment, exit barrier), nxdt's bootstrap and a gloo group ask of the store, through
    the path the workers are given (``NXDT_STORE_FILE``)."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    server = create_file_store(run / STORE_FILE, timedelta(seconds=5))
    assert (run / STORE_FILE).stat().st_mode & 0o777 == 0o600
    client = connect_store("127.0.0.1", 0, timedelta(seconds=5), {STORE_FILE_ENV: str(run / STORE_FILE)})
    assert isinstance(client, dist.FileStore)
    keys = SignedKeys(dist.PrefixStore("nxdt/", client), new_secret(), 5)
    keys.set("a", "1")
    assert keys.get("a") == b"1"
    assert client.add("n", 2) == 2 and server.add("n", 3) == 5
    assert client.compare_set("c", b"", b"x") == b"x" and server.get("c") == b"x"
    server.multi_set(["m1", "m2"], [b"1", b"2"])
    assert client.multi_get(["m1", "m2"]) == [b"1", b"2"]
    assert client.delete_key("c") and not server.check(["c"])
    with pytest.raises(CommTimeoutError, match="no value for 'never'"):
        keys.get("never", timeout_s=0.2)  # a FileStore's timeout (a plain RuntimeError) reads as nxdt's


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root (setuid)")
def test_another_user_cannot_open_or_replace_a_local_store(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    create_file_store(run / STORE_FILE, timedelta(seconds=5)).set("k", b"v")
    os.chmod(tmp_path, 0o755)  # the run's parent is open to all: the run directory itself keeps them out
    assert as_other_user(lambda: opens(run / STORE_FILE)) == 13
    os.chmod(run, 0o755)  # even with the directory readable, the file is not
    assert as_other_user(lambda: opens(run / STORE_FILE)) == 13
    os.chmod(run, 0o777)  # a directory others may write: they could swap the file, so no store is made or opened there
    with pytest.raises(StoreAccessError, match=r"can be written by other users.*chmod go-w"):
        create_file_store(run / STORE_FILE, timedelta(seconds=5))
    with pytest.raises(StoreAccessError, match=r"can be written by other users"):
        open_file_store(run / STORE_FILE, timedelta(seconds=5))
    os.chmod(run, 0o700)
    os.chown(run / STORE_FILE, NOBODY, NOBODY)  # a store file of another user is never opened
    with pytest.raises(StoreAccessError, match=f"is not a private file of this user .*uid {NOBODY}"):
        open_file_store(run / STORE_FILE, timedelta(seconds=5))


def test_a_store_file_is_made_anew_never_through_a_link_and_opened_only_private(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    target = tmp_path / "planted"
    target.write_bytes(b"")
    (run / STORE_FILE).symlink_to(target)
    create_file_store(run / STORE_FILE, timedelta(seconds=5)).set("k", b"v")
    assert not (run / STORE_FILE).is_symlink() and target.read_bytes() == b""
    (run / STORE_FILE).unlink()
    (run / STORE_FILE).symlink_to(target)
    with pytest.raises(StoreAccessError, match="cannot open the run's store"):
        open_file_store(run / STORE_FILE, timedelta(seconds=5))
    (run / STORE_FILE).unlink()
    create_file_store(run / STORE_FILE, timedelta(seconds=5))
    os.chmod(run / STORE_FILE, 0o644)
    with pytest.raises(StoreAccessError, match="is not a private file of this user"):
        open_file_store(run / STORE_FILE, timedelta(seconds=5))


# ----------------------------------------------------------------------------- a real run, attacked
@pytest.mark.slow
@pytest.mark.timeout(300)  # the shared launches (shared_runs.py) may start here
def test_an_intruder_finds_no_store_in_a_restarting_run_and_changes_nothing(attacked_restart, reliability_reference):
    """The acceptance case of issue 38 on a real run. On main a local process found the store (the port the run
    listened on, the run id in /dev/shm) and planted the resume key of the restart; after the first hardening it
    could still delete or overwrite keys and end the run. Now, while rank 0 is killed in the middle of saving step 10
    (a restart follows), the run's processes listen on no port at all, and another user cannot open the store file.
    The restart resumes both ranks from this run's step-5 and the losses are bitwise the uninterrupted run's — though
    this user's own process wrote forged values into every key the restart reads (shared_runs.py's
    ``attacked_restart``, test_security.py)."""
    run, tree = attacked_restart["run"], attacked_restart["tree"]
    assert len(tree) >= 3, tree  # the launcher and two workers: the check is not vacuous
    assert attacked_restart["listening"] == []  # no TCP store, nothing to connect to
    assert attacked_restart["modes"] == (0o600, 0o700)  # the store file, the run directory
    if os.geteuid() == 0:
        assert attacked_restart["other_user"] == 13
    result = attacked_restart["result"]
    assert_ok(result)
    # a worker failed and the restart resumed from step-5: step-10's save, where rank 0 was killed, never committed
    # (rank 0's own "fault injection" line may die with it in its console tee: a pipe its killed process was draining)
    assert "nxdt: restart 1 of 1 after a worker failed (see logs/agent); resuming from step-5" in result.stdout, result.stdout[
        -2000:
    ]
    assert losses(run) == losses(reliability_reference)
    assert not (run / STORE_SECRET_FILE).exists() and not (run / STORE_FILE).exists()  # they go with the launch


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_launcher_killed_with_sigkill_leaves_no_shared_memory_and_no_store(tmp_path, short_tmpdir):
    """SIGKILL skips the launcher's own cleanup; its watchdog (a detached process blocked on a pipe only the
    launcher holds) removes the run's segments, the store file and its secret once the launcher is gone. On main the
    segments stayed until the next run, and the store and secret until the next launch in that directory. The
    launcher's temporary directory (multiprocessing's, with its fork server's socket: a private TMPDIR here) goes too;
    it was left in /tmp, two a suite run."""
    run, tmp = tmp_path / "run", short_tmpdir
    args = [*RELIABILITY, "trainer.max_steps=100000", f"exp_manager.explicit_log_dir={run}"]
    proc = start_train(args, tmp_path, env={"TMPDIR": str(tmp)})
    try:
        tree, segments = wait_training(proc.pid, run)
        assert (run / STORE_FILE).exists() and (run / STORE_SECRET_FILE).exists() and list(tmp.glob("pymp-*"))
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        deadline = time.monotonic() + 20
        store = [run / STORE_FILE, run / STORE_SECRET_FILE]
        while (left := [p for p in [*segments, *store, *tmp.iterdir()] if p.exists()] + run_segments(tree)) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not left, f"left after the launcher was killed: {[p.name for p in left]}"
    assert not processes_left(run), "a worker or the fork server outlived the launcher"
