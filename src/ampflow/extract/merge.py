"""One input's outputs from the vector cache, a block of records in memory at a time.

``{name}.{model}.h5ad``: obs = records in input order (``length`` = letters embedded,
``original_length``, ``truncated``, ``windows``, the FASTA ``record`` number and header
``line``); X = the first product (first layer, first pooling), float32; ``obsm`` = every
product by name (``L{layer}.{pooling}``, X's included, so a name always finds its
vectors); var: ``dim_0`` ...; ``uns["extract"]``: model id, layers, poolings, dtype,
truncations, windows, the FASTA summary. A record embedded in several windows gets the
mean of its windows' vectors weighted by their letters (mean pooling over the record's
tokens, as far as the windows allow).

``{name}.{model}.windows.h5ad`` (``too_long: window``): obs = every window
(``{id}:{start}-{end}``, 0-based, end exclusive; ``parent``, ``start``, ``end``), the same
X and ``obsm``.

``{name}.{model}.tokens.h5`` (``per_token``): ``ids`` (one per item: the record's id or
its window's), ``offsets`` (items + 1) and one ``(tokens, dim)`` float32 dataset per layer,
``L{layer}``: item i's own tokens (no special ones) are rows ``offsets[i]:offsets[i+1]``.

The obs/var/uns part is written by anndata, then X and ``obsm`` are added to the same
file block by block as plain dense arrays (anndata's own on-disk encoding), so millions
of sequences never need the whole matrix in memory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..base.atomic import atomic_path
from .cache import ShardReader

BLOCK = 8192  # records per block


def read_records(folder) -> pd.DataFrame:
    """``records.tsv`` with ids as text (an id such as ``NA`` stays ``NA``)."""
    return pd.read_csv(Path(folder) / "records.tsv", sep="\t", dtype={"id": str}, keep_default_na=False, na_filter=False)


def read_items(folder) -> pd.DataFrame:
    return pd.read_csv(Path(folder) / "items.tsv", sep="\t", dtype={"key": str}, keep_default_na=False, na_filter=False)


def _dense(f, name: str, n: int, dim: int):
    d = f.create_dataset(name, shape=(n, dim), dtype="float32")
    d.attrs["encoding-type"] = "array"
    d.attrs["encoding-version"] = "0.2.0"
    return d


def _gather(reader: ShardReader, where: list[tuple[str, int]], product: str, dim: int) -> np.ndarray:
    """Rows of ``product`` at ``(shard, row)`` places, in that order."""
    out = np.empty((len(where), dim), dtype=np.float32)
    by_shard: dict[str, list[tuple[int, int]]] = {}
    for i, (shard, row) in enumerate(where):
        by_shard.setdefault(shard, []).append((i, row))
    for shard, pairs in by_shard.items():
        a = reader.arrays(shard)[product]
        idx = np.array(pairs)
        out[idx[:, 0]] = a[idx[:, 1]]
    return out


def _write_matrices(f, n: int, dim: int, products: list[str], blocks) -> None:
    """X (the first product) and obsm/{product} for every product, from ``blocks``
    yielding (start, {product: rows})."""
    X = _dense(f, "X", n, dim)
    group = f.require_group("obsm")
    group.attrs["encoding-type"] = "dict"
    group.attrs["encoding-version"] = "0.1.0"
    ds = {p: _dense(group, p, n, dim) for p in products}
    for start, rows in blocks:
        stop = start + len(rows[products[0]])
        X[start:stop] = rows[products[0]]
        for p in products:
            ds[p][start:stop] = rows[p]


def merge_input(folder, items: pd.DataFrame, index: dict, reader: ShardReader, products: list[str], dim: int, out=None,
                uns: dict | None = None, windows_out=None, tokens_out=None) -> int:  # fmt: skip
    """Write one input's outputs (those given a path) atomically from the cache; the
    number of records.

    ``items`` is the input's ``items.tsv`` (:func:`read_items`); ``index`` maps every item key to its (shard, row) (``VectorCache.index``);
    ``products`` are the pooled products, the first one X; ``tokens_out`` gets the
    ``L{k}.tokens`` products of ``uns["layers"]``.
    """
    import anndata as ad
    import h5py

    folder = Path(folder)
    records = read_records(folder)
    missing = [k for k in items["key"] if k not in index]
    if missing:
        raise RuntimeError(f"{folder}: {len(missing)} sequence(s) not in the cache after the run (first key {missing[0]})")
    where = [index[k] for k in items["key"]]
    obs = pd.DataFrame(
        {
            "length": records["length"].to_numpy(np.int64),
            "original_length": records["original_length"].to_numpy(np.int64),
            "truncated": (records["length"] < records["original_length"]).to_numpy(),
            "windows": records["windows"].to_numpy(np.int64),
            "record": records["record"].to_numpy(np.int64),
            "line": records["line"].to_numpy(np.int64),
        },
        # object, not pandas 3's default string dtype, which anndata writes only on request
        index=pd.Index(records["id"].to_numpy(dtype=object), name="id", dtype=object),
    )
    var = pd.DataFrame(index=pd.Index([f"dim_{i}" for i in range(dim)], name="dim", dtype=object))
    # items of record r are rows first[r]:first[r + 1] of items.tsv
    counts = records["windows"].to_numpy(np.int64)
    first = np.concatenate([[0], np.cumsum(counts)])
    letters = (items["end"] - items["start"]).to_numpy(np.float64)

    def record_blocks():
        for start in range(0, len(records), BLOCK):
            stop = min(start + BLOCK, len(records))
            a, b = first[start], first[stop]
            w = letters[a:b]
            rows = {}
            for p in products:
                v = _gather(reader, where[a:b], p, dim)
                if b - a == stop - start:  # one item per record
                    rows[p] = v
                else:
                    # letter-weighted mean of each record's windows
                    sums = np.add.reduceat(v * w[:, None], first[start:stop] - a, axis=0)
                    rows[p] = (sums / np.add.reduceat(w, first[start:stop] - a)[:, None]).astype(np.float32)
            yield start, rows

    if out is not None:
        with atomic_path(out) as tmp:
            ad.AnnData(obs=obs, var=var, uns={"extract": uns}).write_h5ad(tmp)
            with h5py.File(tmp, "a") as f:
                _write_matrices(f, len(records), dim, products, record_blocks())

    if windows_out is not None:
        ids = records["id"].to_numpy(dtype=object)[items["record"].to_numpy(np.int64)]
        wobs = pd.DataFrame(
            {
                "parent": pd.Series(ids, dtype=object),
                "start": items["start"].to_numpy(np.int64),
                "end": items["end"].to_numpy(np.int64),
            },
        )
        wobs.index = pd.Index([f"{i}:{s}-{e}" for i, s, e in zip(ids, items["start"], items["end"])], name="id", dtype=object)

        def item_blocks():
            for start in range(0, len(items), BLOCK):
                yield start, {p: _gather(reader, where[start : start + BLOCK], p, dim) for p in products}

        with atomic_path(windows_out) as tmp:
            ad.AnnData(obs=wobs, var=var, uns={"extract": uns}).write_h5ad(tmp)
            with h5py.File(tmp, "a") as f:
                _write_matrices(f, len(items), dim, products, item_blocks())

    if tokens_out is not None:
        _write_tokens(tokens_out, records, items, where, reader, uns["layers"], dim)
    return len(records)


def _write_tokens(out, records, items, where, reader: ShardReader, layers: list[int], dim: int) -> None:
    import h5py

    ids = records["id"].to_numpy(dtype=object)[items["record"].to_numpy(np.int64)]
    many = records["windows"].to_numpy(np.int64)[items["record"].to_numpy(np.int64)] > 1
    names = [f"{i}:{s}-{e}" if m else i for i, s, e, m in zip(ids, items["start"], items["end"], many)]
    first = f"L{layers[0]}.tokens"
    sizes = []
    for shard, row in where:
        off = reader.arrays(shard)[f"{first}.offsets"]
        sizes.append(int(off[row + 1] - off[row]))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    with atomic_path(out) as tmp, h5py.File(tmp, "w") as f:
        f.create_dataset("ids", data=np.array(names, dtype=object), dtype=h5py.string_dtype())
        f.create_dataset("offsets", data=offsets)
        for layer in layers:
            product = f"L{layer}.tokens"
            d = f.create_dataset(f"L{layer}", shape=(int(offsets[-1]), dim), dtype="float32", chunks=True)
            for i, (shard, row) in enumerate(where):
                a = reader.arrays(shard)
                off = a[f"{product}.offsets"]
                d[offsets[i] : offsets[i + 1]] = a[product][off[row] : off[row + 1]]
