"""LoRA checkpoints: what one holds, merging on save (``merge_lora``), continuing from one (``load_lora_from_ckpt``)
and exporting one (``nxdt checkpoint export-hf``).

A checkpoint of a LoRA run is one of three kinds (:func:`lora_kind`), read from its model files' tensor names:

* ``with_base``     — ``save_lora_base`` true: the frozen base (``X.base_layer.weight``) and the adapters
  (``X.lora_A.weight``, ``X.lora_B.weight``); resumable on any layout;
* ``adapters_only`` — ``save_lora_base`` false: the adapters alone (meta ``adapters_only``); resuming takes the base
  from the model as built (``model.hf_checkpoint``, or the same seed);
* ``merged``        — ``merge_lora`` true (NxD's "save_lora_base and merge_lora"): each adapted weight holds
  W' = W + (alpha/r)·B·A under its base name (``X.base_layer.weight``), the adapters are not stored. Merged on each
  rank's own shards: under tensor parallelism the product of a rank's shards of B and A is its shard of B·A (column-
  parallel base: B's rows × the whole A = those rows of B·A; row-parallel base: the whole B × A's columns = those
  columns), so W' is split exactly like W and the checkpoint's layout entries stay right. A merged checkpoint is a
  model to deploy or to start from (``model.weight_init_only``: W' becomes the base of fresh adapters, as NxD loads
  it) — it cannot resume the LoRA training that wrote it (its adapters are folded in), which is refused by name.

Exports (:func:`export_lora_checkpoint`): a Hugging Face PEFT adapter directory (adapter_config.json +
adapter_model.safetensors) from ``with_base`` / ``adapters_only``; a full Hugging Face model with the adapters merged
(``merge=True``: the base from the checkpoint, or for ``adapters_only`` from a Hugging Face directory, ``base=``);
a ``merged`` checkpoint exports as a plain model. The adapter's lora_alpha is read from the checkpoint's meta.json
(``lora``, written by ``nxdt train``) or its own adapter_config.json (``save_lora_config_adapter``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from nxdt.lightning.checkpoint import CheckpointError, read_meta, read_small_file
from nxdt.models.lora import HF_TARGETS, LoRAConfig

LORA_META_KEY = "lora"  # meta.json: the adapters' config (rank, alpha, dropout, bias, target_modules), and merged
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
BASE_MARK = ".base_layer."
KINDS = ("none", "with_base", "adapters_only", "merged")


def lora_meta(config: LoRAConfig, merged: bool = False) -> dict[str, Any]:
    """What a checkpoint's meta.json records of its adapters (``nxdt train`` adds it to every checkpoint)."""
    return {
        "rank": config.rank,
        "alpha": config.alpha,
        "dropout": config.dropout,
        "bias": config.bias,
        "target_modules": list(config.hf_target_modules),
        "merged": merged,
    }


@torch.no_grad()
def merged_state_dict(state: Mapping[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """``merge_lora`` on a model file's tensors (any rank's shards, any name prefix): each ``X.base_layer.weight``
    becomes W + scaling·B·A (fp32 product, the base's dtype) under the same name, the adapter tensors are dropped."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(ADAPTER_SUFFIXES):
            continue
        prefix, sep, rest = name.partition(BASE_MARK)
        if sep and rest == "weight":
            a, b = state.get(f"{prefix}.lora_A.weight"), state.get(f"{prefix}.lora_B.weight")
            if a is None or b is None:
                raise ValueError(f"merge_lora: {name} has no lora_A / lora_B tensors beside it")
            if (b.shape[0], a.shape[1]) != tuple(tensor.shape):
                raise ValueError(
                    f"merge_lora: {name} has shape {list(tensor.shape)} but its adapters' B·A has "
                    f"{[b.shape[0], a.shape[1]]}: the base model does not match the adapters"
                )
            tensor = tensor + ((b.float() @ a.float()) * scaling).to(tensor.dtype)
        out[name] = tensor
    return out


def plain_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A merged model's tensors under the names of the model without adapters (``.base_layer.`` dropped)."""
    return {name.replace(BASE_MARK, "."): t for name, t in state.items() if not name.endswith(ADAPTER_SUFFIXES)}


# ---------------------------------------------------------------------------------------------- reading a checkpoint
def _model_headers(root: Path) -> dict[str, list[int]]:
    """Tensor name → shape over the checkpoint's model files (safetensors headers only; no tensor is read)."""
    from nxdt.lightning.hf import read_safetensors_header

    shapes: dict[str, list[int]] = {}
    for file in sorted(root.glob("model*.safetensors")):
        try:
            header = read_safetensors_header(file)
        except ValueError as exc:  # damaged: say so in the checkpoint tools' terms
            raise CheckpointError(f"checkpoint {root}: {exc} (nxdt checkpoint verify {root} lists every problem)") from None
        for name, entry in header.items():
            if name != "__metadata__":
                shapes.setdefault(name, entry["shape"])
    return shapes


def lora_kind(path: str | Path) -> str:
    """none | with_base | adapters_only | merged (see the module docstring), from the model files' tensor names."""
    root = Path(path)
    names = _model_headers(root)
    adapters = any(n.endswith(ADAPTER_SUFFIXES) for n in names)
    based = any(BASE_MARK in n for n in names)
    if read_meta(root).get("adapters_only"):
        return "adapters_only"
    if based and not adapters:
        return "merged"
    return "with_base" if adapters else "none"


def adapter_shape(path: str | Path) -> tuple[int, tuple[str, ...]]:
    """(rank, adapted projection names in HF's canonical order) of a checkpoint's adapters, from its headers."""
    names = _model_headers(Path(path))
    ranks = {shape[0] for n, shape in names.items() if n.endswith(".lora_A.weight")}
    leaves = {n[: -len(".lora_A.weight")].rpartition(".")[2] for n in names if n.endswith(".lora_A.weight")}
    if len(ranks) != 1:
        raise CheckpointError(f"checkpoint {path}: its adapters have ranks {sorted(ranks)}; one rank is expected")
    return ranks.pop(), tuple(t for t in HF_TARGETS if t in leaves)


def checkpoint_lora_config(path: str | Path) -> dict[str, Any] | None:
    """The adapters' config recorded with a checkpoint: meta.json's ``lora`` (nxdt train), else its PEFT
    adapter_config.json (save_lora_config_adapter) in nxdt's terms; None when neither is there."""
    root = Path(path)
    recorded = read_meta(root).get(LORA_META_KEY)
    if isinstance(recorded, dict):
        return recorded
    adapter = root / "adapter_config.json"
    if adapter.is_file():
        try:
            peft = json.loads(read_small_file(adapter))  # a checkpoint's file: size-capped, no link followed
            return {
                "rank": int(peft["r"]),
                "alpha": float(peft["lora_alpha"]),
                "dropout": float(peft.get("lora_dropout", 0.0)),
                "bias": peft.get("bias", "none"),
                "target_modules": list(peft["target_modules"]),
                "merged": False,
            }
        except (OSError, ValueError, KeyError, TypeError):
            raise CheckpointError(f"{adapter}: not a readable PEFT adapter config") from None
    return None


def check_adapters_fit(path: str | Path, rank: int, alpha: float, targets: tuple[str, ...]) -> tuple[str, Any, str] | None:
    """Why the adapters in ``path`` cannot continue as a LoRA run of ``rank`` / ``alpha`` / HF ``targets``: (the peft key
    to change, its value, the reason and fix), or None when they fit."""
    theirs_rank, theirs_targets = adapter_shape(path)
    if theirs_rank != rank:
        return "lora_rank", rank, f"the adapters in {path} have rank {theirs_rank}; set lora_rank={theirs_rank}"
    if theirs_targets != tuple(targets):
        return (
            "target_modules",
            list(targets),
            f"the adapters in {path} adapt {list(theirs_targets)}; set target_modules to match",
        )
    recorded = checkpoint_lora_config(path)
    if recorded is not None and float(recorded["alpha"]) != float(alpha):
        return "lora_alpha", alpha, f"the adapters in {path} were trained with lora_alpha={recorded['alpha']:g}; set it"
    return None


# ---------------------------------------------------------------------------------------------- export
def _full_model(path: Path) -> dict[str, torch.Tensor]:
    from nxdt.lightning.reshard import MODULE_PREFIX, read_full_state

    full = read_full_state(path, optimizer=False).model
    return {n[len(MODULE_PREFIX) :] if n.startswith(MODULE_PREFIX) else n: t for n, t in full.items()}


def _base_from_hf(directory: str | Path, architecture: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from nxdt.lightning.hf import adapter_for

    adapter = adapter_for(architecture)
    files = sorted(Path(directory).expanduser().glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"--base {directory}: no *.safetensors files there; give the Hugging Face model directory the "
            "run started from (its model.hf_checkpoint)"
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update({name: v for k, v in load_file(str(file)).items() if (name := adapter.canonical(k)) is not None})
    return adapter.from_hf(state)


def run_hf_base(checkpoint: Path) -> str | None:
    """The Hugging Face directory the checkpoint's run took its base weights from (its config.yaml's
    ``model.hf_checkpoint``, ``RUN/checkpoints/step-N`` → ``RUN/config.yaml``), as PEFT's ``base_model_name_or_path``;
    None when the base was not a Hugging Face model or the checkpoint was moved out of its run."""
    from nxdt.config import ConfigError, load_run_config

    run_config = checkpoint.resolve().parent.parent / "config.yaml"
    try:
        base = load_run_config(run_config).model.hf_checkpoint if run_config.is_file() else None
    except ConfigError:
        return None
    return str(Path(base).expanduser().resolve()) if base else None


def export_lora_checkpoint(
    path: str | Path, out: str | Path, *, merge: bool = False, base: str | Path | None = None, dtype: str = "fp32"
) -> Path:
    """``nxdt checkpoint export-hf`` of a LoRA checkpoint (see the module docstring); returns the file written. A
    merged export is a Hugging Face model directory as :func:`nxdt.lightning.hf.export_hf_state` writes it (with
    ``base``: the base's config.json, generation config and tokenizer kept)."""
    from nxdt.lightning.hf import export_hf_state, export_source
    from nxdt.lightning.peft_export import write_peft_adapter

    root = Path(path)
    kind = lora_kind(root)
    if kind == "none":
        raise CheckpointError(f"checkpoint {root} has no LoRA adapters; export it without --merge / --base")
    if kind == "merged":
        if base is not None:
            raise CheckpointError(f"checkpoint {root} holds the adapters merged into its base already (merge_lora); drop --base")
        return export_hf_state(plain_names(_full_model(root)), export_source(root), out, dtype=dtype)
    if base is not None and kind == "with_base":
        raise CheckpointError(f"checkpoint {root} holds its base weights (save_lora_base); drop --base")
    if base is not None and not merge:
        raise CheckpointError(
            "--base is the model the adapters merge into: add --merge (without it the export is the PEFT adapter directory alone)"
        )
    config = checkpoint_lora_config(root)
    if config is None:
        raise CheckpointError(
            f"checkpoint {root} records no LoRA config (lora_alpha): write checkpoints with nxdt train or "
            "model_alignment_strategy.peft.save_lora_config_adapter=true"
        )
    if not merge and config.get("bias", "none") != "none":
        raise CheckpointError(
            f"checkpoint {root}: its adapters trained biases too (lora_bias={config['bias']}), which the "
            "PEFT export does not carry yet; export it with --merge instead"
        )
    state = _full_model(root)
    rank, targets = adapter_shape(root)
    lora = LoRAConfig(
        rank,
        float(config["alpha"]),
        float(config.get("dropout", 0.0)),
        config.get("bias", "none"),
        tuple(targets),
        tuple(targets),
    )
    if not merge:
        adapters = {n: t for n, t in state.items() if n.endswith(ADAPTER_SUFFIXES)}
        return write_peft_adapter(lora, adapters, out, base_model_name_or_path=run_hf_base(root))
    if kind == "adapters_only":
        if base is None:
            raise CheckpointError(
                f"checkpoint {root} holds the adapters alone (save_lora_base false): give the base model to "
                "merge them into with --base HF_DIR (the run's model.hf_checkpoint)"
            )
        source = export_source(root)
        hf_base = _base_from_hf(base, source["model_config"]["architecture"])
        adapted = {n[: -len(".lora_A.weight")] for n in state if n.endswith(".lora_A.weight")}
        with_base = {
            (f"{n.rpartition('.')[0]}.base_layer.weight" if n.rpartition(".")[0] in adapted and n.endswith(".weight") else n): t
            for n, t in hf_base.items()
        }
        missing = sorted(f"{p}.base_layer.weight" for p in adapted if f"{p}.base_layer.weight" not in with_base)
        if missing:
            raise CheckpointError(f"--base {base}: no weights for the adapted layers {missing[:3]}; give the run's base model")
        for n, t in state.items():
            with_base[n] = t
        state = with_base
    merged = plain_names(merged_state_dict(state, lora.scaling))
    return export_hf_state(merged, export_source(root), out, dtype=dtype, base=base)
