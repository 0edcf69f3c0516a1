"""Tokenizers: byte-level by default (no files, vocabulary 256), or a Hugging Face ``tokenizer.json``.

Both expose ``vocab_size``, ``encode(str) -> list[int]``, ``decode(ids) -> str`` and ``cache_key`` (what
identifies the token stream a text produces, so a tokenized file can be reused in memory).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Union


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255: any text, no vocabulary file, nothing unknown."""

    vocab_size = 256
    cache_key = ("byte",)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        # a window may start or end inside a multi-byte character: show it, do not fail
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (a file, or a model directory holding one) through the optional
    ``tokenizers`` package. ``encode`` adds no special tokens: text is packed into windows, where a BOS
    inserted per encoded chunk would land mid-document."""

    def __init__(self, path: str | Path) -> None:
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(
                f"data.tokenizer={path}: no tokenizer.json there — give the path of a Hugging Face "
                f"tokenizer.json (or its directory), or null for the byte-level tokenizer"
            )
        try:
            from tokenizers import Tokenizer  # optional: only needed for this tokenizer
        except ImportError as exc:
            raise RuntimeError(
                f"data.tokenizer={path}: reading tokenizer.json needs the 'tokenizers' package — pip install tokenizers"
            ) from exc
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # the package's own errors are terse and path-less
            raise ValueError(f"data.tokenizer={path}: {file} is not a valid tokenizer.json ({exc})") from exc
        self.path = file
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.cache_key = ("hf", str(file.resolve()), file.stat().st_mtime_ns)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


Tokenizer = Union[ByteTokenizer, HFTokenizer]


def build_tokenizer(path: str | Path | None) -> Tokenizer:
    """``None`` → byte-level; otherwise a ``tokenizer.json`` (or a directory holding one)."""
    return ByteTokenizer() if path is None else HFTokenizer(path)


MAX_TOKENIZER_BYTES = 1 << 30  # the largest tokenizer.json the launcher parses (real ones are a few MB)


class TokenizerFileError(ValueError):
    """A ``data.tokenizer`` the workers could not use: ``fix`` is the one-line reason and remedy."""

    def __init__(self, fix: str) -> None:
        self.fix = fix
        super().__init__(fix)


def check_tokenizer(path: str | Path, vocab_size: int) -> int:
    """The launcher's check of ``data.tokenizer``: loadable by ``tokenizers.Tokenizer.from_file`` and with every
    id below ``model.vocab_size``. Returns its vocabulary size; raises :class:`TokenizerFileError`."""
    file = Path(path)  # as the workers open it (no ~ expansion)
    file = file / "tokenizer.json" if file.is_dir() else file
    if file.is_file() and file.stat().st_size > MAX_TOKENIZER_BYTES:
        raise TokenizerFileError(
            f"{file.name} is {file.stat().st_size / 2**30:.1f} GiB, no tokenizer.json is that large; "
            "give the tokenizer.json saved with the model"
        )
    try:
        tokenizer = HFTokenizer(path)
    except FileNotFoundError:
        raise TokenizerFileError(
            "no tokenizer.json there; give a Hugging Face tokenizer.json (or its directory), or null for the byte-level tokenizer"
        ) from None
    except RuntimeError:
        raise TokenizerFileError("reading tokenizer.json needs the 'tokenizers' package: pip install 'nxdt[hf]'") from None
    except (ValueError, OSError) as exc:
        reason = str(exc.__cause__ or exc).splitlines()[0][:160] if str(exc.__cause__ or exc) else type(exc).__name__
        raise TokenizerFileError(
            f"not a valid tokenizer.json ({reason}); give the tokenizer.json saved with the model (tokenizer.save_pretrained)"
        ) from None
    if tokenizer.vocab_size > vocab_size:
        raise TokenizerFileError(
            f"has {tokenizer.vocab_size} token ids, model.vocab_size={vocab_size} has room for "
            f"fewer (ids would index past the embedding); set model.vocab_size >= "
            f"{tokenizer.vocab_size}, or use the model's own tokenizer"
        )
    return tokenizer.vocab_size
