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
and source; ``masked_fill``/``where``: the bool mask; the chunked-attention Function:
``q_s``, ``k``, ``v`` and each block's probabilities). The formulas are closed-form in
the shapes; ``scripts/bench_memory_model.py`` checks them against real training steps.

Structure: ``M(L) = M_base + (L - 1) * M_stratum``. Stratum 0 has no attention block
(its keys are the anchor latents), so it belongs to the base; every attention stratum
``k >= 1`` adds its block's parameters, optimizer state and saved activations, its
decode and likelihood terms (``B x |F_k|``) and its share of the feature-indexed terms.
With equal ``|F_k|`` the model is exactly linear in ``L``.

What is *not* in ``total``: tensors that live only for a moment of the forward pass
(the naive decode's ``B x n`` scores, the full attention's unmasked ``H x n x n``
scores). A device allocator sees them on top of ``total`` while they exist; they are
reported in :attr:`Estimate.transient`.

Assumptions (those of the trainer): ``LossWeights.cross == 0``; Adam keeps two moments
per parameter plus a float32 ``step`` scalar per parameter tensor; index buffers
(``feature_anchor``, node indices, edge lists) are standalone int64 tensors. Dropout is
counted as on CPU (a mask in the input's dtype); CUDA's fused dropout keeps a 1-byte
mask instead, a difference of ``4 B h (b - 1)`` bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..spec.config import ModelConfig

#: Bytes per element of the dtypes the model may train in.
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
#: Index tensors (gathers, edge lists) are int64.
INDEX_BYTES = 8
#: Adam's per-tensor ``step`` is a float32 scalar (torch's default dtype).
STEP_BYTES = 4
#: Strategy names understood by :func:`predict` (S1 .. S5).
STRATEGIES = ("data_parallel", "feature_parallel", "chunked_attention", "key_first_decode", "hidden_parallel")
OPTIMIZERS = ("adam", "adamw")

# Forward order used for the per-stratum marks: state exists throughout, "pre" is
# everything saved before the Hi-C decoder's loop over strata, stratum k's own terms
# follow at phase k, and "post" (likelihood of the Hi-C counts, KL terms, graph decoder,
# alignment) comes after the loop.
_STATE, _PRE, _POST = "state", "pre", "post"


@dataclass(frozen=True)
class ShapeSpec:
    """Shapes and settings that determine one training step's memory.

    Parameters
    ----------
    n_cells_batch : int
        Cells per batch ``B`` (before data parallelism divides it).
    n_genes : int
        RNA features ``G`` (0: no RNA branch).
    n_features : int
        Hi-C features ``F`` (all strata).
    features_per_stratum : sequence of int
        ``|F_k|`` for ``k = 0 .. L-1``; stratum 0 holds the anchors. Sums to ``F``.
    n_anchors : int
        Anchors ``n`` (sequence length of the attention blocks).
    n_nodes, n_edges : int
        Guidance-graph nodes ``N`` and edges ``E`` (both directions, self-loops included).
    latent : int
        Latent size ``d``.
    hidden : int
        Encoder hidden width ``h``.
    D : int
        Hi-C decoder width.
    heads : int
        Attention heads ``H``.
    window : int
        Attention half-window ``w``.
    ffn_mult : int
        GEGLU expansion ``f`` (``w_ff``: ``D -> 2 f D``).
    attention : bool
        Whether the stratum blocks use attention.
    neg_samples : int
        Negative samples per positive edge in the graph decoder.
    graph_batch : int
        Edges sampled per step by the graph decoder.
    dtype_bytes : int
        Bytes per element: 4 fp32, 2 bf16, 8 fp64.
    optimizer : str
        ``"adam"`` (or ``"adamw"``, same state).
    dropout : float
        Encoder dropout; 0 saves no mask (dropout then returns its input).
    """

    n_cells_batch: int
    n_genes: int
    n_features: int
    features_per_stratum: tuple[int, ...]
    n_anchors: int
    n_nodes: int
    n_edges: int
    latent: int
    hidden: int
    D: int
    heads: int
    window: int
    ffn_mult: int = 2
    attention: bool = True
    neg_samples: int = 5
    graph_batch: int = 4096
    dtype_bytes: int = 4
    optimizer: str = "adam"
    dropout: float = 0.1

    def __post_init__(self):
        object.__setattr__(self, "features_per_stratum", tuple(int(x) for x in self.features_per_stratum))
        for name in ("n_cells_batch", "latent", "hidden", "D", "heads", "ffn_mult", "graph_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("n_genes", "n_features", "n_anchors", "n_nodes", "n_edges", "window", "neg_samples"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if any(x < 0 for x in self.features_per_stratum):
            raise ValueError("features_per_stratum must be >= 0")
        if sum(self.features_per_stratum) != self.n_features:
            raise ValueError(f"features_per_stratum sums to {sum(self.features_per_stratum)}, n_features is {self.n_features}")
        if self.n_features and not self.features_per_stratum:
            raise ValueError("features_per_stratum is empty but n_features > 0")
        if self.D % self.heads:
            raise ValueError(f"D = {self.D} is not divisible by heads = {self.heads}")
        if self.dtype_bytes not in (2, 4, 8):
            raise ValueError(f"dtype_bytes must be 2, 4 or 8, got {self.dtype_bytes}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def n_strata(self) -> int:
        """``L``, the number of strata (stratum 0 included)."""
        return len(self.features_per_stratum)

    @classmethod
    def from_model(
        cls,
        model_config: ModelConfig,
        batch_size: int,
        n_genes: int,
        features_per_stratum,
        n_anchors: int,
        n_nodes: int,
        n_edges: int,
        dtype_bytes: int = 4,
    ) -> "ShapeSpec":
        """The spec of a :class:`~ampflow.model.paired.PairedModel` built with
        ``model_config`` on data of these shapes.

        ``chunk`` and ``key_first`` of the config are not part of the spec: pass them
        to :func:`predict` (they are strategies S3 and S4).
        """
        fps = tuple(int(x) for x in features_per_stratum)
        c = model_config
        return cls(
            n_cells_batch=int(batch_size), n_genes=int(n_genes), n_features=sum(fps),
            features_per_stratum=fps, n_anchors=int(n_anchors), n_nodes=int(n_nodes),
            n_edges=int(n_edges), latent=c.latent_dim, hidden=c.hidden_dim, D=c.D,
            heads=c.heads, window=c.window, ffn_mult=c.ffn_mult, attention=c.attention,
            neg_samples=c.neg_samples, graph_batch=c.graph_batch, dtype_bytes=int(dtype_bytes),
            dropout=c.dropout,
        )  # fmt: skip


@dataclass(frozen=True)
class Estimate:
    """Predicted bytes of one training step on one device.

    Attributes
    ----------
    total : int
        State + saved activations at the end of the forward pass (what the trainer
        reports as ``peak_bytes`` on CPU). ``total == base + sum(strata)``.
    base : int
        Everything not attributable to an attention stratum: state of the encoders,
        graph and shared decoder parts, their activations, and stratum 0's decode and
        likelihood terms.
    per_stratum : float
        Mean of :attr:`strata` (0 when ``L = 1``), so that
        ``total == base + (L - 1) * per_stratum`` up to rounding. The slope of a line
        fitted to ``total`` against ``L`` estimates it; the intercept estimates
        ``base - per_stratum``.
    strata : tuple of int
        Marginal bytes of each attention stratum ``k = 1 .. L-1``: its block's
        parameters, gradients and optimizer state, its saved activations, and every
        term proportional to ``|F_k|`` (encoder input columns and weights, per-feature
        parameters, decode, likelihood, index entries) or to the stratum count (its
        row of the strata head and column of the strata weights).
    components : dict of str to int
        ``total`` broken down by what holds the bytes (sums to ``total``):

        ``parameters``, ``gradients``, ``optimizer_state``
            Model state (Adam: two moments per parameter, a 4-byte step per tensor).
        ``rna_encoder``, ``hic_encoder``
            MLP activations: input (``B x G`` / ``B x F``, saved by the first
            Linear), per layer the LeakyReLU input, BatchNorm input and its four
            ``(h,)`` vectors, the dropout mask and the next layer's input, and the
            softplus input of the std head.
        ``cell_latents``
            Reparameterisation noise of both cell latents, their KL terms (``loc``,
            ``std``, ``std + eps``) and the alignment difference.
        ``graph_encoder``
            Two graph convolutions (edge indices, coefficients, messages ``E x d``),
            SELU, Normal head, node noise and node KL terms.
        ``graph_decoder``
            Sampled edges and negatives: gathered node latents, signs, logits,
            targets, weights and their int64 indices.
        ``rna_decoder``
            NB decoder (``u``, gathered gene latents, ``B x G`` product and softmax,
            gene index) and the NB likelihood's ``B x G`` intermediates.
        ``hic_decoder_head``
            The Hi-C decoder's shared inputs: ``u`` (and ``u_D`` when ``D != d``),
            strata weights ``B x L``, library, anchor latents and indices,
            ``feature_anchor`` (int64, ``F``).
        ``stratum0_decode``
            Stratum 0's logits, softmax and per-feature softplus scale.
        ``stratum_norms``
            Per attention stratum: LayerNorm statistics (``4 n``) and the normalised
            input ``n x d`` (replicated under S5).
        ``stratum_projections``
            Per attention stratum, D-proportional ``n x D`` tensors: values, keys,
            scaled queries, attention sum, feed-forward LayerNorm output.
        ``stratum_attention_scores``
            Per attention stratum: softmax probabilities ``H n n`` plus the ``n x n``
            bool mask (full), or ``H sum_blocks (e-s)(ke-ks)`` (chunked, S3, over the
            blocks of :func:`ampflow.model.attention.chunk_blocks`; no mask).
        ``stratum_feed_forward``
            Per attention stratum, GEGLU: ``w_ff`` output ``2 f n D``, GELU output
            and product ``f n D`` each.
        ``stratum_decode``
            Per attention stratum: keys ``n x D`` saved by ``u_D key^T`` (naive) or
            gathered keys ``|F_k| x D`` (key-first, S4), logits and softmax
            ``B x |F_k|``, softplus scale, strata-weighted library.
        ``zinb_likelihood``
            ZINB over ``B x F``: five float intermediates, the bool zero mask, two
            ``(F,)`` vectors.
    marks : tuple of int
        Predicted bytes held after stratum ``k``'s part of the forward pass
        (``k = 0 .. L-1``): the trainer's ``stratum_bytes`` on CPU.
    transient : dict of str to int
        Short-lived forward intermediates not in ``total``: ``decode_scores``
        (the naive decode's ``B x n`` product, removed by S4) and
        ``attention_scores`` (full: the unmasked ``H x n x n`` scores; chunked: one
        block's scores).
    """

    total: int
    base: int
    per_stratum: float
    components: dict = field(default_factory=dict)
    strata: tuple = ()
    marks: tuple = ()
    transient: dict = field(default_factory=dict)


class _Ledger:
    """Byte entries tagged with a component, the stratum they belong to (None: base)
    and the phase of the forward pass in which they appear."""

    def __init__(self):
        self.items: list[tuple[str, int | None, object, int]] = []

    def add(self, component: str, nbytes: int, stratum: int | None = None, phase: object = _PRE) -> None:
        if nbytes:
            self.items.append((component, stratum, phase, int(nbytes)))


def _ceil_div(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def chunked_score_elements(n: int, window: int, chunk: int) -> int:
    """Probabilities per head kept by chunked attention: ``sum (e - s) * (ke - ks)``
    over the blocks of :func:`ampflow.model.attention.chunk_blocks` (same enumeration:
    query rows ``[s, e)`` of ``chunk``, keys ``[max(0, s - w), min(n, e + w))``)."""
    total = 0
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        total += (e - s) * (min(n, e + window) - max(0, s - window))
    return total


def _encoder(led: _Ledger, name: str, B: int, h: int, d: int, b: int, dropout: float) -> None:
    """Saved activations of an :class:`~ampflow.model.encoders.Encoder`'s body and
    heads, without its input (added by the caller, which knows how it is sharded)."""
    # LeakyReLU input, BatchNorm input, dropout mask, next layer's input; dropout(p=0)
    # returns its input unchanged, so it saves no mask
    per_b_h = 4 if dropout > 0 else 3
    for _ in range(2):
        led.add(name, per_b_h * B * h * b)
        led.add(name, 4 * h * b)  # running mean/var, save_mean, save_invstd
    led.add(name, B * d * b)  # softplus input of the std head


def _encoder_params(h: int, d: int) -> int:
    """Parameters of an Encoder apart from its first Linear's weight (``h x n_in``)."""
    return h + 2 * h + h * h + h + 2 * h + 2 * (h * d + d)


def _block_params(spec: ShapeSpec) -> tuple[int, int, int]:
    """(replicated elements, D-proportional elements, tensors) of one StratumBlock."""
    d, D, f = spec.latent, spec.D, spec.ffn_mult
    proj = d * D * (2 if spec.attention else 1)  # w_v (and w_k)
    d_prop = proj + 2 * D + (2 * f * D * D + 2 * f * D) + (f * D * D + D)
    return 2 * d, d_prop, 10 if spec.attention else 9


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
        both (key-first gathered keys) is divided once. Attention scores and
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
    if "chunked_attention" in strategies and not chunk:
        raise ValueError("chunked_attention needs a chunk size > 0")
    key_first = bool(key_first) or "key_first_decode" in strategies
    hp_div = tp if "hidden_parallel" in strategies else 1
    fp_div = tp if "feature_parallel" in strategies else 1

    def hp(x: int) -> int:  # D-proportional elements on one rank
        return _ceil_div(x, hp_div)

    def fp(x: int) -> int:  # feature-proportional elements on one rank
        return _ceil_div(x, fp_div)

    s = spec
    b = s.dtype_bytes
    B = _ceil_div(s.n_cells_batch, dp)
    G, F, n, N, E = s.n_genes, s.n_features, s.n_anchors, s.n_nodes, s.n_edges
    d, h, D, H, f = s.latent, s.hidden, s.D, s.heads, s.ffn_mult
    fps = s.features_per_stratum
    L = len(fps)
    has_rna, has_hic = G > 0, F > 0
    led = _Ledger()

    def state(component_elems: int, tensors: int, stratum: int | None = None) -> None:
        # parameters and gradients take the same bytes; Adam adds two moments and a step
        led.add("parameters", component_elems * b, stratum, _STATE)
        led.add("gradients", component_elems * b, stratum, _STATE)
        led.add("optimizer_state", 2 * component_elems * b + STEP_BYTES * tensors, stratum, _STATE)

    # ---------------------------------------------------------------- state
    state(N * d + 2 * (d * d + d), 5)  # graph: embedding, loc, std
    if has_rna:
        state(G * h + _encoder_params(h, d), 12)
        state(3 * G, 3)  # NB decoder: scale, bias, log_theta
    if has_hic:
        state(_encoder_params(h, d), 12)
        if D != d:
            if L > 1:
                state(hp(d * D), 1)  # u_proj
            else:
                # u_D feeds no stratum: u_proj gets no gradient, so Adam keeps no state
                # for it (the trainer still counts a gradient slot per parameter)
                led.add("parameters", hp(d * D) * b, None, _STATE)
                led.add("gradients", hp(d * D) * b, None, _STATE)
        state(0, 2 + 4)  # tensors of the strata head and of the per-feature vectors
        rep, dprop, nt = _block_params(s)
        for k, fk in enumerate(fps):
            # input-projection columns, per-feature scale/bias/theta/zi, strata-head row
            state(h * fp(fk) + 4 * fp(fk) + (d + 1), 0, k or None)
            if k:
                state(rep + hp(dprop), nt, k)

    # ---------------------------------------------------------------- before the strata
    gd = N * d * b
    led.add("graph_encoder", 2 * E * INDEX_BYTES + E * b + 2 * E * d * b)  # src, dst, coef, 2 messages
    led.add("graph_encoder", 3 * gd)  # SELU input, Normal-head input, softplus input
    led.add("graph_encoder", gd)  # node noise
    if has_rna:
        led.add("rna_encoder", B * G * b)  # first Linear's input
        _encoder(led, "rna_encoder", B, h, d, b, s.dropout)
        led.add("cell_latents", B * d * b)  # noise
        # u, gathered gene latents, u v^T and its softmax, softplus scale, library,
        # theta; NB: log input, theta-weighted difference, log(mu) input, lgamma input
        led.add("rna_decoder", G * INDEX_BYTES + B * d * b + G * d * b)
        led.add("rna_decoder", 2 * B * G * b + 2 * G * b + B * b)
        led.add("rna_decoder", 4 * B * G * b + G * b)
    if has_hic:
        for k, fk in enumerate(fps):
            led.add("hic_encoder", fp(B * fk) * b, k or None)
        _encoder(led, "hic_encoder", B, h, d, b, s.dropout)
        led.add("cell_latents", B * d * b)  # noise
        led.add("hic_decoder_head", n * INDEX_BYTES + B * d * b)  # anchor index, u
        if D != d and L > 1:
            led.add("hic_decoder_head", hp(B * D) * b, None, 1)  # u_D, first saved by stratum 1
        for k in range(L):
            led.add("hic_decoder_head", B * b, k or None)  # strata weights (B, L)
        # The anchor latents are first saved by stratum 0's product (naive) or by
        # block 1's LayerNorm (key-first); with key-first and one stratum, never.
        if not key_first:
            led.add("hic_decoder_head", n * d * b, None, 0)
        elif L > 1:
            led.add("hic_decoder_head", n * d * b, None, 1)

    # ---------------------------------------------------------------- strata
    if has_hic:
        led.add("hic_decoder_head", B * b, None, 0)  # library
        for k, fk in enumerate(fps):
            led.add("hic_decoder_head", fp(fk) * INDEX_BYTES, k or None, 0)  # feature_anchor slice
        fk = fps[0]
        led.add("stratum0_decode", 2 * fp(B * fk) * b + fp(fk) * b + B * b, None, 0)
        if key_first:
            led.add("stratum0_decode", fp(fk * d) * b, None, 0)  # gathered anchor latents
        scores = (
            H * chunked_score_elements(n, s.window, chunk) * b if chunk
            else H * n * n * b + n * n  # probabilities + bool mask
        )  # fmt: skip
        for k in range(1, L):
            fk = fps[k]
            led.add("stratum_norms", n * d * b + 4 * n * b, k, k)
            if s.attention:
                led.add("stratum_projections", 5 * hp(n * D) * b, k, k)
                led.add("stratum_attention_scores", scores, k, k)
            else:
                led.add("stratum_projections", 2 * hp(n * D) * b, k, k)
            led.add("stratum_feed_forward", 4 * f * hp(n * D) * b, k, k)
            if key_first:
                keys = _ceil_div(fk * D, max(hp_div, fp_div))
            else:
                keys = hp(n * D)
            led.add("stratum_decode", keys * b + 2 * fp(B * fk) * b + fp(fk) * b + B * b, k, k)

    # ---------------------------------------------------------------- after the strata
    if has_hic:
        for k, fk in enumerate(fps):
            # five float (B, F) intermediates + the bool zero mask; theta and log input
            led.add("zinb_likelihood", 5 * fp(B * fk) * b + fp(B * fk) + 2 * fp(fk) * b, k or None, _POST)
        led.add("cell_latents", 3 * B * d * b, None, _POST)  # KL
    if has_rna:
        led.add("cell_latents", 3 * B * d * b, None, _POST)  # KL
        if has_hic:
            led.add("cell_latents", B * d * b, None, _POST)  # alignment difference
    if E:
        es = min(s.graph_batch, E)
        en = s.neg_samples * es
        # positives: s, t indices; v[s], v[t]; sign, logit, target, weight
        gdec = 2 * es * INDEX_BYTES + 2 * es * d * b + 4 * es * b
        if en:  # negatives: indices, gathered latents, repeated sign, logit, target
            gdec += 2 * en * INDEX_BYTES + 2 * en * d * b + 3 * en * b
        led.add("graph_decoder", gdec, None, _POST)
    led.add("graph_encoder", 3 * gd, None, _POST)  # node KL

    # ---------------------------------------------------------------- summaries
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
    fixed = sum(x for _, _, ph, x in led.items if ph in (_STATE, _PRE))
    for k in range(L if has_hic else 0):
        marks.append(fixed + sum(x for _, _, ph, x in led.items if isinstance(ph, int) and ph <= k))
    transient = {"decode_scores": 0, "attention_scores": 0}
    if has_hic:
        if not key_first:
            transient["decode_scores"] = B * n * b
        if s.attention and L > 1:
            if chunk:
                c = min(chunk, n)
                transient["attention_scores"] = H * c * min(n, c + 2 * s.window) * b
            else:
                transient["attention_scores"] = H * n * n * b
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

    A missing modality gives a spec without that branch (``n_genes = 0`` or no
    strata); the model itself needs both, so such a spec is an approximation.
    """
    mods = profile.get("modalities", {})
    rna, hic = mods.get("rna", {}), mods.get("hic", {})
    train = profile.get("train", {})
    dtype = str(train.get("dtype", "float32"))
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"train dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    cfg = ModelConfig.from_dict(profile.get("model"))
    fps = [int(x) for x in hic.get("features_per_stratum", [])]
    graph = profile.get("graph", {})
    spec = ShapeSpec.from_model(
        cfg,
        batch_size=int(train.get("batch_size", 32)),
        n_genes=int(rna.get("n_features", 0)),
        features_per_stratum=fps,
        n_anchors=int(hic.get("n_anchors", fps[0] if fps else 0)),
        n_nodes=int(graph.get("n_nodes", 0)),
        n_edges=int(graph.get("n_edges", 0)),
        dtype_bytes=DTYPE_BYTES[dtype],
    )
    optimizer = str(train.get("optimizer", "adam")).lower()
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
    use_chunk = int(chunk) if "chunked_attention" in names and chunk else 0
    if not use_chunk:
        names = names - {"chunked_attention"}
    return predict(spec_from_profile(profile), chunk=use_chunk, tp=int(tp), dp=int(dp), strategies=names)


def profile_memory(profile: dict) -> dict:
    """The memory section of a profile: the single-device prediction with the model
    config's own ``chunk`` and ``key_first`` (JSON-serialisable, integers only).

    Returns
    -------
    dict
        ``model`` (the formula), ``n_strata``, ``dtype_bytes``, ``batch_size``,
        ``total_bytes``, ``M_base_bytes``, ``M_stratum_bytes`` (rounded mean),
        ``strata_bytes``, ``components`` and ``transient`` (bytes).
    """
    spec = spec_from_profile(profile)
    cfg = ModelConfig.from_dict(profile.get("model"))
    est = predict(spec, chunk=cfg.chunk if cfg.attention else 0, key_first=cfg.key_first)
    return {
        "model": "M(L) = M_base + (L - 1) * M_stratum",
        "n_strata": spec.n_strata,
        "dtype_bytes": spec.dtype_bytes,
        "batch_size": spec.n_cells_batch,
        "chunk": cfg.chunk if cfg.attention else 0,
        "key_first": cfg.key_first,
        "total_bytes": int(est.total),
        "M_base_bytes": int(est.base),
        "M_stratum_bytes": int(math.floor(est.per_stratum + 0.5)),
        "strata_bytes": [int(x) for x in est.strata],
        "components": {k: int(v) for k, v in est.components.items()},
        "transient": {k: int(v) for k, v in est.transient.items()},
    }
