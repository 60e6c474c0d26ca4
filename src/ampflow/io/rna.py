"""RNA count matrices: genes x cells TSV/CSV (optionally gzipped), 10x MTX folders, h5ad.

Real matrices (e.g. featureCounts --fraction) hold fractional counts; the NB model
needs integers, so :func:`round_counts` rounds them and reports what changed.
"""

from __future__ import annotations

import csv
import logging
import re
import zlib
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

from ..base.errors import InputError
from .h5ad import read_h5ad
from .textfile import is_gzip, open_binary, open_text

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
        adata = read_h5ad(p, "RNA matrix")
        if "counts" in adata.layers:
            adata.X = adata.layers["counts"]
        adata.X = sp.csr_matrix(adata.X, dtype=np.float32)
        _check_values(adata, p)
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


MTX_FILES = {
    "matrix": ("matrix.mtx.gz", "matrix.mtx"),
    "features": ("features.tsv.gz", "features.tsv", "genes.tsv.gz", "genes.tsv"),
    "barcodes": ("barcodes.tsv.gz", "barcodes.tsv"),
}


def _read_mtx(p: Path) -> ad.AnnData:
    """A 10x folder (Cell Ranger v3 ``features.tsv.gz`` or v2 ``genes.tsv``): genes x
    cells MatrixMarket coordinates, one feature per line (``id<TAB>symbol[<TAB>type]``),
    one barcode per line. Gene symbols become ``var_names`` (ids in ``var["gene_ids"]``)."""
    found = {}
    for part, names in MTX_FILES.items():
        hit = next((p / n for n in names if (p / n).is_file()), None)
        if hit is None:
            raise InputError(f"not a 10x MTX folder: no {' or '.join(names)}", path=p)
        found[part] = hit
    features = [line.rstrip("\r\n").split("\t") for line in _lines(found["features"])]
    barcodes = [line.strip() for line in _lines(found["barcodes"])]
    X = _read_matrix_market(found["matrix"], len(features), len(barcodes))
    ids = [f[0] for f in features]
    symbols = [f[1] if len(f) > 1 and f[1] else f[0] for f in features]
    var = pd.DataFrame({"gene_ids": ids}, index=pd.Index(symbols))
    if len(features[0]) > 2:
        var["feature_types"] = [f[2] if len(f) > 2 else "" for f in features]
    adata = ad.AnnData(X=X.T.tocsr().astype(np.float32), obs=pd.DataFrame(index=pd.Index(barcodes)), var=var)
    _check_values(adata, found["matrix"])
    return adata


def _lines(path: Path) -> list[str]:
    """Non-blank lines of a 10x side file; a blank or cut line is an InputError."""
    with open_text(path) as fh:
        lines = fh.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise InputError("empty file", path=path)
    for i, line in enumerate(lines, 1):
        if not line.strip():
            raise InputError("blank line", path=path, line=i)
    return lines


def _read_matrix_market(path: Path, n_rows: int, n_cols: int) -> sp.coo_matrix:
    """A MatrixMarket ``coordinate`` matrix (``integer``/``real``/``pattern``), checked
    against the feature and barcode counts and its own size line."""
    with open_binary(path) as fh:
        head = fh.readline().decode("ascii", "replace").split()
        if len(head) < 4 or head[0].lower() != "%%matrixmarket" or head[2].lower() != "coordinate":
            raise InputError("not a MatrixMarket coordinate matrix", path=path, line=1, value=" ".join(head)[:80])
        field = head[3].lower()
        if field not in ("integer", "real", "pattern"):
            raise InputError("unsupported MatrixMarket field (integer, real or pattern)", path=path, line=1, value=field)
        lineno = 1
        while (line := fh.readline()).startswith(b"%"):
            lineno += 1
        lineno += 1
        size = line.split()
        if len(size) != 3 or not all(t.isdigit() for t in size):
            raise InputError("size line must be 'rows cols entries'", path=path, line=lineno, value=line.decode("ascii", "replace").strip())
        rows, cols, nnz = (int(t) for t in size)
        if (rows, cols) != (n_rows, n_cols):
            raise InputError(
                f"matrix is {rows} x {cols}, but the folder lists {n_rows} features and {n_cols} barcodes",
                path=path, line=lineno, value=line.decode("ascii", "replace").strip(),
            )  # fmt: skip
        ncol = 2 if field == "pattern" else 3
        try:
            df = pd.read_csv(fh, sep=" ", header=None, dtype=str, na_filter=False, engine="c", quoting=csv.QUOTE_NONE, encoding_errors="replace")
        except pd.errors.EmptyDataError:
            df = pd.DataFrame(np.empty((0, ncol), dtype=str))
        except pd.errors.ParserError as e:
            m = re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", str(e))
            if m is None:
                raise InputError(f"malformed entry lines: {e}", path=path) from None
            raise InputError(f"entry line has {m[3]} fields, expected {m[1]}", path=path, line=lineno + int(m[2])) from None
    first = lineno + 1
    if df.shape[1] != ncol:
        raise InputError(f"entry lines need {ncol} fields, found {df.shape[1]}", path=path, line=first)
    if len(df) != nnz:
        raise InputError(f"size line promises {nnz} entries, found {len(df)} (file cut?)", path=path, line=lineno)
    ij = []
    for k, n in ((0, rows), (1, cols)):
        text = df[k].to_numpy(dtype=str)
        ok = np.char.isdigit(text) & (np.char.str_len(text) <= 18)
        v = np.where(ok, text, "0").astype(np.int64)
        ok &= (v >= 1) & (v <= n)
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise InputError(f"{('row', 'column')[k]} index is not in 1..{n}", path=path, line=first + i, value=str(text[i]))
        ij.append(v - 1)
    if field == "pattern":
        vals = np.ones(nnz, dtype=np.float64)
    else:
        vals = pd.to_numeric(df[2], errors="coerce").to_numpy(dtype=np.float64)
        bad = ~np.isfinite(vals) | (vals < 0)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InputError("count is not a finite non-negative number", path=path, line=first + i, value=str(df[2].iat[i]))
    return sp.coo_matrix((vals, (ij[0], ij[1])), shape=(rows, cols))


def _check_values(adata, p: Path) -> None:
    """Counts must be finite and non-negative; name the first bad entry's cell and gene."""
    X = sp.csr_matrix(adata.X)
    bad = ~np.isfinite(X.data) | (X.data < 0)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        i = int(np.searchsorted(X.indptr, k, side="right") - 1)
        j = int(X.indices[k])
        raise InputError(
            "counts must be finite and non-negative",
            path=p,
            key=f"cell {adata.obs_names[i]}, gene {adata.var_names[j]}",
            value=float(X.data[k]),
        )


def _read_delimited(p: Path) -> ad.AnnData:
    with open_text(p) as fh:
        header = fh.readline().rstrip("\n\r")
        first = next((line for line in fh if line.strip()), "")
    if not header.strip():
        raise InputError("RNA matrix is empty (no header line)", path=p, line=1)
    sep = "\t" if "\t" in header else ","
    names = _fields(header, sep)
    # R's write.table(row.names=TRUE) leaves the gene column unnamed: one field less
    # (but a trailing separator on data lines is not that)
    first_fields = _fields(first.rstrip("\n\r"), sep) if first else []
    r_style = len(first_fields) == len(names) + 1 and first_fields[-1].strip() != ""
    offset = 1 if r_style else 2
    cells = names if offset == 1 else names[1:]
    seen: dict[str, int] = {}
    for j, c in enumerate(cells):
        if not c.strip():
            raise InputError(f"empty cell id in header (column {j + offset})", path=p, line=1, key="cell", value=c)
        if c in seen:
            raise InputError(
                f"duplicate cell id in header (columns {seen[c] + offset} and {j + offset})",
                path=p,
                line=1,
                key="cell",
                value=c,
            )
        seen[c] = j
    if not cells:
        raise InputError("header names no cell (expected 'gene<TAB>cell1<TAB>cell2...')", path=p, line=1, value=header)
    genes: list[str] = []
    blocks = []
    row0 = 0  # data rows (non-blank lines after the header) before this chunk
    try:
        reader = pd.read_csv(
            p,
            sep=sep,
            header=None,
            skiprows=1,
            index_col=0,
            dtype={0: str},
            chunksize=CHUNK_ROWS,
            compression="gzip" if is_gzip(p) else None,
            keep_default_na=False,  # a gene called 'NA' stays 'NA'; a count 'NA' is reported as such
            encoding_errors="replace",
        )
        for chunk in reader:
            if chunk.shape[1] != len(cells):
                _check_fields(p, sep, len(cells) + 1)
                raise InputError(
                    f"expected {len(cells)} count columns (one per header cell), found {chunk.shape[1]}",
                    path=p,
                    line=_data_line(p, row0),
                )
            values = _numeric_block(chunk, p, row0, cells, sep)
            genes.extend(chunk.index.astype(str))
            blocks.append(sp.csr_matrix(values.T))  # cells x genes
            row0 += len(chunk)
    except pd.errors.EmptyDataError:
        raise InputError("RNA matrix has a header but no genes", path=p) from None
    except (EOFError, OSError, zlib.error) as e:
        raise InputError(f"cannot read (truncated or corrupt gzip?): {e}", path=p) from None
    except pd.errors.ParserError as e:
        _check_fields(p, sep, len(cells) + 1)
        raise InputError(f"malformed table: {e}", path=p) from None
    if not blocks:
        raise InputError("RNA matrix has a header but no genes", path=p)
    X = sp.hstack(blocks, format="csr").astype(np.float32)
    return ad.AnnData(X=X, obs=pd.DataFrame(index=pd.Index(cells, name="cell_id")), var=pd.DataFrame(index=genes))


def _fields(line: str, sep: str) -> list[str]:
    """Split one line like pandas does (double quotes group a field)."""
    return next(csv.reader([line], delimiter=sep))


def _data_lines(p: Path):
    """(line number, text) of each data line: non-blank lines after the header."""
    with open_text(p) as fh:
        fh.readline()
        for lineno, line in enumerate(fh, 2):
            if line.strip():
                yield lineno, line.rstrip("\n\r")


def _data_line(p: Path, row: int) -> int:
    """File line number of the 0-based data row ``row`` (pandas skips blank lines)."""
    for k, (lineno, _) in enumerate(_data_lines(p)):
        if k == row:
            return lineno
    return row + 2


def _check_fields(p: Path, sep: str, n: int) -> None:
    """Raise InputError at the first data line that does not have ``n`` fields (slow path)."""
    for lineno, line in _data_lines(p):
        f = _fields(line, sep)
        if len(f) != n:
            raise InputError(
                f"expected {n} fields (gene and one count per header cell), found {len(f)}",
                path=p,
                line=lineno,
                key=f"gene {f[0]}",
                value=line if len(line) <= 80 else line[:77] + "...",
            )


def _py(v):
    return v.item() if isinstance(v, np.generic) else v


def _numeric_block(chunk: pd.DataFrame, p: Path, row0: int, cells: list[str], sep: str) -> np.ndarray:
    try:
        values = chunk.to_numpy(dtype=np.float64)
    except (ValueError, TypeError):
        num = chunk.apply(pd.to_numeric, errors="coerce")
        bad = num.isna().to_numpy() & ~chunk.isna().to_numpy()
        if not bad.any():
            bad = num.isna().to_numpy()
        i, j = (int(x[0]) for x in np.nonzero(bad))
        raw = chunk.iat[i, j]
        if raw == "":
            _check_fields(p, sep, len(cells) + 1)  # a short line reads as empty fields
        raise InputError(
            "count is empty" if raw == "" else "count is not a number",
            path=p,
            line=_data_line(p, row0 + i),
            key=f"gene {chunk.index[i]}, cell {cells[j]}",
            value=_py(raw),
        ) from None
    bad = ~np.isfinite(values) | (values < 0)
    if bad.any():
        if np.isnan(values).any():
            _check_fields(p, sep, len(cells) + 1)  # a short line leaves NaN behind
        i, j = (int(x[0]) for x in np.nonzero(bad))
        what = "count is negative" if values[i, j] < 0 else "count is missing or not finite"
        raise InputError(
            what,
            path=p,
            line=_data_line(p, row0 + i),
            key=f"gene {chunk.index[i]}, cell {cells[j]}",
            value=_py(chunk.iat[i, j]),
        )
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
