"""Direct fast paths over a :class:`~nxdt.comm.shm.ShmChannel`, chunk by chunk (one step per chunk).

On one host every member can read every other member's slot, so the fastest algorithms are direct:

* all-reduce ``direct`` (3+ members below 64 KB; 2 members at every size, except fp16/bf16 from
  64 KB): everyone copies its chunk in, then every member reduces the chunk from all slots in member
  order — one synchronisation, identical bits everywhere. Members 0 and 1 reduce into their own
  tensor in place (it still holds their contribution), which saves a memory stream per operand;
* all-reduce ``slice`` (larger messages; 2 members in fp16/bf16): member ``i`` copies in only the
  slices *others* reduce, reduces its own slice ``i`` straight into its tensor (and its slot, for the
  others), marks it reduced and copies the others' reduced slices out as they become ready — each
  element converted, reduced and rounded once (by its slice's owner), the least CPU, two
  synchronisations;
* every reduction (both all-reduces, reduce-scatter, reduce) adds an element's contributions in member order, so
  its bits do not depend on the message's size, the algorithm or where the element falls (which slice, which
  chunk): a buffer reduced in pieces equals the buffer reduced whole (``Communicator.sums_in_member_order``);
* all-gather / reduce-scatter / all-to-all / broadcast / reduce: each member writes what others
  need into its slot once, in one step per slot-full, and every peer copies its part straight out.

Why so few steps: on a 2-core host shared with other work, every synchronisation can cost a context
switch (≈0.1 ms), more than copying a megabyte; see experiments/collectives-cpu/README.md.

Every member checks every peer's fingerprint on every step, so a mismatched call fails everywhere.
Each step ends with ``ch.finish(bytes, hops)``, the step's traffic in the cost model: a channel with
a pacer (emulated link, stream priority; :mod:`nxdt.comm.emulate`) waits or yields there.
"""

from __future__ import annotations

import math

import torch

from nxdt.comm.errors import CommMismatchError
from nxdt.comm.reduce import (
    LOW_PRECISION,
    _combine_ as combine_,
    check_op,
    dtype_code,
    reduce_in_place,
    reduce_into,
    reduce_own_into,
)
from nxdt.comm.shm import ShmChannel

DIRECT_ALL_REDUCE_MAX_BYTES = 64 << 10  # 3+ members: direct below, slice above
# 2 members, fp16/bf16: direct below, slice from here up. Direct has each rank widen, add and round every element;
# slice halves that per rank (and in total when both ranks share one core) for one more synchronisation and a
# copy-out. fp32 and the other dtypes stay direct at 2 members: without the conversion the halved kernel does not pay
# for the extra pass (experiments/collectives-cpu, issue #23 round 9: pinned_{split,same}.txt, bf16 1 MB slice 186 vs
# 210 µs with a CPU per rank and 371 vs 418 on one CPU, fp32 1 MB 177 vs 160 and 390 vs 365; deepspeed_r9b: fp32 4 MB
# plain 5087-7241 µs sliced vs 1020-3294 direct)
SLICE_MIN_BYTES_2_HALF = 64 << 10
# 2 members: up to this size an all-reduce is one native step, copied even from a shared tensor. At 256 KB the
# copy (≈ 10 µs) costs about what zero-copy's second synchronisation does on a quiet host (44 vs 47 µs) and
# far less on a loaded one (58-89 vs 495-1178 µs); at 1 MB zero-copy wins in both (experiments/collectives-cpu)
ONE_STEP_MAX_BYTES_2 = 256 << 10
# Direct all-reduce step size: the tensor chunk is read twice (copy-in, then the in-place reduce),
# so it should still be in cache the second time. Measured at 4 MB, 2 ranks: 2 MB steps 575 µs,
# 1 MB 618 µs, 4 MB 721 µs (one step, but the re-read misses L2).
DIRECT_CHUNK_BYTES = 2 << 20

(
    OP_ALL_REDUCE,
    OP_ALL_GATHER,
    OP_REDUCE_SCATTER,
    OP_ALL_TO_ALL,
    OP_BROADCAST,
    OP_REDUCE,
    OP_SEND_RECV,
    OP_BARRIER,
    OP_A2A_SIZES,
) = range(1, 10)


def _chunks(count: int, chunk: int):
    if count == 0:
        yield 0, 0
        return
    chunk = max(1, chunk)
    for start in range(0, count, chunk):
        yield start, min(count, start + chunk)


def _pipelined(ch: ShmChannel, count: int, elem: int, per_step_units: int = 1) -> int:
    """Chunk length (elements) for pure data movement: as much as a slot holds. Splitting a message
    that fits into smaller steps to overlap one member's copy-in with another's copy-out measured
    1.5-2.5x slower at 1 MB on a shared 2-core host: each extra step is another synchronisation
    (a possible context switch) and Python round trip, which costs more than the overlap buys.
    Messages larger than a slot still pipeline across consecutive steps (double buffering)."""
    return max(1, min(ch.slot_bytes // (elem * per_step_units), count))


def _bounds(count: int, parts: int) -> list[tuple[int, int]]:
    per = -(-count // parts) if count else 0
    return [(min(count, i * per), min(count, (i + 1) * per)) for i in range(parts)]


def _all_reduce_plan(ch: ShmChannel, t: torch.Tensor, op: str, algorithm: str) -> tuple:
    """What every call of this (op, dtype, count, algorithm) on ``ch`` does: (fingerprint, description, sliced,
    chunk elements, one native step). Decided from the fingerprinted count (never from whether this rank has the
    native extension), so every member takes the same path. Two members: direct for small messages, where the
    second synchronisation would cost more than the halved work saves."""
    red = check_op(op, t.dtype)
    total, nbytes = t.numel(), t.numel() * t.element_size()
    fp = (OP_ALL_REDUCE + 100 * red, dtype_code(t.dtype), total, 0)
    if ch.size > 2:
        auto_slice = nbytes > DIRECT_ALL_REDUCE_MAX_BYTES
    else:
        auto_slice = t.dtype in LOW_PRECISION and nbytes >= SLICE_MIN_BYTES_2_HALF
    sliced = algorithm == "slice" or (algorithm != "direct" and auto_slice)
    chunk = (ch.slot_bytes if sliced else min(ch.slot_bytes, DIRECT_CHUNK_BYTES)) // t.element_size()
    # up to 64 KB (256 KB with 2 members) in one step: the whole call is one native step, copied even from a shared
    # tensor — a 64 KB copy costs a few µs, the zero-copy path's second synchronisation and Python tail tens (2 ranks:
    # 23 vs 73 µs, 4 ranks on 2 cores: 0.55 vs 1.8 ms; experiments/collectives-cpu/deepspeed_{2,4}ranks_round1.txt)
    one_step_max = ONE_STEP_MAX_BYTES_2 if ch.size == 2 else DIRECT_ALL_REDUCE_MAX_BYTES
    quick = ch.native is not None and ch.pacer is None and nbytes <= one_step_max and total <= chunk
    return fp, f"all_reduce({op})", sliced, chunk, quick


def _plan_for(ch: ShmChannel, t: torch.Tensor, op: str, algorithm: str) -> tuple:
    key = (op, t.dtype, t.numel(), algorithm)
    plan = ch.plans.get(key)
    if plan is None:
        if len(ch.plans) > 256:
            ch.plans.clear()
        check_op(op, t.dtype)
        plan = ch.plans[key] = _all_reduce_plan(ch, t, op, algorithm)
    return plan


def one_step_all_reduce(ch: ShmChannel, t: torch.Tensor, op: str, algorithm: str = "auto"):
    """For calls shaped like ``t`` (op, dtype, count) that are one native step: a function running just that step
    on a flat contiguous tensor, for ``Communicator``'s per-call-shape cache; None when such a call is more."""
    fp, desc, sliced, _, quick = _plan_for(ch, t, op, algorithm)
    if not quick:
        return None
    step = ch.all_reduce_step_fn(fp, desc, sliced)

    def run(dst: torch.Tensor) -> None:
        if not step(dst):  # rare: a peer on the torch fallback sent its shared tensor
            _finish_by_slices(ch, dst, op)

    return run


def _finish_by_slices(ch: ShmChannel, dst: torch.Tensor, op: str) -> None:
    with torch.no_grad():
        _reduce_by_slices(ch, dst.view(-1), op, _bounds(dst.numel(), ch.size), None)


def all_reduce(ch: ShmChannel, t: torch.Tensor, op: str, algorithm: str = "auto") -> None:
    fp, desc, sliced, chunk, quick = _plan_for(ch, t, op, algorithm)
    if quick:
        if not ch.all_reduce_step(t, fp, desc, sliced):
            _reduce_by_slices(ch, t, op, _bounds(t.numel(), ch.size), None)
        return
    n, me, dtype = ch.size, ch.me, t.dtype
    total = t.numel()
    peers = ch.peers
    native = ch.native is not None and ch.pacer is None  # one C call per step (ShmChannel.all_reduce_step)
    for c0, c1 in _chunks(total, chunk):
        k = c1 - c0
        dst = t if k == total else t[c0:c1]
        shared = ch.locate(dst)
        if native and shared is None:
            if not ch.all_reduce_step(dst, fp, desc, sliced):
                # published; a peer's data is its own tensor, which it is about to change in place: reduce by slices
                _reduce_by_slices(ch, dst, op, _bounds(k, n), None)
            continue
        ch.begin(fp, desc)
        bounds = _bounds(k, n)
        if shared is not None:  # zero-copy: peers read my slices of dst in place
            ch.set_source(shared)
        elif sliced:  # only the slices others reduce
            mine = ch.typed(me, dtype)
            for j in peers:
                lo, hi = bounds[j]
                mine[lo:hi].copy_(dst[lo:hi])
        else:
            ch.typed(me, dtype, k).copy_(dst)  # a cached view: slicing a fresh one costs as much as a small copy
        ch.publish()
        if not sliced:
            ch.wait_published()
            if not ch.any_shared():
                # dst still holds my contribution: members 0 and 1 reduce into it in place
                reduce_own_into(dst, [ch.typed(i, dtype, k) for i in range(n)], me, op, n)
                ch.finish(2 * (n - 1) * k * t.element_size() // n, 2)  # cost model: reduce-scatter + all-gather terms
                continue
            # some member's data is its own tensor, which it is about to change in place: reduce by slices
        _reduce_by_slices(ch, dst, op, bounds, shared)


def _reduce_by_slices(ch: ShmChannel, dst: torch.Tensor, op: str, bounds: list[tuple[int, int]], shared) -> None:
    """The rest of an all-reduce step every member has published: member ``i`` reduces slice ``i`` of ``dst``
    and hands it on, then collects the others' slices; ends the step. ``shared``: where ``dst`` lies in my
    shared memory (peers read it in place), or None."""
    n, me, dtype, peers = ch.size, ch.me, dst.dtype, ch.peers
    k = dst.numel()
    lo, hi = bounds[me]
    own = dst[lo:hi]
    if dtype in LOW_PRECISION or me >= 2:  # fp32 accumulation / member order need every operand at once
        ch.wait_published()
        reduce_in_place(own, [own if i == me else ch.source(i, dtype, lo, hi) for i in range(n)], me, op, n)
    else:  # member order (member 1 first: one operation with member 0's, commutative), each peer as soon as it is there
        for j in peers:
            ch.wait_published((j,))
            combine_(own, ch.source(j, dtype, lo, hi), op)
        if op == "avg":
            own.div_(n)
    # hand my result on: pushed into every peer whose tensor is shared (its lines are in my cache, I just
    # read them; nobody else touches that slice of it), left in my slot or tensor for the others to pull
    pullers = [j for j in peers if ch.in_slot(j)]
    for j in peers:
        if not ch.in_slot(j):
            ch.source(j, dtype, lo, hi).copy_(own)
    if shared is None and pullers:
        ch.typed(me, dtype)[lo:hi].copy_(own)
    ch.mark_reduced()
    if shared is None:  # my tensor is private: pull every peer's slice as soon as it is ready
        for j in ch.each_ready(peers, reduced=True):
            lo, hi = bounds[j]
            dst[lo:hi].copy_(ch.source(j, dtype, lo, hi))
    else:  # peers pushed theirs into my tensor before they marked reduced
        ch.wait_reduced()
    ch.finish(2 * (n - 1) * k * dst.element_size() // n, 2)
    if shared is not None and pullers:
        ch.wait_readers()


def all_gather(ch: ShmChannel, out: torch.Tensor, inp: torch.Tensor) -> None:
    m, me, dtype = inp.numel(), ch.me, inp.dtype
    fp = (OP_ALL_GATHER, dtype_code(dtype), m, 0)
    in_place = out.data_ptr() + me * m * inp.element_size() == inp.data_ptr()
    rows = out.view(ch.size, m) if m else None
    for c0, c1 in _chunks(m, _pipelined(ch, m, inp.element_size())):
        k = c1 - c0
        whole = k == m and m > 0
        src = inp if whole else inp[c0:c1]
        ch.begin(fp, "all_gather")
        shared = ch.put(src)
        ch.publish()
        if not in_place:  # our own block while the peers catch up
            (rows[me] if whole else out[me * m + c0 : me * m + c1]).copy_(src)
        for j in ch.each_ready(ch.peers):
            (rows[j] if whole else out[j * m + c0 : j * m + c1]).copy_(ch.source(j, dtype, 0, k))
        ch.finish((ch.size - 1) * k * inp.element_size())
        if shared:
            ch.wait_readers()


def _row_of(ch: ShmChannel, member: int, dtype: torch.dtype, row: int, c0: int, c1: int, stride: int) -> torch.Tensor:
    """Columns [c0, c1) of row ``row`` of ``member``'s published (rows × ``stride``) input: its slot holds
    the step's (rows × (c1-c0)) block, its shared tensor the whole matrix."""
    k = c1 - c0
    if ch.in_slot(member):
        return ch.typed(member, dtype)[row * k : (row + 1) * k]
    return ch.source(member, dtype, row * stride + c0, row * stride + c1)


def reduce_scatter(ch: ShmChannel, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
    red = check_op(op, inp.dtype)
    n, m, me, dtype = ch.size, out.numel(), ch.me, inp.dtype
    rows = inp.view(n, m)
    fp = (OP_REDUCE_SCATTER + 100 * red, dtype_code(dtype), m, 0)
    desc = f"reduce_scatter({op})"
    shared = ch.locate(inp)  # peers read their rows of my whole input in place
    for c0, c1 in _chunks(m, ch.slot_bytes // (inp.element_size() * n)):
        k = c1 - c0
        ch.begin(fp, desc)
        whole = k == m
        src = rows if whole else rows[:, c0:c1]
        if shared is not None:
            ch.set_source(shared)
        else:
            mine = ch.rows(me, dtype, n, k)
            for j in ch.peers:
                mine[j].copy_(src[j])
        ch.publish()
        ch.wait_published()
        reduce_into(
            out if whole else out[c0:c1], [src[me] if i == me else _row_of(ch, i, dtype, me, c0, c1, m) for i in range(n)], op, n
        )
        ch.finish((n - 1) * k * inp.element_size())
        if shared is not None:
            ch.wait_readers()


def broadcast(ch: ShmChannel, t: torch.Tensor, root: int) -> None:
    fp = (OP_BROADCAST, dtype_code(t.dtype), t.numel(), root)
    desc = f"broadcast(root={root})"
    for c0, c1 in _chunks(t.numel(), _pipelined(ch, t.numel(), t.element_size())):
        ch.begin(fp, desc)
        shared = ch.me == root and ch.put(t[c0:c1])
        ch.publish()
        ch.wait_published()
        if ch.me != root:
            t[c0:c1].copy_(ch.source(root, t.dtype, 0, c1 - c0))
        ch.finish((c1 - c0) * t.element_size())
        if shared:
            ch.wait_readers()


def reduce(ch: ShmChannel, t: torch.Tensor, root: int, op: str) -> None:
    red = check_op(op, t.dtype)
    n, me = ch.size, ch.me
    fp = (OP_REDUCE + 100 * red, dtype_code(t.dtype), t.numel(), root)
    desc = f"reduce({op}, root={root})"
    for c0, c1 in _chunks(t.numel(), ch.slot_bytes // t.element_size()):
        k = c1 - c0
        ch.begin(fp, desc)
        shared = me != root and ch.put(t[c0:c1])
        ch.publish()
        ch.wait_published()
        if me == root:  # member order, as all_reduce and reduce_scatter: a root's piece has the bits of their result
            own = t[c0:c1]
            reduce_in_place(own, [own if i == me else ch.source(i, t.dtype, 0, k) for i in range(n)], me, op, n)
        ch.finish(k * t.element_size())
        if shared:
            ch.wait_readers()


def barrier(ch: ShmChannel) -> None:
    ch.begin((OP_BARRIER, 0, 0, 0), "barrier")
    ch.publish()
    ch.wait_published()
    ch.finish()


def all_to_all_equal(ch: ShmChannel, out: torch.Tensor, inp: torch.Tensor) -> None:
    """Equal splits: one step per chunk of every destination's block; no split exchange (the
    fingerprint already checks that every rank sends the same count). Each member writes its
    outgoing blocks once; every peer copies its own block straight out of that slot."""
    n, me, dtype = ch.size, ch.me, inp.dtype
    per = inp.numel() // n
    blocks_in, blocks_out = inp.view(n, per), out.view(n, per)
    fp = (OP_ALL_TO_ALL, dtype_code(dtype), inp.numel(), 1)
    same = out.data_ptr() == inp.data_ptr()
    shared = None if same else ch.locate(inp)  # in place, peers could read blocks we already overwrote
    peers = ch.peers
    for c0, c1 in _chunks(per, _pipelined(ch, per, inp.element_size(), n)):
        k = c1 - c0
        whole = k == per  # the common case: no per-row slicing (each view op costs ~1 µs of Python)
        src = blocks_in if whole else blocks_in[:, c0:c1]
        dst = blocks_out if whole else blocks_out[:, c0:c1]
        ch.begin(fp, "all_to_all")
        if shared is not None:
            ch.set_source(shared)
        else:
            mine = ch.rows(me, dtype, n, k)
            for j in peers:
                mine[j].copy_(src[j])
        ch.publish()
        if same:  # in place: our own input blocks must be safe in the slot before we overwrite them
            ch.wait_published()
        else:  # our own block while the peers catch up
            dst[me].copy_(src[me])
        for j in ch.each_ready(peers):
            dst[j].copy_(_row_of(ch, j, dtype, me, c0, c1, per))
        ch.finish((n - 1) * k * inp.element_size())
        if shared is not None:
            ch.wait_readers()


def all_to_all(ch: ShmChannel, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
    """Uneven all-to-all (splits in elements). Split vectors are exchanged and checked first, so a
    send count that does not match its receiver's count is a clear error on every rank."""
    n, me = ch.size, ch.me
    ch.begin((OP_A2A_SIZES, dtype_code(inp.dtype), n, 0), "all_to_all(sizes)")
    ch.typed(me, torch.int64)[: 2 * n].copy_(torch.tensor(list(in_splits) + list(out_splits), dtype=torch.int64))
    ch.publish()
    ch.wait_published()
    all_in = [ch.typed(i, torch.int64)[:n].tolist() for i in range(n)]
    all_out = [ch.typed(i, torch.int64)[n : 2 * n].tolist() for i in range(n)]
    ch.finish()
    for s in range(n):
        for r in range(n):
            if all_in[s][r] != all_out[r][s]:
                raise CommMismatchError(
                    f"nxdt.comm: group '{ch.group}' all_to_all: rank {ch.ranks[s]} sends {all_in[s][r]} elements to rank "
                    f"{ch.ranks[r]}, which expects {all_out[r][s]} — input and output split sizes must agree"
                )
    src_offset = [sum(all_in[s][:me]) for s in range(n)]  # where my part starts in each sender's input
    dst_offset = [sum(out_splits[:s]) for s in range(n)]
    window = ch.slot_bytes // inp.element_size()
    rounds = max(1, math.ceil(max(sum(row) for row in all_in) / window))
    fp = (OP_ALL_TO_ALL, dtype_code(inp.dtype), rounds, 0)
    for r in range(rounds):
        w0 = r * window
        w1 = min(inp.numel(), w0 + window)
        ch.begin(fp, "all_to_all")
        if w1 > w0:
            ch.typed(me, inp.dtype)[: w1 - w0].copy_(inp[w0:w1])
        ch.publish()
        ch.wait_published()
        for s in range(n):
            lo = max(w0, src_offset[s])
            hi = min(w0 + window, src_offset[s] + all_in[s][me])
            if hi > lo:
                out[dst_offset[s] + lo - src_offset[s] : dst_offset[s] + hi - src_offset[s]].copy_(
                    ch.typed(s, inp.dtype)[lo - w0 : hi - w0]
                )
        ch.finish((w1 - w0) * inp.element_size())
