"""Streams, work handles and stream priority.

A stream is a FIFO of collectives with its own thread, so ops on different streams progress
concurrently (torch kernels and waits release the GIL). The thread asks the kernel for a short
scheduling slice (:func:`nxdt.comm.waiting.request_short_slice`): it mostly sleeps, and each wake-up
gates every op queued behind it, so it should not wait for the core its rank's compute holds.
A blocking op on a stream with nothing queued runs inline in the caller's thread: the common synchronous path pays no thread hand-off.
``after=`` makes an op wait for other ops' completion first: the token chain FSDP prefetch uses.
Every :class:`Work` has a unique integer ``id`` (per process), the token a trace shows.

Ops on device tensors (a GPU's) carry a :class:`DeviceOrder` (``nxdt.comm.cuda_streams``): the host thread only
*issues* device work, so its order is not the data's. A queued op marks its inputs ready on the issuing thread's
device stream, runs on a device stream of its own nxdt stream (waiting for that mark, and for its ``after=`` ops on
the device too), marks its results, and :meth:`Work.wait` makes the waiter's device stream wait for that mark —
not the host, and not the device's other work: the next layer's kernels run while a prefetched gather is in flight.
An op that runs inline runs on the caller's device stream, in its order.

Stream priority (``World.high_priority_streams``, default ``{"tp"}``; ``World.yielding_streams``,
default ``{"fsdp"}``). While an op of a high-priority stream of this rank runs, an op of a yielding
stream pauses at its next chunk boundary (between shm steps, between point-to-point exchanges, and
before it starts) and resumes when no high-priority op runs. Streams in neither set never pause
and pay nothing.

The no-deadlock rule. Ranks yield independently, so a pause can sit in a cycle: rank 0's TP op waits
for rank 1, which computes and waits for an FSDP gather whose peer, rank 3, pauses for its own TP op
with rank 2, which waits for the gather rank 0 paused. So a pause never waits for the high-priority
op to *finish*, only while it *makes progress*: a high-priority op counts as progressing for
``World.yield_stall_s`` (default 5 ms) after it started and after each of its steps (an emulated
link's wire time included). An op that waits for a peer longer than that is stalled, and every
paused stream of that rank resumes and keeps running until the op moves again. A high-priority op
only progresses when its peers take part in it, which they do finitely often before they need
something else, so every pause ends within ``yield_stall_s`` of the last progress anywhere in the
cycle, and a pause never waits for a transfer that needs the paused one. Waits sleep on a condition
variable (no spinning).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Iterable, Protocol

import torch

from nxdt.comm.errors import CommError, CommTimeoutError
from nxdt.comm.waiting import request_short_slice


_work_ids = itertools.count(1)


def next_work_id() -> int:
    """A process-unique id (for ops that run inline and have no Work object)."""
    return next(_work_ids)


class DeviceOrder(Protocol):
    """How one queued op on device tensors is ordered with the device work around it (see the module docstring).
    Made per op by the communicator, cheaply: it does nothing until :meth:`issued`."""

    def issued(self) -> None:
        """In the submitting thread, when the op is queued: its inputs are ready where that thread's device work is."""

    def running(self) -> ContextManager[None]:
        """In the stream's thread, around the op (and its waits for ``after=`` ops): the device work it issues goes
        after the inputs' mark, on the stream's own device queue; on leaving, the results are marked."""

    def waited(self) -> None:
        """In a thread that waited for the op on the host: that thread's device work from now on follows the results."""

    def inline(self) -> None:
        """In the submitting thread, when the op runs there (nothing queued on its stream): it follows the stream's
        earlier queued ops on the device as on the host."""


class Work:
    """Handle of an issued collective; ``id`` is unique within the process."""

    def __init__(self, description: str, work_id: int | None = None, order: DeviceOrder | None = None) -> None:
        self.description = description
        self.id = next(_work_ids) if work_id is None else work_id
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._order = order  # device tensors: the device-side completion wait() hands on to the waiter's stream
        # perf_counter seconds when the op began (its ``after=`` done) and ended: what overlap accounting reads
        self.start_s: float | None = None
        self.end_s: float | None = None

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> None:
        """Until the op has run on the host (device tensors: issued); then, for device tensors, the calling thread's
        device work is ordered after the op's results."""
        if not self._done.wait(timeout_s):
            raise CommTimeoutError(f"nxdt.comm: {self.description} did not complete within {timeout_s}s")
        if self._error is not None:
            raise self._error
        if self._order is not None:
            self._order.waited()


class PriorityState:
    """Which high-priority ops of this rank run, and until when they count as progressing (see the
    module docstring). Yielding streams wait on it."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self._cond = threading.Condition(threading.Lock())
        self._running = 0
        self._fresh_until = 0.0  # perf_counter time; a running op stalled beyond it releases the pausers
        self._waiters = 0

    def begin(self) -> None:
        with self._cond:
            self._running += 1
            self._fresh_until = max(self._fresh_until, time.perf_counter() + self.stall_s)

    def end(self) -> None:
        with self._cond:
            self._running -= 1
            if self._waiters:
                self._cond.notify_all()

    def progress(self, busy_s: float = 0.0) -> None:
        """A running high-priority op moved (and stays busy on the wire ``busy_s`` more)."""
        until = time.perf_counter() + busy_s + self.stall_s
        if until > self._fresh_until:  # unlocked: a racing store shortens or extends one pause by < stall_s
            self._fresh_until = until

    def pause(self) -> tuple[float, float] | None:
        """Wait while a high-priority op runs and progresses; (start, end) of the pause, None if none."""
        if not self._running:
            return None
        start = time.perf_counter()
        if start >= self._fresh_until:
            return None
        with self._cond:
            self._waiters += 1
            try:
                while self._running:
                    left = self._fresh_until - time.perf_counter()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            finally:
                self._waiters -= 1
        return start, time.perf_counter()


class Stream:
    def __init__(self, name: str, role: str | None = None) -> None:
        self.name = name
        self.role = role  # "high" | "yield" | None, fixed when the stream is first used
        self._lock = threading.Lock()  # held while an op of this stream runs
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        # per device, the device queue (a CUDA stream) this stream's thread issues its device work on; filled by the
        # DeviceOrder of the first op on that device (nxdt.comm.cuda_streams), so nothing here touches a device
        self.device_queues: dict[torch.device, Any] = {}

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"nxdt-stream-{self.name}", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        request_short_slice()  # wake-ups of this thread gate every queued collective: let them preempt compute
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, work, after = item
            self._run(fn, work, after)

    def _run(self, fn: Callable[[], None], work: Work, after: Iterable[Work]) -> None:
        try:
            with work._order.running() if work._order is not None else nullcontext():
                for dep in after:
                    dep.wait()  # device tensors: this stream's device queue waits for it, not the host
                with self._lock, torch.no_grad():  # collectives are not differentiated; a thread starts in grad mode
                    work.start_s = time.perf_counter()
                    fn()
        except BaseException as exc:  # delivered to whoever waits on the work
            work.end_s = time.perf_counter()
            work._finish(exc if isinstance(exc, CommError) else exc)
        else:
            work.end_s = time.perf_counter()
            work._finish()
        finally:
            with self._pending_lock:
                self._pending -= 1

    def submit(
        self,
        fn: Callable[[], None],
        description: str | Callable[[], str],
        *,
        async_op: bool,
        after: Iterable[Work] = (),
        work_id: int | None = None,
        order: DeviceOrder | None = None,
    ) -> Work | None:
        """Run ``fn`` on this stream. ``description`` (or a function making it: only ops that get a Work need one).
        ``order``: the op's tensors are a device's (:class:`DeviceOrder`: queued, issued / running / waited; inline,
        ``inline`` only)."""
        if self._closed:
            raise CommError(f"nxdt.comm: stream '{self.name}' is closed")
        after = list(after) if after else ()
        if not async_op and not after:
            with self._pending_lock:
                idle = self._pending == 0
                if idle:
                    self._pending += 1
            if idle:  # the common synchronous path: run here, no hand-off, no work handle
                try:  # no self._lock: nothing else runs while _pending counts this op (threads, inline callers queue)
                    if order is not None:
                        order.inline()
                    if torch.is_grad_enabled():  # entering no_grad costs more than a small collective's copy
                        with torch.no_grad():
                            fn()
                    else:
                        fn()
                finally:
                    with self._pending_lock:
                        self._pending -= 1
                return None
        work = Work(description if isinstance(description, str) else description(), work_id, order)
        if order is not None:
            order.issued()
        with self._pending_lock:
            self._pending += 1
        self._ensure_thread()
        self._queue.put((fn, work, after))
        if async_op:
            return work
        work.wait()
        return None

    def run_inline(self, fn: Callable[[torch.Tensor], None], tensor: torch.Tensor) -> bool:
        """``fn(tensor)`` here and now when nothing is queued or running on this stream (False, not run, otherwise):
        ``submit``'s synchronous path for a caller that needs neither a work handle nor autograd's no_grad (the
        op writes through raw addresses). Errors propagate."""
        lock = self._pending_lock
        lock.acquire()  # not ``with``: half the cost, and nothing in between can raise
        idle = self._pending == 0 and not self._closed
        if idle:
            self._pending = 1
        lock.release()
        if not idle:
            return False
        try:
            fn(tensor)
        finally:
            lock.acquire()
            self._pending -= 1
            lock.release()
        return True

    def close(self) -> None:
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
