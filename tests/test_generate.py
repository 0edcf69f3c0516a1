"""``nxdt.models.generate.greedy_generate`` against ``transformers``' ``LlamaForCausalLM.generate(do_sample=False)``
on the same weights: the same tokens for prompts decoded alone, the same tokens when prompts of different lengths
share one left-padded batch, and decoding stops at EOS exactly where transformers does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nxdt.lightning.hf import hf_name
from nxdt.models.generate import greedy_generate
from nxdt.models.llama import LlamaForCausalLM
from hf_reference import llama_config

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=64,
    max_position_embeddings=64,
    rope_theta=10000.0,
    norm_eps=1e-5,
    tie_word_embeddings=False,
    init_method_std=0.02,
    activations_checkpoint_granularity=None,
)
PROMPTS = [[5, 17, 42, 3, 9, 11, 60], [7, 1], [33, 33, 2, 48]]
NEW = 12


@pytest.fixture(scope="module")
def models():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = LlamaForCausalLM(SimpleNamespace(**TINY))
    with torch.no_grad():  # distinctive weights (norms away from 1) so the logits are far from ties
        for p in model.parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.3 * torch.randn_like(p))
    model.eval()
    hf = transformers.LlamaForCausalLM(llama_config(transformers, TINY)).eval()
    hf.load_state_dict({hf_name(n): t for n, t in model.state_dict().items()}, strict=True)
    return model, hf


def hf_greedy(hf, prompt: list[int], new: int, eos_id: int | None = None) -> list[int]:
    """transformers' greedy continuation of one prompt (no padding), new tokens only."""
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=0,
        eos_token_id=eos_id,
        pad_token_id=0 if eos_id is None else eos_id,
        num_beams=1,
    )
    return out[0, len(prompt) :].tolist()


def smallest_top2_gap(model, prompt: list[int], continuation: list[int]) -> float:
    """The smallest gap between the best and second-best logit over the decoded steps."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + continuation]))[0, len(prompt) - 1 : -1]
    top = logits.topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def test_greedy_equals_transformers_alone_and_in_a_left_padded_batch(models):
    model, hf = models
    expected = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    # Both implementations compute the logits in fp32 with different kernels, so they differ by ~1e-6; the arg-max
    # is only comparable when no step is a near-tie. Check that rather than assume it (any x86 host).
    for p, e in zip(PROMPTS, expected):
        assert smallest_top2_gap(model, p, e) > 1e-3, "a near-tie: pick other prompts/weights"
    assert [greedy_generate(model, [p], NEW)[0] for p in PROMPTS] == expected
    batched = greedy_generate(model, PROMPTS, NEW)  # lengths 7, 2, 4: rows 2 and 3 are left-padded
    assert batched == expected
    assert all(len(e) == NEW for e in batched)


def test_stops_at_eos_like_transformers(models):
    model, hf = models
    free = greedy_generate(model, PROMPTS, NEW)
    eos = free[0][3]  # a token the first prompt produces at step 4
    first = free[0].index(eos)
    out = greedy_generate(model, PROMPTS, NEW, eos_id=eos)
    assert out[0] == free[0][: first + 1]  # stops right after EOS, EOS included
    for p, o, f in zip(PROMPTS, out, free):
        assert o == hf_greedy(hf, p, NEW, eos_id=eos)
        assert o == (f[: f.index(eos) + 1] if eos in f else f)  # rows that never hit EOS are unaffected
    assert greedy_generate(model, PROMPTS, 0) == [[], [], []]


def test_bad_prompts_are_refused_by_name(models):
    model, _ = models
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        greedy_generate(model, [[1, 2], []], 3)
    with pytest.raises(ValueError, match="max_new_tokens=-1"):
        greedy_generate(model, [[1]], -1)
