"""Damaged inputs of every format end in one InputError naming the file, never a traceback.

Real files from ``../shared/data`` (or small slices of them that the test writes, in the
formats users bring) are cut at random offsets, have random bytes flipped, or both;
gzipped files are damaged both in their compressed bytes and in the text inside
(re-compressed). Every reader runs on every damaged copy and must either refuse it with
an :class:`~ampflow.base.errors.InputError` whose message is one line naming the file, or
accept it and return a result that is still valid (checked here against the undamaged
original: a flipped letter in a read id harms nothing). Any other exception fails.

A few damaged files also go through the real CLI in a subprocess: exit status 2, no
traceback, one error line on stderr naming the file.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from ampflow.base.errors import InputError

REPO = Path(__file__).resolve().parents[1]
N_DAMAGED = 30  # damaged copies per format (split over its source files)
SEED = 20240611
HG19_21_22 = {"chr21": 48_129_895, "chr22": 51_304_566}


# --- damage --------------------------------------------------------------------------


def _position(rng: np.random.Generator, n: int) -> int:
    """A byte offset: half uniform, half near either end (headers, footers, superblocks)."""
    u = rng.random()
    edge = min(n, 4096)
    if u < 0.5:
        return int(rng.integers(0, n))
    if u < 0.75:
        return int(rng.integers(0, edge))
    return int(n - 1 - rng.integers(0, edge))


def damage(data: bytes, rng: np.random.Generator, kind: str) -> tuple[bytes, int]:
    """``data`` cut at a random offset (``cut``), with 1-8 bytes flipped (``flip``), or
    both; returns the damaged bytes and the number of flipped bytes."""
    b = bytearray(data)
    flips = 0
    if "flip" in kind:
        flips = int(rng.integers(1, 9))
        for _ in range(flips):
            b[_position(rng, len(b))] ^= int(rng.integers(1, 256))
    if "cut" in kind:
        b = b[: int(rng.integers(0, len(b)))]
    return bytes(b), flips


KINDS = ("cut", "flip", "cut+flip")


# --- bookkeeping ---------------------------------------------------------------------


@dataclass
class Tally:
    tried: int = 0
    refused: int = 0
    accepted: int = 0
    failures: list[str] = field(default_factory=list)


TALLIES: dict[str, Tally] = {}


def run_reader(fmt: str, path: Path, read: Callable, check: Callable, named: Path | None = None) -> None:
    """Run ``read(path)``; record a one-line InputError naming ``named`` (default
    ``path``) as refused, a result that passes ``check`` as accepted, anything else as a
    failure."""
    t = TALLIES.setdefault(fmt, Tally())
    t.tried += 1
    named = path if named is None else named
    try:
        result = read(path)
    except InputError as e:
        msg = str(e)
        if "\n" in msg or str(named) not in msg:
            t.failures.append(f"{path.name}: InputError not one line naming {named}: {msg!r}")
        else:
            t.refused += 1
        return
    except Exception as e:  # noqa: BLE001 - the point of the test: name what escaped
        t.failures.append(f"{path.name}: {type(e).__module__}.{type(e).__name__}: {str(e)[:200]!r}")
        return
    try:
        check(result)
    except AssertionError as e:
        t.failures.append(f"{path.name}: accepted but invalid: {e}")
        return
    t.accepted += 1


def damaged_copies(fmt: str, sources: list[Path], out: Path, n: int, gz_text: bool = True):
    """Yield ``(damaged path, source, flips)``, ``n`` in all, deterministic per format.

    For a gzipped source, every other copy is damaged in the text inside and
    re-compressed (``gz_text``), the others in the compressed bytes.
    """
    rng = np.random.default_rng([SEED, sum(fmt.encode())])
    out.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        src = sources[i % len(sources)]
        kind = KINDS[(i // len(sources)) % len(KINDS)]
        data = src.read_bytes()
        gz = data[:2] == b"\x1f\x8b"
        if gz and gz_text and i % 2:
            bad, flips = damage(gzip.decompress(data), rng, kind)
            bad = gzip.compress(bad, mtime=0)
            layer = "text"
        else:
            bad, flips = damage(data, rng, kind)
            layer = "gzip" if gz else "raw"
        name = f"{i:02d}-{kind.replace('+', '_')}-{layer}-{src.name}"
        dst = out / name
        dst.write_bytes(bad)
        yield dst, src, flips


@pytest.fixture(scope="module", autouse=True)
def summary_table():
    """After the module: one table of every format tried (shown with ``pytest -s``)."""
    yield
    if TALLIES:
        print("\n\ndamaged inputs per format (every one refused in one line or accepted valid)")
        _print_table(list(TALLIES))


# --- sources the test writes from real data -------------------------------------------


@pytest.fixture(scope="module")
def data(shared_data) -> Path:
    return shared_data


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def rna_slice(data, work):
    """The first 200 genes x 60 cells of the real HiRES brain RNA matrix: a TSV.gz, a
    CSV, a 10x MTX folder and two h5ad (plain and gzip-compressed datasets)."""
    import anndata as ad

    df = pd.read_csv(
        data / "hires" / "GSE223917_HiRES_brain.rna.umicount.tsv.gz",
        sep="\t",
        index_col=0,
        nrows=200,
    )
    df = df.iloc[:, :60]
    d = work / "rna"
    d.mkdir()
    tsv = d / "brain.tsv.gz"
    with gzip.open(tsv, "wt") as fh:
        df.to_csv(fh, sep="\t")
    csv = d / "brain.csv"
    df.to_csv(csv)
    mtx = d / "mtx"
    mtx.mkdir()
    counts = np.round(df.to_numpy())
    from scipy.io import mmwrite

    with gzip.open(mtx / "matrix.mtx.gz", "wb") as fh:
        mmwrite(fh, sp.coo_matrix(counts))  # genes x cells, as 10x writes it
    with gzip.open(mtx / "features.tsv.gz", "wt") as fh:
        fh.writelines(f"ENSG{i:05d}\t{g}\tGene Expression\n" for i, g in enumerate(df.index))
    with gzip.open(mtx / "barcodes.tsv.gz", "wt") as fh:
        fh.writelines(f"{c}\n" for c in df.columns)
    adata = ad.AnnData(X=sp.csr_matrix(df.to_numpy().T.astype(np.float32)))
    adata.obs_names = list(df.columns)
    adata.var_names = list(df.index)
    h5 = d / "brain.h5ad"
    adata.write_h5ad(h5)
    h5z = d / "brain.gz.h5ad"
    adata.write_h5ad(h5z, compression="gzip")
    return {
        "tsv": tsv,
        "csv": csv,
        "mtx": mtx,
        "h5ad": [h5, h5z],
        "shape": (df.shape[1], df.shape[0]),
    }


def check_rna(shape, flips: int):
    n_cells, n_genes = shape

    def check(adata):
        X = sp.csr_matrix(adata.X)
        assert adata.n_obs > 0 and adata.n_vars > 0, adata.shape
        # a flipped byte can split a line in two (one more row), never add more
        assert adata.n_obs <= n_cells + flips and adata.n_vars <= n_genes + flips, (
            adata.shape,
            shape,
        )
        assert np.isfinite(X.data).all() and (X.data >= 0).all(), "non-finite or negative counts"
        assert not adata.obs_names.has_duplicates and not adata.var_names.has_duplicates

    return check


# --- pairs ---------------------------------------------------------------------------


def _pairs_sources(data: Path):
    from ampflow.io.pairs import sniff_layout

    out = []
    for rel in (
        "hires/hires_utils_test.hg38.pairs.gz",
        "pairs/4dn.chr21_22.pairs.gz",
        "pairs/mm9.sample1.pairs",
    ):
        p = data / rel
        sizes = sniff_layout(p).header_chromsizes or dict(HG19_21_22)
        out.append((p, sizes))
    return out


def _read_pairs_with(sizes, engine):
    from ampflow.io.genome import ChromNamer
    from ampflow.io.pairs import read_pairs

    namer = ChromNamer(tuple(sizes))
    return lambda p: read_pairs(p, namer, sizes, engine=engine)


def check_contacts(sizes: dict, n_original: int, flips: int):
    size = np.array(list(sizes.values()), dtype=np.int64)

    def check(c):
        n = len(c)
        assert 0 < n <= n_original + flips, (n, n_original)
        assert len(c.chrom1) == len(c.chrom2) == len(c.pos2) == n
        for ch, pos in ((c.chrom1, c.pos1), (c.chrom2, c.pos2)):
            assert ((ch >= 0) & (ch < len(size))).all(), "chromosome code outside the genome"
            assert ((pos >= 0) & (pos <= size[ch])).all(), "position outside its chromosome"
        s = c.stats
        assert s["cis"] + s["trans"] == n
        assert s["total"] == n + s["dropped_unknown_chrom"] + s["dropped_excluded"]

    return check


def test_fuzz_pairs(data, work):
    for src, sizes in _pairs_sources(data):
        n0 = len(_read_pairs_with(sizes, "pandas")(src))
        srcs = [src]
        for j, (bad, _, flips) in enumerate(damaged_copies(f"pairs {src.name}", srcs, work / "pairs", N_DAMAGED // 3 + 4)):
            fmt = "pairs.gz" if src.name.endswith(".gz") else "pairs"
            engine = ("pandas", "compiled")[j % 2]
            run_reader(
                fmt,
                bad,
                _read_pairs_with(sizes, engine),
                check_contacts(sizes, n0, flips),
            )
    _assert_clean("pairs", "pairs.gz")


# --- RNA -----------------------------------------------------------------------------


def test_fuzz_rna_tables(rna_slice, work):
    from ampflow.io.rna import read_rna

    for fmt, src in (("RNA TSV.gz", rna_slice["tsv"]), ("RNA CSV", rna_slice["csv"])):
        for bad, _, flips in damaged_copies(fmt, [src], work / "rna-bad", N_DAMAGED):
            run_reader(fmt, bad, read_rna, check_rna(rna_slice["shape"], flips))
    _assert_clean("RNA TSV.gz", "RNA CSV")


def test_fuzz_rna_mtx(rna_slice, work):
    from ampflow.io.rna import read_rna

    src = rna_slice["mtx"]
    files = sorted(src.iterdir())
    for i, (bad, target, flips) in enumerate(damaged_copies("10x MTX", files, work / "mtx-parts", N_DAMAGED)):
        folder = work / "mtx-bad" / f"{i:02d}"
        shutil.copytree(src, folder)
        shutil.move(bad, folder / target.name)
        run_reader("10x MTX", folder, read_rna, check_rna(rna_slice["shape"], flips))
    _assert_clean("10x MTX")


def test_fuzz_rna_h5ad(rna_slice, work):
    from ampflow.io.rna import read_rna

    for bad, _, flips in damaged_copies("h5ad", rna_slice["h5ad"], work / "h5ad-bad", N_DAMAGED):
        bad = bad.rename(bad.with_name(bad.name.replace(".gz.h5ad", "-gz.h5ad")))
        run_reader("h5ad", bad, read_rna, check_rna(rna_slice["shape"], flips))
    _assert_clean("h5ad")


# --- scool ---------------------------------------------------------------------------


def _read_scool(path):
    from ampflow.io.cool import cell_bins, cell_pixels, scool_cells

    cells = scool_cells(path)
    bins, binsize = cell_bins(path, cells[0])
    return cells, bins, binsize, [cell_pixels(path, c, len(bins)) for c in cells]


def check_scool(n_cells: int):
    def check(result):
        cells, bins, binsize, pixels = result
        assert len(cells) == n_cells, (len(cells), n_cells)
        assert binsize > 0 and len(bins) > 0
        assert (bins["start"] >= 0).all() and (bins["end"] > bins["start"]).all()
        for px in pixels:
            b1, b2 = px["bin1_id"].to_numpy(), px["bin2_id"].to_numpy()
            assert ((b1 >= 0) & (b1 <= b2) & (b2 < len(bins))).all(), "bin id out of range"
            assert np.isfinite(px["count"].to_numpy()).all() and (px["count"] >= 0).all()

    return check


def test_fuzz_scool(data, work):
    from ampflow.io.cool import scool_cells

    sources = sorted((data / "schic").glob("*.scool"))
    n_cells = {s.name: len(scool_cells(s)) for s in sources}
    for bad, src, _ in damaged_copies("scool", sources, work / "scool-bad", N_DAMAGED):
        run_reader("scool", bad, _read_scool, check_scool(n_cells[src.name]))
    _assert_clean("scool")


# --- parquet -------------------------------------------------------------------------


def test_fuzz_parquet(data, work):
    """Graph tables as the graph step writes them, from real genes of the annotation."""
    from ampflow.io.tables import read_parquet_table
    from ampflow.train.data import EDGE_COLUMNS

    genes = pd.read_csv(
        data / "annotation" / "mm10_ensembl96_genes.bed.gz",
        sep="\t",
        header=None,
        nrows=400,
    )
    d = work / "parquet"
    d.mkdir()
    nodes = pd.DataFrame({"name": genes[4].astype(str), "kind": "gene"})
    rng = np.random.default_rng(0)
    edges = pd.DataFrame(
        {
            "source": rng.integers(0, len(nodes), 1000),
            "target": rng.integers(0, len(nodes), 1000),
            "weight": rng.random(1000).astype(np.float32),
            "sign": rng.choice(np.array([-1, 1], np.int8), 1000),
            "kind": pd.Categorical(rng.choice(["prior", "contact"], 1000)),
        }
    )
    nodes.to_parquet(d / "nodes.parquet")
    edges.to_parquet(d / "edges.parquet")
    columns = {"nodes.parquet": {"name": "string"}, "edges.parquet": EDGE_COLUMNS}
    for bad, src, _ in damaged_copies(
        "parquet",
        [d / "nodes.parquet", d / "edges.parquet"],
        work / "parquet-bad",
        N_DAMAGED,
    ):
        n0 = len(nodes) if src.name == "nodes.parquet" else len(edges)

        def check(df, n0=n0, cols=columns[src.name]):
            assert 0 < len(df) <= n0, len(df)
            assert set(cols) <= set(df.columns)
            for c in cols:
                v = df[c].to_numpy()
                assert v.dtype == (nodes if cols is columns["nodes.parquet"] else edges)[c].dtype, (c, v.dtype)
                assert v.dtype.kind != "f" or np.isfinite(v).all()

        run_reader(
            "parquet",
            bad,
            lambda p, cols=columns[src.name]: read_parquet_table(p, cols),
            check,
        )
    _assert_clean("parquet")


# --- FASTA, BED, chrom.sizes, cell sheet ----------------------------------------------


def test_fuzz_fasta(data, work):
    from ampflow.io.fasta import DNA, PROTEIN, FastaCleaner, FastaPolicy

    sources = [
        (data / "fasta" / "vibrant_mixed_example_prodigal.faa", PROTEIN),
        (data / "fasta" / "esm_some_proteins.fasta", PROTEIN),
        (data / "fasta" / "virnucpro_sample_viral_test.fasta", DNA),
    ]
    alphabet = {p.name: a for p, a in sources}
    POLICY = FastaPolicy(duplicate_ids="rename")  # Prodigal files repeat ids
    n0 = {p.name: sum(1 for _ in FastaCleaner(p, a, POLICY, 1022).records()) for p, a in sources}
    for bad, src, flips in damaged_copies("fasta", [p for p, _ in sources], work / "fasta-bad", N_DAMAGED):
        a = alphabet[src.name]

        def check(recs, n0=n0[src.name], a=a, flips=flips):
            assert 0 < len(recs) <= n0 + flips, (len(recs), n0)
            for r in recs:
                assert r.seq and set(r.seq) <= a.letters and len(r.seq) <= 1022, r.id

        run_reader(
            "FASTA",
            bad,
            lambda p, a=a: list(FastaCleaner(p, a, POLICY, 1022).records()),
            check,
        )
    _assert_clean("FASTA")


def test_fuzz_bed_and_chromsizes(data, work):
    from ampflow.io.annotation import read_genes
    from ampflow.io.genome import ChromNamer, read_chromsizes

    sizes_src = data / "annotation" / "mm10.chrom.sizes"
    sizes = read_chromsizes(sizes_src)
    namer = ChromNamer(tuple(sizes))
    # a slice of the real BED keeps this fast; the gzip layer is damaged as written
    bed = work / "genes.bed.gz"
    with (
        gzip.open(data / "annotation" / "mm10_ensembl96_genes.bed.gz", "rt") as fh,
        gzip.open(bed, "wt") as out,
    ):
        out.writelines(line for _, line in zip(range(3000), fh))
    n_genes = len(read_genes(bed, namer, sizes))
    for bad, _, flips in damaged_copies("bed", [bed], work / "bed-bad", N_DAMAGED):

        def check(df, flips=flips):
            assert 0 < len(df) <= n_genes + flips
            assert (df["start"] >= 0).all() and (df["end"] >= df["start"]).all()
            assert df["chrom"].isin(list(sizes)).all()

        run_reader("gene BED.gz", bad, lambda p: read_genes(p, namer, sizes), check)
    for bad, _, flips in damaged_copies("sizes", [sizes_src], work / "sizes-bad", N_DAMAGED):

        def check(s, flips=flips):
            assert 0 < len(s) <= len(sizes) + flips
            assert all(isinstance(v, int) and v > 0 for v in s.values())

        run_reader("chrom.sizes", bad, read_chromsizes, check)
    _assert_clean("gene BED.gz", "chrom.sizes")


def test_fuzz_sheet(data, work):
    from ampflow.io.sheet import CELL_ID, read_sheet

    pairs = sorted((data / "schic" / "gageseq_chr1").glob("*.pairs.gz"))
    sheet = work / "cells.tsv"
    sheet.write_text("cell_id\tpairs\tcell_type\n" + "".join(f"{p.name.split('.')[0]}\t{p}\tneuron\n" for p in pairs))
    n0 = len(read_sheet(sheet))
    for bad, _, flips in damaged_copies("sheet", [sheet], work / "sheet-bad", N_DAMAGED):

        def check(df, flips=flips):
            assert 0 < len(df) <= n0 + flips
            assert all(CELL_ID.match(c) for c in df["cell_id"])
            assert all(Path(p).is_file() for p in df["pairs"])

        run_reader("cell sheet", bad, read_sheet, check)
    _assert_clean("cell sheet")


# --- the CLI -------------------------------------------------------------------------

LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING) ")


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    return subprocess.run(
        [sys.executable, "-m", "ampflow.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def _assert_one_line(proc: subprocess.CompletedProcess, command: str, named: Path, out: Path) -> None:
    t = TALLIES.setdefault("CLI (subproc.)", Tally())
    t.tried += 1
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    other = [line for line in err.splitlines() if line.strip() and not LOG_RECORD.match(line)]
    assert len(other) == 1, other
    assert other[0].startswith(f"ampflow {command}: error: ") and str(named) in other[0], other[0]
    assert not out.exists(), f"{out} written although the input was refused"
    t.refused += 1


@pytest.mark.slow
def test_fuzz_cli(data, rna_slice, work):
    """Damaged files that the readers refuse, through the real commands in subprocesses."""
    from ampflow.io.cool import scool_cells

    sizes = data / "annotation" / "mm10.chrom.sizes"
    hires = data / "hires" / "GSM6998595_GasaE751001.pairs.gz"
    rng = np.random.default_rng(SEED)
    d = work / "cli"
    d.mkdir()
    # bin-pairs: the real HiRES cell cut inside its gzip stream, and with flipped bytes
    raw = hires.read_bytes()
    cases = {"cut": raw[: len(raw) // 3], "flip": damage(raw, rng, "flip")[0]}
    for name, bad in cases.items():
        p = d / f"{name}.pairs.gz"
        p.write_bytes(bad)
        out = d / f"{name}.cool"
        proc = _cli(
            [
                "bin-pairs",
                str(p),
                "--chromsizes",
                str(sizes),
                "--resolution",
                "1000000",
                "--out",
                str(out),
            ]
        )
        _assert_one_line(proc, "bin-pairs", p, out)
    # load-rna: a cut TSV.gz and a damaged h5ad
    tsv = d / "cut.tsv.gz"
    raw = rna_slice["tsv"].read_bytes()
    tsv.write_bytes(raw[: len(raw) // 2])
    h5 = d / "cut.h5ad"
    raw = rna_slice["h5ad"][0].read_bytes()
    h5.write_bytes(raw[: len(raw) // 2])
    for p in (tsv, h5):
        out = d / f"{p.name}.out.h5ad"
        proc = _cli(["load-rna", str(p), "--out", str(out), "--stats", str(d / "rna_stats.tsv")])
        _assert_one_line(proc, "load-rna", p, out)
    # strata: a real .scool cut in half
    src = data / "schic" / "nagano2017_20cells_1mb.scool"
    cells = [c.rsplit("/", 1)[-1] for c in scool_cells(src)]
    scool = d / "cut.scool"
    scool.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    qc = d / "qc.tsv"
    qc.write_text("cell_id\tpass\n" + "".join(f"{c}\tTrue\n" for c in cells))
    chroms = d / "mm9.sizes"
    from ampflow.io.cool import cell_bins

    bins, _ = cell_bins(src, scool_cells(src)[0])
    chroms.write_text("".join(f"{c}\t{int(g['end'].max())}\n" for c, g in bins.groupby("chrom", observed=True)))
    out = d / "hic.h5ad"
    proc = _cli(
        [
            "strata",
            "--scool",
            str(scool),
            "--qc",
            str(qc),
            "--chromsizes",
            str(chroms),
            "--strata",
            "3",
            "--out",
            str(out),
        ]
    )
    _assert_one_line(proc, "strata", scool, out)


# --- the table -----------------------------------------------------------------------


def _print_table(formats) -> None:
    print(f"{'format':<14} {'tried':>6} {'refused (one line)':>19} {'accepted (valid)':>17} {'failed':>7}")
    for f in formats:
        t = TALLIES[f]
        print(f"{f:<14} {t.tried:>6} {t.refused:>19} {t.accepted:>17} {len(t.failures):>7}")


def _assert_clean(*formats: str) -> None:
    print()
    _print_table(formats)
    failures = [f"[{f}] {x}" for f in formats for x in TALLIES[f].failures]
    assert not failures, "\n".join(failures)
    for f in formats:
        t = TALLIES[f]
        # the damage must bite: most damaged files are refused, none is both or neither
        assert t.refused + t.accepted == t.tried and t.refused >= t.tried // 3, (f, t)
