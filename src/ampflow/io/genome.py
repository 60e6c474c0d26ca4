"""Chromosome sizes and chromosome-name mapping (``mm10_chr1`` / ``1`` / ``chr1``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..base.errors import InputError, require_file
from .textfile import numbered_lines

CHR_PREFIX_MODES = ("auto", "keep", "add", "drop")


def read_chromsizes(path, chromosomes=None) -> dict[str, int]:
    """Read a two-column ``name<TAB>size`` file, in file order.

    Parameters
    ----------
    path
        chrom.sizes file (plain or gzipped); lines starting with ``#`` are skipped.
    chromosomes
        Optional subset to keep, in the order given; each must be in the file.
    """
    path = require_file(path, "chromosome sizes file")
    sizes: dict[str, int] = {}
    for lineno, line in numbered_lines(path):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) < 2:
            raise InputError("expected 'name size'", path=path, line=lineno, value=line.rstrip("\n"))
        name, size = fields[0], fields[1]
        try:
            n = int(size)
        except ValueError:
            raise InputError("chromosome size is not an integer", path=path, line=lineno, value=size) from None
        if n <= 0:
            raise InputError("chromosome size must be positive", path=path, line=lineno, value=size)
        if name in sizes:
            raise InputError("chromosome listed twice", path=path, line=lineno, value=name)
        sizes[name] = n
    if not sizes:
        raise InputError("no chromosomes in file", path=path)
    if chromosomes:
        missing = [c for c in chromosomes if c not in sizes]
        if missing:
            raise InputError(
                f"chromosomes not in the sizes file (it has {', '.join(list(sizes)[:6])}...)",
                path=path,
                key="chromosomes",
                value=missing,
            )
        sizes = {c: sizes[c] for c in chromosomes}
    return sizes


@dataclass(frozen=True)
class ChromNamer:
    """Maps chromosome names found in inputs onto the names of the genome.

    First ``strip_prefix`` is removed (e.g. ``mm10_``), then ``chr_prefix`` applies:
    ``add`` puts ``chr`` in front, ``drop`` removes it, ``keep`` leaves the name, and
    ``auto`` picks whichever of the three names the genome knows.
    """

    genome: tuple[str, ...]
    strip_prefix: str = ""
    chr_prefix: str = "auto"

    def __post_init__(self):
        if self.chr_prefix not in CHR_PREFIX_MODES:
            raise InputError(f"must be one of {CHR_PREFIX_MODES}", key="chr_prefix", value=self.chr_prefix)

    def __call__(self, name: str) -> str:
        if self.strip_prefix and name.startswith(self.strip_prefix):
            name = name[len(self.strip_prefix) :]
        mode = self.chr_prefix
        if mode == "keep":
            return name
        added = "chr" + name
        dropped = name[3:] if name.startswith("chr") else name
        if mode == "add":
            return name if name.startswith("chr") else added
        if mode == "drop":
            return dropped
        known = set(self.genome)
        for cand in (name, added, dropped):
            if cand in known:
                return cand
        return name

    def codes(self, names) -> np.ndarray:
        """Map an array of names to genome indices (-1 for names the genome lacks)."""
        cat = pd.Categorical(names)
        index = {c: i for i, c in enumerate(self.genome)}
        lut = np.array([index.get(self(str(c)), -1) for c in cat.categories], dtype=np.int32)
        out = np.full(len(cat), -1, dtype=np.int32)
        valid = cat.codes >= 0
        out[valid] = lut[cat.codes[valid]]
        return out


def make_bins(chromsizes: dict[str, int], resolution: int) -> pd.DataFrame:
    """Fixed-width bins over ``chromsizes`` (the last bin of a chromosome is shorter)."""
    if resolution <= 0:
        raise InputError("resolution must be a positive number of base pairs", key="resolution", value=resolution)
    frames = []
    for chrom, size in chromsizes.items():
        starts = np.arange(0, size, resolution, dtype=np.int64)
        ends = np.minimum(starts + resolution, size)
        frames.append(pd.DataFrame({"chrom": chrom, "start": starts, "end": ends}))
    bins = pd.concat(frames, ignore_index=True)
    bins["chrom"] = pd.Categorical(bins["chrom"], categories=list(chromsizes), ordered=True)
    return bins


def bin_offsets(chromsizes: dict[str, int], resolution: int) -> np.ndarray:
    """First global bin id of each chromosome, plus the total bin count at the end."""
    nbins = [-(-size // resolution) for size in chromsizes.values()]
    return np.concatenate([[0], np.cumsum(nbins)]).astype(np.int64)


def resolution_label(bp: int) -> str:
    """500000 -> '500kb', 1000000 -> '1mb', 2500 -> '2500bp'."""
    if bp % 1_000_000 == 0:
        return f"{bp // 1_000_000}mb"
    if bp % 1000 == 0:
        return f"{bp // 1000}kb"
    return f"{bp}bp"


def write_chromsizes(path, chromsizes: dict[str, int]) -> None:
    Path(path).write_text("".join(f"{c}\t{s}\n" for c, s in chromsizes.items()))
