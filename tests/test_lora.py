"""LoRA as a model converter (``nxdt.models.lora``) and its Hugging Face PEFT export
(``nxdt.lightning.peft_export``): a fresh adapter is the identity, training touches the adapters only, merging
gives base + scaling·B·A, and the exported adapter loaded by the real ``peft`` library onto a ``transformers``
Llama with the same base weights gives the same logits."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from nxdt.lightning.hf import hf_name
from nxdt.lightning.peft_export import export_peft_adapter
from nxdt.models.llama import LlamaForCausalLM
from nxdt.models.lora import LoRALinear, apply_lora, base_state_dict, lora_state_dict, merge_lora
from nxdt.config.hf_model import tensor_parallel_plan_of
from hf_reference import TINY_LLAMA, llama_config

TINY = TINY_LLAMA
ALL = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(SimpleNamespace(**TINY))
    with torch.no_grad():  # distinctive weights (norms away from 1), as the HF parity test does
        for p in model.parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.1 * torch.randn_like(p))
    return model.eval()


def ids() -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))


def randomise_b(model: nn.Module, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.copy_(0.1 * torch.randn(m.lora_B.weight.shape, generator=g))


def adapter_names(model: nn.Module) -> set[str]:
    return {n for n, _ in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}


def test_fresh_adapter_equals_the_base_layer_and_model():
    base = nn.Linear(8, 6)
    layer = LoRALinear(base, rank=2, alpha=4)
    assert layer.lora_A.weight.shape == (2, 8) and layer.lora_B.weight.shape == (6, 2) and layer.scaling == 2.0
    assert torch.count_nonzero(layer.lora_B.weight) == 0 and torch.count_nonzero(layer.lora_A.weight) > 0
    x = torch.randn(3, 8)
    assert torch.equal(layer(x), base(x))

    model = llama()
    with torch.no_grad():
        expected = model(ids())
    apply_lora(model, rank=4, alpha=8, target_modules=ALL)
    names = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert names == {
        f"layers.{i}.{blk}.{p}"
        for i in range(2)
        for blk, ps in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))
        for p in ps
    }
    with torch.no_grad():
        assert torch.equal(model(ids()), expected)


def test_targets_map_nxdt_and_hf_names():
    for targets, leaves in (
        (("qkv_proj",), {"q_proj", "k_proj", "v_proj"}),
        (("gate_up_proj", "o_proj"), {"gate_proj", "up_proj", "o_proj"}),
        (("v_proj", "down_proj"), {"v_proj", "down_proj"}),
    ):
        model = apply_lora(llama(), rank=2, alpha=2, target_modules=targets)
        assert {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, LoRALinear)} == leaves
        assert set(model.lora_config.hf_target_modules) == leaves


def test_sgd_on_adapters_only_then_merge():
    model = llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply_lora(model, rank=4, alpha=8, target_modules=ALL)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.5)
    named = dict(model.named_parameters())
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(named[n]) for n in adapter_names(model)}
    tokens = ids()
    labels = torch.roll(tokens, -1, dims=1)
    for _ in range(4):
        optimizer.zero_grad()
        loss = model.loss_fn(model(tokens), labels)
        loss.backward()
        # gradients reach the adapters only; every base parameter stays without one
        assert all((p.grad is not None) == (n in adapter_names(model)) for n, p in model.named_parameters())
        optimizer.step()
    assert any(torch.count_nonzero(model.get_parameter(n)) for n in adapter_names(model) if ".lora_B." in n)
    # base weights bitwise unchanged (under their names without .base_layer)
    base = base_state_dict(model)
    assert base.keys() == {n for n in before} | {"lm_head.weight"} and all(torch.equal(base[n], t) for n, t in before.items())
    assert set(lora_state_dict(model)) == adapter_names(model)

    model.eval()
    with torch.no_grad():
        unmerged = model(tokens)
        layer = model.layers[0].self_attn.q_proj
        expected_q = layer.base_layer.weight + layer.scaling * layer.lora_B.weight @ layer.lora_A.weight
    merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert type(model.layers[0].self_attn.q_proj) is nn.Linear and set(model.state_dict()) == set(before)
    torch.testing.assert_close(model.layers[0].self_attn.q_proj.weight, expected_q, rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), unmerged, rtol=0, atol=1e-5)
    fresh = llama()
    fresh.load_state_dict(model.state_dict())  # the merged model is a plain hub model again


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(4, 4, bias=True)
        self.other = nn.Linear(4, 4, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.other(self.q_proj(x))


@pytest.mark.parametrize(
    "bias, trainable_biases",
    [("none", set()), ("lora_only", {"q_proj.base_layer.bias"}), ("all", {"q_proj.base_layer.bias", "other.bias"})],
)
def test_gradients_flow_to_adapters_and_the_chosen_biases_only(bias, trainable_biases):
    torch.manual_seed(0)
    block = apply_lora(Block(), rank=2, alpha=2, bias=bias, target_modules=["q_proj"])
    randomise_b(block)
    block(torch.randn(5, 4)).pow(2).sum().backward()
    expected = {"q_proj.lora_A.weight", "q_proj.lora_B.weight"} | trainable_biases
    assert {n for n, p in block.named_parameters() if p.requires_grad} == expected
    assert {n for n, p in block.named_parameters() if p.grad is not None} == expected
    assert all(torch.count_nonzero(block.get_parameter(n).grad) for n in expected)
    assert set(lora_state_dict(block)) == expected


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(rank=4, alpha=8, target_modules=["qkv_proj", "attn_proj"]),
            "unknown; valid targets are qkv_proj, o_proj, gate_up_proj",
        ),
        (dict(rank=0, alpha=8), "rank=0: must be a positive integer"),
        (dict(rank=-2, alpha=8), "rank=-2: must be a positive integer"),
        (dict(rank=2.5, alpha=8), "rank=2.5: must be a positive integer"),
        (dict(rank=4, alpha=0), "alpha=0: must be a positive number"),
        (dict(rank=4, alpha=8, dropout=1.0), "dropout=1.0: must be in [0, 1)"),
        (dict(rank=4, alpha=8, bias="lora"), "bias='lora': use one of none, all, lora_only"),
        (dict(rank=4, alpha=8, target_modules=[]), "target_modules is empty"),
        # an adapter's rank is at most min(in, out) of its layer: above it, only memory and time grow
        (dict(rank=100000, alpha=8), "rank=100000 is larger than"),
    ],
)
def test_bad_input_is_one_clear_error(kwargs, message):
    model = llama()
    with pytest.raises(ValueError) as err:
        apply_lora(model, **kwargs)
    assert message in str(err.value)
    assert not any(isinstance(m, LoRALinear) for m in model.modules()) and all(p.requires_grad for p in model.parameters())


def test_a_target_the_model_lacks_and_a_second_apply_are_refused():
    with pytest.raises(ValueError, match=r"Block has no nn.Linear named \['gate_proj', 'up_proj'\]"):
        apply_lora(Block(), rank=2, alpha=2, target_modules=["gate_up_proj"])
    model = apply_lora(llama(), rank=2, alpha=2)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(model, rank=2, alpha=2)


def test_tensor_parallel_plan_splits_adapters_with_their_base_layer():
    """Without processes (only the group's size and rank are needed to cut shards): each adapter follows its
    base's plan entry — column bases split B by rows, row bases split A by columns — and a style that cannot
    carry an adapter is refused by name."""
    from nxdt.parallel.tensor_parallel import LoRAParallelLinear, apply_tensor_parallel, shard_layout

    model = apply_tensor_parallel(
        m := apply_lora(llama(), rank=2, alpha=2, target_modules=ALL),
        SimpleNamespace(size=2, rank=1),
        plan=tensor_parallel_plan_of(m),
    )
    layout = shard_layout(model)
    attn = model.layers[0].self_attn
    assert isinstance(attn.q_proj, LoRAParallelLinear) and isinstance(model.layers[1].mlp.down_proj, LoRAParallelLinear)
    assert layout["layers.0.self_attn.q_proj.lora_B.weight"] == [0, 1] and "layers.0.self_attn.q_proj.lora_A.weight" not in layout
    assert layout["layers.0.self_attn.o_proj.lora_A.weight"] == [1, 1] and "layers.0.self_attn.o_proj.lora_B.weight" not in layout
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".lora_" not in n)  # slicing kept them frozen

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(4, 8)

        def tensor_parallel_plan(self):
            return {"lm_head": "vocab_head"}

    with pytest.raises(TypeError, match="lm_head is a LoRA adapter; style 'vocab_head' cannot split one"):
        apply_tensor_parallel(_adapted_head(Head()), SimpleNamespace(size=2, rank=0))


def _adapted_head(module: nn.Module) -> nn.Module:
    module.lm_head = LoRALinear(module.lm_head, rank=2, alpha=2)
    return module


def _hf_llama(transformers, model: LlamaForCausalLM):
    """A transformers Llama with ``model``'s weights, mapped by nxdt.lightning.hf's names."""
    config = llama_config(transformers, TINY)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.load_state_dict({hf_name(n): t for n, t in model.state_dict().items()}, strict=True)
    return hf


@pytest.mark.timeout(120)
@pytest.mark.parametrize("targets", [ALL, ("qkv_proj",)])
def test_exported_adapter_loads_with_peft_and_gives_the_same_logits(tmp_path, targets):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    model = llama()
    hf = _hf_llama(transformers, model)
    apply_lora(model, rank=4, alpha=16, dropout=0.1, target_modules=targets)
    randomise_b(model)
    model.eval()
    out = export_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path="tiny-llama")

    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM" and config["r"] == 4
    assert config["lora_alpha"] == 16 and config["lora_dropout"] == 0.1 and config["bias"] == "none"
    assert set(config["target_modules"]) == set(model.lora_config.hf_target_modules)
    saved = load_file(str(out / "adapter_model.safetensors"))
    # the keys PEFT itself writes for the same targets
    reference = peft.get_peft_model(
        _hf_llama(transformers, llama()),
        peft.LoraConfig(r=4, lora_alpha=16, target_modules=list(config["target_modules"]), task_type="CAUSAL_LM"),
    )
    assert set(saved) == set(peft.get_peft_model_state_dict(reference))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in saved

    with torch.no_grad():
        base_logits = hf(input_ids=ids()).logits
    loaded = peft.PeftModel.from_pretrained(hf, str(out)).eval()
    for key, tensor in saved.items():  # each tensor arrived where PEFT looks for it
        path, part, _ = key.rsplit(".", 2)
        assert torch.equal(getattr(loaded.get_submodule(path), part)["default"].weight, tensor), key
    with torch.no_grad():
        expected = model(ids())
        torch.testing.assert_close(loaded(input_ids=ids()).logits, expected, rtol=0, atol=1e-5)
    assert (expected - base_logits).abs().max() > 1e-2  # the adapter matters: not a comparison of two base models


def test_export_refuses_a_non_empty_directory_and_a_model_without_adapters(tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    with pytest.raises(ValueError, match="not an empty directory"):
        export_peft_adapter(apply_lora(llama(), rank=2, alpha=2), tmp_path / "busy")
    with pytest.raises(ValueError, match="no LoRA adapters"):
        export_peft_adapter(llama(), tmp_path / "new")


def test_dropout_acts_on_the_adapter_path_only():
    torch.manual_seed(0)
    base = nn.Linear(8, 6)
    layer = LoRALinear(base, rank=2, alpha=2, dropout=0.5).train()
    x = torch.randn(4, 8)
    assert torch.equal(layer(x), base(x))  # B = 0: whatever dropout drops, the base path is untouched
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    torch.manual_seed(1)
    noisy = layer(x)
    torch.manual_seed(1)
    mask = nn.functional.dropout(torch.ones_like(x), 0.5, training=True)
    torch.testing.assert_close(noisy, base(x) + layer.scaling * layer.lora_B(layer.lora_A(x * mask)))


# ---------------------------------------------------------------------------------------------- apply_peft (NxDT's keys)
def test_apply_peft_takes_nxdt_keys_from_a_mapping_and_records_them():
    from nxdt.models.lora import PeftConfig, apply_peft

    model = apply_peft(
        llama(), {"lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["qkv_proj", "down_proj"]}
    )
    assert model.peft_config == PeftConfig(lora_rank=4, lora_alpha=8, lora_dropout=0.0, target_modules=("qkv_proj", "down_proj"))
    assert model.lora_config.hf_target_modules == ("q_proj", "k_proj", "v_proj", "down_proj") and model.lora_config.scaling == 2
    assert PeftConfig.of({}) == PeftConfig(16, 32, 0.05, "none", ("qkv_proj",), False)  # NxD Training's defaults
    assert {n for n, p in model.named_parameters() if p.requires_grad} == adapter_names(model)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"lora_rank": 4, "target_modules": ["qkv_proj", "attn_proj"]}, "unknown; valid targets are qkv_proj, o_proj"),
        ({"lora_rank": 4, "lora_rnak": 8}, "peft: unknown key(s) ['lora_rnak']"),
        ({"lora_rank": 0}, "rank=0: must be a positive integer"),
    ],
)
def test_apply_peft_bad_input_is_one_clear_error(config, message):
    from nxdt.models.lora import apply_peft

    with pytest.raises(ValueError) as err:
        apply_peft(llama(), config)
    assert message in str(err.value)


def test_lora_on_a_model_without_the_target_names_it():
    """Mixtral's feed-forward layers are experts (w1/w3/w2), not gate_proj/up_proj: gate_up_proj is refused by name."""
    from nxdt.config import compose_config
    from nxdt.lightning.module import import_architecture
    from nxdt.models.lora import apply_peft

    cfg = compose_config(["model=mixtral_tiny"]).model
    with pytest.raises(ValueError, match=r"MixtralForCausalLM has no nn.Linear named \['gate_proj', 'up_proj'\]"):
        apply_peft(import_architecture(cfg.architecture)(cfg), {"target_modules": ["gate_up_proj"]})


def test_merge_lora_state_equals_merge_lora_on_the_model():
    """The by-name merge of full tensors (what a TP/FSDP run gathers) equals merging the module: base + scaling·B·A."""
    from nxdt.models.lora import merge_lora_state

    model = apply_lora(llama(), rank=4, alpha=8, target_modules=ALL)
    randomise_b(model)
    merged = merge_lora_state(model.state_dict(), model.lora_config.scaling)
    q = model.layers[0].self_attn.q_proj
    expected_q = q.base_layer.weight + 2.0 * q.lora_B.weight @ q.lora_A.weight
    merge_lora(model)
    assert merged.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(merged[name], value), name
    torch.testing.assert_close(merged["layers.0.self_attn.q_proj.weight"], expected_q, rtol=1e-6, atol=1e-7)


def test_check_peft_validates_on_a_meta_model_without_changing_it():
    from nxdt.models.lora import check_peft

    with torch.device("meta"):
        model = LlamaForCausalLM(SimpleNamespace(**TINY))
    assert check_peft(model, {"target_modules": ["o_proj"]}).lora_rank == 16 and not any(
        isinstance(m, LoRALinear) for m in model.modules()
    )
    with pytest.raises(ValueError, match="Block has no nn.Linear named"):
        check_peft(Block(), {"target_modules": ["gate_up_proj"]})
    with pytest.raises(ValueError, match="alpha=0: must be a positive number"):
        check_peft(model, {"lora_alpha": 0})


# ---------------------------------------------------------------------------------------------- nxdt train's peft block
def test_the_lora_recipe_composes_and_its_model_keys_reach_apply_peft():
    from nxdt.config import compose_config
    from nxdt.config.validate import check_trainable
    from nxdt.models.lora import PeftConfig

    cfg = compose_config(["+recipe=lora", "model_alignment_strategy.peft.lora_rank=4"])
    check_trainable(cfg)
    assert cfg.model_alignment_strategy.sft is not None  # LoRA on the SFT recipe
    # only the model-shaping keys: lora_verbose, merge_* and the export switches are the trainer's
    assert PeftConfig.pick(cfg.model_alignment_strategy.peft) == PeftConfig(
        lora_rank=4,
        lora_alpha=16,
        lora_dropout=0.0,
        lora_bias="none",
        target_modules=("qkv_proj", "o_proj"),
        save_lora_base=False,
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model_alignment_strategy.peft.lora_bias=all"],
            "model_alignment_strategy.peft.save_lora_config_adapter=True: the PEFT "
            "adapter export has no trainable biases (lora_bias=all)",
        ),
    ],
)
def test_peft_keys_this_version_does_not_do_are_refused_by_name(overrides, message):
    from nxdt.config import compose_config
    from nxdt.config.validate import NotYetSupported, check_trainable

    with pytest.raises(NotYetSupported) as info:
        check_trainable(compose_config(["+recipe=lora", *overrides]))
    assert message in str(info.value)
