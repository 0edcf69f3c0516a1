"""``World`` and ``Communicator``: bootstrap, locality, transport choice and the public operators.

Bootstrap uses a torch.distributed ``TCPStore`` (hosted by torch's elastic agent under ``nxdt
train``/torchrun, or by rank 0 otherwise) only to exchange host identities; collectives never go
through it. A communicator whose members share a host uses the ``shm`` transport; one spanning
hosts uses ``p2p`` (torch.distributed point-to-point over gloo), hierarchically where a host holds
several members. Locality is decided per group from the members' host identities (hostname, boot
id, network namespace), never from LOCAL_WORLD_SIZE-style variables, which lie for groups that
span hosts unevenly.

A communicator may be given an :class:`~nxdt.comm.emulate.EmulatedLink` (``new_communicator(...,
link=)``): its transfers then also take the modelled time (see :mod:`nxdt.comm.emulate`). Streams
named in ``World.high_priority_streams`` / ``World.yielding_streams`` get the priority rule of
:mod:`nxdt.comm.stream`; ``World.set_tracer`` records every collective as a Chrome-trace event.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import hmac
import itertools
import os
import socket
import time
import uuid
import zlib
from datetime import timedelta
from typing import Any, Callable, Literal, Mapping, Sequence, overload

import torch
import torch.distributed as dist

from nxdt.comm import native as native_path, objects
from nxdt.comm.errors import CommError, CommTimeoutError
from nxdt.comm.reduce import check_op, dtype_code
from nxdt.comm.shm import DEFAULT_SLOT_BYTES, SegmentNames, remove_stale_segments
from nxdt.comm.emulate import EmulatedLink
from nxdt.comm.heap import Heap
from nxdt.comm.store import SignedKeys, StoreAccessError, connect_store, open_file_store, secret_from_env, serve_store
from nxdt.comm.stream import DeviceOrder, PriorityState, Stream, Work, next_work_id
from nxdt.comm.trace import Tracer
from nxdt.comm.transport import (
    ALGORITHM_NAMES,
    ALGORITHMS,
    DEVICE_TRANSPORTS,
    Transport,
    device_transport,
    parse_algorithm,
    transport_class,
)
from nxdt.comm.waiting import DEFAULT_WAIT, WaitPolicy, policy_for


def host_identity() -> str:
    """hostname + boot id + network-namespace inode: two network namespaces on one machine are two hosts."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        boot = "noboot"
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{socket.gethostname()}/{boot}/{netns}"


def _flat(t: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu and t.device.type not in DEVICE_TRANSPORTS:
        raise ValueError(f"{what} is on {t.device}; nxdt.comm works on CPU tensors and on {', '.join(DEVICE_TRANSPORTS)} tensors")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous (call .contiguous() first)")
    dtype_code(t.dtype)
    return t if t.dim() == 1 else t.view(-1)  # making a view costs about a microsecond: not for a flat tensor


class Communicator:
    """Collectives over one group of ranks. ``root`` and ``peer`` are group-local ranks.

    Each op checks its arguments, picks its algorithm (the call's ``algorithm=``; for ``auto``, this
    communicator's default for the op: see :mod:`nxdt.comm.transport`) and runs on its transport, on the
    named stream. ``transport`` is the transport's name; ``algorithms`` the per-op defaults."""

    def __init__(
        self,
        world: "World",
        name: str,
        ranks: list[int],
        link: EmulatedLink | None = None,
        transport: str = "auto",
        algorithm: str = "auto",
        planned: Mapping[str, str] | None = None,
    ) -> None:
        self.world, self.name, self.ranks = world, name, list(ranks)
        self.link = link
        self._seq: dict[str, int] = {}  # ops issued per stream (counted while a tracer is set)
        self.rank = self.ranks.index(world.rank)
        self.size = len(self.ranks)
        self.hosts = [world.host_ids[r] for r in self.ranks]
        by_host: dict[str, list[int]] = {}
        for i, h in enumerate(self.hosts):
            by_host.setdefault(h, []).append(i)
        self.host_groups = list(by_host.values())  # group-local ranks per host, leader first
        self._transport: Transport = transport_class(transport, self.hosts, name)(self)
        self.transport = self._transport.name
        # device type → its transport (nccl for CUDA tensors), built on the first op whose tensors live there
        self._device_transports: dict[str, Transport] = {}
        self.algorithms = self._defaults(algorithm, planned or {})
        self._broken: BaseException | None = None
        # blocking all-reduces that are one native step: (dtype, numel, op, algorithm, stream) -> (stream, step function),
        # filled by a first call through the whole path (which validated op and dtype); see all_reduce
        self._one_step: dict[tuple, tuple[Stream, Callable[[torch.Tensor], None]]] = {}

    def _defaults(self, override: str, planned: Mapping[str, str]) -> dict[str, str]:
        """Per op, what ``algorithm="auto"`` in a call runs: the override if the op has an algorithm of that
        name, else the planner's choice if this transport runs it, else the transport's own auto."""
        if override != "auto":
            parse_algorithm(override, ALGORITHM_NAMES)  # a misspelt name fails here, not at the first op
        out = {}
        for op, allowed in ALGORITHMS.items():
            if override != "auto" and override.partition(":")[0] in allowed:
                self._transport.resolve(
                    op, parse_algorithm(override, allowed)[0], 0
                )  # a transport that cannot run it says so now
                out[op] = override
            elif op in planned:
                mapped = self._transport.planned(op, str(planned[op]))
                if mapped is not None:
                    out[op] = mapped
        return out

    def __repr__(self) -> str:
        return f"Communicator({self.name!r}, ranks={self.ranks}, transport={self.transport})"

    def algorithm_for(self, op: str, nbytes: int, algorithm: str = "auto") -> str:
        """The algorithm ``op`` runs on a message of ``nbytes`` for the call's ``algorithm`` (what traces record)."""
        if op not in ALGORITHMS:
            raise ValueError(f"op {op!r} unknown; use one of {tuple(ALGORITHMS)}")
        if self.size == 1 and op == "all_reduce":
            return "none"
        name, _ = self._algorithm(op, algorithm)
        return self._transport.resolve(op, name, nbytes)

    def sums_in_member_order(self, *ops: str) -> bool:
        """Whether each reduction in ``ops`` (called with ``algorithm="auto"``) gives every element the bits of one fixed
        sequence — its members' contributions added in member order — whatever the message's size and the element's
        place in it: then a buffer reduced in pieces equals it reduced whole. Two members always do (one addition,
        commutative); more on the transports whose algorithms say so (shm's direct ones)."""
        if self.size <= 2:
            return True
        return all(self._transport.member_order(op, self._algorithm(op, "auto")[0]) for op in ops)

    # ------------------------------------------------------------------------------ plumbing
    def _algorithm(self, op: str, algorithm: str) -> tuple[str, tuple[int, int] | None]:
        if algorithm == "auto":
            algorithm = self.algorithms.get(op, "auto")
            if algorithm == "auto":
                return "auto", None
        return parse_algorithm(algorithm, ALGORITHMS[op])

    def _submit(
        self,
        fn: Callable[[], None],
        desc: str,
        stream: str,
        async_op: bool,
        after: Any,
        nbytes: int = 0,
        algorithm: str = "",
        on: tuple[torch.Tensor, ...] = (),
    ) -> Work | None:
        """Run ``fn`` (the op on tensors ``on``) on ``stream``; a GPU's tensors get the device order of
        :mod:`nxdt.comm.cuda_streams`."""
        if self._broken is not None:
            raise CommError(f"nxdt.comm: group '{self.name}' is unusable after an earlier failure: {self._broken}")
        s = self.world.stream(stream)
        order = None
        if on and not on[0].is_cpu:
            from nxdt.comm.cuda_streams import device_order

            order = device_order(s, on)
        if s.role is None and self.world.tracer is None and after is None and not async_op:
            # the common blocking call: an error reaches this thread whether the op runs inline or queued
            # behind others (Work.wait re-raises it), so no wrapper closure per call (experiments/collectives-cpu)
            try:
                return s.submit(fn, lambda: f"group '{self.name}' {desc}", async_op=False, order=order)
            except CommError as exc:
                self._broken = exc
                raise
        if after is None:
            after = ()
        elif isinstance(after, Work):
            after = (after,)
        if s.role is not None or self.world.tracer is not None:
            return self._submit_instrumented(fn, desc, s, async_op, tuple(after), nbytes, algorithm, order)

        def guarded() -> None:
            try:
                fn()
            except CommError as exc:
                self._broken = exc
                raise

        return s.submit(guarded, f"group '{self.name}' {desc}", async_op=async_op, after=after, order=order)

    def _submit_instrumented(
        self,
        fn: Callable[[], None],
        desc: str,
        s: Stream,
        async_op: bool,
        after: tuple[Work, ...],
        nbytes: int,
        algorithm: str,
        order: DeviceOrder | None,
    ) -> Work | None:
        """``_submit`` for a prioritised stream or while tracing: pause (yielding stream) or mark the op
        running (high-priority stream), and record the op from when it starts (its ``after=`` done)."""
        world, tracer, role = self.world, self.world.tracer, s.role
        work_id = seq = None
        deps: list[int] = []
        if tracer is not None:
            work_id = next_work_id()
            seq = self._seq[s.name] = self._seq.get(s.name, -1) + 1
            deps = [w.id for w in after]

        def instrumented() -> None:
            if role == "yield":
                world.yield_point(s.name)
            elif role == "high":
                world.priority.begin()
            start = time.perf_counter()
            try:
                fn()
            except CommError as exc:
                self._broken = exc
                raise
            finally:
                if role == "high":
                    world.priority.end()
                if tracer is not None:
                    tracer.add(
                        desc.partition("(")[0],
                        s.name,
                        start,
                        time.perf_counter(),
                        group=self.name,
                        seq=seq,
                        bytes=nbytes,
                        token=work_id,
                        after=deps,
                        algorithm=algorithm,
                        transport=self.transport,
                    )

        return s.submit(instrumented, f"group '{self.name}' {desc}", async_op=async_op, after=after, work_id=work_id, order=order)

    def stream_tag(self, stream: str) -> int:
        return self.world.stream_tag(self.name, stream)

    def empty(self, numel: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
        """A flat buffer to communicate over this group every step: in shared memory when the transport reads
        peers' memory in place (``shm``: ``World.shared_empty``), else an ordinary tensor; on ``device`` (a CUDA
        device: its transport's buffer there). Keep it; don't allocate one per call."""
        if device is None or torch.device(device).type == "cpu":
            return self._transport.empty(numel, dtype)
        return self._on(torch.empty(0, device=device)).empty(numel, dtype)

    def transport_on(self, device: torch.device | str) -> str:
        """The transport an op on tensors on ``device`` takes (``transport`` for the CPU; for a GPU nccl, or cuda_ipc
        where members share it). The first call for a GPU is a collective step, as that device's first op is."""
        return self._on(torch.empty(0, device=device)).name

    def _on(self, *tensors: torch.Tensor) -> Transport:
        """The transport for an op on ``tensors`` (validated by ``_flat``): this communicator's own for CPU tensors,
        the device's (``DEVICE_TRANSPORTS``: nccl for CUDA) otherwise; every tensor of one op on one device."""
        if tensors[0].is_cpu and tensors[-1].is_cpu:  # the CPU path pays two flag reads (ops take one or two tensors)
            return self._transport
        device = tensors[0].device
        if any(t.device != device for t in tensors[1:]):
            raise ValueError(
                f"group '{self.name}': an op's tensors must be on one device, got {', '.join(str(t.device) for t in tensors)}"
            )
        if device.type == "cpu":
            return self._transport
        tr = self._device_transports.get(device.type)
        if tr is None:
            tr = self._device_transports[device.type] = device_transport(device.type, self)
        if tr.device != device:
            raise ValueError(
                f"group '{self.name}': this rank communicates from {tr.device}; a tensor on {device} must be moved there first"
            )
        return tr

    # ------------------------------------------------------------------------------ all-reduce
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: str = "sum",
        *,
        algorithm: str = "auto",
        stream: str = "default",
        async_op: bool = False,
        after: Any = None,
    ) -> Work | None:
        """In place. ``algorithm``: auto | direct | slice (shm) | ring | rhd | torus[:RxC] | hierarchical."""
        if not async_op and after is None and isinstance(tensor, torch.Tensor):
            # a small blocking call shaped like an earlier one: straight to its one native step — argument checks,
            # algorithm choice and plan were made by that first call; errors, deadlines and liveness checks stay in
            # the step (experiments/collectives-cpu: the Communicator layer was 3 µs of a 5 µs 1 KB all-reduce)
            quick = self._one_step.get((tensor.dtype, tensor.numel(), op, algorithm, stream))
            if (
                quick is not None
                and tensor.is_contiguous()
                and tensor.is_cpu
                and self._broken is None
                and self.world.tracer is None
            ):
                try:
                    if quick[0].run_inline(quick[1], tensor):
                        return None
                except CommError as exc:
                    self._broken = exc
                    raise
        t = _flat(tensor, "all_reduce tensor")
        check_op(op, t.dtype)
        if self.size == 1:
            return self._submit(lambda: None, "all_reduce", stream, async_op, after, 0, "none")
        name, grid = self._algorithm("all_reduce", algorithm)
        nbytes = t.numel() * t.element_size()
        tr = self._on(t)
        ran = tr.resolve("all_reduce", name, nbytes)
        work = self._submit(
            lambda: tr.all_reduce(t, op, ran, grid, stream), f"all_reduce({op})", stream, async_op, after, nbytes, ran, (t,)
        )
        if not async_op and after is None and t.is_cpu:
            self._remember_one_step(t, op, algorithm, ran, stream)
        return work

    def _remember_one_step(self, t: torch.Tensor, op: str, algorithm: str, ran: str, stream: str) -> None:
        """After a blocking all-reduce went through the whole path: cache its one-step function, if the transport
        runs calls of this shape as one step on a plain stream (no priority role: those need the instrumented path)."""
        s = self.world.stream(stream)
        if s.role is not None:
            return
        run = self._transport.one_step_all_reduce(t, op, ran, stream)
        if run is not None:
            if len(self._one_step) >= 64:
                self._one_step.clear()
            self._one_step[(t.dtype, t.numel(), op, algorithm, stream)] = (s, run)

    # ------------------------------------------------------------------------------ gather / scatter
    @overload
    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        algorithm: str = ...,
        stream: str = ...,
        async_op: Literal[True],
        after: Any = ...,
    ) -> Work: ...
    @overload
    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        algorithm: str = ...,
        stream: str = ...,
        async_op: bool = ...,
        after: Any = ...,
    ) -> Work | None: ...

    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        algorithm: str = "auto",
        stream: str = "default",
        async_op: bool = False,
        after: Any = None,
    ) -> Work | None:
        """``output`` holds every member's ``input`` in group-rank order. ``algorithm``: auto | direct | ring."""
        out, inp = _flat(output, "all_gather output"), _flat(input, "all_gather input")
        if out.numel() != self.size * inp.numel() or out.dtype != inp.dtype:
            raise ValueError(
                f"all_gather on group '{self.name}' (size {self.size}): output must hold size × input elements "
                f"of the same dtype; got output {out.numel()} {out.dtype}, input {inp.numel()} {inp.dtype}"
            )
        name, _ = self._algorithm("all_gather", algorithm)
        nbytes = out.numel() * out.element_size()
        tr = self._on(out, inp)
        ran = tr.resolve("all_gather", name, nbytes)
        return self._submit(
            lambda: tr.all_gather(out, inp, ran, stream), "all_gather", stream, async_op, after, nbytes, ran, (out, inp)
        )

    @overload
    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: str = ...,
        *,
        algorithm: str = ...,
        stream: str = ...,
        async_op: Literal[True],
        after: Any = ...,
    ) -> Work: ...
    @overload
    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: str = ...,
        *,
        algorithm: str = ...,
        stream: str = ...,
        async_op: bool = ...,
        after: Any = ...,
    ) -> Work | None: ...

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: str = "sum",
        *,
        algorithm: str = "auto",
        stream: str = "default",
        async_op: bool = False,
        after: Any = None,
    ) -> Work | None:
        """``output`` gets block ``rank`` of the reduction of every member's ``input``. ``algorithm``: auto | direct | ring."""
        out, inp = _flat(output, "reduce_scatter output"), _flat(input, "reduce_scatter input")
        if inp.numel() != self.size * out.numel() or out.dtype != inp.dtype:
            raise ValueError(
                f"reduce_scatter on group '{self.name}' (size {self.size}): input must hold size × output elements "
                f"of the same dtype; got input {inp.numel()} {inp.dtype}, output {out.numel()} {out.dtype}"
            )
        check_op(op, inp.dtype)
        name, _ = self._algorithm("reduce_scatter", algorithm)
        nbytes = inp.numel() * inp.element_size()
        tr = self._on(out, inp)
        ran = tr.resolve("reduce_scatter", name, nbytes)
        run = functools.partial(tr.reduce_scatter, out, inp, op, ran, stream)
        return self._submit(run, f"reduce_scatter({op})", stream, async_op, after, nbytes, ran, (out, inp))

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        *,
        algorithm: str = "auto",
        stream: str = "default",
        async_op: bool = False,
        after: Any = None,
    ) -> Work | None:
        """Splits are numbers of rows (dim 0), as in torch's all_to_all_single; None = equal splits.
        ``algorithm``: auto | direct | pairwise."""
        out, inp = _flat(output, "all_to_all output"), _flat(input, "all_to_all input")
        equal = input_split_sizes is None and output_split_sizes is None
        # elements per row: only split sizes (rows) need it; equal splits skip the view ops
        row = (
            1
            if equal
            else (
                max(1, input[0].numel())
                if input.dim() > 1 and input.shape[0]
                else (max(1, output[0].numel()) if output.dim() > 1 and output.shape[0] else 1)
            )
        )
        in_splits = self._splits(input_split_sizes, inp.numel(), row, "input")
        out_splits = self._splits(output_split_sizes, out.numel(), row, "output")
        if equal and out.numel() != inp.numel():
            raise ValueError(
                f"all_to_all on group '{self.name}': equal splits need output and input of the same size "
                f"({out.numel()} vs {inp.numel()}); pass split sizes for uneven exchanges"
            )
        name, _ = self._algorithm("all_to_all", algorithm)
        nbytes = inp.numel() * inp.element_size()
        tr = self._on(out, inp)
        ran = tr.resolve("all_to_all", name, nbytes)
        return self._submit(
            lambda: tr.all_to_all(out, inp, out_splits, in_splits, equal, ran, stream),
            "all_to_all",
            stream,
            async_op,
            after,
            nbytes,
            ran,
            (out, inp),
        )

    def _splits(self, splits: Sequence[int] | None, numel: int, row: int, which: str) -> list[int]:
        if splits is None:
            if numel % self.size:
                raise ValueError(
                    f"all_to_all on group '{self.name}': {which} has {numel} elements, not divisible by the group "
                    f"size {self.size}; pass {which}_split_sizes for uneven splits"
                )
            return [numel // self.size] * self.size
        splits = [int(s) * row for s in splits]
        if len(splits) != self.size or sum(splits) != numel or min(splits) < 0:
            raise ValueError(
                f"all_to_all on group '{self.name}': {which}_split_sizes must be {self.size} non-negative row counts "
                f"summing to the {which}'s rows"
            )
        return splits

    # ------------------------------------------------------------------------------ rooted
    def broadcast(
        self,
        tensor: torch.Tensor,
        root: int = 0,
        *,
        algorithm: str = "auto",
        stream: str = "default",
        async_op: bool = False,
        after: Any = None,
    ) -> Work | None:
        """``algorithm``: auto | direct | tree."""
        t = _flat(tensor, "broadcast tensor")
        self._check_rank(root, "root")
        name, _ = self._algorithm("broadcast", algorithm)
        nbytes = t.numel() * t.element_size()
        tr = self._on(t)
        ran = tr.resolve("broadcast", name, nbytes)
        return self._submit(
            lambda: tr.broadcast(t, root, ran, stream), f"broadcast(root={root})", stream, async_op, after, nbytes, ran, (t,)
        )

    def reduce(
        self,
        tensor: torch.Tensor,
        root: int = 0,
        op: str = "sum",
        *,
        algorithm: str = "auto",
        stream: str = "default",
        async_op: bool = False,
        after: Any = None,
    ) -> Work | None:
        """Result on ``root`` only (other members' tensors are left unchanged). ``algorithm``: auto | direct | tree."""
        t = _flat(tensor, "reduce tensor")
        self._check_rank(root, "root")
        check_op(op, t.dtype)
        name, _ = self._algorithm("reduce", algorithm)
        nbytes = t.numel() * t.element_size()
        tr = self._on(t)
        ran = tr.resolve("reduce", name, nbytes)
        return self._submit(
            lambda: tr.reduce(t, root, op, ran, stream), f"reduce({op}, root={root})", stream, async_op, after, nbytes, ran, (t,)
        )

    # ------------------------------------------------------------------------------ point to point
    def send(
        self, tensor: torch.Tensor, peer: int, *, stream: str = "default", async_op: bool = False, after: Any = None
    ) -> Work | None:
        """Returns once the data is in the peer's mailbox (same host) or handed to gloo; FIFO per peer and stream."""
        t = _flat(tensor, "send tensor")
        self._check_peer(peer)
        tr = self._on(t)
        return self._submit(
            lambda: tr.exchange([(peer, t)], [], stream, f"send to rank {self.ranks[peer]}"),
            "send",
            stream,
            async_op,
            after,
            t.numel() * t.element_size(),
            "p2p",
            (t,),
        )

    def recv(
        self, tensor: torch.Tensor, peer: int, *, stream: str = "default", async_op: bool = False, after: Any = None
    ) -> Work | None:
        t = _flat(tensor, "recv tensor")
        self._check_peer(peer)
        tr = self._on(t)
        return self._submit(
            lambda: tr.exchange([], [(peer, t)], stream, f"recv from rank {self.ranks[peer]}"),
            "recv",
            stream,
            async_op,
            after,
            t.numel() * t.element_size(),
            "p2p",
            (t,),
        )

    def send_recv(
        self,
        send_tensor: torch.Tensor,
        send_peer: int,
        recv_tensor: torch.Tensor,
        recv_peer: int,
        *,
        stream: str = "default",
        async_op: bool = False,
        after: Any = None,
    ) -> Work | None:
        """Send and receive at once (a pipeline or ring step) without ordering deadlocks."""
        s, r = _flat(send_tensor, "send tensor"), _flat(recv_tensor, "recv tensor")
        self._check_peer(send_peer)
        self._check_peer(recv_peer)
        tr = self._on(s, r)
        return self._submit(
            lambda: tr.exchange([(send_peer, s)], [(recv_peer, r)], stream, "send_recv"),
            "send_recv",
            stream,
            async_op,
            after,
            s.numel() * s.element_size(),
            "p2p",
            (s, r),
        )

    def barrier(self, *, stream: str = "default", timeout_s: float | None = None) -> None:
        if self.size == 1:
            return
        tr = self._transport
        self._submit(lambda: tr.barrier(stream), "barrier", stream, False, None, 0, self.transport)

    def _check_rank(self, r: int, what: str) -> None:
        if not isinstance(r, int) or not 0 <= r < self.size:
            raise ValueError(f"group '{self.name}': {what}={r!r} is not a group rank in 0..{self.size - 1}")

    def _check_peer(self, peer: int) -> None:
        self._check_rank(peer, "peer")
        if peer == self.rank:
            raise ValueError(f"group '{self.name}': rank {self.rank} cannot send to or receive from itself")

    # ------------------------------------------------------------------------------ objects (plain data and tensors, no pickle)
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        if self.rank == root:
            payload = torch.frombuffer(bytearray(objects.encode(obj)), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        self.broadcast(length, root)
        if self.rank != root:
            payload = torch.empty(int(length), dtype=torch.uint8)
        self.broadcast(payload, root)
        return obj if self.rank == root else objects.decode(payload.numpy().tobytes())

    def all_gather_object(self, obj: Any, *, stream: str = "default") -> list[Any]:
        data = objects.encode(obj)
        lengths = torch.zeros(self.size, dtype=torch.int64)
        self.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64), stream=stream)
        width = int(lengths.max())
        mine = torch.zeros(width, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        everyone = torch.empty(self.size * width, dtype=torch.uint8)
        self.all_gather(everyone, mine, stream=stream)
        return [objects.decode(everyone[i * width : i * width + int(lengths[i])].numpy().tobytes()) for i in range(self.size)]

    def close(self) -> None:
        self._one_step.clear()  # their channels' memory goes away with the transport
        self._transport.close()
        for tr in self._device_transports.values():
            tr.close()
        self._device_transports.clear()


class World:
    """All ranks of a job: host identities, streams, and the communicators."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: dist.Store,
        run_id: str,
        timeout_s: float,
        host_ids: list[str],
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        wait_policy: WaitPolicy = DEFAULT_WAIT,
        hosts_store: bool = False,
        native: bool | None = None,
        segment_key: bytes | None = None,
    ) -> None:
        native_path.use(native)  # before any channel exists: channels and kernels read it
        self.rank, self.world_size, self.store, self.run_id = rank, world_size, store, run_id
        self.hosts_store = hosts_store  # this process serves the store: it must outlive every other rank's use of it
        self.timeout_s, self.host_ids = timeout_s, host_ids
        self.slot_bytes, self.wait_policy = slot_bytes, wait_policy
        self._streams: dict[str, Stream] = {}
        # stream priority (nxdt.comm.stream): decided per stream when it is first used
        self.high_priority_streams: set[str] = {"tp"}
        self.yielding_streams: set[str] = {"fsdp"}
        self.priority = PriorityState(stall_s=0.005)
        self.tracer: Tracer | None = None
        self._names: set[str] = set()
        self._communicators: list[Communicator] = []
        self._tags: dict[tuple[str, str], int] = {}
        # the key of the run's segment names: the same on every rank (init_process); a World of its own: random
        self.segment_names = SegmentNames(run_id, segment_key if segment_key is not None else os.urandom(16))
        self.heap = Heap(self.segment_names, rank)
        self.multi_host = len(set(host_ids)) > 1
        if self.multi_host:
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore("gloo", store),
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
        world = self.new_communicator(list(range(world_size)), "world")
        assert world is not None  # every rank is a member
        self.world: Communicator = world

    def stream(self, name: str) -> Stream:
        s = self._streams.get(name)
        if s is None:
            role = "high" if name in self.high_priority_streams else "yield" if name in self.yielding_streams else None
            s = self._streams[name] = Stream(name, role)
        return s

    @property
    def yield_stall_s(self) -> float:
        """How long a high-priority op without progress keeps yielding streams paused (the no-deadlock bound)."""
        return self.priority.stall_s

    @yield_stall_s.setter
    def yield_stall_s(self, seconds: float) -> None:
        self.priority.stall_s = float(seconds)

    def yield_point(self, stream: str) -> None:
        """A chunk boundary of an op on yielding ``stream``: pause per the priority rule (traced)."""
        span = self.priority.pause()
        if span is not None and self.tracer is not None:
            self.tracer.add("yield", stream, span[0], span[1], reason="high-priority op running")

    def set_tracer(self, tracer: Tracer | None) -> None:
        """Record every collective issued from now on in ``tracer`` (None: stop recording)."""
        self.tracer = tracer

    def stream_tag(self, comm: str, stream: str) -> int:
        """A gloo message tag per (communicator, stream), so concurrent streams never take each other's messages."""
        key = (comm, stream)
        if key not in self._tags:
            self._tags[key] = (zlib.crc32(f"{comm}/{stream}".encode()) & 0x3FFFFF) + 1  # same on every rank
        return self._tags[key]

    def new_communicator(
        self,
        ranks: Sequence[int],
        name: str,
        link: EmulatedLink | None = None,
        *,
        transport: str = "auto",
        algorithm: str = "auto",
        planned: Mapping[str, str] | None = None,
    ) -> Communicator | None:
        """Called by every rank with the same arguments in the same order; None on non-members.

        ``link``: emulate this link's latency and bandwidth on every transfer of the communicator.
        ``transport``: auto (by locality: one host → shm, else p2p) | shm | p2p | gloo (:mod:`nxdt.comm.transport`).
        ``algorithm``: run this algorithm for every op that has one of that name (``comm.algorithm``); ``auto``:
        ``planned`` (op → algorithm, e.g. ``Plan.algorithms[dim]``) where the transport runs it, else its own choice."""
        if link is not None and not isinstance(link, EmulatedLink):
            raise TypeError(f"communicator '{name}': link must be an nxdt.comm.EmulatedLink, got {type(link).__name__}")
        if name in self._names:
            raise ValueError(f"a communicator named '{name}' exists already")
        ranks = [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(
                f"communicator '{name}': ranks {ranks} must be distinct ranks of the world (0..{self.world_size - 1})"
            )
        self._names.add(name)
        if self.rank not in ranks:
            return None
        comm = Communicator(self, name, ranks, link, transport, algorithm, planned)
        self._communicators.append(comm)
        return comm

    def shared_empty(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised tensor in this rank's shared memory: collectives on the ``shm`` transport read it
        in place instead of copying it into their slot (see :mod:`nxdt.comm.heap`). For buffers communicated
        every step; the memory is released when the world closes."""
        return self.heap.empty(shape, dtype)

    def close(self) -> None:
        if not hasattr(self, "store"):
            return  # closed already
        for s in self._streams.values():
            s.close()
        for c in self._communicators:
            c.close()
        self._communicators.clear()
        self.heap.close()
        if self.multi_host and dist.is_initialized():
            dist.destroy_process_group()
        self._leave_store()
        # this World's reference to the store (its last, unless a gloo transport group holds one): rank 0's server
        # stops with it, so a later join in this process (a script's second Trainer) can serve on the same port
        del self.store

    def _leave_store(self) -> None:
        """The rank serving the store stops it only after every other rank has left (bounded): a rank still
        reading from it — the end of its own init, a gloo handshake — would otherwise see its connection reset."""
        try:
            if not self.hosts_store:
                self.store.add("left", 1)
                return
            deadline = time.monotonic() + min(self.timeout_s, 30.0)
            while self.store.add("left", 0) < self.world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.002)
        except Exception:  # the store or its server is gone already: nothing left to protect
            pass


_JOINS = itertools.count(1)  # numbers this process's init_process calls


def _joined(keys: SignedKeys, names: list[str], ranks: list[int], where: str) -> list[str]:
    """The values of ``names`` (``ranks[i]`` writes ``names[i]`` when it joins), or one error naming the ranks that
    never joined — rather than the store's "wait timeout … keys: host/1". Only values signed with the run's secret
    are read (``SignedKeys``): a forged one is refused."""
    store_gone = (
        f"nxdt.comm: the rank serving the rendezvous store stopped while this rank was joining the run ({where}): "
        f"its own error names the ranks that never joined"
    )
    try:
        return [keys.get(name).decode() for name in names]
    except dist.DistNetworkError as exc:  # the serving rank gave up first (it started first) and its store closed
        raise CommError(store_gone) from exc
    except CommTimeoutError as exc:
        try:
            absent = [rank for rank, name in zip(ranks, names) if not keys.store.check([name])]
        except dist.DistNetworkError as gone:  # ... as this rank's own wait ran out: its connection is reset
            raise CommError(store_gone) from gone
        raise CommTimeoutError(
            f"nxdt.comm: rank(s) {absent} never joined the run ({where}): check that they were started, "
            f"with the same MASTER_ADDR and MASTER_PORT",
            missing_ranks=absent,
        ) from exc


def init_process(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    *,
    timeout_s: float = 120.0,
    run_id: str | None = None,
    store_is_server: bool = False,
    host_id: str | None = None,
    slot_bytes: int = DEFAULT_SLOT_BYTES,
    wait_policy: WaitPolicy | None = None,
    native: bool | None = None,
    secret: bytes | None = None,
    store_file: str | None = None,
    store: dist.Store | None = None,
) -> World:
    """Join the job: connect to (or host) the store, agree on a run id, exchange host identities.

    ``secret``: the run's store secret (default: ``NXDT_STORE_SECRET``); the values this join reads back are
    signed with it and a forged one is refused (:mod:`nxdt.comm.store`). ``store_file``: every rank opens the run's
    private store file there instead of a TCP store (``run_local``; a local ``nxdt train`` sets ``NXDT_STORE_FILE``).
    ``store``: join through this existing store instead (torch.distributed's default group's, which holds the address
    and port already: a script's earlier DDPStrategy fit); nobody serves one then.

    ``slot_bytes`` (shm chunk size, every rank must agree) and ``wait_policy`` tune the shared-memory
    transport; the defaults are what experiments/collectives-cpu measured best on a 2-core host.
    ``native=False`` runs the shm transport on its torch fallback instead of the C extension (a test and
    debugging knob, process-wide; the results are bit-identical, :mod:`nxdt.comm.native`)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    try:
        if store is not None:
            store_is_server = False  # someone else's: it outlives this World
        elif store_file is not None:
            store = open_file_store(store_file, timedelta(seconds=timeout_s))
            store_is_server = False  # no server: nobody has to outlive the others' use of it
        elif store_is_server:  # listening on master_addr's interface only, not on every interface of the host
            store = serve_store(master_addr, int(master_port), world_size, timedelta(seconds=timeout_s))
        else:  # a local nxdt run's private store file (NXDT_STORE_FILE), else the TCP store at master_addr
            store = connect_store(master_addr, int(master_port), timedelta(seconds=timeout_s))
    except StoreAccessError:
        raise
    except Exception as exc:
        if store_is_server and isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
            raise CommError(
                f"nxdt.comm: rank {rank} cannot serve the rendezvous store on {master_addr}:{master_port}: the port is "
                f"in use — by another process, or by an earlier World of this process that is still open (a script's "
                f"earlier Trainer: call trainer.strategy.close() on every rank before the next one)"
            ) from exc
        raise CommTimeoutError(
            f"nxdt.comm: rank {rank} could not reach the rendezvous store at {master_addr}:{master_port} ({exc})"
        ) from exc
    # NXDT_ATTEMPT (multi-node: the rendezvous round) is the same on every node; agents' restart counts need not be
    attempt = os.environ.get("NXDT_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # one process may join several times (a script's fit, then test: each sets up its strategy anew); every
    # rank runs the same sequence, so the count agrees, and no join reads the keys an earlier one left
    namespace = f"nxdt/{run_id or 'run'}/{attempt}/{next(_JOINS)}/"
    where = f"{world_size} ranks at {master_addr}:{master_port}, {timeout_s:g} s"
    store = dist.PrefixStore(namespace, store)
    secret = secret if secret is not None else secret_from_env()
    keys = SignedKeys(store, secret, timeout_s, f" ({where})")
    if rank == 0:
        remove_stale_segments()
        keys.set("run_nonce", uuid.uuid4().hex)
    nonce = _joined(keys, ["run_nonce"], [0], where)[0]
    if not nonce.isalnum():  # it names shared-memory segments
        raise CommError(f"nxdt.comm: the run nonce in the rendezvous store is not alphanumeric ({where})")
    # short: segment names must stay well below NAME_MAX; only 8 of the nonce's 32 digits are shown in them
    full_run_id = f"{(run_id or 'run')[:24]}.{nonce[:8]}"
    # the names' key: the whole nonce, under the run's secret when there is one (a store others can read — several
    # hosts' TCP store — then reveals nothing); without one, as private as the store (shm.SegmentNames)
    segment_key = hmac.new(secret or b"nxdt-segments", nonce.encode(), hashlib.sha256).digest()
    keys.set(f"host/{rank}", host_id or host_identity())
    host_ids = _joined(keys, [f"host/{r}" for r in range(world_size)], list(range(world_size)), where)
    local_ranks = host_ids.count(host_ids[rank])
    return World(
        rank,
        world_size,
        store,
        full_run_id,
        timeout_s,
        host_ids,
        slot_bytes,
        wait_policy or policy_for(local_ranks),
        hosts_store=store_is_server,
        native=native,
        segment_key=segment_key,
    )


def init_from_env(*, timeout_s: float = 120.0, run_id: str | None = None) -> World:
    """``init_process`` from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun / elastic agent / Slurm wrappers)."""
    env = os.environ
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise CommError(
            f"nxdt.comm.init_from_env: environment variables {missing} are not set — start the workers with nxdt train or torchrun"
        )
    rank = int(env["RANK"])
    return init_process(
        rank,
        int(env["WORLD_SIZE"]),
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        timeout_s=timeout_s,
        run_id=run_id or env.get("TORCHELASTIC_RUN_ID"),
        store_is_server=rank == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
    )
