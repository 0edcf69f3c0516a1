"""The LoRA SFT example in NxD Training's config format (tests/nxdt_configs/hf_llama3_8B_SFT_lora_config.yaml), shrunk by the
overrides of tests/test_sft_e2e.py, trained through `nxdt train --config-path ... --config-name ...` on two CPU
processes (PP2: each stage one layer; LoRA under DP, TP and FSDP: tests/parallel/test_lora_parallel.py), its peft block as it is (rank 16, qkv_proj, save_lora_base and save_lora_config_adapter true,
autocast precision, weight_init_only) and the base weights from a Hugging Face directory (model.hf_checkpoint)
written by transformers. One launch, checked for:

* the lora_verbose line: the adapted modules and the exact trainable / total parameter counts;
* learning: the loss falls; only the adapters moved — the checkpoint's base weights equal the Hugging Face ones bit
  for bit, every lora_B left zero;
* the checkpoint is a Hugging Face PEFT adapter directory too (adapter_config.json, adapter_model.safetensors, under
  its checksums; the adapters gathered over the pipeline stages): the real ``peft`` library loads it onto the
  transformers Llama and gives the logits of the base with nxdt's merged adapters (merge_lora_state, from the stages'
  own model files) — two independent ways of applying the same adapter.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import warm_cli
import torch

from hf_reference import llama_config
from nxdt.data import SAMPLE_INSTRUCTIONS
from test_sft_e2e import CONFIGS, SHRINK, _rows, _tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

NAME = "hf_llama3_8B_SFT_lora_config"
# SHRINK's model; rope_theta as the file, the rest nxdt's defaults (what the run's model is built with)
SHAPE = dict(
    vocab_size=272,
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=96,
    max_position_embeddings=64,
    rope_theta=500000.0,
    norm_eps=1e-5,
)
RANK, ALPHA = 16, 32  # the file's lora_rank, lora_alpha


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("lora_e2e")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_config(transformers, SHAPE)).save_pretrained(str(root / "base"))
    lines = SAMPLE_INSTRUCTIONS.read_text().splitlines()
    (root / "validation.jsonl").write_text("\n".join(lines[-20:]) + "\n")
    overrides = [
        "trainer.devices=2",
        "distributed_strategy.pipeline_model_parallel_size=2",
        "exp_manager.resume_from_checkpoint=null",
        f"model.hf_checkpoint={root / 'base'}",
        # the file's model_config (Llama 3 8B's config.json) states head_dim 128; the shrunk base's is hidden/heads
        f"model.head_dim={SHAPE['hidden_size'] // SHAPE['num_attention_heads']}",
        f"exp_manager.explicit_log_dir={root / 'run'}",
        f"data.tokenizer.type={_tokenizer(root / 'tokenizer')}",
        f"data.train_dir={SAMPLE_INSTRUCTIONS}",
        "data.dev_choose_samples=64",
        f"data.val_dir={root / 'validation.jsonl'}",
        "model.optim.lr=2e-2",
    ]
    result = warm_cli.run(
        ["train", "--config-path", str(CONFIGS), "--config-name", NAME, *SHRINK, *overrides], cwd=root, timeout=230
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    return {"base": root / "base", "run": root / "run", "stdout": result.stdout, "transformers": transformers}


def _checkpoint_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The model's tensors from every pipeline stage's file (each stage's layers under their global names)."""
    from safetensors.torch import load_file

    stages = sorted(ckpt.glob("model-mp*.safetensors"))
    assert len(stages) == 2, stages
    return {k[len("model.") :]: v for f in stages for k, v in load_file(str(f)).items()}


def test_the_nxdt_lora_config_trains_the_adapters_alone(run):
    # lora_verbose: q/k/v of 2 layers at rank 16 = 2 · 16 · ((64 + 64) + 2 · (64 + 32)) trainable
    head_dim = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    kv = SHAPE["num_kv_heads"] * head_dim
    h, f, v, layers = SHAPE["hidden_size"], SHAPE["ffn_hidden_size"], SHAPE["vocab_size"], SHAPE["num_layers"]
    trainable = layers * RANK * ((h + h) + 2 * (h + kv))
    base = 2 * v * h + layers * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + h  # embedding, head; attention, MLP, norms
    assert "nxdt: LoRA on 6 modules (k_proj, q_proj, v_proj; " in run["stdout"]
    assert f": {trainable:,} trainable of {base + trainable:,} parameters" in run["stdout"], run["stdout"][-2000:]
    rows = _rows(run["run"])
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    loss = [float(r["loss"]) for r in rows]
    # the base starts near uniform (ln 272 = 5.606; its loss on any batch within ~0.03 of it): a fall of more than that
    # over three steps is the adapters learning, not another batch (seen: 5.628 → 5.559)
    assert all(math.isfinite(x) for x in loss) and loss[-1] < loss[0] - 0.03, loss
    assert math.isfinite(float(rows[2]["val_loss"]))

    from safetensors.torch import load_file

    from nxdt.lightning.hf import our_name

    state = _checkpoint_state(run["run"] / "checkpoints" / "step-3")
    base = {our_name(k): v for k, v in load_file(str(run["base"] / "model.safetensors")).items()}
    frozen = {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}
    assert frozen.keys() == base.keys()
    for name, tensor in base.items():  # frozen: not one bit moved (save_lora_base true: the base is in the checkpoint)
        assert torch.equal(frozen[name], tensor), name
    b = [v for k, v in state.items() if ".lora_B." in k]
    assert len(b) == 6 and all(torch.count_nonzero(t) > 0 for t in b)  # the adapters learned (they start at zero)


def test_each_checkpoint_is_a_peft_adapter_that_the_peft_library_loads(run):
    peft = pytest.importorskip("peft")
    transformers = run["transformers"]
    from nxdt.lightning.checkpoint import read_checksums, verify
    from nxdt.lightning.hf import hf_name
    from nxdt.models.lora import merge_lora_state

    ckpt = run["run"] / "checkpoints" / "step-3"
    verify(ckpt)  # the adapter files are recorded in checksums.json with the rest
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(read_checksums(ckpt))
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (RANK, ALPHA, ["q_proj", "k_proj", "v_proj"])
    # the base PEFT loads the adapters onto: the run's model.hf_checkpoint (it was null before issue 39)
    assert config["base_model_name_or_path"] == str(run["base"].resolve())

    ids = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    merged = transformers.LlamaForCausalLM.from_pretrained(str(run["base"])).eval()
    merged.load_state_dict({hf_name(k): v for k, v in merge_lora_state(_checkpoint_state(ckpt), ALPHA / RANK).items()})
    base = transformers.LlamaForCausalLM.from_pretrained(str(run["base"])).eval()
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        loaded = peft.PeftModel.from_pretrained(base, str(ckpt)).eval()
        want = merged(input_ids=ids).logits
        # fp32 both sides; x·W + s·(x·A)·B (peft) vs x·(W + s·B·A) (merged) differ by float rounding only, ~1e-6 here
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=0, atol=1e-5)
    assert (want - base_logits).abs().max() > 1e-3  # the adapter matters: not a comparison of two base models
