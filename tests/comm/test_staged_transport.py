"""The ``staged`` transport (CUDA tensors of members that share a GPU, through host memory: nxdt/comm/nccl.py), its
plumbing checked on the CPU: with CPU tensors its device copies are no-ops, so each op must hand the host transport
(shm) the right arguments and write the result back where it belongs. A light module: the ranks run_local forks import
it, so it imports nothing beyond torch and nxdt.comm."""

from __future__ import annotations

import torch

from nxdt.comm.nccl import StagedTransport
from nxdt.comm.spawn import run_local


def _staged_ops(world):
    """One rank: every op of StagedTransport on CPU tensors (results returned for the test to compare)."""

    comm = world.new_communicator([0, 1], "pair")
    tr = StagedTransport(comm, torch.device("cpu"))
    r = world.rank

    def name(op, n):
        return tr.resolve(op, "auto", n)

    t = torch.tensor([1.0, 2.0]) * (r + 1)
    tr.all_reduce(t, "sum", name("all_reduce", 8), None, "default")
    out = torch.empty(4)
    tr.all_gather(out, torch.tensor([r, r + 0.5]), name("all_gather", 16), "default")
    rs = torch.empty(1)
    tr.reduce_scatter(rs, torch.tensor([1.0, 10.0]) * (r + 1), "sum", name("reduce_scatter", 8), "default")
    a2a = torch.empty(2)
    tr.all_to_all(a2a, torch.tensor([10.0 * r, 10.0 * r + 1]), [1, 1], [1, 1], True, name("all_to_all", 8), "default")
    b = torch.tensor([float(r + 7)])
    tr.broadcast(b, 1, name("broadcast", 4), "default")
    red = torch.tensor([float(r + 1)])
    tr.reduce(red, 0, "sum", name("reduce", 4), "default")
    got = torch.empty(1)
    tr.exchange([(1 - r, torch.tensor([float(r)]))], [(1 - r, got)], "default", "send_recv")
    return [t.tolist(), out.tolist(), rs.tolist(), a2a.tolist(), b.tolist(), red.tolist(), got.tolist()]


def test_staged_transport_hands_each_op_to_the_host_transport():
    r0, r1 = run_local(_staged_ops, 2, timeout_s=60)
    assert r0[0] == r1[0] == [3.0, 6.0]
    assert r0[1] == r1[1] == [0.0, 0.5, 1.0, 1.5]
    assert (r0[2], r1[2]) == ([3.0], [30.0])
    assert (r0[3], r1[3]) == ([0.0, 10.0], [1.0, 11.0])
    assert r0[4] == r1[4] == [8.0]
    assert r0[5] == [3.0] and r1[5] == [2.0]  # the root gets the sum; the other member's tensor is left alone
    assert (r0[6], r1[6]) == ([1.0], [0.0])
