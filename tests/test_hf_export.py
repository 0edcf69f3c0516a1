"""Exact Hugging Face import and export, per family, in-process (no launches).

A tiny model made with transformers (random weights, every non-default computation field: rope_theta, epsilon,
Llama 3.1 rope scaling, tied or untied head) is read by ``model.hf_checkpoint=DIR`` alone (every model field from its
config.json), computes transformers' logits, and exports (``export_hf_state``, what ``nxdt checkpoint export-hf``
writes) to a directory ``AutoModelForCausalLM.from_pretrained`` loads as the same family with the same logits.

Tolerance: both sides compute in fp32 from the same weights; they differ only in operation order (torch's sdpa vs
transformers' eager softmax, the fused tanh GELU vs GPT-2's formula), a few fp32 ulps (~1e-7 relative) per operation
on logits of magnitude ~1 through two layers: ~1e-6, so ``atol=1e-5`` leaves a tenfold margin on any CPU.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from nxdt.config import ConfigError, compose_config, validate
from nxdt.config.hf_model import model_meta
from nxdt.lightning.checkpoint import CheckpointError
from nxdt.lightning.hf import export_hf_state, load_hf_weights

transformers = pytest.importorskip("transformers")

ATOL = 1e-5  # module docstring
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
SHAPE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)


def _llama(tied: bool) -> "transformers.PretrainedConfig":
    return transformers.LlamaConfig(
        **SHAPE,
        intermediate_size=48,
        num_key_value_heads=2,
        rope_theta=500000.0,
        rms_norm_eps=1e-6,
        rope_scaling=dict(LLAMA31_ROPE),
        tie_word_embeddings=tied,
    )


def _mixtral() -> "transformers.PretrainedConfig":
    return transformers.MixtralConfig(
        **SHAPE,
        intermediate_size=40,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_theta=250000.0,
        rms_norm_eps=3e-6,
    )


def _qwen2(tied: bool) -> "transformers.PretrainedConfig":
    return transformers.Qwen2Config(
        **SHAPE,
        intermediate_size=48,
        num_key_value_heads=2,
        rope_theta=1e6,
        rms_norm_eps=3e-6,
        tie_word_embeddings=tied,
    )


def _qwen3() -> "transformers.PretrainedConfig":
    # head_dim 16, not hidden/heads = 8: the projections are wider than the model
    return transformers.Qwen3Config(
        **SHAPE, intermediate_size=48, num_key_value_heads=2, head_dim=16, rope_theta=1e6, rms_norm_eps=2e-6
    )


def _mistral() -> "transformers.PretrainedConfig":
    # a window as long as the positions: full causal attention is the same function for every sequence
    return transformers.MistralConfig(
        **SHAPE, intermediate_size=48, num_key_value_heads=1, sliding_window=128, rope_theta=1e6, rms_norm_eps=1e-5
    )


def _qwen3_moe() -> "transformers.PretrainedConfig":
    # q/k norms, head_dim 16 ≠ hidden/heads, experts 24 wide, the top-k weights renormalised (Qwen3-30B-A3B's setting)
    return transformers.Qwen3MoeConfig(
        **SHAPE,
        moe_intermediate_size=24,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        rope_theta=1e6,
        rms_norm_eps=2e-6,
    )


def _gpt2(tied: bool) -> "transformers.PretrainedConfig":
    s = SHAPE
    return transformers.GPT2Config(
        vocab_size=s["vocab_size"],
        n_embd=s["hidden_size"],
        n_layer=s["num_hidden_layers"],
        n_head=s["num_attention_heads"],
        n_positions=s["max_position_embeddings"],
        n_inner=80,
        layer_norm_epsilon=1e-4,
        activation_function="gelu_new",
        tie_word_embeddings=tied,
    )


FAMILIES = {
    "llama-tied": _llama(True),
    "llama-untied": _llama(False),
    "mixtral": _mixtral(),
    "qwen2-tied": _qwen2(True),
    "qwen2-untied": _qwen2(False),
    "qwen3": _qwen3(),
    "mistral": _mistral(),
    "qwen3_moe": _qwen3_moe(),
    "gpt2-tied": _gpt2(True),
    "gpt2-untied": _gpt2(False),
}


def _hf_model(config, directory):
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms start at 1 and biases at 0: make every tensor count
            p.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    return model


def _ours(cfg):
    module, _, name = cfg.model.architecture.rpartition(".")
    torch.manual_seed(1)
    return getattr(importlib.import_module(module), name)(cfg.model).eval()


def _ids(vocab: int = SHAPE["vocab_size"]) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(5))


def _hf_logits(directory) -> tuple[torch.Tensor, "transformers.PreTrainedModel"]:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(_ids()).logits, model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_checkpoint_alone_imports_and_exports_the_same_model(family, tmp_path):
    config = FAMILIES[family]
    reference = _hf_model(config, tmp_path / "hf")
    # model.hf_checkpoint alone: the family and every computation field come from config.json
    cfg = compose_config([f"model.hf_checkpoint={tmp_path / 'hf'}", "data=synthetic"])
    model = _ours(cfg)
    load_hf_weights(model, tmp_path / "hf", cfg.model.architecture)
    with torch.no_grad():
        ours = model(_ids())
        theirs = reference(_ids()).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=ATOL)

    export_hf_state(model.state_dict(), {"model_config": model_meta(cfg.model), "tokenizer": None}, tmp_path / "out")
    written = json.loads((tmp_path / "out/config.json").read_text())
    assert written["model_type"] == config.model_type
    back, loaded = _hf_logits(tmp_path / "out")
    assert type(loaded) is type(reference)
    torch.testing.assert_close(back, ours, rtol=0, atol=ATOL)
    for key in (
        "rms_norm_eps",
        "layer_norm_epsilon",
        "rope_parameters",
        "tie_word_embeddings",
        "n_inner",
        "num_key_value_heads",
        "sliding_window",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
    ):
        assert getattr(loaded.config, key, None) == getattr(reference.config, key, None), key
    if hasattr(reference.config, "num_key_value_heads"):  # the heads' width (null in a config.json = hidden / heads)
        width = [
            getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads for c in (loaded.config, reference.config)
        ]
        assert width[0] == width[1]


def test_an_nxdt_trained_model_exports_every_computation_field(tmp_path):
    """The silent-wrong case of the old export (shapes only): epsilon 1e-5 came back as transformers' 1e-6, rope_theta
    500000 as 10000, and Llama 3.1 scaling was dropped; here nxdt's own model (its own init) is exported."""
    cfg = compose_config(
        [
            "data=synthetic",
            "model.norm_eps=1e-5",
            "model.rope_theta=500000",
            "model.tie_word_embeddings=true",
            *(f"model.rope_scaling.{k}={v}" for k, v in LLAMA31_ROPE.items()),
        ]
    )
    model = _ours(cfg)
    export_hf_state(model.state_dict(), {"model_config": model_meta(cfg.model), "tokenizer": None}, tmp_path / "out")
    back, loaded = _hf_logits(tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(back, model(_ids()), rtol=0, atol=ATOL)
    c = loaded.config
    assert (c.model_type, c.rms_norm_eps, c.tie_word_embeddings, c.max_position_embeddings) == ("llama", 1e-5, True, 256)
    assert c.rope_parameters == {**LLAMA31_ROPE, "rope_theta": 500000.0}
    gen = json.loads((tmp_path / "out/generation_config.json").read_text())
    assert gen["_from_model_config"] is True


def test_export_bf16_and_refusals(tmp_path):
    cfg = compose_config(["data=synthetic", "model=mixtral_tiny"])
    model = _ours(cfg)
    source = {"model_config": model_meta(cfg.model), "tokenizer": None}
    export_hf_state(model.state_dict(), source, tmp_path / "bf16", dtype="bf16")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert loaded.config.model_type == "mixtral" and loaded.dtype == torch.bfloat16
    want = model.state_dict()["layers.0.block_sparse_moe.experts.1.w2.weight"].to(torch.bfloat16)
    assert torch.equal(loaded.model.layers[0].mlp.experts.down_proj[1], want) or torch.equal(
        loaded.state_dict().get("model.layers.0.block_sparse_moe.experts.1.w2.weight", want), want
    )
    # sigmoid routing (NxDT's Megatron MoE) is no Hugging Face family: refused by name, nothing written
    sigmoid = {**source, "model_config": {**source["model_config"], "moe.router_activation": "sigmoid"}}
    with pytest.raises(CheckpointError, match="model.moe.router_activation='sigmoid'.*cannot be exported"):
        export_hf_state(model.state_dict(), sigmoid, tmp_path / "sig")
    assert not (tmp_path / "sig").exists()


def test_merge_base_keeps_the_base_config_and_refuses_another_model(tmp_path):
    _hf_model(_llama(False), tmp_path / "base")
    base = json.loads((tmp_path / "base/config.json").read_text())
    base["custom_field_of_the_base"] = "kept"
    base["bos_token_id"], base["eos_token_id"] = 7, 9
    (tmp_path / "base/config.json").write_text(json.dumps(base))
    (tmp_path / "base/generation_config.json").write_text(json.dumps({"eos_token_id": 9, "do_sample": True}))
    cfg = compose_config([f"model.hf_checkpoint={tmp_path / 'base'}", "data=synthetic"])
    model = _ours(cfg)
    source = {"model_config": model_meta(cfg.model), "tokenizer": None}
    export_hf_state(model.state_dict(), source, tmp_path / "out", base=tmp_path / "base")
    written = json.loads((tmp_path / "out/config.json").read_text())
    assert {**written, "torch_dtype": None} == {**{k: v for k, v in base.items() if k != "dtype"}, "torch_dtype": None}
    assert json.loads((tmp_path / "out/generation_config.json").read_text()) == {"eos_token_id": 9, "do_sample": True}
    other = {**source, "model_config": {**source["model_config"], "norm_eps": 1e-5}}
    with pytest.raises(CheckpointError, match=r"--base .*config.json has norm_eps=1e-06, the checkpoint's model 1e-05"):
        export_hf_state(model.state_dict(), other, tmp_path / "other", base=tmp_path / "base")


def test_the_run_tokenizer_is_exported(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4}, "[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok/tokenizer.json"))
    (tmp_path / "tok/tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"})
    )
    cfg = compose_config(["data=synthetic"])
    model = _ours(cfg)
    source = {"model_config": model_meta(cfg.model), "tokenizer": str(tmp_path / "tok")}
    export_hf_state(model.state_dict(), source, tmp_path / "out")
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert loaded("hello world")["input_ids"][-2:] == [2, 3] and loaded.eos_token == "</s>"
    written = json.loads((tmp_path / "out/config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"]) == (0, 1)
    gone = {**source, "tokenizer": str(tmp_path / "no-such")}
    with pytest.raises(CheckpointError, match="tokenizer .*no-such is gone"):
        export_hf_state(model.state_dict(), gone, tmp_path / "gone")


# ---------------------------------------------------------------------------------------------- import checks
@pytest.fixture()
def llama_dir(tmp_path):
    _hf_model(_llama(False), tmp_path / "hf")
    return tmp_path / "hf"


@pytest.mark.parametrize(
    "override, key, ours, theirs",
    [
        ("model.norm_eps=1e-5", "model.norm_eps", "1e-05", "rms_norm_eps is 1e-06"),
        ("model.rope_theta=10000", "model.rope_theta", "10000.0", "rope_theta is 500000.0"),
        ("model.rope_scaling.factor=4", "model.rope_scaling.factor", "4.0", "rope_scaling.factor is 8.0"),
        ("model.rope_scaling.rope_type=null", "model.rope_scaling.rope_type", "None", "'llama3'"),
        ("model.num_kv_heads=4", "model.num_kv_heads", "4", "num_key_value_heads is 2"),
        ("model.tie_word_embeddings=true", "model.tie_word_embeddings", "True", "tie_word_embeddings is False"),
        ("model=gpt_tiny", "model.architecture", "GPTForCausalLM", "model_type is 'llama'"),
    ],
)
def test_an_override_contradicting_config_json_is_refused_by_name(llama_dir, override, key, ours, theirs):
    for source in (f"model.hf_checkpoint={llama_dir}", f"model.model_config={llama_dir / 'config.json'}"):
        with pytest.raises(ConfigError) as err:
            compose_config([source, "data=synthetic", override])
        assert err.value.key == key and ours in str(err.value.value) + repr(err.value.value), str(err.value)
        assert theirs in str(err.value) and "drop the override" in str(err.value)


def test_training_only_overrides_and_model_config_are_accepted(llama_dir):
    cfg = compose_config(
        [
            f"model.hf_checkpoint={llama_dir}",
            "data=synthetic",
            "model.activations_checkpoint_granularity=selective",
            "model.core_attention=naive",
            "model.init_method_std=0.01",
            "model.max_position_embeddings=256",  # a RoPE model's table length is no computation field
            "model.norm_eps=1e-6",  # agreeing with config.json
        ]
    )
    m = cfg.model
    assert (m.activations_checkpoint_granularity, m.core_attention, m.max_position_embeddings) == ("selective", "naive", 256)
    assert (m.norm_eps, m.rope_theta, m.rope_scaling.rope_type, m.hidden_size) == (1e-6, 500000.0, "llama3", 32)
    same = compose_config([f"model.model_config={llama_dir}", "data=synthetic"])  # the directory works too
    assert model_meta(same.model) == {**model_meta(m), "max_position_embeddings": 128, "init_method_std": 0.02}
    assert same.model.hf_checkpoint is None


def test_a_run_config_that_differs_from_the_checkpoint_is_refused_before_launch(llama_dir):
    """The launcher's check (validate), for configs that do not go through compose's reading (an NxDT config, a run
    config written before): every computation field is compared, not the shapes only."""
    cfg = compose_config([f"model.hf_checkpoint={llama_dir}", "data=synthetic"], check=False)
    cfg.model.norm_eps = 1e-5
    with pytest.raises(ConfigError, match=r"model.norm_eps=1e-05: the checkpoint's config.json .* has rms_norm_eps=1e-06"):
        validate(cfg)
    cfg.model.norm_eps = 1e-6
    cfg.model.rope_scaling.rope_type = None
    with pytest.raises(ConfigError, match=r"model.rope_scaling.rope_type: .* has rope_scaling.rope_type='llama3'"):
        validate(cfg)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"model_type": "qwen2_moe"}, "model_type='qwen2_moe' is not in the model hub"),
        ({"model_type": "qwen3_moe", "decoder_sparse_step": 2}, "decoder_sparse_step=2: nxdt's Qwen3-MoE has a sparse"),
        ({"model_type": "qwen3_moe", "mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]: dense layers between"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window=true: sliding-window attention is not"),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=true"),
        ({"model_type": "qwen3", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn' is not"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn' is not implemented"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias=true"),
    ],
)
def test_a_config_json_nxdt_cannot_honour_is_refused(llama_dir, edit, message):
    hf = json.loads((llama_dir / "config.json").read_text())
    hf.pop("rope_parameters", None)
    (llama_dir / "config.json").write_text(json.dumps({**hf, "rope_theta": 500000.0, **edit}))
    with pytest.raises(ConfigError, match=message) as err:
        compose_config([f"model.hf_checkpoint={llama_dir}", "data=synthetic"])
    assert err.value.key == "model.hf_checkpoint"


def test_a_checkpoint_of_an_older_nxdt_exports_from_its_run_config(tmp_path):
    """Checkpoints written before meta.json recorded the model config: the run's config.yaml describes it (checked
    against the shape the checkpoint does record); without one the export is refused rather than guessed."""
    from nxdt.config import save_run_config
    from nxdt.config.validate import MODEL_SHAPE_FIELDS
    from nxdt.lightning.hf import export_source

    cfg = compose_config(["data=synthetic", "model.norm_eps=1e-6", "model.rope_theta=500000"])
    step = tmp_path / "run/checkpoints/step-1"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"model": {k: getattr(cfg.model, k) for k in MODEL_SHAPE_FIELDS}}))
    with pytest.raises(CheckpointError, match=r"does not record its model config .* config.yaml is not at"):
        export_source(step)
    save_run_config(cfg, tmp_path / "run/config.yaml")
    source = export_source(step)
    assert source == {"model_config": model_meta(cfg.model), "tokenizer": None}
    assert (source["model_config"]["norm_eps"], source["model_config"]["rope_theta"]) == (1e-6, 500000.0)
    other = compose_config(["data=synthetic", "model.hidden_size=64"])
    save_run_config(other, tmp_path / "run/config.yaml")
    with pytest.raises(CheckpointError, match="describes another model .hidden_size=64, the checkpoint has 128"):
        export_source(step)


def test_the_launcher_checks_a_gpt2_checkpoint_in_its_own_names(tmp_path):
    """The header check before launch goes through the family's adapter: GPT-2's fused, transposed c_attn is expected
    as [n_embd, 3·n_embd], and a wrong one is named as the checkpoint names it."""
    from safetensors.torch import load_file, save_file

    from nxdt.cli import _check_model

    _hf_model(_gpt2(True), tmp_path / "hf")
    cfg = compose_config([f"model.hf_checkpoint={tmp_path / 'hf'}", "data=synthetic"])
    assert cfg.model.architecture == "nxdt.models.gpt.GPTForCausalLM" and cfg.model.ffn_hidden_size == 80
    _check_model(cfg)  # accepted: every tensor known, of its shape
    tensors = load_file(str(tmp_path / "hf/model.safetensors"))
    tensors["transformer.h.1.attn.c_attn.weight"] = tensors["transformer.h.1.attn.c_attn.weight"].t().contiguous()
    save_file(tensors, str(tmp_path / "hf/model.safetensors"))
    with pytest.raises(ConfigError, match=r"transformer.h.1.attn.c_attn.weight has shape \[96, 32\], .* expects \[32, 96\]"):
        _check_model(cfg)


def test_the_launcher_checks_a_qwen3_moe_checkpoint_in_its_own_names(tmp_path):
    """Qwen3-MoE's experts go by Hugging Face's names (gate_proj/up_proj/down_proj, the spec's rules): an expert left
    out of the checkpoint is named as the checkpoint would name it, before launch."""
    from safetensors.torch import load_file, save_file

    from nxdt.cli import _check_model

    _hf_model(_qwen3_moe(), tmp_path / "hf")
    cfg = compose_config([f"model.hf_checkpoint={tmp_path / 'hf'}", "data=synthetic"])
    assert cfg.model.architecture == "nxdt.models.qwen3_moe.Qwen3MoeForCausalLM" and cfg.model.ffn_hidden_size == 24
    _check_model(cfg)  # accepted: every tensor known, of its shape
    tensors = load_file(str(tmp_path / "hf/model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.down_proj.weight"]
    save_file(tensors, str(tmp_path / "hf/model.safetensors"))
    with pytest.raises(ConfigError, match=r"missing tensors model.layers.1.mlp.experts.3.down_proj.weight \(1 of"):
        _check_model(cfg)


def test_a_mistral_window_shorter_than_the_sequence_is_refused_by_name(llama_dir):
    """Sliding-window attention is computed as full causal attention, equal only while the sequence fits the window."""
    hf = json.loads((llama_dir / "config.json").read_text())
    (llama_dir / "config.json").write_text(json.dumps({**hf, "model_type": "mistral", "sliding_window": 16}))
    with pytest.raises(ConfigError, match="data.seq_length=.* sliding-window attention is not implemented") as err:
        compose_config([f"model.hf_checkpoint={llama_dir}", "data=synthetic", "data.seq_length=32"])
    assert (err.value.key, err.value.value) == ("model.sliding_window", 16)
    cfg = compose_config([f"model.hf_checkpoint={llama_dir}", "data=synthetic", "data.seq_length=16"])
    assert (cfg.model.architecture, cfg.model.sliding_window) == ("nxdt.models.llama.MistralForCausalLM", 16)
    with pytest.raises(ValueError, match="exceeds model.sliding_window=16"):  # the hub model, used on its own
        _ours(cfg)(torch.zeros(1, 17, dtype=torch.long))


def test_a_qwen3_override_of_head_dim_or_the_window_is_refused_by_name(tmp_path):
    _hf_model(_qwen3(), tmp_path / "hf")
    with pytest.raises(ConfigError, match="its head_dim is 16; drop the override") as err:
        compose_config([f"model.hf_checkpoint={tmp_path / 'hf'}", "data=synthetic", "model.head_dim=8"])
    assert (err.value.key, err.value.value) == ("model.head_dim", 8)
    with pytest.raises(ConfigError, match="model_type is 'qwen3'") as err:
        compose_config(
            [f"model.hf_checkpoint={tmp_path / 'hf'}", "data=synthetic", "model.architecture=nxdt.models.llama.LlamaForCausalLM"]
        )
    assert err.value.key == "model.architecture"


@pytest.mark.parametrize(
    "family, edit, message",
    [
        # a Llama checkpoint under a qwen2 config.json: Qwen2's q/k/v biases are missing
        ("qwen2", lambda t: {k: v for k, v in t.items() if not k.endswith("proj.bias")}, r"missing tensors .*q_proj.bias"),
        ("qwen3", lambda t: {k: v for k, v in t.items() if "k_norm" not in k}, r"missing tensors .*self_attn.k_norm.weight"),
        ("qwen3", lambda t: {**t, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}, "q_proj.bias has no counterpart"),
        ("mistral", lambda t: {**t, "lm_head.weight": t["lm_head.weight"].to(torch.int8)}, "lm_head.weight is I8, not floating"),
    ],
)
def test_the_launcher_refuses_a_new_familys_tensors_it_cannot_load(tmp_path, family, edit, message):
    """Missing, extra or unloadable tensors of a Qwen2 / Qwen3 / Mistral checkpoint: one ConfigError naming
    model.hf_checkpoint before any worker starts (the check reads the safetensors headers in the family's names)."""
    from safetensors.torch import load_file, save_file

    from nxdt.cli import _check_model

    _hf_model({"qwen2": _qwen2(False), "qwen3": _qwen3(), "mistral": _mistral()}[family], tmp_path / "hf")
    cfg = compose_config([f"model.hf_checkpoint={tmp_path / 'hf'}", "data=synthetic"])
    _check_model(cfg)  # as saved: accepted
    tensors = edit(load_file(str(tmp_path / "hf/model.safetensors")))
    save_file(tensors, str(tmp_path / "hf/model.safetensors"))
    with pytest.raises(ConfigError, match=message) as err:
        _check_model(cfg)
    assert err.value.key == "model.hf_checkpoint" and "\n" not in str(err.value)
