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

import dataclasses
import fnmatch
import importlib
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from nxdt.config.hf_model import FAMILIES, META_KEYS, Block, ModelSpec, ParallelPlan, WeightRule, normalized, spec_of_class
from nxdt.models.llama import DecoderLayer, LlamaForCausalLM
from nxdt.parallel.expert_parallel import moe_blocks
from nxdt.parallel.pipeline import build_chunks, chunk_parameters
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
    from nxdt.lightning.hf import StateDictAdapter  # not at module level: see _toy_ranks' test

    spec = FAMILIES[family]
    model, cfg = _build(spec, _round_trip(spec))
    names = dict(model.named_modules())

    # TP/SP: the spec's plan (the hub class declares none); every entry names modules of this model; every projection
    # and table is planned, itself or its block
    assert not hasattr(model, "tensor_parallel_plan"), f"{family}: the plan is the spec's, not the hub class's"
    plan = spec.tensor_parallel_plan(cfg)
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
    # at PP2 each parameter belongs to exactly one stage (a table ``embed`` reads but no stage owns, e.g. GPT's
    # positions, would never reach an optimizer or a checkpoint)
    owned = [n for stage in (0, 1) for n in chunk_parameters(build_chunks(_build(spec, _round_trip(spec))[0], stage, 2))]
    assert sorted(owned) == sorted(n for n, _ in model.named_parameters()), f"{family}: PP2 stages vs parameters"

    # EP: MoE blocks exactly when the spec says MoE, at the spec's pattern
    blocks = moe_blocks(model)
    assert bool(blocks) == spec.block.moe == (spec.parallel.experts is not None)
    assert all(b.num_experts == cfg.moe.num_experts for b in blocks)
    at_pattern = [m for n, m in names.items() if spec.parallel.experts and fnmatch.fnmatchcase(n, spec.parallel.experts)]
    assert [id(b) for b in at_pattern] == [id(b) for b in blocks], f"{family}: experts pattern vs the MoE blocks"

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


@pytest.mark.parametrize("family", [f for f in sorted(FAMILIES) if FAMILIES[f].block.moe])
def test_the_load_balancing_weight_follows_output_router_logits_as_transformers(family):
    """transformers adds ``router_aux_loss_coef ·`` the load-balancing loss only with ``output_router_logits`` (false by
    default, and in the released Mixtral and Qwen3-MoE files): read from such a config.json the weight is 0, so the
    loss is transformers' (cross-entropy alone); with it, the file's weight. An export says which it trained with."""
    spec = FAMILIES[family]
    hf = spec.hf_config(_round_trip(spec))
    assert hf["output_router_logits"] is True  # trained with the loss (MODEL's weight 0.01)
    assert spec.model_fields(hf)["moe.router_aux_loss_coef"] == 0.01
    assert spec.model_fields({**hf, "output_router_logits": False})["moe.router_aux_loss_coef"] == 0.0
    off = {k: v for k, v in hf.items() if k != "output_router_logits"}
    assert spec.model_fields(off)["moe.router_aux_loss_coef"] == 0.0
    assert spec.hf_config({**_round_trip(spec), "moe.router_aux_loss_coef": 0.0})["output_router_logits"] is False


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


# ---------------------------------------------------------------------------------------- a family added by a test
# One model file's worth (a hub class) and one spec, defined here and registered nowhere: the spec alone tells the
# parallel layer how to cut it and the adapter how to name its tensors; nothing under nxdt/ or models/ is edited.
class ToyMLP(nn.Module):
    """A GELU feed-forward under names no registered family uses."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class ToyLayer(DecoderLayer):
    ffn_name = "ffn"

    def make_ffn(self, cfg) -> nn.Module:
        return ToyMLP(cfg)


class ToyForCausalLM(LlamaForCausalLM):
    layer_class = ToyLayer
    residual_outputs = ("o_proj.weight", "down.weight")


TOY = dataclasses.replace(
    FAMILIES["llama"],
    model_type="toy",
    hf_architecture="ToyForCausalLM",
    architecture=f"{__name__}.ToyForCausalLM",
    block=Block(mlp_matrices=2, norm="rmsnorm", moe=False, lora_mlp=False),
    parallel=ParallelPlan(
        tensor_parallel=(
            # Llama's attention, embedding and head
            *((p, style) for p, style in FAMILIES["llama"].parallel.tensor_parallel if not p.startswith("layers.*.mlp")),
            ("layers.*.ffn", "input_region"),
            ("layers.*.ffn.up", "colwise"),
            ("layers.*.ffn.down", "rowwise"),
        )
    ),
    weights=(
        WeightRule(("layers.{i}.ffn.up.weight",), "model.layers.{i}.mlp.fc1.weight"),
        WeightRule(("layers.{i}.ffn.down.weight",), "model.layers.{i}.mlp.fc2.weight"),
        *FAMILIES["llama"].weights,
    ),
)
TOY_CFG = SimpleNamespace(**{k: v for k, v in TINY.items() if "." not in k}, make_vocab_size_divisible_by=8)
SGD_LR, TOY_STEPS = 0.1, 3


def _toy_ranks(world) -> dict:
    from nxdt.parallel.tensor_parallel import apply_tensor_parallel, gather_full_state_dict, sync_replicated_grads

    tp = world.new_communicator(list(range(world.world_size)), "tp")
    out = {}
    ids = torch.randint(0, TOY_CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    for sp in (False, True):
        losses = {}
        for layout in ("tp1", "tp2"):
            torch.manual_seed(0)
            model = ToyForCausalLM(TOY_CFG)
            if layout == "tp2":
                model = apply_tensor_parallel(model, tp, sequence_parallel=sp, plan=TOY.tensor_parallel_plan(TOY_CFG))
            opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
            losses[layout] = []
            for _ in range(TOY_STEPS):  # one batch, so the loss falls
                opt.zero_grad()
                loss = model.loss_fn(model(ids[:, :-1]), ids[:, 1:])
                loss.backward()
                if layout == "tp2":
                    sync_replicated_grads(model, tp)
                opt.step()
                losses[layout].append(loss.item())
            state = gather_full_state_dict(model, tp) if layout == "tp2" else model.state_dict()
            losses[f"{layout} state"] = {n: t.numpy().copy() for n, t in state.items()}
        out[sp] = losses
    return out


@pytest.mark.timeout(120)
def test_a_family_added_as_one_spec_and_one_hub_class_trains_at_tp2_from_its_spec():
    """The toy family trains at TP2 (and TP2+SP) by its spec's plan alone: its losses over 3 SGD steps and its gathered
    weights equal one rank's (fp32; the row-parallel sums change the rounding by ~1e-7 relative, kept by rtol 1e-5), and
    its spec's adapter names its tensors for Hugging Face and back."""
    from nxdt.comm.spawn import run_local

    # imported here, not at module level: run_local's ranks unpickle _toy_ranks by importing this module, and
    # nxdt.lightning imports Lightning (~8 CPU-s in each rank; the test took 11 s, its ranks' compute ~1 s)
    from nxdt.lightning.hf import StateDictAdapter

    assert spec_of_class(ToyForCausalLM) is None  # registered nowhere
    plan = TOY.tensor_parallel_plan(TOY_CFG)
    assert plan["layers.*.self_attn.q_proj"] == "colwise:16" and plan["lm_head"] == "vocab_head:8"  # head_dim, padding
    for rank in run_local(_toy_ranks, 2, timeout_s=110):
        for sp, losses in rank.items():
            assert losses["tp2"] == pytest.approx(losses["tp1"], rel=1e-5), f"sp={sp}"
            assert losses["tp1"][-1] < losses["tp1"][0]  # it trains
            want = losses["tp1 state"]
            assert set(losses["tp2 state"]) == set(want)
            for name, value in losses["tp2 state"].items():
                torch.testing.assert_close(torch.from_numpy(value), torch.from_numpy(want[name]), rtol=1e-5, atol=1e-6)

    torch.manual_seed(0)
    state = ToyForCausalLM(TOY_CFG).state_dict()
    adapter = StateDictAdapter(TOY)
    hf = adapter.to_hf(state)
    assert "model.layers.1.mlp.fc1.weight" in hf and "lm_head.weight" in hf
    back = adapter.from_hf(hf)
    assert set(back) == set(state) and all(torch.equal(back[n], state[n]) for n in state)


def test_every_registered_family_is_cut_by_its_spec_in_a_run():
    """The strategy hands a family's hub model its spec's TP/SP plan and expert pattern, found by the exact class path
    (a subclass, which may rename modules, and a model of no family declare their own)."""
    for spec in FAMILIES.values():
        module, _, name = spec.architecture.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        assert spec_of_class(cls) is spec
        assert spec_of_class(type("Mine", (cls,), {})) is None
    assert spec_of_class(nn.Linear) is None


def test_expert_parallelism_slices_the_blocks_at_the_specs_pattern():
    """EP takes the spec's pattern (slicing needs no communication); a pattern naming a dense block is one line."""
    from nxdt.parallel.expert_parallel import apply_expert_parallel

    for family in ("mixtral", "qwen3_moe"):
        spec = FAMILIES[family]
        model, _ = _build(spec, _round_trip(spec))
        apply_expert_parallel(model, SimpleNamespace(size=2, rank=1), blocks=spec.parallel.experts)
        assert [b.expert_ids for b in moe_blocks(model)] == [[2, 3], [2, 3]]
    llama, _ = _build(FAMILIES["llama"], _round_trip(FAMILIES["llama"]))
    with pytest.raises(ValueError, match=r"layers\.\*\.mlp matches MLP, no MoE block"):
        apply_expert_parallel(llama, SimpleNamespace(size=2, rank=0), blocks="layers.*.mlp")
