"""Fast path for pairs files: decompression in one thread, a compiled tokenizer in another.

zlib and the numba kernel both release the GIL, so on two cores parsing costs little
more than decompression alone. The kernel pulls out only the four needed columns and
stops at the first line it does not understand; the caller then falls back to the
general parser, which reports that line with its number and reason.
"""

from __future__ import annotations

import os
import queue
import threading
import zlib

import numpy as np

from ..base.jit import LazyJit
from .genome import ChromNamer

BLOCK = 1 << 22  # compressed bytes per read
FNV_OFFSET = 14695981039346656037
FNV_PRIME = 1099511628211
MAX_DIGITS = 18  # stays inside int64

try:  # ISA-L inflate: about twice zlib's speed, same stream format
    from isal.isal_zlib import decompressobj
    from isal.isal_zlib import error as _InflateError
except ImportError:  # pragma: no cover
    from zlib import decompressobj
    from zlib import error as _InflateError


def _kernel(buf, end, c1, p1, c2, p2, ws, tab_h, tab_off, tab_len, n_tab, chrom1, chrom2, pos1, pos2):
    """Scan complete lines in ``buf[:end]``; return (rows, ok).

    Chromosome tokens are hashed (FNV-1a) and looked up in a small table of the
    distinct names seen so far (``tab_*``, ``n_tab[0]`` entries); a new name is
    appended with its offset in ``buf`` so the caller can decode it once. Rows get the
    table index, so no per-row string ever reaches Python.
    """
    maxcol = max(max(c1, p1), max(c2, p2))
    i = 0
    row = 0
    last = -1
    while i < end:
        b = buf[i]
        if b == 35:  # '#': header or comment line
            while i < end and buf[i] != 10:
                i += 1
            i += 1
            continue
        if b == 10 or (b == 13 and i + 1 < end and buf[i + 1] == 10):  # blank line
            i += 1 if b == 10 else 2
            continue
        f = 0
        while True:
            if ws:
                while i < end and (buf[i] == 32 or buf[i] == 9):
                    i += 1
            s = i
            if ws:
                while i < end and buf[i] != 10 and buf[i] != 9 and buf[i] != 32:
                    i += 1
            else:
                while i < end and buf[i] != 10 and buf[i] != 9:
                    i += 1
            e = i
            if e > s and buf[e - 1] == 13:
                e -= 1
            if f == c1 or f == c2:
                h = np.uint64(FNV_OFFSET)
                for k in range(s, e):
                    h = (h ^ np.uint64(buf[k])) * np.uint64(FNV_PRIME)
                # consecutive lines mostly share a chromosome: try the last hit first
                if last >= 0 and tab_h[last] == h:
                    t = last
                else:
                    t = -1
                    for j in range(n_tab[0]):
                        if tab_h[j] == h:
                            t = j
                            break
                    if t < 0:
                        if n_tab[0] == len(tab_h):
                            return row, False  # too many distinct names: general parser
                        t = n_tab[0]
                        tab_h[t] = h
                        tab_off[t] = s
                        tab_len[t] = e - s
                        n_tab[0] = t + 1
                    last = t
                if f == c1:
                    chrom1[row] = t
                else:
                    chrom2[row] = t
            elif f == p1 or f == p2:
                if e == s or e - s > MAX_DIGITS:
                    return row, False
                v = 0
                for k in range(s, e):
                    d = buf[k] - 48
                    if d < 0 or d > 9:
                        return row, False
                    v = v * 10 + d
                if f == p1:
                    pos1[row] = v
                else:
                    pos2[row] = v
            f += 1
            if i >= end or buf[i] == 10:
                break
            i += 1
        if f <= maxcol:
            return row, False
        row += 1
        i += 1
    return row, True


SMALL_FILE = 4 << 20  # bytes on disk below which pandas is quicker than loading the kernel
KERNEL = LazyJit(_kernel)


def worth_compiling(path) -> bool:
    """True if the kernel is loaded already or ``path`` is big enough to repay loading it."""
    return KERNEL.loaded or os.path.getsize(path) >= SMALL_FILE


def _blocks(path, gz: bool):
    """Decompressed blocks of ``path`` (multi-member gzip as written by bgzip/cat)."""
    with open(path, "rb") as fh:
        if not gz:
            while chunk := fh.read(BLOCK):
                yield chunk
            return
        d = decompressobj(31)
        try:
            while raw := fh.read(BLOCK):
                yield d.decompress(raw)
                while d.eof and d.unused_data:
                    rest = d.unused_data
                    d = decompressobj(31)
                    yield d.decompress(rest)
        except _InflateError as e:
            raise zlib.error(f"corrupt gzip data: {e}") from None
        if not d.eof:
            raise EOFError("compressed file ended before the end-of-stream marker was reached")


def _prefetch(gen, depth: int = 4):
    """Run ``gen`` in a thread, ``depth`` items ahead; exceptions re-raised here."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def work():
        try:
            for item in gen:
                if stop.is_set():
                    return
                q.put(item)
            q.put(done)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put(e)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    try:
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while t.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                t.join(0.01)


class _ChromTable:
    """Distinct chromosome tokens met by the kernel, and their genome codes."""

    SIZE = 4096

    def __init__(self, namer: ChromNamer):
        self.namer = namer
        self.index = {c: i for i, c in enumerate(namer.genome)}
        self.hashes = np.zeros(self.SIZE, np.uint64)
        self.offsets = np.zeros(self.SIZE, np.int64)
        self.lengths = np.zeros(self.SIZE, np.int64)
        self.count = np.zeros(1, np.int64)
        self.codes = np.full(self.SIZE, -1, np.int32)
        self.decoded = 0

    def decode_new(self, buf: np.ndarray) -> None:
        """Name the entries the last kernel call added (their offsets point into ``buf``)."""
        for j in range(self.decoded, int(self.count[0])):
            o, n = int(self.offsets[j]), int(self.lengths[j])
            token = bytes(buf[o : o + n]).decode("utf-8", "replace")
            self.codes[j] = self.index.get(self.namer(token), -1)
        self.decoded = int(self.count[0])


def scan_pairs(path, cols: tuple[int, int, int, int], whitespace: bool, gz: bool, namer: ChromNamer):
    """Parse the four columns of a pairs file.

    Returns ``(chrom1 codes, pos1, chrom2 codes, pos2)``, or None if numba is missing
    or any line is not plain (too few fields, a position that is not a run of digits):
    the caller then uses the general parser, which names the bad line.
    """
    _scan = KERNEL.get()
    if _scan is None:
        return None
    c1, p1, c2, p2 = cols
    table = _ChromTable(namer)
    parts: list[tuple[np.ndarray, ...]] = []
    carry = b""
    blocks = _prefetch(_blocks(path, gz), depth=8)
    # first call loads the compiled kernel from numba's cache (~0.2 s): do it on an
    # empty buffer while the reader thread is already inflating the first blocks
    z8, z32, z64 = np.zeros(1, np.uint8), np.zeros(1, np.int32), np.zeros(1, np.int64)
    _scan(z8, 0, c1, p1, c2, p2, whitespace, table.hashes, table.offsets, table.lengths, table.count, z32, z32, z64, z64)
    last = False
    while not last:
        block = next(blocks, None)
        if block is None:
            last = True
            data = carry if carry.endswith(b"\n") or not carry else carry + b"\n"
            cut = len(data)
        else:
            data = carry + block
            cut = data.rfind(b"\n") + 1
        carry = data[cut:]
        if cut == 0:
            continue
        buf = np.frombuffer(data, dtype=np.uint8)
        n = buf[:cut].__eq__(10).sum() + 1
        chrom1, chrom2 = np.empty(n, np.int32), np.empty(n, np.int32)
        pos1, pos2 = np.empty(n, np.int64), np.empty(n, np.int64)
        rows, ok = _scan(
            buf, cut, c1, p1, c2, p2, whitespace, table.hashes, table.offsets, table.lengths, table.count,
            chrom1, chrom2, pos1, pos2,
        )  # fmt: skip
        if not ok:
            blocks.close()
            return None
        table.decode_new(buf)
        if rows:
            parts.append((table.codes[chrom1[:rows]], pos1[:rows], table.codes[chrom2[:rows]], pos2[:rows]))
    if not parts:
        return (np.empty(0, np.int32), np.empty(0, np.int64), np.empty(0, np.int32), np.empty(0, np.int64))
    return tuple(np.concatenate([p[k] for p in parts]) for k in range(4))
