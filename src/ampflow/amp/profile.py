"""Profile a data folder from metadata alone: shapes, strata, graph sizes, configs.

The profile is the first step of AMP (profile -> diagnose -> execute). It opens the
AnnData files with h5py and reads only attributes, dataset *shapes* and small groups
(``uns/ampflow``), and reads parquet footers for the graph tables. It never reads the
count matrix (``X``'s ``data``/``indices``/``indptr``, nor ``layers``), so its cost does
not grow with the number of contacts. Only when ``uns["ampflow"]`` lacks the strata
summary does it read one or two ``var`` columns (or, failing those, the feature names),
which grows with the number of features but never with the number of non-zeros.

The result is a plain, JSON-serialisable dict. ``signals`` and ``memory`` are added by
:func:`main_profile` from :mod:`ampflow.amp.signals` and :mod:`ampflow.amp.memory_model`
when those modules are importable.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import h5py
import numpy as np

from ..io.atomic import write_text_atomic
from ..io.errors import InputError
from ..model.config import ModelConfig

log = logging.getLogger(__name__)

PROFILE_VERSION = 1

#: Files of a data folder, by role. Paths are relative to the folder.
MODALITY_FILES = {"rna": "rna.h5ad", "hic": "hic.h5ad"}
GRAPH_FILES = {"nodes": "graph/nodes.parquet", "edges": "graph/edges.parquet"}
GRAPH_META = "graph/graph.json"

#: Probability model assumed when a file does not record one.
DEFAULT_PROB_MODEL = {"hic": "HiCZINB", "rna": "NB"}

#: ``train.batch_size`` default; kept equal to ``TrainConfig`` by a test. Not imported
#: from there because that module pulls in torch, which would dominate the profile's cost.
DEFAULT_BATCH_SIZE = 32

#: Bytes hashed at the start of each input for its fingerprint.
HEAD_BYTES = 1 << 20

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
_NP_STRINGS = hasattr(np, "strings") and all(hasattr(np.strings, f) for f in ("partition", "rpartition", "isdigit", "str_len"))


def _strata_from_names(names: np.ndarray, path, key: str) -> tuple[np.ndarray, int | None]:
    """Stratum per feature, and the largest bin width, from names ``chrom:start-end[-k]``.

    The part after the last ``:`` has 2 ``-``-separated fields for stratum 0 and 3 for
    stratum k (the last field). Splitting on the last ``:`` keeps chromosome names that
    contain ``:`` or ``-`` working.
    """
    names = np.asarray(names)
    if _NP_STRINGS and len(names):
        try:
            fixed = names.astype("S" if isinstance(names.flat[0], bytes) else "U") if names.dtype == object else names
        except (UnicodeError, TypeError, ValueError):
            fixed = None
        if fixed is not None and fixed.dtype.kind in "SU":
            return _strata_from_names_vectorised(fixed, path, key)
    return _strata_from_names_loop(names, path, key)


def _bad_name(path, key: str, name) -> InputError:
    if isinstance(name, bytes):
        name = name.decode(errors="replace")
    return InputError(
        "feature name is not chrom:start-end or chrom:start-end-stratum, so strata cannot be inferred",
        path=path,
        key=key,
        value=str(name),
    )


def _strata_from_names_vectorised(names: np.ndarray, path, key: str) -> tuple[np.ndarray, int | None]:
    colon, dash = (b":", b"-") if names.dtype.kind == "S" else (":", "-")
    _, c, coords = np.strings.rpartition(names, colon)
    start, d1, rest = np.strings.partition(coords, dash)
    end, d2, k = np.strings.partition(rest, dash)
    has_k = np.strings.str_len(d2) > 0
    # isdigit("") is False, so empty fields and a fourth '-' field (k = "3-4") fail here
    ok = (np.strings.str_len(c) > 0) & (np.strings.str_len(d1) > 0) & np.strings.isdigit(start) & np.strings.isdigit(end)
    ok &= ~has_k | np.strings.isdigit(k)
    if not ok.all():
        raise _bad_name(path, key, names[np.argmin(ok)])
    strata = np.zeros(len(names), dtype=np.int64)
    strata[has_k] = k[has_k].astype(np.int64)
    # every feature's coordinates are its anchor bin's, so stratum 0 has all the widths
    # at a tenth of the parsing cost
    sel = ~has_k if (~has_k).any() else slice(None)
    return strata, _max_width(start[sel].astype(np.int64), end[sel].astype(np.int64))


def _max_width(start: np.ndarray, end: np.ndarray) -> int | None:
    """The largest ``end - start``: the resolution, since only a chromosome's last bin is shorter."""
    return int((end - start).max()) if len(start) else None


def _strata_from_names_loop(names: np.ndarray, path, key: str) -> tuple[np.ndarray, int | None]:
    strata = np.empty(len(names), dtype=np.int64)
    width = np.empty(len(names), dtype=np.int64)
    for i, name in enumerate(names):
        text = name.decode() if isinstance(name, bytes) else str(name)
        _, colon, coords = text.rpartition(":")
        parts = coords.split("-")
        if not colon or len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
            raise _bad_name(path, key, name)
        strata[i] = int(parts[2]) if len(parts) == 3 else 0
        width[i] = int(parts[1]) - int(parts[0])
    return strata, int(width.max()) if len(width) else None


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
                    max_width = _max_width(np.asarray(start, dtype=np.int64), np.asarray(end, dtype=np.int64))
        else:
            key = _index_key(f)
            if key is None:
                raise InputError(
                    "no strata recorded: uns/ampflow lacks n_strata/features_per_stratum, "
                    "var has no 'stratum' column and no feature names",
                    path=path,
                    key="var/stratum",
                )
            ds = f["var"][key]
            # raw bytes: decoding a million names to str costs more than parsing them
            names = ds[()] if _is_string_dtype(ds.dtype) else _read_array(ds)
            strata, max_width = _strata_from_names(names, path, f"var/{key}")
            sources["strata"] = "names"
        if len(strata) != n_vars:
            raise InputError(f"has {len(strata)} entries but X has {n_vars} features", path=path, key="var")
        n_inferred = int(strata.max()) + 1 if len(strata) else 0
        if n_strata is None:
            n_strata = n_inferred
        elif int(n_strata) < n_inferred:
            raise InputError(
                f"is smaller than the strata found in var ({n_inferred})", path=path, key="uns/ampflow/n_strata", value=n_strata
            )
        fps = np.bincount(strata, minlength=int(n_strata)).tolist()
    fps = [int(x) for x in (fps if isinstance(fps, list) else [fps])]
    n_strata = int(n_strata)
    if len(fps) != n_strata:
        raise InputError(f"has {len(fps)} entries for {n_strata} strata", path=path, key="uns/ampflow/features_per_stratum")
    if sum(fps) != n_vars:
        raise InputError(
            f"sums to {sum(fps)} but X has {n_vars} features", path=path, key="uns/ampflow/features_per_stratum", value=fps
        )
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


# ------------------------------------------------------------------ folder
def file_fingerprint(path) -> dict:
    """``{"bytes": size, "sha256_head": hex}`` of one file.

    ``sha256_head`` is the SHA-256 of the file's first MiB followed by its size in
    decimal: constant cost however large the file is, and it changes when the file is
    rewritten with different metadata (HDF5 and parquet keep theirs near the start or
    end; the size covers the end). It can miss an in-place edit past the first MiB
    that keeps the size, so it identifies inputs for the plan rather than proving
    their contents.
    """
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        h.update(fh.read(HEAD_BYTES))
    h.update(str(size).encode())
    return {"bytes": int(size), "sha256_head": h.hexdigest()}


def _parquet_rows(path: Path) -> int:
    """Row count from the parquet footer; no column is read."""
    import pyarrow.parquet as pq

    if not path.is_file():
        raise InputError("graph table does not exist", path=path)
    try:
        return int(pq.ParquetFile(path).metadata.num_rows)
    except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError
        raise InputError(f"cannot be read as parquet ({e})", path=path) from None


def _batch_size(train_config: dict) -> int:
    bs = train_config.get("batch_size", DEFAULT_BATCH_SIZE)
    if isinstance(bs, bool) or not isinstance(bs, (int, np.integer)) or bs < 2:
        raise InputError("must be an integer >= 2 (batch normalisation needs two cells)", key="train.batch_size", value=bs)
    return int(bs)


def profile_data(data_dir, model_config: dict | None, train_config: dict | None) -> dict:
    """The profile of a data folder, without ``signals`` and ``memory``.

    Parameters
    ----------
    data_dir
        A ``data/{cfg}`` folder: ``rna.h5ad`` and/or ``hic.h5ad``, and ``graph/`` with
        ``nodes.parquet`` and ``edges.parquet``.
    model_config
        The config's ``model`` section (validated through :class:`ModelConfig`).
    train_config
        The config's ``train`` section; only ``batch_size`` is used.

    Returns
    -------
    dict
        ``version``, ``data_dir``, ``inputs`` (per file ``bytes`` and ``sha256_head``,
        see :func:`file_fingerprint`), ``modalities`` (``rna``: prob_model, n_features,
        n_cells, nnz; ``hic``: those plus n_strata, n_anchors, features_per_stratum,
        attention, window, heads, resolution; each with ``sources`` telling which
        values were inferred), ``graph`` (n_nodes, n_edges), ``model`` and ``train``.
        Equal inputs give an equal dict; key order is fixed.

    Raises
    ------
    InputError
        A missing folder or file, an unreadable file, a bad config value, or
        modalities that disagree on the number of cells.
    """
    d = Path(data_dir)
    if not d.is_dir():
        raise InputError("data folder does not exist", path=d)
    model = ModelConfig.from_dict(model_config)
    train = {"batch_size": _batch_size(dict(train_config or {})), "dtype": "float32", "optimizer": "adam"}

    present = {m: name for m, name in MODALITY_FILES.items() if (d / name).exists()}
    if not present:
        raise InputError(f"has neither {' nor '.join(MODALITY_FILES.values())}", path=d)
    inputs = {}
    modalities = {}
    for modality in sorted(present):
        name = present[modality]
        meta = read_h5ad_meta(d / name, modality=modality)
        inputs[name] = file_fingerprint(d / name)
        entry = {
            "prob_model": meta["prob_model"],
            "n_features": meta["n_vars"],
            "n_cells": meta["n_obs"],
            "nnz": meta["nnz"],
            "x_encoding": meta["x_encoding"],
        }
        if modality == "hic":
            entry.update(
                n_strata=meta["n_strata"],
                n_anchors=meta["n_anchors"],
                features_per_stratum=meta["features_per_stratum"],
                attention=model.attention,
                window=model.window,
                heads=model.heads,
                resolution=meta["resolution"],
            )
        entry["sources"] = meta["sources"]
        modalities[modality] = dict(sorted(entry.items()))
    cells = {m: v["n_cells"] for m, v in modalities.items()}
    if len(set(cells.values())) > 1:
        raise InputError("modalities must hold the same cells (paired data)", path=d, key="n_cells", value=cells)

    graph = {}
    for role, name in GRAPH_FILES.items():
        graph[f"n_{role}"] = _parquet_rows(d / name)
        inputs[name] = file_fingerprint(d / name)
    if (d / GRAPH_META).is_file():
        inputs[GRAPH_META] = file_fingerprint(d / GRAPH_META)

    return {
        "version": PROFILE_VERSION,
        "data_dir": str(d),
        "inputs": dict(sorted(inputs.items())),
        "modalities": modalities,
        "graph": dict(sorted(graph.items())),
        "model": dict(sorted(model.to_dict().items())),
        "train": train,
    }


def canonical_json(profile: dict) -> str:
    """The profile as compact JSON with sorted keys: the form that is hashed."""
    return json.dumps(profile, sort_keys=True, separators=(",", ":"))


def profile_hash(profile: dict) -> str:
    """SHA-256 (hex) of :func:`canonical_json`; equal profiles give equal hashes."""
    return hashlib.sha256(canonical_json(profile).encode()).hexdigest()


def _optional(module: str, name: str):
    """``ampflow.amp.<module>.<name>``, or None when that module or name does not exist.

    Only the absence of the module itself (or of the name in it) is tolerated, so the
    profile works before those parts exist; an ImportError raised *inside* an existing
    module (say, a missing dependency) is a real failure and propagates.
    """
    import importlib

    full = f"{__package__}.{module}"
    try:
        return getattr(importlib.import_module(full), name)
    except ImportError as e:
        if e.name != full:
            raise
    except AttributeError:
        pass
    log.warning("%s.%s is not available; the profile has no '%s'", full, name, "signals" if module == "signals" else "memory")
    return None


def main_profile(data_dir, model_config: dict | None, train_config: dict | None, out_path) -> dict:
    """Profile ``data_dir``, add signals and the memory model, write ``out_path``.

    ``signals`` (from :func:`ampflow.amp.signals.evaluate_signals`) and ``memory``
    (from :func:`ampflow.amp.memory_model.profile_memory`) are added when those
    modules can be imported; without them the profile is still complete otherwise.
    The JSON (indent 2, sorted keys) appears under ``out_path`` only when complete.

    Returns
    -------
    dict
        The profile as written.
    """
    profile = profile_data(data_dir, model_config, train_config)
    evaluate_signals = _optional("signals", "evaluate_signals")
    if evaluate_signals is not None:
        profile["signals"] = evaluate_signals(profile)
    profile_memory = _optional("memory_model", "profile_memory")
    if profile_memory is not None:
        profile["memory"] = profile_memory(profile)
    write_text_atomic(out_path, json.dumps(profile, indent=2, sort_keys=True) + "\n")
    log.info("profile: %s (sha256 %s)", out_path, profile_hash(profile)[:12])
    return profile
