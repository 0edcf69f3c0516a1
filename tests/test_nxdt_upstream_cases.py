"""NxD Training's 22 example configs (aws-neuron/neuronx-distributed-training 2.26.0, examples/conf/), each as a
case written here (tests/nxdt_cases.py: a conf/nxdt example plus the keys the upstream file sets otherwise),
written out as an NxDT YAML file and planned as its authors run it: given only ``instance=`` and, for the hf ones,
the Hugging Face config.json its ``model.model_config`` names (kept in conf/nxdt/); for the Megatron ones whose
tokenizer directory is not here, its vocabulary size. None is refused with "unknown key", none "does not fit" on the
hardware its authors run it on. The Megatron configs (model_source: megatron, data_prefix with weights) also train
shrunk on 2 CPU ranks on an indexed dataset converted from text."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import warm_cli
from nxdt_cases import CASE, EXAMPLES, keys_of, write_cases
from test_nxdt_configs import SHRINK, train_case

from nxdt.config import ConfigError, compose_nxdt_config
from nxdt.data import SAMPLE_TEXT
from nxdt.planner import plan

pytestmark = pytest.mark.timeout(120)

# The Megatron Llama/Mistral/Mixtral configs name /home/ubuntu/llama_tokenizer, Llama 2's tokenizer: 32000 ids
# (meta-llama/Llama-2-7b-hf config.json vocab_size), already a multiple of make_vocab_size_divisible_by 8 × TP, so
# Megatron's padding keeps it. megatron_gpt_config names GPT2BPETokenizer, whose vocabulary nxdt knows (50257).
LLAMA2_VOCAB = ["model.vocab_size=32000"]
# fine-tuning configs: their keys (model_alignment_strategy, data.dev_choose_samples, model.weight_init_only, and for
# the Megatron one data.packing, data.use_sft_style_data_module) come with the SFT work on its own branch
FINE_TUNING = (
    "hf_llama3_8B_SFT_config",
    "hf_llama3_8B_SFT_lora_config",
    "hf_llama3_8B_DPO_config",
    "hf_llama3_8B_ORPO_config",
    "megatron_llama2_7B_SFT_config",
)
# NxDT's hf Mixtral at TP32 with 8 KV heads and no kv_replicator: NxDT's own modeling_mixtral.py computes
# divide(num_key_value_heads × kv_shared_group_size, TP) = divide(8, 32), which asserts; refused here by name too
KV_HEADS_BELOW_TP = ("hf_mixtral_8x7b_config", "hf_mixtral_8x7b_dropless_config")


# (TP, PP, CP, nodes) of each upstream file, read off the originals: a case whose conf/nxdt base changed under it
# no longer matches its original, and these say so
LAYOUT = {
    "hf_llama3.1_405B_trn1_config": (32, 32, 1, 64),
    "hf_llama3.1_70B_config": (32, 8, 1, 32),
    "hf_llama3.1_8B_config": (32, 1, 1, 32),
    "hf_llama3_70B_CP_config": (32, 8, 2, 16),
    "hf_llama3_70B_config": (32, 8, 1, 16),
    "hf_llama3_70B_trn2_config": (32, 4, 1, 8),
    "hf_llama3_8B_DPO_config": (32, 1, 1, 1),
    "hf_llama3_8B_ORPO_config": (32, 1, 1, 1),
    "hf_llama3_8B_SFT_config": (32, 1, 1, 1),
    "hf_llama3_8B_SFT_lora_config": (32, 1, 1, 1),
    "hf_llama3_8B_config": (32, 1, 1, 4),
    "hf_llama3_8B_trn2_config": (16, 1, 1, 1),
    "hf_llama_7B_config": (8, 1, 1, 1),
    "hf_mixtral_8x7b_config": (32, 4, 1, 8),
    "hf_mixtral_8x7b_dropless_config": (32, 4, 1, 8),
    "megatron_gpt_config": (8, 1, 1, 1),
    "megatron_llama2_7B_SFT_config": (8, 1, 1, 1),
    "megatron_llama_70b_config": (8, 16, 1, 8),
    "megatron_llama_7B_config": (8, 1, 1, 1),
    "megatron_mistral_config": (8, 1, 1, 1),
    "megatron_mixtral_8x7b_config": (32, 4, 1, 16),
    "megatron_mixtral_8x7b_dropless_config": (32, 4, 1, 16),
}


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> Path:
    return write_cases(tmp_path_factory.mktemp("nxdt_cases"))


def overrides(name: str) -> list[str]:
    case = CASE[name]
    if case.hf_config is not None:
        extra = [f"model.model_config={EXAMPLES / (case.hf_config + '_config.json')}"]
    else:
        extra = [] if name == "megatron_gpt_config" else LLAMA2_VOCAB
    return [f"instance={case.instance}", *extra]


def planned(cases: Path, name: str, *more: str):
    return compose_nxdt_config(cases, name, [*overrides(name), *more], paths=False)


def test_the_cases_are_nxd_trainings_22_examples(cases):
    names = sorted(p.stem for p in cases.glob("*.yaml"))
    assert names == sorted(CASE) and len(names) == 22
    assert sum(c.hf_config is not None for c in CASE.values()) == 15  # the hf ones; 7 Megatron
    keys = keys_of("megatron_llama_7B_config")
    assert "model.model_config" not in keys and keys["data.data_prefix"] == [
        1.0,
        "/home/ubuntu/examples_datasets/llama/book.jsonl-processed_text_document",
    ]
    assert {c.instance for c in CASE.values()} == {"trn1.32xlarge", "trn2.48xlarge"}
    layouts = {}
    for name in CASE:
        k = {
            key.rpartition(".")[2]: v
            for key, v in keys_of(name).items()
            if key.split(".")[0] in ("distributed_strategy", "trainer")
        }
        layouts[name] = (
            k["tensor_model_parallel_size"],
            k["pipeline_model_parallel_size"],
            k.get("context_parallel_size", 1),
            k["num_nodes"],
        )
    assert layouts == LAYOUT


PLANNED = sorted(set(CASE) - set(FINE_TUNING) - set(KV_HEADS_BELOW_TP))


@pytest.mark.parametrize("name", PLANNED)
def test_every_example_config_plans_as_written_and_fits(cases, name):
    cfg, warnings = planned(cases, name)
    assert not any("unknown key" in w for w in warnings)
    p = plan(cfg)
    assert not [w for w in p.warnings if "does not fit" in w], p.warnings
    tp, pp, cp, nodes = LAYOUT[name]  # the original's own layout, not a substitute
    assert (p.degrees["tp"], p.degrees["pp"], p.degrees["cp"], cfg.trainer.num_nodes) == (tp, pp, cp, nodes)
    assert p.world_size == cfg.trainer.devices * cfg.trainer.num_nodes


@pytest.mark.parametrize("name", FINE_TUNING[:4])
def test_fine_tuning_configs_plan_as_written(cases, name):
    from nxdt.config.nxdt_compat import rule_for

    if rule_for("data.dev_choose_samples") is None:  # runs for real once the SFT branch (its keys) is merged
        pytest.xfail("fine-tuning keys land with the SFT branch")
    cfg, warnings = planned(cases, name)
    assert not [w for w in plan(cfg).warnings if "does not fit" in w]


def test_the_megatron_sft_config_plans_as_written(cases):
    """data.use_sft_style_data_module: the Megatron model on instruction records (data.train_dir), packed by data.packing."""
    cfg, _ = planned(cases, "megatron_llama2_7B_SFT_config")
    assert not [w for w in plan(cfg).warnings if "does not fit" in w]
    assert (cfg.data.source, cfg.model_alignment_strategy.sft.packing, cfg.model.architecture) == (
        "instructions",
        True,
        "nxdt.models.llama.LlamaForCausalLM",
    )
    cfg, _ = planned(cases, "megatron_llama2_7B_SFT_config", "data.packing=false")
    assert cfg.model_alignment_strategy.sft.packing is False


@pytest.mark.parametrize("name", KV_HEADS_BELOW_TP)
def test_hf_mixtral_at_tp32_is_refused_by_name_as_nxdt_itself_would(cases, name):
    with pytest.raises(ConfigError) as info:
        planned(cases, name)
    assert str(info.value) == (
        "config error: distributed_strategy.tensor_model_parallel_size=32: must divide model.num_kv_heads "
        "× kv_replicator = 8×1; raise distributed_strategy.kv_replicator"
    )
    cfg, _ = planned(cases, name, "distributed_strategy.kv_replicator=4")  # what makes NxD's GQA layers accept TP32
    assert not [w for w in plan(cfg).warnings if "does not fit" in w]


def test_megatron_model_keys_pick_the_hub_model(cases):
    cfg, warnings = planned(cases, "megatron_gpt_config")
    m = cfg.model
    assert (m.architecture, m.tie_word_embeddings, m.hidden_size, m.num_layers, m.ffn_hidden_size, cfg.data.seq_length) == (
        "nxdt.models.gpt.GPTForCausalLM",
        True,
        4096,
        32,
        16384,
        2048,
    )
    # GPT2BPETokenizer's 50257 ids; under TP 8 the layers pad them to a multiple of 8 × 8 = 50304 as Megatron does
    # (NxDT's data/base.py _vocab_size_with_padding), masked, so the model's vocabulary is the tokenizer's
    assert (m.vocab_size, m.make_vocab_size_divisible_by) == (50257, 8)
    assert any("model.hidden_dropout=0.1 has no effect: nxdt has no dropout" in w for w in warnings)
    assert (cfg.data.source, list(cfg.data.data_prefix), cfg.data.splits_string) == (
        "megatron",
        [1.0, "/home/ubuntu/examples_datasets/gpt2/my-gpt2_text_document"],
        "980,10,10",
    )
    cfg, _ = planned(cases, "megatron_llama_70b_config")
    assert (cfg.model.architecture, cfg.model.num_kv_heads, cfg.model.norm_eps, cfg.model.tie_word_embeddings) == (
        "nxdt.models.llama.LlamaForCausalLM",
        8,
        1e-5,
        False,
    )
    cfg, _ = planned(cases, "megatron_mixtral_8x7b_config")
    assert (cfg.model.architecture, cfg.model.moe.num_experts, cfg.model.moe.router_activation) == (
        "nxdt.models.mixtral.MixtralForCausalLM",
        8,
        "sigmoid",
    )
    cfg, _ = planned(cases, "megatron_mistral_config")  # sliding_window_size 4096 = seq_length: plain causal attention
    assert cfg.model.ffn_hidden_size == 14336
    with pytest.raises(ConfigError, match="model.sliding_window_size=1024: sliding-window attention is not implemented"):
        planned(cases, "megatron_mistral_config", "model.sliding_window_size=1024")
    with pytest.raises(ConfigError, match="no hub model has normalization='rmsnorm', activation='gelu'"):
        planned(cases, "megatron_llama_7B_config", "model.activation=gelu")


def test_the_home_variable_in_the_megatron_sft_paths_is_named_as_not_expanded(cases):
    """megatron_llama2_7B_SFT names data.train_dir: $HOME/training.jsonl; neither Hydra nor NxDT's loaders
    (model_alignment_data_module.py: load_dataset("json", data_files=path)) expand it."""
    with pytest.raises(ConfigError) as info:
        compose_nxdt_config(cases, "megatron_llama2_7B_SFT_config", overrides("megatron_llama2_7B_SFT_config"))
    assert "data.train_dir=" in str(info.value) and "$HOME/training.jsonl': no such file (environment variables such as" in str(
        info.value
    )


def test_a_megatron_vocabulary_comes_from_the_tokenizer(cases, tmp_path):
    tok = {
        "model": {"type": "WordLevel", "vocab": {f"w{i}": i for i in range(1000)}, "unk_token": "w0"},
        "added_tokens": [{"id": 1000, "content": "<s>"}],
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    cfg, _ = compose_nxdt_config(
        cases, "megatron_llama_7B_config", ["instance=trn1.32xlarge", f"data.tokenizer.type={tmp_path}"], paths=False
    )
    assert cfg.model.vocab_size == 1001  # the tokenizer's ids; padded to 1024 (8 × TP 8) only inside the TP layers
    with pytest.raises(ConfigError) as info:
        compose_nxdt_config(cases, "megatron_llama_7B_config", ["instance=trn1.32xlarge"], paths=False)
    assert (
        "model.vocab_size: the Megatron model's vocabulary comes from its tokenizer (data.tokenizer.type=/home/ubuntu/"
        "llama_tokenizer), not readable here" in str(info.value)
    )


def test_the_sigmoid_router_of_nxdts_megatron_mixtral_routes_by_sigmoid_affinities(cases):
    """NxD's RouterTopK with act_fn sigmoid: affinities sigmoid(logits), the top-k experts by logit, their affinities
    renormalised to sum 1; computed here token by token in float64 against the block's batched fp32 forward (both
    sum k ≤ 2 expert outputs of O(1) size: float32 rounding, ~1e-7 relative, is far inside rtol 1e-5)."""
    import types

    import torch

    from nxdt.config.validate import check_trainable
    from nxdt.models.mixtral import SparseMoeBlock

    cfg, _ = planned(cases, "megatron_mixtral_8x7b_dropless_config")
    assert cfg.model.moe.router_activation == "sigmoid"
    check_trainable(cfg)  # trains as it plans
    torch.manual_seed(0)
    small = types.SimpleNamespace(
        hidden_size=8,
        ffn_hidden_size=12,
        moe=types.SimpleNamespace(num_experts=4, top_k=2, router_aux_loss_coef=0.0, router_activation="sigmoid"),
    )
    block = SparseMoeBlock(small)
    x = torch.randn(2, 5, 8)
    got = block(x).reshape(-1, 8).double()
    for t, token in enumerate(x.reshape(-1, 8).double()):
        logits = token @ block.gate.weight.double().T
        chosen = torch.topk(logits, 2).indices
        weights = torch.sigmoid(logits[chosen]) / torch.sigmoid(logits[chosen]).sum()
        expert = [block.experts[str(int(e))] for e in chosen]
        want = sum(
            w * (e.w2.weight.double() @ (torch.nn.functional.silu(e.w1.weight.double() @ token) * (e.w3.weight.double() @ token)))
            for w, e in zip(weights, expert)
        )
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-6)
    block.router_activation = "softmax"
    assert not torch.allclose(block(x).reshape(-1, 8).double(), got)  # the activation matters


# ---------------------------------------------------------------------------------------------- shrunk, trained


def corpus(tmp_path: Path) -> tuple[Path, Path]:
    """Two indexed datasets converted from the shipped sample text: its paragraphs as JSONL documents, first and
    second half (byte-level ids)."""
    paragraphs = [p for p in SAMPLE_TEXT.read_text(encoding="utf-8").split("\n\n") if p.strip()][:400]
    prefixes = []
    for part, chunk in (("a", paragraphs[:200]), ("b", paragraphs[200:])):
        src = tmp_path / f"{part}.jsonl"
        src.write_text("".join(json.dumps({"text": p}) + "\n" for p in chunk), encoding="utf-8")
        out = warm_cli.run(["data", "convert-megatron", str(src), "--output-prefix", str(tmp_path / part)], timeout=60)
        assert out.returncode == 0, out.stderr
        prefixes.append(tmp_path / part)
    return prefixes[0], prefixes[1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_megatron_config_shrunk_trains_on_blended_indexed_data(cases, tmp_path):
    a, b = corpus(tmp_path)
    run, index_dir = tmp_path / "run", tmp_path / "index"
    # test_nxdt_configs' shrink, its text directory replaced by the Megatron files (data.data_prefix)
    shrink = [o for o in SHRINK if not o.startswith("data.train_dir=")] + [
        "distributed_strategy.tensor_model_parallel_size=1",
        f"data.data_prefix=[0.3,{a},0.7,{b}]",
        f"data.index_mapping_dir={index_dir}",
        "data.tokenizer.type=null",  # the data is converted byte-level
        f"exp_manager.explicit_log_dir={run}",
    ]
    train_case(cases, "megatron_llama_7B_config", shrink, tmp_path)
    with open(run / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    loss = [float(r["loss"]) for r in rows]
    assert all(math.isfinite(x) for x in loss) and loss[-1] < loss[0], loss
    # the sample index of each dataset, cached as .npy (+ its description) for 3 steps × 4 samples blended 0.3 / 0.7
    cached = sorted(p.name for p in index_dir.iterdir())
    assert len(cached) == 8 and sum(n.startswith("a_") for n in cached) == sum(n.startswith("b_") for n in cached) == 4
    descs = {n[0]: json.loads((index_dir / n).read_text()) for n in cached if n.endswith("_desc.json")}
    assert descs["a"]["num_samples"] + descs["b"]["num_samples"] == 12 and descs["a"]["seq_length"] == 32
    cfg, _ = compose_nxdt_config(cases, "megatron_llama_7B_config", shrink)
    assert (cfg.data.source, cfg.model.architecture, cfg.model.core_attention) == (
        "megatron",
        "nxdt.models.llama.LlamaForCausalLM",
        "naive",
    )  # fusions.flash_attention: False in the file


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_megatron_sft_config_shrunk_trains_on_instruction_records(cases, tmp_path):
    """megatron_llama2_7B_SFT as written but shrunk (its ZeRO-1, mixed precision and packing kept), on the shipped
    instruction records with a Hugging Face tokenizer directory (the model's vocabulary padded from it, as Megatron
    does), validated on held-out records; no pretrained checkpoint here, so weight_init_only is off."""
    from nxdt.data import SAMPLE_INSTRUCTIONS
    from test_sft_e2e import _tokenizer

    lines = SAMPLE_INSTRUCTIONS.read_text().splitlines()
    (tmp_path / "validation.jsonl").write_text("\n".join(lines[-16:]) + "\n")
    run = tmp_path / "run"
    shrink = [
        "instance=cpu",
        "trainer.devices=2",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "model.num_layers=2",
        "model.hidden_size=64",
        "model.num_attention_heads=4",
        "model.num_kv_heads=2",
        "model.ffn_hidden_size=96",
        "model.encoder_seq_length=128",
        "data.global_batch_size=4",
        "distributed_strategy.tensor_model_parallel_size=1",
        "distributed_strategy.sequence_parallel=false",
        f"data.train_dir={SAMPLE_INSTRUCTIONS}",
        f"data.val_dir={tmp_path / 'validation.jsonl'}",
        f"data.tokenizer.type={_tokenizer(tmp_path / 'tokenizer')}",
        "model.weight_init_only=false",
        "exp_manager.resume_from_checkpoint=null",
        "model.optim.lr=3e-3",
        "exp_manager.create_tensorboard_logger=false",
        "comm.timeout_s=60",
        f"exp_manager.explicit_log_dir={run}",
    ]
    result = train_case(cases, "megatron_llama2_7B_SFT_config", shrink, tmp_path)
    # packed: the records (~50 tokens each with the chat template) share 128-token sequences
    line = next(x for x in result.stdout.splitlines() if "data: train:" in x)
    records, sequences = int(line.split("records →")[0].split()[-2]), int(line.split("→ ")[1].split()[0])
    assert records >= 1.5 * sequences, line
    with open(run / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    steps = [r for r in rows if r.get("step") and r.get("loss")]
    assert [int(r["step"]) for r in steps] == [1, 2, 3]
    assert all(math.isfinite(float(r["loss"])) for r in steps)
    assert any(r.get("val_loss") for r in rows)
    cfg, _ = compose_nxdt_config(cases, "megatron_llama2_7B_SFT_config", shrink)
    assert (cfg.data.source, cfg.model_alignment_strategy.sft.packing, cfg.model.vocab_size, cfg.distributed_strategy.zero1) == (
        "instructions",
        True,
        260,
        True,
    )  # the tokenizer's 260 ids (padding happens under TP only, inside the layers)
