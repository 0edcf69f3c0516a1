"""Every registered model family is one complete :class:`nxdt.config.hf_model.ModelSpec` that agrees with its hub class.

For each spec, a tiny model config goes to the family's config.json and back (every computation field survives), the
hub class is built from what config.json alone gives, and the spec's claims are checked against that model: its
tensor-parallel plan names modules that exist and covers every projection and table (itself or a block around it),
its layers are the pipeline's stages and its FSDP units hold every parameter once, its MoE blocks (expert
parallelism) exist exactly when the spec says MoE, the block the planner reads (MLP matrices, norm kind, LoRA MLP
names, learned positions) is the model's, the state-dict adapter maps every tensor to a distinct Hugging Face name and
back, the planner's parameter count is the model's up to the O(hidden) tensors it leaves out, and its forward FLOPs are
torch's FlopCounterMode count. A family added as one spec and one hub class is checked here without editing this file.
"""

from __future__ import annotations

import fnmatch
import importlib
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from nxdt.config.hf_model import FAMILIES, META_KEYS, ModelSpec, normalized
from nxdt.lightning.hf import StateDictAdapter
from nxdt.parallel.expert_parallel import moe_blocks
from nxdt.planner.estimate import forward_flops_per_token, model_numbers

# a tiny model in every field an export records: head_dim 16 ≠ hidden/heads = 8, non-default theta and epsilon
TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "ffn_hidden_size": 48,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "rope_theta": 123456.0,
    "norm_eps": 3e-6,
    "tie_word_embeddings": False,
    "sliding_window": None,
    "init_method_std": 0.02,
    "moe.num_experts": 4,
    "moe.top_k": 2,
    "moe.router_aux_loss_coef": 0.01,
    "moe.router_activation": "softmax",
    "moe.normalize_top_k_affinities": True,
}


def test_the_registered_families():
    assert sorted(FAMILIES) == ["gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe"]
    assert all(name == spec.model_type for name, spec in FAMILIES.items())
    assert len({spec.architecture for spec in FAMILIES.values()}) == len(FAMILIES)  # one hub class per family


def _round_trip(spec: ModelSpec) -> dict:
    """The family's config.json of TINY, and the model fields read back from it."""
    flat = {k: None for k in META_KEYS} | TINY | {"architecture": spec.architecture, **spec.fixed}
    flat = {k: v for k, v in flat.items() if k != "rope_scaling.rope_type" or v is not None}
    hf = spec.hf_config(flat)
    assert (hf["model_type"], hf["architectures"]) == (spec.model_type, [spec.hf_architecture])
    back = spec.model_fields(hf)
    ours, theirs = normalized(flat), normalized(back)
    for key in ("architecture", *spec.compute_keys):
        assert theirs.get(key) == ours.get(key), f"{spec.model_type}: {key} {ours.get(key)!r} came back as {theirs.get(key)!r}"
    return back


def _build(spec: ModelSpec, fields: dict) -> tuple[nn.Module, SimpleNamespace]:
    moe = SimpleNamespace(**{k.split(".", 1)[1]: v for k, v in fields.items() if k.startswith("moe.")})
    # the fields config.json leaves unset are the schema's nulls, as in a run
    flat = {k: None for k in META_KEYS if "." not in k} | {k: v for k, v in fields.items() if "." not in k}
    cfg = SimpleNamespace(**flat, moe=moe, core_attention="naive")
    module, _, name = spec.architecture.rpartition(".")
    torch.manual_seed(0)
    return getattr(importlib.import_module(module), name)(cfg), cfg


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_spec_is_complete_and_agrees_with_its_hub_class(family):
    spec = FAMILIES[family]
    model, cfg = _build(spec, _round_trip(spec))
    names = dict(model.named_modules())

    # TP/SP: every entry names modules of this model; every projection and table is planned, itself or its block
    plan = model.tensor_parallel_plan()
    for pattern in plan:
        assert any(fnmatch.fnmatchcase(n, pattern) for n in names), f"{family}: plan entry {pattern} matches nothing"
    planned = {n for n in names if any(fnmatch.fnmatchcase(n, p) for p in plan)}
    for name, module in names.items():
        if isinstance(module, (nn.Linear, nn.Embedding)) and name != "embed_positions":  # GPT's positions: replicated
            parts = name.split(".")
            assert any(".".join(parts[:i]) in planned for i in range(1, len(parts) + 1)), f"{family}: {name} not planned"

    # PP: the layers are the stages' units; FSDP: every parameter in one unit
    assert isinstance(model.layers, nn.ModuleList) and len(model.layers) == cfg.num_layers
    assert all(callable(getattr(model, hook)) for hook in ("embed", "run_layer", "head"))
    in_units = [id(p) for unit in model.fsdp_units() for m in unit for p in m.parameters()]
    assert sorted(in_units) == sorted(id(p) for p in model.parameters()), f"{family}: FSDP units vs parameters"

    # EP: MoE blocks exactly when the spec says MoE
    blocks = moe_blocks(model)
    assert bool(blocks) == spec.block.moe and all(b.num_experts == cfg.moe.num_experts for b in blocks)

    # the block the planner reads is the model's
    layer = model.layers[0]
    ffn = getattr(layer, getattr(layer, "ffn_name", "mlp"))
    one = ffn.experts["0"] if spec.block.moe else ffn
    assert sum(isinstance(m, nn.Linear) for m in one.modules()) == spec.block.mlp_matrices
    assert isinstance(model.norm, nn.LayerNorm) == (spec.block.norm == "layernorm")
    leaves = {n.rpartition(".")[2] for n, m in names.items() if isinstance(m, nn.Linear)}
    assert {"gate_proj", "up_proj", "down_proj"} <= leaves if spec.block.lora_mlp else not leaves & {"gate_proj", "up_proj"}
    assert ("embed_positions" in names) == spec.block.learned_positions

    # the state-dict adapter: every tensor goes by one of the family's rules (none passes through unmapped), and back
    # to ours unchanged (GPT-2's q/k/v are fused on the way and split again)
    state = model.state_dict()
    adapter = StateDictAdapter(spec)
    hf = adapter.to_hf(state)
    assert all(adapter._match_hf(name) is not None for name in hf), f"{family}: a tensor no rule maps"
    back = adapter.from_hf(hf)
    assert set(back) == set(state) and all(torch.equal(back[n], state[n]) for n in state)

    # the planner: parameters up to O(hidden) per layer (biases, q/k norms), forward FLOPs exactly
    width = max(cfg.hidden_size, cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or 0))
    assert abs(model_numbers(cfg)["total"] - model.num_parameters()) <= 16 * width * cfg.num_layers
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids)
    # FlopCounterMode counts matmuls only, as the formula does; naive attention's scores are matmuls (test_flops.py)
    assert counter.get_total_flops() / ids.numel() == pytest.approx(forward_flops_per_token(cfg, 16), rel=1e-9)


def test_expert_parallelism_on_a_dense_family_is_refused_before_launch():
    """The spec's block says the family has no experts: EP would find no MoE block only in the workers."""
    from nxdt.config import ConfigError, compose_config

    over = ["data=synthetic", "trainer.devices=2", "distributed_strategy.expert_model_parallel_size=2"]
    with pytest.raises(ConfigError, match="is a dense family") as err:
        compose_config(["model=llama_tiny", "model.moe.num_experts=2", *over])
    assert (err.value.key, err.value.value) == ("distributed_strategy.expert_model_parallel_size", 2)
    assert compose_config(["model=mixtral_tiny", "model.moe.num_experts=2", *over]).model.moe.num_experts == 2


def test_the_planner_refuses_an_architecture_no_family_has_by_name():
    """The planner asks the spec by the exact hub class path (never a module name): anything else is one line."""
    from nxdt.config import compose_config
    from nxdt.config.hf_model import HFConfigError
    from nxdt.planner import plan

    cfg = compose_config(["model.architecture=nxdt.models.llama.DecoderOnlyLM", "data=synthetic"])
    with pytest.raises(HFConfigError, match=r"model.architecture='nxdt.models.llama.DecoderOnlyLM' is no model family's"):
        plan(cfg)
