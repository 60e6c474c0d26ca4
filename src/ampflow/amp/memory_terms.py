"""The terms of the memory model, component by component.

Each function adds to a :class:`Ledger` the bytes one part of the paired model holds at
the end of a training step's forward pass on one device (see
:mod:`ampflow.amp.memory_model` for what counts and why). State (parameters, gradients,
optimizer state) is counted from the model's own shape description,
:mod:`ampflow.spec.model_shapes`; saved activations are closed-form in the shapes, from
what PyTorch saves for each operation the model runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.model_shapes import ParamShape, encoder_params, graph_encoder_params, hic_decoder_shared_params, nb_decoder_params, stratum_block_params
from ..spec.strategies import FEATURE_PARALLEL, HIDDEN_PARALLEL
from .memory_spec import ShapeSpec

#: Index tensors (gathers, edge lists) are int64.
INDEX_BYTES = 8
#: Adam's per-tensor ``step`` is a float32 scalar (torch's default dtype).
STEP_BYTES = 4

# Forward order used for the per-stratum marks: state exists throughout, "pre" is
# everything saved before the Hi-C decoder's loop over strata, stratum k's own terms
# follow at phase k, and "post" (likelihood of the Hi-C counts, KL terms, graph decoder,
# alignment, cross-reconstruction) comes after the loop.
STATE, PRE, POST = "state", "pre", "post"


class Ledger:
    """Byte entries tagged with a component, the stratum they belong to (None: base)
    and the phase of the forward pass in which they appear."""

    def __init__(self):
        self.items: list[tuple[str, int | None, object, int]] = []

    def add(self, component: str, nbytes: int, stratum: int | None = None, phase: object = PRE) -> None:
        if nbytes:
            self.items.append((component, stratum, phase, int(nbytes)))


def ceil_div(a: int, b: int) -> int:
    return -(-int(a) // int(b))


@dataclass(frozen=True)
class Device:
    """One device's view of a :class:`ShapeSpec` under a set of strategies.

    ``B`` is this device's cells; ``hp_div`` and ``fp_div`` are the ways S5 and S2 split
    the D-proportional and the feature-proportional terms (1 when the strategy is off).
    """

    spec: ShapeSpec
    B: int
    chunk: int
    key_first: bool
    hp_div: int
    fp_div: int

    def hp(self, x: int) -> int:
        """D-proportional elements on one rank."""
        return ceil_div(x, self.hp_div)

    def fp(self, x: int) -> int:
        """Feature-proportional elements on one rank."""
        return ceil_div(x, self.fp_div)

    @property
    def parts(self) -> dict[str, int]:
        """How many ranks split a parameter that a strategy shards."""
        return {HIDDEN_PARALLEL: self.hp_div, FEATURE_PARALLEL: self.fp_div}


def chunked_score_elements(n: int, window: int, chunk: int) -> int:
    """Probabilities per head kept by the older chunked kernel
    (:func:`ampflow.model.attention.local_attention_chunked`, not used by the model):
    ``sum (e - s) * (ke - ks)`` over the blocks of
    :func:`ampflow.model.attention.chunk_blocks` (query rows ``[s, e)`` of ``chunk``,
    keys ``[max(0, s - w), min(n, e + w))``)."""
    total = 0
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        total += (e - s) * (min(n, e + window) - max(0, s - window))
    return total


def banded_score_elements(n: int, window: int) -> int:
    """Probabilities per head kept by the banded kernel the model runs
    (:func:`ampflow.model.attention.local_attention_banded`): ``n * (2w + 1)`` with
    ``w`` clipped to ``n - 1``, whatever the query chunk (S3 bounds only the transient
    score block). Edge rows keep their out-of-range columns (as zeros) in the same
    dense ``(n, 2w + 1)`` tensor, so they count in full."""
    return n * (2 * min(int(window), max(int(n) - 1, 0)) + 1) if n else 0


# ---------------------------------------------------------------- state
def _state(led: Ledger, dev: Device, elems: int, tensors: int, stratum: int | None = None, optimizer: bool = True) -> None:
    # parameters and gradients take the same bytes; Adam adds two moments and a step
    b = dev.spec.dtype_bytes
    led.add("parameters", elems * b, stratum, STATE)
    led.add("gradients", elems * b, stratum, STATE)
    if optimizer:
        led.add("optimizer_state", 2 * elems * b + STEP_BYTES * tensors, stratum, STATE)


def _local(params: dict[str, ParamShape], dev: Device) -> int:
    return sum(p.local_numel(dev.parts) for p in params.values())


def _per_stratum(base: dict[str, ParamShape], one: dict[str, ParamShape], dev: Device) -> int:
    """Elements a stratum adds: a description evaluated for one stratum (and its
    features) minus the same evaluated for none. Exact, since every size in the
    descriptions is linear in the number of strata and of features."""
    return _local(one, dev) - _local(base, dev)


def state_terms(led: Ledger, dev: Device) -> None:
    """Parameters, gradients and optimizer state of every component. A tensor's Adam
    ``step`` belongs to the base; a stratum's share of the per-stratum and
    per-feature parameters, and its block, belong to the stratum."""
    s = dev.spec
    d, h, fps, L = s.latent, s.hidden, s.features_per_stratum, s.n_strata
    graph = graph_encoder_params(s.n_nodes, d)
    _state(led, dev, _local(graph, dev), len(graph))
    if s.n_genes:
        rna = {**encoder_params(s.n_genes, h, d), **nb_decoder_params(s.n_genes)}
        _state(led, dev, _local(rna, dev), len(rna))
    if not s.n_features:
        return
    enc0 = encoder_params(0, h, d, FEATURE_PARALLEL)
    head0 = hic_decoder_shared_params(d, s.D, 0, 0)
    # D-proportional head parameters (u_proj) feed only the strata k >= 1: with one
    # stratum they get no gradient, so Adam keeps no state for them (the trainer still
    # counts a gradient slot per parameter)
    unused = {n: p for n, p in head0.items() if p.shard == HIDDEN_PARALLEL} if L == 1 else {}
    used = {n: p for n, p in head0.items() if n not in unused}
    _state(led, dev, _local(enc0, dev) + _local(used, dev), len(enc0) + len(used))
    _state(led, dev, _local(unused, dev), len(unused), optimizer=False)
    block = stratum_block_params(d, s.D, s.ffn_mult, s.attention)
    for k, fk in enumerate(fps):
        # input-projection columns, per-feature vectors, the strata head's row
        enc = _per_stratum(enc0, encoder_params(fk, h, d, FEATURE_PARALLEL), dev)
        head = _per_stratum(head0, hic_decoder_shared_params(d, s.D, 1, fk), dev)
        _state(led, dev, enc + head, 0, k or None)
        if k:
            _state(led, dev, _local(block, dev), len(block), k)


# ---------------------------------------------------------------- activations
def encoder_terms(led: Ledger, name: str, dev: Device) -> None:
    """Saved activations of an :class:`~ampflow.model.encoders.Encoder`'s body and
    heads, without its input (added by the caller, which knows how it is sharded)."""
    s, B, b = dev.spec, dev.B, dev.spec.dtype_bytes
    h = s.hidden
    # LeakyReLU input, BatchNorm input, dropout mask, next layer's input; dropout(p=0)
    # returns its input unchanged, so it saves no mask
    per_b_h = 4 if s.dropout > 0 else 3
    for _ in range(2):
        led.add(name, per_b_h * B * h * b)
        led.add(name, 4 * h * b)  # running mean/var, save_mean, save_invstd
    led.add(name, B * s.latent * b)  # softplus input of the std head


def graph_encoder_terms(led: Ledger, dev: Device) -> None:
    """Two graph convolutions, SELU, the Normal head and the node noise."""
    s, b = dev.spec, dev.spec.dtype_bytes
    E, gd = s.n_edges, s.n_nodes * s.latent * b
    led.add("graph_encoder", 2 * E * INDEX_BYTES + E * b + 2 * E * s.latent * b)  # src, dst, coef, 2 messages
    led.add("graph_encoder", 3 * gd)  # SELU input, Normal-head input, softplus input
    led.add("graph_encoder", gd)  # node noise


def rna_decoder_terms(led: Ledger, dev: Device, first: bool = True) -> None:
    """The NB decoder and likelihood. ``first=False``: the cross-reconstruction pass
    (from the Hi-C latent), which reads the gene latents, the library and a cell latent
    that the first passes already hold."""
    s, B, b = dev.spec, dev.B, dev.spec.dtype_bytes
    G, d = s.n_genes, s.latent
    phase = PRE if first else POST
    if first:  # gene index, u, gathered gene latents, library
        led.add("rna_decoder", G * INDEX_BYTES + B * d * b + G * d * b + B * b)
    # u v^T and its softmax, softplus scale, theta; NB: log input, theta-weighted
    # difference, log(mu) input, lgamma input, log(theta) input
    led.add("rna_decoder", 2 * B * G * b + 2 * G * b, None, phase)
    led.add("rna_decoder", 4 * B * G * b + G * b, None, phase)


def hic_decoder_terms(led: Ledger, dev: Device, first: bool = True) -> None:
    """The stratified ZINB decoder and its likelihood, per stratum.

    ``first=False``: the cross-reconstruction pass (from the RNA latent). Everything
    it computes is new (``u_D``, strata weights, every block's activations, decode and
    likelihood) and comes after the last mark; the cell latent, anchor latents,
    library and feature indices it reads are already held.
    """
    s, B, b = dev.spec, dev.B, dev.spec.dtype_bytes
    hp, fp, key_first = dev.hp, dev.fp, dev.key_first
    n, d, D, H, f = s.n_anchors, s.latent, s.D, s.heads, s.ffn_mult
    fps, L = s.features_per_stratum, s.n_strata

    def at(k):  # phase of stratum k's terms: its place in the loop, or after the loop
        return k if first else POST

    if first:
        led.add("hic_decoder_head", n * INDEX_BYTES + B * d * b)  # anchor index, u
        # The anchor latents are first saved by stratum 0's product (naive) or by
        # block 1's LayerNorm (key-first); with key-first and one stratum, never.
        if not key_first:
            led.add("hic_decoder_head", n * d * b, None, 0)
        elif L > 1:
            led.add("hic_decoder_head", n * d * b, None, 1)
        led.add("hic_decoder_head", B * b, None, 0)  # library
        for k, fk in enumerate(fps):
            led.add("hic_decoder_head", fp(fk) * INDEX_BYTES, k or None, 0)  # feature_anchor slice
    if D != d and L > 1:
        led.add("hic_decoder_head", hp(B * D) * b, None, at(1))  # u_D, first saved by stratum 1
    for k in range(L):
        led.add("hic_decoder_head", B * b, k or None, PRE if first else POST)  # strata weights (B, L)

    fk = fps[0]  # logits, softmax, softplus scale, strata-weighted library
    led.add("stratum0_decode", 2 * fp(B * fk) * b + fp(fk) * b + B * b, None, at(0))
    if key_first:
        led.add("stratum0_decode", fp(fk * d) * b, None, at(0))  # gathered anchor latents
    # The banded kernel keeps (H, n, 2w + 1) probabilities and no mask, chunked or not.
    scores = H * banded_score_elements(n, s.window) * b
    for k in range(1, L):
        fk = fps[k]
        led.add("stratum_norms", n * d * b + 4 * n * b, k, at(k))
        if s.attention:
            led.add("stratum_projections", 5 * hp(n * D) * b, k, at(k))
            led.add("stratum_attention_scores", scores, k, at(k))
        else:
            led.add("stratum_projections", 2 * hp(n * D) * b, k, at(k))
        led.add("stratum_feed_forward", 4 * f * hp(n * D) * b, k, at(k))
        keys = ceil_div(fk * D, max(dev.hp_div, dev.fp_div)) if key_first else hp(n * D)
        led.add("stratum_decode", keys * b + 2 * fp(B * fk) * b + fp(fk) * b + B * b, k, at(k))

    for k, fk in enumerate(fps):
        # five float (B, F) intermediates + the bool zero mask; theta and log input
        led.add("zinb_likelihood", 5 * fp(B * fk) * b + fp(B * fk) + 2 * fp(fk) * b, k or None, POST)


def graph_decoder_terms(led: Ledger, dev: Device) -> None:
    """Sampled edges and negatives of the graph loss, and the node KL."""
    s, b = dev.spec, dev.spec.dtype_bytes
    E, d = s.n_edges, s.latent
    if E:
        es = min(s.graph_batch, E)
        en = s.neg_samples * es
        # positives: s, t indices; v[s], v[t]; sign, logit, target, weight
        gdec = 2 * es * INDEX_BYTES + 2 * es * d * b + 4 * es * b
        if en:  # negatives: indices, gathered latents, repeated sign, logit, target
            gdec += 2 * en * INDEX_BYTES + 2 * en * d * b + 3 * en * b
        led.add("graph_decoder", gdec, None, POST)
    led.add("graph_encoder", 3 * s.n_nodes * d * b, None, POST)  # node KL
