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
from hf_reference import TINY_LLAMA, llama_config

TINY = TINY_LLAMA
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


# --- KV cache and sampling (issue 34) ---------------------------------------------------------------------------

from nxdt.models.attention import KVCache  # noqa: E402
from nxdt.models.generate import generate, left_pad, warp, Sampling  # noqa: E402
from nxdt.models.gpt import GPTForCausalLM  # noqa: E402
from nxdt.models.mixtral import MixtralForCausalLM  # noqa: E402


def hub_models():
    """Llama (GQA, RoPE), Mixtral (routed experts) and GPT (learned positions, biases): every hub attention."""
    torch.manual_seed(1)
    out = {"llama": LlamaForCausalLM(SimpleNamespace(**TINY))}
    moe = SimpleNamespace(num_experts=4, top_k=2, router_aux_loss_coef=0.02)
    out["mixtral"] = MixtralForCausalLM(SimpleNamespace(**TINY, moe=moe))
    out["gpt"] = GPTForCausalLM(SimpleNamespace(**TINY))
    for model in out.values():
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.3 * torch.randn_like(p))
        model.eval()
    return out


@pytest.mark.parametrize("name", ["llama", "mixtral", "gpt"])
def test_cached_logits_equal_the_full_prefix_forward(name):
    """Prefill a left-padded batch into the cache, then feed one token per step: every step's last-position logits
    equal a full forward over the whole (left-padded) prefix. Same fp32 math over the same keys in another
    order (a masked sdpa over the cache vs. the block-causal one), so they agree to fp32 rounding: logits are
    O(10) here and 2 layers of 32-wide sums keep the difference near 1e-6; 1e-4 absolute leaves a wide margin
    while a wrong position, mask or stale cache entry moves logits by O(1)."""
    model = hub_models()[name]
    continuation = [[4, 8, 15], [16, 23, 42], [1, 2, 3]]
    cache = KVCache()
    batch = left_pad(PROMPTS)
    with torch.no_grad():
        model(batch["input_ids"], position_ids=batch["position_ids"], segment_ids=batch["segment_ids"], kv_cache=cache)
        for step in range(3):
            new = torch.tensor([[c[step]] for c in continuation])
            positions = torch.tensor([[len(p) + step] for p in PROMPTS])
            cached = model(new, position_ids=positions, segment_ids=torch.ones_like(new), kv_cache=cache)[:, -1]
            full = left_pad([p + c[: step + 1] for p, c in zip(PROMPTS, continuation)])
            reference = model(full["input_ids"], position_ids=full["position_ids"], segment_ids=full["segment_ids"])
            torch.testing.assert_close(cached, reference[:, -1], rtol=0, atol=1e-4)
    assert len(cache) == max(len(p) for p in PROMPTS) + 3


@pytest.mark.parametrize("name", ["llama", "mixtral", "gpt"])
def test_cached_greedy_equals_uncached_with_eos(name):
    model = hub_models()[name]
    free = generate(model, PROMPTS, NEW, use_cache=False)
    assert generate(model, PROMPTS, NEW) == free
    eos = free[1][2]  # rows leave the batch at different steps: the cache must drop exactly those rows
    assert generate(model, PROMPTS, NEW, eos_id=eos) == generate(model, PROMPTS, NEW, eos_id=eos, use_cache=False)


def test_cached_greedy_equals_transformers(models):
    model, hf = models
    assert greedy_generate(model, PROMPTS, NEW) == [hf_greedy(hf, p, NEW) for p in PROMPTS]


def test_warpers_equal_transformers():
    """temperature → top-k → top-p as transformers' own warpers compute them (generation/logits_process.py)."""
    pytest.importorskip("transformers")
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(3)
    logits = torch.randn(5, 64) * 3
    for temperature, top_k, top_p in [(0.7, 0, 1.0), (1.0, 10, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.6)]:
        expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p < 1:
            expected = TopPLogitsWarper(top_p)(None, expected)
        ours = warp(logits, Sampling(True, temperature, top_k, top_p))
        assert torch.equal(ours.isinf(), expected.isinf()), (temperature, top_k, top_p)
        torch.testing.assert_close(ours, expected, rtol=0, atol=0)  # the same fp32 division, nothing else


def test_sampling_is_reproducible_with_a_seeded_generator():
    model = hub_models()["llama"]
    kwargs = dict(do_sample=True, temperature=1.5, top_k=20, top_p=0.9)
    first = generate(model, PROMPTS, NEW, generator=torch.Generator().manual_seed(7), **kwargs)
    again = generate(model, PROMPTS, NEW, generator=torch.Generator().manual_seed(7), **kwargs)
    other = generate(model, PROMPTS, NEW, generator=torch.Generator().manual_seed(8), **kwargs)
    assert first == again and first != other
    # without the cache the same draws are made in the same order: the same tokens (the probabilities differ by fp32
    # rounding, ~1e-7; a draw could only flip if its uniform fell that close to a bucket edge, ~1e-6 over these draws)
    assert generate(model, PROMPTS, NEW, generator=torch.Generator().manual_seed(7), use_cache=False, **kwargs) == first
    # top_k=1 leaves one token: sampling is greedy decoding
    assert generate(model, PROMPTS, NEW, do_sample=True, top_k=1, generator=torch.Generator().manual_seed(0)) == (
        generate(model, PROMPTS, NEW)
    )


def test_bad_sampling_options_are_refused_by_name():
    model = hub_models()["gpt"]
    with pytest.raises(ValueError, match="temperature=0"):
        generate(model, PROMPTS, 2, do_sample=True, temperature=0)
    with pytest.raises(ValueError, match=r"top_p=1.5"):
        generate(model, PROMPTS, 2, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="top_k=-1"):
        generate(model, PROMPTS, 2, do_sample=True, top_k=-1)


def test_lockstep_decoding_runs_idle_forwards_and_changes_no_completion():
    """``keep_going`` (FSDP's lockstep: another rank still decoding) keeps this process stepping after its own rows
    ended: one forward per step until the step the others stop at, each idle one a single token, no random draw (the
    generator ends in the state decoding alone leaves it) — and the completions are exactly decoding alone's."""
    model = hub_models()["llama"]
    sampled = dict(do_sample=True, temperature=1.5)
    free = generate(model, PROMPTS[:1], NEW, generator=torch.Generator().manual_seed(5), **sampled)
    eos = free[0][2]  # this rank's one row ends within 3 steps
    alone_gen = torch.Generator().manual_seed(5)
    alone = generate(model, PROMPTS[:1], NEW, eos_id=eos, generator=alone_gen, **sampled)
    assert len(alone[0]) <= 3 and alone[0][-1] == eos
    others = 7  # the other ranks decode 7 steps (of NEW = 10)
    calls: list[bool] = []

    def keep_going(mine: bool) -> bool:
        calls.append(mine)
        return mine or len(calls) < others

    shapes: list[tuple[int, ...]] = []
    hook = model.register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape)))
    try:
        lockstep_gen = torch.Generator().manual_seed(5)
        lockstep = generate(model, PROMPTS[:1], NEW, eos_id=eos, generator=lockstep_gen, keep_going=keep_going, **sampled)
    finally:
        hook.remove()
    assert lockstep == alone
    assert len(shapes) == len(calls) == others  # one forward and one agreement per step, on every rank alike
    assert all(s == (1, 1) for s in shapes[len(alone[0]) :])  # after its row ended: one-token idle forwards
    assert torch.equal(lockstep_gen.get_state(), alone_gen.get_state())  # the idle steps drew nothing
