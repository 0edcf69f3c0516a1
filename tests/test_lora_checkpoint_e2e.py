"""LoRA checkpoints through ``nxdt train`` (+recipe=lora: llama_tiny cut to 2 layers, the shipped instruction set,
adapters on q/k/v and o_proj, rank 8, alpha 16), the base weights from a Hugging Face directory written here.
Three launches, each checked for several things:

* TP2 with ``merge_lora`` (and save_lora_base): every checkpoint holds W' = W + (alpha/r)·B·A merged on each rank's
  shards and no adapters; ``export-hf`` gives a Hugging Face model whose adapted weights equal base + scale·B·A
  computed here from the base directory and the checkpoint's own PEFT adapter (gathered over TP independently of the
  merge), whose other weights are the base's bit for bit, and whose logits equal the adapter model's; starting from
  it (weight_init_only) puts fresh adapters on the merged weights; resuming it as a LoRA run is refused by name before
  any worker starts;
* one rank, adapters only (save_lora_base false): ``export-hf`` writes a PEFT adapter directory, ``export-hf --merge``
  asks for ``--base`` and with it writes the merged model, ``consolidate`` keeps the adapters-only checkpoint whole;
  a run asking for another rank is refused by name;
* ``load_lora_from_ckpt`` + ``weight_init_only`` from that adapters-only checkpoint (base: model.hf_checkpoint) at
  lr 0: a new run at step 1 whose adapters are the checkpoint's, bit for bit.

Tolerances as tests/test_lora_checkpoint.py: the fp32 fold differs from the float64 reference by a few ulps
(atol 1e-6 on weights of size ≤ 0.2); logits through 2 layers differ by fp32 summation order (atol 1e-5).
"""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest
import warm_cli
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RANK, ALPHA = 8, 16.0  # conf/recipe/lora.yaml
LAYERS = ["model.num_layers=2"]
COMMON = [
    "+recipe=lora",
    *LAYERS,
    "exp_manager.create_tensorboard_logger=false",
    "comm.timeout_s=60",
    "exp_manager.checkpoint_every_n_steps=2",
    "trainer.max_steps=2",
    "model.optim.lr=5e-2",
]


def nxdt(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return warm_cli.run([*args], cwd=cwd, timeout=240)


def trained(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"


def refused(result: subprocess.CompletedProcess, needle: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and needle in lines[0], result.stderr[-2000:]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The base model: the hub's llama_tiny (2 layers) of seed 3, exported as a Hugging Face directory."""
    from nxdt.config import compose_config
    from nxdt.config.hf_model import model_meta
    from nxdt.lightning.hf import export_hf_state
    from nxdt.lightning.module import import_architecture

    root = tmp_path_factory.mktemp("lora_ckpt")
    cfg = compose_config(["+recipe=lora", *LAYERS])
    torch.manual_seed(3)
    model = import_architecture(cfg.model.architecture)(cfg.model)
    export_hf_state(dict(model.state_dict()), {"model_config": model_meta(cfg.model), "tokenizer": None}, root / "base")
    return root


def base_weights(root: Path) -> dict[str, torch.Tensor]:
    from nxdt.lightning.hf import our_name

    return {our_name(k): v for k, v in load_file(str(root / "base" / "model.safetensors")).items()}


def peft_adapters(directory: Path) -> dict[str, torch.Tensor]:
    """A PEFT adapter file's tensors by hub-model module name (``layers.0.self_attn.q_proj.lora_A.weight``)."""
    from nxdt.lightning.hf import our_name
    from nxdt.lightning.peft_export import PEFT_PREFIX

    return {our_name(k[len(PEFT_PREFIX) :]): v for k, v in load_file(str(directory / "adapter_model.safetensors")).items()}


def check_merged(exported: dict[str, torch.Tensor], base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor]) -> int:
    """Each adapted weight equals base + (alpha/r)·B·A (float64 here); every other weight is the base's bit for bit."""
    adapted = {n[: -len(".lora_A.weight")] for n in adapters if n.endswith(".lora_A.weight")}
    for name, w in base.items():
        prefix = name[: -len(".weight")]
        if prefix in adapted:
            b, a = adapters[f"{prefix}.lora_B.weight"].double(), adapters[f"{prefix}.lora_A.weight"].double()
            assert b.abs().max() > 0, prefix  # trained: B starts at zero
            want = w.double() + (ALPHA / RANK) * torch.einsum("or,ri->oi", b, a)
            torch.testing.assert_close(exported[name].double(), want, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
        else:
            assert torch.equal(exported[name], w), name
    return len(adapted)


def test_tp2_merge_lora_checkpoints_hold_base_plus_scaled_b_a(root):
    from nxdt.config import compose_config
    from nxdt.lightning.hf import load_hf_weights
    from nxdt.lightning.lora_checkpoint import lora_kind
    from nxdt.lightning.module import import_architecture
    from nxdt.models.lora import apply_lora

    run = root / "tp2-merged"
    trained(
        nxdt(
            "train",
            *COMMON,
            "trainer.devices=2",
            "distributed_strategy.tensor_model_parallel_size=2",
            "model_alignment_strategy.peft.save_lora_base=true",
            "model_alignment_strategy.peft.merge_lora=true",
            f"model.hf_checkpoint={root / 'base'}",
            f"exp_manager.explicit_log_dir={run}",
            cwd=root,
        )
    )
    ckpt = run / "checkpoints" / "step-2"
    assert lora_kind(ckpt) == "merged"
    shards = [load_file(str(f)) for f in sorted(ckpt.glob("model*.safetensors"))]
    assert len(shards) == 2 and not [n for s in shards for n in s if ".lora_" in n]
    assert json.loads((ckpt / "meta.json").read_text())["lora"]["merged"] is True
    trained(nxdt("checkpoint", "export-hf", str(ckpt), str(root / "tp2-hf"), cwd=root))
    from nxdt.lightning.hf import our_name

    exported = {our_name(k): v for k, v in load_file(str(root / "tp2-hf" / "model.safetensors")).items()}
    adapters = peft_adapters(ckpt)  # save_lora_config_adapter: gathered over TP by the strategy, not by the merge
    assert check_merged(exported, base_weights(root), adapters) == 2 * 4  # q, k, v, o of 2 layers
    # the merged model computes what the adapter model computes
    cfg = compose_config(["+recipe=lora", *LAYERS])
    build = import_architecture(cfg.model.architecture)
    merged = build(cfg.model).eval()
    load_hf_weights(merged, root / "tp2-hf", cfg.model.architecture)
    lora = build(cfg.model)
    load_hf_weights(lora, root / "base", cfg.model.architecture)
    apply_lora(lora, rank=RANK, alpha=ALPHA, target_modules=["qkv_proj", "o_proj"])
    missing, unexpected = lora.load_state_dict(adapters, strict=False)
    assert not unexpected and not [m for m in missing if ".lora_" in m]
    ids = torch.randint(0, cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), lora.eval()(ids), rtol=1e-5, atol=1e-5)
    # starting from it (model.weight_init_only) gives fresh adapters on the merged weights: the function is unchanged
    from nxdt.lightning.module import CausalLMModule

    again = CausalLMModule(
        cfg.model,
        8,
        128,
        2,
        init_checkpoint=str(ckpt),
        peft={"lora_rank": RANK, "lora_alpha": ALPHA, "target_modules": ["qkv_proj", "o_proj"]},
    ).model.eval()
    assert torch.equal(again.layers[0].self_attn.q_proj.base_layer.weight, exported["layers.0.self_attn.q_proj.weight"])
    with torch.no_grad():
        torch.testing.assert_close(again(ids), merged(ids), rtol=1e-6, atol=1e-6)  # B = 0: exactly the merged model
    # a merged checkpoint cannot resume the LoRA run: refused before any worker starts
    refused(
        nxdt(
            "train",
            *COMMON,
            "model_alignment_strategy.peft.save_lora_base=true",
            f"exp_manager.resume_from_checkpoint={ckpt}",
            f"exp_manager.explicit_log_dir={root / 'refused'}",
            cwd=root,
        ),
        "holds a LoRA run's adapters merged into its base (merge_lora), which cannot resume LoRA training",
    )


@pytest.fixture(scope="module")
def adapters_only(root) -> Path:
    run = root / "adapters-only"
    trained(
        nxdt(
            "train",
            *COMMON,
            "trainer.devices=1",
            f"model.hf_checkpoint={root / 'base'}",
            f"exp_manager.explicit_log_dir={run}",
            cwd=root,
        )
    )
    return run / "checkpoints" / "step-2"


def checkpoint_adapters(ckpt: Path) -> dict[str, torch.Tensor]:
    return {k[len("model.") :]: v for k, v in load_file(str(ckpt / "model.safetensors")).items()}


def test_an_adapters_only_checkpoint_exports_as_a_peft_adapter_or_merged_onto_its_base(root, adapters_only):
    from nxdt.lightning.hf import our_name
    from nxdt.lightning.lora_checkpoint import lora_kind

    ckpt = adapters_only
    assert lora_kind(ckpt) == "adapters_only"
    saved = checkpoint_adapters(ckpt)
    assert saved and all(".lora_" in n for n in saved)
    trained(nxdt("checkpoint", "export-hf", str(ckpt), str(root / "peft"), cwd=root))
    config = json.loads((root / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((root / "base").resolve())  # the run's model.hf_checkpoint
    assert (config["peft_type"], config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (
        "LORA",
        RANK,
        ALPHA,
        ["k_proj", "o_proj", "q_proj", "v_proj"],
    )
    exported = peft_adapters(root / "peft")
    assert exported.keys() == saved.keys() and all(torch.equal(exported[n], saved[n]) for n in saved)
    refused(
        nxdt("checkpoint", "export-hf", "--merge", str(ckpt), str(root / "no-base"), cwd=root),
        "holds the adapters alone (save_lora_base false): give the base model to merge them into with --base HF_DIR",
    )
    trained(nxdt("checkpoint", "export-hf", str(ckpt), str(root / "merged"), "--merge", "--base", str(root / "base"), cwd=root))
    merged = {our_name(k): v for k, v in load_file(str(root / "merged" / "model.safetensors")).items()}
    assert check_merged(merged, base_weights(root), saved) == 2 * 4
    # --base: the merged model is the base's model, and its config.json is the base's, field for field
    base_config = json.loads((root / "base" / "config.json").read_text())
    assert json.loads((root / "merged" / "config.json").read_text()) == base_config
    trained(nxdt("checkpoint", "consolidate", str(ckpt), str(root / "consolidated"), cwd=root))
    assert json.loads((root / "consolidated" / "meta.json").read_text())["adapters_only"] is True
    whole = checkpoint_adapters(root / "consolidated")
    assert whole.keys() == saved.keys() and all(torch.equal(whole[n], saved[n]) for n in saved)


def test_load_lora_from_ckpt_continues_from_the_adapters_and_refuses_another_rank(root, adapters_only):
    start = [
        f"exp_manager.resume_from_checkpoint={adapters_only}",
        "model.weight_init_only=true",
        "model_alignment_strategy.peft.load_lora_from_ckpt=true",
        f"model.hf_checkpoint={root / 'base'}",
    ]
    refused(
        nxdt(
            "train",
            *COMMON,
            *start,
            "model_alignment_strategy.peft.lora_rank=4",
            f"exp_manager.explicit_log_dir={root / 'rank4'}",
            cwd=root,
        ),
        f"model_alignment_strategy.peft.lora_rank=4: the adapters in {adapters_only} have rank 8; set lora_rank=8",
    )
    refused(
        nxdt("train", *COMMON, *start[:2], f"exp_manager.explicit_log_dir={root / 'fresh'}", cwd=root),
        "model_alignment_strategy.peft.load_lora_from_ckpt=False: ",
    )
    from nxdt.cli import check_lora_checkpoint  # the launcher's check, in this process (what the two lines above ran)
    from nxdt.config import ConfigError, compose_config

    for override, needle in [
        (
            "model_alignment_strategy.peft.target_modules=[qkv_proj]",
            "target_modules=['q_proj', 'k_proj', 'v_proj']: the adapters in ",
        ),
        ("model_alignment_strategy.peft.lora_alpha=32", "lora_alpha=32.0: the adapters in "),
    ]:
        with pytest.raises(ConfigError) as info:
            check_lora_checkpoint(compose_config(["+recipe=lora", *LAYERS, *start, override]), str(adapters_only))
        assert needle in str(info.value) and (
            "adapt ['q_proj', 'k_proj', 'v_proj', 'o_proj']" in str(info.value) or "trained with lora_alpha=16" in str(info.value)
        ), str(info.value)
    run = root / "continued"
    trained(
        nxdt(
            "train",
            *COMMON,
            *start,
            "trainer.devices=1",
            "trainer.max_steps=1",
            "exp_manager.checkpoint_every_n_steps=1",
            "model.optim.lr=0",
            "model.optim.sched.name=constant",
            f"exp_manager.explicit_log_dir={run}",
            cwd=root,
        )
    )
    with open(run / "metrics.csv", newline="") as fh:
        assert [int(r["step"]) for r in csv.DictReader(fh) if r.get("loss")] == [1]  # a new run: step 1, fresh optimizer
    saved, now = checkpoint_adapters(adapters_only), checkpoint_adapters(run / "checkpoints" / "step-1")
    assert now.keys() == saved.keys() and all(torch.equal(now[n], saved[n]) for n in saved)
