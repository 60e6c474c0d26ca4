"""Load a configuration's model-ready files (rna.h5ad, hic.h5ad, graph/) for training."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch

from ..base.errors import InputError
from ..contract.config import batch_names
from ..contract.layout import SPLIT_COLUMN, SPLIT_VALUES, DataFolder, training_rows
from ..io.h5ad import read_h5ad
from ..io.split import read_split, split_of
from ..io.tables import read_parquet_table
from ..model.paired import GraphSpec
from .thinning import thin_rows

log = logging.getLogger(__name__)
EDGE_COLUMNS = {"source": "int", "target": "int", "weight": "number", "sign": "number"}


@dataclass
class PairedData:
    """Counts of the same cells in both modalities, plus what the model needs to be built.

    A Hi-C-only folder (no ``rna.h5ad``) gives ``rna`` of shape ``(n_cells, 0)`` and no
    genes: the model built from it has no RNA branch (:attr:`has_rna`).
    """

    obs: pd.DataFrame
    rna: sp.csr_matrix  # (n_cells, G) counts; G = 0 without RNA
    hic: sp.csr_matrix  # (n_cells, F) counts
    feature_anchor: torch.Tensor
    feature_stratum: torch.Tensor
    n_strata: int
    graph: GraphSpec
    meta: dict
    genes: list[str] = field(default_factory=list)  # (G,) rna.h5ad var names, in column order
    features: list[str] = field(default_factory=list)  # (F,) hic.h5ad var names, in column order
    #: the batches the model is conditioned on (sorted names; empty: none) and each
    #: cell's index among them (:meth:`use_batches`)
    batch_names: list[str] = field(default_factory=list)
    batch_codes: np.ndarray | None = None

    @property
    def n_cells(self) -> int:
        return self.hic.shape[0]

    @property
    def has_rna(self) -> bool:
        return self.rna.shape[1] > 0

    @property
    def train_rows(self) -> np.ndarray:
        """Rows of the cells training fits on: all but those ``obs["split"]`` holds out."""
        return training_rows(self.obs)

    @property
    def n_batches(self) -> int:
        return len(self.batch_names)

    def use_batches(self, key: str | None, path=None) -> None:
        """Condition on the batches of ``obs[key]``: two or more distinct values give
        :attr:`batch_names` and :attr:`batch_codes`; no such column, one batch, or
        ``key`` None: none. A cell without a batch is an error naming it."""
        self.batch_names, self.batch_codes = [], None
        if key is None or key not in self.obs.columns:
            return
        values = self.obs[key]
        missing = values.isna().to_numpy() | (values.astype(str).str.strip() == "").to_numpy()
        if missing.any():
            i = int(np.flatnonzero(missing)[0])
            raise InputError(f"cell {self.obs.index[i]!r} has no batch ({int(missing.sum())} cells lack one)", path=path, key=key, value=values.iloc[i])
        names = batch_names(values)
        if not names:
            return
        self.batch_names = names
        self.batch_codes = np.searchsorted(np.array(names), values.astype(str).to_numpy()).astype(np.int64)
        log.info("conditioning the decoders on %d batches of %r: %s", len(names), key,
                 ", ".join(f"{n} ({int((self.batch_codes == i).sum())} cells)" for i, n in enumerate(names)))  # fmt: skip

    def conditions(self, idx: np.ndarray, dtype=torch.float32) -> torch.Tensor | None:
        """One-hot batch indicators (B, n_batches) of rows ``idx``; None without batches."""
        if not self.batch_names:
            return None
        codes = torch.as_tensor(self.batch_codes[np.asarray(idx)], dtype=torch.long)
        # by scatter: one_hot() reads its values back to check them (a host sync on a GPU)
        return torch.zeros(len(codes), len(self.batch_names), dtype=dtype).scatter_(1, codes.unsqueeze(1), 1.0)

    def stratum_totals(self, idx: np.ndarray) -> torch.Tensor:
        """Contacts per stratum (len(idx), L) of rows ``idx``, summed in float64."""
        stratum = self.feature_stratum.numpy()
        onehot = sp.csr_matrix((np.ones(len(stratum)), (np.arange(len(stratum)), stratum)), shape=(len(stratum), self.n_strata))
        return torch.as_tensor((self.hic[np.asarray(idx)].astype(np.float64) @ onehot).toarray())

    def batch(self, idx: np.ndarray, dtype=torch.float32, thinning: tuple[float, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense (B, G) and (B, F) count tensors for rows ``idx``; with ``thinning``
        (keep_min, seed, step) the Hi-C rows thinned by :func:`~.thinning.thin_rows`."""
        return torch.as_tensor(self.rna[idx].toarray(), dtype=dtype), self.hic_batch(idx, dtype, thinning)

    def hic_batch(self, idx: np.ndarray, dtype=torch.float32, thinning: tuple[float, int, int] | None = None) -> torch.Tensor:
        """The dense (B, F) Hi-C counts of :meth:`batch` alone."""
        hic = self.hic[idx]
        if thinning is not None:
            hic = thin_rows(hic, np.asarray(idx), *thinning)
        return torch.as_tensor(hic.toarray(), dtype=dtype)


def counts_matrix(adata: ad.AnnData) -> sp.csr_matrix:
    """The counts of a data-folder file as float32 CSR (n_cells, n_vars): the layer that
    ``uns["ampflow"]["counts_layer"]`` names (default ``counts``), else ``X``."""
    layer = adata.uns.get("ampflow", {}).get("counts_layer", "counts")
    X = adata.layers[layer] if layer in adata.layers else adata.X
    return sp.csr_matrix(X, dtype=np.float32)


def apply_split(obs: pd.DataFrame, split_path, data_root) -> pd.DataFrame:
    """``obs`` with the split of ``split_path`` (``qc/split.tsv``): it must equal the split
    the data files were built with; a folder built without one takes it as it is."""
    given = split_of(list(obs.index), read_split(split_path), path=split_path)
    if SPLIT_COLUMN in obs.columns:
        built = np.asarray(obs[SPLIT_COLUMN]).astype(str)
        if not np.array_equal(built, given):
            raise InputError(
                f"the data files were built with another split ({int((built != given).sum())} cells differ); build them again with this one",
                path=split_path,
                value=[c for c, a, b in zip(obs.index, built, given) if a != b][:5],
            )
        return obs
    log.warning("%s was built without a split: genes and features were chosen from every cell; training holds out the cells of %s", data_root, split_path)
    obs = obs.copy()
    obs[SPLIT_COLUMN] = pd.Categorical(given, categories=list(SPLIT_VALUES))
    return obs


def load_paired(data_dir, split=None) -> PairedData:
    """Read ``rna.h5ad``, ``hic.h5ad`` and ``graph/`` of one configuration folder.

    A folder without ``rna.h5ad`` is Hi-C only: ``rna`` is then an empty
    ``(n_cells, 0)`` matrix, the graph has anchor nodes only, and ``meta`` no ``rna``.

    Training holds out the cells that ``obs["split"]`` of the files marks ``heldout``;
    ``split`` (the path of ``qc/split.tsv``) must agree with it, or sets it for a folder
    built without one.

    Raises
    ------
    InputError
        A file is missing, the two modalities list different cells or split them
        differently, a split value is unknown, or graph nodes do not match the files'
        genes and anchors.
    """
    d = DataFolder(data_dir)
    for path in d.model_inputs:
        if not path.exists():
            raise InputError("missing model input", path=path)
    hic = read_h5ad(d.hic)
    if d.has_rna:
        rna = read_h5ad(d.rna)
        if list(rna.obs_names) != list(hic.obs_names):
            raise InputError(f"{d.rna.name} and {d.hic.name} must list the same cells in the same order", path=d.root)
        rows = {name: tuple(training_rows(m.obs, path)) for name, m, path in (("rna", rna, d.rna), ("hic", hic, d.hic))}
        if rows["rna"] != rows["hic"]:
            raise InputError(f"{d.rna.name} and {d.hic.name} hold out different cells (obs[{SPLIT_COLUMN!r}])", path=d.root)
        obs = rna.obs.copy()
    else:
        log.info("%s has no %s: Hi-C-only training", d.root, d.rna.name)
        training_rows(hic.obs, d.hic)  # a bad split value fails here, naming the file
        rna = ad.AnnData(obs=hic.obs[[]].copy())  # no genes: (n_cells, 0)
        obs = hic.obs.copy()
    if split is not None:
        obs = apply_split(obs, split, d.root)
    nodes = read_parquet_table(d.nodes, {"name": "string"}, "graph nodes")
    edges = read_parquet_table(d.edges, EDGE_COLUMNS, "graph edges")
    for col in ("source", "target"):
        ids = edges[col].to_numpy()
        bad = (ids < 0) | (ids >= len(nodes))
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise InputError(f"row {k}: node index outside the {len(nodes)} nodes", path=d.edges, key=col, value=int(ids[k]))
    index = {n: i for i, n in enumerate(nodes["name"])}
    try:
        gene_nodes = np.array([index[g] for g in rna.var_names], dtype=np.int64)
        anchors = hic.var[hic.var["stratum"] == 0].sort_values("anchor")
        anchor_nodes = np.array([index[a] for a in anchors.index])
    except KeyError as e:
        raise InputError("graph has no node for a feature of the data files", path=d.nodes, value=str(e)) from None
    stratum = hic.var["stratum"].to_numpy().astype(np.int64)
    n_strata = int(hic.uns["ampflow"]["n_strata"])
    hic_counts = counts_matrix(hic)
    graph = GraphSpec(
        src=torch.as_tensor(edges["source"].to_numpy(), dtype=torch.long),
        dst=torch.as_tensor(edges["target"].to_numpy(), dtype=torch.long),
        weight=torch.as_tensor(edges["weight"].to_numpy(), dtype=torch.float32),
        sign=torch.as_tensor(edges["sign"].to_numpy(), dtype=torch.float32),
        n_nodes=len(nodes),
        gene_nodes=torch.as_tensor(gene_nodes),
        anchor_nodes=torch.as_tensor(anchor_nodes),
    )
    meta = {"hic": dict(hic.uns.get("ampflow", {}))}
    if d.has_rna:
        meta["rna"] = dict(rna.uns.get("ampflow", {}))
    rna_counts = counts_matrix(rna) if d.has_rna else sp.csr_matrix((hic.n_obs, 0), dtype=np.float32)
    return PairedData(
        obs=obs,
        rna=rna_counts,
        hic=hic_counts,
        feature_anchor=torch.as_tensor(hic.var["anchor"].to_numpy(), dtype=torch.long),
        feature_stratum=torch.as_tensor(stratum),
        n_strata=n_strata,
        graph=graph,
        meta=meta,
        genes=[str(g) for g in rna.var_names],
        features=[str(f) for f in hic.var_names],
    )
