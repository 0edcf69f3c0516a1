"""Link emulation and per-step pacing.

:class:`EmulatedLink` is the model a communicator is *given* (``World.new_communicator(..., link=)``;
``comm`` knows nothing of the planner): every transfer step of every algorithm of that communicator
additionally waits ``hops · latency_s + step_bytes / bytes_per_s``. The wait sleeps (no spinning), so
ranks that share cores keep them, and it happens after each chunk, so a yielding stream can pause
between chunks and compute overlaps communication for real.

``step_bytes`` follows the cost model (nxdt.planner.cost) per step of a chunk of ``k`` elements in a
group of ``n``: all-gather / reduce-scatter / all-to-all receive ``(n-1)·k``, all-reduce moves
``2(n-1)/n·k`` in two latency hops, broadcast / reduce ``k``, barrier 0; a point-to-point exchange
(ring/tree/pairwise steps, send/recv) the larger of what it sends and receives.

Sleeps shorter than a timer tick overshoot (a 2 µs sleep takes ~60 µs on Linux), so waits are owed
and slept once they add up to ``MIN_SLEEP_S``; time overslept is credited to the next wait. Over many
steps the total equals the model; a final debt below ``MIN_SLEEP_S`` is dropped.

:class:`Pacer` is what a shm channel or a point-to-point link of one communicator on one stream
calls after every step: the emulated wait, then the stream-priority rule of :mod:`nxdt.comm.stream`
(a high-priority stream notes its progress, a yielding stream pauses while such an op is pending).
While tracing, each shm step of a yielding stream is recorded as a ``chunk`` event (begin to end,
emulated wire time included): the unit a pause waits for, so a trace shows what ran during a TP op.
A channel of an ordinary stream on an unemulated communicator has no pacer at all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nxdt.comm.stream import Stream
    from nxdt.comm.world import World

MIN_SLEEP_S = 200e-6
MAX_CREDIT_S = 1e-3  # oversleep credited at most this much: an idle gap is not transfer time


@dataclass(frozen=True)
class EmulatedLink:
    """Latency (seconds per step) and bandwidth (bytes per second) a communicator's transfers take."""

    latency_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if not self.latency_s >= 0:
            raise ValueError(f"EmulatedLink.latency_s={self.latency_s!r} must be >= 0 seconds")
        if not self.bytes_per_s > 0:
            raise ValueError(f"EmulatedLink.bytes_per_s={self.bytes_per_s!r} must be > 0 bytes per second")

    def seconds(self, nbytes: float, hops: int = 1) -> float:
        """Modelled time of one step moving ``nbytes``."""
        return hops * self.latency_s + nbytes / self.bytes_per_s


class Pacer:
    """Runs after every step of one communicator on one stream (see the module docstring)."""

    __slots__ = ("link", "stream", "world", "_owed", "started")

    def __init__(self, link: EmulatedLink | None, stream: "Stream", world: "World") -> None:
        self.link, self.stream, self.world = link, stream, world
        self._owed = 0.0
        self.started: float | None = None  # when the current shm step began (traced as a "chunk" on yielding streams)

    def step(self, nbytes: float = 0, hops: int = 1) -> None:
        role = self.stream.role
        if self.link is not None:
            self._owed += self.link.seconds(nbytes, hops)
            if self._owed >= MIN_SLEEP_S:
                if role == "high":  # sleeping on the wire is progress, not a stall
                    self.world.priority.progress(self._owed)
                start = time.perf_counter()
                time.sleep(self._owed)
                self._owed = max(-MAX_CREDIT_S, self._owed - (time.perf_counter() - start))
        if role == "high":
            self.world.priority.progress()
        elif role == "yield":
            tracer = self.world.tracer
            if tracer is not None and self.started is not None:  # what a pause must not interrupt
                tracer.add("chunk", self.stream.name, self.started, time.perf_counter(), bytes=int(nbytes))
            self.started = None
            self.world.yield_point(self.stream.name)
