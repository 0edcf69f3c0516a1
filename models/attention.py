"""Core attention, softmax(QKᵀ/√d)V, behind one function every hub model calls (``model.core_attention``).

``core_attention(q, k, v, causal=True, impl=...)`` takes q [B, H, S, D] and k, v [B, Hkv, S, D] with Hkv
dividing H (grouped-query attention: KV head j serves query heads [j·H/Hkv, (j+1)·H/Hkv)), and returns
[B, H, S, D]. It sees only the heads it is given, so under tensor parallelism it runs on a rank's local
heads unchanged. ``causal`` masks key j > query i (top-left aligned, as ``scaled_dot_product_attention``'s
``is_causal``). ``segment_ids`` [B, S] (packed sequences: the document each token belongs to) additionally
masks every key of another document, so attention never crosses a record boundary; it needs q and k of one
length (self-attention). Three implementations, equal up to floating-point rounding:

``naive``     QKᵀ as one [B, H, S, S] matrix, masked, softmax (fp32), times V: the reference; autograd keeps
              the S×S probabilities for backward (the ``5·a·s/h`` term of the planner's activation memory).
``sdpa``      ``torch.nn.functional.scaled_dot_product_attention`` (GQA with ``enable_gqa``, no K/V copy). On
              CPU, torch 2.x dispatches these inputs (4-D, dense, causal, no mask/dropout) to its fused flash
              kernel ``_scaled_dot_product_flash_attention_for_cpu``, which works in blocks and saves only the
              output and a logsumexp for backward; its ``math`` fallback (taken e.g. with an explicit mask) would
              materialise S×S, so tests/test_rope_attention.py checks the dispatch. The default. With
              ``segment_ids`` it is given an explicit [B, 1, S, S] boolean mask, which torch runs on that ``math``
              path (S×S held): for packed batches of long sequences prefer ``blockwise``.
``blockwise`` written here in torch: query blocks × key blocks with an online softmax (running max and sum),
              backward recomputing each block's probabilities from the saved logsumexp (FlashAttention-2's
              scheme). Never holds more than one block×block score tile per head, on any backend; blocks
              wholly above the causal diagonal are skipped. Slower than ``sdpa`` on CPU (Python loop).

Scores, softmax and accumulation run in fp32 for 16-bit inputs (as the flash kernels accumulate; blockwise
also under autocast, forward and backward); the output has the input's dtype. Under autocast ``naive`` follows
autocast's rules (bf16 matmuls, fp32 softmax), as HF's eager attention does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

IMPLEMENTATIONS = ("naive", "sdpa", "blockwise")
DEFAULT_IMPL = "sdpa"
BLOCK_SIZE = 128  # blockwise: rows of a query block and of a key block


def check_impl(impl: str) -> str:
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"model.core_attention={impl!r}: use one of {', '.join(IMPLEMENTATIONS)}")
    return impl


@dataclass(frozen=True)
class SequenceLayout:
    """Where each token of a batch sits: its position (what RoPE or a position embedding sees) and its document.

    ``position_ids`` [B, S] (None: 0..S-1 in every row) — packed records restart at 0, a context-parallel rank's
    tokens carry their places in the full sequence. ``segment_ids`` [B, S] (None: one document per row) — tokens
    attend only within their own segment (packed SFT records). ``kv_cache`` (None: no cache) — incremental
    decoding: each attention appends this call's keys/values to its entry and attends over everything cached
    (:class:`KVCache`). The hub models take it as ``layout=`` in ``embed`` and ``run_layer`` and build it from
    ``forward(input_ids, position_ids=, segment_ids=, kv_cache=)``."""

    position_ids: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    kv_cache: "KVCache | None" = None

    @classmethod
    def of(
        cls,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        kv_cache: "KVCache | None" = None,
    ) -> "SequenceLayout | None":
        """The layout of these ids, or None when all are absent (the plain 0..S-1, one-document, uncached case)."""
        if position_ids is None and segment_ids is None and kv_cache is None:
            return None
        return cls(position_ids, segment_ids, kv_cache)


class KVCache:
    """The keys, values and segment ids of every token decoded so far, one entry per attention module.

    Incremental decoding (``nxdt.models.generate``): the first call (prefill) runs the whole left-padded prompt
    batch, later calls one new token per row; each attention module :meth:`extend` s its entry with the new
    tokens' k/v [B, Hkv, s, D] (after RoPE) and attends over all of them with :func:`cached_attention`. The
    segment ids travel with the keys so a left pad (segment 0) is never seen by a real token (segment 1), exactly
    as the uncached block-causal mask does. :meth:`keep` drops finished rows from every entry."""

    def __init__(self) -> None:
        self._entries: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}

    def __len__(self) -> int:
        """Tokens cached per row (0 before the prefill)."""
        return next(iter(self._entries.values()))[0].shape[2] if self._entries else 0

    def extend(
        self, owner: nn.Module, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Append ``owner``'s new k, v [B, Hkv, s, D] (and their segment ids [B, s]); return everything cached."""
        if owner in self._entries:
            k0, v0, seg0 = self._entries[owner]
            if (seg0 is None) != (segment_ids is None):
                raise ValueError("KVCache: pass segment_ids on every decoding step or on none")
            k, v = torch.cat([k0, k], dim=2), torch.cat([v0, v], dim=2)
            segment_ids = None if seg0 is None else torch.cat([seg0, segment_ids], dim=1)  # type: ignore[list-item]
        self._entries[owner] = (k, v, segment_ids)
        return k, v, segment_ids

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (indices) in every entry: finished sequences leave the batch."""
        for owner, (k, v, seg) in self._entries.items():
            self._entries[owner] = (k[rows], v[rows], None if seg is None else seg[rows])


def cached_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_segments: torch.Tensor | None, k_segments: torch.Tensor | None
) -> torch.Tensor:
    """softmax(QKᵀ/√d)V of the s newest tokens q [B, H, s, D] over all T cached keys k/v [B, Hkv, T, D]: query i
    sits at key index T-s+i (causal, bottom-right aligned) and sees only keys of its own segment."""
    s_q, s_k = q.shape[2], k.shape[2]
    rows = torch.arange(s_k - s_q, s_k, device=q.device)[:, None]
    allowed = torch.arange(s_k, device=q.device)[None, :] <= rows  # [s, T]
    if q_segments is not None and k_segments is not None:
        allowed = allowed & (q_segments[:, :, None] == k_segments[:, None, :])  # [B, s, T]
        allowed = allowed[:, None]
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa)


def layout_fields(layout: SequenceLayout | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(position_ids, segment_ids) of a layout that may be None."""
    return (None, None) if layout is None else (layout.position_ids, layout.segment_ids)


def layout_cache(layout: SequenceLayout | None) -> KVCache | None:
    """The KV cache of a layout that may be None."""
    return None if layout is None else layout.kv_cache


def core_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    impl: str = DEFAULT_IMPL,
    block_size: int = BLOCK_SIZE,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(QKᵀ/√d [+ causal mask] [+ segment mask])V; q [B, H, S, D], k/v [B, Hkv, S, D] → [B, H, S, D]."""
    check_impl(impl)
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{k.shape[1]} key/value heads must divide {q.shape[1]} query heads")
    if segment_ids is not None and (q.shape[2] != k.shape[2] or tuple(segment_ids.shape) != (q.shape[0], q.shape[2])):
        raise ValueError(
            f"segment_ids {tuple(segment_ids.shape)} must be [batch, seq] = {(q.shape[0], q.shape[2])} "
            f"with queries and keys of one length (got {q.shape[2]} and {k.shape[2]})"
        )
    if impl == "sdpa":
        gqa = k.shape[1] != q.shape[1]
        if segment_ids is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        allowed = ~_mask(q.shape[2], k.shape[2], causal, segment_ids, segment_ids, q.device)  # True = attend
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(1), enable_gqa=gqa)
    if impl == "blockwise":
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        # its own precision (fp32 tiles for 16-bit inputs) in forward and backward alike: autocast off inside
        with torch.autocast(q.device.type, enabled=False):
            return _BlockwiseAttention.apply(q, k, v, causal, block_size, segment_ids)
    return naive_attention(q, k, v, causal=causal, segment_ids=segment_ids)


class CoreAttention(nn.Module):
    """Causal softmax(QKᵀ/√d)V (:func:`core_attention`, implementation ``impl``) as the module every hub model's
    attention holds (``.core``): the part ``selective`` activation checkpointing recomputes, and the seam context
    parallelism swaps for ring attention (:mod:`nxdt.parallel.context_parallel`), as tensor parallelism swaps
    linears. k/v may have fewer heads than q (grouped-query attention)."""

    def __init__(self, impl: str = DEFAULT_IMPL) -> None:
        super().__init__()
        self.impl = check_impl(impl)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        return core_attention(q, k, v, causal=True, impl=self.impl, segment_ids=segment_ids)

    def extra_repr(self) -> str:
        return f"impl={self.impl}"


def _mask(
    s_q: int,
    s_k: int,
    causal: bool,
    seg_q: torch.Tensor | None,
    seg_k: torch.Tensor | None,
    device: torch.device,
    q0: int = 0,
    k0: int = 0,
) -> torch.Tensor:
    """True where query row q0+i may NOT see key k0+j: above the causal diagonal, or another segment.
    [s_q, s_k] without segments, [B, s_q, s_k] with them (seg_q [B, s_q], seg_k [B, s_k])."""
    masked = torch.zeros(s_q, s_k, dtype=torch.bool, device=device)
    if causal:
        rows = torch.arange(q0, q0 + s_q, device=device)[:, None]
        cols = torch.arange(k0, k0 + s_k, device=device)[None, :]
        masked = cols > rows
    if seg_q is not None:
        masked = masked | (seg_q[:, :, None] != seg_k[:, None, :])
    return masked


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, S, D] → [B, Hkv, H/Hkv, S, D]: query heads grouped under the KV head they share."""
    b, h, s, d = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, s, d)


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, segment_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """The whole [B, H, S, S] score matrix at once (K/V broadcast over their query-head group, not copied)."""
    kv = k.shape[1]
    dtype = _compute_dtype(q.dtype)
    qg = _grouped(q, kv).to(dtype)
    scores = (qg @ k.unsqueeze(2).to(dtype).transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal or segment_ids is not None:
        masked = _mask(q.shape[2], k.shape[2], causal, segment_ids, segment_ids, q.device)
        if masked.dim() == 3:  # [B, S, S] → [B, 1, 1, S, S] over the grouped heads
            masked = masked[:, None, None]
        scores = scores.masked_fill(masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = probs @ v.unsqueeze(2).to(dtype)
    return out.reshape(q.shape).to(q.dtype)


def _tile_mask(
    i0: int, i1: int, j0: int, j1: int, device: torch.device, causal: bool = True, segment_ids: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Mask of the score tile rows i0:i1 × columns j0:j1 (True = masked; [B, 1, 1, rows, cols] with segments), or
    None when nothing in it is masked (wholly on or below the diagonal, one segment)."""
    if segment_ids is None:
        if not causal or j1 - 1 <= i0:
            return None
        return _mask(i1 - i0, j1 - j0, True, None, None, device, i0, j0)
    return _mask(i1 - i0, j1 - j0, causal and j1 - 1 > i0, segment_ids[:, i0:i1], segment_ids[:, j0:j1], device, i0, j0)[
        :, None, None
    ]


class _BlockwiseAttention(torch.autograd.Function):
    """Forward and backward over block×block score tiles; saves q, k, v, the output and the logsumexp."""

    @staticmethod
    def forward(ctx, q, k, v, causal, block, segment_ids):
        b, h, s_q, d = q.shape
        kv, s_k = k.shape[1], k.shape[2]
        dtype = _compute_dtype(q.dtype)
        scale = 1.0 / math.sqrt(d)
        qg = _grouped(q, kv)  # [B, Hkv, G, S, D]
        k5, v5 = k.unsqueeze(2), v.unsqueeze(2)  # [B, Hkv, 1, S, D]: broadcast over the group
        out = torch.empty(qg.shape, dtype=dtype, device=q.device)
        lse = torch.empty(qg.shape[:-1], dtype=dtype, device=q.device)
        for i0 in range(0, s_q, block):
            i1 = min(i0 + block, s_q)
            qi = qg[..., i0:i1, :].to(dtype) * scale
            m = torch.full(qi.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
            l = torch.zeros_like(m)
            acc = torch.zeros(qi.shape, dtype=dtype, device=q.device)
            for j0 in range(0, min(i1, s_k) if causal else s_k, block):
                j1 = min(j0 + block, s_k)
                s = qi @ k5[..., j0:j1, :].to(dtype).transpose(-1, -2)  # the only score tile held
                mask = _tile_mask(i0, i1, j0, j1, q.device, causal, segment_ids)
                if mask is not None:
                    s = s.masked_fill(mask, float("-inf"))
                m_new = torch.maximum(m, s.amax(dim=-1))
                # a row may see no key of this block yet (another segment): keep exp() away from -inf - -inf
                m_use = m_new.masked_fill(m_new == float("-inf"), 0.0)
                p = torch.exp(s - m_use[..., None])
                alpha = torch.exp(m - m_use)  # rescales what earlier key blocks summed (0 on the first)
                l = l * alpha + p.sum(dim=-1)
                acc = acc * alpha[..., None] + p @ v5[..., j0:j1, :].to(dtype)
                m = m_new
            out[..., i0:i1, :] = acc / l[..., None]
            lse[..., i0:i1] = m + torch.log(l)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block, ctx.segment_ids = causal, block, segment_ids
        return out.reshape(b, h, s_q, d)

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            return _BlockwiseAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        causal, block, segment_ids = ctx.causal, ctx.block, ctx.segment_ids
        b, h, s_q, d = q.shape
        kv, s_k = k.shape[1], k.shape[2]
        dtype = _compute_dtype(q.dtype)
        scale = 1.0 / math.sqrt(d)
        qg = _grouped(q, kv)
        do = _grouped(grad_out.contiguous(), kv).to(dtype)
        k5, v5 = k.unsqueeze(2), v.unsqueeze(2)
        delta = (do * out.to(dtype)).sum(dim=-1)  # rowsum(dO ∘ O) = Σ_j P_ij dP_ij
        dq = torch.zeros(qg.shape, dtype=dtype, device=q.device)
        dk = torch.zeros(k5.shape, dtype=dtype, device=q.device)
        dv = torch.zeros(v5.shape, dtype=dtype, device=q.device)
        for j0 in range(0, s_k, block):
            j1 = min(j0 + block, s_k)
            kj, vj = k5[..., j0:j1, :].to(dtype), v5[..., j0:j1, :].to(dtype)
            dkj = torch.zeros(kj.shape, dtype=dtype, device=q.device)
            dvj = torch.zeros(vj.shape, dtype=dtype, device=q.device)
            for i0 in range(j0 if causal else 0, s_q, block):  # causal: rows above j0 see none of these keys
                i1 = min(i0 + block, s_q)
                qi = qg[..., i0:i1, :].to(dtype)
                s = (qi * scale) @ kj.transpose(-1, -2)
                p = torch.exp(s - lse[..., i0:i1, None])  # the forward's probabilities, recomputed
                mask = _tile_mask(i0, i1, j0, j1, q.device, causal, segment_ids)
                if mask is not None:
                    p = p.masked_fill(mask, 0.0)
                doi = do[..., i0:i1, :]
                dvj += (p.transpose(-1, -2) @ doi).sum(dim=2, keepdim=True)  # summed over the query-head group
                ds = p * (doi @ vj.transpose(-1, -2) - delta[..., i0:i1, None])
                dq[..., i0:i1, :] += (ds @ kj) * scale
                dkj += (ds.transpose(-1, -2) @ qi).sum(dim=2, keepdim=True) * scale
            dk[..., j0:j1, :] = dkj
            dv[..., j0:j1, :] = dvj
        return (dq.reshape(b, h, s_q, d).to(q.dtype), dk.squeeze(2).to(k.dtype), dv.squeeze(2).to(v.dtype), None, None, None)
