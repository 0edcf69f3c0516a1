"""Transports: how one communicator's collectives move bytes, behind one interface.

A :class:`~nxdt.comm.world.Communicator` checks its arguments, picks the algorithm name and hands the op
to its transport; it never asks which transport it has. A transport is chosen per communicator by name
through :data:`TRANSPORTS` (``World.new_communicator(..., transport=)``, the ``comm.transport`` key):
``auto`` picks by locality — every member on one host → ``shm``, else ``p2p``.

* ``shm`` (one host): the direct algorithms of :mod:`nxdt.comm.shm_algorithms` over shared-memory
  channels, reading peers' slots (and shared tensors) in place; an explicitly named generic algorithm
  (``ring``, ``rhd``, ``torus``, ``tree``, ``pairwise``) runs over shm mailboxes instead.
* ``p2p`` (any placement): the generic algorithms of :mod:`nxdt.comm.algorithms` over
  :class:`~nxdt.comm.p2p.Links` — shm mailboxes to peers on the same host, gloo point-to-point to
  other hosts; ``hierarchical`` all-reduce when several hosts hold several members.
* ``gloo`` (:mod:`nxdt.comm.gloo`): torch.distributed's own gloo collectives, one process group per
  communicator and stream — the seam where a torch.distributed transport (NCCL on GPUs) plugs in.

Algorithm names are per op (:data:`ALGORITHMS`). A communicator's *default* for an op (what ``auto`` in
a call means) comes from an explicit override (``comm.algorithm``) if the op has an algorithm of that
name, else from the planner's choice if the transport can run it (:meth:`Transport.planned`), else the
transport's own ``auto``. :meth:`Transport.resolve` names what actually runs (traces, ``comm-test
--show-algorithm``).

Adding a transport: subclass :class:`Transport`, implement the ops, and register it with
:func:`register_transport`; nothing else in nxdt.comm changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence, Union, cast

import torch

from nxdt.comm import algorithms as generic, shm_algorithms as algo
from nxdt.comm.emulate import Pacer
from nxdt.comm.errors import CommMismatchError
from nxdt.comm.p2p import Links
from nxdt.comm.reduce import LOW_PRECISION
from nxdt.comm.shm import ShmChannel

if TYPE_CHECKING:
    from nxdt.comm.world import Communicator

# The algorithm names each op accepts (a call's ``algorithm=``); "torus:RxC" gives the grid explicitly.
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("auto", "direct", "slice", "ring", "rhd", "torus", "hierarchical"),
    "all_gather": ("auto", "direct", "ring"),
    "reduce_scatter": ("auto", "direct", "ring"),
    "all_to_all": ("auto", "direct", "pairwise"),
    "broadcast": ("auto", "direct", "tree"),
    "reduce": ("auto", "direct", "tree"),
}
ALGORITHM_NAMES = tuple(dict.fromkeys(n for names in ALGORITHMS.values() for n in names))
RHD_MAX_BYTES = 256 << 10  # across hosts: fewer, latency-bound steps below this, ring above
GENERIC = {
    "all_reduce": "ring",
    "all_gather": "ring",
    "reduce_scatter": "ring",
    "all_to_all": "pairwise",
    "broadcast": "tree",
    "reduce": "tree",
}  # what a Links-based transport runs for a name it has no algorithm of


def parse_algorithm(algorithm: str, allowed: Sequence[str]) -> tuple[str, tuple[int, int] | None]:
    """(name, torus grid or None); ValueError naming the allowed names."""
    if algorithm == "auto":
        return "auto", None
    name, _, grid = str(algorithm).partition(":")
    if name not in allowed:
        raise ValueError(f"algorithm {algorithm!r} unknown here; use one of {tuple(allowed)}")
    if grid:
        if name != "torus":
            raise ValueError(f"algorithm {algorithm!r}: only torus takes a grid ('torus:RxC')")
        try:
            rows, cols = (int(v) for v in grid.lower().split("x"))
        except ValueError:
            raise ValueError(f"algorithm {algorithm!r}: write the torus grid as 'torus:RxC', e.g. 'torus:2x2'") from None
        return name, (rows, cols)
    return name, None


class Transport:
    """What a communicator's ops run on. ``name`` is what ``Communicator.transport`` reports.

    Each op method is called on the communicator's stream with validated, flat, contiguous CPU tensors,
    group-local ranks and the algorithm name :meth:`resolve` returned for it; it returns when the op is
    complete on this rank and raises :class:`~nxdt.comm.errors.CommError` subclasses on failure.
    """

    name = "?"
    device = torch.device("cpu")  # where the tensors it moves live (a device transport: this rank's device)

    def __init__(self, comm: "Communicator") -> None:
        self.comm = comm

    # --- algorithm choice
    def planned(self, op: str, name: str) -> str | None:
        """The planner's algorithm ``name`` for ``op`` as this transport runs it, or None to keep ``auto``."""
        return None

    def resolve(self, op: str, name: str, nbytes: int) -> str:
        """The algorithm ``op`` runs for the (validated) ``name`` on a message of ``nbytes``: ``auto`` resolved."""
        raise NotImplementedError

    def member_order(self, op: str, name: str) -> bool:
        """Whether reduction ``op`` under algorithm ``name`` (unresolved) adds every element's contributions in member
        order whatever the message's size and the element's place in it (False unless a transport knows it does)."""
        return False

    # --- ops (called on the stream's thread)
    def all_reduce(self, t: torch.Tensor, op: str, name: str, grid: tuple[int, int] | None, stream: str) -> None:
        raise NotImplementedError

    def one_step_all_reduce(self, t: torch.Tensor, op: str, name: str, stream: str) -> Callable[[torch.Tensor], None] | None:
        """A function doing a blocking all-reduce shaped like ``t`` (dtype, numel; ``op``, resolved ``name``) in one
        step on a flat contiguous tensor, for the Communicator's cache; None (the default) when there is none."""
        return None

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, name: str, stream: str) -> None:
        raise NotImplementedError

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str, name: str, stream: str) -> None:
        raise NotImplementedError

    def all_to_all(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        equal: bool,
        name: str,
        stream: str,
    ) -> None:
        """Splits in elements; ``equal``: the caller passed none (every block the same size)."""
        raise NotImplementedError

    def broadcast(self, t: torch.Tensor, root: int, name: str, stream: str) -> None:
        raise NotImplementedError

    def reduce(self, t: torch.Tensor, root: int, op: str, name: str, stream: str) -> None:
        raise NotImplementedError

    def exchange(
        self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], stream: str, desc: str
    ) -> None:
        """Point to point: send and receive these messages (group-local peers) at once."""
        raise NotImplementedError

    def barrier(self, stream: str) -> None:
        raise NotImplementedError

    # --- buffers and lifetime
    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer this transport moves cheapest (see ``Communicator.empty``)."""
        return torch.empty(numel, dtype=dtype)

    def close(self) -> None:
        pass


class _LinkTransport(Transport):
    """Shared by ``shm`` and ``p2p``: shm channels (per stream and member subset), point-to-point
    :class:`Links` (per stream), and the generic algorithms written against Links."""

    def __init__(self, comm: "Communicator") -> None:
        super().__init__(comm)
        self._channels: dict[tuple, ShmChannel] = {}
        self._links: dict[str, Links] = {}

    def _pacer(self, stream: str) -> Pacer | None:
        """What runs after each step on ``stream``: nothing for an ordinary stream of an unemulated group."""
        comm = self.comm
        s = comm.world.stream(stream)
        return None if comm.link is None and s.role is None else Pacer(comm.link, s, comm.world)

    def channel(self, stream: str, members: Sequence[int] | None = None, op: str = "a collective") -> ShmChannel:
        key = (stream, tuple(members) if members else None)
        ch = self._channels.get(key)
        if ch is None:
            comm, world = self.comm, self.comm.world
            ranks = [comm.ranks[i] for i in members] if members else comm.ranks
            stream_id = stream if not members else f"{stream}.m{'-'.join(str(m) for m in members)}"
            ch = ShmChannel(
                world.segment_names,
                comm.name,
                stream_id,
                ranks,
                ranks.index(world.rank),
                world.timeout_s,
                slot_bytes=world.slot_bytes,
                first_op=op,
                wait=world.wait_policy,
            )
            ch.pacer = self._pacer(stream)
            ch.heap = world.heap
            self._channels[key] = ch
        return ch

    def links(self, stream: str, desc: str) -> Links:
        links = self._links.get(stream)
        if links is None:
            links = self._links[stream] = Links(self.comm, stream)
            links.pacer = self._pacer(stream)
        links.desc = desc
        return links

    # --- generic algorithms over Links
    def _generic_all_reduce(self, t: torch.Tensor, op: str, name: str, grid: tuple[int, int] | None, stream: str) -> None:
        comm = self.comm
        low = t.dtype in LOW_PRECISION
        work = t.float() if low else t  # fp32 accumulation, rounded once at the end
        if name == "hierarchical":
            self._hierarchical_all_reduce(work, op, stream)
        else:
            members = list(range(comm.size))
            links = self.links(stream, f"all_reduce({op}, {name})")
            if name == "ring":
                generic.ring_all_reduce(links, members, comm.rank, work, op, comm.size)
            elif name == "rhd":
                generic.rhd_all_reduce(links, members, comm.rank, work, op, comm.size)
            else:
                generic.torus_all_reduce(links, members, comm.rank, work, op, comm.size, grid or generic.default_grid(comm.size))
        if low:
            t.copy_(work)

    def _hierarchical_all_reduce(self, work: torch.Tensor, op: str, stream: str) -> None:
        """Reduce to each host's leader over shm, all-reduce among leaders (p2p), broadcast back over shm."""
        comm = self.comm
        mine = next(g for g in comm.host_groups if comm.rank in g)
        red = "sum" if op == "avg" else op
        if len(mine) > 1:
            algo.reduce(self.channel(stream, mine, op="all_reduce(hierarchical)"), work, 0, red)
        if comm.rank == mine[0]:
            leaders = [g[0] for g in comm.host_groups]
            if len(leaders) > 1:
                links = self.links(stream, f"all_reduce({op}, hierarchical)")
                fn = generic.rhd_all_reduce if work.numel() * work.element_size() <= RHD_MAX_BYTES else generic.ring_all_reduce
                fn(links, leaders, leaders.index(comm.rank), work, red, 1)
            if op == "avg":
                work.div_(comm.size)
        if len(mine) > 1:
            algo.broadcast(self.channel(stream, mine, op="all_reduce(hierarchical)"), work, 0)

    def _ring_all_gather(self, out: torch.Tensor, inp: torch.Tensor, stream: str) -> None:
        comm, m = self.comm, inp.numel()
        out[comm.rank * m : (comm.rank + 1) * m].copy_(inp)
        bl = [(j * m, (j + 1) * m) for j in range(comm.size)]
        generic.ring_all_gather_blocks(self.links(stream, "all_gather(ring)"), list(range(comm.size)), comm.rank, out, bl)

    def _ring_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str, stream: str) -> None:
        comm, m = self.comm, out.numel()
        work = inp.float() if inp.dtype in LOW_PRECISION else inp.clone()
        bl = [(j * m, (j + 1) * m) for j in range(comm.size)]
        generic.ring_reduce_scatter_blocks(
            self.links(stream, f"reduce_scatter({op}, ring)"),
            list(range(comm.size)),
            comm.rank,
            work,
            bl,
            "sum" if op == "avg" else op,
        )
        mine = work[comm.rank * m : (comm.rank + 1) * m]
        if op == "avg":
            mine.div_(comm.size)
        out.copy_(mine)

    def _pairwise_all_to_all(self, out, inp, out_splits, in_splits, stream) -> None:
        comm, n = self.comm, self.comm.size
        if out.numel() and inp.numel() and out.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr():
            inp = inp.clone()  # exchanges write out while later rounds still read inp
        table = torch.zeros(n * 2 * n, dtype=torch.int64)
        self._ring_all_gather(table, torch.tensor(list(in_splits) + list(out_splits), dtype=torch.int64), stream)
        rows = table.view(n, 2 * n).tolist()
        for s in range(n):
            for d in range(n):
                if rows[s][d] != rows[d][n + s]:
                    raise CommMismatchError(
                        f"nxdt.comm: group '{comm.name}' all_to_all: rank {comm.ranks[s]} sends {rows[s][d]} elements "
                        f"to rank {comm.ranks[d]}, which expects {rows[d][n + s]} — input and output split sizes must agree"
                    )
        generic.pairwise_all_to_all(
            self.links(stream, "all_to_all(pairwise)"), list(range(n)), comm.rank, out, inp, out_splits, in_splits
        )

    def _tree_reduce(self, t: torch.Tensor, root: int, op: str, stream: str) -> None:
        comm = self.comm
        work = t.float() if t.dtype in LOW_PRECISION else t.clone()
        links = self.links(stream, f"reduce({op}, root={root}, tree)")
        if generic.tree_reduce(links, list(range(comm.size)), comm.rank, work, root, "sum" if op == "avg" else op):
            if op == "avg":
                work.div_(comm.size)
            t.copy_(work)

    def _tree_broadcast(self, t: torch.Tensor, root: int, stream: str) -> None:
        comm = self.comm
        generic.tree_broadcast(self.links(stream, f"broadcast(root={root}, tree)"), list(range(comm.size)), comm.rank, t, root)

    def exchange(self, sends, recvs, stream: str, desc: str) -> None:
        self.links(stream, desc).exchange(sends, recvs)

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()
        for links in self._links.values():
            links.close()
        self._links.clear()


class ShmTransport(_LinkTransport):
    """Every member on one host: direct algorithms over shared memory (module docstring)."""

    name = "shm"
    DIRECT = ("auto", "direct", "slice", "hierarchical")  # on one host a hierarchy is the direct algorithm

    def resolve(self, op: str, name: str, nbytes: int) -> str:
        if name in self.DIRECT:
            return "shm" if name in ("auto", "hierarchical") else name
        return name

    def member_order(self, op: str, name: str) -> bool:
        # the direct algorithms (shm_algorithms); the generic ring/rhd/torus/tree place an element's sum by position
        return self.resolve(op, name, 0) in ("shm", "direct", "slice", "auto")

    def all_reduce(self, t, op, name, grid, stream) -> None:
        if name in ("shm", "direct", "slice"):
            algo.all_reduce(self.channel(stream, op="all_reduce"), t, op, "auto" if name == "shm" else name)
        else:
            self._generic_all_reduce(t, op, name, grid, stream)

    def one_step_all_reduce(self, t, op, name, stream):
        if name not in ("shm", "direct", "slice"):
            return None
        return algo.one_step_all_reduce(self.channel(stream, op="all_reduce"), t, op, "auto" if name == "shm" else name)

    def all_gather(self, out, inp, name, stream) -> None:
        if name == "ring":
            self._ring_all_gather(out, inp, stream)
        else:
            algo.all_gather(self.channel(stream, op="all_gather"), out, inp)

    def reduce_scatter(self, out, inp, op, name, stream) -> None:
        if name == "ring":
            self._ring_reduce_scatter(out, inp, op, stream)
        else:
            algo.reduce_scatter(self.channel(stream, op="reduce_scatter"), out, inp, op)

    def all_to_all(self, out, inp, out_splits, in_splits, equal, name, stream) -> None:
        if name == "pairwise":
            self._pairwise_all_to_all(out, inp, out_splits, in_splits, stream)
        elif equal:
            algo.all_to_all_equal(self.channel(stream, op="all_to_all"), out, inp)
        else:
            aliased = out.numel() and inp.numel() and out.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr()
            algo.all_to_all(self.channel(stream, op="all_to_all"), out, inp.clone() if aliased else inp, out_splits, in_splits)

    def broadcast(self, t, root, name, stream) -> None:
        if name == "tree":
            self._tree_broadcast(t, root, stream)
        else:
            algo.broadcast(self.channel(stream, op="broadcast"), t, root)

    def reduce(self, t, root, op, name, stream) -> None:
        if name == "tree":
            self._tree_reduce(t, root, op, stream)
        else:
            algo.reduce(self.channel(stream, op="reduce"), t, root, op)

    def barrier(self, stream: str) -> None:
        algo.barrier(self.channel(stream, op="barrier"))

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.comm.size > 1:  # in this rank's shared memory: peers read it in place (World.shared_empty)
            return self.comm.world.shared_empty((numel,), dtype)
        return torch.empty(numel, dtype=dtype)


class P2PTransport(_LinkTransport):
    """The generic algorithms over point-to-point links (module docstring); places members anywhere."""

    name = "p2p"

    def planned(self, op: str, name: str) -> str | None:
        base, _, grid = name.partition(":")
        if base not in ALGORITHMS.get(op, ()) or base in ("auto", "direct", "slice"):
            return None  # the planner's one-shot "direct" is the shm family; here auto picks by size
        if grid:
            try:
                rows, cols = (int(v) for v in grid.lower().split("x"))
            except ValueError:
                return None
            if rows * cols != self.comm.size:
                return None
        return name

    def _multi_host_hierarchy(self) -> bool:
        groups = self.comm.host_groups
        return len(groups) > 1 and any(len(g) > 1 for g in groups)

    def resolve(self, op: str, name: str, nbytes: int) -> str:
        if op == "all_reduce":
            if name == "hierarchical" and not self._multi_host_hierarchy():
                name = "auto"  # one host, or one member per host: nothing to do in shared memory
            if name in ("auto", "direct", "slice"):
                if self._multi_host_hierarchy():
                    return "hierarchical"
                return "rhd" if nbytes <= RHD_MAX_BYTES else "ring"
            return name
        return name if name not in ("auto", "direct") else GENERIC[op]

    def all_reduce(self, t, op, name, grid, stream) -> None:
        self._generic_all_reduce(t, op, name, grid, stream)

    def all_gather(self, out, inp, name, stream) -> None:
        self._ring_all_gather(out, inp, stream)

    def reduce_scatter(self, out, inp, op, name, stream) -> None:
        self._ring_reduce_scatter(out, inp, op, stream)

    def all_to_all(self, out, inp, out_splits, in_splits, equal, name, stream) -> None:
        self._pairwise_all_to_all(out, inp, out_splits, in_splits, stream)

    def broadcast(self, t, root, name, stream) -> None:
        self._tree_broadcast(t, root, stream)

    def reduce(self, t, root, op, name, stream) -> None:
        self._tree_reduce(t, root, op, stream)

    def barrier(self, stream: str) -> None:
        comm = self.comm
        generic.rhd_all_reduce(
            self.links(stream, "barrier"), list(range(comm.size)), comm.rank, torch.zeros(1, dtype=torch.int32), "sum", 1
        )


def _gloo() -> type[Transport]:
    from nxdt.comm.gloo import GlooTransport  # torch.distributed's process groups: loaded only when asked for

    return GlooTransport


# a Transport subclass, or a function returning one (imports it only when asked for)
TransportFactory = Union[type[Transport], Callable[[], type[Transport]]]
TRANSPORTS: dict[str, TransportFactory] = {"shm": ShmTransport, "p2p": P2PTransport, "gloo": _gloo}
TRANSPORT_NAMES = ("auto",) + tuple(TRANSPORTS)


def register_transport(name: str, factory: TransportFactory) -> None:
    """Make ``transport=name`` build ``factory(communicator)`` (a Transport subclass, or a function
    returning one: called with no arguments first if it is not a Transport subclass)."""
    if name == "auto":
        raise ValueError("'auto' is the locality choice, not a transport name")
    TRANSPORTS[name] = factory


def _cuda_transport(comm: "Communicator") -> Transport:
    from nxdt.comm.nccl import cuda_transport  # torch's ProcessGroupNCCL: loaded only when a CUDA tensor arrives

    return cuda_transport(comm)


# device type → what builds the transport every op on tensors of that device takes, whatever ``comm.transport``
# chose for the CPU (that key names host transports: shm, p2p, gloo); ``Communicator`` builds it on the first such
# op, on every member at the same op (a collective step: CUDA's looks up where the members' GPUs are)
DEVICE_TRANSPORTS: dict[str, Callable[["Communicator"], Transport]] = {"cuda": _cuda_transport}


def transport_name(device_type: str, requested: str, hosts: Sequence[str], devices: Sequence[str] = ()) -> str:
    """The transport a communicator on ``hosts`` runs an op on ``device_type`` tensors over, ``comm.transport``
    being ``requested``: CPU tensors the requested host transport (auto: shm on one host, else p2p); CUDA tensors
    ``nccl``, unless two members share one GPU (``devices``: each member's ``host/index``), which NCCL refuses:
    then ``cuda_ipc`` (the members' device buffers opened by each other; ``staged`` through host memory where CUDA
    IPC is unavailable); any other device is refused."""
    if device_type == "cpu":
        return ("shm" if len(set(hosts)) == 1 else "p2p") if requested == "auto" else requested
    if device_type not in DEVICE_TRANSPORTS:
        raise ValueError(f"tensors on {device_type} have no transport; nxdt.comm works on cpu and {', '.join(DEVICE_TRANSPORTS)}")
    return "cuda_ipc" if len(set(devices)) < len(devices) else "nccl"


def device_transport(device_type: str, comm: "Communicator") -> Transport:
    """The transport for ``comm``'s ops on tensors of ``device_type`` (a key of :data:`DEVICE_TRANSPORTS`)."""
    build = DEVICE_TRANSPORTS.get(device_type)
    if build is None:
        raise ValueError(
            f"communicator '{comm.name}': tensors on {device_type} have no transport; use cpu or {', '.join(DEVICE_TRANSPORTS)}"
        )
    return build(comm)


def transport_class(requested: str, hosts: Sequence[str], group: str) -> type[Transport]:
    """The Transport class for ``requested`` (auto | a registered name) on members living on ``hosts``."""
    one_host = len(set(hosts)) == 1
    requested = transport_name("cpu", requested, hosts)
    factory = TRANSPORTS.get(requested)
    if factory is None:
        raise ValueError(f"communicator '{group}': transport {requested!r} unknown; use one of {('auto', *TRANSPORTS)}")
    if requested == "shm" and not one_host:
        raise ValueError(
            f"communicator '{group}': transport 'shm' needs every member on one host, but its members are on "
            f"{len(set(hosts))} hosts; use transport 'auto' or 'p2p'"
        )
    if isinstance(factory, type) and issubclass(factory, Transport):
        return factory
    return cast(Callable[[], type[Transport]], factory)()  # a function returning the class
