"""Shared tensors: memory that peers on the same host read directly (zero-copy collectives).

``World.shared_empty(shape, dtype)`` returns a tensor whose storage is a shared-memory block of this
rank (``/dev/shm/nxdt-<run>-<tag>``, :class:`~nxdt.comm.shm.SegmentNames`, mode 0600, removed when the world closes or, after a
crash, by the next start's stale-segment sweep). When a collective's input lies in such a block, the
``shm`` transport publishes *where* it lies (block and byte offset) instead of copying it into the
channel's slot, and peers read it in place: one copy per byte moved instead of two, which is what
the copy-bound collectives of a CPU host are limited by. The idea is NCCL's user-buffer registration
and torch's symmetric memory, without requiring every rank to allocate the same buffers.

Who gains: long-lived buffers that are communicated every step (FSDP's flat shards, the benchmark's
buffers). A block lives until the world closes, so allocate these once, not per step. A call on a
shared tensor returns only after every peer finished reading it, so the tensor may be changed as soon
as the call returns, as with any other tensor; members whose tensors are ordinary keep using their slot,
and the two kinds mix freely within one call.
"""

from __future__ import annotations

import math
import mmap
import os
import threading

import numpy as np
import torch

from nxdt.comm.shm import MAGIC, SegmentNames, create_segment_file, open_segment_file
from nxdt.comm.waiting import fence

BLOCK_HEADER_BYTES = 4096  # magic + creator pid first, like a channel segment, so the stale sweep knows it


def block_path(names: SegmentNames, rank: int, block: int) -> str:
    return names.path("heap", str(block), rank)


class Heap:
    """This rank's shared blocks, and the peers' blocks it has mapped (cached)."""

    def __init__(self, names: SegmentNames, rank: int) -> None:
        self.names, self.rank = names, rank
        self._own: list[tuple[int, int, int, str, mmap.mmap]] = []  # (start address, end address, block id, path, map)
        self._peers: dict[tuple[int, int], torch.Tensor] = {}  # (rank, block) -> the block's bytes
        self._lock = threading.Lock()
        self._next = 1  # block ids start at 1: 0 means "in the slot" in a channel header

    def empty(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (int(shape),)
        if any(int(s) < 0 for s in shape):
            raise ValueError(f"shared_empty: negative dimension in shape {shape}")
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            block = self._next
            self._next += 1
        path = block_path(self.names, self.rank, block)
        size = BLOCK_HEADER_BYTES + max(nbytes, 8)
        fd = create_segment_file(path)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        header = np.frombuffer(mm, dtype=np.int64, count=2)
        header[1] = os.getpid()
        fence()
        header[0] = MAGIC
        data = torch.frombuffer(mm, dtype=torch.uint8, offset=BLOCK_HEADER_BYTES, count=max(nbytes, 8))[:nbytes]
        start = data.data_ptr()
        with self._lock:
            self._own.append((start, start + nbytes, block, path, mm))
        return data.view(dtype).view(shape)

    def locate(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(block id, byte offset) of contiguous ``t`` if it lies in one of this rank's blocks, else None."""
        if not self._own or t.numel() == 0:
            return None
        p = t.data_ptr()
        end = p + t.numel() * t.element_size()
        for start, stop, block, _, _ in self._own:
            if start <= p and end <= stop:
                return block, p - start
        return None

    def peer_bytes(self, rank: int, block: int) -> torch.Tensor:
        """A peer's block, mapped read/write on first use (the peer is inside a call that names it, so it exists)."""
        key = (rank, block)
        data = self._peers.get(key)
        if data is None:
            with self._lock:
                data = self._peers.get(key)
                if data is None:
                    path = block_path(self.names, rank, block)
                    fd = open_segment_file(path)
                    try:
                        size = os.fstat(fd).st_size
                        mm = mmap.mmap(fd, size)
                    finally:
                        os.close(fd)
                    data = self._peers[key] = torch.frombuffer(mm, dtype=torch.uint8, offset=BLOCK_HEADER_BYTES)
        return data

    def peer_view(self, rank: int, block: int, offset: int, dtype: torch.dtype, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of ``dtype`` from byte ``offset`` of a peer's block."""
        elem = dtype.itemsize
        raw = self.peer_bytes(rank, block)
        return raw[offset + start * elem : offset + stop * elem].view(dtype)

    def close(self) -> None:
        """Unlink this rank's blocks (mappings stay valid while tensors use them) and forget peers' blocks."""
        with self._lock:
            own, self._own = self._own, []
            self._peers.clear()
        for _, _, _, path, _ in own:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
