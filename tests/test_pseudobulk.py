"""The pseudobulk .mcool (merged, coarsened, balanced out of core) and the graph's contact
edges read from it chromosome by chromosome.

Referees, each independent of the code under test: the cells' pixels read straight from
the .scool with h5py and summed densely in numpy; the cells binned directly at a coarser
resolution by ``bin-cells`` (for coarsened levels); ``cooler.balance_cooler`` in memory on
the same cooler (for the weights); the whole-table implementation of the contact edges
kept below as it was before (for the chromosome-by-chromosome one).
"""

from __future__ import annotations

import logging
import multiprocessing
from pathlib import Path

import cooler
import h5py
import numpy as np
import pandas as pd
import pytest

from ampflow.cli import main
from ampflow.demo import write_demo
from ampflow.prepare.graph import contact_edges
from ampflow.prepare.pseudobulk import _PassMap, plan_levels, write_mcool
from ampflow.prepare.qc import passing_cells, read_qc

# 250 kb is no multiple of 100 kb: merged from its own .scool; 500 kb is coarsened from it, the extra 1 Mb from 500 kb
BINNED = (100_000, 250_000, 500_000, 1_000_000)
GIVEN = (100_000, 250_000, 500_000)
EXTRA = (1_000_000,)
SMALL = 20_000  # pixel records at a time: several merge epochs, coarsening and balancing chunks


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pseudobulk")
    paths = write_demo(root / "demo", n_cells=30, seed=1, n_genes=100)
    scools = {r: root / f"{r}.scool" for r in BINNED}
    steps = [
        ["bin-cells", "--sheet", paths["sheet"], "--chromsizes", paths["chromsizes"], "--resolutions", *BINNED,
         "--out-scool", *scools.values(), "--stats", root / "contacts.tsv", "--cache-dir", root / "cache"],
        ["qc-cells", "--sheet", paths["sheet"], "--contacts", root / "contacts.tsv", "--min-contacts", 100, "--out", root / "cells.tsv"],
    ]  # fmt: skip
    for step in steps:
        assert main([str(x) for x in step]) == 0, step[0]
    cells = passing_cells(read_qc(root / "cells.tsv"))[::2]  # a pool that is not every cell
    mcool = root / "pb.mcool"
    report = write_mcool(mcool, {r: str(scools[r]) for r in GIVEN}, cells, extra=EXTRA, block=4, chunksize=SMALL)
    return {"root": root, "scools": scools, "cells": cells, "mcool": str(mcool), "report": report}


def dense_sum(scool, cells) -> np.ndarray:
    """Σ over ``cells`` of their upper-triangle pixels, read with h5py, as a dense matrix."""
    with h5py.File(scool, "r") as f:
        n = len(f["bins/start"])
        total = np.zeros((n, n), dtype=np.int64)
        for cell in cells:
            px = f[f"cells/{cell}/pixels"]
            np.add.at(total, (px["bin1_id"][:], px["bin2_id"][:]), px["count"][:].astype(np.int64))
    return total


def dense_level(mcool, res) -> np.ndarray:
    clr = cooler.Cooler(f"{mcool}::resolutions/{res}")
    px = clr.pixels()[:]
    assert px["count"].dtype == np.int64
    assert (px["bin1_id"] <= px["bin2_id"]).all() and not px.duplicated(["bin1_id", "bin2_id"]).any()
    out = np.zeros((clr.info["nbins"],) * 2, dtype=np.int64)
    out[px["bin1_id"].to_numpy(), px["bin2_id"].to_numpy()] = px["count"].to_numpy()
    return out


def test_levels_are_a_valid_mcool(data):
    mcool = data["mcool"]
    assert cooler.fileops.list_coolers(mcool) == [f"/resolutions/{r}" for r in sorted(BINNED)]
    with h5py.File(mcool, "r") as f:
        assert f.attrs["format"] == "HDF5::MCOOL"
    for r in BINNED:
        clr = cooler.Cooler(f"{mcool}::resolutions/{r}")
        assert clr.binsize == r
        bins = clr.bins()[:]
        ref = cooler.Cooler(f"{data['scools'][r]}::/cells/{data['cells'][0]}").bins()[:]
        assert bins[["chrom", "start", "end"]].equals(ref[["chrom", "start", "end"]])
    assert not any(Path(data["mcool"]).parent.glob(".tmp-*")), "no temporary left behind"


@pytest.mark.parametrize("res", BINNED)
def test_each_level_equals_the_cells_binned_at_its_resolution(data, res):
    """Merged (100 kb), fallback (250 kb) and coarsened (500 kb from 250 kb; 1 Mb from 500 kb)
    levels all equal the pool's cells binned directly at that resolution."""
    want = dense_sum(data["scools"][res], data["cells"])
    got = dense_level(data["mcool"], res)
    np.testing.assert_array_equal(got, want)
    entry = data["report"][res]
    assert entry["contacts"] == want.sum() and entry["pixels"] == np.count_nonzero(want)


def test_level_plan():
    # from the coarsest finer level each is a multiple of (as cooler's zoomify chooses)
    assert plan_levels({100: "a", 250: "b", 500: "c"}, extra=(1000, 2000, 300)) == {100: None, 250: None, 300: 100, 500: 250, 1000: 500, 2000: 1000}
    with pytest.raises(ValueError, match="multiples of the finest"):
        plan_levels({100: "a"}, extra=(250,))


@pytest.mark.parametrize("res", BINNED)
def test_weights_equal_in_memory_balancing(data, res):
    clr = cooler.Cooler(f"{data['mcool']}::resolutions/{res}")
    want, stats = cooler.balance_cooler(clr, chunksize=None, cis_only=False, store=False)
    got = clr.bins()["weight"][:].to_numpy()
    assert np.isfinite(want).sum() > 0.5 * len(want), "a balancing that drops most bins would prove little"
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-12, equal_nan=True)
    assert data["report"][res]["balanced"] == bool(stats["converged"])


def test_process_pool_map_gives_the_same_mcool(data, tmp_path):
    """Balancing through a pool's map (the CLI's --threads) writes the same weights and
    pixels; one merge (no blocks) the same pixels as blocks of 4."""
    out = tmp_path / "pool.mcool"
    scools = {r: str(data["scools"][r]) for r in GIVEN}
    with multiprocessing.get_context("fork").Pool(2) as pool:
        write_mcool(out, scools, data["cells"], extra=EXTRA, map=pool.imap, block=1000, chunksize=SMALL)
    for r in BINNED:
        a = cooler.Cooler(f"{data['mcool']}::resolutions/{r}")
        b = cooler.Cooler(f"{out}::resolutions/{r}")
        assert a.pixels()[:].equals(b.pixels()[:])
        np.testing.assert_array_equal(a.bins()["weight"][:].to_numpy(), b.bins()["weight"][:].to_numpy())


def test_progress_lines_cover_every_step(data, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="ampflow"):
        write_mcool(tmp_path / "p.mcool", {r: str(data["scools"][r]) for r in GIVEN}, data["cells"], extra=EXTRA, block=4, chunksize=SMALL)
    text = caplog.text
    assert "100000 bp: merged 4/" in text and "100000 bp: block 1/" in text
    assert "1000000 bp: coarsened from 500000 bp" in text and "250000 bp: merged" in text
    for r in BINNED:
        assert f"{r} bp: balanced=" in text


def test_balance_map_logs_passes_and_chunks(caplog):
    now = [0.0]
    pm = _PassMap(map, "x: balancing", n_chunks=3, max_passes=10, every=5.0, clock=lambda: now[0])

    def slow(v):
        now[0] += 2.0
        return v

    with caplog.at_level(logging.INFO, logger="ampflow"):
        for _ in range(2):
            assert list(pm(slow, [1, 2, 3])) == [1, 2, 3]
    lines = [r.getMessage() for r in caplog.records]
    assert pm.passes == 2
    # 12 s of work, a line at most every 5 s: at 6 s (pass 1, chunk 3) and 12 s (pass 2, chunk 3)
    assert lines == ["x: balancing: pass 1 (at most 10), chunk 3/3, 0.17 passes/s", "x: balancing: pass 2 (at most 10), chunk 3/3, 0.17 passes/s"]


# ------------------------------------------------------------------ contact edges
def whole_table_contact_edges(mcool, resolution, nodes, quantile):
    """The implementation before the chromosome-by-chromosome one (whole pixel table)."""
    clr = cooler.Cooler(f"{mcool}::resolutions/{resolution}")
    bins = clr.bins()[:]
    use_balance = "weight" in bins.columns and bins["weight"].notna().any()
    px = clr.pixels()[:]
    value = px["count"].to_numpy(np.float64)
    if use_balance:
        w = bins["weight"].to_numpy()
        value = value * w[px["bin1_id"].to_numpy()] * w[px["bin2_id"].to_numpy()]
    chrom = bins["chrom"].astype(str).to_numpy()
    b1, b2 = px["bin1_id"].to_numpy(), px["bin2_id"].to_numpy()
    sel = (b1 != b2) & (chrom[b1] == chrom[b2]) & np.isfinite(value) & (value > 0)
    b1, b2, value = b1[sel], b2[sel], value[sel]
    anchors = nodes[nodes["kind"] == "anchor"]
    key = pd.Series(anchors.index.to_numpy(), index=pd.MultiIndex.from_arrays([anchors["chrom"], anchors["start"]]))
    starts = bins["start"].to_numpy()
    n1 = key.reindex(pd.MultiIndex.from_arrays([chrom[b1], starts[b1]])).to_numpy()
    n2 = key.reindex(pd.MultiIndex.from_arrays([chrom[b2], starts[b2]])).to_numpy()
    ok = ~(pd.isna(n1) | pd.isna(n2))
    n1, n2, value = n1[ok].astype(np.int64), n2[ok].astype(np.int64), value[ok]
    if len(value) == 0:
        return np.empty((0, 2), dtype=np.int64), np.empty(0)
    cut = np.quantile(value, quantile)
    top = value >= cut
    return np.stack([n1[top], n2[top]], axis=1), value[top] / value[top].max()


def graph_nodes(mcool, res, drop_chrom=None) -> pd.DataFrame:
    """Three genes, then every bin as an anchor except those of ``drop_chrom``."""
    bins = cooler.Cooler(f"{mcool}::resolutions/{res}").bins()[["chrom", "start", "end"]][:]
    bins = bins[bins["chrom"].astype(str) != drop_chrom]
    genes = pd.DataFrame({"name": ["g1", "g2", "g3"], "kind": "gene", "chrom": "chr1", "start": [0, 10, 20], "end": [5, 15, 25], "strand": "+"})
    anchors = pd.DataFrame({"name": [f"{c}:{s}" for c, s in zip(bins["chrom"], bins["start"])], "kind": "anchor",
                            "chrom": bins["chrom"].astype(str).to_numpy(), "start": bins["start"].to_numpy(),
                            "end": bins["end"].to_numpy(), "strand": "."})  # fmt: skip
    nodes = pd.concat([genes, anchors], ignore_index=True)
    nodes.index.name = "node_id"
    return nodes


@pytest.mark.parametrize("res", [100_000, 500_000])
@pytest.mark.parametrize("quantile", [0.0, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("drop_chrom", [None, "chr2"])
def test_contact_edges_equal_the_whole_table(data, res, quantile, drop_chrom):
    mcool = data["mcool"]
    nodes = graph_nodes(mcool, res, drop_chrom)
    want_pairs, want_w = whole_table_contact_edges(mcool, res, nodes, quantile)
    got_pairs, got_w = contact_edges(mcool, res, nodes, quantile, chunksize=997)
    assert len(want_pairs) > 10
    np.testing.assert_array_equal(got_pairs, want_pairs)
    np.testing.assert_array_equal(got_w, want_w)


def test_contact_edges_on_raw_counts(data, tmp_path):
    """Without weights (an unbalanced pseudobulk) the raw counts rank the pairs."""
    out = tmp_path / "raw.mcool"
    write_mcool(out, {100_000: str(data["scools"][100_000])}, data["cells"], balance=False, chunksize=SMALL)
    assert "weight" not in cooler.Cooler(f"{out}::resolutions/100000").bins().columns
    nodes = graph_nodes(str(out), 100_000)
    want = whole_table_contact_edges(str(out), 100_000, nodes, 0.9)
    got = contact_edges(str(out), 100_000, nodes, 0.9, chunksize=997)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
