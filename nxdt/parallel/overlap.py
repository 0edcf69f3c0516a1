"""Data-parallel gradient reduction overlapped with backward, as torch DDP's reducer does it.

Parameters are cut into buckets in the order backward produces their gradients (the reverse of their order in the
module, DDP's assumption), each of at most ``bucket_cap_mb`` (DDP's option, default 25 MiB; a larger parameter is a
bucket of its own). A ``register_post_accumulate_grad_hook`` on every parameter copies its gradient into its bucket
while the *armed* backward (the last before the optimizer step: DDP reduces only outside ``no_sync``) runs; once a
bucket has every gradient, and every bucket before it has left, its collectives are issued ``async_op=True`` on the
communicator's ``dp`` stream (:class:`nxdt.comm.stream.Stream`: the thread FSDP's asynchronous gathers run on), so they
proceed while backward computes the earlier layers. ``finish`` fills the buckets whose gradients never came in the
armed backward (accumulated by an earlier micro-batch, or none at all), issues them in the same order on every rank,
and waits. Who does what with a finished bucket (the replicated runtime's average, ZeRO-1's reduce to each shard's
owner) is the caller's ``fill`` / ``launch``.

A gradient that arrives a second time after its bucket left (a parameter used by two reentrant activation checkpoints)
would have been sent stale: ``finish`` then answers False on every rank (one 1-element all-reduce agrees on it) and the
caller reduces after backward, as without overlap.

Bits: the caller guarantees that cutting the reduction into buckets does not change any element's summation order
(:func:`order_free`: a group of 2 on every transport, any size on shm, whose reductions all add in member order);
then the overlapped gradients equal the post-backward path's bit for bit.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from nxdt.comm.stream import Work
from nxdt.comm.world import Communicator

DDP_BUCKET_CAP_MB = 25.0  # torch.nn.parallel.DistributedDataParallel's default bucket_cap_mb
DP_STREAM = "dp"  # the data-parallel reductions' stream (ZeRO-1's reduce-scatters and gathers run on it too)


def order_free(comm: Communicator, *ops: str) -> bool:
    """Whether reducing a flat buffer in pieces with ``ops`` (default: all-reduce) gives every element the same bits as
    reducing it whole with any of them: with two members each element is one addition of the two contributions
    (commutative in IEEE arithmetic; half types widened to fp32 first) and one division by 2, on every transport; with
    three or more where the transport adds every element's contributions in member order whatever its place (shm's
    direct algorithms: ``Communicator.sums_in_member_order``), not where a ring or a tree orders them by position,
    which bucket boundaries would move."""
    return comm.sums_in_member_order(*(ops or ("all_reduce",)))


def plan_buckets(sizes: Sequence[int], cap_elements: int) -> list[list[int]]:
    """Consecutive runs of ``sizes`` (indices, in the order given: the order backward produces the gradients) of at
    most ``cap_elements`` in all; a size above the cap is a bucket alone. Empty sizes join the bucket they fall in."""
    if cap_elements < 1:
        raise ValueError(f"plan_buckets: cap_elements must be at least 1, got {cap_elements}")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, n in enumerate(sizes):
        if current and filled + n > cap_elements:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += n
    if current:
        buckets.append(current)
    return buckets


def cap_elements(bucket_cap_mb: float | None, element_size: int) -> int:
    """DDP's ``bucket_cap_mb`` (MiB; None: its 25 MiB default) as a number of elements of ``element_size`` bytes."""
    mb = DDP_BUCKET_CAP_MB if bucket_cap_mb is None else float(bucket_cap_mb)
    return max(1, int(mb * (1 << 20)) // element_size)


class BackwardReduction:
    """Issue each bucket's collectives as soon as its gradients have all arrived during an armed backward.

    ``buckets``: parameters per bucket, buckets in the order they are issued (the same on every rank).
    ``fill(bucket, param)``: copy ``param.grad`` (zeros when None) into the bucket's buffer.
    ``launch(bucket)``: issue the bucket's collectives asynchronously; returns their work handles.
    ``agree``: the group that decides together whether a finished reduction may be used (see the module docstring).
    """

    def __init__(
        self,
        buckets: list[list[nn.Parameter]],
        fill: Callable[[int, nn.Parameter], None],
        launch: Callable[[int], list[Work]],
        agree: Communicator,
    ) -> None:
        self.buckets = buckets
        self._fill, self._launch, self._agree = fill, launch, agree
        self._where = {id(p): b for b, params in enumerate(buckets) for p in params}
        self._handles = [p.register_post_accumulate_grad_hook(self._arrived) for params in buckets for p in params]
        self.armed = False
        self._missing: list[int] = []
        self._seen: set[int] = set()
        self._next = 0  # the first bucket not issued yet
        self._works: list[Work] = []
        self._stale = False
        self.issued_in_backward = 0  # buckets the last armed backward issued before it ended (tests, measurements)
        self.used = False  # whether the last finish() answered True (its buckets held the result)

    def arm(self) -> None:
        """The next backward is the last before the step: reduce as gradients arrive."""
        self._drain()  # an armed backward followed by another before the step: its collectives are void
        self._missing = [len(params) for params in self.buckets]
        self._seen = set()
        self._next = 0
        self._stale = False
        self.armed = True

    def disarm(self) -> None:
        """The next backward accumulates more: nothing is reduced during it (an armed round so far is void)."""
        if self.armed:
            self._drain()
            self.armed = False

    def remove(self) -> None:
        """Unregister the hooks (the runtime is set up again, or released)."""
        self.disarm()
        for h in self._handles:
            h.remove()
        self._handles = []

    def _drain(self) -> None:
        works, self._works = self._works, []
        for w in works:
            w.wait()

    def _arrived(self, p: nn.Parameter) -> None:
        if not self.armed:
            return
        b = self._where[id(p)]
        if id(p) in self._seen:  # a second contribution in the same backward
            if b < self._next:
                self._stale = True  # its bucket left with the earlier value
            else:
                self._fill(b, p)
            return
        self._seen.add(id(p))
        self._fill(b, p)
        self._missing[b] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._works += self._launch(self._next)
            self._next += 1

    def finish(self) -> bool:
        """After the armed backward: issue the remaining buckets (their missing gradients filled as they are now), wait
        for every bucket. True when the reduced buckets hold the result; False when nothing was armed or a gradient came
        after its bucket left on some rank (then the caller reduces after backward)."""
        self.used = False
        if not self.armed:
            return False
        self.armed = False
        self.issued_in_backward = self._next
        for b in range(self._next, len(self.buckets)):
            for p in self.buckets[b]:
                if id(p) not in self._seen:
                    self._fill(b, p)
            self._works += self._launch(b)
        self._next = len(self.buckets)
        self._drain()
        stale = torch.tensor([float(self._stale)])
        self._agree.all_reduce(stale, op="max")
        self.used = not bool(stale.item())
        return self.used
