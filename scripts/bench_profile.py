#!/usr/bin/env python
"""Benchmark ``ampflow.amp.profile.profile_data``: its cost must not grow with contacts.

Builds, in a scratch folder, two data folders that differ only in the number of
non-zeros of the strata file (``--nnz`` and ``--factor`` times that), each with:

- ``hic.h5ad``: ``--cells`` cells x (``--anchors`` anchors x ``--strata`` strata)
  features, laid out exactly as ``prepare/strata.py`` writes it (``var`` columns
  chrom/start/end/anchor/stratum, names ``chr1:0-25000[-k]``, ``uns["ampflow"]``, the
  counts both in ``X`` and ``layers["counts"]``), written with anndata directly rather
  than through the pipeline; the CSR matrix has the requested number of non-zeros,
  spread evenly over cells and at random over features;
- ``rna.h5ad``: the same cells x ``--genes`` genes;
- ``graph/``: nodes (genes + anchors) and edges parquet tables.

For each folder it prints the file sizes and the seconds of ``profile_data``:

- cold: in a fresh interpreter after asking the OS to drop the inputs from the page
  cache (``posix_fadvise(DONTNEED)``), import time reported separately (one discarded
  run first, so that the libraries' own files are cached and only the inputs are not);
- warm: best of ``--repeats`` calls after one warm-up call in this process;

then the ratio large / small (goal: every call < 1 s and the ratio within 1 +- 0.3).
Finally the same with ``uns["ampflow"]`` deleted (strata inferred from ``var``) and
with ``var["stratum"]``/``var["anchor"]`` deleted too (strata inferred from names);
those reads grow with the number of features, never with non-zeros.

Writing the large folder dominates the run time (about 1.6 GB for 1e8 non-zeros).

Examples::

    python scripts/bench_profile.py
    python scripts/bench_profile.py --nnz 2e7 --factor 10 --repeats 9
    python scripts/bench_profile.py --cells 1000 --anchors 10000 --nnz 1e6 --keep
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TIME_GOAL = 1.0  # seconds per profile_data call
RATIO_GOAL = 0.30  # |t(large) / t(small) - 1|
RESOLUTION = 25_000
N_CHROMS = 20


# ------------------------------------------------------------------ data
def hic_var(n_anchors: int, n_strata: int):
    """Features of ``n_anchors`` bins on ``N_CHROMS`` equal chromosomes, via the pipeline's own code."""
    import pandas as pd

    from ampflow.contract.layout import feature_names
    from ampflow.prepare.strata import candidate_index

    per = -(-n_anchors // N_CHROMS)
    rows = []
    left = n_anchors
    for c in range(N_CHROMS):
        n = min(per, left)
        left -= n
        starts = np.arange(n, dtype=np.int64) * RESOLUTION
        rows.append(pd.DataFrame({"chrom": f"chr{c + 1}", "start": starts, "end": starts + RESOLUTION}))
    bins = pd.concat(rows, ignore_index=True)
    chroms = [f"chr{c + 1}" for c in range(N_CHROMS)]
    _, var = candidate_index(bins, chroms, n_strata)
    var.index = pd.Index(feature_names(var), name="feature")
    return var, chroms


def strided_csr(n_rows: int, n_cols: int, nnz: int, seed: int):
    """A CSR with ``nnz // n_rows`` sorted, distinct random columns per row.

    Row r gets one column in each of k equal slices of the columns, drawn uniformly
    within its slice: sorted and distinct by construction, no per-row sampling loop.
    """
    import scipy.sparse as sp

    rng = np.random.default_rng(seed)
    k = max(1, min(nnz // n_rows, n_cols))
    step = n_cols // k
    cols = np.arange(k, dtype=np.int32) * np.int32(step)
    indices = (rng.integers(0, step, size=(n_rows, k), dtype=np.int32) + cols).ravel()
    data = rng.integers(1, 5, size=n_rows * k, dtype=np.int8).astype(np.float32)
    indptr = np.arange(n_rows + 1, dtype=np.int64) * k
    if indptr[-1] < np.iinfo(np.int32).max:
        indptr = indptr.astype(np.int32)
    return sp.csr_matrix((data, indices, indptr), shape=(n_rows, n_cols))


def write_hic(path: Path, var, chroms, n_cells: int, nnz: int, n_strata: int, layer: bool) -> int:
    import anndata as ad
    import pandas as pd

    X = strided_csr(n_cells, len(var), nnz, seed=nnz % 1000)
    fps = np.bincount(var["stratum"].to_numpy(), minlength=n_strata)
    a = ad.AnnData(X=X, obs=pd.DataFrame(index=pd.Index([f"cell{i}" for i in range(n_cells)], name="cell_id")), var=var)
    if layer:
        a.layers["counts"] = X  # the pipeline stores the counts twice; same bytes on disk
    a.uns["ampflow"] = {
        "modality": "hic",
        "prob_model": "HiCZINB",
        "resolution": RESOLUTION,
        "n_strata": n_strata,
        "n_anchors": int(fps[0]),
        "features_per_stratum": fps.astype(np.int64),
        "chromosomes": chroms,
        "min_cells": 1,
        "min_count": 1,
        "counts_layer": "counts",
    }
    a.write_h5ad(path)
    return int(X.nnz)


def write_rna(path: Path, n_cells: int, n_genes: int) -> None:
    import anndata as ad
    import pandas as pd

    X = strided_csr(n_cells, n_genes, n_cells * n_genes // 10, seed=1)
    a = ad.AnnData(
        X=X,
        obs=pd.DataFrame(index=pd.Index([f"cell{i}" for i in range(n_cells)], name="cell_id")),
        var=pd.DataFrame(index=[f"gene{i}" for i in range(n_genes)]),
    )
    a.layers["counts"] = X
    hvg = {"flavor": "seurat", "n_top_genes": n_genes, "n_selected": n_genes}
    a.uns["ampflow"] = {"modality": "rna", "prob_model": "NB", "counts_layer": "counts", "hvg": hvg}
    a.write_h5ad(path)


def write_graph(folder: Path, n_genes: int, n_anchors: int) -> None:
    import pandas as pd

    folder.mkdir(parents=True, exist_ok=True)
    n = n_genes + n_anchors
    rng = np.random.default_rng(2)
    kind = ["gene"] * n_genes + ["anchor"] * n_anchors
    nodes = pd.DataFrame({"node_id": np.arange(n), "name": [f"n{i}" for i in range(n)], "kind": kind})
    gb_src = np.arange(n_genes)
    gb_dst = n_genes + rng.integers(0, n_anchors, n_genes)
    bb_src = n_genes + rng.integers(0, n_anchors, 4 * n_anchors)
    bb_dst = np.minimum(bb_src + rng.integers(1, 10, len(bb_src)), n - 1)
    src = np.concatenate([gb_src, gb_dst, bb_src, bb_dst, np.arange(n)])
    dst = np.concatenate([gb_dst, gb_src, bb_dst, bb_src, np.arange(n)])
    edges = pd.DataFrame({"source": src, "target": dst, "weight": np.float32(1), "sign": np.int8(1)})
    nodes.to_parquet(folder / "nodes.parquet", index=False)
    edges.to_parquet(folder / "edges.parquet", index=False)


# ------------------------------------------------------------------ timing
def input_files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


def drop_cache(d: Path) -> bool:
    """Ask the OS to forget the cached pages of every input; False where unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in input_files(d):
        with open(p, "rb") as fh:
            os.fsync(fh.fileno())
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return True


COLD = """
import time, sys
t0 = time.perf_counter()
from ampflow.amp.profile import profile_data
t1 = time.perf_counter()
profile_data(sys.argv[1], {}, {})
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def cold_call(d: Path) -> tuple[float, float, bool]:
    """(import seconds, first-call seconds, cache dropped) in a fresh interpreter."""
    dropped = drop_cache(d)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", COLD, str(d)], capture_output=True, text=True, env=env, check=True)
    imp, call = map(float, out.stdout.split())
    return imp, call, dropped


def warm_best(d: Path, repeats: int) -> tuple[float, dict]:
    from ampflow.amp.profile import profile_data

    p = profile_data(d, {}, {})  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        profile_data(d, {}, {})
        best = min(best, time.perf_counter() - t)
    return best, p


def mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


# ------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", type=int, default=10_000)
    ap.add_argument("--anchors", type=int, default=100_000)
    ap.add_argument("--strata", type=int, default=10)
    ap.add_argument("--genes", type=int, default=2_000)
    ap.add_argument("--nnz", type=float, default=1e7, help="non-zeros of the small strata file")
    ap.add_argument("--factor", type=int, default=10, help="the large file has this many times more")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-layer", action="store_true", help="omit layers['counts'] (halves the files)")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a new temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    a = ap.parse_args(argv)

    sys.path.insert(0, str(REPO / "src"))
    # the inference runs warn once per call that prob_model was assumed; keep the table readable
    logging.getLogger("ampflow").setLevel(logging.ERROR)
    work = Path(tempfile.mkdtemp(prefix="bench-profile-", dir=a.workdir))
    try:
        t = time.perf_counter()
        var, chroms = hic_var(a.anchors, a.strata)
        shared = work / "shared"
        shared.mkdir()
        write_rna(shared / "rna.h5ad", a.cells, a.genes)
        write_graph(shared / "graph", a.genes, a.anchors)
        print(f"features: {len(var):,} ({a.anchors:,} anchors x {a.strata} strata, cis only); cells: {a.cells:,}")
        folders = {}
        for label, nnz in (("small", int(a.nnz)), ("large", int(a.nnz) * a.factor)):
            d = work / label
            d.mkdir()
            t1 = time.perf_counter()
            real = write_hic(d / "hic.h5ad", var, chroms, a.cells, nnz, a.strata, not a.no_layer)
            shutil.copy(shared / "rna.h5ad", d / "rna.h5ad")
            shutil.copytree(shared / "graph", d / "graph")
            folders[label] = (d, real)
            print(f"wrote {label}: nnz {real:,}, hic.h5ad {mb((d / 'hic.h5ad').stat().st_size)} in {time.perf_counter() - t1:.1f} s")
        del var
        print(
            f"setup {time.perf_counter() - t:.1f} s; rna.h5ad {mb((shared / 'rna.h5ad').stat().st_size)}, "
            f"graph {mb(sum(p.stat().st_size for p in input_files(shared / 'graph')))}\n"
        )

        # one discarded run loads the interpreter's and libraries' own files into the page
        # cache, so that "cold" below measures the inputs not being cached, not the code
        cold_call(folders["small"][0])
        results = {}
        for mode in ("uns", "var", "names"):
            if mode == "var":
                print("\n-- uns['ampflow'] deleted: strata inferred from var['stratum'] / var['anchor']")
            elif mode == "names":
                print("\n-- var['stratum'] and var['anchor'] deleted too: strata inferred from feature names")
            for label, (d, real) in folders.items():
                if mode != "uns":
                    import h5py

                    with h5py.File(d / "hic.h5ad", "r+") as f:
                        for key in {"var": ["uns/ampflow"], "names": ["var/stratum", "var/anchor"]}[mode]:
                            if key in f:
                                del f[key]
                imp, cold, dropped = cold_call(d)
                warm, p = warm_best(d, a.repeats)
                hic = p["modalities"]["hic"]
                # the profile must report what was written, whichever way it found it
                assert hic["nnz"] == real and sum(hic["features_per_stratum"]) == hic["n_features"], hic
                results[(mode, label)] = (cold, warm)
                print(
                    f"{mode:5s} {label:5s} nnz {real:>13,}  hic.h5ad {mb((d / 'hic.h5ad').stat().st_size):>12}  "
                    f"cold {cold:.4f} s (+ import {imp:.2f} s{'' if dropped else ', cache not dropped'})  "
                    f"warm best of {a.repeats} {warm:.4f} s  strata from {hic['sources']['strata']}"
                )
            cs, ws = results[(mode, "small")]
            cl, wl = results[(mode, "large")]
            r_cold, r_warm = cl / cs, wl / ws
            ok_time = max(cs, ws, cl, wl) < TIME_GOAL
            ok_ratio = abs(r_warm - 1) < RATIO_GOAL
            print(
                f"{mode:5s} ratio large/small ({a.factor}x non-zeros): warm {r_warm:.3f}, cold {r_cold:.3f}  "
                f"[each < {TIME_GOAL:g} s: {verdict(ok_time)}; warm ratio within 1 +- {RATIO_GOAL:g}: {verdict(ok_ratio)}]"
            )
    finally:
        if a.keep:
            print(f"\nkept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
