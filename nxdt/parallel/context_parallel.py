"""Context parallelism: the sequence split over the CP group, attention as a ring (``distributed_strategy.context_parallel_size``).

**Load-balanced split.** A sequence of S tokens is cut into 2·CP chunks of c = S/(2·CP); CP rank i holds chunks i
and 2·CP−1−i (:func:`load_balanced_positions`), so under a causal mask every rank has the same attention work
(an early chunk sees few keys, its partner late chunk many). Each micro-batch field of shape [B, S] is cut the
same way and the tokens carry their global positions (``position_ids``), so RoPE / position embeddings see where
each token really sits (:func:`shard_micro_batches`).

**Ring attention** (:class:`RingAttention`, swapped for each layer's :class:`~nxdt.models.attention.CoreAttention`
by :func:`apply_context_parallel`, as tensor parallelism swaps linears). Forward: CP steps; at step t a rank holds
the K/V of CP rank (i−t) mod CP, hands it on to rank i+1 and receives the next block from rank i−1 with one async
``send_recv`` on the ``cp`` stream, and meanwhile computes attention of its queries against the block in hand.
Each (query chunk, key chunk) tile is classified by the chunks' global positions: fully visible (every key before
every query), fully masked (skipped: no compute), or on the diagonal (masked key position > query position).
Partial results merge exactly by log-sum-exp (the online softmax): out = Σ_b exp(lse_b − lse)·out_b with
lse = log Σ_b exp(lse_b). Backward (FlashAttention-2's recomputation, with the global lse and delta = rowsum(dO∘O)):
the K/V blocks go round the ring again, each rank adds its queries' dK/dV contribution of the block in hand to an
accumulator that travels with it (one hop behind the K/V: its receive is awaited only after the next block's
compute), and after CP hops every block's dK/dV is back at its owner. Scores run in fp32 for 16-bit inputs; one
score tile of at most ``block_size`` (256) query rows × one key chunk per head is held at a time; forward saves q,
k, v, out and lse only (no score matrix, whatever ``model.core_attention`` says).

**Packed records** (``segment_ids``, per-record ``position_ids``): cut like every [B, S] field; each attention call
all-gathers the CP group's segment ids once (a few bytes a token), and every tile also masks keys of another record
(padding, segment 0, sees only padding, as at CP=1). A tile can then hide every key from some of its rows: their
partial log-sum-exp is −inf and adds nothing to the merge; each row sees at least itself, so the final lse is finite.

**Loss and gradients.** Each CP rank's loss is the mean over its own tokens; :func:`weight_by_token_share` scales it
by (its tokens)·CP/(the CP group's tokens) — labels of -100 do not count — so that averaging gradients over DP×CP
(the data-parallel runtime's group under CP) gives the gradient of the mean over every token of the sequence, and
the mean of the ranks' losses is the token mean (equal to CP=1, whatever the masked labels). Objectives of whole
sequences (DPO, ORPO: a function of each sequence's summed log-probability) add each rank's per-sequence sums up over
the group instead (:func:`sequence_total`), so every CP rank computes the same loss; its backward scales by CP, so the
same DP×CP average adds the ranks' partial gradients up. Validation: :func:`sequence_means`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

from nxdt.comm.world import Communicator
from nxdt.models.attention import CoreAttention, core_attention

STREAM = "cp"  # the ring's transfers: their own stream, so they run while the rank computes
SEQUENCE_GROUP = "context_parallel_group"  # the model's attribute holding its CP group (apply_context_parallel)
TOKEN_SHARE = "cp_token_share"  # micro-batch key: this rank's weight in its CP group's token mean


def check_sequence(seq_length: int, cp: int) -> None:
    """A sequence the load-balanced split can cut (2·CP chunks of equal length)."""
    if cp < 1 or seq_length % (2 * cp):
        raise ValueError(f"sequence length {seq_length} does not split into 2·CP = {2 * cp} equal chunks")


def chunk_ranges(seq_length: int, cp_rank: int, cp: int) -> list[tuple[int, int]]:
    """The global [start, end) of the two chunks CP rank ``cp_rank`` holds: chunk i and chunk 2·CP−1−i."""
    check_sequence(seq_length, cp)
    c = seq_length // (2 * cp)
    return [(cp_rank * c, (cp_rank + 1) * c), ((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c)]


def load_balanced_positions(seq_length: int, cp_rank: int, cp: int) -> torch.Tensor:
    """The global positions of CP rank ``cp_rank``'s tokens, in its local order: [2·S/(2·CP)] int64."""
    return torch.cat([torch.arange(a, b) for a, b in chunk_ranges(seq_length, cp_rank, cp)])


def shard_micro_batches(
    micro_batches: list[dict[str, torch.Tensor]], comm: Communicator, token_share: bool = True
) -> list[dict[str, torch.Tensor]]:
    """This CP rank's part of each micro-batch: every [B, S] field cut to the rank's two chunks, ``position_ids``
    the tokens' global positions (the micro-batch's own, when it carries them), and ``TOKEN_SHARE`` the rank's weight
    in the group's token mean (one all-reduce of the label counts for all micro-batches; ``token_share=False``: none,
    for objectives that add their sequences up over the group themselves, :func:`sequence_total`). Packed records keep
    their ``segment_ids`` and per-record ``position_ids``, cut the same way (ring attention masks the other records)."""
    out, counts = [], []
    for mb in micro_batches:
        ids = mb["input_ids"]
        b, s = ids.shape
        index = load_balanced_positions(s, comm.rank, comm.size).to(ids.device)
        part = {name: t[:, index] if t.dim() >= 2 and tuple(t.shape[:2]) == (b, s) else t for name, t in mb.items()}
        if mb.get("position_ids") is None:
            part["position_ids"] = index.unsqueeze(0).expand(b, -1)
        counts.append((part["labels"] != -100).sum())
        out.append(part)
    if not token_share:
        return out
    local = torch.stack(counts).to(torch.float64)
    total = local.clone()
    comm.all_reduce(total, op="sum")
    for part, n, n_all in zip(out, local, total):
        part[TOKEN_SHARE] = n * comm.size / n_all if n_all > 0 else torch.ones((), dtype=torch.float64, device=n.device)
    return out


class _SequenceSum(torch.autograd.Function):
    """All-reduce (sum) over the CP group whose gradient is the upstream one times CP (see :func:`sequence_total`)."""

    @staticmethod
    def forward(ctx, values, comm):
        ctx.size = comm.size
        total = values.detach().clone()
        comm.all_reduce(total, op="sum")
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.size, None


def sequence_total(model: nn.Module, values: torch.Tensor) -> torch.Tensor:
    """Per-sequence sums over this rank's tokens (a sequence's log-probability, its token count) as sums over the whole
    sequence, on every rank of the model's CP group (:func:`apply_context_parallel`); ``values`` unchanged without
    context parallelism. For objectives of whole sequences (DPO, ORPO): their loss is then the same on every CP rank,
    and each rank's backward reaches only the parameters' paths through its own tokens, so the gradient is CP times
    the upstream one — the DP×CP average then adds the ranks' parts up instead of averaging them."""
    comm = getattr(model, SEQUENCE_GROUP, None)
    if comm is None or comm.size == 1:
        return values
    return _SequenceSum.apply(values.contiguous(), comm)


def sequence_means(local_means: list[float], parts: list[dict[str, torch.Tensor]], comm: Communicator) -> list[float]:
    """Each micro-batch's token mean over the whole sequence, on every CP rank, from each rank's mean over its own
    tokens (``local_means``) and its parts (:func:`shard_micro_batches`): Σ over the group of
    :func:`weight_by_token_share` / CP, which is Σ (mean · tokens) / Σ tokens. One all-reduce for all micro-batches;
    forward-only passes (validation) use it, as training's backward uses the weights themselves."""
    weighted = torch.stack(
        [
            weight_by_token_share(torch.tensor(m, dtype=torch.float64, device=part[TOKEN_SHARE].device), part)
            for m, part in zip(local_means, parts)
        ]
    )
    comm.all_reduce(weighted, op="sum")
    return (weighted / comm.size).tolist()


def weight_by_token_share(loss: torch.Tensor, micro_batch: Any) -> torch.Tensor:
    """A CP rank's micro-batch loss (mean over its tokens) weighted so the DP×CP gradient average is the gradient
    of the token mean over the whole sequence; unchanged without context parallelism. A rank with no counted
    token contributes zero (its mean is 0/0), and still runs backward: the ring needs every rank."""
    share = micro_batch.get(TOKEN_SHARE) if isinstance(micro_batch, Mapping) else None  # (ids, labels) pairs: no CP
    if share is None:
        return loss
    return torch.where(share > 0, loss * share.to(loss.dtype), torch.zeros_like(loss))


# ---------------------------------------------------------------------------------------------- ring attention
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


FULL, DIAGONAL = "full", "diagonal"
ROW_BLOCK = 256  # query rows of one score tile (× one key chunk): bounds the tile a ring step holds per head


def _visibility(q: tuple[int, int], k: tuple[int, int]) -> str | None:
    """How queries at global positions [q0, q1) see keys at [k0, k1) under the causal mask: every key
    (``FULL``), some (``DIAGONAL``: key position > query position masked), or none (None: the tile is skipped)."""
    if k[0] > q[1] - 1:
        return None
    return FULL if k[1] - 1 <= q[0] else DIAGONAL


def _tile_mask(q: tuple[int, int], k: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
    """True where the key's global position is after the query's: [q rows, k cols]."""
    return torch.arange(k[0], k[1], device=device)[None, :] > torch.arange(q[0], q[1], device=device)[:, None]


def _tiles(
    seq_length: int, q_rank: int, k_rank: int, cp: int, rows: int = ROW_BLOCK, device: torch.device | None = None
) -> list[tuple[slice, slice, torch.Tensor | None]]:
    """The (local query rows, local key rows, mask or None) tiles queries of ``q_rank`` compute against the K/V of
    ``k_rank``: at most ``rows`` query rows × one key chunk each; fully masked tiles are left out. Masks are made on
    ``device`` (the scores')."""
    out = []
    c = seq_length // (2 * cp)
    for a, (q0, q1) in enumerate(chunk_ranges(seq_length, q_rank, cp)):
        for r0 in range(q0, q1, rows):
            qr = (r0, min(r0 + rows, q1))
            local = slice(a * c + qr[0] - q0, a * c + qr[1] - q0)
            for b, kr in enumerate(chunk_ranges(seq_length, k_rank, cp)):
                kind = _visibility(qr, kr)
                if kind is not None:
                    out.append((local, slice(b * c, (b + 1) * c), _tile_mask(qr, kr, device) if kind == DIAGONAL else None))
    return out


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(flat: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    n = flat.numel() // 2
    return flat[:n].view(shape), flat[n:].view(shape)


class _Ring:
    """One rank's view of the ring: its neighbours and the exchange of a block with them, async on the cp stream."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.next, self.prev = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        self.tracer = comm.world.tracer

    def pass_on(self, block: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Send ``block`` to the next rank and receive the previous rank's into a new buffer; returns (buffer, work).
        ``block`` must stay unchanged until the work completes."""
        incoming = torch.empty_like(block)
        work = self.comm.send_recv(block, self.next, incoming, self.prev, stream=STREAM, async_op=True)
        return incoming, work

    def compute_span(self, name: str, step: int):
        """Record the block's compute in the trace (row ``compute``), next to the cp stream's transfers."""
        if self.tracer is None:
            return _NoSpan()
        return self.tracer.span(name, "compute", step=step, group=self.comm.name)


class _NoSpan:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = x.shape
    return x.reshape(b, kv_heads, h // kv_heads, s, d)


def _gather_segments(segment_ids: torch.Tensor | None, comm: Communicator) -> torch.Tensor | None:
    """Every CP rank's segment ids [CP, B, L] (rank order), from this rank's [B, L]; None without segments. One small
    all-gather per attention call: the key blocks of the ring then need no ids of their own."""
    if segment_ids is None:
        return None
    mine = segment_ids.to(torch.int64).contiguous()
    out = torch.empty((comm.size, *mine.shape), dtype=torch.int64, device=mine.device)
    comm.all_gather(out.view(-1), mine.view(-1), stream=STREAM)
    return out


def _with_segments(
    mask: torch.Tensor | None, segments: torch.Tensor | None, k_rank: int, rows: slice, cols: slice, rank: int
) -> torch.Tensor | None:
    """A tile's causal mask ([rows, cols] or None) combined with the packed records' (another segment: masked), as
    [B, 1, 1, rows, cols] for the grouped scores; the causal mask alone without segments."""
    if segments is None:
        return mask
    other = segments[rank][:, rows, None] != segments[k_rank][:, None, cols]  # [B, rows, cols]
    if mask is not None:
        other = other | mask
    return other[:, None, None]


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a row that sees no key of the tile or of the blocks so far: packed records) as 0, so
    exp(x - lse) is 0, not nan, for that row's masked scores and partial sums."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


class _RingAttentionFn(torch.autograd.Function):
    """Causal attention over the CP group's whole sequence; q [B, H, L, D], k/v [B, Hkv, L, D] this rank's L tokens
    (its two chunks, :func:`load_balanced_positions`); ``segment_ids`` [B, L] (packed records: a token sees only its own
    record's keys) or None."""

    @staticmethod
    def forward(ctx, q, k, v, comm, row_block, segment_ids):
        ctx.comm, ctx.row_block = comm, row_block
        ring, cp, rank = _Ring(comm), comm.size, comm.rank
        b, h, s_local, d = q.shape
        kv_heads, seq = k.shape[1], s_local * cp
        dtype, scale = _compute_dtype(q.dtype), 1.0 / math.sqrt(d)
        ctx.segments = segments = _gather_segments(segment_ids, comm)
        qg = _grouped(q, kv_heads).to(dtype) * scale  # [B, Hkv, G, L, D]
        out = torch.zeros(qg.shape, dtype=dtype, device=q.device)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
        block = _pack(k.contiguous(), v.contiguous())  # sent in the inputs' dtype
        for step in range(cp):
            incoming, work = ring.pass_on(block) if step < cp - 1 else (None, None)
            with ring.compute_span("ring_attention.forward", step):
                kb, vb = (t.unsqueeze(2).to(dtype) for t in _unpack(block, k.shape))
                k_rank = (rank - step) % cp
                for rows, cols, mask in _tiles(seq, rank, k_rank, cp, ctx.row_block, q.device):
                    mask = _with_segments(mask, segments, k_rank, rows, cols, rank)
                    scores = qg[..., rows, :] @ kb[..., cols, :].transpose(-1, -2)
                    if mask is not None:
                        scores = scores.masked_fill(mask, float("-inf"))
                    tile_lse = torch.logsumexp(scores, dim=-1)  # -inf for a row the tile hides wholly (segments)
                    tile_out = torch.exp(scores - _finite(tile_lse)[..., None]) @ vb[..., cols, :]
                    new_lse = torch.logaddexp(lse[..., rows], tile_lse)
                    merged = _finite(new_lse)
                    out[..., rows, :] = (
                        out[..., rows, :] * torch.exp(lse[..., rows] - merged)[..., None]
                        + tile_out * torch.exp(tile_lse - merged)[..., None]
                    )
                    lse[..., rows] = new_lse
            if work is not None:
                work.wait()
                block = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        return out.reshape(b, h, s_local, d)

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):  # fp32 tiles for 16-bit inputs, as in forward
            return _RingAttentionFn._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm = ctx.comm
        ring, cp, rank = _Ring(comm), comm.size, comm.rank
        b, h, s_local, d = q.shape
        kv_heads, seq = k.shape[1], s_local * cp
        dtype, scale = _compute_dtype(q.dtype), 1.0 / math.sqrt(d)
        qg = _grouped(q, kv_heads).to(dtype)
        do = _grouped(grad_out.contiguous(), kv_heads).to(dtype)
        delta = (do * out.to(dtype)).sum(dim=-1)  # rowsum(dO ∘ O) = Σ_j P_ij dP_ij over the whole sequence
        dq = torch.zeros(qg.shape, dtype=dtype, device=q.device)
        block = _pack(k.contiguous(), v.contiguous())
        carried, carry_work = None, None  # the dK/dV accumulator arriving with the block in hand
        for step in range(cp):
            incoming, work = ring.pass_on(block) if step < cp - 1 else (None, None)
            with ring.compute_span("ring_attention.backward", step):
                kb, vb = (t.unsqueeze(2).to(dtype) for t in _unpack(block, k.shape))
                dk = torch.zeros(kb.shape, dtype=dtype, device=q.device)
                dv = torch.zeros(vb.shape, dtype=dtype, device=q.device)
                k_rank = (rank - step) % cp
                for rows, cols, mask in _tiles(seq, rank, k_rank, cp, ctx.row_block, q.device):
                    mask = _with_segments(mask, ctx.segments, k_rank, rows, cols, rank)
                    qi, doi = qg[..., rows, :], do[..., rows, :]
                    kj, vj = kb[..., cols, :], vb[..., cols, :]
                    p = torch.exp((qi * scale) @ kj.transpose(-1, -2) - lse[..., rows, None])  # the forward's probabilities
                    if mask is not None:
                        p = p.masked_fill(mask, 0.0)
                    dv[..., cols, :] += (p.transpose(-1, -2) @ doi).sum(dim=2, keepdim=True)  # over the query-head group
                    ds = p * (doi @ vj.transpose(-1, -2) - delta[..., rows, None])
                    dq[..., rows, :] += (ds @ kj) * scale
                    dk[..., cols, :] += (ds.transpose(-1, -2) @ qi).sum(dim=2, keepdim=True) * scale
                part = _pack(dk, dv)
            if carry_work is not None:  # the previous rank's sum for this block: awaited after the compute, not before
                carry_work.wait()
                part = part + carried
            carried, carry_work = ring.pass_on(part)  # on to the next rank; after the last step, home to the owner
            if work is not None:
                work.wait()
                block = incoming
        carry_work.wait()
        dk, dv = _unpack(carried, torch.Size((b, kv_heads, 1, s_local, d)))
        grads = (dq.reshape(b, h, s_local, d).to(q.dtype), dk.squeeze(2).to(k.dtype), dv.squeeze(2).to(v.dtype))
        return (*grads, None, None, None)


class RingAttention(nn.Module):
    """Causal core attention over the CP group's whole sequence (the module that replaces a ``CoreAttention``):
    q/k/v hold this rank's load-balanced chunks; the output is its rows of softmax(QKᵀ/√d)V over every key of
    the sequence. ``impl`` is kept from the replaced module (what CP=1 runs)."""

    def __init__(self, comm: Communicator, impl: str = "sdpa", block_size: int = ROW_BLOCK) -> None:
        super().__init__()
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.comm, self.impl, self.block_size = comm, impl, block_size

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"{k.shape[1]} key/value heads must divide {q.shape[1]} query heads")
        if segment_ids is not None and tuple(segment_ids.shape) != (q.shape[0], q.shape[2]):
            raise ValueError(
                f"segment_ids {tuple(segment_ids.shape)} must be this rank's [batch, seq] = {(q.shape[0], q.shape[2])}"
            )
        if self.comm.size == 1:
            return core_attention(q, k, v, causal=True, impl=self.impl, segment_ids=segment_ids)
        check_sequence(q.shape[2] * self.comm.size, self.comm.size)
        if torch.is_autocast_enabled(q.device.type):  # its own precision (fp32 scores for 16-bit inputs), as blockwise
            with torch.autocast(q.device.type, enabled=False):
                return _RingAttentionFn.apply(q, k, v, self.comm, self.block_size, segment_ids)
        return _RingAttentionFn.apply(q, k, v, self.comm, self.block_size, segment_ids)

    def extra_repr(self) -> str:
        return f"cp={self.comm.size}, rank={self.comm.rank}, group={self.comm.name}"


def apply_context_parallel(model: nn.Module, comm: Communicator) -> int:
    """Swap every :class:`~nxdt.models.attention.CoreAttention` of ``model`` for a :class:`RingAttention` over
    ``comm`` (the rank's CP group), and record ``comm`` on the model for :func:`sequence_total` (and on a MoE model's
    load-balancing statistics, which then run over whole sequences: ``models/mixtral.py``); returns how many
    were swapped. The model's weights are untouched: CP ranks hold full replicas, whose gradients the data-parallel
    runtime averages over DP×CP."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, CoreAttention):
                setattr(parent, name, RingAttention(comm, child.impl))
                swapped += 1
    if not swapped:
        raise ValueError(f"context parallelism: {type(model).__name__} has no CoreAttention module to run as ring attention")
    setattr(model, SEQUENCE_GROUP, comm)  # what sequence_total adds whole sequences up over
    hook = getattr(model, "load_balancing", None)  # a MoE model's load-balancing statistics: over whole sequences too
    balance = hook() if callable(hook) else None
    if balance is not None:
        balance.sequence_group = comm
    return swapped
