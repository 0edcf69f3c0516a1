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
    return name[len("model.") :] if name.startswith("model.") else name


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
                    raise ValueError(
                        f"model.hf_checkpoint={directory}: tensor {key} has no counterpart in {type(model).__name__}"
                    )
                tensor = fh.get_tensor(key)
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise ValueError(
                        f"model.hf_checkpoint={directory}: {key} has shape {list(tensor.shape)}, the configured model "
                        f"expects {list(params[name].shape)} — make the model config match the checkpoint's config.json"
                    )
                params[name].copy_(tensor)
                seen.add(name)
    missing = sorted(set(params) - seen - {"lm_head.weight"} if getattr(model, "tied", False) else set(params) - seen)
    if missing:
        raise ValueError(f"model.hf_checkpoint={directory}: missing tensors {missing[:4]}{' …' if len(missing) > 4 else ''}")


def export_hf(checkpoint: str | Path, out: str | Path, *, merge: bool = False, base: str | Path | None = None) -> Path:
    """Write a full HF-named ``model.safetensors`` (+ ``config.json``) from an nxdt checkpoint directory (the model
    part of the consolidated full state, :func:`nxdt.lightning.reshard.read_full_state`). A LoRA checkpoint exports as
    :func:`nxdt.lightning.lora_checkpoint.export_lora_checkpoint` says: a PEFT adapter directory, or with ``merge`` a
    full model with the adapters merged (``base``: the Hugging Face directory an adapters-only checkpoint merges into)."""
    from nxdt.lightning.reshard import read_full_state  # reshard builds on this package's checkpoint module

    from nxdt.lightning.checkpoint import CheckpointError, refuse_target_inside_checkpoint
    from nxdt.lightning.lora_checkpoint import lora_kind

    refuse_target_inside_checkpoint(checkpoint, out)
    _check_out(Path(out))
    if lora_kind(checkpoint) != "none":  # adapters: a PEFT adapter directory, or with merge a full model
        from nxdt.lightning.lora_checkpoint import export_lora_checkpoint

        try:
            return export_lora_checkpoint(checkpoint, out, merge=merge, base=base)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
    if merge or base is not None:
        raise CheckpointError(f"checkpoint {checkpoint} has no LoRA adapters to merge; export it without --merge / --base")
    state = read_full_state(checkpoint, optimizer=False)
    model = {name[len(MODULE_PREFIX) :] if name.startswith(MODULE_PREFIX) else name: t for name, t in state.model.items()}
    return export_hf_state(model, state.meta, out)


def _check_out(out: Path) -> None:
    from nxdt.lightning.checkpoint import CheckpointError

    if out.is_symlink():
        raise CheckpointError(f"{out} is a symbolic link; export-hf never writes through links — name a new directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} exists and is not an empty directory — name a new directory to export to")


def export_hf_state(model: dict[str, torch.Tensor], meta: dict[str, Any], out: str | Path) -> Path:
    """Write ``OUT/model.safetensors`` (HF names) + ``config.json`` from a full model state by hub names (no
    ``model.`` prefix) and its checkpoint's meta (the model shape)."""
    from nxdt.lightning.checkpoint import CheckpointError

    out = Path(out)
    _check_out(out)
    full = {hf_name(name): t.contiguous() for name, t in model.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    # written into a fresh private directory beside the target, then renamed into place: nothing is written
    # through a link planted in the target meanwhile, and a crash leaves no half export under the target's name
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        save_file(full, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(_hf_config(meta.get("model", {})), indent=2))
        if out.is_dir() and not out.is_symlink():
            out.rmdir()  # empty (checked above); rename will not replace a directory on every platform
        os.rename(staging, out)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"could not export to {out}: {exc.strerror or exc}") from None
    return out / "model.safetensors"


def _hf_config(model: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model.get("vocab_size"),
        "hidden_size": model.get("hidden_size"),
        "num_hidden_layers": model.get("num_layers"),
        "num_attention_heads": model.get("num_attention_heads"),
        "num_key_value_heads": model.get("num_kv_heads"),
        "intermediate_size": model.get("ffn_hidden_size"),
        "torch_dtype": "float32",
    }


# safetensors dtypes a float parameter can be loaded from (copy_ converts them); anything else is not weights
LOADABLE_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_ITEM_BYTES = {
    **LOADABLE_DTYPES,
    "I64": 8,
    "U64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit


class HFCheckpointError(ValueError):
    """A ``model.hf_checkpoint`` the workers could not load: ``fix`` is the one-line reason and remedy."""

    def __init__(self, fix: str) -> None:
        self.fix = fix
        super().__init__(fix)


def read_safetensors_header(file: Path) -> dict[str, Any]:
    """``{name: {"dtype", "shape", "data_offsets"}}`` of one safetensors file from its 8-byte length and JSON header
    alone (no tensor data is read); the offsets are checked against the file's size (a truncated file fails here)."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise HFCheckpointError(f"{file.name} is {size} bytes, too short for a safetensors header; the file is damaged")
        length = int.from_bytes(prefix, "little")
        if not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
            raise HFCheckpointError(
                f"{file.name} does not start with a safetensors header (header length {length}, file "
                f"{size} bytes); the file is damaged or not safetensors"
            )
        raw = fh.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise HFCheckpointError(f"{file.name}'s safetensors header is not JSON; the file is damaged") from None
    if not isinstance(header, dict):
        raise HFCheckpointError(f"{file.name}'s safetensors header is not a JSON object; the file is damaged")
    header.pop("__metadata__", None)
    end = 0
    for name, entry in header.items():
        ok = (
            isinstance(entry, dict)
            and entry.get("dtype") in _ITEM_BYTES
            and isinstance(entry.get("shape"), list)
            and all(isinstance(d, int) and d >= 0 for d in entry["shape"])
            and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2
            and all(isinstance(o, int) for o in entry["data_offsets"])
        )
        if ok:
            begin, stop = entry["data_offsets"]
            count = 1
            for d in entry["shape"]:
                count *= d
            ok = 0 <= begin <= stop and stop - begin == count * _ITEM_BYTES[entry["dtype"]]
        if not ok:
            raise HFCheckpointError(
                f"{file.name}: the header's entry for {name} is malformed (dtype, shape, offsets); the file is damaged"
            )
        end = max(end, entry["data_offsets"][1])
    if 8 + length + end != size:
        raise HFCheckpointError(
            f"{file.name} is {size} bytes, its header describes {8 + length + end}; the file is "
            f"{'truncated' if 8 + length + end > size else 'damaged'}"
        )
    return header


def check_hf_checkpoint(directory: str | Path, expected: dict[str, tuple[int, ...]], tied: bool = False) -> int:
    """The launcher's check of ``model.hf_checkpoint`` against the configured model's parameter shapes
    (``expected``: our names → shapes, e.g. from the model built on the ``meta`` device): every file's header
    whole, every tensor known, of the expected shape and a float dtype, none missing — what
    :func:`load_hf_weights` would find only in the workers. Reads headers only. Returns the tensors checked."""
    files = sorted(Path(directory).expanduser().glob("*.safetensors"))
    if not files:
        raise HFCheckpointError("no *.safetensors files there; give a Hugging Face model directory saved with safetensors")
    seen: dict[str, str] = {}
    for file in files:
        try:
            header = read_safetensors_header(file)
        except OSError as exc:
            raise HFCheckpointError(f"cannot read {file.name}: {exc.strerror or exc}") from None
        for key, entry in header.items():
            name = our_name(key)
            if name not in expected:
                raise HFCheckpointError(
                    f"{file.name}: tensor {key} has no counterpart in the configured model "
                    f"({'its head is tied to the embedding; set model.tie_word_embeddings=false' if tied and name == 'lm_head.weight' else 'make model.architecture and the model config match the checkpoint'})"
                )
            if name in seen:
                raise HFCheckpointError(f"tensor {key} is in both {seen[name]} and {file.name}; give one copy of each tensor")
            seen[name] = file.name
            if tuple(entry["shape"]) != tuple(expected[name]):
                raise HFCheckpointError(
                    f"{file.name}: {key} has shape {entry['shape']}, the configured model expects "
                    f"{list(expected[name])}; make the model config match the checkpoint's config.json"
                )
            if entry["dtype"] not in LOADABLE_DTYPES:
                raise HFCheckpointError(
                    f"{file.name}: {key} is {entry['dtype']}, not floating-point weights (loadable: "
                    f"{', '.join(LOADABLE_DTYPES)}); give an unquantized checkpoint"
                )
    missing = sorted(set(expected) - set(seen))
    if missing:
        raise HFCheckpointError(
            f"missing tensors {', '.join(hf_name(m) for m in missing[:4])}{' …' if len(missing) > 4 else ''} "
            f"({len(missing)} of {len(expected)}); give the complete checkpoint, or a model config of its shape"
        )
    return len(seen)
