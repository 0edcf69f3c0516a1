"""nxdt.parallel.data_parallel: gradients averaged during the last micro-batch's backward equal the
single-process gradient of the mean loss; earlier micro-batches only accumulate; a parameter without a
gradient is averaged as zeros; buckets go out in bucket order."""

from __future__ import annotations

import pytest
import torch

from nxdt.comm.spawn import run_local
from nxdt.parallel.data_parallel import GradientBuckets


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4))


def _data(rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + micro)
    return torch.randn(3, 16, generator=g), torch.randn(3, 4, generator=g)


def _worker(world) -> dict:
    model = _model()
    unused = torch.nn.Parameter(torch.ones(5))  # in a bucket, never in the graph
    params = [unused] + list(model.parameters())  # first registered = last bucket (backward order)
    buckets = GradientBuckets(params, world.world, bucket_bytes=64 * 64 * 4)  # several buckets
    issued: list[int] = []
    original = buckets._issue
    buckets._issue = lambda i: (issued.append(i), original(i))[1]
    micro = 3
    buckets.arm(skip_backwards=micro - 1)
    for m in range(micro):
        x, y = _data(world.rank, m)
        (torch.nn.functional.mse_loss(model(x), y) / micro).backward()
        if m < micro - 1:
            assert not issued  # only the last backward reduces
    assert issued, "no bucket went out during the last backward"
    buckets.finish()
    # reference: one process, the mean over both ranks' micro-batches
    ref = _model()
    for r in range(world.world_size):
        for m in range(micro):
            x, y = _data(r, m)
            (torch.nn.functional.mse_loss(ref(x), y) / (micro * world.world_size)).backward()
    diff = max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    return {"diff": diff, "issued": issued, "buckets": len(buckets.buckets), "unused": unused.grad.tolist()}


@pytest.mark.timeout(60)
def test_buckets_average_during_the_last_backward_like_one_process():
    for rep in run_local(_worker, 2, timeout_s=50):
        assert rep["diff"] < 1e-6, rep
        assert rep["buckets"] >= 3 and sorted(rep["issued"]) == list(range(rep["buckets"]))
        assert rep["issued"][:len(rep["issued"])] == sorted(rep["issued"])  # bucket order
        assert rep["unused"] == [0.0] * 5
