"""Metadata of an ampflow ``.h5ad`` without loading its matrix (the profile's reader).

Opens the file with h5py and reads only attributes, dataset *shapes* and small groups
(``uns/ampflow``). It never reads the count matrix (``X``'s ``data``/``indices``/
``indptr``, nor ``layers``), so its cost does not grow with the number of contacts. Only
when ``uns["ampflow"]`` lacks the strata summary does it read one or two ``var`` columns
(or, failing those, the feature names, parsed by :func:`ampflow.contract.layout.strata_from_names`),
which grows with the number of features but never with the number of non-zeros.
"""

from __future__ import annotations

import logging
from pathlib import Path

import h5py
import numpy as np

from ..base.errors import InputError
from ..contract.layout import DEFAULT_PROB_MODEL, strata_from_names
from ..contract.layout import max_width as widest_bin

log = logging.getLogger(__name__)

#: ``uns`` datasets larger than this are summarised (shape, dtype) instead of read, so a
#: stray large array stored in ``uns/ampflow`` cannot make the profile slow.
UNS_MAX_ELEMENTS = 100_000

# Sparse encodings as anndata writes them; very old files (anndata < 0.7) carry
# ``h5sparse_format`` instead of ``encoding-type``.
_SPARSE = {"csr_matrix": "csr_matrix", "csc_matrix": "csc_matrix", "csr": "csr_matrix", "csc": "csc_matrix"}


# ------------------------------------------------------------------ h5py helpers
def _attr_str(obj, name: str, default=None):
    """An attribute as ``str`` (h5py returns ``bytes`` for some files, ``str`` for others)."""
    v = obj.attrs.get(name, default)
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.ndarray) and v.shape == () and v.dtype.kind in "SO":
        v = v[()]
        return v.decode() if isinstance(v, bytes) else str(v)
    return v


def _is_string_dtype(dt: np.dtype) -> bool:
    return dt.kind in "SU" or h5py.check_string_dtype(dt) is not None


def _plain(v):
    """numpy scalars and arrays as plain Python values, for JSON."""
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.ndarray):
        if v.dtype.kind == "S" or v.dtype.kind == "O":
            return [_plain(x) for x in v.tolist()]
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


def _read_small(ds: h5py.Dataset):
    """A small ``uns`` dataset as a Python value (str, number, bool, list or None)."""
    if isinstance(ds.shape, tuple) and ds.size > UNS_MAX_ELEMENTS:
        return {"shape": list(ds.shape), "dtype": str(ds.dtype), "skipped": "too large to read in a profile"}
    if ds.shape is None:  # h5py.Empty: anndata writes None this way
        return None
    return _plain(ds.asstr()[()] if _is_string_dtype(ds.dtype) else ds[()])


def _read_uns_group(g: h5py.Group) -> dict:
    """An anndata dict group (recursively) as a plain dict with sorted keys."""
    out = {}
    for key in sorted(g.keys()):
        obj = g[key]
        if isinstance(obj, h5py.Group):
            enc = _attr_str(obj, "encoding-type")
            if enc in (None, "dict"):
                out[key] = _read_uns_group(obj)
            else:
                # dataframes, sparse matrices, ...: never needed by the profile
                out[key] = {"encoding-type": enc, "skipped": "not a plain value"}
        else:
            out[key] = _read_small(obj)
    return out


def _read_column(f: h5py.File, path: Path, name: str) -> np.ndarray | None:
    """One ``var`` column, decoded from any of anndata's encodings; None if absent.

    Handles plain arrays, categoricals (``codes`` + ``categories``, and the pre-0.8
    form with a ``categories`` object reference) and nullable integers.
    """
    var = f.get("var")
    if not isinstance(var, h5py.Group) or name not in var:
        return None
    obj = var[name]
    key = f"var/{name}"
    if isinstance(obj, h5py.Group):
        enc = _attr_str(obj, "encoding-type")
        if enc == "categorical" and "codes" in obj and "categories" in obj:
            codes = obj["codes"][()]
            cats = _read_array(obj["categories"])
            if (codes < 0).any():
                raise InputError("has missing values", path=path, key=key)
            return cats[codes]
        if enc in ("nullable-integer", "nullable-boolean") and "values" in obj:
            values = obj["values"][()]
            if "mask" in obj and obj["mask"][()].any():
                raise InputError("has missing values", path=path, key=key)
            return values
        raise InputError(f"unknown column encoding {enc!r}", path=path, key=key)
    ref = obj.attrs.get("categories")
    if isinstance(ref, h5py.Reference):
        cats = _read_array(f[ref])
        codes = obj[()]
        if (codes < 0).any():
            raise InputError("has missing values", path=path, key=key)
        return cats[codes]
    return _read_array(obj)


def _read_array(ds: h5py.Dataset) -> np.ndarray:
    if _is_string_dtype(ds.dtype) and ds.dtype.kind != "U":
        return np.asarray(ds.asstr()[()], dtype=object)
    return np.asarray(ds[()])


def _as_strata(values: np.ndarray, path: Path, key: str) -> np.ndarray:
    """Column values as non-negative int64 strata, or an InputError naming the bad value."""
    if values.dtype.kind in "iu":
        out = values.astype(np.int64, copy=False)
    elif values.dtype.kind == "f":
        if not np.all(np.isfinite(values)) or not np.all(values == np.round(values)):
            bad = values[~(np.isfinite(values) & (values == np.round(values)))][0]
            raise InputError("must hold whole numbers", path=path, key=key, value=float(bad))
        out = values.astype(np.int64)
    else:
        try:
            out = np.array([int(v) for v in values], dtype=np.int64)
        except (TypeError, ValueError):
            bad = next(v for v in values if not _is_int(v))
            raise InputError("must hold whole numbers", path=path, key=key, value=bad) from None
    if len(out) and out.min() < 0:
        raise InputError("must be >= 0", path=path, key=key, value=int(out.min()))
    return out


def _is_int(v) -> bool:
    try:
        int(v)
    except (TypeError, ValueError):
        return False
    return True


def _index_key(f: h5py.File) -> str | None:
    """Name of the dataset holding ``var``'s index (``_index`` unless the writer renamed it)."""
    var = f.get("var")
    if not isinstance(var, h5py.Group):
        return None
    name = _attr_str(var, "_index")
    for cand in (name, "_index", "index"):
        if cand and cand in var and isinstance(var[cand], h5py.Dataset):
            return cand
    return None


# numpy whose np.strings has partition parses a million feature names in C (~10x faster);
# older numpy falls back to a Python loop
# ------------------------------------------------------------------ one file
def _x_meta(f: h5py.File, path: Path) -> dict:
    """Shape, encoding and nnz of ``X`` from attributes and dataset shapes only."""
    if "X" not in f:
        raise InputError("has no count matrix", path=path, key="X")
    X = f["X"]
    if isinstance(X, h5py.Dataset):
        if X.shape is None or len(X.shape) != 2:
            raise InputError("is not a 2-d matrix", path=path, key="X", value=None if X.shape is None else list(X.shape))
        return {"n_obs": int(X.shape[0]), "n_vars": int(X.shape[1]), "x_encoding": "array", "x_dtype": str(X.dtype), "nnz": None}
    enc = _attr_str(X, "encoding-type") or _attr_str(X, "h5sparse_format")
    if enc not in _SPARSE:
        raise InputError("unknown matrix layout; expected a dense array, csr_matrix or csc_matrix", path=path, key="X", value=enc)
    shape = X.attrs.get("shape", X.attrs.get("h5sparse_shape"))
    if shape is None or len(shape) != 2:
        raise InputError("sparse matrix has no 2-d 'shape' attribute", path=path, key="X/shape", value=_plain(shape))
    for part in ("data", "indices", "indptr"):
        if part not in X or not isinstance(X[part], h5py.Dataset):
            raise InputError("sparse matrix part is missing", path=path, key=f"X/{part}")
    data = X["data"]
    if data.shape is None or len(data.shape) != 1 or X["indices"].shape != data.shape:
        raise InputError("sparse matrix data and indices must be 1-d and of equal length", path=path, key="X/data")
    # len(data) is the stored non-zero count: metadata of the dataset, no element is read
    return {
        "n_obs": int(shape[0]),
        "n_vars": int(shape[1]),
        "x_encoding": _SPARSE[enc],
        "x_dtype": str(data.dtype),
        "nnz": int(data.shape[0]),
    }


def _hic_strata(f: h5py.File, path: Path, uns: dict, n_vars: int) -> dict:
    """n_strata, features_per_stratum, n_anchors, resolution and where each came from.

    Preference: ``uns["ampflow"]``; then ``var["stratum"]`` (and ``anchor``,
    ``start``/``end``); then the feature names.
    """
    n_strata = uns.get("n_strata")
    fps = uns.get("features_per_stratum")
    n_anchors = uns.get("n_anchors")
    resolution = uns.get("resolution")
    sources = {}
    max_width = None
    anchor_col = None
    if n_strata is None and isinstance(fps, list):
        n_strata = len(fps)
    if n_strata is not None and fps is not None:
        sources["strata"] = "uns"
    else:
        col = _read_column(f, path, "stratum")
        if col is not None:
            strata = _as_strata(col, path, "var/stratum")
            sources["strata"] = "var"
            anchor_col = _read_column(f, path, "anchor")
            if resolution is None:
                start, end = _read_column(f, path, "start"), _read_column(f, path, "end")
                if start is not None and end is not None and len(start):
                    max_width = widest_bin(np.asarray(start, dtype=np.int64), np.asarray(end, dtype=np.int64))
        else:
            key = _index_key(f)
            if key is None:
                raise InputError(
                    "no strata recorded: uns/ampflow lacks n_strata/features_per_stratum, var has no 'stratum' column and no feature names",
                    path=path,
                    key="var/stratum",
                )
            ds = f["var"][key]
            # raw bytes: decoding a million names to str costs more than parsing them
            names = ds[()] if _is_string_dtype(ds.dtype) else _read_array(ds)
            strata, max_width = strata_from_names(names, path, f"var/{key}")
            sources["strata"] = "names"
        if len(strata) != n_vars:
            raise InputError(f"has {len(strata)} entries but X has {n_vars} features", path=path, key="var")
        n_inferred = int(strata.max()) + 1 if len(strata) else 0
        if n_strata is None:
            n_strata = n_inferred
        elif int(n_strata) < n_inferred:
            raise InputError(f"is smaller than the strata found in var ({n_inferred})", path=path, key="uns/ampflow/n_strata", value=n_strata)
        fps = np.bincount(strata, minlength=int(n_strata)).tolist()
    fps = [int(x) for x in (fps if isinstance(fps, list) else [fps])]
    n_strata = int(n_strata)
    if len(fps) != n_strata:
        raise InputError(f"has {len(fps)} entries for {n_strata} strata", path=path, key="uns/ampflow/features_per_stratum")
    if sum(fps) != n_vars:
        raise InputError(f"sums to {sum(fps)} but X has {n_vars} features", path=path, key="uns/ampflow/features_per_stratum", value=fps)
    if n_anchors is not None:
        sources["n_anchors"] = "uns"
    elif anchor_col is not None and len(anchor_col):
        # anchors are numbered 0..n-1 in genome order; the largest number + 1 counts them
        n_anchors = int(_as_strata(anchor_col, path, "var/anchor").max()) + 1
        sources["n_anchors"] = "var"
    else:
        n_anchors = fps[0] if fps else 0  # stratum 0 holds exactly one feature per anchor
        sources["n_anchors"] = "features_per_stratum"
    if resolution is not None:
        sources["resolution"] = "uns"
    elif max_width is not None:
        resolution = max_width
        sources["resolution"] = sources["strata"]
    else:
        sources["resolution"] = "unknown"
    return {
        "n_strata": n_strata,
        "features_per_stratum": fps,
        "n_anchors": int(n_anchors),
        "resolution": None if resolution is None else int(resolution),
        "sources": sources,
    }


def read_h5ad_meta(path, modality: str | None = None) -> dict:
    """Metadata of one ``.h5ad`` without loading its matrix.

    Reads with h5py only: ``X``'s shape and non-zero count come from attributes and
    dataset shapes, ``uns["ampflow"]`` is read as a plain dict, and ``var`` columns are
    read only when ``uns`` lacks the Hi-C strata summary.

    Parameters
    ----------
    path
        The ``.h5ad`` file.
    modality
        Expected modality (``"hic"`` or ``"rna"``), e.g. from the file name. Used when
        ``uns["ampflow"]["modality"]`` is absent; an error if it disagrees with it.

    Returns
    -------
    dict
        ``path``, ``bytes``, ``n_obs``, ``n_vars``, ``x_encoding`` (``csr_matrix``,
        ``csc_matrix`` or ``array``), ``x_dtype``, ``nnz`` (stored non-zeros; None for a
        dense ``X``), ``uns`` (``uns["ampflow"]``, ``{}`` if absent), ``modality``,
        ``prob_model``, and ``sources`` saying where inferred values came from
        (``prob_model``: ``uns`` or ``default``). For Hi-C also ``n_strata``,
        ``features_per_stratum``, ``n_anchors``, ``resolution`` with their sources
        (``uns``, ``var``, ``names``).

    Raises
    ------
    InputError
        The file is missing, not HDF5 or unreadable, has no ``X``, has an unknown ``X``
        or column layout, or records inconsistent or insufficient metadata.
    """
    path = Path(path)
    if not path.exists():
        raise InputError("input file does not exist", path=path)
    if path.is_dir():
        raise InputError("is a directory, expected an .h5ad file", path=path)
    try:
        with h5py.File(path, "r") as f:
            return _read_meta(f, path, modality)
    except InputError:
        raise
    except OSError as e:
        # h5py raises OSError for a non-HDF5, truncated or otherwise corrupt file
        raise InputError(f"cannot be read as HDF5/AnnData ({e})", path=path) from None
    except (KeyError, RuntimeError, ValueError, TypeError) as e:
        raise InputError(f"has an unexpected AnnData layout ({type(e).__name__}: {e})", path=path) from None


def _read_meta(f: h5py.File, path: Path, modality: str | None) -> dict:
    meta = {"path": str(path), "bytes": path.stat().st_size}
    meta.update(_x_meta(f, path))
    uns_obj = f.get("uns/ampflow")
    if uns_obj is not None and not isinstance(uns_obj, h5py.Group):
        raise InputError("must be a dict", path=path, key="uns/ampflow")
    uns = _read_uns_group(uns_obj) if uns_obj is not None else {}
    meta["uns"] = uns
    recorded = uns.get("modality")
    if recorded is not None and modality is not None and recorded != modality:
        raise InputError(f"says {recorded!r}, but the file is read as {modality!r}", path=path, key="uns/ampflow/modality")
    modality = recorded or modality
    meta["modality"] = modality
    sources = {}
    prob_model = uns.get("prob_model")
    if prob_model is not None:
        sources["prob_model"] = "uns"
    elif modality in DEFAULT_PROB_MODEL:
        prob_model = DEFAULT_PROB_MODEL[modality]
        sources["prob_model"] = "default"
        log.warning("%s: uns/ampflow has no prob_model; assuming %s for modality %s", path, prob_model, modality)
    else:
        raise InputError(
            "no probability model recorded, and the modality is unknown so none can be assumed",
            path=path,
            key="uns/ampflow/prob_model",
            value=modality,
        )
    meta["prob_model"] = str(prob_model)
    # a cheap consistency check: var's index length is a dataset shape
    key = _index_key(f)
    if key is not None and f["var"][key].shape not in (None, (meta["n_vars"],)):
        raise InputError(f"has {f['var'][key].shape[0]} rows but X has {meta['n_vars']} columns", path=path, key="var")
    if modality == "hic":
        hic = _hic_strata(f, path, uns, meta["n_vars"])
        sources.update(hic.pop("sources"))
        meta.update(hic)
    meta["sources"] = dict(sorted(sources.items()))
    return meta
