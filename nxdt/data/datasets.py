"""Datasets yielding ``{"input_ids": LongTensor[S], "labels": LongTensor[S]}`` with labels shifted by one
(``labels[t]`` is the token after ``input_ids[t]``), so the model's loss needs no shifting.

* :class:`SyntheticTokens` — no files; sequences of a fixed random Markov chain, so a model can learn
  and the loss really falls. Sample ``i`` depends only on ``(seed, i)``.
* :class:`PackedText` — a UTF-8 text file (or a directory of ``*.txt`` files) tokenized once and cut into
  consecutive windows.
"""

from __future__ import annotations

import codecs
from collections import OrderedDict
from pathlib import Path

import torch
from torch.utils.data import Dataset

from nxdt.data import mix_seed
from nxdt.data.files import DataFileError, not_regular
from nxdt.data.tokenizers import ByteTokenizer


class SyntheticTokens(Dataset):
    """Deterministic token sequences from a fixed random Markov chain.

    Every token has ``branching`` possible successors drawn once from ``seed``; a sequence starts at a
    random token and picks one successor uniformly at each step. The best achievable loss is
    therefore about ln(branching) (≈1.39 for 4) against ln(vocab_size) for an untrained model.
    Sample ``i`` is generated from its own generator seeded by ``(seed, i)``: independent of access
    order, process and worker, which the data-parallel equality and exact resume rely on.
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int, branching: int = 4) -> None:
        if num_samples < 1 or seq_length < 1 or vocab_size < 2 or branching < 1:
            raise ValueError(
                f"SyntheticTokens needs num_samples>=1, seq_length>=1, vocab_size>=2, branching>=1; got "
                f"{num_samples}, {seq_length}, {vocab_size}, {branching}"
            )
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed
        g = torch.Generator().manual_seed(mix_seed(seed, 0x5EED))
        # a plain list: indexing it in the generation loop is ~50x faster than indexing a tensor
        self.successors: list[list[int]] = torch.randint(0, vocab_size, (vocab_size, branching), generator=g).tolist()
        self.branching = branching

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} outside 0..{self.num_samples - 1}")
        g = torch.Generator().manual_seed(mix_seed(self.seed, index))
        token = int(torch.randint(0, self.vocab_size, (1,), generator=g))
        choices = torch.randint(0, self.branching, (self.seq_length,), generator=g).tolist()
        tokens = [token]
        for c in choices:
            token = self.successors[token][c]
            tokens.append(token)
        seq = torch.tensor(tokens, dtype=torch.long)
        return {"input_ids": seq[:-1], "labels": seq[1:]}


# Text is read and tokenized in chunks of this many characters, so a large file never exists as one
# Python list of ints (~36 bytes per token); tokens are kept in the smallest integer dtype that holds
# the vocabulary (1 byte per token for byte-level).
_CHUNK_CHARS = 4 << 20
# Tokenized files kept in memory per process, keyed by files (path, size, mtime) and tokenizer, so a
# second setup() (another fit in the same process, tests) does not tokenize again.
_TOKEN_CACHE: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_TOKEN_CACHE_ENTRIES = 4


def token_dtype(vocab_size: int) -> torch.dtype:
    if vocab_size <= 256:
        return torch.uint8
    if vocab_size <= 2**15:
        return torch.int16
    if vocab_size <= 2**31:
        return torch.int32
    return torch.int64


def text_files(path: str | Path) -> list[Path]:
    """``path`` itself if it is a file, else the ``*.txt`` files under the directory, in sorted order."""
    path = Path(path)
    if path.is_file():
        return [path]
    kind = not_regular(path)
    if kind is not None and kind != "a directory":  # /dev/zero, a FIFO: endless or blocking reads
        raise DataFileError(f"training text {path} is {kind}, not a regular file; give a UTF-8 text file or a directory")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise FileNotFoundError(
                f"training text directory {path} holds no *.txt file — put UTF-8 text files there "
                f"or point data.train_dir at a text file"
            )
        return files
    raise FileNotFoundError(
        f"training text {path}: no such file or directory — set data.train_dir to a UTF-8 text file or a "
        f"directory of *.txt files (null = the shipped sample text)"
    )


def _tokenize_bytes(file: Path) -> torch.Tensor:
    """Byte-level fast path: the file's bytes are the tokens; only check they are UTF-8."""
    data = bytearray(file.read_bytes())
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(data)
    for start in range(0, len(data), _CHUNK_CHARS):
        try:
            decoder.decode(view[start : start + _CHUNK_CHARS], final=start + _CHUNK_CHARS >= len(data))
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"training text {file} is not UTF-8 (invalid byte at offset {start + exc.start}) — "
                f"convert it, e.g. iconv -t UTF-8"
            ) from exc
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _tokenize_chunked(file: Path, tokenizer, dtype: torch.dtype) -> torch.Tensor:
    parts, carry = [], ""
    # newline="": no newline translation, so the text is exactly the file's (as the byte path sees it)
    with open(file, encoding="utf-8", newline="") as fh:
        while True:
            try:
                chunk = fh.read(_CHUNK_CHARS)
            except UnicodeDecodeError as exc:
                raise ValueError(f"training text {file} is not UTF-8 ({exc.reason}) — convert it, e.g. iconv -t UTF-8") from exc
            if not chunk:
                break
            text = carry + chunk
            # cut after the last newline so a subword tokenizer never sees a word split across chunks
            cut = text.rfind("\n") + 1
            if cut == 0:
                carry = text
                continue
            parts.append(torch.tensor(tokenizer.encode(text[:cut]), dtype=dtype))
            carry = text[cut:]
    if carry:
        parts.append(torch.tensor(tokenizer.encode(carry), dtype=dtype))
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)


def tokenize_files(files: list[Path], tokenizer) -> torch.Tensor:
    """All files' tokens, one after another, in a compact dtype; cached per process."""
    key = (
        tuple(getattr(tokenizer, "cache_key", (id(tokenizer),))),
        tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files),
    )
    if key in _TOKEN_CACHE:
        _TOKEN_CACHE.move_to_end(key)
        return _TOKEN_CACHE[key]
    dtype = token_dtype(tokenizer.vocab_size)
    parts = []
    for f in files:
        if f.stat().st_size == 0:
            raise ValueError(f"training text {f} is empty — give a non-empty UTF-8 text file")
        if isinstance(tokenizer, ByteTokenizer):
            parts.append(_tokenize_bytes(f))
        else:
            parts.append(_tokenize_chunked(f, tokenizer, dtype))
    tokens = torch.cat(parts) if len(parts) > 1 else parts[0]
    _TOKEN_CACHE[key] = tokens
    while len(_TOKEN_CACHE) > _TOKEN_CACHE_ENTRIES:
        _TOKEN_CACHE.popitem(last=False)
    return tokens


class PackedText(Dataset):
    """A UTF-8 text file (or directory of ``*.txt`` files) tokenized once and cut into windows.

    Window ``i`` is tokens ``[i·S, i·S + S]`` (S + 1 tokens): ``input_ids`` are its first S, ``labels`` its
    last S. Consecutive windows' inputs tile the text without overlap and so do their labels, so every
    token but the first is a training target exactly once (Megatron's packing; a stride of S + 1 would
    never predict every (S+1)-th token). A trailing remainder shorter than a window is dropped.
    """

    def __init__(self, path: str | Path, tokenizer, seq_length: int) -> None:
        if seq_length < 1:
            raise ValueError(f"data.seq_length={seq_length} must be >= 1")
        self.path, self.seq_length = Path(path), seq_length
        self.tokens = tokenize_files(text_files(self.path), tokenizer)
        if len(self) == 0:
            raise ValueError(
                f"training text {self.path} has {self.tokens.numel()} tokens, too short for one sample of "
                f"data.seq_length={seq_length} (+1 for the shifted label) — use a longer text or a "
                f"shorter seq_length"
            )

    def __len__(self) -> int:
        return max(0, (self.tokens.numel() - 1) // self.seq_length)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} outside 0..{len(self) - 1}")
        start = index * self.seq_length
        window = self.tokens[start : start + self.seq_length + 1].long()
        return {"input_ids": window[:-1], "labels": window[1:]}


SAMPLE_BYTES = 1024  # what the launcher reads of each training text file before any worker starts


class TextSourceError(ValueError):
    """A training text the workers could not read: ``fix`` is the one-line reason and remedy."""

    def __init__(self, fix: str) -> None:
        self.fix = fix
        super().__init__(fix)


def check_text_files(path: str | Path, seq_length: int, *, byte_level: bool) -> int:
    """The launcher's cheap check of ``data.source=text`` input: regular files, some ``*.txt`` files, none empty,
    the first ``SAMPLE_BYTES`` of each UTF-8 text (no NUL byte), and — byte-level, where a byte is a token —
    enough bytes for one sample. Reads at most ``SAMPLE_BYTES`` per file. Returns the files' total size (every
    rank holds the text's tokens in memory: :func:`tokenize_files`). Raises :class:`TextSourceError`."""
    path = Path(path)  # as the workers open it (no ~ expansion)
    if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        raise TextSourceError("is a Hugging Face save_to_disk dataset, not text; set data.source=hf_dataset")
    try:
        files = text_files(path)
    except DataFileError:
        raise TextSourceError(
            f"is {not_regular(path)}, not a regular file; give a UTF-8 text file or a directory of *.txt files"
        ) from None
    except FileNotFoundError:
        raise TextSourceError(
            "holds no *.txt file; put UTF-8 text files there or point data.train_dir at a text "
            "file (null = the shipped sample text)"
        ) from None
    total = 0
    for file in files:
        shown = str(file.relative_to(path)) if file != path else "the file"
        try:
            size = file.stat().st_size
            with open(file, "rb") as fh:
                head = fh.read(SAMPLE_BYTES)
        except OSError as exc:
            raise TextSourceError(f"cannot read {shown}: {exc.strerror or exc}; check its permissions") from None
        if size == 0:
            raise TextSourceError(f"{shown} is empty; remove it or give non-empty UTF-8 text")
        try:  # final=False: the sample may end inside a multi-byte character
            codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
            binary = b"\x00" in head
        except UnicodeDecodeError as exc:
            raise TextSourceError(
                f"{shown} is not UTF-8 text (invalid byte at offset {exc.start}); convert it, "
                "e.g. iconv -t UTF-8, or leave binary files out"
            ) from None
        if binary:
            raise TextSourceError(
                f"{shown} is binary (a NUL byte in its first {SAMPLE_BYTES} bytes), not UTF-8 text; "
                "leave binary files out of data.train_dir"
            )
        total += size
    if byte_level and total - 1 < seq_length:
        raise TextSourceError(
            f"holds {total} bytes (tokens, byte-level), too few for one sample of data.seq_length="
            f"{seq_length} (+1 for the shifted label); use a longer text or a shorter seq_length"
        )
    return total
