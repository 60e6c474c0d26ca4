"""Guidance graph: genes + anchors as nodes; promoter, contact and self-loop edges.

Without RNA (a Hi-C-only dataset) the nodes are the anchors alone and the edges their
pseudobulk contact edges and self-loops: the graph then ties each anchor's latent to
those of the bins it contacts most, which is what the Hi-C decoder reads its keys from.

Stored as two columnar tables (``nodes.parquet``, ``edges.parquet``) in one folder.
Every edge has a weight in (0, 1] and a sign of +1 or -1, and appears in both
directions.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pandas as pd

from ..base.atomic import atomic_path
from ..base.errors import InputError
from ..contract.layout import GRAPH_NAMES
from ..io.annotation import promoters

log = logging.getLogger(__name__)


def build_nodes(rna_var: pd.DataFrame | None, hic_var: pd.DataFrame) -> pd.DataFrame:
    """Genes first (in rna.h5ad order), then anchors (stratum-0 features, anchor order);
    ``rna_var`` None: anchors only."""
    anchors = hic_var[hic_var["stratum"] == 0].sort_values("anchor")
    if rna_var is None:
        rna_var = pd.DataFrame({"chrom": [], "start": [], "end": [], "strand": []}, index=pd.Index([], dtype=str))
    genes = pd.DataFrame(
        {
            "name": rna_var.index.astype(str),
            "kind": "gene",
            "chrom": rna_var["chrom"].astype(str).to_numpy(),
            "start": rna_var["start"].to_numpy(np.int64),
            "end": rna_var["end"].to_numpy(np.int64),
            "strand": rna_var["strand"].astype(str).to_numpy(),
        }
    )
    bins = pd.DataFrame(
        {
            "name": anchors.index.astype(str),
            "kind": "anchor",
            "chrom": anchors["chrom"].astype(str).to_numpy(),
            "start": anchors["start"].to_numpy(np.int64),
            "end": anchors["end"].to_numpy(np.int64),
            "strand": ".",
        }
    )
    nodes = pd.concat([genes, bins], ignore_index=True)
    nodes.index.name = "node_id"
    return nodes


def gene_bin_edges(nodes: pd.DataFrame, resolution: int, upstream: int, chromsizes: dict[str, int]) -> np.ndarray:
    """(gene, anchor) pairs where the gene's promoter overlaps the anchor bin."""
    genes = nodes[nodes["kind"] == "gene"]
    anchors = nodes[nodes["kind"] == "anchor"]
    anchor_at = {(c, s // resolution): i for i, c, s in zip(anchors.index, anchors["chrom"], anchors["start"])}
    prom = promoters(genes, upstream, chromsizes)
    pairs = []
    for gi, c, lo, hi in zip(genes.index, prom["chrom"], prom["start"], prom["end"]):
        for b in range(int(lo) // resolution, (int(hi) - 1) // resolution + 1):
            ai = anchor_at.get((c, b))
            if ai is not None:
                pairs.append((gi, ai))
    return np.array(pairs, dtype=np.int64).reshape(-1, 2)


def _cis_chunks(clr, anchor_of_bin: np.ndarray, weight: np.ndarray | None, chunksize: int):
    """Cis off-diagonal pixels between two anchors, one chromosome and at most
    ``chunksize`` records at a time: (anchor1, anchor2, value) arrays in pixel order.

    A chromosome's cis pixels are the rows of its bins (a range of the pixel table, by
    the bin1 index) whose bin2 stays within the chromosome; trans pixels are never kept.
    """
    chrom_offset = clr._load_dset("indexes/chrom_offset")
    bin1_offset = clr._load_dset("indexes/bin1_offset")
    with clr.open("r") as grp:
        px = grp["pixels"]
        for lo, hi in zip(chrom_offset[:-1], chrom_offset[1:]):
            for plo in range(int(bin1_offset[lo]), int(bin1_offset[hi]), chunksize):
                phi = min(plo + chunksize, int(bin1_offset[hi]))
                b1 = px["bin1_id"][plo:phi].astype(np.int64)
                b2 = px["bin2_id"][plo:phi].astype(np.int64)
                value = px["count"][plo:phi].astype(np.float64)
                if weight is not None:
                    value = value * weight[b1] * weight[b2]
                a1, a2 = anchor_of_bin[b1], anchor_of_bin[b2]
                keep = (b1 != b2) & (b2 < hi) & np.isfinite(value) & (value > 0) & (a1 >= 0) & (a2 >= 0)
                yield a1[keep], a2[keep], value[keep]


def contact_edges(mcool: str, resolution: int, nodes: pd.DataFrame, quantile: float, chunksize: int = 2_000_000) -> tuple[np.ndarray, np.ndarray]:
    """Cis anchor pairs whose pseudobulk contact value is at or above ``quantile``.

    Uses balanced values where the pseudobulk was balanced, raw counts otherwise.
    Weights are value / max, so in (0, 1].

    Reads only cis pixels, chromosome by chromosome, ``chunksize`` records at a time, in
    two passes: the first keeps the cis values alone (float64) for the exact quantile,
    the second the pairs at or above it. Memory follows the cis pixels (8 bytes each)
    and the edges kept, not the whole pixel table.

    Returns
    -------
    pairs : (n_edges, 2) int64 node ids; weights : (n_edges,) float64
    """
    import cooler

    clr = cooler.Cooler(f"{mcool}::resolutions/{resolution}")
    bins = clr.bins()[["chrom", "start"]][:]
    weight = None
    if "weight" in clr.bins().columns:
        w = clr.bins()["weight"][:].to_numpy()
        weight = w if pd.notna(w).any() else None
    anchors = nodes[nodes["kind"] == "anchor"]
    key = pd.Series(anchors.index.to_numpy(), index=pd.MultiIndex.from_arrays([anchors["chrom"], anchors["start"]]))
    # node id of each bin's anchor, -1 where the bin is no anchor (e.g. a chromosome left out)
    found = key.reindex(pd.MultiIndex.from_arrays([bins["chrom"].astype(str).to_numpy(), bins["start"].to_numpy()]))
    anchor_of_bin = found.fillna(-1).to_numpy().astype(np.int64)
    values = [v for _, _, v in _cis_chunks(clr, anchor_of_bin, weight, chunksize)]
    values = np.concatenate(values) if values else np.empty(0)
    if len(values) == 0:
        return np.empty((0, 2), dtype=np.int64), np.empty(0)
    cut = np.quantile(values, quantile)
    del values
    kept = []
    for a1, a2, v in _cis_chunks(clr, anchor_of_bin, weight, chunksize):
        top = v >= cut
        kept.append((a1[top], a2[top], v[top]))
    n1, n2, top = (np.concatenate(x) for x in zip(*kept))
    log.info("graph: %d cis anchor pairs at or above the %g quantile (%.4g)", len(top), quantile, cut)
    return np.stack([n1, n2], axis=1), top / top.max()


def build_graph(rna_var, hic_var, mcool, resolution, chromsizes, upstream=2000, quantile=0.9) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Nodes and edges tables (edges: source, target, weight, sign, kind).

    ``rna_var`` None builds the Hi-C-only graph: anchor nodes, bin-bin and self edges.
    An anchor-only graph without a single contact edge would give the graph loss
    nothing but self-loops to learn from; that is logged as a warning.
    """
    if not 0 <= quantile < 1:
        raise InputError("must be within [0, 1)", key="graph.contact_quantile", value=quantile)
    nodes = build_nodes(rna_var, hic_var)
    gb = gene_bin_edges(nodes, resolution, upstream, chromsizes) if rna_var is not None else np.empty((0, 2), dtype=np.int64)
    bb, bw = contact_edges(mcool, resolution, nodes, quantile)
    n = len(nodes)
    if rna_var is None and len(bb) == 0:
        log.warning("graph: Hi-C only and no contact edge above quantile %g: the anchors are linked by self-loops alone", quantile)
    parts = [
        (gb, np.ones(len(gb)), "gene_bin"),
        (gb[:, ::-1], np.ones(len(gb)), "gene_bin"),
        (bb, bw, "bin_bin"),
        (bb[:, ::-1], bw, "bin_bin"),
        (np.stack([np.arange(n), np.arange(n)], axis=1), np.ones(n), "self"),
    ]
    edges = pd.concat(
        [pd.DataFrame({"source": e[:, 0], "target": e[:, 1], "weight": w.astype(np.float32), "sign": np.int8(1), "kind": kind}) for e, w, kind in parts],
        ignore_index=True,
    )
    edges["kind"] = edges["kind"].astype("category")
    log.info(
        "graph: %d nodes (%d genes, %d anchors); edges: %d gene-bin, %d bin-bin, %d self (both directions)",
        n,
        int((nodes["kind"] == "gene").sum()),
        int((nodes["kind"] == "anchor").sum()),
        2 * len(gb),
        2 * len(bb),
        n,
    )
    return nodes, edges


def write_graph(path, nodes: pd.DataFrame, edges: pd.DataFrame, meta: dict) -> None:
    """Write the graph folder atomically (nodes.parquet, edges.parquet, graph.json)."""
    with atomic_path(path) as tmp:
        tmp.mkdir()
        nodes.reset_index().to_parquet(tmp / GRAPH_NAMES["nodes"], index=False)
        edges.to_parquet(tmp / GRAPH_NAMES["edges"], index=False)
        (tmp / GRAPH_NAMES["meta"]).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
