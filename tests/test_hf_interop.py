"""Hugging Face checkpoint interop: a HF Llama checkpoint (Llama 3.1 style: rope_theta 500000, rms_norm_eps 1e-6,
llama3 rope scaling) named by `model.hf_checkpoint` alone, imported into a TP2×PP2 run, trained one step with a zero
learning rate (no change) and exported with `nxdt checkpoint export-hf` is bitwise the original, with a config.json
transformers builds the same model from; bad HF checkpoints fail before any worker starts."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from test_train_e2e import TINY, assert_ok, nxdt

transformers = pytest.importorskip("transformers")


def _hf_llama_tiny(directory):
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=500000.0,
        rms_norm_eps=1e-6,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():  # HF initialises norms to 1: make every tensor distinctive
            p.normal_(0.0, 0.05)
    model.save_pretrained(directory, safe_serialization=True)
    return load_file(str(directory / "model.safetensors"))


@pytest.mark.timeout(300)
def test_import_at_tp2_pp2_then_export_is_bitwise_the_original(tmp_path):
    original = _hf_llama_tiny(tmp_path / "hf")
    run = tmp_path / "run"
    assert_ok(
        nxdt(
            "train",
            *TINY[1:],  # no model group: every model field from the checkpoint's config.json
            "data=synthetic",
            f"model.hf_checkpoint={tmp_path / 'hf'}",
            "trainer.devices=4",
            "distributed_strategy.tensor_model_parallel_size=2",
            "distributed_strategy.pipeline_model_parallel_size=2",
            "data.global_batch_size=4",
            "data.micro_batch_size=2",
            "trainer.max_steps=1",
            "model.optim.lr=0",
            "model.optim.weight_decay=0",
            "exp_manager.checkpoint_every_n_steps=1",
            f"exp_manager.explicit_log_dir={run}",
            cwd=tmp_path,
        )
    )
    result = nxdt("checkpoint", "export-hf", str(run / "checkpoints/step-1"), str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    exported = load_file(str(tmp_path / "out/model.safetensors"))
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    # the same model for transformers: every computation field of the original config.json (the old export wrote
    # the shapes only: epsilon 1e-6 and rope_theta 500000 came back as transformers' defaults, the scaling dropped)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    models = [transformers.AutoModelForCausalLM.from_pretrained(tmp_path / d, attn_implementation="eager") for d in ("hf", "out")]
    # bos/eos ids are the tokenizer's: this run had none (byte-level), so the export names none
    configs = [{k: v for k, v in m.config.to_diff_dict().items() if k not in ("bos_token_id", "eos_token_id")} for m in models]
    assert models[1].config.model_type == "llama" and configs[1] == configs[0]
    with torch.no_grad():
        assert torch.equal(models[0](ids).logits, models[1](ids).logits)
    result = nxdt(
        "checkpoint", "export-hf", str(run / "checkpoints/step-1"), str(tmp_path / "bf16"), "--dtype", "bf16", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    halved = load_file(str(tmp_path / "bf16/model.safetensors"))
    assert all(torch.equal(halved[name], tensor.to(torch.bfloat16)) for name, tensor in original.items())
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16


def test_a_mismatched_hf_checkpoint_is_one_line(tmp_path):
    _hf_llama_tiny(tmp_path / "hf")
    result = nxdt(
        "train",
        *TINY,
        "data=synthetic",
        f"model.hf_checkpoint={tmp_path / 'hf'}",
        "model.hidden_size=64",
        "trainer.devices=1",
        "trainer.max_steps=1",
        f"exp_manager.explicit_log_dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    # found before any worker starts: one line naming the key, both values and the fix
    assert result.returncode == 2 and not (tmp_path / "run" / "logs").exists(), result.stderr[-2000:]
    assert "model.hidden_size=64" in result.stderr and "its hidden_size is 128" in result.stderr, result.stderr[-2000:]
    assert "drop the override (config.json sets the model)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    empty = nxdt("train", *TINY, f"model.hf_checkpoint={tmp_path}", cwd=tmp_path, timeout=60)
    assert empty.returncode == 2 and "no *.safetensors" in empty.stderr and len(empty.stderr.strip().splitlines()) == 1
