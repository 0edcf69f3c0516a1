"""The ``gloo`` transport: torch.distributed's own collectives behind nxdt's :class:`Transport` interface.

This is where a torch.distributed backend plugs in (gloo on CPU here; NCCL would be the same class over
CUDA tensors). It is a peer and a reference, not the fast path: gloo moves every byte through TCP, even
between processes of one host.

One gloo process group per (communicator, stream), created by the members alone on the stream's first
op (``ProcessGroupGloo`` over a ``PrefixStore`` of the world's store named after both): streams of one
communicator are independent FIFOs on every rank, and gloo matches collectives by issue order, so they
must not share a group. What nxdt keeps on top of gloo: fp32 accumulation of fp16/bf16 (rounded once;
gloo alone rounds at every hop), ``avg`` (sum, then divide), deadlines (the group's timeout is
``comm.timeout_s``) and one-line errors. What it does not have: the shm transports' per-step
fingerprints — calls that differ across ranks end as a timeout or gloo's own error, not
``CommMismatchError``. gloo runs its own algorithms: an algorithm name other than ``auto`` is refused.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from nxdt.comm.errors import CommError, CommTimeoutError, PeerDiedError
from nxdt.comm.reduce import LOW_PRECISION
from nxdt.comm.transport import Transport

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "prod": dist.ReduceOp.PRODUCT,
}
_LOST = ("Connection closed", "Connection reset", "Broken pipe", "Connection refused")


class GlooTransport(Transport):
    name = "gloo"

    def __init__(self, comm) -> None:
        super().__init__(comm)
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._tags: dict[str, int] = {}

    def resolve(self, op: str, name: str, nbytes: int) -> str:
        if name != "auto":
            raise ValueError(
                f"communicator '{self.comm.name}': transport 'gloo' runs gloo's own algorithms; "
                f"algorithm {name!r} needs transport 'shm' or 'p2p'"
            )
        return "gloo"

    backend = "gloo"  # names the store prefix and the error; a subclass over another backend overrides _new_group

    def _new_group(self, store: dist.Store, timeout: timedelta) -> dist.ProcessGroup:
        return dist.ProcessGroupGloo(store, self.comm.rank, self.comm.size, timeout)

    def _group(self, stream: str) -> dist.ProcessGroup:
        pg = self._groups.get(stream)
        if pg is None:
            comm = self.comm
            store = dist.PrefixStore(f"nxdt-{self.backend}/{comm.name}/{stream}", comm.world.store)
            try:
                pg = self._new_group(store, timedelta(seconds=comm.world.timeout_s))
            except RuntimeError as exc:
                raise CommTimeoutError(
                    f"nxdt.comm: group '{comm.name}' could not form its {self.backend} group on stream '{stream}' "
                    f"({str(exc).splitlines()[0]})"
                ) from exc
            self._groups[stream] = pg
            self._tags[stream] = comm.world.stream_tag(comm.name, stream)
        return pg

    def _run(self, stream: str, desc: str, call) -> None:
        """``call(pg)`` returns a gloo Work; wait for it and turn gloo's errors into nxdt's."""
        try:
            call(self._group(stream)).wait()
        except RuntimeError as exc:
            if isinstance(exc, CommError):
                raise
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            kind = PeerDiedError if any(s in text for s in _LOST) else CommTimeoutError
            raise kind(f"nxdt.comm: group '{self.comm.name}' {desc} (stream '{stream}') over gloo failed: {text}") from exc

    def _reduce_work(self, t: torch.Tensor) -> torch.Tensor:
        return t.float() if t.dtype in LOW_PRECISION else t  # fp32 accumulation, rounded once

    def all_reduce(self, t, op, name, grid, stream) -> None:
        work = self._reduce_work(t)
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[op]
        self._run(stream, f"all_reduce({op})", lambda pg: pg.allreduce([work], opts))
        if op == "avg":
            work.div_(self.comm.size)
        if work is not t:
            t.copy_(work)

    def all_gather(self, out, inp, name, stream) -> None:
        self._run(stream, "all_gather", lambda pg: pg._allgather_base(out, inp))

    def reduce_scatter(self, out, inp, op, name, stream) -> None:
        work_in, work_out = self._reduce_work(inp), self._reduce_work(out)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _OPS[op]
        self._run(stream, f"reduce_scatter({op})", lambda pg: pg._reduce_scatter_base(work_out, work_in, opts))
        if op == "avg":
            work_out.div_(self.comm.size)
        if work_out is not out:
            out.copy_(work_out)

    def all_to_all(self, out, inp, out_splits, in_splits, equal, name, stream) -> None:
        if out.numel() and inp.numel() and out.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr():
            inp = inp.clone()
        outs, ins = ([], []) if equal else (list(out_splits), list(in_splits))
        self._run(stream, "all_to_all", lambda pg: pg.alltoall_base(out, inp, outs, ins, dist.AllToAllOptions()))

    def broadcast(self, t, root, name, stream) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._run(stream, f"broadcast(root={root})", lambda pg: pg.broadcast([t], opts))

    def reduce(self, t, root, op, name, stream) -> None:
        work = self._reduce_work(t) if self.comm.rank == root else self._reduce_work(t).clone()  # gloo may scribble on non-roots
        opts = dist.ReduceOptions()
        opts.reduceOp = _OPS[op]
        opts.rootRank = root
        self._run(stream, f"reduce({op}, root={root})", lambda pg: pg.reduce([work], opts))
        if self.comm.rank == root:
            if op == "avg":
                work.div_(self.comm.size)
            if work is not t:
                t.copy_(work)

    def exchange(self, sends, recvs, stream: str, desc: str) -> None:
        pg = self._group(stream)
        tag = self._tags[stream]
        works = []
        try:
            works += [pg.recv([t], peer, tag) for peer, t in recvs if t.numel()]
            works += [pg.send([t], peer, tag) for peer, t in sends if t.numel()]
        except RuntimeError as exc:
            raise CommTimeoutError(
                f"nxdt.comm: group '{self.comm.name}' {desc} (stream '{stream}') over gloo failed: {str(exc).splitlines()[0]}"
            ) from exc
        for w in works:
            self._run(stream, desc, lambda _pg, w=w: w)

    def barrier(self, stream: str) -> None:
        zero = torch.zeros(1, dtype=torch.int32)
        self._run(stream, "barrier", lambda pg: pg.allreduce([zero]))

    def close(self) -> None:
        self._groups.clear()
