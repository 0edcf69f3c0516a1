"""The ``cuda_ipc`` transport: members that share one GPU reduce in device memory, through CUDA IPC.

NCCL takes one rank per GPU, so ranks placed on the same GPU (more ranks than GPUs: ``nxdt.parallel.devices``) need
another path. The staged one (:class:`~nxdt.comm.nccl.StagedTransport`) copies every tensor to host memory, runs the
host transport and copies back. This one keeps the bytes on the GPU, as the shm transport keeps them in shared host
memory: each member shares one device buffer per stream (a CUDA IPC handle: the fields ``torch.multiprocessing``
sends for a CUDA tensor, written to the world's store as JSON, so nothing is unpickled) and opens the others'. An
all-reduce is then: copy in, synchronise, host barrier, reduce every member's buffer in member order on the GPU
(:func:`nxdt.comm.reduce.reduce_into`: fp32 accumulation of bf16/fp16, rounded once — the shm transport's bits, as
elementwise ops round alike on both devices), synchronise, host barrier (the buffers are free for the next op).
``all_gather``, ``reduce_scatter`` and ``broadcast`` go the same way; ``all_to_all``, ``reduce``, point-to-point,
barriers and messages under ``IPC_MIN_BYTES`` (where the staged path is faster, measured) stay staged.

Opening the peers' handles is one collective step: when any member cannot (a runtime without CUDA IPC), every
member falls back to the staged path together, with one line on stderr.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nxdt.comm.nccl import StagedTransport
from nxdt.comm.reduce import reduce_into

MIN_CAPACITY = 1 << 20  # bytes: a buffer grows in powers of two from here, to the largest message seen
# below this, an op is staged: two processes' kernels on one GPU take turns (time slices), so the IPC path's five
# kernels and two synchronisations cost ~0.6 ms an op whatever its size, the staged path's two copies less. Measured on
# an H200, 2 ranks, fp32 all-reduce (tests/gpu/device_checks.py): 4 KiB 620 us IPC vs 287 staged, 1 MiB 630 vs 606,
# 64 MiB 822 vs 79,782
IPC_MIN_BYTES = 1 << 20


@dataclass
class _Buffers:
    capacity: int  # bytes
    generation: int
    views: list[torch.Tensor]  # every member's buffer (uint8, this rank's own at its group rank)


def share_fields(buf: torch.Tensor) -> dict:
    """What another process needs to open ``buf``'s allocation (torch.multiprocessing's fields for a CUDA tensor)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buf)
    device, handle, size, offset, _, ref_handle, ref_offset, event, event_sync = args[6:15]
    return {
        "device": int(device),
        "handle": bytes(handle).hex(),
        "size": int(size),
        "offset": int(offset),
        "ref_handle": bytes(ref_handle).hex(),
        "ref_offset": int(ref_offset),
        "event": bytes(event).hex() if event else "",
        "event_sync": bool(event_sync),
        "numel": buf.numel(),
    }


def open_fields(f: dict) -> torch.Tensor:
    """The uint8 tensor over a peer's buffer described by :func:`share_fields` (in another process)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size([f["numel"]]),
        (1,),
        0,
        torch.storage.TypedStorage,
        torch.uint8,
        f["device"],
        bytes.fromhex(f["handle"]),
        f["size"],
        f["offset"],
        False,
        bytes.fromhex(f["ref_handle"]),
        f["ref_offset"],
        bytes.fromhex(f["event"]) if f["event"] else None,
        f["event_sync"],
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class CudaIpcTransport(StagedTransport):
    name = "cuda_ipc"
    # how a buffer is offered to the other members and how theirs are opened (a test's subclass stands in for CUDA)
    share = staticmethod(share_fields)
    open = staticmethod(open_fields)

    def __init__(self, comm, device: torch.device | None = None) -> None:
        super().__init__(comm, device)
        self._buffers: dict[str, _Buffers] = {}
        self.failed: str | None = None  # why IPC could not be used (then every op is staged)

    # --- buffers
    def _views(self, stream: str, nbytes: int) -> list[torch.Tensor] | None:
        """Every member's buffer on ``stream``, at least ``nbytes`` long (grown together: every member sees the same
        op sizes, so all choose the same capacity); None when the op is staged (IPC off, or under IPC_MIN_BYTES)."""
        if self.failed is not None or nbytes < IPC_MIN_BYTES:
            return None
        b = self._buffers.get(stream)
        if b is not None and b.capacity >= nbytes:
            return b.views
        capacity = max(MIN_CAPACITY, 1 << max(nbytes - 1, 1).bit_length())
        generation = 0 if b is None else b.generation + 1
        views = self._exchange(stream, generation, capacity)
        if views is None:
            return None
        self._buffers[stream] = _Buffers(capacity, generation, views)
        return views

    def _exchange(self, stream: str, generation: int, capacity: int) -> list[torch.Tensor] | None:
        comm = self.comm
        store = dist.PrefixStore(f"nxdt-ipc/{comm.name}/{stream}/{generation}", comm.world.store)
        own = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        # any failure below is recorded, never raised, so every member reaches the status step (a member that raised
        # would leave the others waiting for it until the store's timeout)
        try:
            store.set(f"fields/{comm.rank}", json.dumps(self.share(own)))
        except Exception as exc:  # this member cannot share: say so, the others will see it in the status step
            store.set(f"fields/{comm.rank}", json.dumps({"error": _first_line(exc)}))
        views: list[torch.Tensor] = []
        problem = ""
        for r in range(comm.size):
            if r == comm.rank:
                views.append(own)
                continue
            fields = json.loads(store.get(f"fields/{r}").decode())
            if "error" in fields:
                problem = problem or f"member {r}: {fields['error']}"
                continue
            try:
                views.append(self.open(fields))
            except Exception as exc:
                problem = problem or f"opening member {r}'s buffer: {_first_line(exc)}"
        store.set(f"status/{comm.rank}", problem)
        problems = [store.get(f"status/{r}").decode() for r in range(comm.size)]
        first = next((p for p in problems if p), "")
        if first:
            self.failed, self.name = first, "staged"
            if comm.rank == 0:
                print(
                    f"nxdt.comm: group '{comm.name}': CUDA IPC unavailable ({first}); its members sharing a GPU "
                    "communicate through host memory",
                    file=sys.stderr,
                )
            return None
        return views

    def _sync(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def _fence(self, stream: str) -> None:
        """This member's GPU work so far is done and every member has reached the same point."""
        self._sync()
        self.host.barrier(stream)

    # --- ops
    def all_reduce(self, t, op, name, grid, stream) -> None:
        nbytes = t.numel() * t.element_size()
        views = self._views(stream, nbytes)
        if views is None:
            return super().all_reduce(t, op, name, grid, stream)
        with torch.cuda.device(self.device):
            parts = [v[:nbytes].view(t.dtype) for v in views]
            parts[self.comm.rank].copy_(t)
            self._fence(stream)
            reduce_into(t, parts, op, self.comm.size)
            self._fence(stream)

    def all_gather(self, out, inp, name, stream) -> None:
        nbytes = inp.numel() * inp.element_size()
        views = self._views(stream, nbytes)
        if views is None:
            return super().all_gather(out, inp, name, stream)
        with torch.cuda.device(self.device):
            views[self.comm.rank][:nbytes].view(inp.dtype).copy_(inp)
            self._fence(stream)
            blocks = out.view(self.comm.size, inp.numel())
            for r, v in enumerate(views):
                blocks[r].copy_(v[:nbytes].view(inp.dtype))
            self._fence(stream)

    def reduce_scatter(self, out, inp, op, name, stream) -> None:
        nbytes = inp.numel() * inp.element_size()
        views = self._views(stream, nbytes)
        if views is None:
            return super().reduce_scatter(out, inp, op, name, stream)
        with torch.cuda.device(self.device):
            views[self.comm.rank][:nbytes].view(inp.dtype).copy_(inp)
            self._fence(stream)
            n, me = out.numel(), self.comm.rank
            reduce_into(out, [v[:nbytes].view(inp.dtype)[me * n : (me + 1) * n] for v in views], op, self.comm.size)
            self._fence(stream)

    def broadcast(self, t, root, name, stream) -> None:
        nbytes = t.numel() * t.element_size()
        views = self._views(stream, nbytes)
        if views is None:
            return super().broadcast(t, root, name, stream)
        with torch.cuda.device(self.device):
            if self.comm.rank == root:
                views[root][:nbytes].view(t.dtype).copy_(t)
            self._fence(stream)
            if self.comm.rank != root:
                t.copy_(views[root][:nbytes].view(t.dtype))
            self._fence(stream)

    def close(self) -> None:
        self._buffers.clear()
        super().close()
