"""Analytic memory model (EPM) of one training step of the paired model, from shapes only.

The per-device peak of a training step is predicted without building a tensor or
running a forward pass. On CPU the trainer measures the peak as what is held at the
end of the forward pass (DESIGN §4, :mod:`ampflow.train.memory`):

* **state**: parameters + gradients (one per parameter) + optimizer state;
* **saved activations**: every tensor autograd keeps for backward, reduced to the
  storages backing it and counted once per storage at the storage's full size;
  parameters and the data batch (``rna``, ``hic``) do not count.

This module reproduces that sum op by op from what PyTorch saves for each operation
the model uses (``Linear``: its input; ``LayerNorm``: input, mean and rstd;
``BatchNorm`` in training: input, running mean/var, save_mean, save_invstd; softmax:
its output; LeakyReLU/SELU/GELU/softplus/log/lgamma/square: their input; dropout on
CPU: a mask of the input's dtype; indexing: its int64 indices; ``index_add_``: indices
and source; ``masked_fill``/``where``: the bool mask; the banded-attention Function:
``q_s``, ``k``, ``v`` and the ``(H, n, 2w + 1)`` probabilities). The formulas are closed-form in
the shapes (:mod:`ampflow.amp.memory_terms`); the state is counted from the model's
own shape description (:mod:`ampflow.spec.model_shapes`), the one its modules are
built from. ``scripts/bench_memory_model.py`` checks them against real training steps.

Structure: ``M(L) = M_base + (L - 1) * M_stratum``. Stratum 0 has no attention block
(its keys are the anchor latents), so it belongs to the base; every attention stratum
``k >= 1`` adds its block's parameters, optimizer state and saved activations, its
decode and likelihood terms (``B x |F_k|``) and its share of the feature-indexed terms.
With equal ``|F_k|`` the model is exactly linear in ``L``.

What is *not* in ``total``: tensors that live only for a moment of the forward pass
(the naive decode's ``B x n`` scores, one query block's ``H x rows x (2w + 1)``
attention scores before the softmax). A device allocator sees them on top of ``total`` while they exist; they are
reported in :attr:`Estimate.transient`.

Cross-reconstruction (:attr:`ShapeSpec.cross`, ``LossWeights.cross > 0``) decodes each
modality from the other's latent: a second pass through the RNA decoder and through the
whole Hi-C decoder, every stratum block included. Its activations come after the last
per-stratum mark, and each stratum's share of them belongs to that stratum, so
``M(L)`` stays linear.

Assumptions (those of the trainer): Adam keeps two moments
per parameter plus a float32 ``step`` scalar per parameter tensor; index buffers
(``feature_anchor``, node indices, edge lists) are standalone int64 tensors. Dropout is
counted as on CPU (a mask in the input's dtype); CUDA's fused dropout keeps a 1-byte
mask instead, a difference of ``4 B h (b - 1)`` bytes.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..spec.profile import model_config, train_settings
from ..spec.strategies import BUILT_IN, CHUNKED_ATTENTION, FEATURE_PARALLEL, HIDDEN_PARALLEL, KEY_FIRST_DECODE
from .memory_spec import DTYPE_BYTES, OPTIMIZERS, Estimate, ShapeSpec
from .memory_terms import (
    INDEX_BYTES,
    POST,
    PRE,
    STATE,
    STEP_BYTES,
    Device,
    Ledger,
    ceil_div,
    banded_score_elements,
    chunked_score_elements,
    encoder_terms,
    graph_decoder_terms,
    graph_encoder_terms,
    hic_decoder_terms,
    rna_decoder_terms,
    state_terms,
)

__all__ = [
    "DTYPE_BYTES", "INDEX_BYTES", "OPTIMIZERS", "STEP_BYTES", "STRATEGIES", "Estimate", "ShapeSpec",
    "banded_score_elements", "chunked_score_elements", "estimate_for_profile", "fit_linear", "predict", "profile_memory", "spec_from_profile",
]  # fmt: skip

#: Strategy names understood by :func:`predict` (S1 .. S5).
STRATEGIES = BUILT_IN


def predict(
    spec: ShapeSpec,
    chunk: int = 0,
    key_first: bool = False,
    tp: int = 1,
    dp: int = 1,
    strategies=frozenset(),
) -> Estimate:
    """Predict one training step's per-device memory.

    Parameters
    ----------
    spec : ShapeSpec
        Shapes and settings, :attr:`ShapeSpec.cross` included.
    chunk : int
        Query chunk of the local attention; > 0 is S3 (``chunked_attention``).
    key_first : bool
        S4 (``key_first_decode``); also turned on by that name in ``strategies``.
    tp : int
        Tensor-parallel degree. It divides terms only through the strategies that
        shard over it: ``hidden_parallel`` (S5) divides the decoder's D-proportional
        parameters (with their gradients and optimizer state) and activations
        (projections, feed-forward, ``u_D``, saved keys); ``feature_parallel`` (S2)
        divides every term proportional to a stratum's features (decode and
        likelihood ``B x |F_k|`` terms, the Hi-C encoder's input and input
        projection, per-feature parameters, feature indices). A term proportional to
        both (key-first gathered keys) is divided once. Which parameter dimension
        each strategy splits is part of the model's shape description
        (:class:`ampflow.spec.model_shapes.ParamShape`). Attention scores and
        LayerNorm statistics are not divided (S5 all-reduces partial dot products and
        sums, so every rank holds them whole).
    dp : int
        Data-parallel degree (S1): each device holds ``ceil(B / dp)`` cells.
    strategies : iterable of str
        Names from :data:`STRATEGIES`. ``data_parallel`` is implied by ``dp``;
        ``chunked_attention`` requires ``chunk > 0``.

    Returns
    -------
    Estimate
    """
    strategies = frozenset(strategies)
    unknown = sorted(strategies - set(STRATEGIES))
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; known: {list(STRATEGIES)}")
    if tp < 1 or dp < 1:
        raise ValueError(f"tp and dp must be >= 1, got tp={tp}, dp={dp}")
    if chunk < 0:
        raise ValueError(f"chunk must be >= 0, got {chunk}")
    if CHUNKED_ATTENTION in strategies and not chunk:
        raise ValueError(f"{CHUNKED_ATTENTION} needs a chunk size > 0")
    dev = Device(
        spec=spec,
        B=ceil_div(spec.n_cells_batch, dp),
        chunk=chunk,
        key_first=bool(key_first) or KEY_FIRST_DECODE in strategies,
        hp_div=tp if HIDDEN_PARALLEL in strategies else 1,
        fp_div=tp if FEATURE_PARALLEL in strategies else 1,
    )
    led = _ledger(dev)
    return _summarise(led, dev)


def _ledger(dev: Device) -> Ledger:
    """Every term of one step, in forward order."""
    s, B, b = dev.spec, dev.B, dev.spec.dtype_bytes
    has_rna, has_hic = s.n_genes > 0, s.n_features > 0
    d = s.latent
    led = Ledger()
    state_terms(led, dev)
    graph_encoder_terms(led, dev)
    if has_rna:
        led.add("rna_encoder", B * s.n_genes * b)  # first Linear's input
        encoder_terms(led, "rna_encoder", dev)
        led.add("cell_latents", B * d * b)  # noise
        rna_decoder_terms(led, dev)
    if has_hic:
        for k, fk in enumerate(s.features_per_stratum):
            led.add("hic_encoder", dev.fp(B * fk) * b, k or None)  # first Linear's input
        encoder_terms(led, "hic_encoder", dev)
        led.add("cell_latents", B * d * b)  # noise
        hic_decoder_terms(led, dev)
        led.add("cell_latents", 3 * B * d * b, None, POST)  # KL
    if has_rna:
        led.add("cell_latents", 3 * B * d * b, None, POST)  # KL
        if has_hic:
            aligned = d if s.shared is None else s.shared
            led.add("cell_latents", B * aligned * b, None, POST)  # alignment difference (shared dims)
    graph_decoder_terms(led, dev)
    # each modality decoded from the other's latent; needs both (as the model does)
    if s.cross and has_rna and has_hic:
        rna_decoder_terms(led, dev, first=False)
        hic_decoder_terms(led, dev, first=False)
    return led


def _summarise(led: Ledger, dev: Device) -> Estimate:
    """Totals, components, per-stratum shares, marks and transients of a ledger."""
    s, B, b = dev.spec, dev.B, dev.spec.dtype_bytes
    L, n, H = s.n_strata, s.n_anchors, s.heads
    has_hic = s.n_features > 0
    total = sum(x for *_, x in led.items)
    components: dict[str, int] = {}
    for comp, _, _, x in led.items:
        components[comp] = components.get(comp, 0) + x
    strata = [0] * max(L - 1, 0)
    for _, k, _, x in led.items:
        if k:
            strata[k - 1] += x
    base = total - sum(strata)
    marks = []
    fixed = sum(x for _, _, ph, x in led.items if ph in (STATE, PRE))
    for k in range(L if has_hic else 0):
        marks.append(fixed + sum(x for _, _, ph, x in led.items if isinstance(ph, int) and ph <= k))
    transient = {"decode_scores": 0, "attention_scores": 0}
    if has_hic:
        if not dev.key_first:
            transient["decode_scores"] = B * n * b
        if s.attention and L > 1:
            # one query block's (H, rows, 2w + 1) scores before the softmax (the band
            # width clipped by n, not by the rows of the block)
            rows = min(dev.chunk, n) if dev.chunk else n
            transient["attention_scores"] = H * rows * (banded_score_elements(n, s.window) // max(n, 1)) * b
    return Estimate(
        total=total,
        base=base,
        per_stratum=sum(strata) / len(strata) if strata else 0.0,
        components=dict(sorted(components.items())),
        strata=tuple(strata),
        marks=tuple(marks),
        transient=transient,
    )


def fit_linear(Ls, measured) -> tuple[float, float]:
    """Least-squares line through ``(L, measured)``.

    Parameters
    ----------
    Ls : sequence of number
        At least two distinct values.
    measured : sequence of number
        Same length.

    Returns
    -------
    slope, intercept : float
    """
    xs, ys = [float(x) for x in Ls], [float(y) for y in measured]
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("need at least two (L, measured) pairs of equal length")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("all L are equal: the slope is undefined")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


# ---------------------------------------------------------------- profile adapters
def spec_from_profile(profile: dict) -> ShapeSpec:
    """The :class:`ShapeSpec` of a profile (:func:`ampflow.amp.profile.profile_data`).

    ``train`` gives the batch size, the run's dtype, the optimizer and whether any
    stage trains the cross-reconstruction term. A missing modality gives a spec
    without that branch: no RNA (``n_genes = 0``) is the Hi-C-only model exactly
    (``PairedModel`` with no genes); no Hi-C (no strata) describes an RNA branch and
    graph that the model has no form for, so that spec is an approximation.
    """
    mods = profile.get("modalities", {})
    rna, hic = mods.get("rna", {}), mods.get("hic", {})
    train = train_settings(profile)
    if train.dtype not in DTYPE_BYTES:
        raise ValueError(f"train dtype {train.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    cfg = model_config(profile)
    fps = [int(x) for x in hic.get("features_per_stratum", [])]
    graph = profile.get("graph", {})
    spec = ShapeSpec.from_model(
        cfg,
        batch_size=train.batch_size,
        n_genes=int(rna.get("n_features", 0)),
        features_per_stratum=fps,
        n_anchors=int(hic.get("n_anchors", fps[0] if fps else 0)),
        n_nodes=int(graph.get("n_nodes", 0)),
        n_edges=int(graph.get("n_edges", 0)),
        dtype_bytes=DTYPE_BYTES[train.dtype],
        cross=train.cross_reconstruction,
    )
    optimizer = train.optimizer.lower()
    if optimizer != spec.optimizer:
        spec = replace(spec, optimizer=optimizer)
    return spec


def estimate_for_profile(profile: dict, names, dp: int, tp: int, chunk: int) -> Estimate:
    """:func:`predict` for a profile under strategies ``names`` on a ``dp x tp`` mesh.

    The signature the diagnosis (:mod:`ampflow.amp.diagnose`) calls. ``chunk`` counts
    only when ``chunked_attention`` is among ``names``; the model config's own
    ``chunk``/``key_first`` settings are ignored here, since the plan decides them.
    """
    names = frozenset(names)
    use_chunk = int(chunk) if CHUNKED_ATTENTION in names and chunk else 0
    if not use_chunk:
        names = names - {CHUNKED_ATTENTION}
    return predict(spec_from_profile(profile), chunk=use_chunk, tp=int(tp), dp=int(dp), strategies=names)


def profile_memory(profile: dict) -> dict:
    """The memory section of a profile: the single-device prediction with the model
    config's own ``chunk`` and ``key_first`` (JSON-serialisable, integers only).

    Returns
    -------
    dict
        ``model`` (the formula), ``n_strata``, ``dtype_bytes``, ``batch_size``,
        ``chunk``, ``key_first``, ``cross_reconstruction``, ``total_bytes``,
        ``M_base_bytes``, ``M_stratum_bytes`` (rounded mean), ``strata_bytes``,
        ``components`` and ``transient`` (bytes).
    """
    spec = spec_from_profile(profile)
    cfg = model_config(profile)
    est = predict(spec, chunk=cfg.chunk if cfg.attention else 0, key_first=cfg.key_first)
    return {
        "model": "M(L) = M_base + (L - 1) * M_stratum",
        "n_strata": spec.n_strata,
        "dtype_bytes": spec.dtype_bytes,
        "batch_size": spec.n_cells_batch,
        "chunk": cfg.chunk if cfg.attention else 0,
        "key_first": cfg.key_first,
        "cross_reconstruction": spec.cross,
        "total_bytes": int(est.total),
        "M_base_bytes": int(est.base),
        "M_stratum_bytes": int(math.floor(est.per_stratum + 0.5)),
        "strata_bytes": [int(x) for x in est.strata],
        "components": {k: int(v) for k, v in est.components.items()},
        "transient": {k: int(v) for k, v in est.transient.items()},
    }
