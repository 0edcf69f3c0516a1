"""Streams and work handles.

A stream is a FIFO of collectives with its own thread, so ops on different streams progress
concurrently (torch kernels and waits release the GIL). A blocking op on a stream with nothing
queued runs inline in the caller's thread: the common synchronous path pays no thread hand-off.
``after=`` makes an op wait for other ops' completion first: the token chain FSDP prefetch uses.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterable

from nxdt.comm.errors import CommError, CommTimeoutError


class Work:
    """Handle of an issued collective."""

    def __init__(self, description: str) -> None:
        self.description = description
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> None:
        if not self._done.wait(timeout_s):
            raise CommTimeoutError(f"nxdt.comm: {self.description} did not complete within {timeout_s}s")
        if self._error is not None:
            raise self._error


class Stream:
    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()       # held while an op of this stream runs
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"nxdt-stream-{self.name}", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, work, after = item
            self._run(fn, work, after)

    def _run(self, fn: Callable[[], None], work: Work, after: Iterable[Work]) -> None:
        try:
            for dep in after:
                dep.wait()
            with self._lock:
                fn()
        except BaseException as exc:  # delivered to whoever waits on the work
            work._finish(exc if isinstance(exc, CommError) else exc)
        else:
            work._finish()
        finally:
            with self._pending_lock:
                self._pending -= 1

    def submit(self, fn: Callable[[], None], description: str, *, async_op: bool, after: Iterable[Work] = ()) -> Work | None:
        if self._closed:
            raise CommError(f"nxdt.comm: stream '{self.name}' is closed")
        after = list(after)
        if not async_op and not after:
            with self._pending_lock:
                idle = self._pending == 0
                if idle:
                    self._pending += 1
            if idle:  # the common synchronous path: run here, no hand-off, no work handle
                try:
                    with self._lock:
                        fn()
                finally:
                    with self._pending_lock:
                        self._pending -= 1
                return None
        work = Work(description)
        with self._pending_lock:
            self._pending += 1
        self._ensure_thread()
        self._queue.put((fn, work, after))
        if async_op:
            return work
        work.wait()
        return None

    def close(self) -> None:
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
