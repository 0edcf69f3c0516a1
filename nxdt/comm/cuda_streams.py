"""CUDA streams and events for nxdt's stream threads: :class:`nxdt.comm.stream.DeviceOrder` for CUDA tensors.

An nxdt stream is a host thread that runs its collectives in FIFO order. On a GPU that thread only *issues* device
work (NCCL kernels, CUDA IPC reductions, staged copies), so the host's order is not the data's. Had the thread issued
it on the device's default stream, as it did before this module, every NCCL op's ``wait()`` would have made the default
stream — the training step's — wait for the collective, and a prefetched gather would have held back the very
kernels it was meant to run beside. Instead each nxdt stream has one CUDA stream per device (made by its first op
there), and a queued op:

* ``issued`` (the submitting thread): records an event on that thread's current CUDA stream — the op's inputs are ready
  after it — and marks the op's tensors as used on the nxdt stream's CUDA stream (``Tensor.record_stream``: the caching
  allocator keeps their memory from other work until what that stream queued before their release is done; the op's
  closure holds them until its work is queued, so that is after it);
* ``running`` (the stream's thread): makes that CUDA stream current, has it wait for the inputs' event (and for the
  ``after=`` ops: their ``Work.wait`` runs inside), runs the op — NCCL queues after that stream's work and its
  ``wait()`` makes that stream wait, not the default one —, then records the op's own event there;
* ``waited`` (a thread that waited for the op's ``Work``): its current CUDA stream waits for the op's event. The host
  never waits for the device here.

An op that runs inline (blocking, nothing queued on its nxdt stream) runs on the caller's CUDA stream, after the nxdt
stream's last queued op on that device (``inline``), so an nxdt stream stays FIFO on the device as on the host.

Imported by the communicator only when an op's tensors are on a GPU; nothing here runs on a CPU-only host.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from nxdt.comm.stream import Stream


class _DeviceQueue:
    """One nxdt stream's CUDA stream on one device, and the event of the newest op queued on it."""

    __slots__ = ("stream", "last")

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.last: torch.cuda.Event | None = None


class CudaOrder:
    """The :class:`~nxdt.comm.stream.DeviceOrder` of one op on CUDA tensors of ``device`` (see the module docstring)."""

    __slots__ = ("owner", "device", "tensors", "_ready", "_done")

    def __init__(self, owner: Stream, device: torch.device, tensors: Sequence[torch.Tensor]) -> None:
        self.owner, self.device, self.tensors = owner, device, tensors
        self._ready: torch.cuda.Event | None = None
        self._done: torch.cuda.Event | None = None

    def _queue(self) -> _DeviceQueue:
        q = self.owner.device_queues.get(self.device)
        if q is None:  # setdefault: two threads issuing the stream's first ops both get the one that was stored
            q = self.owner.device_queues.setdefault(self.device, _DeviceQueue(self.device))
        return q

    def issued(self) -> None:
        q = self._queue()
        self._ready = torch.cuda.Event()
        self._ready.record(torch.cuda.current_stream(self.device))
        self._done = torch.cuda.Event()
        for t in self.tensors:
            t.record_stream(q.stream)

    @contextmanager
    def running(self) -> Iterator[None]:
        q = self._queue()
        assert self._ready is not None and self._done is not None, "CudaOrder.running before issued"
        with torch.cuda.device(self.device), torch.cuda.stream(q.stream):
            q.stream.wait_event(self._ready)
            try:
                yield
            finally:  # recorded even after an error: a later op's wait on it must not wait for nothing forever
                self._done.record(q.stream)
                q.last = self._done

    def waited(self) -> None:
        assert self._done is not None, "CudaOrder.waited before issued"
        torch.cuda.current_stream(self.device).wait_event(self._done)

    def inline(self) -> None:
        q = self.owner.device_queues.get(self.device)
        if q is not None and q.last is not None:
            torch.cuda.current_stream(self.device).wait_event(q.last)


def device_order(owner: Stream, tensors: Sequence[torch.Tensor]) -> CudaOrder | None:
    """The order of an op of nxdt stream ``owner`` on ``tensors`` (all on one device, as the communicator checked):
    a :class:`CudaOrder` for CUDA tensors, None for any other device's (their host order is their data's)."""
    device = tensors[0].device
    if device.type != "cuda":
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return CudaOrder(owner, device, tuple(t for t in tensors if t.numel()))
