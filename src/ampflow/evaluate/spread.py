"""How many dimensions a latent spreads cells over, and the warning when it is too few.

A latent can hold every cell type apart in a direction k-means cannot see, or squeeze
the cells onto one or two directions: on all 400 labelled Lee 2019 cortex cells, a
Hi-C KL weight of 20 left the Hi-C latent of new cells about 1.5 effective dimensions
where a PCA of the same contacts spread them over 5.5, and k-means on it fell below
that PCA (README, "How well it works"). :func:`effective_dims` measures it;
:func:`narrow_latent_warning` names the weight to lower when a latent spreads labelled
cells over fewer dimensions than their types need while its modality's baseline does
not.
"""

from __future__ import annotations

import numpy as np

#: Each latent's modality baseline and the loss weight that narrows it.
LATENT_WEIGHTS = {
    "hic_latent": ("hic_baseline", "train.*.weights.hic_kl"),
    "rna_latent": ("rna_baseline", "train.*.weights.kl"),
}


def effective_dims(z: np.ndarray) -> float:
    """How many dimensions the cells ``z`` (cells x dims) spread over: the participation
    ratio of their covariance's eigenvalues, (sum l)^2 / sum l^2. k equally wide
    directions give k, in any rotation; one direction holding nearly all the variance
    gives about 1, however many dimensions the latent has. NaN for fewer than two cells
    or cells that do not vary."""
    z = np.asarray(z, dtype=np.float64)
    if z.ndim != 2 or z.shape[0] < 2:
        return float("nan")
    eig = np.clip(np.linalg.eigvalsh(np.atleast_2d(np.cov(z, rowvar=False))), 0.0, None)
    square = float((eig**2).sum())
    return float(eig.sum() ** 2 / square) if square > 0 else float("nan")


def narrow_latent_warning(method: str, dims: float, baseline_dims: float | None, n_types: int, group: str, n_cells: int) -> str | None:
    """The warning for latent ``method`` (a key of :data:`LATENT_WEIGHTS`) when it spreads
    the group's cells over fewer than ``n_types - 1`` effective dimensions, the fewest in
    which ``n_types`` types lie apart, while its baseline spreads them over at least one
    more than the latent does; else None (no labels, another method, or a baseline
    about as narrow)."""
    if method not in LATENT_WEIGHTS or n_types < 3 or not np.isfinite(dims) or baseline_dims is None or not np.isfinite(baseline_dims):
        return None
    need = n_types - 1
    if dims >= need or baseline_dims < dims + 1.0:
        return None
    baseline, weight = LATENT_WEIGHTS[method]
    return (
        f"{group}: {method} spreads its {n_cells} cells over {dims:.1f} effective dimensions, fewer than the {need} "
        f"that {n_types} cell types need to lie apart, where {baseline} spreads them over {baseline_dims:.1f}; "
        f"a lower {weight} leaves the latent more room"
    )
