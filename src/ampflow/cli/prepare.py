"""Commands of the prepare stage: demo data, binning, RNA, QC, held-out split, pseudobulk, strata, graph."""

from __future__ import annotations

import argparse
import json
import logging

from ..base.errors import InputError

log = logging.getLogger("ampflow")


def _add_naming(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("chromosome names and columns")
    g.add_argument("--strip-prefix", default="", help="prefix removed from input chromosome names, e.g. mm10_")
    g.add_argument(
        "--chr-prefix",
        default="auto",
        choices=["auto", "keep", "add", "drop"],
        help="add or drop 'chr' after stripping (auto: whichever the genome knows)",
    )
    g.add_argument("--pairs-columns", default=None, help="1-based 'chrom1,pos1,chrom2,pos2' (default: header or inferred)")
    g.add_argument("--chromosomes", default=None, help="comma-separated chromosomes to keep (default: all in --chromsizes)")


def _chroms(arg):
    return [c for c in arg.split(",") if c] if arg else None


def cmd_demo_data(a):
    from ..demo import genome_files, write_demo

    chromsizes, genes_bed = a.chromsizes, a.genes_bed
    if a.genome:
        sizes_file, bed_file = genome_files(a.genome)
        chromsizes = chromsizes or sizes_file
        genes_bed = genes_bed or bed_file
    paths = write_demo(
        a.outdir,
        n_cells=a.cells,
        seed=a.seed,
        scale=a.scale,
        n_genes=a.genes,
        chromsizes=chromsizes,
        chromosomes=_chroms(a.chromosomes),
        genes_bed=genes_bed,
        biotype=a.biotype,
        contacts=a.contacts,
        cis_fraction=a.cis_fraction,
        decay=a.decay,
        workers=a.workers,
    )
    log.info("demo data: %s", {k: str(v) for k, v in paths.items()})


def cmd_bin_pairs(a):
    from ..base.atomic import atomic_path
    from ..io.genome import ChromNamer, read_chromsizes
    from ..io.pairs import read_pairs
    from ..prepare.binning import bin_contacts, write_cool

    sizes = read_chromsizes(a.chromsizes, _chroms(a.chromosomes))
    namer = ChromNamer(tuple(sizes), a.strip_prefix, a.chr_prefix)
    contacts = read_pairs(a.pairs, namer, sizes, columns=a.pairs_columns)
    pixels = bin_contacts(contacts, sizes, a.resolution)
    with atomic_path(a.out) as tmp:
        write_cool(tmp, sizes, a.resolution, pixels, metadata={"source": str(a.pairs), **contacts.stats})
    log.info("%s: %s -> %s (%d pixels)", a.pairs, contacts.stats, a.out, len(pixels))


def _parse_options(a):
    """The binning options of ``bin-cells`` / ``bin-block``: genome, naming, resolutions."""
    from ..io.genome import read_chromsizes
    from ..prepare.cells import ParseOptions

    sizes = read_chromsizes(a.chromsizes)
    keep = _chroms(a.chromosomes)
    if keep:
        read_chromsizes(a.chromsizes, keep)  # validates the names
    if len(a.resolutions) != len(a.out_scool):
        raise InputError("give one --out-scool per --resolutions entry", key="out_scool", value=a.out_scool)
    return ParseOptions(
        chromsizes=tuple(sizes.items()),
        keep=tuple(keep) if keep else None,
        strip_prefix=a.strip_prefix,
        chr_prefix=a.chr_prefix,
        columns=a.pairs_columns,
        resolutions=tuple(sorted(set(a.resolutions))),
    )


def cmd_bin_cells(a):
    from ..base.atomic import atomic_path
    from ..io.sheet import read_sheet
    from ..prepare.cells import bin_cells, write_scool

    sheet = read_sheet(a.sheet)
    opts = _parse_options(a)
    stats = bin_cells(sheet, opts, a.cache_dir, threads=a.threads)
    for res, out in zip(a.resolutions, a.out_scool):
        write_scool(out, list(sheet["cell_id"]), a.cache_dir, opts, res)
        log.info("wrote %s (%d cells at %d bp)", out, len(sheet), res)
    with atomic_path(a.stats) as tmp:
        stats.to_csv(tmp, sep="\t")


def cmd_bin_block(a):
    from ..io.sheet import read_sheet
    from ..prepare.blocks import block_digest, block_rows
    from ..prepare.cells import bin_block

    opts = _parse_options(a)
    span = block_rows(a.block, a.block_cells)
    rows = read_sheet(a.sheet).iloc[span]
    if rows.empty:
        raise InputError(f"the sheet has no rows in block {a.block} ({a.block_cells} cells a block)", path=a.sheet)
    digest = block_digest(rows["cell_id"], rows["pairs"])
    if a.digest and digest != a.digest:
        # the sheet changed after the workflow planned this job: its cells are not the planned ones
        raise InputError(
            f"block {a.block} changed since the workflow was planned (digest {digest}, planned {a.digest}); run the workflow again",
            path=a.sheet,
        )
    log.info("block %s: sheet rows %d-%d, %d cells", a.block, span.start + 1, span.start + len(rows), len(rows))
    out = dict(zip(a.resolutions, a.out_scool))
    bin_block(rows["cell_id"], rows["pairs"], opts, out, a.stats, threads=a.threads)
    log.info("block %s: wrote %s and %s", a.block, ", ".join(a.out_scool), a.stats)


def cmd_gather_blocks(a):
    from ..prepare.blocks import gather_scool, gather_stats

    if len(a.resolutions) != len(a.out_scool):
        raise InputError("give one --out-scool per --resolutions entry", key="out_scool", value=a.out_scool)
    for label, out in zip(a.resolutions, a.out_scool):
        n = gather_scool([f"{b}/{label}.scool" for b in a.blocks], out)
        log.info("wrote %s: %d cells from %d blocks", out, n, len(a.blocks))
    table = gather_stats([f"{b}/contacts.tsv" for b in a.blocks], a.stats)
    log.info("wrote %s: %d cells", a.stats, len(table))


def cmd_load_rna(a):
    from ..base.atomic import atomic_path
    from ..io.rna import read_rna, round_counts
    from ..prepare.qc import rna_stats

    adata = read_rna(a.rna)
    adata.X, report = round_counts(adata.X, a.rounding)
    log.info(
        "%s: %d genes x %d cells; rounded %d fractional of %d nonzero counts (%s): total %.1f -> %.0f",
        a.rna,
        adata.n_vars,
        adata.n_obs,
        report["fractional_entries"],
        report["nonzero_entries"],
        report["mode"],
        report["total_before"],
        report["total_after"],
    )
    adata.uns["ampflow"] = {"rounding": report, "source": str(a.rna)}
    with atomic_path(a.out) as tmp:
        adata.write_h5ad(tmp, compression="gzip")
    with atomic_path(a.stats) as tmp:
        rna_stats(adata).to_csv(tmp, sep="\t")


def cmd_qc_cells(a):
    import pandas as pd

    from ..base.atomic import atomic_path
    from ..io.sheet import read_sheet
    from ..prepare.qc import QCThresholds, qc_table

    sheet = read_sheet(a.sheet, check_files=False)
    contacts = pd.read_csv(a.contacts, sep="\t", index_col="cell_id", dtype={"cell_id": str})
    # no --rna-stats: a Hi-C-only dataset, cells pass on their contacts alone
    rna = pd.read_csv(a.rna_stats, sep="\t", index_col="cell_id", dtype={"cell_id": str}) if a.rna_stats else None
    th = QCThresholds(a.min_contacts, a.min_cis_fraction, a.min_umis, a.min_genes)
    table = qc_table(contacts, rna, th, rna_path=a.rna_stats)
    meta = sheet.drop(columns=["cell_id", "pairs"])
    table = table.join(meta, how="left")
    with atomic_path(a.out) as tmp:
        table.to_csv(tmp, sep="\t")


def cmd_pseudobulk(a):
    from ..contract.layout import TRAIN
    from ..prepare.pseudobulk import write_mcool
    from ..prepare.qc import passing_cells, read_qc

    cells = passing_cells(read_qc(a.qc))
    if not cells:
        raise InputError("no cell passes QC; nothing to pool", path=a.qc)
    if a.split is not None:
        # the graph's contact edges come from this pool: held-out cells must not shape them
        split = _split(a.split, cells)
        cells = [c for c, s in zip(cells, split) if s == TRAIN]
        log.info("pseudobulk: %d training cells (%d held out left out)", len(cells), len(split) - len(cells))
        if not cells:
            raise InputError("no training cell to pool", path=a.split)
    scools = {}
    for spec in a.scool:
        res, _, path = spec.partition("=")
        scools[int(res)] = path
    if a.threads > 1 and not a.no_balance:
        import multiprocessing

        # forked before any HDF5 file is open (cooler's advice for reading in workers)
        with multiprocessing.get_context("fork").Pool(a.threads) as pool:
            report = write_mcool(a.out, scools, cells, balance=True, extra=a.extra_resolutions, map=pool.imap)
    else:
        report = write_mcool(a.out, scools, cells, balance=not a.no_balance, extra=a.extra_resolutions)
    log.info("pseudobulk of %d cells: %s", len(cells), json.dumps(report))


def cmd_split_cells(a):
    from ..io.split import write_split
    from ..prepare.qc import read_qc
    from ..prepare.split import split_cells

    split = split_cells(read_qc(a.qc), a.holdout, seed=a.seed, label_key=a.label_key, path=a.qc)
    write_split(a.out, split)


def _qc_obs(qc_path, cells):
    from ..contract.layout import SPLIT_COLUMN
    from ..prepare.qc import read_qc

    qc = read_qc(qc_path)
    if SPLIT_COLUMN in qc.columns:
        # the name the held-out split is written under (obs["split"])
        log.warning("%s: the cell sheet's column %r is not carried into obs (a reserved name)", qc_path, SPLIT_COLUMN)
    drop = ["pass", "reason", "in_pairs", "in_rna", "matched", SPLIT_COLUMN]
    return qc.loc[cells].drop(columns=[c for c in drop if c in qc.columns])


def _split(split_path, cells):
    """``train`` / ``heldout`` per cell from ``--split`` (None without one)."""
    from ..io.split import read_split, split_of

    return None if split_path is None else split_of(cells, read_split(split_path), path=split_path)


def cmd_strata(a):
    from ..base.atomic import atomic_path
    from ..io.genome import read_chromsizes
    from ..prepare.qc import passing_cells, read_qc
    from ..prepare.strata import write_strata

    cells = [c for c in passing_cells(read_qc(a.qc))]
    sizes = read_chromsizes(a.chromsizes, _chroms(a.chromosomes))
    split = _split(a.split, cells)
    with atomic_path(a.out) as tmp:
        write_strata(a.scool, cells, list(sizes), a.strata, tmp, a.min_cells, a.min_count, obs=_qc_obs(a.qc, cells), split=split)


def cmd_rna_data(a):
    import anndata as ad

    from ..base.atomic import atomic_path
    from ..io.annotation import read_genes
    from ..io.genome import ChromNamer, read_chromsizes
    from ..prepare.qc import passing_cells, read_qc
    from ..prepare.rna import all_genes_rna, build_rna

    if a.all_genes:
        cells = passing_cells(read_qc(a.qc))
        adata = all_genes_rna(ad.read_h5ad(a.counts), cells, obs=_qc_obs(a.qc, cells))
        with atomic_path(a.out) as tmp:
            adata.write_h5ad(tmp, compression="gzip")
        return
    for opt in ("genes", "chromsizes"):
        if getattr(a, opt) is None:
            raise InputError("required unless --all-genes (the genes are placed on the genome)", key=f"--{opt}")
    sizes = read_chromsizes(a.chromsizes, _chroms(a.chromosomes))
    genes = read_genes(a.genes, ChromNamer(tuple(sizes), a.strip_prefix, a.chr_prefix), sizes)
    if genes.attrs.get("dropped"):
        log.info("%s: %d genes off the analysed chromosomes dropped", a.genes, genes.attrs["dropped"])
    cells = passing_cells(read_qc(a.qc))
    counts = ad.read_h5ad(a.counts)
    adata = build_rna(counts, cells, genes, a.n_top_genes, obs=_qc_obs(a.qc, cells), split=_split(a.split, cells))
    with atomic_path(a.out) as tmp:
        adata.write_h5ad(tmp, compression="gzip")


def cmd_graph(a):
    import anndata as ad

    from ..io.genome import read_chromsizes
    from ..prepare.graph import build_graph, write_graph

    sizes = read_chromsizes(a.chromsizes, _chroms(a.chromosomes))
    # no --rna: a Hi-C-only dataset, whose graph has anchors and their contact edges only
    rna_var = ad.read_h5ad(a.rna, backed="r").var if a.rna else None
    hic = ad.read_h5ad(a.hic, backed="r")
    res = int(hic.uns["ampflow"]["resolution"])
    nodes, edges = build_graph(rna_var, hic.var, a.mcool, res, sizes, a.promoter_upstream, a.contact_quantile)
    meta = {
        "resolution": res,
        "n_nodes": int(len(nodes)),
        "n_genes": int((nodes["kind"] == "gene").sum()),
        "n_anchors": int((nodes["kind"] == "anchor").sum()),
        "n_edges": int(len(edges)),
        "edges_by_kind": {str(k): int(v) for k, v in edges["kind"].value_counts().sort_index().items()},
        "promoter_upstream": a.promoter_upstream,
        "contact_quantile": a.contact_quantile,
    }
    write_graph(a.out, nodes, edges, meta)


def add_commands(sub) -> None:
    """Add this group's subcommands to the ``ampflow`` parser."""
    s = sub.add_parser(
        "demo-data",
        help="write a synthetic HiRES-like dataset",
        description="Without options: the small demo (4 mouse chromosomes at 1/4 size, 3,000 simulated genes). "
        "With --genome mm10 (or --chromsizes/--genes-bed): full-size chromosomes and real genes, e.g. "
        "--genome mm10 --cells 1000 --contacts 150000 --genes 25000 --biotype all.",
    )
    s.add_argument("outdir")
    s.add_argument("--cells", type=int, default=120)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--scale", type=float, default=None, help="chromosome length scale (default: 0.25 of 4 mm10 chromosomes; 1 with --chromsizes)")
    s.add_argument("--genes", type=int, default=None, help="genes (default: 3000 simulated; with --genes-bed all of --biotype)")
    s.add_argument("--contacts", type=int, default=None, help="median contacts per cell (default: 30000)")
    g = s.add_argument_group("real genome")
    g.add_argument("--genome", default=None, help="shortcut for both files under ../shared/data/annotation: mm10")
    g.add_argument("--chromsizes", default=None, help="chromosome sizes file (full-size chromosomes)")
    g.add_argument("--chromosomes", default=None, help="comma-separated chromosomes (default: numbered ones and X)")
    g.add_argument("--genes-bed", default=None, help="real genes: BED with name in column 4 (needs --chromsizes)")
    g.add_argument("--biotype", default="protein_coding", help="genes of this biotype from --genes-bed, or 'all' (default: protein_coding)")
    g.add_argument("--cis-fraction", type=float, default=None, help="per-cell cis share, +-0.03 (default with a real genome: 0.9)")
    g.add_argument("--decay", type=float, default=None, help="P(s) exponent, +-0.1 per cell (default with a real genome: 1.1)")
    s.add_argument("--workers", type=int, default=None, help="processes writing pairs files (default: usable cores, at most 8)")
    s.set_defaults(func=cmd_demo_data)

    s = sub.add_parser("bin-pairs", help="bin one pairs file into a single-cell cooler")
    s.add_argument("pairs")
    s.add_argument("--chromsizes", required=True)
    s.add_argument("--resolution", type=int, required=True)
    s.add_argument("--out", required=True)
    _add_naming(s)
    s.set_defaults(func=cmd_bin_pairs)

    s = sub.add_parser("bin-cells", help="bin every cell of a sheet into .scool files (cached per cell)")
    s.add_argument("--sheet", required=True)
    s.add_argument("--chromsizes", required=True)
    s.add_argument("--resolutions", type=int, nargs="+", required=True)
    s.add_argument("--out-scool", nargs="+", required=True, help="one per resolution, same order")
    s.add_argument("--stats", required=True, help="per-cell contact stats TSV")
    s.add_argument("--cache-dir", required=True)
    s.add_argument("--threads", type=int, default=1)
    _add_naming(s)
    s.set_defaults(func=cmd_bin_cells)

    s = sub.add_parser("bin-block", help="bin one block of a sheet's cells into .scool files (one per resolution)")
    s.add_argument("--sheet", required=True)
    s.add_argument("--block", required=True, help="block name (0000, 0001, ...): sheet rows block*N+1 .. (block+1)*N")
    s.add_argument("--block-cells", type=int, required=True, help="N, cells a block")
    s.add_argument("--digest", default=None, help="the block's planned digest: refuse a sheet changed since")
    s.add_argument("--chromsizes", required=True)
    s.add_argument("--resolutions", type=int, nargs="+", required=True)
    s.add_argument("--out-scool", nargs="+", required=True, help="one per resolution, same order")
    s.add_argument("--stats", required=True, help="per-cell contact stats TSV")
    s.add_argument("--threads", type=int, default=1)
    _add_naming(s)
    s.set_defaults(func=cmd_bin_block)

    s = sub.add_parser("gather-blocks", help="gather block .scool files and contact tables into the dataset's")
    s.add_argument("--blocks", nargs="+", required=True, help="block folders, each with LABEL.scool and contacts.tsv")
    s.add_argument("--resolutions", nargs="+", required=True, help="resolution labels (file names in a block folder)")
    s.add_argument("--out-scool", nargs="+", required=True, help="one per label, same order")
    s.add_argument("--stats", required=True)
    s.set_defaults(func=cmd_gather_blocks)

    s = sub.add_parser("load-rna", help="read, validate and round an RNA count matrix")
    s.add_argument("rna")
    s.add_argument("--out", required=True)
    s.add_argument("--stats", required=True)
    s.add_argument("--rounding", default="half_up", choices=["half_up", "half_even", "floor", "ceil"])
    s.set_defaults(func=cmd_load_rna)

    s = sub.add_parser("qc-cells", help="per-cell QC table")
    s.add_argument("--sheet", required=True)
    s.add_argument("--contacts", required=True)
    s.add_argument("--rna-stats", default=None, help="qc/rna.tsv; leave out for a Hi-C-only dataset (no RNA thresholds)")
    s.add_argument("--min-contacts", type=int, default=1000)
    s.add_argument("--min-cis-fraction", type=float, default=0.5)
    s.add_argument("--min-umis", type=int, default=500)
    s.add_argument("--min-genes", type=int, default=200)
    s.add_argument("--out", required=True)
    s.set_defaults(func=cmd_qc_cells)

    s = sub.add_parser("split-cells", help="hold out a share of the passing cells from fitting (qc/split.tsv)")
    s.add_argument("--qc", required=True, help="qc/cells.tsv")
    s.add_argument("--holdout", type=float, default=0.2, help="expected share of the passing cells held out, in [0, 1); 0: none")
    s.add_argument("--label-key", default=None, help="QC-table column whose labels each keep a training cell (must exist); default: none")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", required=True, help="TSV: cell_id, split (train or heldout)")
    s.set_defaults(func=cmd_split_cells)

    s = sub.add_parser("pseudobulk", help="pool passing (with --split: training) cells into a multi-resolution .mcool")
    s.add_argument("--scool", nargs="+", required=True, help="RES=PATH entries")
    s.add_argument("--qc", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--no-balance", action="store_true")
    s.add_argument("--split", default=None, help="qc/split.tsv: pool its training cells only")
    s.add_argument("--extra-resolutions", type=int, nargs="*", default=[], help="coarser zoom levels (multiples of the finest)")
    s.add_argument("--threads", type=int, default=1, help="processes balancing pixel chunks in parallel")
    s.set_defaults(func=cmd_pseudobulk)

    s = sub.add_parser("strata", help="build the strata file (hic.h5ad)")
    s.add_argument("--scool", required=True)
    s.add_argument("--qc", required=True)
    s.add_argument("--chromsizes", required=True)
    s.add_argument("--chromosomes", default=None)
    s.add_argument("--strata", type=int, required=True)
    s.add_argument("--min-cells", type=int, default=1)
    s.add_argument("--min-count", type=int, default=1)
    s.add_argument("--split", default=None, help="qc/split.tsv: the feature filter counts its training cells only")
    s.add_argument("--out", required=True)
    s.set_defaults(func=cmd_strata)

    s = sub.add_parser("rna-data", help="build the RNA model file (rna.h5ad)")
    s.add_argument("--counts", required=True)
    s.add_argument("--qc", required=True)
    s.add_argument("--genes", default=None, help="gene annotation (required unless --all-genes)")
    s.add_argument("--chromsizes", default=None, help="chromosome sizes (required unless --all-genes)")
    s.add_argument("--n-top-genes", type=int, default=2000)
    s.add_argument("--split", default=None, help="qc/split.tsv: genes are chosen from its training cells only")
    s.add_argument(
        "--all-genes", action="store_true",
        help="keep every gene, choose nothing (no HVGs, no annotation): cells to embed with a trained model, which picks its genes by name",
    )  # fmt: skip
    s.add_argument("--out", required=True)
    _add_naming(s)
    s.set_defaults(func=cmd_rna_data)

    s = sub.add_parser("graph", help="build the guidance graph (nodes + edges tables)")
    s.add_argument("--rna", default=None, help="rna.h5ad; leave out for a Hi-C-only graph (anchors and contact edges)")
    s.add_argument("--hic", required=True)
    s.add_argument("--mcool", required=True)
    s.add_argument("--chromsizes", required=True)
    s.add_argument("--chromosomes", default=None)
    s.add_argument("--promoter-upstream", type=int, default=2000)
    s.add_argument("--contact-quantile", type=float, default=0.9)
    s.add_argument("--out", required=True)
    s.set_defaults(func=cmd_graph)
