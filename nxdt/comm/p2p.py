"""Point-to-point links: the small interface the generic algorithms (:mod:`nxdt.comm.algorithms`) run on.

``Links.exchange(sends, recvs)`` moves a set of messages to and from group-local peers at once (so a
ring step can send right while receiving from the left without deadlock). Each peer is reached by
the cheapest path:

* ``shm`` mailbox for a peer on the same host: a segment per directed pair owned by the sender,
  two slots, a ``sent`` counter the sender bumps and an ``acked`` counter the receiver bumps
  (futex-woken both ways). Sends complete without the receiver while a slot is free, messages
  between a pair on a stream are FIFO, and each chunk carries a fingerprint (dtype, count) the
  receiver checks;
* ``p2p`` for a peer on another host: torch.distributed ``isend``/``irecv`` (gloo on CPU) with a tag
  per (communicator, stream), so concurrent streams never take each other's messages.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist

from nxdt.comm.errors import CommMismatchError, CommTimeoutError, PeerDiedError
from nxdt.comm.reduce import dtype_code
from nxdt.comm.shm import FP_WORDS, W_FINGERPRINT, W_FP_DIGEST, Segment, describe_fingerprint, open_peers
from nxdt.comm.waiting import SpinBudget, fence, pid_alive, wait_until, wait_word, wake

if TYPE_CHECKING:
    from nxdt.comm.emulate import Pacer
    from nxdt.comm.world import Communicator

MAILBOX_SLOT_BYTES = 512 << 10
W_SENT, W_ACKED, W_RECEIVER_PID = 6, 7, 8
OP_P2P = 7


class _Transfer:
    __slots__ = ("peer", "flat", "bytes", "pos", "count", "fp")

    def __init__(self, peer: int, t: torch.Tensor) -> None:
        self.peer = peer
        self.flat = t.view(-1).view(torch.uint8)  # callers pass contiguous tensors: we must write into them
        self.bytes = self.flat.numel()
        self.pos = 0
        self.count = 0  # chunks moved
        self.fp = (OP_P2P, dtype_code(t.dtype), t.numel(), 0)

    def chunks(self) -> int:
        return max(1, -(-self.bytes // MAILBOX_SLOT_BYTES))


class Links:
    """Point-to-point messaging of one communicator on one stream (see the module docstring)."""

    def __init__(self, comm: "Communicator", stream: str) -> None:
        self.comm, self.stream = comm, stream
        self.world = comm.world
        self.tag = self.world.stream_tag(comm.name, stream)
        self._out: dict[int, Segment] = {}
        self._in: dict[int, Segment] = {}
        self._sent: dict[int, int] = {}
        self._recvd: dict[int, int] = {}
        self.desc = "send/recv"
        self.spin = SpinBudget(comm.world.wait_policy)
        self.pacer: Pacer | None = None  # each exchange is one step

    # -------------------------------------------------------------------------------- shm mailboxes
    def _path(self, src: int, dst: int) -> str:
        return self.world.segment_names.path(
            self.comm.name, f"{self.stream}.mb", f"{self.comm.ranks[src]}to{self.comm.ranks[dst]}"
        )

    def _deadline(self) -> float:
        return time.monotonic() + self.world.timeout_s

    def _outbox(self, peer: int) -> Segment:
        seg = self._out.get(peer)
        if seg is None:
            seg = self._out[peer] = Segment(self._path(self.comm.rank, peer), MAILBOX_SLOT_BYTES, create=True)
            self._sent[peer] = 0
        return seg

    def _inbox(self, peer: int) -> Segment:
        seg = self._in.get(peer)
        if seg is None:

            def timeout(_missing) -> Exception:
                return CommTimeoutError(
                    f"nxdt.comm: group '{self.comm.name}' {self.desc} (stream '{self.stream}') timed out after "
                    f"{self.world.timeout_s:g}s waiting for rank(s) [{self.comm.ranks[peer]}] to send"
                )

            seg = open_peers({peer: self._path(peer, self.comm.rank)}, MAILBOX_SLOT_BYTES, self._deadline(), timeout)[peer]
            seg.header[W_RECEIVER_PID] = os.getpid()
            self._in[peer] = seg
            self._recvd[peer] = 0
        return seg

    def _try_send(self, x: _Transfer) -> bool:
        seg = self._outbox(x.peer)
        h = seg.header
        n = self._sent[x.peer]
        if n - h[W_ACKED] >= 2:
            return False
        size = min(MAILBOX_SLOT_BYTES, x.bytes - x.pos)
        slot = seg.slot(n)
        if size:
            slot[:size].copy_(x.flat[x.pos : x.pos + size])
        parity = n & 1
        base = W_FINGERPRINT + parity * FP_WORDS
        h[base : base + 4] = x.fp
        h[W_FP_DIGEST + parity] = hash(x.fp) & 0x3FFFFFFFFFFF
        x.pos += size
        x.count += 1
        self._sent[x.peer] = n + 1
        fence()
        h[W_SENT] = n + 1
        wake(seg.word_address(W_SENT))
        return True

    def _try_recv(self, x: _Transfer) -> bool:
        seg = self._inbox(x.peer)
        h = seg.header
        n = self._recvd[x.peer]
        if h[W_SENT] <= n:
            return False
        parity = n & 1
        if h[W_FP_DIGEST + parity] != hash(x.fp) & 0x3FFFFFFFFFFF:
            base = W_FINGERPRINT + parity * FP_WORDS
            theirs = tuple(int(v) for v in h[base : base + 4])
            raise CommMismatchError(
                f"nxdt.comm: group '{self.comm.name}' {self.desc}: rank {self.comm.ranks[x.peer]} sent {describe_fingerprint(theirs)} but "
                f"rank {self.comm.ranks[self.comm.rank]} expected {describe_fingerprint(x.fp)} — sends and receives must match in dtype and count"
            )
        size = min(MAILBOX_SLOT_BYTES, x.bytes - x.pos)
        if size:
            x.flat[x.pos : x.pos + size].copy_(seg.slot(n)[:size])
        x.pos += size
        x.count += 1
        self._recvd[x.peer] = n + 1
        fence()
        h[W_ACKED] = n + 1
        wake(seg.word_address(W_ACKED))
        return True

    def _shm_exchange(self, sends: list[_Transfer], recvs: list[_Transfer]) -> None:
        pending = [(x, True) for x in sends] + [(x, False) for x in recvs]
        deadline = self._deadline()
        while pending:
            progressed, still = False, []
            for x, sending in pending:
                while x.count < x.chunks() and (self._try_send(x) if sending else self._try_recv(x)):
                    progressed = True
                if x.count < x.chunks():
                    still.append((x, sending))
            pending = still
            if not pending or progressed:
                if progressed:
                    deadline = self._deadline()
                continue
            self._block(pending, deadline)

    def _block(self, pending, deadline: float) -> None:
        def timeout() -> Exception:
            who = {self.comm.ranks[x.peer]: peer_pid(x, sending) for x, sending in pending}
            return CommTimeoutError(
                f"nxdt.comm: group '{self.comm.name}' {self.desc} (stream '{self.stream}') timed out after "
                f"{self.world.timeout_s:g}s waiting for rank(s) {sorted(who)} to {'receive' if pending[0][1] else 'send'}",
                stuck_pids=who,
            )

        def peer_pid(x, sending: bool) -> int:  # the mailbox's other end: its receiver, or its creator (the sender)
            seg = self._out[x.peer] if sending else self._in[x.peer]
            return int(seg.header[W_RECEIVER_PID] if sending else seg.header[1])

        def health() -> None:
            for x, sending in pending:
                pid = peer_pid(x, sending)
                if pid and not pid_alive(pid):
                    raise PeerDiedError(
                        f"nxdt.comm: group '{self.comm.name}' {self.desc}: rank {self.comm.ranks[x.peer]} (pid {pid}) "
                        f"exited while rank {self.comm.ranks[self.comm.rank]} waited for it"
                    )

        if len(pending) == 1:  # one word to watch: sleep on it
            x, sending = pending[0]
            if sending:
                seg = self._out[x.peer]
                wait_word(
                    seg.header, W_ACKED, self._sent[x.peer] - 1, seg.word_address(W_ACKED), deadline, timeout, health, self.spin
                )
            else:
                seg = self._in[x.peer]
                wait_word(
                    seg.header, W_SENT, self._recvd[x.peer] + 1, seg.word_address(W_SENT), deadline, timeout, health, self.spin
                )
            return

        def ready() -> bool:
            for x, sending in pending:
                if sending and self._sent[x.peer] - self._out[x.peer].header[W_ACKED] < 2:
                    return True
                if not sending and self._in[x.peer].header[W_SENT] > self._recvd[x.peer]:
                    return True
            return False

        wait_until(ready, deadline, timeout, health, self.spin.policy)

    # -------------------------------------------------------------------------------- public
    def exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]] = (),
        recvs: Sequence[tuple[int, torch.Tensor]] = (),
        desc: str | None = None,
    ) -> None:
        """Send and receive these messages (group-local peers; tensors contiguous). Returns when all moved."""
        if desc:
            self.desc = desc
        hosts, me = self.comm.hosts, self.comm.rank
        works = []
        try:
            for peer, t in recvs:
                if hosts[peer] != hosts[me] and t.numel():
                    works.append(dist.irecv(t, self.comm.ranks[peer], tag=self.tag))
            for peer, t in sends:
                if hosts[peer] != hosts[me] and t.numel():
                    works.append(dist.isend(t.contiguous(), self.comm.ranks[peer], tag=self.tag))
            local_sends = [_Transfer(p, t) for p, t in sends if hosts[p] == hosts[me]]
            local_recvs = [_Transfer(p, t) for p, t in recvs if hosts[p] == hosts[me]]
            if local_sends or local_recvs:
                self._shm_exchange(local_sends, local_recvs)
            for w in works:
                w.wait()
            if self.pacer is not None:  # full duplex: a step costs the larger direction
                self.pacer.step(
                    max(sum(t.numel() * t.element_size() for _, t in sends), sum(t.numel() * t.element_size() for _, t in recvs))
                )
        except RuntimeError as exc:
            if isinstance(exc, (CommTimeoutError, CommMismatchError, PeerDiedError)):
                raise
            gloo = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if any(s in gloo for s in ("Connection closed", "Connection reset", "Broken pipe", "Connection refused")):
                remote = sorted({self.comm.ranks[p] for p, _ in (*sends, *recvs) if hosts[p] != hosts[me]})
                gloo = gloo.split("] ", 1)[-1].split(". This is typically")[0]  # drop gloo's source path and advice
                raise PeerDiedError(
                    f"nxdt.comm: group '{self.comm.name}' {self.desc} (stream '{self.stream}'): lost the connection "
                    f"to rank(s) {remote} on another host ({gloo}) — that host's worker or agent died; see its "
                    "logs"
                ) from exc
            raise CommTimeoutError(
                f"nxdt.comm: group '{self.comm.name}' {self.desc} (stream '{self.stream}') over p2p failed: "
                f"{str(exc).splitlines()[0]}"
            ) from exc

    def close(self) -> None:
        for seg in self._in.values():
            seg.close()
        for peer, seg in self._out.items():
            # A send completes once its data sits in the mailbox, so the receiver may not have read it yet
            # (the sender can even exit first). Unlink only a drained mailbox; an unread one stays for the
            # receiver and is removed with the run's other segments (cleanup_run / the next start).
            drained = int(seg.header[W_ACKED]) >= self._sent.get(peer, 0)
            seg.close()
            if drained:
                try:
                    os.unlink(seg.path)
                except FileNotFoundError:
                    pass
        self._in.clear()
        self._out.clear()
