"""nxdt.models.llama: shapes, grouped-query attention, tied embeddings, causality, RoPE convention,
activation checkpointing, determinism, FLOP accounting, and that a tiny model can learn."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from nxdt.models.llama import LlamaForCausalLM, apply_rope, rope_tables


def config(**overrides) -> SimpleNamespace:
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
    )
    return SimpleNamespace(**{**base, **overrides})


def build(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(config(**overrides))


def tokens(batch: int = 2, seq: int = 16, vocab: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_forward_shapes_and_hf_like_names():
    model = build()
    logits = model(tokens(3, 10))
    assert logits.shape == (3, 10, 64) and logits.dtype == torch.float32
    names = set(dict(model.named_parameters()))
    for name in (
        "embed_tokens.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.0.self_attn.v_proj.weight",
        "layers.0.self_attn.o_proj.weight",
        "layers.1.mlp.gate_proj.weight",
        "layers.1.mlp.up_proj.weight",
        "layers.1.mlp.down_proj.weight",
        "layers.1.input_layernorm.weight",
        "layers.1.post_attention_layernorm.weight",
        "norm.weight",
        "lm_head.weight",
    ):
        assert name in names, name
    assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == 2
    assert not any("rope" in k for k in model.state_dict())  # derived tables are not checkpointed


def test_grouped_query_attention_equals_multi_head_with_repeated_kv_weights():
    gqa = build(num_kv_heads=2)
    attn = gqa.layers[0].self_attn
    assert attn.k_proj.out_features == 2 * 8 and attn.q_proj.out_features == 4 * 8
    # The same model as plain multi-head attention: each KV head's weights copied to its group of query heads.
    mha = build(num_kv_heads=None)
    state = gqa.state_dict()
    for key, value in state.items():
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            state[key] = value.view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(state)
    x = tokens()
    torch.testing.assert_close(gqa(x), mha(x), rtol=1e-5, atol=1e-6)


def test_tied_embeddings_share_one_parameter():
    model = build(tie_word_embeddings=True)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    untied = build(tie_word_embeddings=False)
    assert untied.num_parameters() - model.num_parameters() == 64 * 32
    model.loss_fn(model(tokens()), tokens(seed=2)).backward()
    assert model.embed_tokens.weight.grad is not None  # gradients of both uses land in the one tensor


def test_logits_are_causal():
    model = build().eval()
    x = tokens(1, 16)
    changed = x.clone()
    changed[0, 9] = (x[0, 9] + 1) % 64
    a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=0)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_rope_uses_hf_rotate_half_convention_and_encodes_relative_position():
    head_dim = 8
    cos, sin = rope_tables(head_dim, 16, 10000.0)
    x = torch.randn(1, 1, 16, head_dim, dtype=torch.float64)
    out = apply_rope(x, cos.double(), sin.double())
    # HF layout: dimension i pairs with i + head_dim/2, rotated by angle pos · theta^(-2i/head_dim)
    half = head_dim // 2
    for pos in (0, 3, 15):
        for i in range(half):
            angle = pos * 10000.0 ** (-2 * i / head_dim)
            a, b = x[0, 0, pos, i], x[0, 0, pos, i + half]
            expect_a = a * math.cos(angle) - b * math.sin(angle)
            expect_b = b * math.cos(angle) + a * math.sin(angle)
            assert out[0, 0, pos, i].item() == pytest.approx(expect_a.item(), abs=1e-6)
            assert out[0, 0, pos, i + half].item() == pytest.approx(expect_b.item(), abs=1e-6)
    # q·k after rotation depends only on the distance between positions
    q, k = torch.randn(head_dim, dtype=torch.float64), torch.randn(head_dim, dtype=torch.float64)

    def score(pq: int, pk: int) -> float:
        rq = apply_rope(q.view(1, 1, 1, -1), cos[pq : pq + 1].double(), sin[pq : pq + 1].double())
        rk = apply_rope(k.view(1, 1, 1, -1), cos[pk : pk + 1].double(), sin[pk : pk + 1].double())
        return float((rq * rk).sum())

    assert score(5, 2) == pytest.approx(score(13, 10), abs=1e-5)


def loss_and_grads(model: LlamaForCausalLM) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model.loss_fn(model(tokens(2, 16)), tokens(2, 16, seed=2))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_activation_checkpointing_gives_identical_loss_and_grads(granularity):
    ref_loss, ref_grads = loss_and_grads(build(activations_checkpoint_granularity=None))
    model = build(activations_checkpoint_granularity=granularity)
    calls = []
    target = model.layers[0] if granularity == "full" else model.layers[0].self_attn.core
    target.register_forward_pre_hook(lambda *args: calls.append(1))  # recomputation may stop early: no post-hook
    loss, grads = loss_and_grads(model)
    assert len(calls) == 2  # forward, then the recomputation in backward: checkpointing really happened
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-6, atol=1e-8, msg=name)


def test_same_seed_same_weights_and_init_scales():
    a, b, c = build(seed=7), build(seed=7), build(seed=8)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.layers[0].self_attn.q_proj.weight, c.layers[0].self_attn.q_proj.weight)
    big = build(seed=0, hidden_size=256, ffn_hidden_size=512, num_layers=8)
    assert big.layers[0].self_attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert big.layers[0].mlp.down_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert torch.equal(big.norm.weight, torch.ones(256))


def test_num_parameters():
    cfg = config()
    model = build()
    h, f, v, kv_dim = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, 2 * 8
    per_layer = h * h + 2 * h * kv_dim + h * h + 3 * h * f + 2 * h
    expected = v * h + cfg.num_layers * per_layer + h + h * v
    assert model.num_parameters() == expected
    assert model.num_parameters(exclude_embeddings=True) == expected - v * h
    tied = build(tie_word_embeddings=True)  # the shared table is the output head's matmul: counted once
    assert tied.num_parameters(exclude_embeddings=True) == tied.num_parameters() == expected - v * h


def test_loss_is_fp32_mean_next_token_cross_entropy():
    logits = torch.randn(2, 5, 64).bfloat16()
    labels = tokens(2, 5)
    loss = LlamaForCausalLM.loss_fn(logits, labels)
    assert loss.dtype == torch.float32
    manual = -torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).mean()
    torch.testing.assert_close(loss, manual)


def test_bf16_forward_runs():
    model = build().to(torch.bfloat16)
    assert model(tokens()).dtype == torch.bfloat16


def test_clear_errors_for_bad_shapes():
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        build(num_kv_heads=3)
    with pytest.raises(ValueError, match="hidden_size=30"):
        build(hidden_size=30)
    with pytest.raises(ValueError, match="activations_checkpoint_granularity"):
        build(activations_checkpoint_granularity="everything")
    with pytest.raises(ValueError, match="max_position_embeddings=32"):
        build()(tokens(1, 33))


def test_tiny_model_overfits_a_fixed_batch():
    model = build(seed=0, vocab_size=64, hidden_size=64, ffn_hidden_size=128, num_layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    x, y = tokens(4, 16, seed=3), tokens(4, 16, seed=4)
    losses = []
    for _ in range(30):
        loss = model.loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(64), abs=0.3)  # small init: near-uniform predictions
    assert losses[-1] < 0.25 * losses[0], losses
