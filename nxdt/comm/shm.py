"""Shared-memory channels: the ``shm`` transport for ranks on one host.

A channel connects the members of a group on one stream. Each member owns one segment
``/dev/shm/nxdt-<run>-<tag>`` (the tag keyed by the run's secret: :class:`SegmentNames`; mode 0600, created
exclusively by its owner, opened by peers only as a private file of their own user: :func:`open_segment_file`) holding a header of flags and two data slots (double buffering).

Every collective is a sequence of *steps* (one chunk each) numbered ``s`` per channel. A step has
three milestones a member announces in its ``progress`` word: ``3s+1`` published (my slot holds my
data), ``3s+2`` reduced (my slot holds my reduced slice; only the slice all-reduce uses it) and
``3s+3`` done (I finished reading everybody's slot). A member writes slot ``s % 2`` only after every
peer is done with step ``s-2``, so no trailing barrier is needed. Each step's fingerprint digest
(op, dtype, count, root) is written next to the flags and compared by every member, so calls that
differ across ranks fail on every rank with the same clear error instead of hanging or corrupting.

Waiting is spin → yield → futex on the progress word (see :mod:`nxdt.comm.waiting`); every store of
a progress word is preceded by a fence. With the native extension (:mod:`nxdt.comm.native`) the waits,
the progress stores and a whole all-reduce step (direct or slice) run in C; the protocol, its words and the errors
are the same, so a native and a torch-fallback rank interoperate. A member about to block in the futex says so in its
``sleep`` word first, and a writer issues the wake syscall only when a peer's ``sleep`` word names
it (fence between the progress store and that read): an uncontended step makes no syscall.
"""

from __future__ import annotations

import glob
import hashlib
import hmac
import mmap
import os
import re
import stat
import threading
import time
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from nxdt.comm import native
from nxdt.comm.errors import CommError, CommMismatchError, CommTimeoutError, PeerDiedError
from nxdt.comm.waiting import DEFAULT_WAIT, SpinBudget, WaitPolicy, fence, pid_alive, wait_word, wake

if TYPE_CHECKING:
    from nxdt.comm.emulate import Pacer
    from nxdt.comm.heap import Heap

SHM_DIR = "/dev/shm"
PREFIX = "nxdt-"
HEADER_BYTES = 4096
MAGIC = 0x6E786474  # "nxdt"
ZERO_COPY_MIN_BYTES = 64 << 10  # 2 ranks, 1 KB all-reduce: 43 µs copied, 61 µs zero-copy (experiments/collectives-cpu)
DEFAULT_SLOT_BYTES = 4 << 20  # a 4 MB message in one step (one synchronisation); pages are committed only when touched

# header words (int64). Words 0 and 1 (magic, creator pid) are what remove_stale_segments reads.
W_MAGIC, W_PID, W_PROGRESS, W_SLOT_BYTES = 0, 1, 2, 3
W_FP_DIGEST = 4  # two words: digest of each slot parity's fingerprint, compared on the hot path
W_SENT, W_ACKED = 6, 7  # mailbox counters (see nxdt.comm.mailbox); spaced from PROGRESS on purpose
W_SLEEP = 10  # 1 + index of the member whose progress word I block on in the kernel, else 0
W_FINGERPRINT = 16  # two fingerprints (one per slot parity) of FP_WORDS words, for error messages
FP_WORDS = 6
W_SOURCE = 32  # per slot parity, two words: where my step's data lies — (0, 0): my slot; (block, byte offset): my
# shared tensor (nxdt.comm.heap), which peers read in place


_MAIN = threading.main_thread()  # may spin longer than a stream thread (nxdt.comm.waiting.policy_for)
_MAIN_ID = _MAIN.ident
get_ident = threading.get_ident  # cheaper than threading.current_thread() on the hot path


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", name)


class SegmentNames:
    """The names of one run's segments: ``nxdt-<run id>-<tag>``, the tag an HMAC-SHA256 (96 bits shown) of the
    segment's group, stream and rank under the run's ``key``. /dev/shm is listed by every local user; with readable
    names (``…-world-default-r0``) anyone could predict — and create first — a segment the run makes later (a stream,
    a heap block, a restart's). A tag is not predictable without the key, which comes from the run's store secret
    (``init_process``). The run id stays readable: the launcher's cleanup and its watchdog find the run's segments
    by it."""

    def __init__(self, run_id: str, key: bytes) -> None:
        self.run_id, self._key = run_id, key

    def path(self, group: str, stream: str, rank: int | str) -> str:
        tag = hmac.new(self._key, f"{group}\0{stream}\0{rank}".encode(), hashlib.sha256).hexdigest()[:24]
        return os.path.join(SHM_DIR, f"{PREFIX}{_safe(self.run_id)}-{tag}")


def create_segment_file(path: str) -> int:
    """A new segment file, exclusively (never one that exists, never through a link), readable by this user only.
    A name taken already — by another process, which could otherwise hand this run memory it controls — is
    refused with one line; nothing of it is used."""
    try:
        return os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        try:
            owner = f"uid {os.lstat(path).st_uid}"
        except OSError:
            owner = "gone again"
        raise CommError(
            f"nxdt.comm: the shared-memory segment {path} exists already ({owner}): another process took a name "
            f"of this run; refused (nothing of it was used) — start the run again"
        ) from None


def open_segment_file(path: str) -> int:
    """A peer's segment file, read/write, only if it is a regular file of this user that nobody else can open
    (so no other user's file — created first under a name of this run — is ever read as a peer's data).
    FileNotFoundError: not created yet."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as exc:  # a link (ELOOP), another user's file (EACCES), ...
        raise CommError(f"nxdt.comm: cannot open the shared-memory segment {path} ({exc.strerror or exc}); refused") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        os.close(fd)
        raise CommError(
            f"nxdt.comm: the shared-memory segment {path} is not this run's (owner uid {info.st_uid}, mode "
            f"{stat.filemode(info.st_mode)}; the run's are private files of uid {os.geteuid()}); refused"
        )
    return fd


class Segment:
    """One mapped segment: header words (numpy int64), their address (for futex) and the two slots."""

    def __init__(self, path: str, slot_bytes: int, create: bool) -> None:
        self.path = path
        size = HEADER_BYTES + 2 * slot_bytes
        if create:
            fd = create_segment_file(path)
            os.ftruncate(fd, size)
        else:
            fd = open_segment_file(path)
        try:
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.header = np.frombuffer(self.mm, dtype=np.int64, count=HEADER_BYTES // 8)
        self.address = self.header.ctypes.data
        self.data = torch.frombuffer(self.mm, dtype=torch.uint8, offset=HEADER_BYTES, count=2 * slot_bytes)
        self.slot_bytes = slot_bytes
        if create:
            self.header[W_PID] = os.getpid()
            self.header[W_SLOT_BYTES] = slot_bytes
            self.header[W_PROGRESS] = 0
            fence()
            self.header[W_MAGIC] = MAGIC  # last: a peer opening us waits for it

    def word_address(self, index: int) -> int:
        return self.address + 8 * index

    def slot(self, step: int) -> torch.Tensor:
        start = (step % 2) * self.slot_bytes
        return self.data[start : start + self.slot_bytes]

    def close(self) -> None:
        self.header = None
        self.data = None
        try:
            self.mm.close()
        except BufferError:  # a tensor view is still alive somewhere; the mapping goes with the process
            pass


def try_open(path: str, slot_bytes: int) -> Segment | None:
    try:
        if os.path.getsize(path) >= HEADER_BYTES + 2 * slot_bytes:
            seg = Segment(path, slot_bytes, create=False)
            if seg.header[W_MAGIC] == MAGIC:
                return seg
            seg.close()
    except FileNotFoundError:
        pass
    return None


def open_peers(paths: dict[int, str], slot_bytes: int, deadline: float, on_timeout) -> dict[int, Segment]:
    """Open the segments peers create when they first use a channel; ``on_timeout(missing_keys)``."""
    opened: dict[int, Segment] = {}
    pause = 1e-4
    while len(opened) < len(paths):
        for key, path in paths.items():
            if key not in opened:
                seg = try_open(path, slot_bytes)
                if seg is not None:
                    opened[key] = seg
        if len(opened) < len(paths):
            if time.monotonic() > deadline:
                for seg in opened.values():
                    seg.close()
                raise on_timeout([k for k in paths if k not in opened])
            time.sleep(pause)
            pause = min(2 * pause, 2e-3)
    return opened


def _digest(fingerprint: tuple[int, ...]) -> int:
    d = 0
    for x in fingerprint:
        d = (d * 1_000_003 + int(x) + 1) & 0x3FFFFFFFFFFF
    return d


class ShmChannel:
    """Steps of one group on one stream over shared memory (see the module docstring)."""

    def __init__(
        self,
        names: SegmentNames,
        group: str,
        stream: str,
        ranks: Sequence[int],
        my_index: int,
        timeout_s: float,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        first_op: str = "a collective",
        wait: WaitPolicy = DEFAULT_WAIT,
    ) -> None:
        self.group, self.stream, self.ranks, self.me = group, stream, list(ranks), my_index
        self.timeout_s = timeout_s
        self.slot_bytes = slot_bytes
        self.step = 0
        self.op_desc = "setup"
        deadline = time.monotonic() + timeout_s
        self.own = Segment(names.path(group, stream, self.ranks[my_index]), slot_bytes, create=True)

        def timeout(missing_idx: list[int]) -> Exception:
            self.close_own()
            return CommTimeoutError(
                f"nxdt.comm: group '{group}' {first_op} (first use of stream '{stream}') timed out after {timeout_s:g}s "
                f"waiting for rank(s) {[self.ranks[i] for i in missing_idx]} to join — they crashed, hung, or called a different collective"
            )

        paths = {i: names.path(group, stream, r) for i, r in enumerate(self.ranks) if i != my_index}
        try:
            opened = open_peers(paths, slot_bytes, deadline, timeout)
        except CommError:  # a peer's segment refused (the timeout closed ours already)
            self.close_own()
            raise
        opened[my_index] = self.own
        self.segments = [opened[i] for i in range(len(self.ranks))]
        self.headers = [s.header for s in self.segments]
        self.progress_addr = [s.word_address(W_PROGRESS) for s in self.segments]
        self.peers = [i for i in range(len(self.ranks)) if i != my_index]
        self._peer_headers = [self.headers[i] for i in self.peers]
        self._typed: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self._fp: tuple | None = None
        self._fp_digest = 0
        self._fp_written: list[tuple | None] = [None, None]
        self.spin = SpinBudget(wait)
        self.pacer: Pacer | None = None  # link emulation / stream priority after each step, if any
        self.heap: Heap | None = None  # this rank's heap: zero-copy sources (see set_source)
        self.plans: dict[tuple, tuple] = {}  # per-call decisions of an algorithm, by (op, dtype, count, ...)
        self.native = native.lib if self.size <= native.MAX_MEMBERS else None
        if self.native is not None:
            self._ctx = native.context(
                self.size,
                my_index,
                slot_bytes,
                [s.address for s in self.segments],
                [s.data.data_ptr() for s in self.segments],
                wait,
            )
            self.ctx_address = self._ctx.ctypes.data
            self._peer_mask = native.mask(self.peers)

    @property
    def size(self) -> int:
        return len(self.ranks)

    # -------------------------------------------------------------------------------- waiting
    def _wait(self, members: Sequence[int], milestone: int, what: str) -> None:
        lib = self.native
        if lib is not None:
            mask = self._peer_mask if members is self.peers else native.mask(members)
            if lib.wait(self.ctx_address, mask, milestone, threading.current_thread() is _MAIN):
                self._wait_native(members, mask, milestone, what)
            return
        headers = self.headers
        deadline = 0.0
        for i in members:
            if headers[i][W_PROGRESS] >= milestone:
                continue
            if not deadline:
                deadline = time.monotonic() + self.timeout_s
            wait_word(
                headers[i],
                W_PROGRESS,
                milestone,
                self.progress_addr[i],
                deadline,
                lambda: self._timeout_error(members, milestone, what),
                lambda: self._check_health(members, milestone),
                self.spin,
                (self.own.header, W_SLEEP, i + 1),
            )

    def _wait_native(self, members: Sequence[int], mask: int, milestone: int, what: str) -> None:
        """A native wait came back still waiting (it does every 20 ms): the deadline, the peers' health, again."""
        deadline = time.monotonic() + self.timeout_s
        main = threading.current_thread() is _MAIN
        while True:
            if time.monotonic() > deadline:
                raise self._timeout_error(members, milestone, what)
            self._check_health(members, milestone)
            if not self.native.wait(self.ctx_address, mask, milestone, main):
                return

    def _missing(self, members: Sequence[int], milestone: int) -> list[int]:
        return [i for i in members if self.headers[i][W_PROGRESS] < milestone]

    def _timeout_error(self, members: Sequence[int], milestone: int, what: str) -> Exception:
        missing = self._missing(members, milestone)
        return CommTimeoutError(
            f"nxdt.comm: group '{self.group}' {self.op_desc} (seq/step {self.step}, stream '{self.stream}') timed out after "
            f"{self.timeout_s:g}s waiting for {what} of rank(s) {[self.ranks[i] for i in missing]} — they crashed, hung, or called "
            f"a different collective",
            stuck_pids={self.ranks[i]: int(self.headers[i][W_PID]) for i in missing},
        )

    def _check_health(self, members: Sequence[int], milestone: int) -> None:
        for i in self._missing(members, milestone):
            pid = int(self.headers[i][W_PID])
            if pid and not pid_alive(pid):
                raise PeerDiedError(
                    f"nxdt.comm: group '{self.group}' {self.op_desc} (seq/step {self.step}): rank {self.ranks[i]} "
                    f"(pid {pid}) exited while the others waited for it"
                )

    def _set_progress(self, value: int) -> None:
        if self.native is not None:
            self.native.set_progress(self.ctx_address, value)
            return
        fence()
        self.own.header[W_PROGRESS] = value
        fence()  # the store before reading the sleep flags (pairs with the fence in wait_word)
        mark = self.me + 1
        for h in self._peer_headers:
            if h[W_SLEEP] == mark:  # a futex wake is a syscall: only when a peer blocks on my word
                wake(self.progress_addr[self.me])
                return

    # -------------------------------------------------------------------------------- one step
    def begin(self, fingerprint: tuple[int, ...], op_desc: str) -> None:
        """Start step ``self.step``: wait until my slot is free, record my fingerprint."""
        self.op_desc = op_desc
        if self.pacer is not None:
            self.pacer.started = time.perf_counter()
        s = self.step
        if s >= 2:
            self._wait(self.peers, 3 * (s - 2) + 3, "completion of an earlier step")
        if fingerprint != self._fp:  # consecutive chunks of one op share it: compute the digest once
            self._fp = fingerprint
            self._fp_digest = _digest(fingerprint)
        parity = s & 1
        h = self.own.header
        if self._fp_written[parity] != fingerprint:
            base = W_FINGERPRINT + parity * FP_WORDS
            h[base : base + FP_WORDS] = (*fingerprint, *([0] * (FP_WORDS - len(fingerprint))))[:FP_WORDS]
            self._fp_written[parity] = fingerprint
        h[W_FP_DIGEST + parity] = self._fp_digest  # a peer cannot be at step s±2 while we compare (slot protocol)
        h[W_SOURCE + 2 * parity] = 0  # my data is in my slot unless set_source says otherwise

    def all_reduce_step(
        self, dst: torch.Tensor, fingerprint: tuple[int, int, int, int], op_desc: str, sliced: bool = False
    ) -> bool:
        """One whole step of the direct (``sliced`` False) or the slice all-reduce in one native call (``self.native``
        must be set; ``dst`` is copied into my slot even when it is a shared tensor): begin, copy in (everything, or
        the peers' slices), publish, wait for every peer, check fingerprints, reduce (in member order into ``dst``, or my
        slice into ``dst`` and my slot, marked reduced, then the peers' reduced slices copied out), finish. False: every
        member published but some peer's data lies in its shared tensor — the step is still open and the caller
        reduces it by slices."""
        step = self.step
        self._fp_written[step & 1] = None  # the C side writes this parity's fingerprint words
        op, dtype, count, _ = fingerprint
        main = get_ident() == _MAIN_ID
        status = self.native.all_reduce_step(
            self.ctx_address, step, dst.data_ptr(), dst.numel(), dtype, op // 100, op, count, 0, main, sliced
        )
        if status == native.DONE:  # the common case: one call, nothing else
            self.step = step + 1
            return True
        return self._all_reduce_step_on(dst, fingerprint, op_desc, status, main, sliced)

    def all_reduce_step_fn(
        self, fingerprint: tuple[int, int, int, int], op_desc: str, sliced: bool
    ) -> Callable[[torch.Tensor], bool]:
        """``all_reduce_step`` for one call shape (``fingerprint``'s count = the tensor's numel, one step), with every
        argument that does not change between calls bound once: per call only the step counter, the tensor's address
        and the calling thread are read (a 1 KB call is ≈ 2 µs in all; each torch attribute read here cost
        0.1–0.5 µs: experiments/collectives-cpu/README.md, issue 35)."""
        op, dtype, count, _ = fingerprint
        step_fn, ctx, code, fp_written = self.native.all_reduce_step, self.ctx_address, op // 100, self._fp_written
        done = native.DONE

        def run(dst: torch.Tensor) -> bool:
            step = self.step
            fp_written[step & 1] = None  # the C side writes this parity's fingerprint words
            main = get_ident() == _MAIN_ID
            status = step_fn(ctx, step, dst.data_ptr(), count, dtype, code, op, count, 0, main, sliced)
            if status == done:
                self.step = step + 1
                return True
            return self._all_reduce_step_on(dst, fingerprint, op_desc, status, main, sliced)

        return run

    def _all_reduce_step_on(
        self, dst: torch.Tensor, fingerprint: tuple[int, int, int, int], op_desc: str, status: int, main: bool, sliced: bool
    ) -> bool:
        """The native step came back before it was done: check the deadline and the peers' health between calls
        (every 20 ms of waiting), or raise the mismatch; the rest of ``all_reduce_step``."""
        lib, step = self.native, self.step
        op, dtype, count, _ = fingerprint
        deadline = 0.0
        while True:
            if status == native.DONE:
                self.step = step + 1
                return True
            self.op_desc = op_desc
            if status == native.PEER_SHARED:
                return False
            if status == native.MISMATCH:
                self._raise_mismatch(self.peers)
            if status == native.PENDING_SLOT:
                milestone, what, phase = 3 * step - 3, "completion of an earlier step", 0
            elif status == native.PENDING_DATA:
                milestone, what, phase = 3 * step + 1, "the data", 1
            else:  # PENDING_REDUCED
                milestone, what, phase = 3 * step + 2, "the reduced slice", 2
            now = time.monotonic()
            deadline = deadline or now + self.timeout_s
            if now > deadline:
                raise self._timeout_error(self.peers, milestone, what)
            self._check_health(self.peers, milestone)
            status = lib.all_reduce_step(
                self.ctx_address, step, dst.data_ptr(), dst.numel(), dtype, op // 100, op, count, phase, main, sliced
            )

    # -------------------------------------------------------------------------------- zero-copy sources
    def locate(self, t: torch.Tensor) -> tuple[int, int] | None:
        """Where ``t`` lies in this rank's shared blocks, or None (then it has to be copied into the slot).
        Messages below ZERO_COPY_MIN_BYTES are always copied: that costs less than the extra wait for readers."""
        if self.heap is None or t.numel() * t.element_size() < ZERO_COPY_MIN_BYTES:
            return None
        return self.heap.locate(t)

    def set_source(self, where: tuple[int, int]) -> None:
        """This step's data is my shared tensor at ``where`` (before :meth:`publish`). The caller must
        :meth:`wait_readers` after :meth:`finish` before the tensor may change again."""
        base = W_SOURCE + 2 * (self.step & 1)
        self.own.header[base + 1] = where[1]
        self.own.header[base] = where[0]

    def in_slot(self, member: int) -> bool:
        """Is ``member``'s data of this step in its slot (else in its shared tensor)? After it published."""
        return self.headers[member][W_SOURCE + 2 * (self.step & 1)] == 0

    def any_shared(self) -> bool:
        """Does any member's data of this step lie in its shared tensor? After every member published."""
        word = W_SOURCE + 2 * (self.step & 1)
        return any(h[word] != 0 for h in self.headers)

    def put(self, src: torch.Tensor) -> bool:
        """Offer ``src`` as my data of this step: in place when it is a shared tensor (returns True; then
        :meth:`wait_readers` after :meth:`finish`), else copied to the start of my slot (returns False)."""
        where = self.locate(src)
        if where is None:
            self.typed(self.me, src.dtype, src.numel()).copy_(src)
            return False
        self.set_source(where)
        return True

    def source(self, member: int, dtype: torch.dtype, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of ``member``'s published data: from its slot or, zero-copy, its shared tensor."""
        base = W_SOURCE + 2 * (self.step & 1)
        h = self.headers[member]
        block = int(h[base])
        if block == 0:
            return self.typed(member, dtype)[start:stop]
        return self.heap.peer_view(self.ranks[member], block, int(h[base + 1]), dtype, start, stop)

    def wait_readers(self) -> None:
        """After :meth:`finish`: wait until every peer finished the step just ended (it read my shared tensor)."""
        self._wait(self.peers, 3 * self.step, "completion (reading this rank's shared tensor)")

    def typed(self, member: int, dtype: torch.dtype, count: int | None = None) -> torch.Tensor:
        """The current step's slot of ``member`` as a flat tensor of ``dtype`` (the first ``count``
        elements if given). Views are cached: making a tensor view costs microseconds, the hot path
        of a small collective is a handful of them."""
        key = (member, self.step & 1, dtype, count)
        view = self._typed.get(key)
        if view is None:
            if len(self._typed) > 512:  # many distinct counts: start over rather than grow
                self._typed.clear()
            view = self.segments[member].slot(self.step).view(dtype)
            if count is not None:
                view = view[:count]
            self._typed[key] = view
        return view

    def rows(self, member: int, dtype: torch.dtype, n: int, k: int) -> torch.Tensor:
        """The first ``n * k`` elements of ``member``'s current slot as an ``(n, k)`` matrix (cached
        like :meth:`typed`: all-to-all and reduce-scatter address one row per member)."""
        key = (member, self.step & 1, dtype, -n, k)  # negative n: never equal to a typed() key
        view = self._typed.get(key)
        if view is None:
            view = self.typed(member, dtype)[: n * k].view(n, k)
            self._typed[key] = view
        return view

    def publish(self) -> None:
        self._set_progress(3 * self.step + 1)

    def wait_published(self, members: Sequence[int] | None = None) -> None:
        members = self.peers if members is None else members
        self._wait(members, 3 * self.step + 1, "the data")
        word = W_FP_DIGEST + (self.step & 1)
        mine = self.own.header[word]
        for i in members:
            if self.headers[i][word] != mine:
                self._raise_mismatch(members)

    def _raise_mismatch(self, members: Sequence[int]) -> None:
        base = W_FINGERPRINT + (self.step & 1) * FP_WORDS
        mine = tuple(int(x) for x in self.own.header[base : base + FP_WORDS])
        for i in members:
            theirs = tuple(int(x) for x in self.headers[i][base : base + FP_WORDS])
            if theirs != mine or self.headers[i][W_FP_DIGEST + (self.step & 1)] != self.own.header[W_FP_DIGEST + (self.step & 1)]:
                raise CommMismatchError(
                    f"nxdt.comm: group '{self.group}' seq/step {self.step}: rank {self.ranks[self.me]} called {self.op_desc} "
                    f"{describe_fingerprint(mine)} but rank {self.ranks[i]} called {describe_fingerprint(theirs)} — "
                    f"every member must issue the same collectives with the same op, dtype, count and root, in the same order"
                )

    def each_ready(self, members: Sequence[int], reduced: bool = False):
        """Yield ``members`` once each has published (``reduced``: has its reduced slice), those
        already there first: blocking on a slow member while a faster one's data sits ready would
        waste the wait (matters when ranks outnumber cores and arrive in any order)."""
        pending = list(members)
        target = 3 * self.step + (2 if reduced else 1)
        headers = self.headers
        while pending:
            i = next((j for j in pending if headers[j][W_PROGRESS] >= target), pending[0])
            if reduced:
                self.wait_reduced((i,))
            else:
                self.wait_published((i,))
            pending.remove(i)
            yield i

    def mark_reduced(self) -> None:
        self._set_progress(3 * self.step + 2)

    def wait_reduced(self, members: Sequence[int] | None = None) -> None:
        self._wait(self.peers if members is None else members, 3 * self.step + 2, "the reduced slice")

    def finish(self, wire_bytes: int = 0, hops: int = 1) -> None:
        """End the step; ``wire_bytes``/``hops``: what the step moves in the cost model (for a pacer)."""
        self._set_progress(3 * self.step + 3)
        self.step += 1
        if self.pacer is not None:  # a chunk boundary: emulated wire time, then the priority rule
            self.pacer.step(wire_bytes, hops)

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


OP_NAMES = [
    "?",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "reduce",
    "send_recv",
    "barrier",
    "all_to_all_sizes",
]


def describe_fingerprint(fp: tuple[int, ...]) -> str:
    op, dtype, count, root = (tuple(fp) + (0,) * 4)[:4]
    from nxdt.comm.reduce import DTYPES, REDUCE_OPS  # local: avoids an import cycle at module load

    dtype_name = str(DTYPES[dtype - 1]).replace("torch.", "") if 0 < dtype <= len(DTYPES) else "?"
    op_name = OP_NAMES[op % 100] if 0 <= op % 100 < len(OP_NAMES) else "?"
    red = REDUCE_OPS[op // 100 - 1] if op >= 100 and op // 100 - 1 < len(REDUCE_OPS) else None
    return f"{op_name}({'op=' + red + ', ' if red else ''}dtype={dtype_name}, count={count}, root={root})"


def remove_segments(pattern: str) -> int:
    """Remove this user's segments matching ``pattern`` (another user's file under a name of the run is left
    alone: /dev/shm is sticky, and it is not ours to remove)."""
    removed = 0
    for path in glob.glob(os.path.join(SHM_DIR, pattern)):
        try:
            if os.lstat(path).st_uid != os.geteuid():
                continue
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    return removed


def cleanup_run(run_id: str) -> int:
    """Remove every segment of a run (the launcher calls this after its workers exit). ``run_id`` is
    the id given to ``init_process`` (segments carry it plus a per-start nonce) or ``World.run_id``."""
    short = _safe(run_id[:24])
    return remove_segments(f"{PREFIX}{short}.*") + remove_segments(f"{PREFIX}{_safe(run_id)}-*")


def remove_stale_segments() -> int:
    """Remove segments whose creating process is gone (left behind by a crashed run)."""
    removed = 0
    for path in glob.glob(os.path.join(SHM_DIR, PREFIX + "*")):
        try:  # this user's regular files only: a FIFO, device or link planted under the prefix is not opened
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                continue
            words = np.frombuffer(os.read(fd, 16), dtype=np.int64)
            if len(words) == 2 and words[0] == MAGIC and not pid_alive(int(words[1])):
                os.unlink(path)
                removed += 1
        except (OSError, ValueError):
            continue
        finally:
            os.close(fd)
    return removed
