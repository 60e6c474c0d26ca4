"""A synthetic HiRES-like dataset, deterministic by seed, for demos and tests.

Per cell a 4DN ``.pairs.gz`` over a few mouse chromosomes scaled down, with
cell-type-specific compartments and TAD-like blocks, power-law distance decay
(exponent 1.0-1.5 per cell), B-compartment contacts :data:`COMPACT` times denser,
and 5-15 % trans contacts; a genes x cells RNA matrix
with type-specific negative-binomial expression and fractional counts (as
featureCounts --fraction writes them); a gene BED; a cell sheet with cell types.
Each cell also has a continuous state z in [0, 1] (think maturation) that both
modalities show: a program of genes scales with it, and so do contacts inside a set
of state domains. Without such shared within-type variation, no method could tell
apart the two modalities' cells of one type. A few cells are deliberately imperfect so that QC and matching have something to
report: one with too few contacts, one with too few UMIs, one without RNA and two
RNA-only barcodes.

With a real genome (:func:`write_demo` given ``chromsizes``, and optionally
``genes_bed``) the same biology is laid over full-size chromosomes and real genes, so
that a dataset of HiRES size (thousands of cells, ~150,000 contacts each, ~90 % cis,
P(s) ~ s^-1.1) can be written in minutes; the RNA matrix is then written in blocks of
genes so that its size in memory does not grow with the number of cells.
"""

from __future__ import annotations

import gzip
import io
import logging
import os
import re
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pandas as pd

from .base.atomic import atomic_path
from .base.errors import InputError, require_file
from .base.progress import Progress
from .io.genome import read_chromsizes, write_chromsizes
from .io.textfile import is_gzip, open_text

log = logging.getLogger(__name__)

MM10 = {"chr1": 195471971, "chr2": 182113224, "chr3": 160039680, "chrX": 171031299}
CELL_TYPES = ("excitatory", "inhibitory", "astrocyte", "oligodendrocyte")
#: The chromatin (compartments, TADs) of each cell type: the neurons share one.
HIC_GROUP = (0, 0, 1, 2)
#: The expression profile of each cell type: astrocytes and oligodendrocytes share one.
RNA_GROUP = (0, 1, 2, 2)
#: How much denser contacts with both ends in the B compartment are (compact chromatin):
#: what makes a cell type's compartments visible at the short distances the strata hold,
#: where A-A and B-B pairs are otherwise alike.
COMPACT = 3.0
PAIRS_COLUMNS = "readID chr1 pos1 chr2 pos2 strand1 strand2 phase0 phase1"
#: ``--genome NAME``: its chromosome sizes and gene BED, under :data:`ANNOTATION_DIR`.
GENOMES = {"mm10": ("mm10.chrom.sizes", "mm10_ensembl96_genes.bed.gz")}
#: Where ``--genome`` looks for its files, relative to the working directory (the
#: repository root: the shared data folder lies beside it).
ANNOTATION_DIR = Path("../shared/data/annotation")
#: The chromosomes kept from a sizes file by default: numbered ones and X (no Y, no
#: mitochondrion, no unplaced or patch contigs).
CANONICAL = re.compile(r"^(chr)?([0-9]+|X)$")
#: Spread of the per-cell cis fraction and decay exponent around the values asked for.
CIS_JITTER = 0.03
DECAY_JITTER = 0.1
#: Genes per block of the streamed RNA matrix.
RNA_BLOCK = 2000


class DemoGenome:
    """Chromosomes, and compartments and TAD boundaries per chromatin group (the cells
    of one group share them)."""

    def __init__(self, rng: np.random.Generator, scale: float, n_types: int, sizes: dict[str, int] | None = None):
        base_sizes = MM10 if sizes is None else sizes
        self.sizes = {c: int(s * scale) for c, s in base_sizes.items()}
        self.names = list(self.sizes)
        self.block = 1_000_000  # compartment/TAD grid
        self.state = {c: rng.random(-(-s // self.block)) < 0.25 for c, s in self.sizes.items()}  # state domains
        self.comp = {}  # type -> chrom -> +-1 per block
        self.tad = {}  # type -> chrom -> TAD id per block
        base = {c: self._blocks(rng, s) for c, s in self.sizes.items()}
        for t in range(n_types):
            self.comp[t], self.tad[t] = {}, {}
            for c in self.sizes:
                comp = base[c].copy()
                flip = rng.random(len(comp)) < 0.35  # type-specific compartment switches
                comp[flip] *= -1
                self.comp[t][c] = comp
                nblk = len(comp)
                bounds = np.sort(rng.choice(np.arange(1, nblk), size=max(1, nblk // 4), replace=False))
                self.tad[t][c] = np.searchsorted(bounds, np.arange(nblk), side="right")
        # the same per-block tables laid end to end, chromosome after chromosome
        nblocks = np.array([len(self.state[c]) for c in self.names])
        self.offsets = np.concatenate([[0], np.cumsum(nblocks)[:-1]]).astype(np.int64)
        self.flat_state = np.concatenate([self.state[c] for c in self.names])
        self.flat_comp = {t: np.concatenate([self.comp[t][c] for c in self.names]) for t in self.comp}
        self.flat_tad = {t: np.concatenate([self.tad[t][c] for c in self.names]) for t in self.tad}

    def _blocks(self, rng, size):
        n = -(-size // self.block)
        out = np.empty(n, dtype=np.int8)
        i = 0
        sign = 1
        while i < n:
            run = int(rng.integers(2, 8))
            out[i : i + run] = sign
            sign = -sign
            i += run
        return out


def _power_law(rng, n, alpha, smin, smax):
    u = rng.random(n)
    a = 1.0 - alpha
    if abs(a) < 1e-9:
        return np.exp(np.log(smin) + u * (np.log(smax) - np.log(smin)))
    return (smin**a + u * (smax**a - smin**a)) ** (1.0 / a)


def simulate_cell(
    rng,
    genome: DemoGenome,
    ctype: int,
    n_contacts: int,
    state: float = 0.5,
    alpha_range: tuple[float, float] = (1.0, 1.5),
    trans_range: tuple[float, float] = (0.05, 0.15),
) -> pd.DataFrame:
    """Contacts of one cell of chromatin group ``ctype`` as a 4DN pairs table (upper
    triangle, sorted).

    ``state`` (0-1) scales contacts whose ends both lie in state domains by 0.4-1.6.
    The cell's decay exponent (P(s) ~ s^-alpha before the compartment/TAD weights) and
    its share of trans contacts are drawn uniformly from ``alpha_range`` and
    ``trans_range``.
    """
    alpha = rng.uniform(*alpha_range)
    trans_frac = rng.uniform(*trans_range)
    n_trans = int(round(n_contacts * trans_frac))
    n_cis = n_contacts - n_trans
    sizes = np.array([genome.sizes[c] for c in genome.names], dtype=np.float64)
    p_chrom = sizes / sizes.sum()
    c1s, p1s, c2s, p2s = [], [], [], []
    need = n_cis
    while need > 0:
        m = need * 3
        ci = rng.choice(len(sizes), size=m, p=p_chrom)
        size = sizes[ci].astype(np.int64)
        pos1 = (rng.random(m) * size).astype(np.int64) + 1
        s = _power_law(rng, m, alpha, 1_000, 50_000_000).astype(np.int64)
        pos2 = pos1 + np.where(rng.random(m) < 0.5, s, -s)
        ok = (pos2 >= 1) & (pos2 <= size)
        ci, pos1, pos2 = ci[ok], pos1[ok], pos2[ok]
        # blocks numbered across chromosomes: one lookup for all (both ends share a chromosome)
        offset = genome.offsets[ci]
        b1 = (pos1 - 1) // genome.block + offset
        b2 = (pos2 - 1) // genome.block + offset
        cv = genome.flat_comp[ctype]
        cv1, cv2 = cv[b1], cv[b2]
        comp = (cv1 * cv2).astype(np.float64)
        compact = (cv1 < 0) & (cv2 < 0)
        tv = genome.flat_tad[ctype]
        same_tad = tv[b1] == tv[b2]
        in_state = genome.flat_state[b1] & genome.flat_state[b2]
        weight = (1.0 + 0.7 * comp) * np.where(same_tad, 2.0, 1.0) * np.where(in_state, 0.4 + 1.2 * state, 1.0)
        weight *= np.where(compact, COMPACT, 1.0)
        accept = rng.random(len(ci)) < weight / (3.4 * 1.6 * COMPACT)
        ci, pos1, pos2 = ci[accept][:need], pos1[accept][:need], pos2[accept][:need]
        c1s.append(ci)
        c2s.append(ci)
        p1s.append(pos1)
        p2s.append(pos2)
        need -= len(ci)
    if n_trans:
        a = rng.choice(len(sizes), size=n_trans, p=p_chrom)
        b = (a + rng.integers(1, len(sizes), size=n_trans)) % len(sizes)
        c1s.append(a)
        c2s.append(b)
        p1s.append((rng.random(n_trans) * sizes[a]).astype(np.int64) + 1)
        p2s.append((rng.random(n_trans) * sizes[b]).astype(np.int64) + 1)
    c1, c2 = np.concatenate(c1s), np.concatenate(c2s)
    p1, p2 = np.concatenate(p1s), np.concatenate(p2s)
    swap = (c1 > c2) | ((c1 == c2) & (p1 > p2))
    c1, c2 = np.where(swap, c2, c1), np.where(swap, c1, c2)
    p1, p2 = np.where(swap, p2, p1), np.where(swap, p1, p2)
    order = np.lexsort((p2, p1, c2, c1))
    names = np.array(genome.names)
    n = len(order)
    phases = np.array([".", "0", "1"])
    return pd.DataFrame(
        {
            "readID": ".",
            "chr1": names[c1[order]],
            "pos1": p1[order],
            "chr2": names[c2[order]],
            "pos2": p2[order],
            "strand1": np.where(rng.random(n) < 0.5, "+", "-"),
            "strand2": np.where(rng.random(n) < 0.5, "+", "-"),
            "phase0": phases[rng.integers(0, 3, n)],
            "phase1": phases[rng.integers(0, 3, n)],
        }
    )


def _write_gz_text(path: Path, text: str) -> None:
    # mtime=0 and no file name in the gzip header: same seed, same bytes. Level 1: a
    # tenth of level 9's time for files about a third larger (the demo's own data)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=1) as gz:
            gz.write(text.encode())


def write_pairs(path: Path, table: pd.DataFrame, sizes: dict[str, int], assembly: str = "mm10-scaled-demo", columns: str = PAIRS_COLUMNS) -> None:
    """Write ``table`` (one row per contact, its columns those ``columns`` names, sorted by
    chromosomes then positions) as a gzipped 4DN pairs file, the same bytes for the same table."""
    header = ["## pairs format v1.0", "#sorted: chr1-chr2-pos1-pos2", "#shape: upper triangle", f"#genome_assembly: {assembly}"]
    header += [f"#chromosome: {c} {s}" for c, s in sizes.items()]
    header.append("#columns: " + columns)
    # the text DataFrame.to_csv(sep="\t", header=False, index=False) writes, in half its time
    cols = [table[c].to_numpy() for c in table.columns]
    cols = [c.astype(str).tolist() if c.dtype.kind in "iu" else c.tolist() for c in cols]
    body = "\n".join(map("\t".join, zip(*cols)))
    _write_gz_text(path, "\n".join(header) + "\n" + body + ("\n" if len(table) else ""))


def _write_cell(job) -> None:
    path, seq, genome, group, n_contacts, state = job[:6]
    if len(job) == 6:  # the scaled demo
        write_pairs(path, simulate_cell(np.random.default_rng(seq), genome, group, n_contacts, state), genome.sizes)
        return
    alpha_range, trans_range, assembly = job[6:]
    table = simulate_cell(np.random.default_rng(seq), genome, group, n_contacts, state, alpha_range, trans_range)
    write_pairs(path, table, genome.sizes, assembly)


def simulate_genes(rng, genome: DemoGenome, n_genes: int) -> pd.DataFrame:
    sizes = np.array([genome.sizes[c] for c in genome.names], dtype=np.float64)
    ci = rng.choice(len(sizes), size=n_genes, p=sizes / sizes.sum())
    length = rng.integers(2_000, 80_000, size=n_genes)
    start = (rng.random(n_genes) * (sizes[ci] - length - 1)).astype(np.int64)
    genes = pd.DataFrame(
        {
            "chrom": np.array(genome.names)[ci],
            "start": start,
            "end": start + length,
            "name": [f"Gene{i:05d}" for i in range(n_genes)],
            "gene_id": [f"ENSMUSG9{i:010d}" for i in range(n_genes)],
            "strand": np.where(rng.random(n_genes) < 0.5, "+", "-"),
        }
    )
    genes["_order"] = [genome.names.index(c) for c in genes["chrom"]]
    return genes.sort_values(["_order", "start"]).drop(columns="_order").reset_index(drop=True)


def simulate_rna(rng, genome: DemoGenome, genes: pd.DataFrame, types: np.ndarray, libsize: np.ndarray, state: np.ndarray) -> np.ndarray:
    """genes x cells counts: NB around the means of each cell's expression group
    (:data:`RNA_GROUP` of its type; a state program of genes scaled 1/4..4 by each
    cell's state), then fractional splits."""
    profile, program = _rna_profiles(rng, genome, genes)
    mu = profile[np.asarray(RNA_GROUP)[types]].T.copy()  # genes x cells
    mu[program] *= np.exp(np.log(4.0) * (2 * state[None, :] - 1))
    mu = mu / mu.sum(axis=0, keepdims=True) * libsize[None, :]
    theta = 2.0
    counts = rng.negative_binomial(theta, theta / (theta + mu)).astype(np.float64)
    nz = counts > 0
    split = nz & (rng.random(counts.shape) < 0.12)
    counts[split] -= rng.choice([0.5, 0.25, 0.75], size=int(split.sum()))
    return counts


def genome_files(name: str, root: Path = ANNOTATION_DIR) -> tuple[Path, Path]:
    """The chromosome sizes and gene BED of ``--genome NAME`` (see :data:`GENOMES`).

    Raises
    ------
    InputError
        Unknown name, or a file absent (named in the message).
    """
    if name not in GENOMES:
        raise InputError(f"unknown genome; known: {', '.join(sorted(GENOMES))}", key="genome", value=name)
    paths = tuple(Path(root) / f for f in GENOMES[name])
    for path in paths:
        if not path.is_file():
            raise InputError(f"genome {name}: {path} not found (run from the repository root beside shared/data, or give --chromsizes and --genes-bed)")
    return paths


def genome_sizes(path, chromosomes=None) -> dict[str, int]:
    """Chromosome sizes from ``path``: the ``chromosomes`` given (in that order), or by
    default the numbered ones and X (:data:`CANONICAL`) in file order."""
    sizes = read_chromsizes(path, chromosomes)
    if chromosomes:
        return sizes
    kept = {c: n for c, n in sizes.items() if CANONICAL.match(c)}
    if not kept:
        raise InputError("no numbered or X chromosome in the file; name the chromosomes to use", path=path, value=list(sizes)[:5])
    return kept


BIOTYPE_COLUMNS = ("biotype", "gene_biotype", "gene_type", "transcript_type")


def read_gene_bed(path, sizes: dict[str, int], biotype: str = "protein_coding") -> pd.DataFrame:
    """Real genes on the genome from a BED: ``chrom, start, end, name, gene_id, strand``
    in genome order, one row per name.

    Names and ids follow the workflow's gene reader (:mod:`ampflow.io.annotation`): the
    name is column 4 (the id where that is ``NA``/``.``/empty), the id column 5 where it
    is not a number. ``biotype`` (``all``: no filter) is matched against the column that
    a ``#`` header line names ``biotype``, ``gene_biotype`` or ``gene_type``. Genes off
    the genome or past a chromosome's end are left out, and so are later genes of a name
    already taken (the RNA matrix needs unique names).
    """
    path = require_file(path, "gene BED")
    header = None
    with open_text(path) as fh:
        for line in fh:
            if not line.startswith(("#", "track", "browser")):
                break
            if line.startswith("#"):
                header = line[1:].rstrip("\n").split("\t")
    compression = "gzip" if is_gzip(path) else None
    df = pd.read_csv(path, sep="\t", header=None, dtype=str, keep_default_na=False, compression=compression)
    df = df[~df[0].str.startswith(("#", "track", "browser"))].reset_index(drop=True)
    if df.shape[1] < 4:
        raise InputError("a gene BED needs at least chrom, start, end, name", path=path)
    if biotype != "all":
        col = next((i for i, name in enumerate(header or []) if name.lower() in BIOTYPE_COLUMNS), None)
        if col is None or col >= df.shape[1]:
            raise InputError(f"no biotype column named in a '#' header line (one of {', '.join(BIOTYPE_COLUMNS)}); use biotype 'all'", path=path, value=header)
        df = df[df[col] == biotype]
        if df.empty:
            raise InputError("no gene of this biotype", path=path, key="biotype", value=biotype)
    no_symbol = ("", ".", "NA")
    gene_id = df[4] if df.shape[1] > 4 else df[3]
    numeric = pd.to_numeric(gene_id, errors="coerce").notna() | gene_id.isin(no_symbol)
    gene_id = gene_id.where(~numeric, df[3])
    genes = pd.DataFrame(
        {
            "chrom": df[0].to_numpy(),
            "start": pd.to_numeric(df[1]).to_numpy(np.int64),
            "end": pd.to_numeric(df[2]).to_numpy(np.int64),
            "name": np.where(df[3].isin(no_symbol), gene_id, df[3]),
            "gene_id": gene_id.to_numpy(),
            "strand": np.where(df[5].isin(["+", "-"]), df[5], "+") if df.shape[1] > 5 else "+",
        }
    )
    size = genes["chrom"].map(sizes)
    genes = genes[size.notna() & (genes["start"] >= 0) & (genes["end"] > genes["start"]) & (genes["end"] <= size.fillna(0))]
    if genes.empty:
        raise InputError(f"no gene on the chromosomes {', '.join(list(sizes)[:5])}...", path=path)
    order = {c: i for i, c in enumerate(sizes)}
    genes = genes.assign(_order=genes["chrom"].map(order)).sort_values(["_order", "start"], kind="stable")
    return genes.drop(columns="_order").drop_duplicates("name").reset_index(drop=True)


def _rna_profiles(rng, genome: DemoGenome, genes: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Mean expression per expression group (groups x genes) and the state program's genes,
    as :func:`simulate_rna` draws them."""
    n_groups = max(RNA_GROUP) + 1
    base = rng.lognormal(mean=0.0, sigma=1.5, size=len(genes))
    profile = np.tile(base, (n_groups, 1))
    blk = ((genes["start"].to_numpy()) // genome.block).astype(int)
    for g in range(n_groups):
        markers = rng.choice(len(genes), size=max(10, len(genes) // 30), replace=False)
        profile[g, markers] *= rng.uniform(4, 10, size=len(markers))
        # active compartment, more expression: the compartments of the group's first
        # type, so that types sharing an expression group share it exactly
        chromatin = HIC_GROUP[RNA_GROUP.index(g)]
        comp = np.array([genome.comp[chromatin][c][b] for c, b in zip(genes["chrom"], blk)])
        profile[g] *= np.where(comp > 0, 1.5, 0.7)
    program = rng.choice(len(genes), size=max(10, len(genes) // 20), replace=False)
    return profile, program


def write_rna_blocks(
    path: Path, rng, genome: DemoGenome, genes: pd.DataFrame, cells: list[str], types: np.ndarray, libsize: np.ndarray, state: np.ndarray
) -> None:
    """Write the genes x cells TSV of :func:`simulate_rna`'s model (same means, NB and
    fractional splits) block by block of genes: memory stays that of one block whatever
    the number of cells, and counts are formatted by table lookup (they are quarters)."""
    profile, program = _rna_profiles(rng, genome, genes)
    groups = np.asarray(RNA_GROUP)[types]
    factor = np.exp(np.log(4.0) * (2 * state - 1))  # the state program's scale, per cell
    in_prog = np.zeros(len(genes), dtype=bool)
    in_prog[program] = True
    # each cell's total mean before scaling to its library size, as simulate_rna sums it
    total = profile[:, ~in_prog].sum(1)[groups] + profile[:, in_prog].sum(1)[groups] * factor
    scale = libsize / total
    block = max(1, min(RNA_BLOCK, 4_000_000 // max(1, len(cells))))
    starts = range(0, len(genes), block)
    block_seqs = np.random.SeedSequence(int(rng.integers(2**63))).spawn(len(starts))
    names = genes["name"].to_numpy()
    table = np.array(["%g" % (k / 4) for k in range(4096)], dtype=object)
    theta = 2.0
    with atomic_path(path) as tmp, open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=1) as gz:
        gz.write(("gene\t" + "\t".join(cells) + "\n").encode())
        for lo, seq in zip(starts, block_seqs):
            brng = np.random.default_rng(seq)
            hi = min(lo + block, len(genes))
            mu = profile[:, lo:hi][groups].T  # genes x cells
            mu[in_prog[lo:hi]] *= factor[None, :]
            mu *= scale[None, :]
            counts = brng.negative_binomial(theta, theta / (theta + mu)).astype(np.float64)
            split = (counts > 0) & (brng.random(counts.shape) < 0.12)
            counts[split] -= brng.choice([0.5, 0.25, 0.75], size=int(split.sum()))
            quarters = np.rint(counts * 4).astype(np.int64)
            if quarters.max(initial=0) >= len(table):
                table = np.array(["%g" % (k / 4) for k in range(int(quarters.max()) + 1)], dtype=object)
            text = table[quarters]
            gz.write(("\n".join(n + "\t" + "\t".join(row) for n, row in zip(names[lo:hi], text)) + "\n").encode())


def write_demo(
    outdir,
    n_cells: int = 120,
    seed: int = 0,
    scale: float | None = None,
    n_genes: int | None = None,
    *,
    chromsizes=None,
    chromosomes: list[str] | None = None,
    genes_bed=None,
    biotype: str = "protein_coding",
    contacts: int | None = None,
    cis_fraction: float | None = None,
    decay: float | None = None,
    workers: int | None = None,
) -> dict:
    """Write the demo dataset into ``outdir`` and return the paths written.

    Layout: ``chrom.sizes``, ``genes.bed``, ``rna.tsv.gz``, ``cells.tsv``,
    ``pairs/<cell>.pairs.gz``, ``truth.tsv`` (cell types for every barcode).

    Without keyword options: four mouse chromosomes scaled by ``scale`` (0.25), ``n_genes``
    (3,000) simulated genes, a median of 30,000 contacts per cell; these bytes are fixed by
    the seed (the tests hold them).

    Parameters
    ----------
    chromsizes
        A real genome's sizes file: its numbered chromosomes and X (or ``chromosomes``)
        at full size (``scale`` 1).
    genes_bed
        Real genes (needs ``chromsizes``): ``n_genes`` of them drawn at random (default:
        all) of ``biotype`` (``all``: any); the RNA matrix rows are their names.
    contacts
        Median contacts per cell (log-normal spread, sigma 0.3).
    cis_fraction, decay
        Per-cell cis share and P(s) exponent drawn within +-0.03 / +-0.1 of these
        (defaults with ``chromsizes``: 0.9 and 1.1; otherwise 0.85-0.95 and 1.0-1.5).
    workers
        Processes writing pairs files (default: the usable cores, at most 8).
    """
    if n_cells < 8:
        raise InputError("the demo needs at least 8 cells", key="cells", value=n_cells)
    real = chromsizes is not None
    if genes_bed is not None and not real:
        raise InputError("real genes need real chromosome sizes: give chromsizes too", key="genes_bed", value=str(genes_bed))
    if contacts is not None and contacts < 1:
        raise InputError("contacts per cell must be positive", key="contacts", value=contacts)
    if cis_fraction is not None and not 0.0 <= cis_fraction <= 1.0:
        raise InputError("the cis fraction lies in [0, 1]", key="cis_fraction", value=cis_fraction)
    if decay is not None and decay <= DECAY_JITTER:
        raise InputError(f"the decay exponent must exceed {DECAY_JITTER}", key="decay", value=decay)
    scale = (1.0 if real else 0.25) if scale is None else scale
    if n_genes is None and genes_bed is None:
        n_genes = 3000
    custom = real or cis_fraction is not None or decay is not None
    out = Path(outdir)
    (out / "pairs").mkdir(parents=True, exist_ok=True)
    root = np.random.SeedSequence(seed)
    g_seq, r_seq, *cell_seqs = root.spawn(2 + n_cells + 2)
    rng = np.random.default_rng(g_seq)
    genome = DemoGenome(rng, scale, max(HIC_GROUP) + 1, genome_sizes(chromsizes, chromosomes) if real else None)
    if genes_bed is not None:
        genes = read_gene_bed(genes_bed, genome.sizes, biotype)
        if n_genes is not None and n_genes < len(genes):
            genes = genes.iloc[np.sort(rng.choice(len(genes), size=n_genes, replace=False))].reset_index(drop=True)
        elif n_genes is not None and n_genes > len(genes):
            log.warning(
                "demo: %s has %d genes of biotype %s on these chromosomes, fewer than the %d asked for: all taken", genes_bed, len(genes), biotype, n_genes
            )
        n_genes = len(genes)
    else:
        genes = simulate_genes(rng, genome, n_genes)

    ids = [f"cell{i:04d}" for i in range(n_cells)]
    types = np.arange(n_cells) % len(CELL_TYPES)
    np.random.default_rng(seed + 1).shuffle(types)
    median = 30_000 if contacts is None else contacts
    n_contacts = np.random.default_rng(cell_seqs[0]).lognormal(np.log(median), 0.3, n_cells).astype(int)
    n_contacts[1] = 400  # fails the contact threshold
    state = np.random.default_rng(seed + 2).random(n_cells + 2)  # the last two: RNA-only barcodes
    jobs = [(out / "pairs" / f"{cid}.pairs.gz", cell_seqs[i], genome, HIC_GROUP[types[i]], int(n_contacts[i]), float(state[i])) for i, cid in enumerate(ids)]
    if custom:
        cis = (0.9 if real else None) if cis_fraction is None else cis_fraction
        alpha = (1.1 if real else None) if decay is None else decay
        trans_range = (0.05, 0.15) if cis is None else (max(0.0, 1 - cis - CIS_JITTER), min(1.0, 1 - cis + CIS_JITTER))
        alpha_range = (1.0, 1.5) if alpha is None else (alpha - DECAY_JITTER, alpha + DECAY_JITTER)
        assembly = Path(chromsizes).name.split(".")[0] if real else "mm10-scaled-demo"
        jobs = [job + (alpha_range, trans_range, assembly) for job in jobs]
    # one process per core: each cell has its own seed, so the bytes do not depend on it
    if workers is None:
        workers = max(1, min(len(os.sched_getaffinity(0)), 8))
    progress = Progress(n_cells, "cells", log, verb="demo: wrote")
    with ProcessPoolExecutor(workers) if workers > 1 else nullcontext() as pool:
        for _ in (pool.map if pool else map)(_write_cell, jobs):
            progress.update()

    # RNA: every sheet cell but the last, plus two RNA-only barcodes
    rna_ids = ids[:-1] + ["orphan0001", "orphan0002"]
    rna_types = np.concatenate([types[:-1], [0, 1]])
    rrng = np.random.default_rng(r_seq)
    lib = rrng.lognormal(np.log(4000), 0.3, len(rna_ids))
    lib[2] = 60.0  # fails the UMI threshold
    rna_state = np.concatenate([state[: n_cells - 1], state[n_cells:]])
    if real:
        write_rna_blocks(out / "rna.tsv.gz", rrng, genome, genes, rna_ids, rna_types, lib, rna_state)
    else:
        counts = simulate_rna(rrng, genome, genes, rna_types, lib, rna_state)
        mat = pd.DataFrame(counts, index=pd.Index(genes["name"], name="gene"), columns=rna_ids)
        buf = io.StringIO()
        mat.to_csv(buf, sep="\t", float_format="%g")
        _write_gz_text(out / "rna.tsv.gz", buf.getvalue())

    write_chromsizes(out / "chrom.sizes", genome.sizes)
    genes.to_csv(out / "genes.bed", sep="\t", header=False, index=False, columns=["chrom", "start", "end", "name", "gene_id", "strand"])
    sheet = pd.DataFrame({"cell_id": ids, "pairs": [str(out / "pairs" / f"{c}.pairs.gz") for c in ids], "cell_type": [CELL_TYPES[t] for t in types]})
    sheet.to_csv(out / "cells.tsv", sep="\t", index=False)
    truth = pd.DataFrame(
        {
            "cell_id": ids + rna_ids[-2:],
            "cell_type": [CELL_TYPES[t] for t in types] + [CELL_TYPES[t] for t in rna_types[-2:]],
            "state": np.round(state, 4),
        }
    )
    truth.to_csv(out / "truth.tsv", sep="\t", index=False)
    log.info("demo: %d cells, %d genes, %d chromosomes in %s", n_cells, n_genes, len(genome.sizes), out)
    return {"sheet": out / "cells.tsv", "rna": out / "rna.tsv.gz", "genes": out / "genes.bed", "chromsizes": out / "chrom.sizes"}
