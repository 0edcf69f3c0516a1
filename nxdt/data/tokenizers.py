"""Tokenizers: byte-level by default (no files needed), or a Hugging Face ``tokenizer.json``."""

from __future__ import annotations

from pathlib import Path


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` package (optional dependency)."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise RuntimeError(f"data.tokenizer={path}: reading tokenizer.json needs the 'tokenizers' package — pip install tokenizers") from exc
        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def build_tokenizer(path: str | Path | None) -> ByteTokenizer | HFTokenizer:
    return ByteTokenizer() if path is None else HFTokenizer(path)
