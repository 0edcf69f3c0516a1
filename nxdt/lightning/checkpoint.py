"""Atomic directory checkpoints: ``checkpoints/step-<N>/`` written under a temporary name, completed
with a ``done`` marker, made visible by one rename, and ``latest`` updated last.

A crash at any moment leaves either the previous complete checkpoint or the new one, never a half
written directory that a resume could pick up: readers only accept directories holding ``done``.

Layout of one checkpoint directory::

    step-12/
      model.safetensors      model state (tensors only: safe to load, no pickle)
      trainer_state.pt       everything else Lightning keeps (optimizer, loops, schedulers, callbacks),
                             saved with torch.save and loaded with ``weights_only=True``
      meta.json              step, layout, format version
      done                   written last, before the rename
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 1
DONE_MARKER = "done"
LATEST_FILE = "latest"
_TMP_PREFIX = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or written; the message names the path and the fix."""


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / DONE_MARKER).is_file()


def _step_of(path: Path) -> int:
    try:
        return int(path.name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def list_complete(checkpoint_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``checkpoint_dir``, oldest first (by step)."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(_TMP_PREFIX) and is_complete(p)]
    return sorted(found, key=_step_of)


def latest_complete(checkpoint_dir: str | os.PathLike) -> Path | None:
    found = list_complete(checkpoint_dir)
    return found[-1] if found else None


def remove_incomplete(checkpoint_dir: str | os.PathLike) -> list[Path]:
    """Delete leftovers of interrupted saves (temporary directories, directories without ``done``)."""
    root = Path(checkpoint_dir)
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and (p.name.startswith(_TMP_PREFIX) or not is_complete(p)):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def _split_state(checkpoint: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    state = dict(checkpoint)
    model_state = state.pop("state_dict", {})
    # Hyper-parameters may hold arbitrary user objects; they are re-created from the config, not the
    # checkpoint, so they are not stored (keeps trainer_state.pt loadable with weights_only=True).
    for key in ("hyper_parameters", "hparams_name", "datamodule_hyper_parameters", "hparams_type"):
        state.pop(key, None)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model_state.items()}
    return tensors, state


def save(checkpoint: dict[str, Any], path: str | os.PathLike, meta: dict[str, Any] | None = None,
         before_commit: Callable[[Path], None] | None = None) -> Path:
    """Write ``checkpoint`` (a Lightning checkpoint dict) atomically to the directory ``path``.
    ``before_commit(tmp_dir)`` runs when every file is written but before the ``done`` marker (fault drills)."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{_TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    tensors, rest = _split_state(checkpoint)
    try:
        tmp.mkdir()
        # safetensors refuses tensors that share storage (tied embeddings): store each once.
        save_file(_dedupe_shared(tensors), str(tmp / "model.safetensors"))
        torch.save(rest, tmp / "trainer_state.pt")
        info = {"format_version": FORMAT_VERSION, "step": rest.get("global_step"), **(meta or {})}
        (tmp / "meta.json").write_text(json.dumps(info, indent=2))
        _fsync_dir_files(tmp)
        if before_commit is not None:
            before_commit(tmp)
        (tmp / DONE_MARKER).write_text("ok\n")
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_latest(final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"could not write checkpoint {final}: {exc.strerror or exc}; the previous checkpoint is intact "
            f"— free disk space or point exp_manager.exp_dir elsewhere"
        ) from exc
    return final


def save_sharded(checkpoint: dict[str, Any], path: str | os.PathLike, *, model_file: str | None, state_file: str | None, comm: Any,
                 meta: dict[str, Any] | None = None, before_commit: Callable[[Path], None] | None = None) -> Path:
    """Every rank of ``comm`` calls this; each writes the files it is given (its model shard
    ``model_file``, its trainer/optimizer state ``state_file``; None = nothing) into one temporary
    directory; rank 0 commits it (meta, ``done``, rename, ``latest``) once every rank reported success —
    a failure anywhere aborts the whole save with one error on every rank and leaves the previous
    checkpoint intact."""
    final = Path(path)
    tmp = final.parent / f"{_TMP_PREFIX}{final.name}"
    if comm.rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of an interrupted save of the same step
        tmp.mkdir()
    comm.barrier()
    error = ""
    tensors, rest = _split_state(checkpoint)
    try:
        if model_file:
            save_file(_dedupe_shared(tensors), str(tmp / model_file))
        if state_file:
            torch.save(rest, tmp / state_file)
    except OSError as exc:
        error = exc.strerror or str(exc)
    errors = [e for e in comm.all_gather_object(error) if e]
    try:
        if errors:
            raise OSError(errors[0])
        if comm.rank == 0:
            step = checkpoint.get("global_step")
            (tmp / "meta.json").write_text(json.dumps({"format_version": FORMAT_VERSION, "step": step, **(meta or {})}, indent=2))
            _fsync_dir_files(tmp)
            if before_commit is not None:
                before_commit(tmp)
            (tmp / DONE_MARKER).write_text("ok\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _write_latest(final)
    except OSError as exc:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {final}: {exc.strerror or exc}; the previous checkpoint is intact "
                              f"— free disk space or point exp_manager.exp_dir elsewhere") from exc
    comm.barrier()
    return final


def _dedupe_shared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    seen: dict[tuple[int, int, tuple], str] = {}
    out = {}
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            out[name] = t.clone()  # an alias: a separate copy keeps the format simple and safe
        else:
            seen[key] = name
            out[name] = t
    return out


def _fsync_dir_files(directory: Path) -> None:
    for f in directory.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def _write_latest(final: Path) -> None:
    latest = final.parent / LATEST_FILE
    tmp = final.parent / f"{_TMP_PREFIX}{LATEST_FILE}-{uuid.uuid4().hex[:8]}"
    tmp.write_text(final.name + "\n")
    os.replace(tmp, latest)


def verify(path: str | os.PathLike, expect_model: dict[str, Any] | None = None) -> None:
    """Everything that can be checked without loading tensors: the directory, the ``done`` marker,
    meta.json, the model it belongs to, and that every file is whole (a safetensors file's header
    states its exact length; trainer_state.pt is a zip archive with checksums). Raises CheckpointError."""
    root = _complete_dir(path, expect_model)
    for tensors in root.glob("*.safetensors"):
        _check_safetensors_length(tensors)
    states = sorted(root.glob("trainer_state*.pt"))
    if not states:
        raise CheckpointError(f"checkpoint {root} has no trainer_state*.pt — it is damaged; use an earlier checkpoint")
    for state in states:
        try:
            with zipfile.ZipFile(state) as archive:
                bad = archive.testzip()
        except (OSError, zipfile.BadZipFile) as exc:
            raise CheckpointError(f"checkpoint file {state} is damaged ({exc}) — use an earlier checkpoint") from None
        if bad is not None:
            raise CheckpointError(f"checkpoint file {state} is damaged (member {bad} fails its checksum) — use an earlier checkpoint")


def _complete_dir(path: str | os.PathLike, expect_model: dict[str, Any] | None) -> Path:
    """The checkpoint directory, if it exists, is committed (``done``) and belongs to the expected model."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {root} does not exist or is not a directory — pass a checkpoints/step-<N> directory")
    if not is_complete(root):
        raise CheckpointError(f"checkpoint {root} is incomplete (no '{DONE_MARKER}' marker: its save was interrupted) — use an earlier one")
    _check_model(root, expect_model)
    return root


def _check_safetensors_length(file: Path) -> None:
    size = file.stat().st_size
    try:
        with open(file, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(header_len)) if 0 < header_len <= size else None
    except (OSError, ValueError):
        header = None
    if header is None:
        raise CheckpointError(f"checkpoint file {file} is damaged (unreadable safetensors header) — use an earlier checkpoint")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end != size:
        raise CheckpointError(f"checkpoint file {file} is truncated ({size} bytes, its header promises {8 + header_len + end}) "
                              "— use an earlier checkpoint")


def _check_model(root: Path, expect_model: dict[str, Any] | None) -> None:
    saved = read_meta(root).get("model") or {}
    for key, want in (expect_model or {}).items():
        if key in saved and saved[key] != want:
            raise CheckpointError(f"checkpoint {root} is from another model (model.{key}={saved[key]}, this run has {want}) — "
                                  "resume from a checkpoint of this model")


def describe(path: str | os.PathLike) -> str:
    """``nxdt checkpoint inspect``: step, layout, model shape and every tensor (read from headers only)."""
    from safetensors import safe_open

    root = Path(path)
    verify(root)
    meta = read_meta(root)
    lines = [f"checkpoint {root}: step {meta.get('step')}, format {meta.get('format_version')}, world {meta.get('world_size')}, "
             f"degrees {meta.get('degrees')}", f"model: {meta.get('model')}"]
    total = 0
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(str(file), "pt") as fh:
            for name in fh.keys():
                t = fh.get_slice(name)
                shape, dtype = t.get_shape(), t.get_dtype()
                count = 1
                for d in shape:
                    count *= d
                total += count
                lines.append(f"  {file.name}:{name:<48} {str(list(shape)):<16} {dtype}")
    lines.append(f"{total:,} parameters")
    return "\n".join(lines)


def check_layout(path: str | os.PathLike, degrees: dict[str, int], zero1: bool, fsdp: bool = False) -> None:
    """Refuse, with one line, a checkpoint whose shards do not fit this run's layout: the model-parallel
    degrees (TP, PP, EP) must match; the data-parallel degree may change unless ZeRO-1 or FSDP sharded the
    optimizer state over it."""
    meta = read_meta(path)
    saved = meta.get("degrees", {})
    if any(saved.get(d, 1) != degrees[d] for d in ("tp", "pp", "ep")):
        raise CheckpointError(
            f"checkpoint {path} was saved at TP{saved.get('tp', 1)}×PP{saved.get('pp', 1)}×EP{saved.get('ep', 1)}; this run is "
            f"TP{degrees['tp']}×PP{degrees['pp']}×EP{degrees['ep']} — resuming on another tensor/pipeline/expert layout is not "
            "supported yet (the data-parallel degree may change)")
    for key, shown, here in (("zero1", "ZeRO-1", zero1), ("fsdp", "FSDP", fsdp)):
        if bool(meta.get(key)) != here or (here and saved.get("dp") != degrees["dp"]):
            raise CheckpointError(
                f"checkpoint {path} holds optimizer state for {key}={bool(meta.get(key))} at DP{saved.get('dp')}; this run is "
                f"{key}={here} at DP{degrees['dp']} — resume with the same {shown} setting and data-parallel degree")


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    try:
        return json.loads((Path(path) / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: meta.json is missing or unreadable ({exc}) — this is not a complete nxdt checkpoint") from None


def load(path: str | os.PathLike, expect_model: dict[str, Any] | None = None, model_file: str = "model.safetensors",
         state_file: str = "trainer_state.pt") -> dict[str, Any]:
    """Read a complete checkpoint directory back into a Lightning checkpoint dict (no arbitrary unpickling).
    ``expect_model``: model shape fields the checkpoint must have been saved with; ``model_file`` /
    ``state_file``: this rank's shard files (see ``NxDStrategy``)."""
    root = _complete_dir(path, expect_model)
    try:
        state = torch.load(root / state_file, map_location="cpu", weights_only=True)
        state["state_dict"] = load_file(str(root / model_file), device="cpu")
    except Exception as exc:  # corrupted or truncated files: one message, no deep traceback
        raise CheckpointError(f"checkpoint {root} is unreadable ({type(exc).__name__}: {exc}) — delete it or resume from an earlier one") from exc
    return state


def remove(path: str | os.PathLike) -> None:
    shutil.rmtree(path, ignore_errors=True)
