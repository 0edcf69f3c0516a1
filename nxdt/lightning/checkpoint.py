"""Atomic directory checkpoints: ``checkpoints/step-<N>/`` written under a temporary name, completed
with a ``done`` marker, made visible by one rename, and ``latest`` updated last.

A crash at any moment leaves either the previous complete checkpoint or the new one, never a half
written directory that a resume could pick up: readers only accept directories holding ``done``.

Layout of one checkpoint directory::

    step-12/
      model.safetensors      model state (tensors only: safe to load, no pickle)
      trainer_state.pt       everything else Lightning keeps (optimizer, loops, schedulers, callbacks),
                             saved with torch.save and loaded with ``weights_only=True``; since format 2
                             also the parameter name of every optimizer-state index (for resharding)
      rng-rank<R>.safetensors  random-number generator states of rank R (torch, Python, NumPy)
      meta.json              step, layout, format version
      done                   written last, before the rename

Under model parallelism the files carry shard suffixes (``model-mp<K>[-ep<E>]``, ``trainer_state-mp<K>[-dp<D>]``,
see ``NxDStrategy._shard_files``); :mod:`nxdt.lightning.reshard` turns any of them into one full state.

Random state on resume: a run resumed on the layout it was saved with restores every rank's own
generators (exact continuation). On another layout ranks do not correspond one to one, so every rank
takes rank 0's saved state: nxdt seeds all ranks alike (equal initial weights need it), so rank 0's
streams are every rank's unless a model draws rank-dependent numbers; nxdt's models draw none while
training (no dropout), so losses do not depend on this choice.

Asynchronous save (``exp_manager.async_checkpointing``): :class:`AsyncWriter` persists a snapshot (tensors
copied before training continues) in a background thread through the same atomic commit, its collectives
on their own stream (``ASYNC_STREAM``); removals of older checkpoints wait until the new one is committed.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import shutil
import threading
import uuid
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

# 2: trainer states record optimizer parameter names, rng-rank<R> files, meta has virtual_pipeline
FORMAT_VERSION = 2
DONE_MARKER = "done"
LATEST_FILE = "latest"
ASYNC_STREAM = "ckpt"  # collectives of a background save: never interleave with training's on "default"
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
         before_commit: Callable[[Path], None] | None = None, extra_files: dict[str, dict[str, torch.Tensor]] | None = None,
         write_latest: bool = True) -> Path:
    """Write ``checkpoint`` (a Lightning checkpoint dict) atomically to the directory ``path``.
    ``before_commit(tmp_dir)`` runs when every file is written but before the ``done`` marker (fault drills);
    ``extra_files``: more safetensors files {name: tensors} (RNG states); ``write_latest``: point the
    parent's ``latest`` at it (False for a checkpoint written outside a run, e.g. ``consolidate``)."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{_TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    tensors, rest = _split_state(checkpoint)
    try:
        tmp.mkdir()
        # safetensors refuses tensors that share storage (tied embeddings): store each once.
        save_file(_dedupe_shared(tensors), str(tmp / "model.safetensors"))
        torch.save(rest, tmp / "trainer_state.pt")
        for name, extra in (extra_files or {}).items():
            save_file(extra, str(tmp / name))
        info = {"format_version": FORMAT_VERSION, "step": rest.get("global_step"), **(meta or {})}
        (tmp / "meta.json").write_text(json.dumps(info, indent=2))
        _fsync_dir_files(tmp)
        if before_commit is not None:
            before_commit(tmp)
        (tmp / DONE_MARKER).write_text("ok\n")
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        if write_latest:
            _write_latest(final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"could not write checkpoint {final}: {exc.strerror or exc}; the previous checkpoint is intact "
            f"— free disk space or point exp_manager.exp_dir elsewhere"
        ) from exc
    return final


def save_sharded(checkpoint: dict[str, Any], path: str | os.PathLike, *, model_file: str | None, state_file: str | None, comm: Any,
                 meta: dict[str, Any] | None = None, before_commit: Callable[[Path], None] | None = None,
                 extra_files: dict[str, dict[str, torch.Tensor]] | None = None, stream: str = "default") -> Path:
    """Every rank of ``comm`` calls this; each writes the files it is given (its model shard
    ``model_file``, its trainer/optimizer state ``state_file``; None = nothing; ``extra_files``
    {name: tensors}, e.g. its RNG states) into one temporary directory; rank 0 commits it (meta, ``done``,
    rename, ``latest``) once every rank reported success — a failure anywhere aborts the whole save with
    one error on every rank and leaves the previous checkpoint intact. ``stream``: the communicator
    stream of the save's collectives (``ASYNC_STREAM`` from a background writer)."""
    final = Path(path)
    tmp = final.parent / f"{_TMP_PREFIX}{final.name}"
    if comm.rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of an interrupted save of the same step
        tmp.mkdir()
    comm.barrier(stream=stream)
    error = ""
    tensors, rest = _split_state(checkpoint)
    try:
        if model_file:
            save_file(_dedupe_shared(tensors), str(tmp / model_file))
        if state_file:
            torch.save(rest, tmp / state_file)
        for name, extra in (extra_files or {}).items():
            save_file(extra, str(tmp / name))
    except OSError as exc:
        error = exc.strerror or str(exc)
    errors = [e for e in comm.all_gather_object(error, stream=stream) if e]
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
    comm.barrier(stream=stream)
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
             f"degrees {meta.get('degrees')}, zero1 {bool(meta.get('zero1'))}", f"model: {meta.get('model')}"]
    total = 0
    for file in sorted(f for f in root.glob("*.safetensors") if not f.name.startswith("rng-")):
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


def dp_format(meta: dict[str, Any]) -> str:
    """How a checkpoint's state is stored over data parallelism: ``replicated`` (DP rank 0 wrote it), ``zero1``
    (optimizer state in flat shards per DP rank), or what meta.json's ``dp_format`` names (FSDP)."""
    return meta.get("dp_format") or ("zero1" if meta.get("zero1") else "replicated")


def check_layout(path: str | os.PathLike, degrees: dict[str, int], zero1: bool, virtual: int | None = None,
                 data_parallel_format: str | None = None) -> bool:
    """Whether the checkpoint must be resharded to load into this layout (False: each rank reads its own
    shard files: same TP/PP/EP shards and the same DP format — and DP degree, unless replicated).
    ``data_parallel_format``: this run's (default: ``zero1`` or ``replicated`` from ``zero1``).
    A change that cannot be supported raises CheckpointError — one line naming it."""
    meta = read_meta(path)
    saved = meta.get("degrees", {})
    same_shards = all(saved.get(d, 1) == degrees[d] for d in ("tp", "pp", "ep"))
    # virtual pipeline chunks decide which layers a stage's file holds (recorded since format 2)
    same_chunks = virtual is None or meta.get("virtual_pipeline", virtual) == virtual
    here = data_parallel_format or ("zero1" if zero1 else "replicated")
    same_dp = dp_format(meta) == here and (here == "replicated" or saved.get("dp") == degrees["dp"])
    if same_shards and same_chunks and same_dp:
        return False
    from nxdt.lightning.reshard import check_reshardable  # reshard builds on this module

    check_reshardable(path, meta, degrees, zero1)
    return True


def same_world(path: str | os.PathLike, degrees: dict[str, int], world_size: int) -> bool:
    meta = read_meta(path)
    return meta.get("world_size") == world_size and all(meta.get("degrees", {}).get(d, 1) == n for d, n in degrees.items())


# ---------------------------------------------------------------------------------------------- random state
def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.safetensors"


def rng_tensors() -> dict[str, torch.Tensor]:
    """This process's torch, Python and NumPy generator states as tensors (stored with safetensors: no pickle)."""
    version, mt, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "python": torch.tensor([version, *mt], dtype=torch.int64),
            "python_gauss": torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64),
            "numpy": torch.from_numpy(keys.astype(np.int64)),
            "numpy_pos": torch.tensor([pos, has_gauss], dtype=torch.int64),
            "numpy_gauss": torch.tensor([cached], dtype=torch.float64)}


def restore_rng(path: str | os.PathLike, rank: int, same_layout: bool) -> Path | None:
    """Set this process's generators from the checkpoint: its own rank's states on the same layout, rank 0's
    otherwise (see the module docstring). Returns the file used (None: the checkpoint predates RNG states)."""
    file = Path(path) / rng_file(rank if same_layout else 0)
    if not file.is_file():
        return None
    try:
        t = load_file(str(file))
        py = t["python"].tolist()
        gauss = float(t["python_gauss"][0])
        random.setstate((int(py[0]), tuple(int(v) for v in py[1:]), None if gauss != gauss else gauss))
        pos, has_gauss = t["numpy_pos"].tolist()
        np.random.set_state(("MT19937", t["numpy"].numpy().astype(np.uint32), int(pos), int(has_gauss), float(t["numpy_gauss"][0])))
        torch.set_rng_state(t["torch"])
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {file} is damaged ({type(exc).__name__}: {exc}) — use an earlier checkpoint") from None
    return file


# ---------------------------------------------------------------------------------------------- asynchronous save
def snapshot(obj: Any) -> Any:
    """A copy of a checkpoint dict whose tensors no longer share memory with training (dicts, lists and
    tuples copied, tensors cloned, other leaves — numbers, strings — kept); aliases stay aliases (tied weights)."""
    memo: dict[int, torch.Tensor] = {}

    def copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if id(x) not in memo:
                memo[id(x)] = x.detach().clone()
            return memo[id(x)]
        if isinstance(x, dict):
            return {k: copy(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            items = [copy(v) for v in x]
            return items if isinstance(x, list) else tuple(items)
        return x

    return copy(obj)


class AsyncWriter:
    """One background thread that runs checkpoint writes in submission order, so training continues while a
    snapshot is persisted. At most one save is in flight: ``submit`` first waits for the previous one (and
    raises its error). ``after_success`` queues work (removing an older checkpoint) that runs only if every
    job before it succeeded — a crash or failure mid-save never leaves fewer complete checkpoints."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._reported = False
        # daemon: a process that dies or exits on an error does not wait for a half-done save (it stays
        # uncommitted, so the previous checkpoint remains the newest complete one)
        self._thread = threading.Thread(target=self._run, name="nxdt-checkpoint-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job, needs_success = self._jobs.get()
            if job is None:
                return
            if not (needs_success and self._error is not None):
                try:
                    job()
                except BaseException as exc:  # kept for the training thread: it decides how the run ends
                    log.error("background checkpoint write failed: %s", exc)
                    self._error = self._error or exc
            with self._done:
                self._pending -= 1
                self._done.notify_all()

    def _put(self, job: Callable[[], Any] | None, needs_success: bool) -> None:
        with self._done:
            self._pending += job is not None
        self._jobs.put((job, needs_success))

    def submit(self, save: Callable[[], Any]) -> None:
        self.wait()
        self._put(save, False)

    def after_success(self, job: Callable[[], Any]) -> None:
        self._put(job, True)

    def wait(self, raise_errors: bool = True) -> None:
        """Block until every queued job ran; raise the first failure (once)."""
        with self._done:
            self._done.wait_for(lambda: self._pending == 0)
        if raise_errors and self._error is not None and not self._reported:
            self._reported = True
            raise self._error

    def close(self, raise_errors: bool = True) -> None:
        try:
            self.wait(raise_errors)
        finally:
            self._put(None, False)
            self._thread.join(timeout=5)


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
