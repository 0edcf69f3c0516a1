"""Core attention, softmax(QKᵀ/√d)V, behind one function every hub model calls (``model.core_attention``).

``core_attention(q, k, v, causal=True, impl=...)`` takes q [B, H, S, D] and k, v [B, Hkv, S, D] with Hkv
dividing H (grouped-query attention: KV head j serves query heads [j·H/Hkv, (j+1)·H/Hkv)), and returns
[B, H, S, D]. It sees only the heads it is given, so under tensor parallelism it runs on a rank's local
heads unchanged. ``causal`` masks key j > query i (top-left aligned, as ``scaled_dot_product_attention``'s
``is_causal``). Three implementations, equal up to floating-point rounding:

``naive``     QKᵀ as one [B, H, S, S] matrix, masked, softmax (fp32), times V: the reference; autograd keeps
              the S×S probabilities for backward (the ``5·a·s/h`` term of the planner's activation memory).
``sdpa``      ``torch.nn.functional.scaled_dot_product_attention`` (GQA with ``enable_gqa``, no K/V copy). On
              CPU, torch 2.x dispatches these inputs (4-D, dense, causal, no mask/dropout) to its fused flash
              kernel ``_scaled_dot_product_flash_attention_for_cpu``, which works in blocks and saves only the
              output and a logsumexp for backward; its ``math`` fallback (taken e.g. with an explicit mask) would
              materialise S×S, so tests/test_rope_attention.py checks the dispatch. The default.
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

import torch
import torch.nn.functional as F

IMPLEMENTATIONS = ("naive", "sdpa", "blockwise")
DEFAULT_IMPL = "sdpa"
BLOCK_SIZE = 128  # blockwise: rows of a query block and of a key block


def check_impl(impl: str) -> str:
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"model.core_attention={impl!r}: use one of {', '.join(IMPLEMENTATIONS)}")
    return impl


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, impl: str = DEFAULT_IMPL,
                   block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """softmax(QKᵀ/√d [+ causal mask])V; q [B, H, S, D], k/v [B, Hkv, S, D] → [B, H, S, D]."""
    check_impl(impl)
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{k.shape[1]} key/value heads must divide {q.shape[1]} query heads")
    if impl == "sdpa":
        gqa = k.shape[1] != q.shape[1]
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    if impl == "blockwise":
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        # its own precision (fp32 tiles for 16-bit inputs) in forward and backward alike: autocast off inside
        with torch.autocast(q.device.type, enabled=False):
            return _BlockwiseAttention.apply(q, k, v, causal, block_size)
    return naive_attention(q, k, v, causal=causal)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, S, D] → [B, Hkv, H/Hkv, S, D]: query heads grouped under the KV head they share."""
    b, h, s, d = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, s, d)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True) -> torch.Tensor:
    """The whole [B, H, S, S] score matrix at once (K/V broadcast over their query-head group, not copied)."""
    kv = k.shape[1]
    dtype = _compute_dtype(q.dtype)
    qg = _grouped(q, kv).to(dtype)
    scores = (qg @ k.unsqueeze(2).to(dtype).transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        s_q, s_k = q.shape[2], k.shape[2]
        above = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = probs @ v.unsqueeze(2).to(dtype)
    return out.reshape(q.shape).to(q.dtype)


def _tile_mask(i0: int, i1: int, j0: int, j1: int, device: torch.device) -> torch.Tensor | None:
    """Causal mask of the score tile rows i0:i1 × columns j0:j1 (True = masked), or None when the tile is
    wholly on or below the diagonal."""
    if j1 - 1 <= i0:
        return None
    rows = torch.arange(i0, i1, device=device)[:, None]
    cols = torch.arange(j0, j1, device=device)[None, :]
    return cols > rows


class _BlockwiseAttention(torch.autograd.Function):
    """Forward and backward over block×block score tiles; saves q, k, v, the output and the logsumexp."""

    @staticmethod
    def forward(ctx, q, k, v, causal, block):
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
                mask = _tile_mask(i0, i1, j0, j1, q.device) if causal else None
                if mask is not None:
                    s = s.masked_fill(mask, float("-inf"))
                m_new = torch.maximum(m, s.amax(dim=-1))
                p = torch.exp(s - m_new[..., None])
                alpha = torch.exp(m - m_new)  # rescales what earlier key blocks summed (0 on the first)
                l = l * alpha + p.sum(dim=-1)
                acc = acc * alpha[..., None] + p @ v5[..., j0:j1, :].to(dtype)
                m = m_new
            out[..., i0:i1, :] = acc / l[..., None]
            lse[..., i0:i1] = m + torch.log(l)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block = causal, block
        return out.reshape(b, h, s_q, d)

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            return _BlockwiseAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        causal, block = ctx.causal, ctx.block
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
                mask = _tile_mask(i0, i1, j0, j1, q.device) if causal else None
                if mask is not None:
                    p = p.masked_fill(mask, 0.0)
                doi = do[..., i0:i1, :]
                dvj += (p.transpose(-1, -2) @ doi).sum(dim=2, keepdim=True)  # summed over the query-head group
                ds = p * (doi @ vj.transpose(-1, -2) - delta[..., i0:i1, None])
                dq[..., i0:i1, :] += (ds @ kj) * scale
                dkj += (ds.transpose(-1, -2) @ qi).sum(dim=2, keepdim=True) * scale
            dk[..., j0:j1, :] = dkj
            dv[..., j0:j1, :] = dvj
        return (dq.reshape(b, h, s_q, d).to(q.dtype), dk.squeeze(2).to(k.dtype), dv.squeeze(2).to(v.dtype), None, None)
