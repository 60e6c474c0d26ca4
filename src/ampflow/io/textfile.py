"""Open plain or gzipped text by content (magic bytes), not by file name."""

from __future__ import annotations

import gzip
import io
import zlib
from pathlib import Path

from .errors import InputError

GZIP_MAGIC = b"\x1f\x8b"


def is_gzip(path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(2) == GZIP_MAGIC


def open_text(path):
    """A text handle on ``path``, decompressing gzip transparently.

    ``utf-8-sig`` drops a byte-order mark (spreadsheet exports) and reads plain UTF-8
    unchanged.
    """
    path = Path(path)
    if is_gzip(path):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig", errors="replace")
    return open(path, encoding="utf-8-sig", errors="replace")


def numbered_lines(path):
    """Yield ``(line number, line)`` from 1; a truncated or corrupt gzip raises InputError."""
    try:
        with open_text(path) as fh:
            yield from enumerate(fh, 1)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise InputError(f"cannot read (truncated or corrupt gzip?): {e}", path=path) from None
