"""Embed cells with a trained ``model.pt``, new cells included, without retraining.

Only the two cell encoders are built (the guidance graph and the decoders are not
needed to encode). The input files' columns are mapped onto the trained model's by
name: a trained gene or Hi-C feature the file lacks is a column of zeros, a column the
model does not know is dropped; both are counted and reported. The output
``embeddings.h5ad`` has the trainer's ``obsm`` keys, dtype and ``X_joint`` rule, and
every forward pass has the trainer's row count, so embedding the training data folder's
cells, or any of them (the held-out ones, say), with its model gives the trainer's vectors
bit for bit (on the CPU, in the dtype and thread count it trained with).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import anndata as ad
import numpy as np
import scipy.sparse as sp
import torch
import torch.nn as nn

from ..base.atomic import atomic_path
from ..base.errors import InputError, require_file
from ..contract.config import ModelConfig
from ..contract.layout import DataFolder
from ..model.encoders import Encoder, HiCInput, rna_input
from ..train.data import counts_matrix
from ..train.embeddings import EMBED_ROWS, embeddings_anndata, latent_means

log = logging.getLogger(__name__)

#: Keys of ``model.pt`` that embedding reads besides the weights and the model settings.
NAME_KEYS = ("genes", "features", "n_strata", "feature_stratum")
#: How the Hi-C encoder read its input in the versions before each of these settings
#: existed (every stratum, the diagonal included, through log1p, unprojected): a
#: model.pt without a key embeds as it trained, not with today's default
HIC_INPUT_BEFORE = {"hic_transform": "log1p", "hic_diagonal": True, "hic_max_stratum": None, "hic_max_distance": None, "hic_pcs": 0}


@dataclass(frozen=True)
class ColumnMap:
    """Where each trained column comes from in a given file.

    Attributes
    ----------
    source : (n_kept,) int
        Columns of the given file that the model knows.
    target : (n_kept,) int
        The trained columns they fill, in the same order.
    n_trained, n_given : int
        Columns of the model and of the file.
    """

    source: np.ndarray
    target: np.ndarray
    n_trained: int
    n_given: int

    @property
    def kept(self) -> int:
        return len(self.source)

    @property
    def missing(self) -> int:
        """Trained columns the file lacks (zeros)."""
        return self.n_trained - self.kept

    @property
    def extra(self) -> int:
        """Columns of the file the model does not know (dropped)."""
        return self.n_given - self.kept

    def counts(self) -> dict:
        return {"trained": self.n_trained, "given": self.n_given, "kept": self.kept, "missing": self.missing, "extra": self.extra}

    def dense(self, x: sp.csr_matrix) -> np.ndarray:
        """Rows of the file's counts ``x`` (B, n_given) as (B, n_trained) float32."""
        out = np.zeros((x.shape[0], self.n_trained), dtype=np.float32)
        out[:, self.target] = x[:, self.source].toarray()
        return out


def map_columns(trained, given, path, key: str) -> ColumnMap:
    """Match the given names onto the trained ones.

    Parameters
    ----------
    trained, given : sequence of str
        Column names of the model (in its order) and of the file.
    path, key
        The file and the key named in an error.

    Raises
    ------
    InputError
        The file repeats a name, or shares none with the model.
    """
    given = [str(g) for g in given]
    if len(set(given)) < len(given):
        dup = sorted({g for g in given if given.count(g) > 1})[:5] if len(given) < 10_000 else None
        raise InputError("column names must be unique to be mapped onto the trained model", path=path, key=key, value=dup)
    at = {name: i for i, name in enumerate(given)}
    target = np.array([j for j, name in enumerate(trained) if name in at], dtype=np.int64)
    source = np.array([at[trained[j]] for j in target], dtype=np.int64)
    if len(trained) and not len(target):
        raise InputError(
            f"none of the {len(given)} names is among the model's {len(trained)} (e.g. {trained[0]!r})",
            path=path, key=key, value=given[:3],
        )  # fmt: skip
    return ColumnMap(source, target, len(trained), len(given))


class CellEncoders(nn.Module):
    """The trained model's RNA and Hi-C encoders with their input transforms: what
    :meth:`~ampflow.model.paired.PairedModel.encode` computes, without the graph."""

    def __init__(self, cfg: ModelConfig, n_genes: int, feature_stratum: torch.Tensor, n_strata: int):
        super().__init__()
        self.latent = cfg.latent_dim
        self.hic_input = HiCInput.from_config(cfg, feature_stratum, n_strata)
        self.has_rna = n_genes > 0  # a Hi-C-only model (no genes) has no RNA encoder
        if self.has_rna:
            self.rna_encoder = Encoder(n_genes, cfg.hidden_dim, cfg.latent_dim, cfg.dropout)
        self.hic_encoder = Encoder(len(feature_stratum), cfg.hidden_dim, cfg.latent_dim, cfg.dropout)

    @property
    def names(self) -> tuple[str, ...]:
        return ("hic_input", "rna_encoder", "hic_encoder") if self.has_rna else ("hic_input", "hic_encoder")

    @torch.no_grad()
    def forward(self, rna: torch.Tensor | None, hic: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """rna: (B, G), hic: (B, F) counts -> latent means (B, d) of each encoder (RNA:
        None without an RNA encoder)."""
        h_loc, _ = self.hic_encoder(self.hic_input(hic))
        if not self.has_rna:
            return None, h_loc
        r_loc, _ = self.rna_encoder(rna_input(rna, rna.sum(1)))
        return r_loc, h_loc


@dataclass
class TrainedModel:
    """What embedding needs of a ``model.pt``."""

    encoders: CellEncoders
    genes: list[str]
    features: list[str]
    dtype: torch.dtype
    threads: int
    steps: int
    shared_dim: int


def load_trained(model_path, device: str | torch.device = "cpu") -> TrainedModel:
    """Build the cell encoders of ``model.pt`` (eval mode) and read its column names.

    Raises
    ------
    InputError
        The file is missing or unreadable, predates the column names, or its weights do
        not fit its names.
    """
    path = require_file(model_path, "model file")
    try:
        m = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is bad input here
        raise InputError(f"cannot read the model file: {e}", path=path) from None
    if not isinstance(m, dict):
        raise InputError("not a model.pt written by `ampflow train`", path=path)
    for key in ("state_dict", "model_config", *NAME_KEYS):
        if key not in m:
            raise InputError("the model file lacks this key (train it again with this version to embed with it)", path=path, key=key)
    cfg = ModelConfig.from_dict({**HIC_INPUT_BEFORE, **m["model_config"]})
    train = m.get("train_config", {})
    dtype = getattr(torch, train.get("dtype", "float32"))
    stratum = torch.as_tensor(m["feature_stratum"], dtype=torch.long)
    if len(stratum) != len(m["features"]):
        raise InputError(f"{len(stratum)} feature strata for {len(m['features'])} features", path=path, key="feature_stratum")
    if "hic_input.band_mean" not in m["state_dict"]:
        raise InputError(
            "the model predates the Hi-C input weighed by the training cells' strata, which embedding applies to new cells; "
            "train it again with this version to embed with it", path=path, key="state_dict.hic_input.band_mean",
        )  # fmt: skip
    enc = CellEncoders(cfg, len(m["genes"]), stratum, int(m["n_strata"])).to(device, dtype)
    for name in enc.names:
        prefix = f"{name}."
        sd = {k[len(prefix) :]: v for k, v in m["state_dict"].items() if k.startswith(prefix)}
        try:
            getattr(enc, name).load_state_dict(sd)
        except RuntimeError as e:
            raise InputError(f"weights do not fit the model's genes and features: {e}", path=path, key=f"state_dict.{name}") from None
    enc.eval()
    # the threads it trained with: as it ran (train.threads may say "auto")
    threads = m.get("threads") or train.get("threads", 1)
    threads = threads if isinstance(threads, int) else 1
    return TrainedModel(enc, [str(g) for g in m["genes"]], [str(f) for f in m["features"]], dtype, threads, int(m.get("steps", 0)), cfg.shared_dim)


def _read(path, what: str) -> ad.AnnData:
    path = require_file(path, what)
    try:
        return ad.read_h5ad(path)
    except Exception as e:  # noqa: BLE001 - an unreadable file is bad input
        raise InputError(f"cannot read {what}: {e}", path=path) from None


def paired_rows(rna: ad.AnnData, hic: ad.AnnData, rna_path, hic_path) -> np.ndarray:
    """Rows of ``hic`` in the order of ``rna``'s cells.

    Raises
    ------
    InputError
        A cell is in one file only (cells are never dropped silently), or a file repeats one.
    """
    r, h = [str(c) for c in rna.obs_names], [str(c) for c in hic.obs_names]
    for names, path in ((r, rna_path), (h, hic_path)):
        if len(set(names)) < len(names):
            raise InputError("cell ids must be unique", path=path, key="obs_names")
    at = {c: i for i, c in enumerate(h)}
    only_rna = [c for c in r if c not in at]
    only_hic = sorted(set(h) - set(r))
    if only_rna or only_hic:
        raise InputError(
            f"{len(only_rna)} cell(s) only in {rna_path} and {len(only_hic)} only in {hic_path}; both files must hold the same cells",
            path=hic_path, key="obs_names", value=(only_rna + only_hic)[:5],
        )  # fmt: skip
    return np.array([at[c] for c in r], dtype=np.int64)


def embed_cells(model_path, rna_path, hic_path, out, *, batch_size: int = EMBED_ROWS, device: str = "auto", threads: int | None = None) -> dict:
    """Encode the cells of an ``rna.h5ad`` + ``hic.h5ad`` pair with a trained model.

    A Hi-C-only model (trained without RNA) needs ``hic_path`` alone (``rna_path``
    None; one given is ignored, with a warning): the output has ``X_hic`` and
    ``X_joint`` = ``X_hic``, obs of ``hic_path``, and no ``genes`` in the report.

    Parameters
    ----------
    model_path
        ``model.pt`` from ``ampflow train``.
    rna_path, hic_path
        Data-folder files of any cells (the same cells in both, any order), possibly
        with other genes or features than the model's: counts from
        ``uns["ampflow"]["counts_layer"]`` (default ``counts``) or ``X``.
    out
        ``embeddings.h5ad`` to write (atomically): obs of ``rna_path``; ``obsm`` X_rna,
        X_hic (n_cells, d) and X_joint (the trainer's rule,
        :func:`~ampflow.train.embeddings.joint_latent`), float32.
    batch_size
        Rows of every forward pass (a last batch of fewer cells is padded): the trainer's
        1024 by default; with another count the vectors may differ from training's in
        the last bits.
    device
        ``auto`` (CUDA when there is one), ``cpu`` or ``cuda``.
    threads
        torch CPU threads; default the count the model trained with.

    Returns
    -------
    dict
        ``cells`` and, for ``genes`` and ``features``, the counts trained, given, kept,
        missing (zeros) and extra (dropped); also in ``uns["ampflow"]`` of ``out``.

    Raises
    ------
    InputError
        A file is missing or unreadable, the model lacks its column names, the files
        hold different cells, or a file shares no column with the model.
    """
    if batch_size < 1:
        raise InputError("must be at least 1", key="--batch-size", value=batch_size)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    trained = load_trained(model_path, device)
    torch.set_num_threads(threads or trained.threads)
    if not trained.encoders.has_rna:
        return _embed_hic_only(trained, model_path, rna_path, hic_path, out, batch_size, device)
    if rna_path is None:
        raise InputError("the model was trained with RNA: give the cells' rna.h5ad too (--rna or a data folder holding one)", path=model_path, key="--rna")
    rna, hic = _read(rna_path, "RNA file"), _read(hic_path, "Hi-C file")
    hic_rows = paired_rows(rna, hic, rna_path, hic_path)
    maps = {
        "genes": map_columns(trained.genes, rna.var_names, rna_path, "var_names"),
        "features": map_columns(trained.features, hic.var_names, hic_path, "var_names"),
    }
    for what, m in maps.items():
        level = logging.WARNING if m.missing else logging.INFO
        log.log(level, "%s: %d of the model's %d kept; %d missing (zeros); %d extra in the file (dropped)", what, m.kept, m.n_trained, m.missing, m.extra)
    x_rna, x_hic = counts_matrix(rna), counts_matrix(hic)[hic_rows]
    n = rna.n_obs

    def batches():
        for i in range(0, n, batch_size):
            idx = np.arange(i, min(i + batch_size, n))
            # float32 like the trainer's batches, then the model's dtype
            r = torch.as_tensor(maps["genes"].dense(x_rna[idx]), dtype=torch.float32).to(device, trained.dtype)
            h = torch.as_tensor(maps["features"].dense(x_hic[idx]), dtype=torch.float32).to(device, trained.dtype)
            yield r, h

    x_r, x_h = latent_means(trained.encoders, batches(), trained.encoders.latent, rows=batch_size)
    report = {"cells": int(n), **{what: m.counts() for what, m in maps.items()}}
    emb = embeddings_anndata(rna.obs, x_r, x_h, trained.shared_dim, {"model": str(model_path), "steps": trained.steps, **report})
    with atomic_path(out) as tmp:
        emb.write_h5ad(tmp)
    log.info("embedded %d cells into %s", n, out)
    return report


def _embed_hic_only(trained: TrainedModel, model_path, rna_path, hic_path, out, batch_size: int, device) -> dict:
    """:func:`embed_cells` for a Hi-C-only model: the Hi-C file alone."""
    if rna_path is not None and Path(rna_path).exists():
        log.warning("the model was trained without RNA: %s is not read", rna_path)
    hic = _read(hic_path, "Hi-C file")
    if len(set(map(str, hic.obs_names))) < hic.n_obs:
        raise InputError("cell ids must be unique", path=hic_path, key="obs_names")
    fmap = map_columns(trained.features, hic.var_names, hic_path, "var_names")
    level = logging.WARNING if fmap.missing else logging.INFO
    log.log(
        level, "features: %d of the model's %d kept; %d missing (zeros); %d extra in the file (dropped)", fmap.kept, fmap.n_trained, fmap.missing, fmap.extra
    )
    x_hic, n = counts_matrix(hic), hic.n_obs

    def batches():
        for i in range(0, n, batch_size):
            h = torch.as_tensor(fmap.dense(x_hic[i : i + batch_size]), dtype=torch.float32).to(device, trained.dtype)
            yield None, h

    x_r, x_h = latent_means(trained.encoders, batches(), trained.encoders.latent, rows=batch_size)
    report = {"cells": int(n), "features": fmap.counts()}
    emb = embeddings_anndata(hic.obs, None, x_h, trained.shared_dim, {"model": str(model_path), "steps": trained.steps, **report})
    with atomic_path(out) as tmp:
        emb.write_h5ad(tmp)
    log.info("embedded %d cells (Hi-C only) into %s", n, out)
    return report


def embed_paths(data=None, rna=None, hic=None) -> tuple[Path | None, Path]:
    """The RNA and Hi-C files to embed: ``rna``/``hic`` where given, else the data
    folder's ``rna.h5ad``/``hic.h5ad`` (which a Hi-C-only folder lacks: a Hi-C-only
    model reads none). The RNA file is None for ``hic`` alone, which only a Hi-C-only
    model accepts.

    Raises
    ------
    InputError
        Neither a data folder nor a Hi-C file is given.
    """
    folder = DataFolder(data) if data else None
    if folder is None and not hic:
        raise InputError("give a data folder (--data) or both --rna and --hic (--hic alone for a model trained without RNA)", key="--data")
    rna_path = Path(rna) if rna else (folder.rna if folder is not None else None)
    return rna_path, Path(hic) if hic else folder.hic
