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
      checksums.json         since format 3: size and SHA-256 of every other file (meta.json included) and a
                             digest of that list itself; written after every data file, before ``done``
      done                   written last, before the rename

Integrity: ``load`` (and ``restore_rng``) check the size and SHA-256 of each file they read; ``verify`` /
``check`` / ``nxdt checkpoint verify`` check every file; ``newest_verified`` is the newest complete checkpoint
whose files all check (the launcher resumes from it; damaged ones are moved aside by ``set_aside``). A
checkpoint written before format 3 has no checksums: it still loads, "unverified" (structural checks only:
safetensors lengths, trainer_state zip CRCs). Under ``save_sharded`` every rank hashes the files it wrote
and the digests travel to rank 0 with the collective that already reports write errors.

Under model parallelism the files carry shard suffixes (``model-mp<K>[-ep<E>]``, ``trainer_state-mp<K>[-dp<D>]``,
see :func:`nxdt.lightning.sharded_checkpoint.shard_files`); :mod:`nxdt.lightning.reshard` turns any of them into one full state.

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

import errno
import hashlib
import json
import logging
import os
import queue
import random
import re
import shutil
import stat
import threading
import uuid
import zipfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from nxdt.config.validate import Dim

log = logging.getLogger(__name__)

# 2: trainer states record optimizer parameter names, rng-rank<R> files, meta has virtual_pipeline
# 3: checksums.json (size and SHA-256 of every file)
FORMAT_VERSION = 3
CHECKSUMS_SINCE = 3
DONE_MARKER = "done"
CHECKSUMS_FILE = "checksums.json"
DAMAGED_SUFFIX = ".damaged"  # a damaged checkpoint moved aside by set_aside(): never listed, never removed
_HASH_CHUNK = 8 << 20
LATEST_FILE = "latest"
ASYNC_STREAM = "ckpt"  # collectives of a background save: never interleave with training's on "default"
_TMP_PREFIX = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or written; the message names the path and the fix."""


@contextmanager
def opened_regular(file: str | os.PathLike) -> Iterator[str]:
    """``file`` opened without following a link and checked to be a regular file, as a path to that open file
    (``/proc/self/fd/N``) for readers that take a path (safetensors maps it): a link planted in a checkpoint —
    even to a file with the very bytes its checksum names — is refused, and the file read is the one checked."""
    path = Path(file)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointError(
                f"checkpoint file {path} is a symbolic link; checkpoint files are read only as regular files "
                f"— use an earlier checkpoint"
            ) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"checkpoint file {path} is not a regular file — use an earlier checkpoint")
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


METADATA_LIMIT = 16 << 20  # meta.json / checksums.json are a few KB as written; a larger one is not nxdt's


def read_small_file(file: str | os.PathLike, limit: int = METADATA_LIMIT) -> bytes:
    """The bytes of a checkpoint's metadata file, opened without following a link (O_NOFOLLOW) or blocking on a FIFO
    (O_NONBLOCK, then fstat of what was opened), at most ``limit`` bytes: a crafted checkpoint must not hang
    ``nxdt checkpoint inspect`` or fill memory. ValueError (one line) for what it refuses, OSError when it is absent."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError("a symbolic link, not the file that was written") from None
        raise
    with open(fd, "rb") as fh:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file (a FIFO, device or directory)")
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"more than the {limit >> 20} MiB nxdt reads of a checkpoint's metadata")
    return data


def refuse_target_inside_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike) -> None:
    """``export-hf`` / ``consolidate`` write ``out``: never inside the checkpoint read (its files and checksums would
    change under it) nor inside any other checkpoint directory (links resolved); nor in a system directory or at a
    link (:func:`nxdt.config.validate.output_path_problem`, as every command's output)."""
    from nxdt.config.validate import output_path_problem

    problem = output_path_problem(os.fspath(out), directory=True)
    if problem is not None:
        raise CheckpointError(f"{out} {problem}")
    source, target = Path(checkpoint).resolve(), Path(out).resolve()
    inside = target == source or source in target.parents
    if not inside:
        inside_other = next(
            (d for d in (target, *target.parents) if (d / DONE_MARKER).is_file() or (d / CHECKSUMS_FILE).is_file()), None
        )
        if inside_other is None:
            return
        source = inside_other
    raise CheckpointError(f"{out} is inside the checkpoint {source}: writing there would change it — name a directory outside it")


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / DONE_MARKER).is_file()


def is_step_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint directory's name, ``step-<N>`` (nothing else: no separator, no "..")."""
    return re.fullmatch(r"step-[0-9]{1,18}", name) is not None


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
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(_TMP_PREFIX) and DAMAGED_SUFFIX not in p.name and is_complete(p)
    ]
    return sorted(found, key=_step_of)


def latest_complete(checkpoint_dir: str | os.PathLike) -> Path | None:
    found = list_complete(checkpoint_dir)
    return found[-1] if found else None


def remove_incomplete(checkpoint_dir: str | os.PathLike) -> list[Path]:
    """Delete leftovers of interrupted saves (temporary directories, directories without ``done``); checkpoints
    moved aside as damaged (``set_aside``) stay for the user to inspect."""
    root = Path(checkpoint_dir)
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and DAMAGED_SUFFIX not in p.name and (p.name.startswith(_TMP_PREFIX) or not is_complete(p)):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def plain_data(obj: Any) -> bool:
    """Whether ``obj`` is made of what ``torch.load(weights_only=True)`` reads back: tensors, numbers, strings, None
    in dicts, lists and tuples (not a user's class, not an OmegaConf container)."""
    if obj is None or type(obj) in (bool, int, float, str) or type(obj) is torch.Tensor:
        return True
    if type(obj) in (list, tuple):
        return all(plain_data(v) for v in obj)
    if type(obj) is dict:
        return all(plain_data(k) and plain_data(v) for k, v in obj.items())
    return False


def _split_state(checkpoint: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    state = dict(checkpoint)
    model_state = state.pop("state_dict", {})
    # Hyper-parameters (save_hyperparameters) are kept when they are plain data, so a checkpoint converted to a
    # Lightning file (load_from_checkpoint) has them; ones holding arbitrary user objects are dropped, which keeps
    # trainer_state.pt loadable with weights_only=True (nxdt train re-creates everything from its config).
    for obj in ("", "datamodule_"):
        if not plain_data(state.get(f"{obj}hyper_parameters")):
            log.info("checkpoint: the %shyper-parameters are not plain data; not stored", obj)
            state.pop(f"{obj}hyper_parameters", None)
    state.pop("hparams_type", None)  # a type: only OmegaConf hyper-parameters have one, and they are not plain data
    tensors = {k: v.detach().contiguous().cpu() for k, v in model_state.items()}
    return tensors, state


def save(
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    meta: dict[str, Any] | None = None,
    before_commit: Callable[[Path], None] | None = None,
    extra_files: dict[str, dict[str, torch.Tensor] | bytes] | None = None,
    write_latest: bool = True,
) -> Path:
    """Write ``checkpoint`` (a Lightning checkpoint dict) atomically to the directory ``path``.
    ``before_commit(tmp_dir)`` runs when every file is written but before the ``done`` marker (fault drills);
    ``extra_files``: more files {name: tensors (safetensors) or bytes} (RNG states, a PEFT adapter); ``write_latest``: point the
    parent's ``latest`` at it (False for a checkpoint written outside a run, e.g. ``consolidate``)."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{_TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    tensors, rest = _split_state(checkpoint)
    try:
        tmp.mkdir()
        # safetensors refuses tensors that share storage (tied embeddings): store each once.
        _save_safetensors(_dedupe_shared(tensors), tmp / "model.safetensors")
        _torch_save(rest, tmp / "trainer_state.pt")
        for name, extra in (extra_files or {}).items():
            _write_extra(extra, tmp / name)
        info = {"format_version": FORMAT_VERSION, "step": rest.get("global_step"), **(meta or {})}
        (tmp / "meta.json").write_text(json.dumps(info, indent=2))
        _write_checksums(tmp, _digest_files(tmp, sorted(p.name for p in tmp.iterdir())))  # fsyncs every file
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


def save_sharded(
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    *,
    model_file: str | None,
    state_file: str | None,
    comm: Any,
    meta: dict[str, Any] | None = None,
    before_commit: Callable[[Path], None] | None = None,
    extra_files: dict[str, dict[str, torch.Tensor] | bytes] | None = None,
    stream: str = "default",
) -> Path:
    """Every rank of ``comm`` calls this; each writes the files it is given (its model shard
    ``model_file``, its trainer/optimizer state ``state_file``; None = nothing; ``extra_files``
    {name: tensors}, e.g. its RNG states) into one temporary directory; rank 0 commits it (meta, ``done``,
    rename, ``latest``) once every rank reported success — a failure anywhere aborts the whole save with
    one error on every rank and leaves the previous checkpoint intact. ``stream``: the communicator
    stream of the save's collectives (``ASYNC_STREAM`` from a background writer). ``before_commit(tmp_dir)``
    (fault drills) runs on every rank once its own files are written and before the commit: on rank 0 after
    meta.json and checksums.json, on the others before they report to rank 0."""
    final = Path(path)
    tmp = final.parent / f"{_TMP_PREFIX}{final.name}"
    error, digests = "", {}
    if comm.rank == 0:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a leftover of an interrupted save of the same step
            tmp.mkdir()
        except OSError as exc:  # reported with the others' below (theirs then fail on the missing directory)
            error = exc.strerror or str(exc)
    comm.barrier(stream=stream)
    tensors, rest = _split_state(checkpoint)

    def write_mine() -> dict[str, dict[str, Any]]:
        written = []
        if model_file:
            _save_safetensors(_dedupe_shared(tensors), tmp / model_file)
            written.append(model_file)
        if state_file:
            _torch_save(rest, tmp / state_file)
            written.append(state_file)
        for name, extra in (extra_files or {}).items():
            _write_extra(extra, tmp / name)
            written.append(name)
        return _digest_files(tmp, written)  # this rank's files, hashed and fsynced where they were written

    try:
        digests = {} if error else write_mine()
    except OSError as exc:
        error = exc.strerror or str(exc)
    if before_commit is not None and comm.rank != 0 and not error:
        before_commit(tmp)  # this rank's files are written, the checkpoint is not committed (rank 0's: below)
    # one collective reports every rank's errors and hands rank 0 every rank's digests (plain data)
    reports = comm.all_gather_object((error, digests), stream=stream)
    errors = [e for e, _ in reports if e]
    entries: dict[str, dict[str, Any]] = {}
    for rank, (_, theirs) in enumerate(reports):  # every rank sees the same reports: all agree on a conflict
        for name, digest in theirs.items():
            if entries.get(name, digest) != digest and not errors:  # two ranks wrote one file differently: a layout bug
                errors.append(f"ranks wrote different contents to {name} (rank {rank} and an earlier one)")
            entries[name] = digest
    try:
        if errors:
            raise OSError(errors[0])
        if comm.rank == 0:
            step = checkpoint.get("global_step")
            (tmp / "meta.json").write_text(json.dumps({"format_version": FORMAT_VERSION, "step": step, **(meta or {})}, indent=2))
            _write_checksums(tmp, {**entries, **_digest_files(tmp, ["meta.json"])})
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
        raise CheckpointError(
            f"could not write checkpoint {final}: {exc.strerror or exc}; the previous checkpoint is intact "
            f"— free disk space or point exp_manager.exp_dir elsewhere"
        ) from exc
    comm.barrier(stream=stream)
    return final


class _WriteErrors:
    """A file for torch.save that keeps the first OSError of a write: torch reports a failed write only as
    "unexpected pos", so a full disk would not say so."""

    def __init__(self, fh: Any) -> None:
        self.fh = fh
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.fh.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self.fh.flush()


def _torch_save(obj: Any, path: Path) -> None:
    """torch.save into ``path``; a failed write raises its OSError (ENOSPC: "No space left on device")."""
    with open(path, "wb") as fh:  # buffered: every write is whole or raises (torch ignores short counts)
        sink = _WriteErrors(fh)
        try:
            torch.save(obj, sink)
        except RuntimeError as exc:
            if sink.error is None:
                raise
            raise sink.error from exc


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file; a failed write raises an OSError (safetensors reports it as "os error <errno>")."""
    try:
        save_file(tensors, str(path))
    except SafetensorError as exc:
        errno = re.search(r"os error (\d+)", str(exc))
        if errno is None:
            raise
        raise OSError(int(errno.group(1)), os.strerror(int(errno.group(1))), str(path)) from exc


def _write_extra(extra: dict[str, torch.Tensor] | bytes, path: Path) -> None:
    if isinstance(extra, bytes):
        path.write_bytes(extra)
    else:
        _save_safetensors(extra, path)


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


# ---------------------------------------------------------------------------------------------- checksums
def file_digest(file: str | os.PathLike, fsync: bool = False) -> dict[str, Any]:
    """``{"size", "sha256"}`` of a file, read in chunks (``fsync``: also flush it to disk, as a save does). SHA-256
    runs at about 1-1.5 GB/s per core with SHA extensions, so a 100 MB file costs ~0.1 s read back from the page
    cache right after it was written."""
    digest, size = hashlib.sha256(), 0
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open(os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as fh:  # a link: ELOOP, a problem
        while n := fh.readinto(buf):
            digest.update(view[:n])
            size += n
        if fsync:
            os.fsync(fh.fileno())
    return {"size": size, "sha256": digest.hexdigest()}


def _parallel(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """``fn`` over ``items`` in order, on a few threads when there are several (hashlib releases the GIL)."""
    if len(items) < 2:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(len(items), os.cpu_count() or 1, 8)) as pool:
        return list(pool.map(fn, items))


def _digest_files(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return dict(zip(names, _parallel(lambda n: file_digest(directory / n, fsync=True), names)))


def _list_digest(files: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _write_checksums(directory: Path, files: dict[str, dict[str, Any]]) -> None:
    """checksums.json: every file's size and SHA-256, and the SHA-256 of that list (so the manifest checks itself)."""
    files = dict(sorted(files.items()))
    doc = {"format_version": FORMAT_VERSION, "algorithm": "sha256", "files": files, "files_sha256": _list_digest(files)}
    target = directory / CHECKSUMS_FILE
    with open(target, "w") as fh:
        fh.write(json.dumps(doc, indent=1) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


class _Damage(Exception):
    """One problem of a checkpoint, in the words of ``nxdt checkpoint verify`` ("checksum mismatch: model.safetensors")."""


def _damaged(root: Path, problem: str, more: int = 0) -> CheckpointError:
    extra = f"; {more} more problem{'s' if more > 1 else ''}, see `nxdt checkpoint verify {root}`" if more else ""
    return CheckpointError(f"checkpoint {root} is damaged ({problem}{extra}) — use an earlier checkpoint")


def read_checksums(path: str | os.PathLike) -> dict[str, dict[str, Any]] | None:
    """The recorded ``{file: {"size", "sha256"}}`` of a checkpoint; None for one written before checksums existed
    (format < 3: "unverified"). Raises CheckpointError if checksums.json is missing where the format requires it,
    or unreadable, or does not match its own digest."""
    root = Path(path)
    try:
        return _checksums(root)
    except _Damage as exc:
        raise _damaged(root, str(exc)) from None


def _checksums(root: Path) -> dict[str, dict[str, Any]] | None:
    file = root / CHECKSUMS_FILE
    if not file.is_file():
        version = read_meta(root).get("format_version", 1)
        if isinstance(version, int) and version >= CHECKSUMS_SINCE:
            raise _Damage(f"missing: {CHECKSUMS_FILE} (format {version} records one)")
        return None
    try:
        doc = json.loads(read_small_file(file))
        files = doc["files"]
        whole = (
            isinstance(files, dict)
            and doc["files_sha256"] == _list_digest(files)
            and all(
                isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
                for e in files.values()
            )
        )
    except (OSError, ValueError, KeyError, TypeError):
        whole = False
    if not whole:
        raise _Damage(f"checksum mismatch: {CHECKSUMS_FILE} (unreadable, or it does not match its own digest)")
    return files


def _file_problem(root: Path, name: str, want: dict[str, Any]) -> str | None:
    """What is wrong with one recorded file (None: it is exactly as written)."""
    file = root / name
    try:
        info = file.lstat()
    except OSError:
        return f"missing: {name}"
    if not stat.S_ISREG(info.st_mode):  # a link, even to the very bytes recorded, is not the file that was written
        return f"not a regular file: {name} ({'a symbolic link' if stat.S_ISLNK(info.st_mode) else 'a special file'})"
    size = info.st_size
    if size < want["size"]:
        return f"truncated: {name} ({size} of {want['size']} bytes)"
    if size > want["size"]:
        return f"size mismatch: {name} ({size} bytes, {want['size']} recorded)"
    try:
        got = file_digest(file)
    except OSError as exc:
        return f"unreadable: {name} ({exc.strerror or exc})"
    return None if got["sha256"] == want["sha256"] else f"checksum mismatch: {name}"


def check_file(path: str | os.PathLike, name: str, checksums: dict[str, dict[str, Any]] | None = None) -> None:
    """Before reading file ``name`` of a checkpoint: its size and SHA-256 must match checksums.json (``checksums``:
    from ``read_checksums``, read here when not given). A checkpoint without checksums only needs the file to exist.
    Raises CheckpointError naming the file and the problem, in one line."""
    root = Path(path)
    recorded = read_checksums(root) if checksums is None else checksums
    if recorded is None:
        problem = None if (root / name).is_file() else f"missing: {name}"
    elif name not in recorded:
        problem = f"missing: {name}" if not (root / name).is_file() else f"not recorded in {CHECKSUMS_FILE}: {name}"
    else:
        problem = _file_problem(root, name, recorded[name])
    if problem is not None:
        raise _damaged(root, problem)


@dataclass
class Verification:
    """What ``check`` found: ``checksummed`` False for a checkpoint written before checksums (only its structure
    could be checked: "unverified"); ``problems`` one line each, empty when the checkpoint is good."""

    path: Path
    checksummed: bool = False
    files: int = 0
    size: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check(path: str | os.PathLike) -> Verification:
    """Check every file of a checkpoint directory (``nxdt checkpoint verify``): the ``done`` marker, checksums.json,
    then each recorded file's size and SHA-256, and files nobody recorded; without checksums (format < 3) the
    structural checks instead (meta.json, safetensors lengths, trainer_state zip CRCs). Never raises for damage."""
    root = Path(path)
    result = Verification(root)
    if not root.is_dir():
        result.problems.append(f"missing: {root} is not a directory")
        return result
    if not is_complete(root):
        result.problems.append(f"incomplete: no '{DONE_MARKER}' marker (its save was interrupted)")
    try:
        recorded = _checksums(root)
    except (_Damage, CheckpointError) as exc:  # CheckpointError: meta.json unreadable where checksums.json is missing
        result.problems.append(str(exc) if isinstance(exc, _Damage) else f"unreadable: meta.json (and no {CHECKSUMS_FILE})")
        return result
    if recorded is None:
        result.problems += _structure_problems(root)
        result.files = sum(1 for p in root.iterdir() if p.is_file() and p.name != DONE_MARKER)
        result.size = sum(p.stat().st_size for p in root.iterdir() if p.is_file())
        return result
    result.checksummed = True
    names = sorted(recorded)
    result.problems += [p for p in _parallel(lambda n: _file_problem(root, n, recorded[n]), names) if p]
    known = set(names) | {CHECKSUMS_FILE, DONE_MARKER}
    result.problems += [f"not recorded in {CHECKSUMS_FILE}: {p.name}" for p in sorted(root.iterdir()) if p.name not in known]
    result.files, result.size = len(names), sum(e["size"] for e in recorded.values())
    return result


def _structure_problems(root: Path) -> list[str]:
    """A checkpoint without checksums: what can be checked without them (a safetensors header states its file's
    exact length; trainer_state.pt is a zip archive with CRC-32s)."""
    problems = []
    try:
        read_meta(root)
    except CheckpointError:
        problems.append("unreadable: meta.json")
    for tensors in sorted(root.glob("*.safetensors")):
        problem = _safetensors_problem(tensors)
        if problem:
            problems.append(problem)
    states = sorted(root.glob("trainer_state*.pt"))
    if not states:
        problems.append("missing: trainer_state*.pt")
    for state in states:
        try:
            with zipfile.ZipFile(state) as archive:
                bad = archive.testzip()
        except (OSError, zipfile.BadZipFile) as exc:
            problems.append(f"truncated or corrupt: {state.name} ({exc})")
            continue
        if bad is not None:
            problems.append(f"checksum mismatch: {state.name} (zip member {bad} fails its CRC)")
    return problems


def verify(path: str | os.PathLike, expect_model: dict[str, Any] | None = None) -> None:
    """The checkpoint is committed, of the expected model, and every file is exactly as written (SHA-256 from
    checksums.json; a checkpoint without checksums: its structure, "unverified"). Raises CheckpointError,
    one line naming the first problem."""
    root = _complete_dir(path, expect_model)
    result = check(root)
    if result.problems:
        raise _damaged(root, result.problems[0], len(result.problems) - 1)


def newest_verified(checkpoint_dir: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint under ``checkpoint_dir`` whose files all check (``check``), and the newer
    complete ones skipped as damaged, newest first, each with its first problem. Changes nothing on disk.
    A checkpoint without checksums counts as good if its structure is (see ``check``)."""
    skipped: list[tuple[Path, str]] = []
    for path in reversed(list_complete(checkpoint_dir)):
        result = check(path)
        if result.ok:
            return path, skipped
        skipped.append((path, result.problems[0]))
    return None, skipped


def set_aside(path: str | os.PathLike) -> Path:
    """Rename a damaged checkpoint to ``<name>.damaged`` (``.damaged-<k>`` if taken): no listing, resume or cleanup
    sees it any more, and its files stay for inspection. Points the parent's ``latest`` at the newest complete
    checkpoint left (removes it if none). Returns the new path."""
    src = Path(path)
    dst = src.with_name(src.name + DAMAGED_SUFFIX)
    k = 1
    while dst.exists():
        dst = src.with_name(f"{src.name}{DAMAGED_SUFFIX}-{k}")
        k += 1
    os.replace(src, dst)
    newest = latest_complete(src.parent)
    if newest is not None:
        _write_latest(newest)
    else:
        (src.parent / LATEST_FILE).unlink(missing_ok=True)
    return dst


def _write_latest(final: Path) -> None:
    latest = final.parent / LATEST_FILE
    tmp = final.parent / f"{_TMP_PREFIX}{LATEST_FILE}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text(final.name + "\n")
        os.replace(tmp, latest)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def missing_checkpoint(root: Path) -> str:
    """Why ``root`` is no checkpoint, with what its run's checkpoints directory holds instead: a step removed by
    ``exp_manager.keep_last_k`` (only the newest k are kept) is the usual case."""
    present = [p.name for p in list_complete(root.parent)] if is_step_name(root.name) else []
    if present:
        return (
            f"checkpoint {root} does not exist: {root.parent} holds {', '.join(present)} (a run keeps its newest "
            "exp_manager.keep_last_k checkpoints) — pass one of them"
        )
    return f"checkpoint {root} does not exist or is not a directory — pass a checkpoints/step-<N> directory"


def _complete_dir(path: str | os.PathLike, expect_model: dict[str, Any] | None) -> Path:
    """The checkpoint directory, if it exists, is committed (``done``) and belongs to the expected model."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(missing_checkpoint(root))
    if not is_complete(root):
        raise CheckpointError(
            f"checkpoint {root} is incomplete (no '{DONE_MARKER}' marker: its save was interrupted) — use an earlier one"
        )
    _check_model(root, expect_model)
    return root


def _safetensors_problem(file: Path) -> str | None:
    size = file.stat().st_size
    try:
        with open(file, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            if not 0 < header_len <= size:
                raise ValueError(f"header length {header_len}")
            header = json.loads(fh.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return f"unreadable: {file.name} (its safetensors header is damaged)"
    if 8 + header_len + end != size:
        return f"truncated: {file.name} ({size} bytes, its header promises {8 + header_len + end})"
    return None


def _check_model(root: Path, expect_model: dict[str, Any] | None) -> None:
    saved = read_meta(root).get("model") or {}
    for key, want in (expect_model or {}).items():
        if key in saved and saved[key] != want:
            raise CheckpointError(
                f"checkpoint {root} is from another model (model.{key}={saved[key]}, this run has {want}) — "
                "resume from a checkpoint of this model"
            )


def describe(path: str | os.PathLike) -> str:
    """``nxdt checkpoint inspect``: step, layout, model shape and every tensor (read from headers only)."""
    from safetensors import safe_open

    root = Path(path)
    verify(root)
    meta = read_meta(root)
    sums = "SHA-256 verified" if read_checksums(root) is not None else "no checksums: unverified"
    lines = [
        f"checkpoint {root}: step {meta.get('step')}, format {meta.get('format_version')} ({sums}), world {meta.get('world_size')}, "
        f"degrees {meta.get('degrees')}, zero1 {bool(meta.get('zero1'))}",
        f"model: {meta.get('model')}",
    ]
    total = 0
    # the model's tensors: not the RNG states, nor a PEFT adapter's copy of the adapters (LoRA save_lora_config_adapter)
    for file in sorted(
        f for f in root.glob("*.safetensors") if not f.name.startswith("rng-") and f.name != "adapter_model.safetensors"
    ):
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


def checkpoint_degrees(degrees: dict[str, int]) -> dict[str, int]:
    """The degrees a checkpoint records and is matched against: context parallelism folded into data parallelism.
    CP ranks hold the same weights, as DP ranks do (ZeRO-1/FSDP shard over DP × CP), so a CP run's checkpoint is
    a DP run's of DP × CP replicas: it loads into, and reshards to, any other split of those replicas."""
    out = dict(degrees)
    out[Dim.DP.value] = out.get(Dim.DP.value, 1) * out.get(Dim.CP.value, 1)
    out[Dim.CP.value] = 1
    return out


def dp_format(meta: dict[str, Any]) -> str:
    """How a checkpoint's state is stored over data parallelism: ``replicated`` (DP rank 0 wrote it), ``zero1``
    (optimizer state in flat shards per DP rank), or what meta.json's ``dp_format`` names (FSDP)."""
    return meta.get("dp_format") or ("zero1" if meta.get("zero1") else "replicated")


def check_layout(
    path: str | os.PathLike,
    degrees: dict[str, int],
    zero1: bool,
    virtual: int | None = None,
    data_parallel_format: str | None = None,
) -> bool:
    """Whether the checkpoint must be resharded to load into this layout (False: each rank reads its own
    shard files: same TP/PP/EP shards and the same DP format — and DP degree, unless replicated).
    ``data_parallel_format``: this run's (default: ``zero1`` or ``replicated`` from ``zero1``).
    A change that cannot be supported raises CheckpointError — one line naming it."""
    meta = read_meta(path)
    saved = meta.get("degrees", {})
    same_shards = all(saved.get(d, 1) == degrees[d] for d in (Dim.TP, Dim.PP, Dim.EP))
    # virtual pipeline chunks decide which layers a stage's file holds (recorded since format 2)
    same_chunks = virtual is None or meta.get("virtual_pipeline", virtual) == virtual
    here = data_parallel_format or ("zero1" if zero1 else "replicated")
    same_dp = dp_format(meta) == here and (here == "replicated" or saved.get(Dim.DP) == degrees[Dim.DP])
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
    state = np.random.get_state(legacy=True)
    assert isinstance(state, tuple)  # legacy=True: the MT19937 tuple
    _, keys, pos, has_gauss, cached = state
    return {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([version, *mt], dtype=torch.int64),
        "python_gauss": torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64),
        "numpy": torch.from_numpy(keys.astype(np.int64)),
        "numpy_pos": torch.tensor([pos, has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
    }


def restore_rng(path: str | os.PathLike, rank: int, same_layout: bool) -> Path | None:
    """Set this process's generators from the checkpoint: its own rank's states on the same layout, rank 0's
    otherwise (see the module docstring). Returns the file used (None: the checkpoint predates RNG states)."""
    file = Path(path) / rng_file(rank if same_layout else 0)
    if not file.is_file():
        return None
    check_file(path, file.name)
    try:
        t = load_file(str(file))
        py = t["python"].tolist()
        gauss = float(t["python_gauss"][0])
        random.setstate((int(py[0]), tuple(int(v) for v in py[1:]), None if gauss != gauss else gauss))
        pos, has_gauss = t["numpy_pos"].tolist()
        np.random.set_state(
            ("MT19937", t["numpy"].numpy().astype(np.uint32), int(pos), int(has_gauss), float(t["numpy_gauss"][0]))
        )
        torch.set_rng_state(t["torch"])
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint file {file} is damaged ({type(exc).__name__}: {exc}) — use an earlier checkpoint"
        ) from None
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
    file = Path(path) / "meta.json"
    try:
        meta = json.loads(read_small_file(file))
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
        return meta
    except (OSError, ValueError) as exc:
        if file.is_file() and (Path(path) / CHECKSUMS_FILE).is_file():  # it was written whole: damaged since
            raise _damaged(Path(path), f"unreadable: meta.json ({exc})") from None
        raise CheckpointError(
            f"checkpoint {path}: meta.json is missing or unreadable ({exc}) — this is not a complete nxdt checkpoint"
        ) from None


def load(
    path: str | os.PathLike,
    expect_model: dict[str, Any] | None = None,
    model_file: str = "model.safetensors",
    state_file: str = "trainer_state.pt",
) -> dict[str, Any]:
    """Read a complete checkpoint directory back into a Lightning checkpoint dict (no arbitrary unpickling).
    ``expect_model``: model shape fields the checkpoint must have been saved with; ``model_file`` /
    ``state_file``: this rank's shard files (see ``NxDStrategy``); their sizes and SHA-256 are checked first
    (CheckpointError "checkpoint … is damaged (checksum mismatch: model.safetensors)")."""
    root = _complete_dir(path, expect_model)
    checksums = read_checksums(root)
    if checksums is None:
        log.info("checkpoint %s predates checksums (format < %d): loading it unverified", root, CHECKSUMS_SINCE)
    for name in ("meta.json", state_file, model_file):  # the files this rank reads: size and SHA-256 first (one line)
        check_file(root, name, checksums)
    try:
        state = torch.load(root / state_file, map_location="cpu", weights_only=True)
        state["state_dict"] = load_file(str(root / model_file), device="cpu")
    except Exception as exc:  # corrupted or truncated files: one message, no deep traceback
        raise CheckpointError(
            f"checkpoint {root} is unreadable ({type(exc).__name__}: {exc}) — delete it or resume from an earlier one"
        ) from exc
    return state


def remove(path: str | os.PathLike) -> None:
    shutil.rmtree(path, ignore_errors=True)
