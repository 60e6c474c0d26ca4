"""Per-cell QC table: contacts by kind and by drop reason, RNA UMIs and genes, pairing, pass/fail."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..base.errors import InputError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QCThresholds:
    min_contacts: int = 1000
    min_cis_fraction: float = 0.5
    min_umis: int = 500
    min_genes: int = 200

    def __post_init__(self):
        for k in ("min_contacts", "min_umis", "min_genes"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise InputError("must be an integer", key=f"qc.{k}", value=v)
        v = self.min_cis_fraction
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise InputError("must be a number", key="qc.min_cis_fraction", value=v)
        for k in ("min_contacts", "min_umis", "min_genes"):
            if getattr(self, k) < 0:
                raise InputError("must be >= 0", key=f"qc.{k}", value=getattr(self, k))
        if not 0 <= self.min_cis_fraction <= 1:
            raise InputError("must be within [0, 1]", key="qc.min_cis_fraction", value=self.min_cis_fraction)


def rna_stats(adata) -> pd.DataFrame:
    """UMIs and detected genes per cell (from rounded counts)."""
    X = adata.X
    return pd.DataFrame(
        {
            "rna_umis": np.asarray(X.sum(axis=1)).ravel().astype(np.int64),
            "rna_genes": np.asarray((X > 0).sum(axis=1)).ravel().astype(np.int64),
        },
        index=pd.Index(adata.obs_names, name="cell_id"),
    )


def qc_table(contacts: pd.DataFrame, rna: pd.DataFrame | None, thresholds: QCThresholds, rna_path=None) -> pd.DataFrame:
    """Join Hi-C and RNA stats over the union of cells and decide pass/fail.

    Cells present in only one modality are kept in the table, marked unmatched and
    failed with that reason. Raises InputError when no cell is in both.

    ``rna`` None: a Hi-C-only dataset. Cells pass on their contacts alone (the RNA
    thresholds do not apply), ``in_rna`` is False and ``matched`` means "has pairs";
    the RNA columns are empty.
    """
    if rna is None:
        return _hic_only_table(contacts, thresholds)
    both = contacts.index.intersection(rna.index)
    if len(both) == 0:
        raise InputError(
            f"no cell id is in both the cell sheet ({len(contacts)} cells, e.g. {list(contacts.index[:3])}) "
            f"and the RNA matrix ({len(rna)} cells, e.g. {list(rna.index[:3])})",
            path=rna_path,
        )
    order = list(contacts.index) + [c for c in rna.index if c not in contacts.index]
    t = contacts.reindex(order).join(rna.reindex(order))
    t.index.name = "cell_id"
    t["in_pairs"] = t.index.isin(contacts.index)
    t["in_rna"] = t.index.isin(rna.index)
    t["matched"] = t["in_pairs"] & t["in_rna"]
    kept = t["cis"].fillna(0) + t["trans"].fillna(0)
    t["cis_fraction"] = np.where(kept > 0, t["cis"].fillna(0) / kept.where(kept > 0, 1), 0.0)
    reasons = []
    for _, r in t.iterrows():
        why = []
        if not r["in_pairs"]:
            why.append("not in cell sheet (no pairs)")
        if not r["in_rna"]:
            why.append("not in RNA matrix")
        if r["in_pairs"]:
            n = int(r["cis"] + r["trans"])
            if n < thresholds.min_contacts:
                why.append(f"contacts {n} < {thresholds.min_contacts}")
            if r["cis_fraction"] < thresholds.min_cis_fraction:
                why.append(f"cis fraction {r['cis_fraction']:.2f} < {thresholds.min_cis_fraction}")
        if r["in_rna"]:
            if r["rna_umis"] < thresholds.min_umis:
                why.append(f"RNA UMIs {int(r['rna_umis'])} < {thresholds.min_umis}")
            if r["rna_genes"] < thresholds.min_genes:
                why.append(f"RNA genes {int(r['rna_genes'])} < {thresholds.min_genes}")
        reasons.append("; ".join(why))
    t["pass"] = [not w for w in reasons]
    t["reason"] = reasons
    int_cols = ["total", "cis", "trans", "dropped_unknown_chrom", "dropped_excluded", "rna_umis", "rna_genes"]
    for c in int_cols:
        t[c] = t[c].astype("Int64")
    only_pairs = int((t["in_pairs"] & ~t["in_rna"]).sum())
    only_rna = int((~t["in_pairs"] & t["in_rna"]).sum())
    if only_pairs or only_rna:
        log.warning("%d cell(s) have pairs but no RNA, %d have RNA but no pairs (see qc table)", only_pairs, only_rna)
    log.info("QC: %d of %d cells pass (%d matched)", int(t["pass"].sum()), len(t), int(t["matched"].sum()))
    return t


def _hic_checks(r, thresholds: QCThresholds) -> list[str]:
    n = int(r["cis"] + r["trans"])
    why = []
    if n < thresholds.min_contacts:
        why.append(f"contacts {n} < {thresholds.min_contacts}")
    if r["cis_fraction"] < thresholds.min_cis_fraction:
        why.append(f"cis fraction {r['cis_fraction']:.2f} < {thresholds.min_cis_fraction}")
    return why


def _hic_only_table(contacts: pd.DataFrame, thresholds: QCThresholds) -> pd.DataFrame:
    """:func:`qc_table` without RNA: the same columns, pass/fail from contacts alone."""
    t = contacts.copy()
    t.index.name = "cell_id"
    t["rna_umis"] = pd.NA
    t["rna_genes"] = pd.NA
    t["in_pairs"] = True
    t["in_rna"] = False
    t["matched"] = True  # every cell has all the modalities the dataset has
    kept = t["cis"].fillna(0) + t["trans"].fillna(0)
    t["cis_fraction"] = np.where(kept > 0, t["cis"].fillna(0) / kept.where(kept > 0, 1), 0.0)
    reasons = ["; ".join(_hic_checks(r, thresholds)) for _, r in t.iterrows()]
    t["pass"] = [not w for w in reasons]
    t["reason"] = reasons
    for c in ["total", "cis", "trans", "dropped_unknown_chrom", "dropped_excluded", "rna_umis", "rna_genes"]:
        t[c] = t[c].astype("Int64")
    log.info("QC (Hi-C only, no RNA): %d of %d cells pass", int(t["pass"].sum()), len(t))
    return t


def passing_cells(qc: pd.DataFrame) -> list[str]:
    """Cells that pass QC, in table (= cell sheet) order."""
    col = qc["pass"]
    if col.dtype != bool:
        col = col.astype(str).str.lower().isin(["true", "1"])
    return list(qc.index[col.to_numpy()])


def read_qc(path) -> pd.DataFrame:
    return pd.read_csv(path, sep="\t", index_col="cell_id", keep_default_na=False, dtype={"cell_id": str})
