"""Negative controls: what FOSCTTM reads when the pairing is broken, and what ARI and
NMI read when the labels are (:func:`shuffled_labels`).

A FOSCTTM well below 0.5 means the RNA and Hi-C latents of the same cell lie close.
The shuffled-pairing control gives each cell's RNA latent another cell's Hi-C latent
(a seeded random derangement of the rows) and scores that: whatever structure the
latents have, a broken pairing must read chance, 0.5. If it does not, the score (or
its ranking of ties) is biased and the real FOSCTTM cannot be trusted either.

Under chance each cell's fraction is close to uniform on [0, 1] (variance 1/12), so
the mean over ``n`` cells lies within ``0.5 +- 3 / sqrt(12 n)`` (three standard
deviations) unless something is wrong: :func:`chance_tolerance`.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from .foscttm import foscttm_directions

log = logging.getLogger(__name__)

#: FOSCTTM of unrelated embeddings.
CHANCE = 0.5


def chance_tolerance(n: int) -> float:
    """Three standard deviations of the mean of ``n`` uniform fractions: ``3 / sqrt(12 n)``."""
    return 3.0 / math.sqrt(12.0 * n)


def derangement(n: int, seed: int = 0) -> np.ndarray:
    """A seeded random permutation of ``range(n)`` that moves every index (``n >= 2``).

    One random cycle through all indices: a plain permutation leaves about one cell
    with its own partner, which would pull the control below chance by ~1/(2n).

    Parameters
    ----------
    n
        Number of rows.
    seed
        Random state; the same seed gives the same permutation.

    Returns
    -------
    numpy.ndarray
        ``perm`` of shape ``(n,)`` with ``perm[i] != i`` for every ``i``.
    """
    if n < 2:
        raise ValueError(f"a derangement needs at least 2 rows, got {n}")
    order = np.random.default_rng(seed).permutation(n)
    perm = np.empty(n, dtype=np.int64)
    perm[order] = np.roll(order, -1)  # order[k] -> order[k+1]: one n-cycle
    return perm


def shuffled_foscttm(x_rna, x_hic, seed: int = 0) -> dict:
    """FOSCTTM with the Hi-C latent's rows deranged among the same cells.

    Parameters
    ----------
    x_rna, x_hic
        Arrays of shape ``(n, d)``, row *i* of each from the same cell.
    seed
        Random state of the derangement.

    Returns
    -------
    dict
        ``foscttm`` (mean of both directions), ``foscttm_rna_to_hic``,
        ``foscttm_hic_to_rna``, ``chance`` (0.5), ``tolerance``
        (:func:`chance_tolerance` of ``n``), ``at_chance`` (whether ``foscttm`` lies
        within ``chance +- tolerance``), ``n_cells`` and ``seed``.
    """
    x_hic = np.asarray(x_hic)
    n = len(x_hic)
    perm = derangement(n, seed)
    rna_to_hic, hic_to_rna = foscttm_directions(x_rna, x_hic[perm])
    value = (rna_to_hic + hic_to_rna) / 2.0
    tol = chance_tolerance(n)
    at_chance = abs(value - CHANCE) <= tol
    (log.info if at_chance else log.warning)(
        "shuffled-pairing control: FOSCTTM %.4f over %d cells (chance %.1f +- %.4f)%s",
        value,
        n,
        CHANCE,
        tol,
        "" if at_chance else ": NOT at chance, the FOSCTTM scores are suspect",
    )
    return {
        "foscttm": float(value),
        "foscttm_rna_to_hic": float(rna_to_hic),
        "foscttm_hic_to_rna": float(hic_to_rna),
        "chance": CHANCE,
        "tolerance": float(tol),
        "at_chance": bool(at_chance),
        "n_cells": int(n),
        "seed": int(seed),
    }


#: Label permutations of the shuffled-label control.
LABEL_PERMUTATIONS = 200


def shuffled_labels(truth: np.ndarray, clusters: np.ndarray, seed: int = 0, n: int = LABEL_PERMUTATIONS) -> dict:
    """The 95th percentiles of ARI and NMI of ``clusters`` against ``n`` seeded
    permutations of the labels ``truth``: what the same clustering scores by chance.

    At small n chance is not 0: many clusters of few cells give NMI 0.2 against any
    labels. A score at or under these percentiles says nothing about the cells.

    Each permutation is scored from its contingency table (:func:`ari_from_table`,
    :func:`nmi_from_table`: scikit-learn's ``adjusted_rand_score`` and
    ``normalized_mutual_info_score``, same formulas): a permutation leaves both
    labellings' counts as they are, so only the table changes, and scikit-learn's checks
    of its inputs, some milliseconds a call, were most of an evaluation's time.
    """
    rng = np.random.default_rng(seed)
    t = np.unique(np.asarray(truth), return_inverse=True)[1].ravel()
    c = np.unique(np.asarray(clusters), return_inverse=True)[1].ravel()
    if t.shape != c.shape:
        raise ValueError(f"{t.size} labels for {c.size} cluster assignments")
    n_t, n_c = (int(t.max()) + 1, int(c.max()) + 1) if t.size else (0, 0)
    h_true, h_pred = _entropy(np.bincount(t)), _entropy(np.bincount(c))
    aris, nmis = [], []
    for _ in range(n):
        perm = rng.permutation(t)  # the draws of permuting the labels themselves: they depend on the length only
        table = np.bincount(perm * n_c + c, minlength=n_t * n_c).reshape(n_t, n_c)
        aris.append(ari_from_table(table))
        nmis.append(nmi_from_table(table, h_true, h_pred))
    return {"ari_shuffled_p95": float(np.percentile(aris, 95)), "nmi_shuffled_p95": float(np.percentile(nmis, 95))}


def ari_from_table(table: np.ndarray) -> float:
    """Adjusted Rand index of a contingency table (labels x clusters, counts), by the
    pair counts as scikit-learn's ``adjusted_rand_score`` (Python integers: no overflow)."""
    sq = int((table.astype(np.int64) ** 2).sum())
    n = int(table.sum())
    tp = sq - n
    fp = int((table.sum(0).astype(np.int64) ** 2).sum()) - sq
    fn = int((table.sum(1).astype(np.int64) ** 2).sum()) - sq
    tn = n * n - fp - fn - sq
    if fn == 0 and fp == 0:
        return 1.0
    return 2.0 * (tp * tn - fn * fp) / ((tp + fn) * (fn + tn) + (tp + fp) * (fp + tn))


def nmi_from_table(table: np.ndarray, h_true: float, h_pred: float) -> float:
    """Normalised mutual information (arithmetic mean of the entropies ``h_true`` of the
    labels and ``h_pred`` of the clusters) of a contingency table, as scikit-learn's
    ``normalized_mutual_info_score``."""
    n_t, n_c = table.shape
    if n_t == n_c == 1 or n_t == n_c == 0:
        return 1.0
    if n_t == 1 or n_c == 1:
        return 0.0
    nzx, nzy = np.nonzero(table)
    nz = table[nzx, nzy].astype(np.float64)
    total = nz.sum()
    pi, pj = table.sum(1), table.sum(0)
    p = nz / total
    log_outer = -np.log(pi[nzx].astype(np.int64) * pj[nzy].astype(np.int64)) + math.log(pi.sum()) + math.log(pj.sum())
    mi = p * (np.log(nz) - math.log(total)) + p * log_outer
    mi = float(np.clip(np.where(np.abs(mi) < np.finfo(mi.dtype).eps, 0.0, mi).sum(), 0.0, None))
    if mi == 0:
        return 0.0
    return float(mi / np.mean([h_true, h_pred]))


def _entropy(counts: np.ndarray) -> float:
    """Entropy (natural log) of a labelling from its label counts."""
    pi = counts[counts > 0].astype(np.float64)
    if not pi.size:
        return 1.0
    total = np.sum(pi)
    return float(-np.sum((pi / total) * (np.log(pi) - math.log(total))))
