"""The CUDA IPC transport's buffer exchange (nxdt/comm/cuda_ipc.py) on any host: the CUDA calls stood in for by meta
buffers, so the collective agreement — every member uses the buffers, or none does — is checked without a GPU (the
transfers themselves: tests/gpu/)."""

from __future__ import annotations

import pytest
import torch

from nxdt.comm.spawn import run_local


def _ipc_protocol_rank(world, failing):
    """CUDA IPC's buffer exchange with the CUDA calls stood in for (meta buffers); member ``failing`` cannot open the
    others' buffers."""
    from nxdt.comm.cuda_ipc import IPC_MIN_BYTES, CudaIpcTransport

    class ByHand(CudaIpcTransport):
        share = staticmethod(lambda buf: {"numel": buf.numel()})

        def open(self, fields):
            if self.comm.rank == failing:
                raise RuntimeError("invalid device context")
            return torch.empty(fields["numel"], dtype=torch.uint8, device="meta")

    tr = ByHand(world.new_communicator([0, 1], "pair"), device=torch.device("meta"))
    small = tr._views("main", IPC_MIN_BYTES - 1)
    big = tr._views("main", 3 * IPC_MIN_BYTES)
    return {
        "small_staged": small is None,
        "big": None if big is None else [v.numel() for v in big],
        "name": tr.name,
        "failed": tr.failed,
        "again": tr._views("main", 3 * IPC_MIN_BYTES) is None,
    }


@pytest.mark.parametrize("failing", [None, 1])
def test_cuda_ipc_buffers_are_agreed_by_every_member_or_by_none(failing):
    """Members sharing a GPU open each other's buffers in one collective step: all use them (grown to a power of two
    over the message), or, when any member cannot, all fall back to the staged path together (never one member
    raising while the others wait for it); messages under IPC_MIN_BYTES are staged either way."""
    got = run_local(_ipc_protocol_rank, 2, failing, timeout_s=60)
    for r in got:
        assert r["small_staged"]
        if failing is None:
            assert r["name"] == "cuda_ipc" and r["big"] == [4 << 20, 4 << 20] and r["failed"] is None, r
        else:
            assert r["name"] == "staged" and r["big"] is None and r["again"], r
            assert r["failed"] == "opening member 0's buffer: invalid device context", r
