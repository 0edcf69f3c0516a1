"""Hugging Face checkpoint interop for the model hub's Llama-family models.

Our parameter names are Hugging Face's without its ``model.`` prefix (``lm_head`` has none), so:

* import: ``model.hf_checkpoint=DIR`` loads ``DIR/*.safetensors`` into the full model on every rank before
  tensor/pipeline parallelism slices it — any layout starts from the same weights;
* export: ``nxdt checkpoint export-hf CKPT OUT`` reassembles a (TP × PP sharded) nxdt checkpoint into full
  tensors — TP shards concatenated along the dimension recorded in ``meta.json``'s ``tensor_parallel``
  layout, PP stages merged by name — and writes ``OUT/model.safetensors`` with HF names plus a
  ``config.json``. Importing, training zero effective steps and exporting returns the original bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn


MODULE_PREFIX = "model."  # CausalLMModule holds the hub model as `model`


def hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def our_name(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


@torch.no_grad()
def load_hf_weights(model: nn.Module, directory: str | Path) -> None:
    """Copy every tensor of a HF safetensors checkpoint into ``model`` (names and shapes must match exactly)."""
    files = sorted(Path(directory).expanduser().glob("*.safetensors"))
    if not files:
        raise ValueError(f"model.hf_checkpoint={directory}: no *.safetensors files")
    params = dict(model.named_parameters())
    seen = set()
    for file in files:
        with safe_open(str(file), "pt") as fh:
            for key in fh.keys():
                name = our_name(key)
                if name not in params:
                    raise ValueError(f"model.hf_checkpoint={directory}: tensor {key} has no counterpart in {type(model).__name__}")
                tensor = fh.get_tensor(key)
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise ValueError(f"model.hf_checkpoint={directory}: {key} has shape {list(tensor.shape)}, the configured model "
                                     f"expects {list(params[name].shape)} — make the model config match the checkpoint's config.json")
                params[name].copy_(tensor)
                seen.add(name)
    missing = sorted(set(params) - seen - {"lm_head.weight"} if getattr(model, "tied", False) else set(params) - seen)
    if missing:
        raise ValueError(f"model.hf_checkpoint={directory}: missing tensors {missing[:4]}{' …' if len(missing) > 4 else ''}")


def export_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """Write a full HF-named ``model.safetensors`` (+ ``config.json``) from an nxdt checkpoint directory (the model
    part of the consolidated full state, :func:`nxdt.lightning.reshard.read_full_state`)."""
    from nxdt.lightning.reshard import read_full_state  # reshard builds on this package's checkpoint module

    from nxdt.lightning.checkpoint import CheckpointError

    out = Path(out)
    if out.is_symlink():
        raise CheckpointError(f"{out} is a symbolic link; export-hf never writes through links — name a new directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} exists and is not an empty directory — name a new directory to export to")
    state = read_full_state(checkpoint, optimizer=False)
    full = {hf_name(name[len(MODULE_PREFIX):] if name.startswith(MODULE_PREFIX) else name): t.contiguous()
            for name, t in state.model.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    # written into a fresh private directory beside the target, then renamed into place: nothing is written
    # through a link planted in the target meanwhile, and a crash leaves no half export under the target's name
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        save_file(full, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(_hf_config(state.meta.get("model", {})), indent=2))
        if out.is_dir() and not out.is_symlink():
            out.rmdir()  # empty (checked above); rename will not replace a directory on every platform
        os.rename(staging, out)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"could not export to {out}: {exc.strerror or exc}") from None
    return out / "model.safetensors"


def _hf_config(model: dict[str, Any]) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": model.get("vocab_size"),
            "hidden_size": model.get("hidden_size"), "num_hidden_layers": model.get("num_layers"),
            "num_attention_heads": model.get("num_attention_heads"), "num_key_value_heads": model.get("num_kv_heads"),
            "intermediate_size": model.get("ffn_hidden_size"), "torch_dtype": "float32"}
