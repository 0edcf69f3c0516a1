"""Megatron's indexed datasets (``.bin``/``.idx``), GPT-style samples over them, blending by weight.

What NxD Training's ``megatron_*`` configs read with ``data.data_prefix: [w1, prefix1, w2, prefix2, ...]``.

**The format** (Megatron-LM ``megatron/core/datasets/indexed_dataset.py``, "MMIDIDX"): ``PREFIX.bin`` holds the
token ids of every sequence back to back in one dtype; ``PREFIX.idx`` is, little-endian::

    b"MMIDIDX\\x00\\x00"             9 bytes, the magic
    version            <Q         1
    dtype code         <B         1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence count N   <Q
    document count M   <Q         documents + 1
    sizes              <i4 × N    tokens per sequence
    pointers           <i8 × N    byte offset of each sequence in .bin
    document indices   <i8 × M    document d = sequences [doc[d], doc[d+1]); doc[0] = 0, doc[M-1] = N

**Samples** (Megatron's GPTDataset, re-derived): the training split's documents (``data.splits_string``, the
first share of documents) are shuffled once per epoch with the seed and concatenated into one token
stream, epochs after each other; sample ``i`` is the ``seq_length + 1`` tokens from position
``i·seq_length`` (consecutive samples share one token, so every token but the first is a target once), and
the samples are shuffled. Three arrays hold this — the document order, each sample's (position in that
order, offset) start, the sample shuffle — and are cached as ``.npy`` files (never pickle) in
``data.index_mapping_dir`` (default: beside the ``.idx``), named by a digest of what they depend on (the
files' sizes and mtimes, split, seq_length, sample count, seed) and checked against a description file
on load, so a changed dataset or setting builds them anew.

**Blending**: dataset ``j`` with normalised weight ``w_j`` places its ``k``-th sample at time ``(k+½)/w_j``;
the blended stream is every dataset's samples in time order (ties: dataset order). At every prefix of ``n``
samples, dataset ``j`` has ``w_j·n`` of them to within ``½ + m·w_j/2`` (``m`` datasets): see
:func:`blend_index`.

Pure numpy/torch; the converter (``nxdt data convert-megatron``, :func:`convert`) writes the format from
text or JSONL with nxdt's tokenizers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from nxdt.data import mix_seed

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_HEADER = struct.Struct("<QBQQ")  # version, dtype code, sequence count, document count (after the magic)
INDEX_FORMAT = 1  # of the cached .npy index mapping; part of its digest


class IndexedDataError(ValueError):
    """A data prefix that cannot be read as an indexed dataset: ``fix`` is the one-line reason and remedy."""

    def __init__(self, fix: str) -> None:
        self.fix = fix
        super().__init__(fix)


# ------------------------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class IndexedDataset:
    """One ``PREFIX.bin``/``PREFIX.idx`` pair: sizes, pointers, document indices and the memory-mapped tokens."""

    prefix: str
    dtype: np.dtype
    sizes: np.ndarray  # int32 [N]
    pointers: np.ndarray  # int64 [N], bytes
    document_indices: np.ndarray  # int64 [M]
    tokens: np.ndarray  # memmap of .bin in dtype

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __len__(self) -> int:
        return len(self.sizes)

    def sequence(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.sizes[i])]

    def document_lengths(self) -> np.ndarray:
        """Tokens per document (the sum of its sequences), int64 [M-1]."""
        ends = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)])
        return ends[self.document_indices[1:]] - ends[self.document_indices[:-1]]

    def document(self, d: int) -> np.ndarray:
        first, last = int(self.document_indices[d]), int(self.document_indices[d + 1])
        parts = [self.sequence(i) for i in range(first, last)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else self.tokens[:0]


def read_index(prefix: str | Path) -> IndexedDataset:
    """Open ``prefix``'s ``.idx`` and ``.bin`` (checked: magic, version, dtype, lengths, every sequence inside the
    ``.bin``); raises :class:`IndexedDataError`."""
    prefix = str(prefix)
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    for f in (idx, bin_):
        if not f.is_file():
            raise IndexedDataError(
                f"no {f.name} beside it ({f}); a data prefix names PREFIX.bin and PREFIX.idx without "
                "the extension (nxdt data convert-megatron writes them)"
            )
    size = idx.stat().st_size
    with open(idx, "rb") as fh:
        head = fh.read(len(MAGIC) + _HEADER.size)
    if head[: len(MAGIC)] != MAGIC:
        raise IndexedDataError(
            f"{idx.name} is not a Megatron indexed-dataset index (no MMIDIDX header); only the "
            "mmap format (data_impl: mmap) is read"
        )
    if len(head) < len(MAGIC) + _HEADER.size:
        raise IndexedDataError(f"{idx.name} is truncated ({size} bytes, shorter than its header)")
    version, code, n, m = _HEADER.unpack(head[len(MAGIC) :])
    if version != VERSION:
        raise IndexedDataError(f"{idx.name} has index version {version}; nxdt reads version {VERSION}")
    if code not in DTYPES:
        raise IndexedDataError(f"{idx.name} has dtype code {code}; known codes are {sorted(DTYPES)}")
    offset = len(MAGIC) + _HEADER.size
    expected = offset + 4 * n + 8 * n + 8 * m
    if size not in (expected, expected + n):  # + n: Megatron's optional per-sequence modes (int8), not used here
        raise IndexedDataError(
            f"{idx.name} is {size} bytes, but its header ({n} sequences, {m} document indices) needs "
            f"{expected}; the file is damaged or was written by another tool"
        )
    sizes: np.ndarray = np.memmap(idx, dtype="<i4", mode="r", offset=offset, shape=(n,)) if n else np.zeros(0, np.int32)
    pointers: np.ndarray = (
        np.memmap(idx, dtype="<i8", mode="r", offset=offset + 4 * n, shape=(n,)) if n else np.zeros(0, np.int64)
    )
    docs: np.ndarray = (
        np.array(np.memmap(idx, dtype="<i8", mode="r", offset=offset + 12 * n, shape=(m,))) if m else np.zeros(0, np.int64)
    )
    dtype = np.dtype(DTYPES[code]).newbyteorder("<")
    if m < 1 or docs[0] != 0 or docs[-1] != n or np.any(np.diff(docs) < 0):
        raise IndexedDataError(f"{idx.name}: its document indices must rise from 0 to the sequence count {n}")
    bin_size = bin_.stat().st_size
    if n and (
        np.any(sizes < 0)
        or np.any(pointers < 0)
        or np.any(pointers % dtype.itemsize)
        or int((pointers + sizes.astype(np.int64) * dtype.itemsize).max()) > bin_size
    ):
        raise IndexedDataError(
            f"{bin_.name} ({bin_size} bytes) does not hold every sequence {idx.name} points to; the "
            ".bin and .idx do not belong together"
        )
    tokens = np.memmap(bin_, dtype=dtype, mode="r") if bin_size else np.zeros(0, dtype)
    return IndexedDataset(prefix, dtype, sizes, pointers, docs, tokens)


# ------------------------------------------------------------------------------------------------ writing


def best_dtype(vocab_size: int) -> type:
    """Megatron's choice: uint16 below 65500 ids, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def write_indexed(prefix: str | Path, documents: Iterable[Sequence[int]], dtype: type) -> int:
    """Write ``PREFIX.bin``/``.idx``, one sequence per document; returns the document count."""
    code = {np.dtype(v): k for k, v in DTYPES.items()}[np.dtype(dtype)]
    item = np.dtype(dtype).itemsize
    sizes: list[int] = []
    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    # both files are written under temporary names and renamed into place at the end: a bad input document
    # (a missing field on line 1000) leaves no half-written .bin behind, and a link at PREFIX.bin is replaced,
    # never written through
    tmp = f"{prefix}.tmp-{os.getpid()}"
    try:
        with open(tmp + ".bin", "xb") as fh:
            for doc in documents:
                arr = np.asarray(doc, dtype=np.int64)
                info = np.iinfo(dtype)
                if arr.size and (arr.min() < info.min or arr.max() > info.max):
                    raise ValueError(f"token id {int(arr.max())} does not fit {np.dtype(dtype).name}")
                fh.write(arr.astype(np.dtype(dtype).newbyteorder("<")).tobytes())
                sizes.append(arr.size)
        n = len(sizes)
        sizes_arr = np.asarray(sizes, dtype="<i4")
        pointers = (
            np.concatenate([[0], np.cumsum(sizes_arr[:-1], dtype=np.int64)]).astype("<i8") * item if n else np.zeros(0, "<i8")
        )
        docs: np.ndarray = np.arange(n + 1, dtype="<i8")
        with open(tmp + ".idx", "xb") as fh:
            fh.write(MAGIC + _HEADER.pack(VERSION, code, n, n + 1))
            fh.write(sizes_arr.tobytes() + pointers.tobytes() + docs.tobytes())
        os.replace(tmp + ".bin", prefix + ".bin")
        os.replace(tmp + ".idx", prefix + ".idx")
    finally:
        for leftover in (tmp + ".bin", tmp + ".idx"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)
    return n


# ------------------------------------------------------------------------------------------------ blend and split


def parse_data_prefix(value: Any) -> list[tuple[float, str]]:
    """NxDT's ``data.data_prefix``: ``[w1, p1, w2, p2, ...]``, one path (weight 1) as a string or a one-item list,
    or a dict whose ``train`` entry is one of those. Returns (weight, prefix) pairs, weights normalised to sum 1;
    raises :class:`IndexedDataError` naming what is wrong."""
    if isinstance(value, Mapping):  # plain containers or OmegaConf's
        if "train" not in value:
            raise IndexedDataError("as a dict it needs a train entry: {train: [1.0, /path/prefix]}")
        value = value["train"]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Sequence) or not value:
        raise IndexedDataError("give [weight, prefix, weight, prefix, ...] (or one prefix)")
    if len(value) == 1:
        if not isinstance(value[0], str):
            raise IndexedDataError("a single entry must be a path prefix")
        return [(1.0, value[0])]
    if len(value) % 2:
        raise IndexedDataError(f"has {len(value)} entries; give pairs: [weight, prefix, weight, prefix, ...]")
    pairs = []
    for w, p in zip(value[0::2], value[1::2]):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise IndexedDataError(f"weight {w!r} (before {p!r}) is not a positive number; give [weight, prefix, ...]")
        if not isinstance(p, str) or not p:
            raise IndexedDataError(f"{p!r} (after weight {w}) is not a path prefix; give [weight, prefix, ...]")
        pairs.append((float(w), p))
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


def train_split_end(num_documents: int, splits_string: str | None) -> int:
    """How many leading documents form the training split (Megatron's ``splits_string``, e.g. ``"980,10,10"``:
    shares rounded per split, the last boundary moved to the document count). ``None`` = all of them."""
    if splits_string is None:
        return num_documents
    try:
        shares = [float(s) for s in str(splits_string).replace("/", ",").split(",") if s.strip()]
    except ValueError:
        shares = [-1.0]
    shares = (shares + [0.0, 0.0, 0.0])[:3]
    total = sum(shares)
    if not np.isfinite(total) or total <= 0 or any(s < 0 for s in shares):
        raise IndexedDataError(f"splits_string={splits_string!r}: give non-negative shares that sum above 0, e.g. 980,10,10")
    bounds = [0]
    for s in shares:
        bounds.append(bounds[-1] + int(round(s / total * num_documents)))
    return min(num_documents, max(0, bounds[1] - (bounds[-1] - num_documents)))  # every boundary moves by the rounding excess


def blend_index(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each blended sample, that dataset's sample number), both int64 [num_samples].

    Dataset ``j``'s ``k``-th sample sits at time ``t = (k+½)/w_j``; samples are taken in time order. If the
    ``n``-th sample is at time ``T``, dataset ``j`` holds the ``k`` with ``(k+½)/w_j ≤ T``: between ``w_j·T − ½``
    and ``w_j·T + ½`` of them; summing over the ``m`` datasets, ``T − m/2 ≤ n ≤ T + m/2``, so
    ``|count_j − w_j·n| ≤ ½ + m·w_j/2`` at every prefix."""
    w = np.asarray(weights, dtype=np.float64)
    if num_samples < 0 or w.ndim != 1 or not len(w) or np.any(w <= 0):
        raise ValueError(f"blend_index needs positive weights and num_samples >= 0, got {list(weights)}, {num_samples}")
    w = w / w.sum()
    per = np.ceil(w * num_samples).astype(np.int64) + 1  # enough candidates of each dataset for the first num_samples
    dataset: np.ndarray = np.repeat(np.arange(len(w)), per)
    k = np.concatenate([np.arange(c) for c in per])
    order = np.argsort((k + 0.5) / w[dataset], kind="stable")[:num_samples]
    return dataset[order].astype(np.int64), k[order].astype(np.int64)


# ------------------------------------------------------------------------------------------------ GPT samples


def build_sample_index(
    doc_lengths: np.ndarray, num_samples: int, seq_length: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document order over epochs, sample starts [num_samples, 2] = (position in that order, token offset), sample
    shuffle) for ``num_samples`` samples of ``seq_length + 1`` tokens; see the module docstring."""
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    per_epoch = int(lengths.sum())
    if per_epoch < seq_length + 1:
        raise IndexedDataError(
            f"holds {per_epoch} tokens in its training split, too few for one sample of seq_length="
            f"{seq_length} (+1 for the shifted label); convert more text or shorten data.seq_length"
        )
    needed = num_samples * seq_length + 1  # the last sample ends one token past its seq_length
    epochs = max(1, -(-needed // per_epoch))
    order = np.concatenate(
        [np.random.Generator(np.random.PCG64(mix_seed(seed, 0x4D45, e))).permutation(len(lengths)) for e in range(epochs)]
    ).astype(np.int64)
    ends = np.cumsum(lengths[order])  # token position where each document of the order ends
    starts: np.ndarray = np.arange(num_samples, dtype=np.int64) * seq_length
    pos = np.searchsorted(ends, starts, side="right")  # the document holding each sample's first token
    offset = starts - (ends[pos] - lengths[order][pos])
    shuffle = np.random.Generator(np.random.PCG64(mix_seed(seed, 0x5348, num_samples))).permutation(num_samples)
    return order, np.stack([pos, offset], axis=1).astype(np.int64), shuffle.astype(np.int64)


def _description(data: IndexedDataset, split_end: int, num_samples: int, seq_length: int, seed: int) -> dict[str, Any]:
    files = {}
    for ext in (".idx", ".bin"):
        st = os.stat(data.prefix + ext)
        files[ext] = [st.st_size, st.st_mtime_ns]
    return {
        "format": INDEX_FORMAT,
        "prefix": str(Path(data.prefix).resolve()),
        "files": files,
        "train_documents": split_end,
        "num_samples": num_samples,
        "seq_length": seq_length,
        "seed": seed,
    }


KINDS = ("doc_order", "sample_starts", "shuffle")


def cached_sample_index(
    data: IndexedDataset, split_end: int, num_samples: int, seq_length: int, seed: int, cache_dir: str | Path | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`build_sample_index` for the first ``split_end`` documents, through the ``.npy`` cache in ``cache_dir``
    (None: beside the ``.idx``). A cache whose description differs, or that does not load, is rebuilt; files are
    written to a temporary name and renamed, so ranks building at once never read half a file."""
    desc = _description(data, split_end, num_samples, seq_length, seed)
    text = json.dumps(desc, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    where = Path(cache_dir) if cache_dir is not None else Path(data.prefix).parent
    stem = where / f"{Path(data.prefix).name}_{digest}"
    arrays = _load_cache(stem, text, num_samples, data.document_lengths()[:split_end], seq_length)
    if arrays is not None:
        return arrays
    arrays = build_sample_index(data.document_lengths()[:split_end], num_samples, seq_length, seed)
    try:
        where.mkdir(parents=True, exist_ok=True)
        for kind, arr in zip(KINDS, arrays):
            _atomic_write(Path(f"{stem}_{kind}.npy"), lambda fh, a=arr: np.save(fh, a, allow_pickle=False))
        _atomic_write(Path(f"{stem}_desc.json"), lambda fh: fh.write(text.encode()))  # last: marks the set complete
    except OSError:  # e.g. a read-only dataset directory: train from the arrays just built, uncached
        pass
    return arrays


def _load_cache(
    stem: Path, text: str, num_samples: int, lengths: np.ndarray, seq_length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The cached arrays if they are whole and describe this dataset, else None (rebuilt). Their values are checked
    too (vectorised: the cost of reading them): a cache is a file anyone with write access to the dataset directory
    can change, and an index outside its range (a tampered or damaged cache) failed inside every worker with an
    IndexError. Every sample must start inside a document of the order and have its seq_length + 1 tokens after."""
    try:
        with _open_regular(Path(f"{stem}_desc.json")) as fh:
            if fh.read(len(text.encode()) + 1).decode() != text:
                return None
        order, starts, shuffle = (_load_npy(Path(f"{stem}_{kind}.npy")) for kind in KINDS)
    except (OSError, ValueError, UnicodeDecodeError, EOFError):
        return None
    if starts.shape != (num_samples, 2) or shuffle.shape != (num_samples,) or order.ndim != 1 or not len(order):
        return None
    if any(a.dtype.kind not in "iu" for a in (order, starts, shuffle)):
        return None
    if order.min() < 0 or order.max() >= len(lengths) or not np.array_equal(np.sort(shuffle), np.arange(num_samples)):
        return None
    pos, offset = starts[:, 0], starts[:, 1]
    if pos.min() < 0 or pos.max() >= len(order) or offset.min() < 0:
        return None
    in_order = np.asarray(lengths, dtype=np.int64)[order]
    ends = np.cumsum(in_order)
    first = ends[pos] - in_order[pos] + offset  # each sample's first token in the order's token stream
    if np.any(offset >= np.maximum(in_order[pos], 1)) or np.any(first + seq_length + 1 > ends[-1]):
        return None
    return order, starts, shuffle


def _open_regular(path: Path) -> Any:
    """``path`` opened for reading if it is a regular file. A FIFO or a device put in a cache file's place would block
    every rank's read (or never end: /dev/zero); opening without blocking and checking the type turns it into a
    cache miss."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return os.fdopen(fd, "rb")


def _load_npy(path: Path) -> np.ndarray:
    with _open_regular(path) as fh:
        return np.load(fh, allow_pickle=False)


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        write(fh)
    os.replace(tmp, path)


class GPTSamples:
    """``num_samples`` samples of ``seq_length + 1`` tokens over one indexed dataset's training split."""

    def __init__(
        self,
        data: IndexedDataset,
        num_samples: int,
        seq_length: int,
        seed: int,
        *,
        splits_string: str | None = None,
        cache_dir: str | Path | None = None,
    ) -> None:
        self.data, self.seq_length = data, seq_length
        split_end = train_split_end(data.num_documents, splits_string)
        self.order, self.starts, self.shuffle = cached_sample_index(data, split_end, num_samples, seq_length, seed, cache_dir)

    def __len__(self) -> int:
        return len(self.shuffle)

    def tokens(self, i: int) -> np.ndarray:
        pos, offset = (int(v) for v in self.starts[int(self.shuffle[i])])
        need, parts = self.seq_length + 1, []
        while need > 0:
            doc = self.data.document(int(self.order[pos]))[offset : offset + need]
            parts.append(doc)
            need -= len(doc)
            pos, offset = pos + 1, 0
        return np.concatenate(parts).astype(np.int64)


class BlendedMegatronData(Dataset):
    """NxDT's Megatron data: ``data_prefix`` datasets blended by weight into ``num_samples`` samples of
    ``{"input_ids", "labels"}`` (``seq_length`` each, labels shifted by one)."""

    def __init__(
        self,
        data_prefix: Any,
        num_samples: int,
        seq_length: int,
        seed: int,
        *,
        vocab_size: int | None = None,
        splits_string: str | None = None,
        index_mapping_dir: str | Path | None = None,
    ) -> None:
        pairs = parse_data_prefix(data_prefix)
        self.which, self.local = blend_index([w for w, _ in pairs], num_samples)
        counts = np.bincount(self.which, minlength=len(pairs))
        self.parts = []
        for j, (_, prefix) in enumerate(pairs):
            data = read_index(prefix)
            self.parts.append(
                GPTSamples(
                    data,
                    max(1, int(counts[j])),
                    seq_length,
                    mix_seed(seed, j),
                    splits_string=splits_string,
                    cache_dir=index_mapping_dir,
                )
            )
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return len(self.which)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} outside 0..{len(self) - 1}")
        window = torch.from_numpy(self.parts[int(self.which[index])].tokens(int(self.local[index])))
        if self.vocab_size is not None and (window.min() < 0 or window.max() >= self.vocab_size):
            raise ValueError(
                f"token id {int(window.max())} of data.data_prefix is outside model.vocab_size={self.vocab_size}; "
                "convert the data with the model's tokenizer"
            )
        return {"input_ids": window[:-1], "labels": window[1:]}


def check_data_prefix(data_prefix: Any, vocab_size: int) -> None:
    """The launcher's check: a valid data_prefix whose every ``.idx``/``.bin`` pair reads, with token ids of the
    dtype's range below ``vocab_size`` in its first sequence. Raises :class:`IndexedDataError`."""
    for _, prefix in parse_data_prefix(data_prefix):
        try:
            data = read_index(prefix)
        except IndexedDataError as exc:
            raise IndexedDataError(f"{prefix}: {exc.fix}") from None
        if len(data) and len(data.sequence(0)) and int(data.sequence(0).max()) >= vocab_size:
            raise IndexedDataError(
                f"{prefix}: token id {int(data.sequence(0).max())} is outside model.vocab_size={vocab_size}; "
                "convert the data with the model's tokenizer"
            )


# ------------------------------------------------------------------------------------------------ converter


def read_documents(path: Path, json_key: str) -> Iterable[str]:
    """JSONL (``*.jsonl``/``*.json``): one document per line, its ``json_key`` field; anything else: the file is one
    document of UTF-8 text."""
    if path.suffix in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not a JSON line ({exc.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
                    raise ValueError(f"{path}:{n}: no string field {json_key!r} (choose it with --json-key)")
                yield record[json_key]
    else:
        yield path.read_text(encoding="utf-8")


def convert(
    inputs: Sequence[str | Path], output_prefix: str | Path, tokenizer, *, json_key: str = "text", eod_id: int | None = None
) -> int:
    """Tokenize every document of ``inputs`` (an EOD id after each when given) into ``output_prefix``.bin/.idx."""
    vocab = max(tokenizer.vocab_size, (eod_id or 0) + 1)

    def documents():
        for path in inputs:
            for text in read_documents(Path(path), json_key):
                ids = tokenizer.encode(text)
                yield ids + [eod_id] if eod_id is not None else ids

    return write_indexed(output_prefix, documents(), best_dtype(vocab))


CONVERT_USAGE = """usage: nxdt data convert-megatron INPUT... --output-prefix PREFIX [--tokenizer PATH] [--json-key KEY] [--eod-id N]

Writes Megatron's indexed dataset PREFIX.bin/PREFIX.idx (what data.data_prefix names) from text: *.jsonl files
give one document per line (its KEY field, default text), other files one document each. --tokenizer: a
Hugging Face tokenizer.json (or its directory); default byte-level. --eod-id: a token id appended to every
document (Megatron's --append-eod)."""


def main(argv: Sequence[str], parser_class: type | None = None) -> int:
    """``nxdt data convert-megatron``; ``parser_class``: the argparse parser the CLI refuses bad flags with (one line,
    ``nxdt.topology.nccom.OneLineParser``; this layer imports nothing of nxdt's upper layers)."""
    import argparse
    import sys

    from nxdt.data.files import not_regular
    from nxdt.data.tokenizers import build_tokenizer

    parser = (parser_class or argparse.ArgumentParser)(
        prog="nxdt data convert-megatron", usage=CONVERT_USAGE.splitlines()[0][7:], add_help=True
    )
    parser.add_argument("inputs", nargs="+")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--eod-id", type=int, default=None)
    args = parser.parse_args(list(argv))
    from nxdt.config.validate import output_path_problem  # system directories: refused as for every output

    problem = output_path_problem(f"{args.output_prefix}.bin", directory=True) or output_path_problem(
        f"{args.output_prefix}.idx", directory=True
    )  # a system directory or a link at PREFIX.bin/.idx refused; an existing file there is replaced (write_indexed)
    if problem is not None:
        print(f"nxdt data convert-megatron: --output-prefix {args.output_prefix!r} {problem}", file=sys.stderr)
        return 2
    try:
        tokenizer = build_tokenizer(args.tokenizer)
        for path in args.inputs:
            if not Path(path).is_file():
                kind = not_regular(path)
                raise FileNotFoundError(f"{path}: {'no such file' if kind is None else f'is {kind}, not a regular file'}")
        n = convert(args.inputs, args.output_prefix, tokenizer, json_key=args.json_key, eod_id=args.eod_id)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"nxdt data convert-megatron: {exc}", file=sys.stderr)
        return 2
    print(f"nxdt: wrote {args.output_prefix}.bin and .idx ({n} documents)")
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
