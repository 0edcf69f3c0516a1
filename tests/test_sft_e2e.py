"""The SFT example in NxD Training's config format (tests/nxdt_configs/hf_llama3_8B_SFT_config.yaml), shrunk by overrides,
trained through `nxdt train --config-path ... --config-name ...` on CPU: a Hugging Face tokenizer directory with a
chat template, the shipped instruction records (first data.dev_choose_samples), packed, validated on a set of its
own. Four launches, each checking several things:

* one process (fp32): the reference losses and val_loss, a checkpoint to start from;
* DP2, TP2+SP and CP2 (fp32): the same per-step losses and the same val_loss (the token-weighted loss over every
  validation token does not depend on the layout; under CP the packed records' segments mask the ring's tiles);
* the file as it is (weight_init_only: True, resume_if_exists: True, ZeRO-1, mixed precision) on DP2, started from the
  first run's checkpoint with other data: a new run directory, step 1 onwards, the checkpoint's weights.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import warm_cli
import torch

from nxdt.data import SAMPLE_INSTRUCTIONS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CONFIGS = Path(__file__).parent / "nxdt_configs"
NAME = "hf_llama3_8B_SFT_config"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SHRINK = [
    "instance=cpu",
    "trainer.max_steps=3",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=1.0",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=96",
    "model.vocab_size=272",
    "model.encoder_seq_length=64",
    "model.max_position_embeddings=64",
    "data.seq_length=64",
    "data.global_batch_size=8",
    "data.micro_batch_size=2",
    "model.optim.lr=3e-3",
    "exp_manager.create_tensorboard_logger=false",
    "comm.timeout_s=60",
    "distributed_strategy.tensor_model_parallel_size=1",
    "distributed_strategy.sequence_parallel=false",
    "exp_manager.checkpoint_callback_params.every_n_train_steps=3",
]
FP32_FROM_SCRATCH = ["precision.type=fp32", "model.weight_init_only=false", "exp_manager.resume_from_checkpoint=null"]


def _tokenizer(directory: Path) -> Path:
    """A byte-level BPE tokenizer directory as Hugging Face saves one, with a chat template and special tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    specials = ["<|begin|>", "<|end|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(alphabet))}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(specials)
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|begin|>",
                "eos_token": "<|end|>",
                "chat_template": TEMPLATE,
            }
        )
    )
    return directory


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_data")
    lines = SAMPLE_INSTRUCTIONS.read_text().splitlines()
    (root / "validation.jsonl").write_text("\n".join(lines[-20:]) + "\n")  # held out: the train runs read the first 64
    return {"tokenizer": _tokenizer(root / "tokenizer"), "val": root / "validation.jsonl"}


def _train(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    result = warm_cli.run(
        ["train", "--config-path", str(CONFIGS), "--config-name", NAME, *SHRINK, *overrides],
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        timeout=230,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    return result


def _rows(run: Path) -> list[dict[str, str]]:
    with open(run / "metrics.csv", newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    """One process, fp32, from scratch, run directory <exp_dir>/hf_llama/<timestamp> (the file's name)."""
    cwd = tmp_path_factory.mktemp("sft_single")
    result = _train(
        cwd,
        *FP32_FROM_SCRATCH,
        "trainer.devices=1",
        f"exp_manager.exp_dir={cwd / 'exp'}",
        f"data.tokenizer.type={data['tokenizer']}",
        f"data.train_dir={SAMPLE_INSTRUCTIONS}",
        "data.dev_choose_samples=64",
        f"data.val_dir={data['val']}",
    )
    (run,) = (cwd / "exp" / "hf_llama").iterdir()
    return {"run": run, "rows": _rows(run), "stdout": result.stdout, "exp": cwd / "exp"}


def test_the_nxdt_sft_config_trains_packed_chat_records_and_validates(reference):
    rows = reference["rows"]
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    loss = [float(r["loss"]) for r in rows]
    assert all(math.isfinite(x) for x in loss) and loss[-1] < loss[0], loss
    assert [r["val_loss"] for r in rows[:2]] == ["", ""] and math.isfinite(float(rows[2]["val_loss"]))
    # the launcher read, templated, masked and packed the records before any worker started, and said so
    assert "nxdt: train: 64 instruction records → " in reference["stdout"] and ", 0 dropped" in reference["stdout"]
    assert "nxdt: validation: 20 instruction records → " in reference["stdout"]
    assert (reference["run"] / "checkpoints" / "step-3" / "done").is_file()


@pytest.mark.parametrize(
    "layout",
    [
        ["trainer.devices=2"],
        ["trainer.devices=2", "distributed_strategy.tensor_model_parallel_size=2", "distributed_strategy.sequence_parallel=true"],
        ["trainer.devices=2", "distributed_strategy.context_parallel_size=2"],
    ],
    ids=["dp2", "tp2-sp", "cp2"],
)
def test_data_and_tensor_parallel_sft_equal_one_process(tmp_path, reference, data, layout):
    run = tmp_path / "run"
    _train(
        tmp_path,
        *FP32_FROM_SCRATCH,
        *layout,
        f"exp_manager.explicit_log_dir={run}",
        f"data.tokenizer.type={data['tokenizer']}",
        f"data.train_dir={SAMPLE_INSTRUCTIONS}",
        "data.dev_choose_samples=64",
        f"data.val_dir={data['val']}",
    )
    got, want = _rows(run), reference["rows"]
    # fp32; TP splits the matmuls' reductions and the vocabulary softmax, DP runs other thread counts, CP merges
    # attention over ring blocks by log-sum-exp: the losses differ by float rounding only (~1e-7 relative per token),
    # far inside 1e-5
    for g, w in zip(got, want, strict=True):
        assert float(g["loss"]) == pytest.approx(float(w["loss"]), rel=1e-5), (got, want)
    # the validation loss is a token-weighted sum over every validation record, whichever rank held it
    assert float(got[2]["val_loss"]) == pytest.approx(float(want[2]["val_loss"]), rel=1e-5)


def test_the_file_as_it_is_starts_from_the_pretrained_checkpoint_with_a_fresh_optimizer(tmp_path, reference, data):
    """weight_init_only: True, resume_if_exists: True as in NxDT's file, other data (dev_choose_samples) than the run
    of the same name whose checkpoint it starts from: a new run directory, steps from 1, that checkpoint's weights."""
    from safetensors.torch import load_file

    ckpt = reference["run"] / "checkpoints" / "step-3"
    _train(
        tmp_path,
        "trainer.devices=2",
        f"exp_manager.exp_dir={reference['exp']}",
        f"exp_manager.resume_from_checkpoint={ckpt}",
        f"data.tokenizer.type={data['tokenizer']}",
        f"data.train_dir={SAMPLE_INSTRUCTIONS}",
        "data.dev_choose_samples=48",
        f"data.val_dir={data['val']}",
    )
    runs = sorted((reference["exp"] / "hf_llama").iterdir())
    assert len(runs) == 2 and reference["run"] in runs  # the pretraining-like run was left alone
    (run,) = [r for r in runs if r != reference["run"]]
    rows = _rows(run)
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    weights = load_file(str(ckpt / "model.safetensors"))
    norm = float(torch.linalg.vector_norm(torch.stack([t.double().norm() for t in weights.values()])))
    assert float(rows[0]["param_norm"]) == pytest.approx(norm, rel=1e-5)  # step 1 starts from the checkpoint's weights
    # a fresh schedule: NxDT's file warms up over 10 steps from step 0 (nxdt: lr·(step+1)/warmup at step 0)
    assert float(rows[0]["lr"]) == pytest.approx(3e-3 / 10)
    assert float(rows[0]["loss"]) < float(reference["rows"][0]["loss"])  # it starts where the first run got to
    assert math.isfinite(float(rows[2]["val_loss"]))
