"""A tokenized Hugging Face dataset saved with ``Dataset.save_to_disk`` (NxDT's ``data.train_dir``).

Such a directory holds ``state.json`` (the list of shard files) and ``data-XXXXX-of-NNNNN.arrow`` shards in
Arrow's IPC *stream* format; a ``DatasetDict`` adds ``dataset_dict.json`` and one such directory per split
(``train`` is used). The shards are read with ``pyarrow`` — the one library the ``datasets`` package itself
builds on — memory-mapped, so a large corpus is not loaded into memory; ``datasets`` itself is not needed.
``pyarrow`` is optional: ``pip install 'nxdt[hf]'``.

Rows give ``input_ids`` (a list of token ids) and optionally ``labels`` in Hugging Face's convention (aligned
with ``input_ids``, the model shifts them; -100 = no target). nxdt's samples carry labels already shifted
(``labels[t]`` is the target after ``input_ids[t]``), so a row of L tokens becomes ``input_ids = row[:S]``
and ``labels = labels_row[1:S+1]`` for ``S = seq_length``, with -100 after the row's last token. Rows must
hold at least ``seq_length`` tokens (NxDT's tokenized corpora hold exactly ``encoder_seq_length``).
``attention_mask`` is not used: nxdt's models attend causally; mark padding -100 in ``labels``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

IGNORE = -100


class DatasetDirError(ValueError):
    """``str()`` names the directory and the fix; ``fix`` alone for a config error line."""

    def __init__(self, path: Any, fix: str) -> None:
        self.path, self.fix = path, fix
        super().__init__(f"data.train_dir={path}: {fix}")


def is_saved_dataset(path: str | Path) -> bool:
    path = Path(path)
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _split_dir(path: Path) -> Path:
    if (path / "state.json").is_file():
        return path
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise DatasetDirError(
                path, f"a DatasetDict without a 'train' split (has {splits}); point data.train_dir at the split's directory"
            )
        return path / "train"
    raise DatasetDirError(
        path,
        "not a Hugging Face datasets directory (no state.json or dataset_dict.json, "
        "written by save_to_disk); for a text file or directory set data.source=text",
    )


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
    except ImportError:
        raise DatasetDirError(
            "",
            "data.source=hf_dataset reads Arrow files with pyarrow, which is not installed: pip install 'nxdt[hf]' (or pyarrow)",
        ) from None
    return pyarrow


def _column_chunks(table: Any, name: str, path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """(offsets, values) numpy views of each chunk of a list-of-integers column (zero-copy from the map)."""
    column = table.column(name)
    chunks = []
    for chunk in column.chunks:
        if chunk.null_count:
            raise DatasetDirError(path, f"column {name} has missing rows")
        try:
            values = chunk.values.to_numpy(zero_copy_only=False)
        except AttributeError:
            raise DatasetDirError(path, f"column {name} is {column.type}, not a list of token ids") from None
        if not np.issubdtype(values.dtype, np.integer):
            raise DatasetDirError(path, f"column {name} holds {values.dtype}, not token ids")
        chunks.append((chunk.offsets.to_numpy(), values))
    return chunks


class SavedHFDataset(Dataset):
    """Samples ``{"input_ids": LongTensor[S], "labels": LongTensor[S]}`` from a ``save_to_disk`` directory."""

    def __init__(self, path: str | Path, seq_length: int, vocab_size: int | None = None) -> None:
        _pyarrow()  # a clear line when pyarrow is missing, before any file is read
        root = Path(path).expanduser()
        split = _split_dir(root)
        state = json.loads((split / "state.json").read_text())
        files = [split / f["filename"] for f in state.get("_data_files", [])]
        if not files:
            raise DatasetDirError(root, "state.json lists no data files")
        self.seq_length = seq_length
        self._ids: list[tuple[np.ndarray, np.ndarray]] = []
        self._labels: list[tuple[np.ndarray, np.ndarray]] | None = []
        for file in files:
            table = _read_shard(root, file)
            if "input_ids" not in table.column_names:
                raise DatasetDirError(
                    root, f"no input_ids column (has {', '.join(table.column_names)}); give a tokenized dataset"
                )
            self._ids += _column_chunks(table, "input_ids", root)
            if self._labels is not None and "labels" in table.column_names:
                self._labels += _column_chunks(table, "labels", root)
            else:
                self._labels = None  # labels only where every shard has them
        self._starts = np.cumsum([0] + [len(off) - 1 for off, _ in self._ids])
        shortest = min((int(np.diff(off).min()) for off, _ in self._ids if len(off) > 1), default=0)
        if len(self) == 0 or shortest < seq_length:
            raise DatasetDirError(
                root,
                f"rows hold {shortest} tokens, fewer than data.seq_length={seq_length}; "
                "set model.encoder_seq_length (data.seq_length) to the corpus' row length",
            )
        if vocab_size is not None:
            top = max(int(values.max()) for _, values in self._ids if len(values))
            if top >= vocab_size:
                raise DatasetDirError(
                    root,
                    f"token id {top} does not fit model.vocab_size={vocab_size}; the corpus was tokenized for another vocabulary",
                )

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _row(self, chunks: list[tuple[np.ndarray, np.ndarray]], index: int, count: int) -> np.ndarray:
        c = int(np.searchsorted(self._starts, index, side="right")) - 1
        offsets, values = chunks[c]
        start, end = int(offsets[index - self._starts[c]]), int(offsets[index - self._starts[c] + 1])
        return values[start : min(end, start + count)]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} outside 0..{len(self) - 1}")
        s = self.seq_length
        ids = torch.from_numpy(self._row(self._ids, index, s).astype(np.int64))
        targets: np.ndarray = self._row(self._labels if self._labels is not None else self._ids, index, s + 1)[1:].astype(
            np.int64
        )
        labels = torch.full((s,), IGNORE, dtype=torch.long)
        labels[: len(targets)] = torch.from_numpy(targets)
        return {"input_ids": ids, "labels": labels}


def check_saved_dataset(path: str | Path) -> None:
    """The launcher's cheap check of a ``save_to_disk`` directory: its JSON files, its shards listed and present,
    and each shard's Arrow *schema* (an ``input_ids`` column of integer lists) — no row is read.
    Raises :class:`DatasetDirError`."""
    root = Path(path).expanduser()
    if root.is_file():
        raise DatasetDirError(
            root,
            "is a file; data.source=hf_dataset reads a directory written by datasets' save_to_disk "
            "(for a text file set data.source=text)",
        )
    try:
        split = _split_dir(root)
        state = json.loads((split / "state.json").read_text())
        names = [f["filename"] for f in state.get("_data_files", [])]
    except DatasetDirError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, TypeError, KeyError) as exc:
        raise DatasetDirError(
            root,
            f"state.json / dataset_dict.json is not what save_to_disk writes ({type(exc).__name__}); "
            "write the dataset again with Dataset.save_to_disk",
        ) from None
    if not names or not all(isinstance(n, str) and n for n in names):
        raise DatasetDirError(root, "state.json lists no data files; write the dataset again with Dataset.save_to_disk")
    pa = _pyarrow()
    for name in names:
        file = split / name
        if not file.is_file():
            raise DatasetDirError(root, f"shard {name} listed in state.json is missing")
        try:
            with pa.memory_map(str(file)) as source:
                schema = pa.ipc.open_stream(source).schema  # the stream's first message only
        except (pa.ArrowException, OSError) as exc:
            raise DatasetDirError(
                root,
                f"{name} is not an Arrow stream ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                "write the dataset again with Dataset.save_to_disk",
            ) from None
        if "input_ids" not in schema.names:
            raise DatasetDirError(
                root, f"{name} has no input_ids column (has {', '.join(schema.names) or 'none'}); give a tokenized dataset"
            )
        for column in ("input_ids", "labels"):
            if column not in schema.names:
                continue
            kind = schema.field(column).type
            if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
                raise DatasetDirError(
                    root, f"{name}: column {column} is {kind}, not a list of token ids; give a tokenized dataset"
                )


def read_saved_records(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The rows of a ``save_to_disk`` directory as plain dicts (untokenized records, e.g. instruction records with
    ``input``/``output`` or ``messages``), in order, the first ``limit`` only if given. Raises :class:`DatasetDirError`."""
    _pyarrow()
    root = Path(path).expanduser()
    split = _split_dir(root)
    state = json.loads((split / "state.json").read_text())
    records: list[dict[str, Any]] = []
    for entry in state.get("_data_files", []):
        file = split / entry["filename"]
        table = _read_shard(root, file)
        take = table.num_rows if limit is None else min(table.num_rows, limit - len(records))
        records += table.slice(0, take).to_pylist()
        if limit is not None and len(records) >= limit:
            break
    return records


def _read_shard(root: Path, file: Path) -> Any:
    """One Arrow stream file of a save_to_disk directory, memory-mapped (a missing or non-Arrow shard: one line)."""
    pa = _pyarrow()
    if not file.is_file():
        raise DatasetDirError(root, f"shard {file.name} listed in state.json is missing")
    try:
        return pa.ipc.open_stream(pa.memory_map(str(file))).read_all()
    except pa.ArrowInvalid as exc:
        raise DatasetDirError(root, f"{file.name} is not an Arrow stream ({exc})") from None
