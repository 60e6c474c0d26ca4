"""Analytic memory model (EPM) of one training step of the paired model, from shapes only.

The per-device peak of a steady-state training step (after the first optimizer
step: Adam's moments exist, and the step begins by freeing the previous gradients,
``zero_grad(set_to_none=True)``) is predicted without building a tensor or running a
forward pass. The referee is the allocator: the profiler's allocation timeline on CPU,
``max_memory_allocated`` on CUDA (:func:`ampflow.train.measured_memory.measure_step`, what the
trainer reports as ``peak_bytes``). Three phases are modelled, and the peak is the
largest:

* **end of the forward pass**: the state (parameters, buffers, optimizer state, the
  data batch) plus every tensor autograd keeps for backward, reduced to the storages
  backing it and counted once per storage at the storage's full size;
* **backward pass**: the parts of the forward pass in reverse, each adding its
  transient (the gradient buffers and derivative temporaries it allocates while its
  saved tensors are still alive) to what is held when it begins; after it, its saved
  tensors are freed and the gradients it produced stay. The largest is usually an
  early step: the graph decoder's gathered-latent gradients (``2 en x d``) or the ZINB
  likelihood's eight ``B x F`` temporaries;
* **optimizer step**: the state, every gradient, and Adam's temporaries: the square
  root of the second moments, as large as all parameters with foreach kernels (CUDA),
  none with the fused kernel the trainer runs on CPU
  (:attr:`ShapeSpec.optimizer_foreach`). Under data parallelism the gradients are
  all-reduced through one flat buffer of all of them first.

Saved activations follow from what PyTorch saves for each operation the model uses
(``Linear``: its input; ``LayerNorm``: input, mean and rstd; ``BatchNorm`` in training:
input, running mean/var, save_mean, save_invstd; softmax: its output;
LeakyReLU/SELU/GELU/softplus/log/lgamma/square: their input; dropout on CPU: a mask of
the input's dtype; indexing: its int64 indices (a buffer of the model where it indexes
by one); ``index_add_``: indices and source; ``masked_fill``/``where``: the bool mask; the
banded-attention Function: ``q_s``, ``k``, ``v`` and the ``(H, n, 2w + 1)``
probabilities). The formulas are closed-form in the shapes and in the dtype's bytes
(:mod:`ampflow.amp.memory.terms`); the state is counted from the model's own shape
description (:mod:`ampflow.contract.model_shapes`), the one its modules are built from.
``scripts/bench_memory_model.py`` checks the prediction against the allocator.

Structure: ``M(L) = M_base + (L - 1) * M_stratum`` within one phase. Stratum 0 has no
attention block (its keys are the anchor latents), so it belongs to the base; every
attention stratum ``k >= 1`` adds its block's parameters, optimizer state and saved
activations, its decode and likelihood terms (``B x |F_k|``), its share of the
feature-indexed terms and of the transients proportional to them. With equal
``|F_k|`` the model is exactly linear in ``L`` as long as the same part holds the peak.

Cross-reconstruction (:attr:`ShapeSpec.cross`, ``LossWeights.cross > 0``) decodes each
modality from the other's latent: a second pass through the RNA decoder and through the
whole Hi-C decoder, every stratum block included. Its activations come after the last
per-stratum mark, and each stratum's share of them belongs to that stratum, so
``M(L)`` stays linear; its likelihood is the first part of the backward pass.

Assumptions (those of the trainer): Adam keeps two moments per parameter plus a
float32 ``step`` scalar per parameter tensor; a parameter no gradient reaches (``u_proj``
with one stratum) has neither a gradient nor optimizer state. Dropout is counted as on
CPU (a mask in the input's dtype); CUDA's fused dropout keeps a 1-byte mask instead, a
difference of ``4 B h (b - 1)`` bytes. Not modelled: the first step (no optimizer
state; its peak is lower), the CUDA runtime, allocator caching and fragmentation,
communication buffers of the tensor-parallel collectives.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from ...contract.profile import ModalityProfile, Profile, as_profile, model_config, train_settings
from ...contract.strategies import BUILT_IN, CHUNKED_ATTENTION, FEATURE_PARALLEL, HIDDEN_PARALLEL, KEY_FIRST_DECODE
from .shapes import DTYPE_BYTES, OPTIMIZERS, PHASES, Estimate, ShapeSpec
from .terms import (
    INDEX_BYTES,
    PRE,
    STATE,
    STEP_BYTES,
    Device,
    Ledger,
    attention_transients,
    banded_score_elements,
    buffer_terms,
    ceil_div,
    cell_kl_terms,
    cell_noise_terms,
    encoder_terms,
    graph_decoder_terms,
    graph_encoder_terms,
    hic_decoder_terms,
    rna_decoder_terms,
)

__all__ = [
    "DTYPE_BYTES", "INDEX_BYTES", "OPTIMIZERS", "STEP_BYTES", "Estimate", "ShapeSpec",
    "banded_score_elements", "estimate_for_profile", "fit_linear", "predict", "profile_memory", "spec_from_profile",
]  # fmt: skip


def predict(
    spec: ShapeSpec,
    chunk: int = 0,
    key_first: bool = False,
    tp: int = 1,
    dp: int = 1,
    strategies=frozenset(),
    stacked: bool = False,
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
        (:class:`ampflow.contract.model_shapes.ParamShape`). Attention scores and
        LayerNorm statistics are not divided (S5 all-reduces partial dot products and
        sums, so every rank holds them whole).
    dp : int
        Data-parallel degree (S1): each device holds ``ceil(B / dp)`` cells.
    strategies : iterable of str
        Names from :data:`~ampflow.contract.strategies.BUILT_IN`. ``data_parallel`` is implied by ``dp``;
        ``chunked_attention`` requires ``chunk > 0``.
    stacked : bool
        The Hi-C decoder's strata in one pass, as the single-process training step runs
        them without a chunk (:func:`~ampflow.train.static_step.stack_strata`); ignored
        with a chunk or on a mesh.

    Returns
    -------
    Estimate
    """
    strategies = frozenset(strategies)
    unknown = sorted(strategies - set(BUILT_IN))
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; known: {list(BUILT_IN)}")
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
        dp=dp,
        stacked=bool(stacked) and not chunk and tp == 1 and dp == 1,
    )
    led = _ledger(dev)
    return _summarise(led, dev)


def _ledger(dev: Device) -> Ledger:
    """State, then every part of the forward pass in the order the model runs them
    (the backward pass runs them in reverse)."""
    s = dev.spec
    has_rna, has_hic = s.n_genes > 0, s.n_features > 0
    led = Ledger()
    buffer_terms(led, dev)
    if has_hic:
        encoder_terms(led, "hic_encoder", dev, list(s.features_per_stratum))
    if has_rna:
        encoder_terms(led, "rna_encoder", dev, [s.n_genes])
        cell_noise_terms(led, dev)
    if has_hic:
        cell_noise_terms(led, dev)
    nodes = graph_encoder_terms(led, dev)
    if has_rna:
        rna_decoder_terms(led, dev)
    if has_hic:
        hic_decoder_terms(led, dev)
    cell_kl_terms(led, dev)
    graph_decoder_terms(led, dev, nodes)
    # each modality decoded from the other's latent; needs both (as the model does)
    if s.cross and has_rna and has_hic:
        rna_decoder_terms(led, dev, first=False)
        hic_decoder_terms(led, dev, first=False)
    return led


def _sum(shares) -> int:
    return sum(x for x, _ in shares)


def _phases(led: Ledger, dev: Device) -> tuple[dict[str, int], dict[str, Callable[[], list]], str]:
    """The held bytes of each phase's peak (:data:`PHASES`); for each phase a function
    giving the breakdown of that peak as ``(component, stratum, bytes)`` entries; and
    the part of the model whose backward holds the backward peak."""
    state = [(c, k, x) for c, k, _, x, owner in led.items if owner is None]
    saved: list[list] = [[] for _ in led.steps]
    for c, k, _, x, owner in led.items:
        if owner is not None:
            saved[owner].append((c, k, x))
    state_total = sum(x for *_, x in state)
    saved_totals = [sum(x for *_, x in items) for items in saved]
    forward = state_total + sum(saved_totals)

    # backward: the steps in reverse, each at its peak above what is held when it begins
    held, best, best_at = forward, -1, None
    for i in range(len(led.steps) - 1, -1, -1):
        step = led.steps[i]
        here = held + _sum(step.transient)
        if here > best:
            best, best_at = here, i
        held += _sum(step.kept) - _sum(step.release) - saved_totals[i]
    grads = _sum(led.param_grads)
    all_reduce = grads if dev.dp > 1 else 0  # one flat buffer of every gradient (sum_gradients)
    if state_total + grads + all_reduce > best:
        best, best_at = state_total + grads + all_reduce, None

    step_transient = grads if dev.spec.optimizer_foreach else 0  # CPU: the fused kernel allocates nothing
    phases = {
        "end_of_forward": forward,
        "backward": best,
        "optimizer_step": state_total + grads + step_transient,
    }

    def end_of_forward():
        return state + [e for items in saved for e in items]

    def backward():
        if best_at is None:
            return state + [("gradients", k, x) for x, k in led.param_grads] + [("gradient_all_reduce", None, all_reduce)]
        out = list(state)
        for items in saved[: best_at + 1]:  # the parts the backward pass has not reached
            out += items
        for step in led.steps[best_at + 1 :]:
            out += [("gradients", k, x) for x, k in step.kept] + [("gradients", k, -x) for x, k in step.release]
        step = led.steps[best_at]
        return out + [("backward_transient", k, x) for x, k in step.transient]

    def optimizer_step():
        shares = led.param_grads if dev.spec.optimizer_foreach else []
        return state + [("gradients", k, x) for x, k in led.param_grads] + [("optimizer_transient", k, x) for x, k in shares]

    breakdown = {"end_of_forward": end_of_forward, "backward": backward, "optimizer_step": optimizer_step}
    part = led.steps[best_at].component if best_at is not None else ("gradient_all_reduce" if dev.dp > 1 else "gradients")
    return phases, breakdown, part


def _summarise(led: Ledger, dev: Device) -> Estimate:
    """Phases, total, components, per-stratum shares, marks and transients of a ledger."""
    s, B, b = dev.spec, dev.B, dev.spec.dtype_bytes
    L, n, H = s.n_strata, s.n_anchors, s.heads
    has_hic = s.n_features > 0
    phases, breakdown, part = _phases(led, dev)
    # the first phase holding the largest peak (ties go to the earlier phase)
    peak_phase = max(PHASES, key=lambda p: (phases[p], -PHASES.index(p)))
    entries = breakdown[peak_phase]()
    total = phases[peak_phase]
    components: dict[str, int] = {}
    strata = [0] * max(L - 1, 0)
    for comp, k, x in entries:
        components[comp] = components.get(comp, 0) + x
        if k:
            strata[k - 1] += x
    components = {c: x for c, x in components.items() if x}
    assert sum(components.values()) == total, (components, total)
    base = total - sum(strata)
    marks = []
    fixed = sum(x for _, _, ph, x, _ in led.items if ph in (STATE, PRE))
    # the node latents (sample, loc, std) are alive through the decoders, saved only
    # by the terms after them (the sample not at all); each stratum's mean (B x |F_k|) waits in a list for the
    # concatenation
    fixed += 3 * s.n_nodes * s.latent * b
    if has_hic and dev.key_first and L == 1:  # the anchor latents, never saved
        fixed += n * s.latent * b
    means = 0
    for k in range(L if has_hic else 0):
        means += dev.fp(B * s.features_per_stratum[k]) * b
        marks.append(fixed + means + sum(x for _, _, ph, x, _ in led.items if isinstance(ph, int) and ph <= k))
    transient = {"decode_scores": 0, "attention_scores": 0}
    if has_hic:
        if not dev.key_first:
            transient["decode_scores"] = B * n * b
        if s.attention and L > 1:
            # one group of query blocks' scores, their band and its softmax
            transient["attention_scores"] = attention_transients(n, s.window, dev.chunk or None, H, 0, b)[0]
    return Estimate(
        total=total,
        base=base,
        per_stratum=sum(strata) / len(strata) if strata else 0.0,
        components=dict(sorted(components.items())),
        strata=tuple(strata),
        marks=tuple(marks),
        transient=transient,
        phases=phases,
        peak_phase=peak_phase,
        peak_part=part if peak_phase == "backward" else peak_phase,
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
def spec_from_profile(profile: Profile | dict) -> ShapeSpec:
    """The :class:`ShapeSpec` of a profile (:func:`ampflow.amp.profile.profile_data`).

    ``train`` gives the batch size, the run's dtype, the optimizer and whether any
    stage trains the cross-reconstruction term. A missing modality gives a spec
    without that branch: no RNA (``n_genes = 0``) is the Hi-C-only model exactly
    (``PairedModel`` with no genes); no Hi-C (no strata) describes an RNA branch and
    graph that the model has no form for, so that spec is an approximation.
    """
    profile = as_profile(profile)
    rna, hic = profile.rna or ModalityProfile(), profile.hic or ModalityProfile()
    train = train_settings(profile)
    if train.dtype not in DTYPE_BYTES:
        raise ValueError(f"train dtype {train.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    cfg = model_config(profile)
    fps = list(hic.features_per_stratum or ())
    spec = ShapeSpec.from_model(
        cfg,
        batch_size=train.batch_size,
        n_genes=int(rna.n_features or 0),
        features_per_stratum=fps,
        n_anchors=int(hic.n_anchors if hic.n_anchors is not None else (fps[0] if fps else 0)),
        n_nodes=profile.n_nodes,
        n_edges=profile.n_edges,
        dtype_bytes=DTYPE_BYTES[train.dtype],
        cross=train.cross_reconstruction,
        n_batches=profile.n_batches,
        hic_input_copy=train.hic_encoder_copy,
    )
    optimizer = train.optimizer.lower()
    if optimizer != spec.optimizer:
        spec = replace(spec, optimizer=optimizer)
    return spec


def estimate_for_profile(profile: Profile | dict, names, dp: int, tp: int, chunk: int) -> Estimate:
    """:func:`predict` for a profile under strategies ``names`` on a ``dp x tp`` mesh.

    The signature the diagnosis (:mod:`ampflow.amp.decide.diagnose`) calls. ``chunk`` counts
    only when ``chunked_attention`` is among ``names``; the model config's own
    ``chunk``/``key_first`` settings are ignored here, since the plan decides them.
    """
    names = frozenset(names)
    use_chunk = int(chunk) if CHUNKED_ATTENTION in names and chunk else 0
    if not use_chunk:
        names = names - {CHUNKED_ATTENTION}
    return predict(spec_from_profile(profile), chunk=use_chunk, tp=int(tp), dp=int(dp), strategies=names)


def profile_memory(profile: Profile | dict) -> dict:
    """The memory section of a profile: the single-device prediction with the model
    config's own ``chunk`` and ``key_first`` (JSON-serialisable, integers only).

    Returns
    -------
    dict
        ``model`` (the formula), ``n_strata``, ``dtype_bytes``, ``batch_size``,
        ``chunk``, ``key_first``, ``cross_reconstruction``, ``total_bytes`` (the
        steady-state peak), ``peak_phase``, ``phases`` (each phase's peak),
        ``M_base_bytes``, ``M_stratum_bytes`` (rounded mean), ``strata_bytes``,
        ``components`` (of the peak) and ``transient`` (bytes).
    """
    profile = as_profile(profile)
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
        "peak_phase": est.peak_phase,
        "phases": {k: int(v) for k, v in est.phases.items()},
        "M_base_bytes": int(est.base),
        "M_stratum_bytes": int(math.floor(est.per_stratum + 0.5)),
        "strata_bytes": [int(x) for x in est.strata],
        "components": {k: int(v) for k, v in est.components.items()},
        "transient": {k: int(v) for k, v in est.transient.items()},
    }
