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
"""

from __future__ import annotations

import gzip
import io
import logging
import os
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pandas as pd

from .io.atomic import atomic_path
from .io.genome import write_chromsizes

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


class DemoGenome:
    """Chromosomes, and compartments and TAD boundaries per chromatin group (the cells
    of one group share them)."""

    def __init__(self, rng: np.random.Generator, scale: float, n_types: int):
        self.sizes = {c: int(s * scale) for c, s in MM10.items()}
        self.names = list(self.sizes)
        self.block = 1_000_000  # compartment/TAD grid
        self.state = {c: rng.random(-(-s // self.block)) < 0.25 for c, s in self.sizes.items()}  # state domains
        self.comp = {}  # type -> chrom -> +-1 per block
        self.tad = {}  # type -> chrom -> TAD id per block
        base = {c: self._blocks(rng, s) for c, s in self.sizes.items()}
        for t in range(n_types):
            self.comp[t], self.tad[t] = {}, {}
            for c, s in self.sizes.items():
                comp = base[c].copy()
                flip = rng.random(len(comp)) < 0.35  # type-specific compartment switches
                comp[flip] *= -1
                self.comp[t][c] = comp
                nblk = len(comp)
                bounds = np.sort(rng.choice(np.arange(1, nblk), size=max(1, nblk // 4), replace=False))
                self.tad[t][c] = np.searchsorted(bounds, np.arange(nblk), side="right")

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


def simulate_cell(rng, genome: DemoGenome, ctype: int, n_contacts: int, state: float = 0.5) -> pd.DataFrame:
    """Contacts of one cell of chromatin group ``ctype`` as a 4DN pairs table (upper
    triangle, sorted).

    ``state`` (0-1) scales contacts whose ends both lie in state domains by 0.4-1.6.
    """
    alpha = rng.uniform(1.0, 1.5)
    trans_frac = rng.uniform(0.05, 0.15)
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
        comp = np.empty(len(ci))
        same_tad = np.empty(len(ci), dtype=bool)
        in_state = np.empty(len(ci), dtype=bool)
        compact = np.empty(len(ci), dtype=bool)
        for k, c in enumerate(genome.names):
            sel = ci == k
            b1 = (pos1[sel] - 1) // genome.block
            b2 = (pos2[sel] - 1) // genome.block
            cv = genome.comp[ctype][c]
            comp[sel] = cv[b1] * cv[b2]
            compact[sel] = (cv[b1] < 0) & (cv[b2] < 0)
            tv = genome.tad[ctype][c]
            same_tad[sel] = tv[b1] == tv[b2]
            sv = genome.state[c]
            in_state[sel] = sv[b1] & sv[b2]
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


def write_pairs(path: Path, table: pd.DataFrame, sizes: dict[str, int]) -> None:
    header = ["## pairs format v1.0", "#sorted: chr1-chr2-pos1-pos2", "#shape: upper triangle", "#genome_assembly: mm10-scaled-demo"]
    header += [f"#chromosome: {c} {s}" for c, s in sizes.items()]
    header.append("#columns: " + PAIRS_COLUMNS)
    buf = io.StringIO()
    table.to_csv(buf, sep="\t", header=False, index=False)
    _write_gz_text(path, "\n".join(header) + "\n" + buf.getvalue())


def _write_cell(job) -> None:
    path, seq, genome, group, n_contacts, state = job
    write_pairs(path, simulate_cell(np.random.default_rng(seq), genome, group, n_contacts, state), genome.sizes)


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
    mu = profile[np.asarray(RNA_GROUP)[types]].T.copy()  # genes x cells
    mu[program] *= np.exp(np.log(4.0) * (2 * state[None, :] - 1))
    mu = mu / mu.sum(axis=0, keepdims=True) * libsize[None, :]
    theta = 2.0
    counts = rng.negative_binomial(theta, theta / (theta + mu)).astype(np.float64)
    nz = counts > 0
    split = nz & (rng.random(counts.shape) < 0.12)
    counts[split] -= rng.choice([0.5, 0.25, 0.75], size=int(split.sum()))
    return counts


def write_demo(outdir, n_cells: int = 120, seed: int = 0, scale: float = 0.25, n_genes: int = 3000) -> dict:
    """Write the demo dataset into ``outdir`` and return the paths written.

    Layout: ``chrom.sizes``, ``genes.bed``, ``rna.tsv.gz``, ``cells.tsv``,
    ``pairs/<cell>.pairs.gz``, ``truth.tsv`` (cell types for every barcode).
    """
    if n_cells < 8:
        raise ValueError("the demo needs at least 8 cells")
    out = Path(outdir)
    (out / "pairs").mkdir(parents=True, exist_ok=True)
    root = np.random.SeedSequence(seed)
    g_seq, r_seq, *cell_seqs = root.spawn(2 + n_cells + 2)
    rng = np.random.default_rng(g_seq)
    genome = DemoGenome(rng, scale, max(HIC_GROUP) + 1)
    genes = simulate_genes(rng, genome, n_genes)

    ids = [f"cell{i:04d}" for i in range(n_cells)]
    types = np.arange(n_cells) % len(CELL_TYPES)
    np.random.default_rng(seed + 1).shuffle(types)
    n_contacts = np.random.default_rng(cell_seqs[0]).lognormal(np.log(30_000), 0.3, n_cells).astype(int)
    n_contacts[1] = 400  # fails the contact threshold
    state = np.random.default_rng(seed + 2).random(n_cells + 2)  # the last two: RNA-only barcodes
    jobs = [(out / "pairs" / f"{cid}.pairs.gz", cell_seqs[i], genome, HIC_GROUP[types[i]], int(n_contacts[i]), float(state[i])) for i, cid in enumerate(ids)]
    # one process per core: each cell has its own seed, so the bytes do not depend on it
    workers = max(1, min(len(os.sched_getaffinity(0)), 8))
    with ProcessPoolExecutor(workers) if workers > 1 else nullcontext() as pool:
        done = (pool.map if pool else map)(_write_cell, jobs)
        for i, _ in enumerate(done):
            if (i + 1) % 20 == 0 or i + 1 == n_cells:
                log.info("demo: wrote %d/%d cells", i + 1, n_cells)

    # RNA: every sheet cell but the last, plus two RNA-only barcodes
    rna_ids = ids[:-1] + ["orphan0001", "orphan0002"]
    rna_types = np.concatenate([types[:-1], [0, 1]])
    rrng = np.random.default_rng(r_seq)
    lib = rrng.lognormal(np.log(4000), 0.3, len(rna_ids))
    lib[2] = 60.0  # fails the UMI threshold
    rna_state = np.concatenate([state[: n_cells - 1], state[n_cells:]])
    counts = simulate_rna(rrng, genome, genes, rna_types, lib, rna_state)
    mat = pd.DataFrame(counts, index=pd.Index(genes["name"], name="gene"), columns=rna_ids)
    buf = io.StringIO()
    mat.to_csv(buf, sep="\t", float_format="%g")
    _write_gz_text(out / "rna.tsv.gz", buf.getvalue())

    write_chromsizes(out / "chrom.sizes", genome.sizes)
    genes.to_csv(out / "genes.bed", sep="\t", header=False, index=False, columns=["chrom", "start", "end", "name", "gene_id", "strand"])
    sheet = pd.DataFrame(
        {"cell_id": ids, "pairs": [str(out / "pairs" / f"{c}.pairs.gz") for c in ids], "cell_type": [CELL_TYPES[t] for t in types]}
    )
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
