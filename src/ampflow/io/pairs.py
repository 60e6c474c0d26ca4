"""Reader for 4DN ``.pairs`` files and the variants real data comes in.

Handles: gzip or plain; full 4DN header (``#columns:``, ``#chromosome:``/``#chromsize:``)
or no header at all (layout inferred from the first data lines); extra columns;
``chr1`` / ``1`` / ``mm10_chr1`` names (see :class:`~ampflow.io.genome.ChromNamer`).

Parsing has three tiers: a compiled scanner that decompresses in one thread and
tokenizes only the four needed columns in another (:mod:`.pairs_scan`); pandas' C
tokenizer when the scanner meets a line it does not understand; and a slow path that
walks the file line by line to report the first bad line with its number, reason and
value.
"""

from __future__ import annotations

import csv
import gzip
import re
import zlib
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ..base.errors import InputError, require_file
from .genome import ChromNamer
from .pairs_scan import scan_pairs, worth_compiling
from .textfile import is_gzip, open_text

CHROM1_NAMES = ("chr1", "chrom1")
CHROM2_NAMES = ("chr2", "chrom2")
SNIFF_LINES = 5
INT64_MAX = int(np.iinfo(np.int64).max)
# a position is a run of decimal digits, nothing else ('+5', '1e3', '5.0' are not):
# the same rule in the compiled scanner, the pandas path and the slow path
_INT = re.compile(r"[0-9]{1,18}")


@dataclass
class PairsLayout:
    """Where the four needed columns are, and what the header said."""

    chrom1: int
    pos1: int
    chrom2: int
    pos2: int
    n_header: int = 0
    sep: str = "\t"
    columns: list[str] | None = None
    header_chromsizes: dict[str, int] = field(default_factory=dict)

    @property
    def usecols(self) -> list[int]:
        return [self.chrom1, self.pos1, self.chrom2, self.pos2]

    @property
    def min_fields(self) -> int:
        return max(self.usecols) + 1


@dataclass
class Contacts:
    """Contacts of one cell on the genome's chromosomes (codes index ``ChromNamer.genome``)."""

    chrom1: np.ndarray  # int32 codes
    pos1: np.ndarray  # int64, as in the file (1-based per the 4DN spec)
    chrom2: np.ndarray
    pos2: np.ndarray
    stats: dict[str, int]

    def __len__(self) -> int:
        return len(self.pos1)


def _is_int(s: str) -> bool:
    try:
        int(s)
        return True
    except ValueError:
        return False


def parse_columns_spec(spec) -> tuple[int, int, int, int] | None:
    """'2,3,4,5' (1-based, as cooler's -c1/-p1/-c2/-p2) -> 0-based indices."""
    if spec in (None, "", "auto"):
        return None
    parts = [p for p in str(spec).replace(" ", "").split(",") if p]
    if len(parts) != 4 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise InputError("expected four 1-based column numbers 'chrom1,pos1,chrom2,pos2'", key="pairs_columns", value=spec)
    c1, p1, c2, p2 = (int(p) - 1 for p in parts)
    return c1, p1, c2, p2


def sniff_layout(path, namer: ChromNamer | None = None, columns=None) -> PairsLayout:
    """Read the header (and a few data lines) of a pairs file and find its layout."""
    path = require_file(path, "pairs file")
    header: list[str] = []
    data: list[str] = []
    n_before_data = 0  # header and blank lines before the first data line
    try:
        with open_text(path) as fh:
            for line in fh:
                if not data and (line.startswith("#") or not line.strip()):
                    n_before_data += 1
                    if line.startswith("#"):
                        header.append(line.rstrip("\n"))
                    continue
                if line.strip():
                    data.append(line.rstrip("\n"))
                if len(data) >= SNIFF_LINES:
                    break
    except (EOFError, OSError, zlib.error) as e:
        raise InputError(f"cannot read (truncated or corrupt gzip?): {e}", path=path) from None
    if not data:
        raise InputError("no contacts: the file is empty or has only header lines", path=path)

    sep = "\t" if "\t" in data[0] else r"\s+"
    names: list[str] | None = None
    header_sizes: dict[str, int] = {}
    for h in header:
        key, _, rest = h[1:].partition(":")
        key = key.strip().lower()
        if key == "columns":
            names = rest.split()
        elif key in ("chromosome", "chromsize"):
            parts = rest.split()
            if len(parts) == 2 and _is_int(parts[1]):
                header_sizes[parts[0]] = int(parts[1])

    explicit = parse_columns_spec(columns)
    if explicit is not None:
        idx = explicit
    elif names is not None:
        idx = _layout_from_names(names, path)
    else:
        idx = _infer_layout([_split(d, sep) for d in data], namer, path)
    return PairsLayout(*idx, n_header=n_before_data, sep=sep, columns=names, header_chromsizes=header_sizes)


def _split(line: str, sep: str) -> list[str]:
    return line.split("\t") if sep == "\t" else line.split()


def _layout_from_names(names: list[str], path) -> tuple[int, int, int, int]:
    lower = [n.lower() for n in names]

    def find(options, what):
        for o in options:
            if o in lower:
                return lower.index(o)
        raise InputError(f"'#columns:' header has no {what} column", path=path, value=" ".join(names))

    return find(CHROM1_NAMES, "chr1/chrom1"), find(("pos1",), "pos1"), find(CHROM2_NAMES, "chr2/chrom2"), find(("pos2",), "pos2")


# Header-less layouts seen in the wild, tried in order: 4DN with readID; plain
# chrom1 pos1 chrom2 pos2 [...]; juicer-short-like chrom1 pos1 strand1 chrom2 pos2 strand2.
_CANDIDATES = ((1, 2, 3, 4), (0, 1, 2, 3), (0, 1, 3, 4))


def _infer_layout(rows: list[list[str]], namer: ChromNamer | None, path) -> tuple[int, int, int, int]:
    known = set(namer.genome) if namer is not None else set()

    def chrom_like(s: str) -> bool:
        # an integer is a chromosome only if the genome knows it ('1' -> 'chr1')
        return not _is_int(s) or (namer is not None and namer(s) in known)

    for c1, p1, c2, p2 in _CANDIDATES:
        if all(len(f) > max(c1, p1, c2, p2) and _is_int(f[p1]) and _is_int(f[p2]) and chrom_like(f[c1]) and chrom_like(f[c2]) for f in rows):
            return c1, p1, c2, p2
    raise InputError(
        "no '#columns:' header and the columns could not be inferred; set pairs_columns (1-based 'chrom1,pos1,chrom2,pos2')",
        path=path,
        value=rows[0] if rows else None,
    )


def read_pairs(path, namer: ChromNamer, chromsizes: dict[str, int], keep=None, columns=None, engine="auto") -> Contacts:
    """Parse one pairs file into contacts on the genome.

    Parameters
    ----------
    path
        ``.pairs`` / ``.pairs.gz`` (or any header-less variant, see module doc).
    namer
        Maps file chromosome names onto ``chromsizes`` names.
    chromsizes
        The genome; a position beyond a chromosome's size is an error.
    keep
        Optional subset of chromosomes to analyse; contacts touching other (known)
        chromosomes are dropped and counted as ``dropped_excluded``.
    columns
        Optional explicit 1-based column numbers 'chrom1,pos1,chrom2,pos2'.
    engine
        ``compiled`` (the scanner of :mod:`.pairs_scan`), ``pandas``, or ``auto``:
        compiled for big files or once the kernel is loaded in this process.

    Returns
    -------
    Contacts
        Arrays of length n (contacts kept) and ``stats`` with ``total``, ``cis``,
        ``trans``, ``dropped_unknown_chrom``, ``dropped_excluded``.

    Raises
    ------
    InputError
        Missing/empty/truncated file, too few columns, a non-integer or negative
        position, a position past the chromosome end: with file, line and value.
    """
    path = require_file(path, "pairs file")
    if keep is not None:
        unknown = [k for k in keep if k not in chromsizes]
        if unknown:
            raise InputError("chromosomes to keep are not in the genome", key="chromosomes", value=unknown)
    layout = sniff_layout(path, namer, columns)
    if engine not in ("auto", "compiled", "pandas"):
        raise ValueError(f"engine must be auto, compiled or pandas, not {engine!r}")
    compiled = engine == "compiled" or (engine == "auto" and worth_compiling(path))
    c1, p1, c2, p2 = _read_columns(path, layout, namer, chromsizes, compiled)
    if len(p1) == 0:
        raise InputError("no contacts: the file has only header lines", path=path)
    sizes = np.array(list(chromsizes.values()) + [np.iinfo(np.int64).max], dtype=np.int64)
    # code -1 indexes the sentinel, so unknown chromosomes never fail the range check
    if (p1 < 0).any() or (p2 < 0).any() or (p1 > sizes[c1]).any() or (p2 > sizes[c2]).any():
        _locate_error(path, layout, namer, chromsizes)
        raise InputError("invalid position (could not locate the line)", path=path)

    total = len(p1)
    known = (c1 >= 0) & (c2 >= 0)
    dropped_unknown = int(total - known.sum())
    if keep is not None:
        keep_codes = np.zeros(len(chromsizes) + 1, dtype=bool)
        order = list(chromsizes)
        for k in keep:
            keep_codes[order.index(k)] = True
        inside = known & keep_codes[c1] & keep_codes[c2]
    else:
        inside = known
    dropped_excluded = int(known.sum() - inside.sum())
    c1, c2, p1, p2 = c1[inside], c2[inside], p1[inside], p2[inside]
    cis = int((c1 == c2).sum())
    stats = {
        "total": total,
        "cis": cis,
        "trans": int(len(c1) - cis),
        "dropped_unknown_chrom": dropped_unknown,
        "dropped_excluded": dropped_excluded,
    }
    return Contacts(c1, p1, c2, p2, stats)


def _read_columns(path, layout: PairsLayout, namer: ChromNamer, chromsizes: dict[str, int], compiled: bool):
    """(chrom1 codes, pos1, chrom2 codes, pos2) of every data line.

    First the compiled scanner (:mod:`.pairs_scan`) when asked for; pandas' tokenizer
    otherwise or when the scanner meets a line it does not understand; the slow path
    names the first bad line whenever either finds one.
    """
    if compiled:
        try:
            arrays = scan_pairs(path, tuple(layout.usecols), layout.sep != "\t", is_gzip(path), namer)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise InputError(f"truncated or corrupt gzip: {e}", path=path) from None
        if arrays is not None:
            return arrays
        _locate_error(path, layout, namer, chromsizes)  # raises at the bad line, if any
    try:
        return _read_pandas(path, layout, namer, layout.n_header)
    except _Malformed as e:
        # the slow path raises at the first bad line; if every line is fine, pandas
        # tripped over '#' lines between data lines: skip them and parse again
        comment_lines = _locate_error(path, layout, namer, chromsizes)
        if len(comment_lines) <= layout.n_header:
            raise InputError(f"cannot parse: {e}", path=path) from None
        try:
            return _read_pandas(path, layout, namer, comment_lines)
        except _Malformed as e2:
            raise InputError(f"cannot parse: {e2}", path=path) from None


class _Malformed(Exception):
    """pandas could not turn the file into four clean columns."""


def _read_pandas(path, layout: PairsLayout, namer: ChromNamer, skiprows):
    try:
        df = _read_fast(path, layout, skiprows)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise InputError(f"truncated or corrupt gzip: {e}", path=path) from None
    except (ValueError, pd.errors.ParserError, IndexError, OverflowError) as e:
        raise _Malformed(str(e)) from None
    positions = []
    for col in (layout.pos1, layout.pos2):
        text = df[col].to_numpy(dtype=str)
        if not (np.char.isdigit(text) & (np.char.str_len(text) <= 18)).all():
            raise _Malformed("a position is not a plain integer")
        positions.append(text.astype(np.int64))
    return (
        namer.codes(df[layout.chrom1].to_numpy()),
        positions[0],
        namer.codes(df[layout.chrom2].to_numpy()),
        positions[1],
    )


def _read_fast(path, layout: PairsLayout, skiprows) -> pd.DataFrame:
    """The four needed columns via pandas' C tokenizer, positions as text (checked by
    the caller: pandas alone would take '1e3' or '5.0' as integers).

    No ``comment="#"``: pandas would cut a line at a ``#`` anywhere in it (old Illumina
    read ids end in ``#0/1``); header lines are skipped by ``skiprows`` instead.
    """
    return pd.read_csv(
        path,
        sep=layout.sep,
        header=None,
        skiprows=skiprows,
        usecols=layout.usecols,
        dtype={layout.chrom1: "category", layout.chrom2: "category", layout.pos1: str, layout.pos2: str},
        compression="gzip" if is_gzip(path) else None,
        engine="c",
        na_filter=False,
        quoting=csv.QUOTE_NONE,
        encoding_errors="replace",
        low_memory=False,
    )


def _locate_error(path, layout: PairsLayout, namer: ChromNamer, chromsizes: dict[str, int]) -> list[int]:
    """Walk the file and raise InputError at the first bad line.

    Returns the 0-based indices of the blank and ``#`` lines if no line is bad.
    """
    need = layout.min_fields
    cache: dict[str, str] = {}
    skipped: list[int] = []
    try:
        with open_text(path) as fh:
            for lineno, line in enumerate(fh, 1):
                if line.startswith("#") or not line.strip():
                    skipped.append(lineno - 1)
                    continue
                f = _split(line.rstrip("\r\n"), layout.sep)
                if len(f) < need:
                    raise InputError(f"too few columns: {len(f)}, need at least {need}", path=path, line=lineno, value=line.rstrip("\n"))
                for ci, pi, which in ((layout.chrom1, layout.pos1, "pos1"), (layout.chrom2, layout.pos2, "pos2")):
                    raw = f[pi]
                    if not _INT.fullmatch(raw):
                        if raw.startswith("-") and raw[1:].isdigit():
                            raise InputError(f"{which} is negative", path=path, line=lineno, value=raw)
                        if raw.isdigit():
                            raise InputError(f"{which} is too large", path=path, line=lineno, value=raw)
                        raise InputError(f"{which} is not an integer", path=path, line=lineno, value=raw)
                    pos = int(raw)
                    name = cache.get(f[ci])
                    if name is None:
                        name = cache[f[ci]] = namer(f[ci])
                    size = chromsizes.get(name)
                    if size is not None and pos > size:
                        raise InputError(f"{which} is past the end of {name} (size {size})", path=path, line=lineno, value=raw)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise InputError(f"truncated or corrupt gzip: {e}", path=path) from None
    return skipped
