"""Packed sequences: ``segment_ids`` keep attention inside each record and ``position_ids`` restart RoPE / the
position embedding per record, so a packed row computes exactly what its records compute one by one.

The reference is independent of the mask code: each record is run *alone* (its own tensor, positions
0..len-1, plain causal attention) and the results are concatenated. Tolerances: fp32 throughout; packed and
alone differ only in which (masked, exactly zero-weight) keys enter a softmax row and in matmul blocking over a
longer row, so the difference is a few ulps of the values (~1e-6 relative); 1e-5 absolute on O(1) values leaves
an order of magnitude, on any x86 host.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nxdt.models.attention import IMPLEMENTATIONS, SequenceLayout, core_attention
from nxdt.models.gpt import GPTForCausalLM
from nxdt.models.llama import LlamaForCausalLM
from nxdt.parallel.pipeline import build_chunks, unpack_microbatch

LENGTHS = [5, 3, 8]  # records packed into one row of 16 tokens


def _segments(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    return seg, pos


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_segment_masked_attention_equals_each_record_alone_forward_and_backward(impl):
    torch.manual_seed(0)
    b, h, kv, d = 2, 4, 2, 8
    s = sum(LENGTHS)
    q = torch.randn(b, h, s, d, requires_grad=True)
    k = torch.randn(b, kv, s, d, requires_grad=True)
    v = torch.randn(b, kv, s, d, requires_grad=True)
    seg = _segments(LENGTHS)[0].expand(b, s)
    out = core_attention(q, k, v, impl=impl, segment_ids=seg, block_size=4)  # blocks straddle record boundaries
    grad = torch.randn_like(out)
    out.backward(grad)

    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    pieces, start = [], 0
    for n in LENGTHS:
        sl = slice(start, start + n)
        pieces.append(core_attention(q2[:, :, sl], k2[:, :, sl], v2[:, :, sl], impl="naive"))
        start += n
    ref = torch.cat(pieces, dim=2)
    ref.backward(grad)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    for mine, theirs in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=0)


def test_segments_need_matching_shapes():
    q = torch.randn(1, 2, 6, 4)
    with pytest.raises(ValueError, match="segment_ids"):
        core_attention(q, q, q, segment_ids=torch.zeros(1, 5, dtype=torch.long))


def _cfg(**over):
    base = dict(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=48,
        max_position_embeddings=32,
        rope_theta=10000.0,
        norm_eps=1e-5,
        tie_word_embeddings=False,
        init_method_std=0.02,
        activations_checkpoint_granularity=None,
        core_attention="sdpa",
    )
    base.update(over)
    return SimpleNamespace(**base)


@pytest.mark.parametrize(
    "model_cls,impl,ckpt",
    [
        (LlamaForCausalLM, "sdpa", None),
        (LlamaForCausalLM, "blockwise", "full"),
        (LlamaForCausalLM, "naive", "selective"),
        (GPTForCausalLM, "sdpa", None),
        (GPTForCausalLM, "naive", "full"),
    ],
)
def test_a_packed_row_gives_each_records_own_logits(model_cls, impl, ckpt):
    torch.manual_seed(0)
    model = model_cls(_cfg(core_attention=impl, activations_checkpoint_granularity=ckpt))
    seg, pos = _segments(LENGTHS)
    ids = torch.randint(0, 64, (1, seg.numel()))
    packed = model(ids, position_ids=pos[None], segment_ids=seg[None])
    alone, start = [], 0
    for n in LENGTHS:
        alone.append(model(ids[:, start : start + n]))
        start += n
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), atol=1e-5, rtol=0)


def test_positions_alone_shift_rope_and_are_checked():
    """Positions p..p+S-1 are what a context-parallel shard of a longer sequence needs: with the keys of the
    same shard, attention only sees relative positions, so logits equal the 0..S-1 run (RoPE is relative)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(_cfg())
    ids = torch.randint(0, 64, (2, 10))
    shifted = model(ids, position_ids=(torch.arange(10) + 7).expand(2, 10))
    torch.testing.assert_close(shifted, model(ids), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="outside model.max_position_embeddings=32"):
        model(ids, position_ids=(torch.arange(10) + 30).expand(2, 10))
    with pytest.raises(ValueError, match="must have the shape of input_ids"):
        model(ids, position_ids=torch.arange(10)[None])


def test_pipeline_chunks_carry_the_layout_to_every_stage():
    torch.manual_seed(0)
    model = LlamaForCausalLM(_cfg(num_layers=4))
    seg, pos = _segments(LENGTHS)
    ids = torch.randint(0, 64, (1, seg.numel()))
    expected = model(ids, pos[None], seg[None])
    mb = {"input_ids": ids, "labels": ids, "position_ids": pos[None], "segment_ids": seg[None]}
    ids_, _, layout = unpack_microbatch(mb)
    assert isinstance(layout, SequenceLayout) and unpack_microbatch((ids, ids))[2] is None
    x = ids_
    for chunk in build_chunks(model, stage=0, num_stages=1, virtual=2):  # two chunks on one stage: embed … head
        x = chunk(x, layout)
    torch.testing.assert_close(x, expected, atol=0, rtol=0)
