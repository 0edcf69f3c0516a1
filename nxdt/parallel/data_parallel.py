"""Data-parallel gradient averaging overlapped with backward.

The trainable parameters are cut into buckets of about ``bucket_bytes``, in reverse registration order
(backward produces the last layers' gradients first). In the backward that ends a step, a bucket is
all-reduced (avg, fp32, async on the ``"dp"`` stream) as soon as every parameter in it has its gradient —
while backward still computes the earlier layers — instead of one flat all-reduce after backward::

    buckets = GradientBuckets(params, dp_comm)
    buckets.arm(skip_backwards=len(micro_batches) - 1)   # earlier micro-batches only accumulate
    for micro in micro_batches: loss(micro).backward()
    buckets.finish()                                     # every bucket reduced, .grad = the DP average

Buckets go out strictly in bucket order (every rank's ``"dp"`` stream must see the same sequence), so a
parameter that gets no gradient in that backward holds its bucket and the later ones back until
:meth:`finish`, which reduces them with zeros for the missing gradient, the same on every rank.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

DP_STREAM = "dp"


class GradientBuckets:
    def __init__(self, params: Sequence[nn.Parameter], comm: Any, bucket_bytes: int = 4 << 20) -> None:
        self.comm = comm
        self.buckets: list[list[nn.Parameter]] = []
        size = bucket_bytes
        for p in reversed(list(params)):
            if size + 4 * p.numel() > bucket_bytes and (not self.buckets or self.buckets[-1]):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += 4 * p.numel()
        self.flats = [torch.empty(sum(p.numel() for p in b), dtype=torch.float32) for b in self.buckets]
        self._armed = False
        self._skip = 0
        self._seen = [0] * len(self.buckets)
        self._passes = [0] * len(self.buckets)
        self._works: dict[int, Any] = {}
        self._complete: set[int] = set()  # buckets ready in the reducing backward, not yet issued
        for i, bucket in enumerate(self.buckets):
            for p in bucket:
                p.register_post_accumulate_grad_hook(lambda _p, i=i: self._ready(i))

    def arm(self, skip_backwards: int = 0) -> None:
        """Reduce during the backward after ``skip_backwards`` more backwards (the last micro-batch's)."""
        self._armed, self._skip = True, skip_backwards
        self._seen = [0] * len(self.buckets)
        self._passes = [0] * len(self.buckets)
        self._works = {}
        self._complete = set()

    def _ready(self, i: int) -> None:
        if not self._armed:
            return
        self._seen[i] += 1
        if self._seen[i] == len(self.buckets[i]):  # this backward has produced the whole bucket
            self._seen[i] = 0
            if self._passes[i] >= self._skip:
                self._complete.add(i)
                # issue strictly in bucket order, so every rank's "dp" stream sees the same sequence
                while len(self._works) in self._complete:
                    self._issue(len(self._works))
            self._passes[i] += 1

    @torch.no_grad()
    def _issue(self, i: int) -> None:
        flat, offset = self.flats[i], 0
        for p in self.buckets[i]:
            view = flat[offset:offset + p.numel()]
            view.copy_(p.grad.reshape(-1)) if p.grad is not None else view.zero_()
            offset += p.numel()
        self._works[i] = self.comm.all_reduce(flat, "avg", stream=DP_STREAM, async_op=True)

    @torch.no_grad()
    def finish(self) -> None:
        """Reduce what has not been reduced yet, wait for every bucket, write the averages into ``.grad``."""
        while len(self._works) < len(self.buckets):  # the rest, still in bucket order
            self._issue(len(self._works))
        for i, bucket in enumerate(self.buckets):
            self._works[i].wait()
            flat, offset = self.flats[i], 0
            for p in bucket:
                view = flat[offset:offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = view.to(p.dtype).clone()
                else:
                    p.grad.copy_(view)
                offset += p.numel()
        self._armed = False
        self._works = {}
