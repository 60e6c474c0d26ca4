"""A content-addressed store of computed vectors, safe to share between jobs.

A vector is found by (sequence key, model fingerprint, layer, pooling, dtype): the model
and the dtype name a folder (``{root}/{digest}/``, its ``ident.json`` says what it
holds), the sequence key (``chunks.item_key``) a row, the layer and pooling a product
(``L{layer}.{pooling}``; ``L{layer}.tokens`` for per-token vectors). So a record
prepended to a file, a reordered file, or a second sample sharing proteins with the
first costs only the sequences never computed before.

The folder holds shards, one per computed chunk, never changed after they appear::

    shards/{name}.npz    keys (n,), one array per product; per-token products as the
                         concatenated tokens plus "{product}.offsets" (n + 1)
    shards/{name}.done   marker, written after the .npz: checksum, size, count,
                         products, worker, seconds, tokens, batches split after OOM

A shard's name is its chunk's content hash plus a random suffix, and both files appear
through a temporary name and a rename: concurrent jobs (two workflows, two models'
jobs sharing a root) never write the same file, and a reader sees a shard whole or not
at all. A key computed twice by racing jobs is harmless: the index takes the shard whose
name sorts first, so every reader picks the same rows.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ..base.atomic import atomic_path, write_text_atomic
from .markers import sha256_file

log = logging.getLogger(__name__)

CACHE_VERSION = 1


def ident_digest(ident: dict) -> str:
    return hashlib.sha256(json.dumps({"version": CACHE_VERSION, **ident}, sort_keys=True).encode()).hexdigest()[:24]


class VectorCache:
    """The shards of one model in one dtype under ``root``.

    Parameters
    ----------
    root
        The cache root (``extract.cache``).
    ident
        What makes vectors differ besides the sequence, layer and pooling: the model's
        kind and fingerprint, the compute dtype.
    """

    def __init__(self, root, ident: dict):
        self.ident = ident
        self.dir = Path(root) / ident_digest(ident)
        self.shard_dir = self.dir / "shards"
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "ident.json"
        if not path.exists():
            write_text_atomic(path, json.dumps({"version": CACHE_VERSION, **ident}, indent=1, sort_keys=True) + "\n")

    # ---------------------------------------------------------------- reading
    def markers(self) -> list[dict]:
        """The markers of every complete shard, by name; a shard whose .npz is missing or
        of another size than its marker says is left out (and computed again)."""
        out = []
        for p in sorted(self.shard_dir.glob("*.done")):
            if p.name.startswith("."):
                # a marker's temporary (pathlib's glob matches hidden names): its writer was
                # killed before the rename, or is renaming it now; not a finished shard
                continue
            try:
                m = json.loads(p.read_text())
                size = (self.shard_dir / m["output"]).stat().st_size
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("%s: unreadable marker or missing shard; its sequences are computed again", p)
                continue
            if size != m.get("output_bytes"):
                log.warning("%s: shard size differs from its marker; its sequences are computed again", p)
                continue
            out.append(m)
        return out

    def index(self, products: list[str], markers: list[dict] | None = None) -> dict[str, tuple[str, int]]:
        """key -> (shard name, row) for every key some shard holds all ``products`` of
        (from ``markers``, or the markers on disk now)."""
        idx: dict[str, tuple[str, int]] = {}
        for m in self.markers() if markers is None else markers:
            if set(products) <= set(m["products"]):
                for row, k in enumerate(m["keys"]):
                    idx.setdefault(k, (m["shard"], row))
        return idx

    def remove_stale_temps(self, max_age: float = 3600.0) -> int:
        """Remove temporaries of shards left by killed writers; the number removed.

        Only those older than ``max_age`` seconds: the cache may be shared, and another
        job, perhaps on another host, may be writing one now (a shard takes seconds).
        """
        now, gone = time.time(), 0
        for p in self.shard_dir.glob(".tmp-*"):
            try:
                if now - p.stat().st_mtime > max_age:
                    p.unlink()
                    gone += 1
            except FileNotFoundError:
                pass  # its writer finished or another job removed it
        return gone

    def reader(self, max_bytes: int = 1 << 29) -> ShardReader:
        return ShardReader(self.shard_dir, max_bytes)

    # ---------------------------------------------------------------- writing
    def write(self, chunk_sha256: str, keys: list[str], arrays: dict, **meta) -> dict:
        """Store one computed chunk: ``arrays`` maps products to ``(n, dim)`` arrays, or
        for per-token products to lists of ``(tokens, dim)`` arrays. The marker."""
        name = f"{chunk_sha256[:16]}-{uuid.uuid4().hex[:8]}"
        payload = {"keys": np.array(keys, dtype=f"S{max((len(k) for k in keys), default=1)}")}
        for product, v in arrays.items():
            if isinstance(v, list):
                lengths = [len(a) for a in v]
                payload[product] = np.concatenate(v).astype(np.float32) if v else np.zeros((0, 0), np.float32)
                payload[f"{product}.offsets"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            else:
                payload[product] = np.ascontiguousarray(v, dtype=np.float32)
        buf = io.BytesIO()
        np.savez(buf, **payload)
        data = buf.getvalue()
        out = self.shard_dir / f"{name}.npz"
        with atomic_path(out) as tmp:
            tmp.write_bytes(data)
        marker = {
            "shard": name,
            "output": out.name,
            "output_sha256": hashlib.sha256(data).hexdigest(),
            "output_bytes": len(data),
            "n_sequences": len(keys),
            "products": sorted(arrays),
            "keys": list(keys),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "finished": round(time.time(), 3),
            **meta,
        }
        write_text_atomic(self.shard_dir / f"{name}.done", json.dumps(marker, sort_keys=True) + "\n")
        return marker


class ShardReader:
    """Rows of shards, each shard read and checked against its marker once, the most
    recently used ones kept up to ``max_bytes``."""

    def __init__(self, shard_dir: Path, max_bytes: int):
        self.shard_dir = shard_dir
        self.max_bytes = max_bytes
        self._open: OrderedDict[str, tuple[dict, int]] = OrderedDict()
        self._bytes = 0

    def arrays(self, shard: str) -> dict:
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard][0]
        marker = json.loads((self.shard_dir / f"{shard}.done").read_text())
        path = self.shard_dir / marker["output"]
        if sha256_file(path) != marker["output_sha256"]:
            # a damaged shard: drop it so that the next run computes its sequences again
            (self.shard_dir / f"{shard}.done").unlink(missing_ok=True)
            raise RuntimeError(f"{path}: changed after its marker was written; removed, run the extraction again")
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        size = sum(a.nbytes for a in arrays.values())
        self._open[shard] = (arrays, size)
        self._bytes += size
        while self._bytes > self.max_bytes and len(self._open) > 1:
            _, (_, old) = self._open.popitem(last=False)
            self._bytes -= old
        return arrays
