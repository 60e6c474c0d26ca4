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
    """
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    rng = np.random.default_rng(seed)
    truth = np.asarray(truth)
    aris, nmis = [], []
    for _ in range(n):
        perm = rng.permutation(truth)
        aris.append(adjusted_rand_score(perm, clusters))
        nmis.append(normalized_mutual_info_score(perm, clusters))
    return {"ari_shuffled_p95": float(np.percentile(aris, 95)), "nmi_shuffled_p95": float(np.percentile(nmis, 95))}
