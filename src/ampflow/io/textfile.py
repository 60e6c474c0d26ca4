"""Open plain or gzipped text by content (magic bytes), not by file name."""

from __future__ import annotations

import gzip
import io
import zlib
from pathlib import Path

from ..base.errors import InputError, require_file

GZIP_MAGIC = b"\x1f\x8b"
# what Python's gzip raises on a damaged stream: a cut file (EOFError), a bad header or
# CRC/length trailer (BadGzipFile, an OSError), corrupt deflate data (zlib.error)
GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)


def is_gzip(path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(2) == GZIP_MAGIC


def gzip_error(path, e: BaseException) -> InputError:
    """The InputError for a damaged gzip stream in ``path``."""
    return InputError(f"cannot read (truncated or corrupt gzip?): {e}", path=path)


class _CheckedGzip(gzip.GzipFile):
    """A GzipFile whose read errors name the file as an InputError, wherever the read
    happens (inside a TextIOWrapper, csv, pandas)."""

    def __init__(self, path):
        self._path = Path(path)
        super().__init__(path, "rb")

    def _checked(self, method, *args):
        try:
            return method(*args)
        except GZIP_ERRORS as e:
            raise gzip_error(self._path, e) from None

    def read(self, size=-1):
        return self._checked(super().read, size)

    def read1(self, size=-1):
        return self._checked(super().read1, size)

    def readinto(self, b):
        return self._checked(super().readinto, b)

    def readinto1(self, b):
        return self._checked(super().readinto1, b)

    def peek(self, n):
        return self._checked(super().peek, n)

    def readline(self, size=-1):
        return self._checked(super().readline, size)


def open_binary(path):
    """A binary handle on ``path``'s content, decompressing gzip transparently; a damaged
    gzip stream raises InputError naming ``path`` when read."""
    path = require_file(path)
    if is_gzip(path):
        return _CheckedGzip(path)
    return open(path, "rb")


def open_text(path):
    """A text handle on ``path``, decompressing gzip transparently.

    ``utf-8-sig`` drops a byte-order mark (spreadsheet exports) and reads plain UTF-8
    unchanged; undecodable bytes become U+FFFD, which every reader then reports as a bad
    value on its line. A damaged gzip stream raises InputError naming ``path``.
    """
    path = require_file(path)
    if is_gzip(path):
        return io.TextIOWrapper(_CheckedGzip(path), encoding="utf-8-sig", errors="replace")
    return open(path, encoding="utf-8-sig", errors="replace")


def numbered_lines(path):
    """Yield ``(line number, line)`` from 1; a truncated or corrupt gzip raises InputError."""
    with open_text(path) as fh:
        yield from enumerate(fh, 1)
