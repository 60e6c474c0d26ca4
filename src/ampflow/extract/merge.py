"""Merge chunk outputs into ``{name}.{model}.h5ad``, one chunk in memory at a time.

obs: sequence ids in input order (``length`` = letters embedded, ``original_length``,
``truncated``, the FASTA ``record`` number and header ``line``); X: float32 vectors;
var: ``dim_0`` ... ; ``uns["extract"]``: model id, layer, pooling, dtype, truncations and
the FASTA summary. The obs/var/uns part is written by anndata, then X is added to the
same file chunk by chunk as a plain dense array (anndata's own on-disk encoding), so
millions of sequences never need the whole matrix in memory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..io.atomic import atomic_path
from .markers import load_chunk


def read_sequences(work) -> pd.DataFrame:
    """``sequences.tsv`` with ids as text (an id such as ``NA`` stays ``NA``)."""
    return pd.read_csv(Path(work) / "sequences.tsv", sep="\t", dtype={"id": str}, keep_default_na=False, na_filter=False)


def merge_chunks(work, chunks: list[dict], dim: int, out, uns: dict) -> int:
    """Write the merged h5ad atomically; the number of sequences."""
    import anndata as ad
    import h5py

    work = Path(work)
    seqs = read_sequences(work)
    obs = pd.DataFrame(
        {
            "length": seqs["length"].to_numpy(np.int64),
            "original_length": seqs["original_length"].to_numpy(np.int64),
            "truncated": (seqs["length"] < seqs["original_length"]).to_numpy(),
            "record": seqs["record"].to_numpy(np.int64),
            "line": seqs["line"].to_numpy(np.int64),
        },
        index=pd.Index(seqs["id"].to_numpy(dtype=object), name="id"),
    )
    if sum(c["n"] for c in chunks) != len(obs):
        raise RuntimeError(f"{work}: chunks hold {sum(c['n'] for c in chunks)} sequences, sequences.tsv {len(obs)}")
    var = pd.DataFrame(index=pd.Index([f"dim_{i}" for i in range(dim)], name="dim"))
    with atomic_path(out) as tmp:
        ad.AnnData(obs=obs, var=var, uns={"extract": uns}).write_h5ad(tmp)
        with h5py.File(tmp, "a") as f:
            X = f.create_dataset("X", shape=(len(obs), dim), dtype="float32")
            X.attrs["encoding-type"] = "array"
            X.attrs["encoding-version"] = "0.2.0"
            start = 0
            for c in chunks:
                X[start : start + c["n"]] = load_chunk(work / "out", c["name"], c["n"])
                start += c["n"]
    return len(obs)
