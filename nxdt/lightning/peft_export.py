"""Export a LoRA adapter (``nxdt.models.lora``) as a Hugging Face PEFT adapter directory.

``OUT/adapter_config.json`` (peft_type LORA, r, lora_alpha, lora_dropout, target_modules with HF names, bias,
task_type CAUSAL_LM, base_model_name_or_path) and ``OUT/adapter_model.safetensors`` with PEFT's keys, which
``peft.PeftModel.from_pretrained(transformers_llama, OUT)`` loads. Key mapping: an adapter's name in the hub
model, ``layers.0.self_attn.q_proj.lora_A.weight``, is HF's parameter name (:func:`nxdt.lightning.hf.hf_name`:
``model.layers.0.self_attn.q_proj.lora_A.weight``) under PEFT's wrapper prefix ``base_model.model.`` —
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (PEFT drops its adapter name, ``default``,
when saving).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import save_file
from torch import nn

from nxdt.lightning.hf import hf_name
from nxdt.models.lora import LoRAConfig, lora_state_dict

PEFT_PREFIX = "base_model.model."  # PeftModelForCausalLM → LoraModel → the transformers model
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_key(name: str) -> str:
    """PEFT's key for an adapter tensor named ``name`` in the hub model (``MODULE_PREFIX`` already removed)."""
    return PEFT_PREFIX + hf_name(name)


def peft_adapter_config(config: LoRAConfig, base_model_name_or_path: str | None = None) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "bias": config.bias,
        "target_modules": list(config.hf_target_modules),
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def peft_adapter_state(adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors by hub-model name (``lora_state_dict``, or full tensors gathered from TP shards) → by PEFT key."""
    biases = [name for name in adapters if ".lora_A." not in name and ".lora_B." not in name]
    if biases:
        raise ValueError(f"PEFT export: trainable bias tensors {biases[:3]} are not exported yet; train with lora bias=none")
    return {peft_key(name): t.detach().contiguous().cpu() for name, t in adapters.items()}


def export_peft_adapter(
    model: nn.Module,
    out: str | Path,
    *,
    base_model_name_or_path: str | None = None,
    adapters: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``out/adapter_config.json`` and ``out/adapter_model.safetensors`` for ``model`` (a hub model after
    :func:`nxdt.models.lora.apply_lora`). ``adapters`` overrides the tensors (e.g. full ones gathered from
    tensor-parallel shards); by default :func:`lora_state_dict`. ``out`` must not exist or be an empty
    directory; it is written beside and renamed into place (no half export under its name)."""
    config = getattr(model, "lora_config", None)
    if not isinstance(config, LoRAConfig):
        raise ValueError(f"{type(model).__name__} has no LoRA adapters (apply_lora first)")
    return write_peft_adapter(
        config, lora_state_dict(model) if adapters is None else adapters, out, base_model_name_or_path=base_model_name_or_path
    )


def write_peft_adapter(
    config: LoRAConfig, adapters: Mapping[str, torch.Tensor], out: str | Path, *, base_model_name_or_path: str | None = None
) -> Path:
    """The PEFT adapter directory of full adapter tensors by hub-model name (e.g. read from a checkpoint) and their
    config; ``out`` as :func:`export_peft_adapter`. Returns ``out``."""
    tensors = peft_adapter_state(adapters)
    out = Path(out)
    if out.is_symlink():
        raise ValueError(f"{out} is a symbolic link; name a new directory to export the adapter to")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory — name a new directory to export the adapter to")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        save_file(tensors, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (staging / ADAPTER_CONFIG).write_text(json.dumps(peft_adapter_config(config, base_model_name_or_path), indent=2))
        if out.is_dir():
            out.rmdir()
        os.rename(staging, out)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise ValueError(f"could not export the adapter to {out}: {exc.strerror or exc}") from None
    return out
