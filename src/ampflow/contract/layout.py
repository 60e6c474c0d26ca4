"""The data folder of one configuration (``data/{cfg}``) and the Hi-C feature naming rule.

Written by the prepare rules, read by the profile, the trainer and ``embed``: the file
names, the probability model each modality's file implies, and the rule that names a
feature ``chrom:start-end`` (stratum 0) or ``chrom:start-end-k`` (stratum k), so that a
reader can infer strata from names alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..base.errors import InputError

#: Files of a data folder, by role. Paths are relative to the folder.
MODALITY_FILES = {"rna": "rna.h5ad", "hic": "hic.h5ad"}
#: The graph folder and its files (names inside the folder): the writer
#: (:func:`ampflow.prepare.graph.write_graph`) and every reader take them from here.
GRAPH_DIR = "graph"
GRAPH_NAMES = {"nodes": "nodes.parquet", "edges": "edges.parquet", "meta": "graph.json"}
GRAPH_FILES = {k: f"{GRAPH_DIR}/{GRAPH_NAMES[k]}" for k in ("nodes", "edges")}
GRAPH_META = f"{GRAPH_DIR}/{GRAPH_NAMES['meta']}"

#: Probability model assumed when a file does not record one.
DEFAULT_PROB_MODEL = {"hic": "HiCZINB", "rna": "NB"}

#: ``obs`` column of the data files (and ``embeddings.h5ad``) that says which cells are
#: held out of fitting; a file without it holds out none.
SPLIT_COLUMN = "split"
TRAIN, HELDOUT = "train", "heldout"
SPLIT_VALUES = (TRAIN, HELDOUT)


@dataclass(frozen=True)
class DataFolder:
    """The files of one configuration's data folder."""

    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    @property
    def rna(self) -> Path:
        return self.root / MODALITY_FILES["rna"]

    @property
    def hic(self) -> Path:
        return self.root / MODALITY_FILES["hic"]

    def modality(self, name: str) -> Path:
        return self.root / MODALITY_FILES[name]

    @property
    def nodes(self) -> Path:
        return self.root / GRAPH_FILES["nodes"]

    @property
    def edges(self) -> Path:
        return self.root / GRAPH_FILES["edges"]

    @property
    def graph(self) -> Path:
        """The graph folder (nodes, edges, graph.json)."""
        return self.nodes.parent

    @property
    def has_rna(self) -> bool:
        """Whether the folder holds ``rna.h5ad``; without it the folder is Hi-C only
        (a dataset without an RNA matrix) and trains the Hi-C branch alone."""
        return self.rna.exists()

    @property
    def model_inputs(self) -> tuple[Path, ...]:
        """What training reads (``rna.h5ad`` only where the folder has RNA)."""
        return ((self.rna,) if self.has_rna else ()) + (self.hic, self.nodes, self.edges)


def training_rows(obs, path=None) -> np.ndarray:
    """Row indices of the cells that are fitted on: those not marked held out in
    ``obs[SPLIT_COLUMN]``; every row when the column is absent.

    Raises InputError for a split value other than ``train`` or ``heldout``.
    """
    if SPLIT_COLUMN not in obs.columns:
        return np.arange(len(obs))
    split = np.asarray(obs[SPLIT_COLUMN]).astype(str)
    bad = sorted(set(split) - set(SPLIT_VALUES))
    if bad:
        raise InputError(f"split must be one of {', '.join(SPLIT_VALUES)}", path=path, key=f"obs.{SPLIT_COLUMN}", value=bad[:5])
    return np.flatnonzero(split == TRAIN)


# ------------------------------------------------------------------ feature names
def feature_name(chrom: str, start: int, end: int, stratum: int) -> str:
    """``chr1:0-500000`` for stratum 0, ``chr1:0-500000-3`` for stratum 3."""
    return f"{chrom}:{start}-{end}" if stratum == 0 else f"{chrom}:{start}-{end}-{stratum}"


def feature_names(var) -> list[str]:
    """Names of the features of a ``var`` table with ``chrom, start, end, stratum``."""
    return [feature_name(c, s, e, k) for c, s, e, k in zip(var["chrom"], var["start"], var["end"], var["stratum"])]


NP_STRINGS = hasattr(np, "strings") and all(hasattr(np.strings, f) for f in ("partition", "rpartition", "isdigit", "str_len"))


def strata_from_names(names: np.ndarray, path, key: str) -> tuple[np.ndarray, int | None]:
    """Stratum per feature, and the largest bin width, from names ``chrom:start-end[-k]``.

    The part after the last ``:`` has 2 ``-``-separated fields for stratum 0 and 3 for
    stratum k (the last field). Splitting on the last ``:`` keeps chromosome names that
    contain ``:`` or ``-`` working.
    """
    names = np.asarray(names)
    if NP_STRINGS and len(names):
        try:
            fixed = names.astype("S" if isinstance(names.flat[0], bytes) else "U") if names.dtype == object else names
        except (UnicodeError, TypeError, ValueError):
            fixed = None
        if fixed is not None and fixed.dtype.kind in "SU":
            return strata_from_names_vectorised(fixed, path, key)
    return strata_from_names_loop(names, path, key)


def _bad_name(path, key: str, name) -> InputError:
    if isinstance(name, bytes):
        name = name.decode(errors="replace")
    return InputError(
        "feature name is not chrom:start-end or chrom:start-end-stratum, so strata cannot be inferred",
        path=path,
        key=key,
        value=str(name),
    )


def strata_from_names_vectorised(names: np.ndarray, path, key: str) -> tuple[np.ndarray, int | None]:
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
    return strata, max_width(start[sel].astype(np.int64), end[sel].astype(np.int64))


def max_width(start: np.ndarray, end: np.ndarray) -> int | None:
    """The largest ``end - start``: the resolution, since only a chromosome's last bin is shorter."""
    return int((end - start).max()) if len(start) else None


def strata_from_names_loop(names: np.ndarray, path, key: str) -> tuple[np.ndarray, int | None]:
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
