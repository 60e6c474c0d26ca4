"""Gene annotation: BED (0-based, name in column 4, strand in column 6) or GTF/GFF (1-based)."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from ..base.errors import InputError, require_file
from .genome import ChromNamer
from .textfile import numbered_lines

GTF_ATTR = re.compile(r'(\S+)\s+"([^"]*)"')
NO_SYMBOL = ("", ".", "NA")


def read_genes(path, namer: ChromNamer, chromsizes: dict[str, int]) -> pd.DataFrame:
    """Genes on the genome as a DataFrame ``name, gene_id, chrom, start, end, strand``.

    Coordinates are 0-based half-open. Genes on chromosomes the genome lacks are
    dropped (and logged by the caller from ``attrs["dropped"]``).

    Raises
    ------
    InputError
        Missing file, a malformed line (with its number), or no gene on the genome.
    """
    path = require_file(path, "gene annotation")
    name = str(path).lower()
    is_gtf = any(name.endswith(s) for s in (".gtf", ".gtf.gz", ".gff", ".gff.gz", ".gff3", ".gff3.gz"))
    rows = _read_gtf(path) if is_gtf else _read_bed(path)
    if not rows:
        raise InputError("no genes in the annotation", path=path)
    df = pd.DataFrame(rows, columns=["name", "gene_id", "chrom", "start", "end", "strand", "line"])
    df["chrom"] = [namer(c) for c in df["chrom"]]
    on_genome = df["chrom"].isin(list(chromsizes))
    if not on_genome.any():
        seen = sorted(set(df["chrom"]))[:5]
        raise InputError(
            f"no gene lies on the genome's chromosomes ({', '.join(list(chromsizes)[:5])}...); check chromosome naming (strip_prefix / chr_prefix)",
            path=path,
            value=seen,
        )
    dropped = int((~on_genome).sum())
    df = df[on_genome].reset_index(drop=True)
    df["start"] = df["start"].astype(np.int64)
    df["end"] = df["end"].astype(np.int64)
    df.attrs["dropped"] = dropped
    return df.drop(columns="line")


def _read_bed(path) -> list[tuple]:
    rows = []
    for lineno, line in numbered_lines(path):
        if line.startswith(("#", "track", "browser")) or not line.strip():
            continue
        f = line.rstrip("\n").split("\t")
        if len(f) < 4:
            raise InputError("BED gene annotation needs at least chrom, start, end, name", path=path, line=lineno, value=line.rstrip())
        try:
            start, end = int(f[1]), int(f[2])
        except ValueError:
            raise InputError("start/end is not an integer", path=path, line=lineno, value=f[1:3]) from None
        if start < 0 or end < start:
            raise InputError("need 0 <= start <= end", path=path, line=lineno, value=f[1:3])
        strand = f[5] if len(f) > 5 and f[5] in ("+", "-") else "+"
        gene_id = f[4] if len(f) > 4 and f[4] and not _numeric(f[4]) else f[3]
        # a symbol of 'NA' or '.' means none (e.g. Ensembl genes without one): use the id,
        # so that such genes are not all one gene called 'NA'
        name = gene_id if f[3] in NO_SYMBOL else f[3]
        rows.append((name, gene_id, f[0], start, end, strand, lineno))
    return rows


def _numeric(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return s == "."


def _read_gtf(path) -> list[tuple]:
    rows = []
    for lineno, line in numbered_lines(path):
        if line.startswith("#") or not line.strip():
            continue
        f = line.rstrip("\n").split("\t")
        if len(f) < 9:
            raise InputError("GTF line needs 9 tab-separated fields", path=path, line=lineno, value=line.rstrip())
        if f[2] != "gene":
            continue
        attrs = dict(GTF_ATTR.findall(f[8]))
        if not attrs and "=" in f[8]:  # GFF3 key=value;...
            attrs = dict(kv.split("=", 1) for kv in f[8].strip(";").split(";") if "=" in kv)
        gene_id = attrs.get("gene_id") or attrs.get("ID", "")
        gene_name = attrs.get("gene_name") or attrs.get("Name") or gene_id
        try:
            start, end = int(f[3]) - 1, int(f[4])  # GTF is 1-based inclusive
        except ValueError:
            raise InputError("start/end is not an integer", path=path, line=lineno, value=f[3:5]) from None
        if start < 0 or end < start + 1:
            raise InputError("GTF needs 1 <= start <= end", path=path, line=lineno, value=f[3:5])
        strand = f[6] if f[6] in ("+", "-") else "+"
        rows.append((gene_name, gene_id.split(".")[0], f[0], start, end, strand, lineno))
    return rows


def promoters(genes: pd.DataFrame, upstream: int, chromsizes: dict[str, int]) -> pd.DataFrame:
    """Promoter interval per gene: ``upstream`` bp before the TSS, plus the TSS base."""
    plus = genes["strand"].to_numpy() != "-"
    tss = np.where(plus, genes["start"].to_numpy(), genes["end"].to_numpy() - 1)
    lo = np.where(plus, tss - upstream, tss)
    hi = np.where(plus, tss + 1, tss + upstream + 1)
    size = genes["chrom"].map(chromsizes).to_numpy()
    return pd.DataFrame(
        {"chrom": genes["chrom"].to_numpy(), "start": np.clip(lo, 0, size), "end": np.clip(hi, 0, size)},
        index=genes.index,
    )
