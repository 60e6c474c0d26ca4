"""RNA count matrices: genes x cells TSV/CSV (optionally gzipped), 10x MTX folders, h5ad.

Real matrices (e.g. featureCounts --fraction) hold fractional counts; the NB model
needs integers, so :func:`round_counts` rounds them and reports what changed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

from .errors import InputError
from .textfile import open_text

log = logging.getLogger(__name__)
ROUNDING = ("half_up", "half_even", "floor", "ceil")
CHUNK_ROWS = 2000


def read_rna(path) -> ad.AnnData:
    """Read a counts matrix as AnnData (cells x genes, float32 CSR, unrounded).

    Raises
    ------
    InputError
        Missing file, duplicate cell ids, non-numeric or negative counts (with the
        line, the column's cell id and the value).
    """
    p = Path(path)
    if not p.exists():
        raise InputError("RNA matrix does not exist", path=p)
    if p.is_dir():
        adata = _read_mtx(p)
    elif p.name.endswith(".h5ad"):
        adata = ad.read_h5ad(p)
        if "counts" in adata.layers:
            adata.X = adata.layers["counts"]
        adata.X = sp.csr_matrix(adata.X, dtype=np.float32)
        _check_values(adata.X, p)
    else:
        adata = _read_delimited(p)
    if adata.obs_names.has_duplicates:
        dup = adata.obs_names[adata.obs_names.duplicated()][0]
        raise InputError("duplicate cell id in RNA matrix", path=p, key="cell", value=dup)
    if adata.var_names.has_duplicates:
        n = int(adata.var_names.duplicated().sum())
        log.warning("%s: %d duplicate gene names made unique (suffix -1, -2, ...)", p, n)
        adata.var_names_make_unique()
    if adata.n_obs == 0 or adata.n_vars == 0:
        raise InputError(f"RNA matrix is empty ({adata.n_vars} genes x {adata.n_obs} cells)", path=p)
    return adata


def _read_mtx(p: Path) -> ad.AnnData:
    import scanpy as sc

    try:
        adata = sc.read_10x_mtx(p, var_names="gene_symbols", cache=False)
    except FileNotFoundError as e:
        raise InputError(f"not a 10x MTX folder (matrix.mtx[.gz], features/genes, barcodes): {e}", path=p) from None
    adata.X = sp.csr_matrix(adata.X, dtype=np.float32)
    _check_values(adata.X, p)
    return adata


def _check_values(X, p: Path) -> None:
    data = X.data if sp.issparse(X) else np.asarray(X)
    if data.size and (not np.isfinite(data).all() or (data < 0).any()):
        raise InputError("counts must be finite and non-negative", path=p)


def _read_delimited(p: Path) -> ad.AnnData:
    with open_text(p) as fh:
        header = fh.readline().rstrip("\n\r")
    if not header:
        raise InputError("RNA matrix is empty", path=p)
    sep = "\t" if "\t" in header else ","
    cells = header.split(sep)[1:]
    seen: dict[str, int] = {}
    for j, c in enumerate(cells):
        if c in seen:
            raise InputError(
                f"duplicate cell id in header (columns {seen[c] + 2} and {j + 2})", path=p, line=1, key="cell", value=c
            )
        seen[c] = j
    genes: list[str] = []
    blocks = []
    line0 = 2
    try:
        reader = pd.read_csv(
            p, sep=sep, header=None, skiprows=1, index_col=0, dtype={0: str}, chunksize=CHUNK_ROWS, compression="infer"
        )
        for chunk in reader:
            if chunk.shape[1] != len(cells):
                raise InputError(
                    f"expected {len(cells)} count columns (one per header cell), found {chunk.shape[1]}",
                    path=p,
                    line=line0,
                )
            values = _numeric_block(chunk, p, line0, cells)
            genes.extend(chunk.index.astype(str))
            blocks.append(sp.csr_matrix(values.T))  # cells x genes
            line0 += len(chunk)
    except (EOFError, OSError) as e:
        raise InputError(f"cannot read (truncated or corrupt gzip?): {e}", path=p) from None
    except pd.errors.ParserError as e:
        raise InputError(f"malformed table: {e}", path=p) from None
    if not blocks:
        raise InputError("RNA matrix has a header but no genes", path=p)
    X = sp.hstack(blocks, format="csr").astype(np.float32)
    return ad.AnnData(X=X, obs=pd.DataFrame(index=pd.Index(cells, name="cell_id")), var=pd.DataFrame(index=genes))


def _numeric_block(chunk: pd.DataFrame, p: Path, line0: int, cells: list[str]) -> np.ndarray:
    try:
        values = chunk.to_numpy(dtype=np.float64)
    except (ValueError, TypeError):
        num = chunk.apply(pd.to_numeric, errors="coerce")
        bad = num.isna().to_numpy() & ~chunk.isna().to_numpy()
        if not bad.any():
            bad = num.isna().to_numpy()
        i, j = (int(x[0]) for x in np.nonzero(bad))
        raise InputError(
            "count is not a number", path=p, line=line0 + i, key=f"gene {chunk.index[i]}, cell {cells[j]}", value=chunk.iat[i, j]
        ) from None
    bad = ~np.isfinite(values) | (values < 0)
    if bad.any():
        i, j = (int(x[0]) for x in np.nonzero(bad))
        what = "count is negative" if values[i, j] < 0 else "count is missing or not finite"
        raise InputError(what, path=p, line=line0 + i, key=f"gene {chunk.index[i]}, cell {cells[j]}", value=chunk.iat[i, j])
    return values


def round_counts(X: sp.csr_matrix, mode: str = "half_up") -> tuple[sp.csr_matrix, dict]:
    """Round fractional counts to integers for the NB likelihood.

    Returns the rounded matrix (float32 CSR, zeros removed) and a report with the
    number of fractional entries and the total counts before and after.
    """
    if mode not in ROUNDING:
        raise InputError(f"must be one of {ROUNDING}", key="rna.rounding", value=mode)
    X = sp.csr_matrix(X, dtype=np.float64, copy=True)
    data = X.data
    frac = int((data != np.floor(data)).sum())
    before = float(data.sum())
    if mode == "half_up":
        data[:] = np.floor(data + 0.5)
    elif mode == "half_even":
        data[:] = np.rint(data)
    elif mode == "floor":
        data[:] = np.floor(data)
    else:
        data[:] = np.ceil(data)
    X.eliminate_zeros()
    after = float(X.data.sum())
    report = {
        "mode": mode,
        "fractional_entries": frac,
        "nonzero_entries": int(len(data)),
        "total_before": before,
        "total_after": after,
    }
    return X.astype(np.float32), report
