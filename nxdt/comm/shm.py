"""Shared-memory channels: the ``shm`` transport for ranks on one host.

A channel connects the members of a group on one stream. Each member owns one segment
``/dev/shm/nxdt-<run>-<group>-<stream>-r<rank>`` (mode 0600, created by its owner, so there is no
creation race) holding a header of flags and two data slots (double buffering).

Every collective is a sequence of *steps* (one chunk each) numbered ``s`` per channel. A step has
three milestones a member announces in its ``progress`` word, ``3s+1`` published (my slot holds my
data), ``3s+2`` reduced (my slot holds my reduced slice; only two-phase all-reduce uses it) and
``3s+3`` done (I finished reading everybody's slot). A member writes slot ``s % 2`` only after every
peer is done with step ``s-2``, so no trailing barrier is needed. Each step's fingerprint
(op, dtype, count, root) is written next to the data and compared by every member, so calls that
differ across ranks fail on every rank with the same clear error instead of hanging or corrupting.

On x86 (TSO) a store of the progress word cannot overtake the data stores before it, so readers
that see the flag also see the data.
"""

from __future__ import annotations

import glob
import mmap
import os
import time
from typing import Sequence

import numpy as np
import torch

from nxdt.comm.errors import CommMismatchError, CommTimeoutError, PeerDiedError
from nxdt.comm.waiting import pid_alive, wait_until

SHM_DIR = "/dev/shm"
PREFIX = "nxdt-"
HEADER_BYTES = 4096
MAGIC = 0x6E786474  # "nxdt"
DEFAULT_SLOT_BYTES = 1 << 20

# header words (int64)
W_MAGIC, W_PID, W_PROGRESS, W_SLOT_BYTES = 0, 1, 2, 3
W_FP_WORD = 4  # two words: a digest of each slot's fingerprint, compared on the hot path
W_FINGERPRINT = 8  # two fingerprints (one per slot) of FP_WORDS words each, for error messages
FP_WORDS = 6


def segment_path(run_id: str, group: str, stream: str, rank: int) -> str:
    return os.path.join(SHM_DIR, f"{PREFIX}{run_id}-{group}-{stream}-r{rank}")


class Segment:
    """One member's mapped segment: header words and a byte view of the two slots."""

    def __init__(self, path: str, slot_bytes: int, create: bool) -> None:
        self.path = path
        size = HEADER_BYTES + 2 * slot_bytes
        if create:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
        else:
            fd = os.open(path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.header = np.frombuffer(self.mm, dtype=np.int64, count=HEADER_BYTES // 8)
        self.data = torch.frombuffer(self.mm, dtype=torch.uint8, offset=HEADER_BYTES, count=2 * slot_bytes)
        self.slot_bytes = slot_bytes
        if create:
            self.header[W_PID] = os.getpid()
            self.header[W_SLOT_BYTES] = slot_bytes
            self.header[W_PROGRESS] = 0
            self.header[W_MAGIC] = MAGIC  # last: a peer opening us waits for it

    def slot(self, step: int) -> torch.Tensor:
        start = (step % 2) * self.slot_bytes
        return self.data[start:start + self.slot_bytes]

    def close(self) -> None:
        self.header = None
        self.data = None
        try:
            self.mm.close()
        except BufferError:  # a tensor view is still alive somewhere; the mapping goes with the process
            pass


def _try_open(path: str, slot_bytes: int) -> Segment | None:
    try:
        if os.path.getsize(path) >= HEADER_BYTES + 2 * slot_bytes:
            seg = Segment(path, slot_bytes, create=False)
            if seg.header[W_MAGIC] == MAGIC:
                return seg
            seg.close()
    except FileNotFoundError:
        pass
    return None


class ShmChannel:
    """Steps of one group on one stream over shared memory (see the module docstring)."""

    def __init__(self, run_id: str, group: str, stream: str, ranks: Sequence[int], my_index: int,
                 timeout_s: float, slot_bytes: int = DEFAULT_SLOT_BYTES, first_op: str = "a collective") -> None:
        self.group, self.stream, self.ranks, self.me = group, stream, list(ranks), my_index
        self.timeout_s = timeout_s
        self.slot_bytes = slot_bytes
        self.step = 0
        self.op_desc = "setup"
        deadline = time.monotonic() + timeout_s
        self.own = Segment(segment_path(run_id, group, stream, self.ranks[my_index]), slot_bytes, create=True)
        # Peers create their segments when they first use this group on this stream.
        opened: dict[int, Segment] = {my_index: self.own}
        while len(opened) < len(self.ranks):
            for i, rank in enumerate(self.ranks):
                if i not in opened:
                    seg = _try_open(segment_path(run_id, group, stream, rank), slot_bytes)
                    if seg is not None:
                        opened[i] = seg
            if len(opened) < len(self.ranks):
                if time.monotonic() > deadline:
                    missing = [r for i, r in enumerate(self.ranks) if i not in opened]
                    for i, seg in opened.items():
                        if i != my_index:
                            seg.close()
                    self.close_own()
                    raise CommTimeoutError(
                        f"nxdt.comm: group '{group}' {first_op} (first use of stream '{stream}') timed out after {timeout_s:g}s "
                        f"waiting for rank(s) {missing} to join — they crashed, hung, or called a different collective")
                time.sleep(0.0005)
        self.segments = [opened[i] for i in range(len(self.ranks))]
        self.peers = [i for i in range(len(self.ranks)) if i != my_index]
        self._typed: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self._fp: tuple | None = None
        self._fp_digest = 0

    @property
    def size(self) -> int:
        return len(self.ranks)

    # -------------------------------------------------------------------------------- waiting
    def _wait(self, members: Sequence[int], milestone: int, what: str) -> None:
        headers = [self.segments[i].header for i in members]

        def ready() -> bool:
            for h in headers:
                if h[W_PROGRESS] < milestone:
                    return False
            return True

        def missing() -> list[int]:
            return [self.ranks[i] for i, h in zip(members, headers) if h[W_PROGRESS] < milestone]

        def timeout() -> Exception:
            return CommTimeoutError(
                f"nxdt.comm: group '{self.group}' {self.op_desc} (step {self.step}, stream '{self.stream}') timed out after "
                f"{self.timeout_s:g}s waiting for {what} of rank(s) {missing()} — they crashed, hung, or called a different collective")

        def health() -> None:
            for rank, i in zip(missing(), [i for i, h in zip(members, headers) if h[W_PROGRESS] < milestone]):
                pid = int(self.segments[i].header[W_PID])
                if pid and not pid_alive(pid):
                    raise PeerDiedError(f"nxdt.comm: group '{self.group}' {self.op_desc} (step {self.step}): rank {rank} "
                                        f"(pid {pid}) exited while the others waited for it")

        wait_until(ready, time.monotonic() + self.timeout_s, timeout, health)

    # -------------------------------------------------------------------------------- one step
    def begin(self, fingerprint: tuple[int, ...], op_desc: str) -> torch.Tensor:
        """Start step ``self.step``: wait until my slot is free, record my fingerprint, return my slot."""
        self.op_desc = op_desc
        s = self.step
        if s >= 2:
            self._wait(self.peers, 3 * (s - 2) + 3, "completion of an earlier step")
        if fingerprint != self._fp:  # consecutive chunks of one op share it: compute the digest once
            self._fp = fingerprint
            digest = 0
            for x in fingerprint:
                digest = (digest * 1_000_003 + int(x) + 1) & 0x3FFFFFFFFFFFFFFF
            self._fp_digest = digest
        base = W_FINGERPRINT + (s % 2) * FP_WORDS
        self.own.header[base:base + FP_WORDS] = (s, *fingerprint, *([0] * (FP_WORDS - 1 - len(fingerprint))))
        self.own.header[W_FP_WORD + s % 2] = (self._fp_digest + s) & 0x3FFFFFFFFFFFFFFF
        return self.own.slot(s)

    def typed(self, member: int, dtype: torch.dtype) -> torch.Tensor:
        """The current step's slot of ``member`` as a flat tensor of ``dtype`` (views cached: they are hot)."""
        key = (member, self.step % 2, dtype)
        view = self._typed.get(key)
        if view is None:
            view = self._typed[key] = self.segments[member].slot(self.step).view(dtype)
        return view

    def publish(self) -> None:
        self.own.header[W_PROGRESS] = 3 * self.step + 1

    def wait_published(self, members: Sequence[int] | None = None) -> None:
        members = self.peers if members is None else members
        self._wait(members, 3 * self.step + 1, "the data")
        self._check_fingerprints(members)

    def _check_fingerprints(self, members: Sequence[int]) -> None:
        word = W_FP_WORD + self.step % 2
        mine = self.own.header[word]
        for i in members:
            if self.segments[i].header[word] != mine:
                self._raise_mismatch(members)

    def _raise_mismatch(self, members: Sequence[int]) -> None:
        base = W_FINGERPRINT + (self.step % 2) * FP_WORDS
        mine = tuple(int(x) for x in self.own.header[base:base + FP_WORDS])
        for i in members:
            theirs = tuple(int(x) for x in self.segments[i].header[base:base + FP_WORDS])
            if theirs != mine:
                raise CommMismatchError(
                    f"nxdt.comm: group '{self.group}' step {self.step}: rank {self.ranks[self.me]} called {self.op_desc} "
                    f"{describe_fingerprint(mine)} but rank {self.ranks[i]} called {describe_fingerprint(theirs)} — "
                    f"every member must issue the same collectives with the same op, dtype, count and root, in the same order")

    def mark_reduced(self) -> None:
        self.own.header[W_PROGRESS] = 3 * self.step + 2

    def wait_reduced(self) -> None:
        self._wait(self.peers, 3 * self.step + 2, "the reduced slice")

    def finish(self) -> None:
        self.own.header[W_PROGRESS] = 3 * self.step + 3
        self.step += 1

    def slot_of(self, member: int) -> torch.Tensor:
        return self.segments[member].slot(self.step)

    def close(self) -> None:
        self._typed.clear()
        for seg in self.segments:
            if seg is not self.own:
                seg.close()
        self.close_own()

    def close_own(self) -> None:
        self.own.close()
        try:
            os.unlink(self.own.path)
        except FileNotFoundError:
            pass


OP_NAMES = ["?", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "send_recv", "barrier", "all_to_all_sizes"]


def describe_fingerprint(fp: tuple[int, ...]) -> str:
    _, op, dtype, count, root, _ = (tuple(fp) + (0,) * 6)[:6]
    from nxdt.comm.reduce import DTYPES, REDUCE_OPS  # local: avoids an import cycle at module load

    dtype_name = str(DTYPES[dtype - 1]).replace("torch.", "") if 0 < dtype <= len(DTYPES) else "?"
    op_name = OP_NAMES[op % 100] if 0 <= op % 100 < len(OP_NAMES) else "?"
    red = REDUCE_OPS[op // 100 - 1] if op >= 100 and op // 100 - 1 < len(REDUCE_OPS) else None
    return f"{op_name}({'op=' + red + ', ' if red else ''}dtype={dtype_name}, count={count}, root={root})"


def remove_segments(pattern: str) -> int:
    removed = 0
    for path in glob.glob(os.path.join(SHM_DIR, pattern)):
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def cleanup_run(run_id: str) -> int:
    """Remove every segment of a run (the launcher calls this after its workers exit)."""
    return remove_segments(f"{PREFIX}{run_id[:24]}.*")


def remove_stale_segments() -> int:
    """Remove segments whose creating process is gone (left behind by a crashed run)."""
    removed = 0
    for path in glob.glob(os.path.join(SHM_DIR, PREFIX + "*")):
        try:
            with open(path, "rb") as fh:
                words = np.frombuffer(fh.read(16), dtype=np.int64)
            if len(words) == 2 and words[0] == MAGIC and not pid_alive(int(words[1])):
                os.unlink(path)
                removed += 1
        except (FileNotFoundError, PermissionError, ValueError):
            continue
    return removed
