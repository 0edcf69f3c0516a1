"""The ``nccl`` transport: torch's ProcessGroupNCCL under nxdt's :class:`Transport` interface, for CUDA tensors.

A communicator hands every op whose tensors are on a CUDA device to this transport (``transport.DEVICE_TRANSPORTS``),
whatever ``comm.transport`` chose for CPU tensors; it is built on the first such op. As :mod:`nxdt.comm.gloo`,
whose class it extends: one process group per (communicator, stream) formed by the members alone through a
``PrefixStore`` of the world's store — streams stay independent FIFOs, as NCCL matches collectives by issue order —,
fp32 accumulation of fp16/bf16 (rounded once, so every member holds the bits the shm transport would give),
``avg`` as sum then divide, the group's timeout ``comm.timeout_s``, one-line errors. NCCL picks its own algorithm
(ring, tree, NVLS: ``NCCL_ALGO`` steers it): every algorithm name resolves to ``nccl``. NCCL's settings come from
the environment, which the worker fills from ``instance.env`` before its first group (``nxdt.parallel.devices``).

Ordering: an op is enqueued on NCCL's stream after the work already queued on the calling thread's current CUDA
stream, and waiting for it makes that stream wait. An inline op runs on the caller's stream (the training step's); a
queued one on its nxdt stream's own CUDA stream, which first waits for the issuing stream's event, and its result
reaches the waiter's stream through ``Work.wait`` (:mod:`nxdt.comm.cuda_streams`), so the step's later kernels do not
wait for it.
Nothing here is imported before a CUDA tensor reaches a communicator.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from nxdt.comm.gloo import GlooTransport
from nxdt.comm.transport import Transport, transport_name


class NCCLTransport(GlooTransport):
    name = "nccl"

    def __init__(self, comm) -> None:
        super().__init__(comm)
        # built on the caller's thread, whose current device the strategy set to this rank's GPU; the stream threads
        # start on cuda:0, so every call below runs under this device
        self.device = torch.device("cuda", torch.cuda.current_device())

    def resolve(self, op: str, name: str, nbytes: int) -> str:
        return "nccl"  # NCCL's own choice (a planned or configured name is the host transports')

    def planned(self, op: str, name: str) -> str | None:
        return None

    backend = "nccl"

    def _new_group(self, store: dist.Store, timeout: timedelta) -> dist.ProcessGroup:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, self.comm.rank, self.comm.size, options)

    def _run(self, stream: str, desc: str, call) -> None:
        with torch.cuda.device(self.device):
            super()._run(stream, desc, call)

    def exchange(self, sends, recvs, stream: str, desc: str) -> None:
        with torch.cuda.device(self.device):
            super().exchange(sends, recvs, stream, desc)

    def barrier(self, stream: str) -> None:
        zero = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._run(stream, "barrier", lambda pg: pg.allreduce([zero]))

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def close(self) -> None:
        # an NCCL group left to the garbage collector warns, and may block the process's exit on its watchdog
        for pg in self._groups.values():
            try:
                pg.shutdown()
            except (AttributeError, RuntimeError):  # an older torch, or a group whose communicator already failed
                pass
        super().close()


class StagedTransport(Transport):
    """CUDA tensors through host memory: each op copies its tensors to the CPU, runs on the communicator's host
    transport (shm on one host) and copies the result back. For members that share a GPU, which NCCL refuses
    (one NCCL rank per device); the bytes are the host transport's, so results equal a CPU run's bit for bit.
    :class:`nxdt.comm.cuda_ipc.CudaIpcTransport` keeps the collectives' bytes on the GPU and uses this class for
    the rest, and for everything where CUDA IPC is unavailable."""

    name = "staged"

    def __init__(self, comm, device: torch.device | None = None) -> None:
        super().__init__(comm)
        self.host = comm._transport
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else device

    def planned(self, op: str, name: str) -> str | None:
        return self.host.planned(op, name)

    def resolve(self, op: str, name: str, nbytes: int) -> str:
        return self.host.resolve(op, name, nbytes)

    @staticmethod
    def _host(t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu")

    @staticmethod
    def _host_like(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype)

    def all_reduce(self, t, op, name, grid, stream) -> None:
        h = self._host(t)
        self.host.all_reduce(h, op, name, grid, stream)
        t.copy_(h)

    def all_gather(self, out, inp, name, stream) -> None:
        h = self._host_like(out)
        self.host.all_gather(h, self._host(inp), name, stream)
        out.copy_(h)

    def reduce_scatter(self, out, inp, op, name, stream) -> None:
        h = self._host_like(out)
        self.host.reduce_scatter(h, self._host(inp), op, name, stream)
        out.copy_(h)

    def all_to_all(self, out, inp, out_splits, in_splits, equal, name, stream) -> None:
        h = self._host_like(out)
        self.host.all_to_all(h, self._host(inp), out_splits, in_splits, equal, name, stream)
        out.copy_(h)

    def broadcast(self, t, root, name, stream) -> None:
        h = self._host(t)
        self.host.broadcast(h, root, name, stream)
        t.copy_(h)

    def reduce(self, t, root, op, name, stream) -> None:
        h = self._host(t)
        self.host.reduce(h, root, op, name, stream)
        if self.comm.rank == root:
            t.copy_(h)

    def exchange(self, sends, recvs, stream: str, desc: str) -> None:
        host_recvs = [(peer, self._host_like(t)) for peer, t in recvs]
        self.host.exchange([(peer, self._host(t)) for peer, t in sends], host_recvs, stream, desc)
        for (_, t), (_, h) in zip(recvs, host_recvs):
            t.copy_(h)

    def barrier(self, stream: str) -> None:
        self.host.barrier(stream)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)


def member_devices(comm) -> list[str]:
    """Every member's ``host/GPU index`` (through the world's store: a collective step of the members alone)."""
    store = dist.PrefixStore(f"nxdt-cuda/{comm.name}", comm.world.store)
    store.set(str(comm.rank), f"{comm.world.host_ids[comm.world.rank]}/{torch.cuda.current_device()}")
    return [store.get(str(r)).decode() for r in range(comm.size)]


def cuda_transport(comm) -> Transport:
    """NCCL, or CUDA IPC where members share a GPU (``transport.transport_name``)."""
    kind = transport_name("cuda", comm.transport, comm.hosts, member_devices(comm) if comm.size > 1 else ())
    if kind == "cuda_ipc":
        from nxdt.comm.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport(comm)
    return NCCLTransport(comm)
