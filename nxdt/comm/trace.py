"""Chrome-trace recording (the JSON Perfetto and chrome://tracing open).

A :class:`Tracer` collects *complete* events (``"ph": "X"``) of one rank: the rank is the trace's
``pid``, each category (a stream name, ``"compute"``, ...) gets its own ``tid`` so every stream is one
row in the viewer. Times are ``time.perf_counter()`` seconds (CLOCK_MONOTONIC on Linux, shared by
every process of a host, so the ranks' files line up when loaded together); events carry them in
microseconds, as the format wants.

``World.set_tracer(Tracer(rank))`` makes every collective record one event (see
:mod:`nxdt.comm.world`); nothing is recorded, and nothing costs, while no tracer is set.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


class Tracer:
    """Events of one rank; safe to use from several threads (the streams record concurrently)."""

    def __init__(self, rank: int) -> None:
        self.rank = int(rank)
        self._events: list[dict[str, Any]] = []
        self._tids: dict[str, int] = {}
        self._lock = threading.Lock()

    @staticmethod
    def now() -> float:
        """The clock ``add`` expects."""
        return time.perf_counter()

    def _tid(self, cat: str) -> int:
        tid = self._tids.get(cat)
        if tid is None:
            with self._lock:
                tid = self._tids.setdefault(cat, len(self._tids) + 1)
        return tid

    def add(self, name: str, cat: str, start_s: float, end_s: float, **args: Any) -> None:
        """One complete event from ``start_s`` to ``end_s`` (``time.perf_counter()`` seconds)."""
        event = {
            "name": name,
            "cat": cat,
            "ph": "X",
            "ts": start_s * 1e6,
            "dur": max(0.0, end_s - start_s) * 1e6,
            "pid": self.rank,
            "tid": self._tid(cat),
            "args": args,
        }
        self._events.append(event)  # list.append is atomic under the GIL

    @contextmanager
    def span(self, name: str, cat: str, **args: Any) -> Iterator[None]:
        """Record the enclosed block as one event (also when it raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, cat, start, time.perf_counter(), **args)

    def events(self) -> list[dict[str, Any]]:
        """Metadata (process and row names) followed by the recorded events, in recording order."""
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": f"rank {self.rank}"}}]
        meta += [
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": cat}}
            for cat, tid in sorted(self._tids.items(), key=lambda kv: kv[1])
        ]
        return meta + list(self._events)

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"traceEvents": self.events(), "displayTimeUnit": "ms"}))
