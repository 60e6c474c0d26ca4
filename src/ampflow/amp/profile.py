"""Profile a data folder from metadata alone: shapes, strata, graph sizes, configs.

The profile is the first step of AMP (profile -> diagnose -> execute). The AnnData files
are read by :func:`~ampflow.io.h5ad_meta.read_h5ad_meta` (attributes and dataset shapes, never the
count matrix) and the graph tables by their parquet footers, so its cost does not grow
with the number of contacts. The ``model`` and ``train`` sections are validated by the
same dataclasses the trainer uses (:mod:`ampflow.contract.config`); the profile keeps what the
memory model needs of ``train``: batch size, dtype, optimizer and whether any stage trains
the cross-reconstruction term.

The result is a plain, JSON-serialisable dict. ``signals`` and ``memory`` are added by
:func:`main_profile` from :mod:`ampflow.amp.decide.signals` and :mod:`ampflow.amp.memory.predict`
when those modules are importable.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from ..base.errors import InputError
from ..contract.config import ModelConfig, TrainConfig, batch_names
from ..contract.layout import GRAPH_FILES, GRAPH_META, MODALITY_FILES
from ..contract.profile import PROFILE_VERSION, ProfileTrain, profile_hash, write_profile
from ..io.h5ad_meta import read_h5ad_meta

log = logging.getLogger(__name__)

#: Bytes hashed at the start of each input for its fingerprint.
HEAD_BYTES = 1 << 20


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
    import pyarrow as pa

    try:
        return int(pq.ParquetFile(path).metadata.num_rows)
    except (pa.ArrowException, OSError, ValueError) as e:  # ArrowInvalid is a ValueError; codec errors are neither
        raise InputError(f"cannot be read as parquet ({e})", path=path) from None


def batch_count(path: Path, key: str | None) -> int:
    """The batches a model trained on ``path`` is conditioned on: the distinct values
    of its ``obs[key]`` when there are two or more (the trainer's rule,
    :meth:`ampflow.train.data.PairedData.use_batches`), else 0. Reads that one column."""
    import h5py
    from anndata.io import read_elem

    if key is None:
        return 0
    try:
        with h5py.File(path, "r") as f:
            obs = f.get("obs")
            if obs is None or key not in obs:
                return 0
            values = read_elem(obs[key])
    except OSError as e:
        raise InputError(f"cannot read obs/{key}: {e}", path=path) from None
    return len(batch_names(values))


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
        The config's ``train`` section (validated through :class:`TrainConfig`); the
        profile keeps a :class:`~ampflow.contract.profile.ProfileTrain` of it.

    Returns
    -------
    dict
        ``version``, ``data_dir``, ``inputs`` (per file ``bytes`` and ``sha256_head``,
        see :func:`file_fingerprint`), ``modalities`` (``rna``: prob_model, n_features,
        n_cells, nnz; ``hic``: those plus n_strata, n_anchors, features_per_stratum,
        attention, window, heads, resolution; each with ``sources`` telling which
        values were inferred), ``graph`` (n_nodes, n_edges), ``batches`` (``key``, the
        model's ``batch_key``, and ``n_batches``, the batches its decoders will be
        conditioned on: 0 for none), ``model`` and ``train``.
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
    train = ProfileTrain.from_config(TrainConfig.from_dict(train_config)).to_dict()

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

    first = d / present[sorted(present)[0]]
    return {
        "version": PROFILE_VERSION,
        "data_dir": str(d),
        "inputs": dict(sorted(inputs.items())),
        "modalities": modalities,
        "graph": dict(sorted(graph.items())),
        "batches": {"key": model.batch_key, "n_batches": batch_count(first, model.batch_key)},
        "model": dict(sorted(model.to_dict().items())),
        "train": train,
    }


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
    log.warning("%s.%s is not available; the profile has no '%s'", full, name, "signals" if module.endswith("signals") else "memory")
    return None


def main_profile(data_dir, model_config: dict | None, train_config: dict | None, out_path) -> dict:
    """Profile ``data_dir``, add signals and the memory model, write ``out_path``.

    ``signals`` (from :func:`ampflow.amp.decide.signals.evaluate_signals`) and ``memory``
    (from :func:`ampflow.amp.memory.predict.profile_memory`) are added when those
    modules can be imported; without them the profile is still complete otherwise.
    The JSON (indent 2, sorted keys) appears under ``out_path`` only when complete.

    Returns
    -------
    dict
        The profile as written.
    """
    profile = profile_data(data_dir, model_config, train_config)
    evaluate_signals = _optional("decide.signals", "evaluate_signals")
    if evaluate_signals is not None:
        profile["signals"] = evaluate_signals(profile)
    profile_memory = _optional("memory.predict", "profile_memory")
    if profile_memory is not None:
        profile["memory"] = profile_memory(profile)
    write_profile(out_path, profile)
    log.info("profile: %s (sha256 %s)", out_path, profile_hash(profile)[:12])
    return profile
