"""/dev/shm is listed and written by every local user (issue 38): a run's segments are created exclusively under
names nobody can predict, and a peer's segment is used only if it is a private file of the run's own user — a name
taken first by someone else, a link or a FIFO under the prefix is refused with one line, never mapped or waited on."""

from __future__ import annotations

import os
import stat
import time

import numpy as np
import pytest
from shared_runs import NOBODY, as_other_user

from nxdt.comm import CommError
from nxdt.comm.heap import Heap
from nxdt.comm.shm import HEADER_BYTES, MAGIC, PREFIX, SHM_DIR, SegmentNames, ShmChannel, cleanup_run, remove_stale_segments

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="creating a file as another user needs root (setuid)")


def _as_other_user(fn) -> None:
    """Run ``fn`` in a child process that has become another user (nobody); it must return normally."""
    assert as_other_user(lambda: (fn(), 0)[1]) == 0


def _squat(path: str, size: int) -> None:
    """What an attacker plants: a segment-sized file, readable and writable by all, with the magic word set."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)
    os.fchmod(fd, 0o666)
    os.ftruncate(fd, size)
    os.pwrite(fd, np.array([MAGIC, os.getpid()], dtype=np.int64).tobytes(), 0)
    os.close(fd)


@pytest.fixture
def names():
    run = f"tsq{os.getpid()}"
    yield SegmentNames(f"{run}.abcd1234", os.urandom(32))
    cleanup_run(run)  # the run's own, if a test made any
    for path in os.listdir(SHM_DIR):  # what the tests planted as nobody (root removes it)
        if path.startswith(f"{PREFIX}{run}"):
            os.unlink(os.path.join(SHM_DIR, path))


def test_segment_names_show_the_run_but_cannot_be_predicted_without_its_key(names):
    path = names.path("world", "default", 0)
    name = os.path.basename(path)
    assert name.startswith(f"{PREFIX}{names.run_id}-")
    assert "world" not in name and "default" not in name  # the group, stream and rank are not readable
    # the next segments of the run differ from it, and the same names under another key differ from all of them
    later = {names.path("world", "default", 1), names.path("dp0", "dp", 0), names.path("heap", "2", 0)}
    other = SegmentNames(names.run_id, os.urandom(32))
    assert path not in later and len(later) == 3
    assert not {other.path("world", "default", 0), *(other.path("dp0", "dp", r) for r in (0, 1))} & (later | {path})


@as_root
def test_a_name_another_user_took_first_is_refused_not_used(names):
    """The creator meets the planted file: one line naming it, nothing of it mapped. A peer that would open a
    planted file (a name taken before its owner made it) refuses it too."""
    size = HEADER_BYTES + 2 * 4096
    mine = names.path("g", "s", 0)
    _as_other_user(lambda: _squat(mine, size))
    with pytest.raises(CommError, match=f"segment {mine} exists already \\(uid {NOBODY}\\).*refused"):
        ShmChannel(names, "g", "s", [0, 1], 0, timeout_s=2, slot_bytes=4096)
    os.unlink(mine)
    peer = names.path("g", "s", 1)
    _as_other_user(lambda: _squat(peer, size))
    start = time.monotonic()
    with pytest.raises(CommError, match=f"segment {peer} is not this run's \\(owner uid {NOBODY}"):
        ShmChannel(names, "g", "s", [0, 1], 0, timeout_s=5, slot_bytes=4096)
    assert time.monotonic() - start < 3  # refused at once, not waited on until the deadline
    assert not os.path.exists(mine)  # the channel removed its own segment on the way out


@as_root
def test_another_user_cannot_open_a_runs_segment(names):
    heap = Heap(names, 0)
    tensor = heap.empty((4,))
    tensor.fill_(1.0)
    (path,) = [p for p in (os.path.join(SHM_DIR, n) for n in os.listdir(SHM_DIR)) if p.startswith(names.path("", "", "")[:-24])]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600

    def read() -> None:
        try:
            os.open(path, os.O_RDONLY)
        except PermissionError:
            return
        raise AssertionError("another user opened the run's segment")

    _as_other_user(read)
    heap.close()


def test_a_link_or_an_open_file_of_this_user_is_refused_as_a_peer(names, tmp_path):
    """Same user, but not a segment the run made: a symlink (to any file) and a file others may open."""
    target = tmp_path / "elsewhere"
    target.write_bytes(b"\0" * (HEADER_BYTES + 2 * 4096))
    peer = names.path("g", "s", 1)
    os.symlink(target, peer)
    with pytest.raises(CommError, match=f"cannot open the shared-memory segment {peer}"):
        ShmChannel(names, "g", "s", [0, 1], 0, timeout_s=5, slot_bytes=4096)
    os.unlink(peer)
    _squat(peer, HEADER_BYTES + 2 * 4096)
    with pytest.raises(CommError, match="is not this run's .*mode -rw-rw-rw-"):
        ShmChannel(names, "g", "s", [0, 1], 0, timeout_s=5, slot_bytes=4096)


def test_the_stale_sweep_and_the_cleanup_skip_what_is_not_the_users_segment(names):
    """A FIFO under the prefix used to hang the sweep every rank 0 runs at start (it opened it for reading);
    a file of another user made the launcher's cleanup raise (sticky /dev/shm: not ours to remove)."""
    fifo = os.path.join(SHM_DIR, f"{PREFIX}{names.run_id}-fifo")
    os.mkfifo(fifo, 0o600)
    start = time.monotonic()
    remove_stale_segments()
    assert time.monotonic() - start < 10 and os.path.exists(fifo)
    if os.geteuid() == 0:
        foreign = os.path.join(SHM_DIR, f"{PREFIX}{names.run_id}-foreign")
        _as_other_user(lambda: _squat(foreign, 64))
        cleanup_run(names.run_id.split(".")[0])  # the launcher's call: removes ours (the FIFO), leaves nobody's
        assert not os.path.exists(fifo) and os.path.exists(foreign)
