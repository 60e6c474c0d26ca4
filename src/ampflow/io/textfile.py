"""Open plain or gzipped text by content (magic bytes), not by file name."""

from __future__ import annotations

import gzip
import io
from pathlib import Path

GZIP_MAGIC = b"\x1f\x8b"


def is_gzip(path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(2) == GZIP_MAGIC


def open_text(path):
    """A text handle on ``path``, decompressing gzip transparently."""
    path = Path(path)
    if is_gzip(path):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")
