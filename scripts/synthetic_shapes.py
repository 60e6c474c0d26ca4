"""Random model shapes for the benchmarks and the tests: strata features and a guidance
graph with the structure the prepare stage writes, at any size, without any data (not
part of the package: nothing in it builds a model from no data)."""

from __future__ import annotations

import torch

try:
    from ampflow.model.paired import GraphSpec
except ImportError:  # run from a checkout without installing the package
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from ampflow.model.paired import GraphSpec


#: ``PairedData.meta`` of synthetic cells: the bin size a workflow's data records, which a
#: reach in base pairs (``model.hic_max_distance``) is counted in; 1 Mb, so the
#: template's 3 Mb reach is strata 0-3
SYNTHETIC_META = {"hic": {"resolution": 1_000_000}}


def synthetic_features(n: int, n_strata: int, keep: float, size: int, g: torch.Generator):
    """``(feature_anchor, feature_stratum)``, stratum-major: all anchors at stratum 0,
    then for each ``k >= 1`` a random subset of the anchors ``a < n - k`` (pair
    ``(a, a + k)``), sorted: a share ``keep`` of them, or exactly ``size`` if > 0."""
    anchors, strata = [torch.arange(n)], [torch.zeros(n, dtype=torch.long)]
    for k in range(1, n_strata):
        m = min(size, n - k) if size > 0 else max(1, round(keep * (n - k)))
        a = torch.randperm(n - k, generator=g)[:m].sort().values
        anchors.append(a)
        strata.append(torch.full((m,), k, dtype=torch.long))
    return torch.cat(anchors), torch.cat(strata)


def synthetic_graph(n_genes: int, n_anchors: int, g: torch.Generator) -> GraphSpec:
    """Genes then anchors as nodes; each gene linked to one anchor, ``2 n`` random
    anchor-anchor contacts; both directions and self-loops, weights in (0, 1]."""
    n_nodes = n_genes + n_anchors
    gene_src = torch.arange(n_genes)
    gene_dst = n_genes + torch.randint(n_anchors, (n_genes,), generator=g)
    bb_src = n_genes + torch.randint(n_anchors, (2 * n_anchors,), generator=g)
    bb_dst = n_genes + torch.randint(n_anchors, (2 * n_anchors,), generator=g)
    one_way_src = torch.cat([gene_src, bb_src])
    one_way_dst = torch.cat([gene_dst, bb_dst])
    loops = torch.arange(n_nodes)
    src = torch.cat([one_way_src, one_way_dst, loops])
    dst = torch.cat([one_way_dst, one_way_src, loops])
    e = src.numel()
    return GraphSpec(
        src=src,
        dst=dst,
        weight=torch.rand(e, generator=g) * 0.9 + 0.1,
        sign=torch.where(torch.rand(e, generator=g) < 0.8, 1.0, -1.0),
        n_nodes=n_nodes,
        gene_nodes=torch.arange(n_genes),
        anchor_nodes=torch.arange(n_genes, n_nodes),
    )
