"""The model hub beyond Llama (single process).

Mixtral: shapes and gradients; the MoE block equals a per-token dense reference (top-k of the router
softmax, renormalised, weighted sum of SwiGLU experts) for k = 1, 2, E; the aux loss equals the explicit
formula over all layers' router logits and ``loss_fn`` adds it with its coefficient; HF-aligned names;
logits, loss and aux loss equal Hugging Face's ``MixtralForCausalLM`` with the same weights (if
transformers is installed); full activation checkpointing changes nothing; config errors are clear.
GPT: shapes, the parameter-count formula, tied embeddings, loss decreasing over 20 steps on one batch.
The shipped YAML configs build their models.
"""

from __future__ import annotations

import copy
import math
import pathlib
import types

import pytest
import torch
import torch.nn.functional as F
import yaml

from nxdt.models.gpt import GPTForCausalLM
from nxdt.models.mixtral import MixtralForCausalLM, SparseMoeBlock, load_balancing_loss

CONF = pathlib.Path(__file__).resolve().parents[1] / "conf" / "model"


def mixtral_cfg(**over) -> types.SimpleNamespace:
    moe = types.SimpleNamespace(num_experts=4, top_k=2, router_aux_loss_coef=0.02)
    for key in ("num_experts", "top_k", "router_aux_loss_coef"):
        if key in over:
            setattr(moe, key, over.pop(key))
    base = dict(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=48,
        max_position_embeddings=64,
        rope_theta=10000.0,
        norm_eps=1e-5,
        tie_word_embeddings=False,
        init_method_std=0.02,
        activations_checkpoint_granularity=None,
        moe=moe,
    )
    base.update(over)
    return types.SimpleNamespace(**base)


def gpt_cfg(**over) -> types.SimpleNamespace:
    base = dict(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        ffn_hidden_size=128,
        max_position_embeddings=32,
        norm_eps=1e-5,
        tie_word_embeddings=True,
        init_method_std=0.02,
        activations_checkpoint_granularity=None,
    )
    base.update(over)
    return types.SimpleNamespace(**base)


def _batch(vocab: int, b: int = 2, s: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


# ----------------------------------------------------------------------------------------------- Mixtral
def test_mixtral_shapes_backward_and_names():
    torch.manual_seed(0)
    model = MixtralForCausalLM(mixtral_cfg())
    ids, labels = _batch(64)
    logits = model(ids)
    assert logits.shape == (2, 8, 64)
    assert [r.shape for r in model.router_logits()] == [(16, 4)] * 2
    loss = model.loss_fn(logits, labels)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for n, p in model.named_parameters() if ".experts." not in n)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if ".experts." in n)
    names = set(dict(model.named_parameters()))
    for key in (
        "layers.1.block_sparse_moe.gate.weight",
        "layers.1.block_sparse_moe.experts.3.w1.weight",
        "layers.1.block_sparse_moe.experts.3.w2.weight",
        "layers.1.block_sparse_moe.experts.3.w3.weight",
        "layers.0.self_attn.k_proj.weight",
        "embed_tokens.weight",
        "norm.weight",
        "lm_head.weight",
    ):
        assert key in names, key
    assert model.layers[0].block_sparse_moe.experts["3"].w2.weight.shape == (32, 48)
    twin = copy.deepcopy(model)  # after a forward: the recorded router logits are not copied
    assert twin.router_logits() == [] and len(model.router_logits()) == 2
    # num_parameters: dense Llama part + router + E experts per layer; active: top_k experts
    h, f, v, layers = 32, 48, 64, 2
    attn = h * h * 2 + 2 * h * (h // 2)  # q, o + k, v with 2 of 4 KV heads
    dense = 2 * v * h + layers * (attn + 2 * h + 4 * h) + h
    assert model.num_parameters() == dense + layers * 4 * 3 * h * f == sum(p.numel() for p in model.parameters())
    assert model.num_parameters(active_only=True) == dense + layers * 2 * 3 * h * f


def _dense_reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax router, top-k, renormalise, weighted sum of the chosen SwiGLU experts."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ block.gate.weight.T, dim=-1)
        chosen = sorted(range(block.num_experts), key=lambda e: -float(probs[e]))[: block.top_k]
        norm = sum(float(probs[e]) for e in chosen)
        for e in chosen:
            ex = block.experts[str(e)]
            y = ex.w2.weight @ (F.silu(ex.w1.weight @ x[t]) * (ex.w3.weight @ x[t]))
            out[t] += float(probs[e]) / norm * y
    return out


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_moe_block_equals_per_token_dense_reference(top_k):
    torch.manual_seed(top_k)
    block = SparseMoeBlock(mixtral_cfg(top_k=top_k))
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)  # a decisive router: no near-ties in the top-k
    x = torch.randn(3, 5, 32)
    got = block(x)
    with torch.no_grad():
        want = _dense_reference(block, x.reshape(-1, 32)).reshape(3, 5, 32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # gradients flow to the router (through the weights) and to the chosen experts
    got.square().sum().backward()
    assert block.gate.weight.grad.abs().sum() > 0
    if top_k == 4:  # every expert sees every token
        assert all(block.experts[str(e)].w1.weight.grad.abs().sum() > 0 for e in range(4))


def _aux_formula(router_logits: list[torch.Tensor], experts: int, k: int) -> float:
    rows = [r for layer in router_logits for r in layer.tolist()]
    counts, prob_sums = [0] * experts, [0.0] * experts
    for row in rows:
        probs = torch.softmax(torch.tensor(row, dtype=torch.float64), dim=-1).tolist()
        for e in sorted(range(experts), key=lambda e: -probs[e])[:k]:
            counts[e] += 1
        for e in range(experts):
            prob_sums[e] += probs[e]
    return experts * sum(counts[e] / len(rows) * prob_sums[e] / len(rows) for e in range(experts))


def test_aux_loss_formula_and_loss_fn():
    torch.manual_seed(3)
    model = MixtralForCausalLM(mixtral_cfg(router_aux_loss_coef=0.1))
    for block in model.moe_blocks():
        torch.nn.init.normal_(block.gate.weight, std=0.5)  # unbalanced enough that aux differs from k
    ids, labels = _batch(64)
    logits = model(ids)
    aux = model.aux_loss()
    assert float(aux.detach()) == pytest.approx(_aux_formula([r.detach() for r in model.router_logits()], 4, 2), rel=1e-5)
    ce = MixtralForCausalLM.loss_fn(logits, labels)  # on the class: plain cross-entropy
    assert ce.item() == pytest.approx(F.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1)).item(), rel=1e-6)
    assert model.loss_fn(logits, labels).item() == pytest.approx(ce.item() + 0.1 * aux.item(), rel=1e-6)
    # the aux loss trains the router only (counts are not differentiable)
    aux.backward()
    assert model.layers[0].block_sparse_moe.gate.weight.grad.abs().sum() > 0
    assert model.layers[-1].block_sparse_moe.experts["0"].w1.weight.grad is None  # after the last router
    # perfectly uniform routing probabilities give aux = k (its minimum under balance)
    uniform = [torch.zeros(8, 4)]
    assert float(load_balancing_loss(uniform, 4, 2)) == pytest.approx(_aux_formula(uniform, 4, 2))
    # coefficient 0: the loss is the cross-entropy
    model0 = MixtralForCausalLM(mixtral_cfg(router_aux_loss_coef=0.0))
    logits0 = model0(ids)
    assert model0.loss_fn(logits0, labels).item() == MixtralForCausalLM.loss_fn(logits0, labels).item()


def test_the_padding_masked_aux_loss_is_transformers_with_an_attention_mask():
    """``aux_loss(padding_masked=True)`` (what DPO and GRPO add, as TRL) equals transformers' load_balancing_loss_func
    given the batch's attention mask — rows left-padded, right-padded, and whole — and unmasked, its loss without one.
    fp32 both sides over the same logits: equal to ~1e-6; leaving the padding in moves it by ~1e-2 here."""
    modeling = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    torch.manual_seed(5)
    model = MixtralForCausalLM(mixtral_cfg())
    for block in model.moe_blocks():
        torch.nn.init.normal_(block.gate.weight, std=0.5)
    ids, _ = _batch(64, b=3)
    segments = torch.ones_like(ids)
    segments[0, :5] = 0  # a left-padded prompt
    segments[1, -6:] = 0  # a completion that ended early
    model(ids, segment_ids=segments)
    logits = tuple(r.detach() for r in model.router_logits())
    masked = model.aux_loss(padding_masked=True).detach()
    want = modeling.load_balancing_loss_func(logits, 4, 2, attention_mask=segments)
    assert float(masked) == pytest.approx(float(want), rel=1e-5)
    assert float(model.aux_loss().detach()) == pytest.approx(float(modeling.load_balancing_loss_func(logits, 4, 2)), rel=1e-5)
    assert abs(float(masked) - float(model.aux_loss().detach())) > 1e-3  # the padding mattered
    model(ids)  # a forward without segment ids: every row is a token, masked or not
    assert float(model.aux_loss(padding_masked=True).detach()) == float(model.aux_loss().detach())


def test_mixtral_full_checkpointing_is_identical():
    ids, labels = _batch(64)
    results = []
    for granularity in (None, "full"):
        torch.manual_seed(0)
        model = MixtralForCausalLM(mixtral_cfg(activations_checkpoint_granularity=granularity))
        loss = model.loss_fn(model(ids), labels)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(num_experts=0), "num_experts=0"),
        (dict(top_k=5), "top_k=5 must be between 1 and model.moe.num_experts=4"),
        (dict(router_aux_loss_coef=-1.0), "router_aux_loss_coef"),
        (dict(hidden_size=30), "divisible by model.num_attention_heads"),
    ],
)
def test_mixtral_config_errors(over, match):
    with pytest.raises(ValueError, match=match):
        MixtralForCausalLM(mixtral_cfg(**over))


def test_mixtral_moe_defaults_and_dict_config():
    cfg = mixtral_cfg()
    del cfg.moe
    model = MixtralForCausalLM(cfg)  # no moe sub-config: Mixtral's 8 experts, top 2, coefficient 0.02
    assert (model.num_experts, model.top_k, model.router_aux_loss_coef) == (8, 2, 0.02)
    cfg.moe = {"num_experts": 2, "top_k": 1}
    model = MixtralForCausalLM(cfg)
    assert (model.num_experts, model.top_k, model.router_aux_loss_coef) == (2, 1, 0.02)


def _hf_state_dict(model: MixtralForCausalLM, hf_keys: set[str]) -> dict[str, torch.Tensor]:
    """Our weights under HF's names: ``block_sparse_moe.experts.N.w*`` (transformers < 5) or the fused
    ``mlp.experts.gate_up_proj = [E, 2f, h] (w1 then w3)`` and ``down_proj = [E, h, f]`` (≥ 5)."""
    out = {}
    for name, p in model.state_dict().items():
        hf = name if name.startswith("lm_head") else "model." + name
        out[hf] = p
    if any("block_sparse_moe" in k for k in hf_keys):
        return out
    for i, layer in enumerate(model.layers):
        moe = layer.block_sparse_moe
        out = {k: v for k, v in out.items() if not k.startswith(f"model.layers.{i}.block_sparse_moe.")}
        out[f"model.layers.{i}.mlp.gate.weight"] = moe.gate.weight
        experts = [moe.experts[str(e)] for e in range(moe.num_experts)]
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([x.w1.weight, x.w3.weight]) for x in experts])
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([x.w2.weight for x in experts])
    return out


def test_mixtral_matches_huggingface():
    transformers = pytest.importorskip("transformers")
    cfg = mixtral_cfg(router_aux_loss_coef=0.05)
    hf_cfg = transformers.MixtralConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.05,
        output_router_logits=True,
        tie_word_embeddings=False,
        sliding_window=None,
        router_jitter_noise=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(hf_cfg).eval()
    torch.manual_seed(1)
    model = MixtralForCausalLM(cfg).eval()
    for block in model.moe_blocks():
        torch.nn.init.normal_(block.gate.weight, std=0.3)  # a decisive router: both sides pick the same experts
    hf_keys = set(hf.state_dict())
    state = _hf_state_dict(model, hf_keys)
    assert set(state) == hf_keys
    hf.load_state_dict(state, strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = hf(input_ids=ids, labels=ids)
        logits = model(ids)
        labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)  # ours: labels arrive shifted
        loss = model.loss_fn(logits, labels)
    torch.testing.assert_close(logits, out.logits, rtol=1e-5, atol=1e-5)
    assert float(model.aux_loss()) == pytest.approx(float(out.aux_loss), rel=1e-5)
    assert float(loss) == pytest.approx(float(out.loss), rel=1e-5)


# ----------------------------------------------------------------------------------------------- GPT
def test_gpt_shapes_and_parameter_count():
    for tied in (True, False):
        cfg = gpt_cfg(tie_word_embeddings=tied)
        torch.manual_seed(0)
        model = GPTForCausalLM(cfg)
        ids, labels = _batch(64)
        logits = model(ids)
        assert logits.shape == (2, 8, 64)
        model.loss_fn(logits, labels).backward()
        assert all(p.grad is not None for p in model.parameters())
        v, pos, h, f, layers = 64, 32, 32, 128, 2
        per_layer = (4 * h * h + 4 * h) + (2 * h * f + f + h) + 4 * h
        want = v * h + pos * h + layers * per_layer + 2 * h + (0 if tied else v * h)
        assert model.num_parameters() == want == sum(p.numel() for p in model.parameters())
        assert model.tied == tied
        assert model.num_parameters(exclude_embeddings=True) == want - pos * h - (0 if tied else v * h)
    # positions matter (learned absolute embeddings): the same token at two positions gives different logits
    same = torch.full((1, 4), 7)
    out = model(same)
    assert not torch.allclose(out[0, 0], out[0, 1])
    with pytest.raises(ValueError, match="max_position_embeddings=32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible"):
        GPTForCausalLM(gpt_cfg(hidden_size=30))
    with pytest.raises(ValueError, match="use one of full, selective, null"):
        GPTForCausalLM(gpt_cfg(activations_checkpoint_granularity="partial"))


def test_gpt_causal_and_checkpointing_identical():
    torch.manual_seed(0)
    model = GPTForCausalLM(gpt_cfg())
    ids, labels = _batch(64)
    a = model(ids)
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 64
    b = model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])  # the future does not leak into earlier positions
    ckpt = copy.deepcopy(model)
    ckpt.checkpoint_layers = True
    la, lb = model.loss_fn(model(ids), labels), ckpt.loss_fn(ckpt(ids), labels)
    la.backward()
    lb.backward()
    assert torch.equal(la, lb)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ckpt.parameters()))
    # selective (NxDT's Megatron GPT default): only the attention core is recomputed, the same ops again: identical
    selective = GPTForCausalLM(gpt_cfg(activations_checkpoint_granularity="selective"))
    selective.load_state_dict(model.state_dict())
    ls = selective.loss_fn(selective(ids), labels)
    ls.backward()
    assert torch.equal(ls, la) and all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), selective.parameters()))


def test_gpt_loss_decreases_on_a_repeated_batch():
    torch.manual_seed(0)
    model = GPTForCausalLM(gpt_cfg())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids, labels = _batch(64, b=4, s=16, seed=1)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = model.loss_fn(model(ids), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(64), rel=0.05)  # small init: near-uniform predictions
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(b < a for a, b in zip(losses[:5], losses[1:6]))


# ----------------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("name, cls", [("mixtral_tiny", MixtralForCausalLM), ("gpt_tiny", GPTForCausalLM)])
def test_shipped_yaml_builds_the_model(name, cls):
    raw = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    assert raw["architecture"] == f"{cls.__module__}.{cls.__name__}"
    fields = {k: v for k, v in raw.items() if k not in ("defaults", "optim", "architecture")}
    if "moe" in fields:
        fields["moe"] = types.SimpleNamespace(**fields["moe"])
    model = cls(types.SimpleNamespace(**fields))
    ids = torch.randint(0, raw["vocab_size"], (1, 8))
    assert model(ids).shape == (1, 8, raw["vocab_size"])


def test_mixtral_8x7b_yaml_counts():
    raw = yaml.safe_load((CONF / "mixtral_8x7b.yaml").read_text())
    h, f, v, layers, e, k = (
        raw["hidden_size"],
        raw["ffn_hidden_size"],
        raw["vocab_size"],
        raw["num_layers"],
        raw["moe"]["num_experts"],
        raw["moe"]["top_k"],
    )
    kv_dim = h // raw["num_attention_heads"] * raw["num_kv_heads"]
    dense = 2 * v * h + layers * (2 * h * h + 2 * h * kv_dim + h * e + 2 * h) + h
    total, active = dense + layers * e * 3 * h * f, dense + layers * k * 3 * h * f
    assert round(total / 1e9, 1) == 46.7 and round(active / 1e9, 1) == 12.9  # Mistral AI's published sizes
