"""Opening training data: regular files only, read with caps.

``data.train_dir=/dev/zero`` read a single endless "line" until the OOM killer came (20 GB); a FIFO as
``train_dir`` blocked the launcher forever on ``open``. Every data file nxdt reads record by record goes through
:func:`open_regular` (opened non-blocking, then checked on the descriptor it got: no race between a check and
the open) and :func:`read_lines` (a line longer than :data:`MAX_RECORD_BYTES`, or more than :data:`MAX_RECORDS`
records, is refused with the file and line named, before memory runs out). Links are followed: datasets are
often linked into place, and what counts is what they name.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO, Iterator

# One JSON-lines record (an instruction or preference record, its prompt included): real records are KBs; the
# longest chat records of public SFT sets are under 1 MB.
MAX_RECORD_BYTES = 16 << 20
# Records read into memory from one data.train_dir / val_dir (each a Python dict of strings: ~1 KB and more).
MAX_RECORDS = 10_000_000


class DataFileError(ValueError):
    """A data file nxdt will not read (not a regular file, a line or a record count over the caps)."""


def file_kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def not_regular(path: str | Path) -> str | None:
    """Why ``path`` (followed if a link) exists but is not a regular file; None when it is one or is missing."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else file_kind(mode)


def open_regular(path: str | Path) -> BinaryIO:
    """``path`` opened for reading in binary mode, if it is a regular file; :class:`DataFileError` otherwise.
    O_NONBLOCK makes opening a FIFO return at once instead of waiting for a writer; the check is on what was opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise DataFileError(f"{path} is {file_kind(mode)}, not a regular file; give a file of records")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_lines(path: str | Path, max_line: int = MAX_RECORD_BYTES) -> Iterator[tuple[int, str]]:
    """(line number, text) of a UTF-8 file of lines, each read with at most ``max_line`` bytes in memory."""
    with open_regular(path) as fh:
        lineno = 0
        while True:
            raw = fh.readline(max_line + 1)
            if not raw:
                return
            lineno += 1
            if len(raw) > max_line:
                raise DataFileError(
                    f"{path}:{lineno}: a line longer than {max_line >> 20} MiB, more than one record can be "
                    "(is this a JSON-lines file?); split it into one record per line"
                )
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataFileError(f"{path}:{lineno}: not UTF-8 (invalid byte at column {exc.start + 1})") from None
