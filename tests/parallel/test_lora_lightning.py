"""LoRA through the Lightning API on two layouts, against an in-process single-process reference:
``CausalLMModule(peft=...)`` + ``NxDStrategy``. An FSDP2 run trains 2 steps and saves an adapters-only
checkpoint (NxDT's save_lora_base false: the model file holds the adapter tensors alone); a TP2 + SP run resumes
it (another layout: resharded by name, the frozen base taken from the model as built) for 2 more steps and exports
the PEFT adapter gathered from its TP shards. Losses of all 4 steps and the exported adapter equal the reference's.

Tolerances: the runs use AdamW with eps=1 (see lora_lightning_run.config: linear in the gradient), so the layouts
differ only by fp32 summation order, ~1e-7 relative; rtol 1e-5 on the losses and atol 1e-6 on adapter values of
size ~1e-2 leave ample margin on any x86 host."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import warm_cli
import torch
import lightning.pytorch as pl
from safetensors.torch import load_file

from nxdt.lightning.datamodule import NxDDataModule
from nxdt.lightning.module import CausalLMModule
from nxdt.lightning.optim import build_optimizer
from nxdt.lightning.peft_export import peft_key
from nxdt.models.lora import lora_state_dict

sys.path.insert(0, str(Path(__file__).parent))
from lora_lightning_run import PEFT, config  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
SCRIPT = Path(__file__).parent / "lora_lightning_run.py"


def run(layout: str, out: Path, steps: int, resume: Path | None = None) -> dict[int, float]:
    out.mkdir()
    # both layouts take 2 ranks; they fork the suite's pre-imported process as torchrun's workers (tests/warm_cli.py)
    args = [layout, str(out), str(steps), *([str(resume)] if resume else [])]
    result = warm_cli.torchrun(SCRIPT, args, nproc=2, cwd=out, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    return {int(k): v for k, v in json.loads((out / "losses.json").read_text()).items()}


def reference(steps: int) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """The same training in this process: one model, the whole global batch, micro-batches of one row."""
    cfg = config(steps)
    pl.seed_everything(cfg.seed, verbose=False)
    module = CausalLMModule(cfg.model, cfg.data.global_batch_size, cfg.data.seq_length, cfg.data.micro_batch_size, peft=PEFT)
    model = module.model
    opt = build_optimizer(model, cfg.model.optim)
    data = NxDDataModule(cfg.data, seed=cfg.seed, vocab_size=cfg.model.vocab_size, step_batches=True)
    data.setup("fit")
    batches = iter(data.train_dataloader())
    losses = {}
    for step in range(1, steps + 1):
        batch = next(batches)
        opt.zero_grad()
        total = 0.0
        for ids, labels in zip(batch["input_ids"].split(1), batch["labels"].split(1)):
            loss = model.loss_fn(model(ids), labels) / len(batch["input_ids"])
            loss.backward()
            total += loss.item()
        opt.step()
        losses[step] = total
    return losses, lora_state_dict(model)


def test_fsdp2_adapters_only_checkpoint_resumed_on_tp2_matches_one_process(tmp_path):
    fsdp = run("fsdp2", tmp_path / "fsdp2", 2)
    ckpt = tmp_path / "fsdp2" / "ckpt"
    saved = load_file(str(ckpt / "model.safetensors"))
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved), sorted(saved)[:5]  # adapters alone
    assert json.loads((ckpt / "meta.json").read_text())["adapters_only"] is True
    tp = run("tp2", tmp_path / "tp2", 4, resume=ckpt)
    want, adapters = reference(4)
    got = {**fsdp, **tp}
    assert sorted(got) == [1, 2, 3, 4]
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-5), (step, got, want)
    exported = load_file(str(tmp_path / "tp2" / "adapter" / "adapter_model.safetensors"))
    assert set(exported) == {peft_key(n) for n in adapters}
    for name, value in adapters.items():
        assert value.abs().max() > 0  # trained (B starts at zero)
        torch.testing.assert_close(exported[peft_key(name)], value, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
    config_json = json.loads((tmp_path / "tp2" / "adapter" / "adapter_config.json").read_text())
    assert (config_json["r"], config_json["lora_alpha"]) == (PEFT["lora_rank"], PEFT["lora_alpha"])
