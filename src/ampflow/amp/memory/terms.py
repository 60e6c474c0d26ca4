"""The terms of the memory model, component by component.

The functions here fill a :class:`Ledger` with what one device holds during a
training step of the paired model (see :mod:`ampflow.amp.memory.predict` for the
phases and how they are combined):

* **state**, held throughout: parameters, buffers, optimizer state and the data batch,
  counted from the model's own shape description (:mod:`ampflow.contract.model_shapes`);
* **saved activations**: what autograd keeps for backward, closed-form in the shapes
  from what PyTorch saves for each operation the model runs;
* **backward steps**: one per part of the forward pass, in forward order. The backward
  pass runs them in reverse; each holds a transient above what was held when it began
  (gradient buffers of its inputs and parameters, temporaries of its derivative
  formulas), frees the activations its part saved, and leaves behind the gradients it
  produced (of parameters, and of activations that an earlier part still has to
  consume).

The transients were counted operator by operator against the allocator (the
profiler's allocation timeline of each part's backward, ``scripts/bench_memory_model.py``
checks the sum): they are what the derivative formulas of the operations allocate
while the part's saved tensors are still alive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...contract.attention_blocks import band_width, block_rows, largest_group_rows
from ...contract.model_shapes import ParamShape, encoder_params, graph_encoder_params, hic_decoder_shared_params, nb_decoder_params, stratum_block_params
from ...contract.strategies import FEATURE_PARALLEL, HIDDEN_PARALLEL
from .shapes import ShapeSpec

#: Index tensors (gathers, edge lists) are int64.
INDEX_BYTES = 8
#: Adam's per-tensor ``step`` is a float32 scalar (torch's default dtype).
STEP_BYTES = 4

# Forward order used for the per-stratum marks: state exists throughout, "pre" is
# everything saved before the Hi-C decoder's loop over strata, stratum k's own terms
# follow at phase k, and "post" (likelihood of the Hi-C counts, KL terms, graph decoder,
# alignment, cross-reconstruction) comes after the loop.
STATE, PRE, POST = "state", "pre", "post"

#: ``(bytes, stratum)`` pieces: a stratum ``k >= 1`` or None (the base).
Shares = list[tuple[int, "int | None"]]


@dataclass
class BackwardStep:
    """The backward pass of one part of the forward pass.

    Attributes
    ----------
    component : str
        What the part is (``zinb_likelihood``, ``stratum_block``, ...).
    transient : list of (int, stratum)
        Bytes above what was held when the step began, at the step's peak (its saved
        tensors are still alive then).
    kept : list of (int, stratum)
        Bytes the step leaves allocated: gradients of its parameters, and gradients of
        activations that an earlier part consumes (freed by that part: ``release``).
    release : list of (int, stratum)
        Bytes kept by later steps that this step consumes and frees.

    The part's saved activations are the :class:`Ledger` items added after the step
    was opened (:meth:`Ledger.step`); the step frees them.
    """

    component: str
    transient: Shares = field(default_factory=list)
    kept: Shares = field(default_factory=list)
    release: Shares = field(default_factory=list)


class Ledger:
    """Byte entries tagged with a component, the stratum they belong to (None: base),
    the phase of the forward pass in which they appear and the backward step that
    frees them (None: state, never freed), plus the backward steps in forward order."""

    def __init__(self):
        self.items: list[tuple[str, int | None, object, int, int | None]] = []
        self.steps: list[BackwardStep] = []
        self.param_grads: Shares = []  # every used parameter's gradient, for the optimizer phase

    def step(self, component: str) -> BackwardStep:
        """Open the backward step of the next part of the forward pass: the items added
        from now on are its saved activations."""
        self.steps.append(BackwardStep(component))
        return self.steps[-1]

    def add(self, component: str, nbytes: int, stratum: int | None = None, phase: object = PRE) -> None:
        """A saved activation of the current step (or, with ``phase=STATE``, state)."""
        if nbytes:
            owner = None if phase == STATE else len(self.steps) - 1
            self.items.append((component, stratum, phase, int(nbytes), owner))


def ceil_div(a: int, b: int) -> int:
    return -(-int(a) // int(b))


@dataclass(frozen=True)
class Device:
    """One device's view of a :class:`ShapeSpec` under a set of strategies.

    ``B`` is this device's cells; ``hp_div`` and ``fp_div`` are the ways S5 and S2 split
    the D-proportional and the feature-proportional terms (1 when the strategy is off);
    ``dp`` is the data-parallel degree (gradients are all-reduced when it is > 1);
    ``stacked``: the Hi-C decoder computes every stratum in one pass (the
    single-process training step, :func:`~ampflow.model.decoders.stacked_keys`).
    """

    spec: ShapeSpec
    B: int
    chunk: int
    key_first: bool
    hp_div: int
    fp_div: int
    dp: int = 1
    stacked: bool = False

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


def banded_score_elements(n: int, window: int) -> int:
    """Probabilities per head kept by the banded kernel the model runs
    (:func:`ampflow.model.attention.local_attention_banded`): ``n * (2w + 1)`` with
    ``w`` clipped to ``n - 1``, whatever the query chunk (S3 bounds only the transient
    score block). Edge rows keep their out-of-range columns (as zeros) in the same
    dense ``(n, 2w + 1)`` tensor, so they count in full."""
    return n * (2 * min(int(window), max(int(n) - 1, 0)) + 1) if n else 0


def attention_transients(n: int, window: int, chunk: int | None, heads: int, hp_nD: int, b: int) -> tuple[int, int]:
    """Bytes the banded kernel (:class:`ampflow.model.attention._BandedLocalAttention`)
    allocates beyond what it keeps, at its forward's and at its backward's peak.

    ``hp_nD`` is ``n x D`` on this rank (``H`` heads of ``D_h = hp_nD / (n H)``), ``g``
    the rows of the largest group of blocks
    (:func:`ampflow.contract.attention_blocks.largest_group_rows`), ``R`` its block rows,
    ``S = R + 2w`` the keys a block sees and ``W = 2w + 1`` the band. Forward: the keys
    and values padded by ``w`` rows (``2 H (n + 2w) D_h``) and the largest of three
    moments of a group: the block product (a copy of the queries' blocks, ``H g D_h``,
    and of the keys' windows, ``H (g / R) S D_h``, and its ``H g S`` scores); the
    softmax (the scores, the band and its softmax, ``2 H g W``); the weighted values
    (the scores, the values' windows and the product). Backward: ``dq`` and the padded
    ``dk``, ``dv``, keys and values, then a group's probabilities as block scores and
    the gradient of its scores (``2 H g S``) beside copies of the gradient's blocks and
    of the values' windows.
    """
    if n <= 0:
        return 0, 0
    width = band_width(n, window)
    w = (width - 1) // 2
    r = block_rows(n, window, chunk)
    span = r + 2 * w
    g = largest_group_rows(n, window, chunk)
    dh = hp_nD / (n * heads)
    windows = heads * (g / r) * span * dh  # one tensor's windows of a group, copied
    blocks = heads * g * dh  # one tensor's blocks of a group, copied
    scores = heads * g * span
    padded = heads * (n + 2 * w) * dh
    forward = 2 * padded + max(blocks + windows + scores, scores + 2 * heads * g * width, scores + windows + blocks)
    backward = hp_nD + 4 * padded + 2 * scores + blocks + windows
    return int(math.ceil(forward * b)), int(math.ceil(backward * b))


# ---------------------------------------------------------------- state
def _local(params: dict[str, ParamShape], dev: Device) -> int:
    return sum(p.local_numel(dev.parts) for p in params.values())


def _per_stratum(base: dict[str, ParamShape], one: dict[str, ParamShape], dev: Device) -> int:
    """Elements a stratum adds: a description evaluated for one stratum (and its
    features) minus the same evaluated for none. Exact, since every size in the
    descriptions is linear in the number of strata and of features."""
    return _local(one, dev) - _local(base, dev)


class _Params:
    """Parameters of one part, by stratum share: their state (parameters and
    optimizer state) goes to the ledger at once, their gradients to the part's backward
    step."""

    def __init__(self, led: Ledger, dev: Device):
        self.led = led
        self.b = dev.spec.dtype_bytes
        self.grads: Shares = []

    def add(self, elems: int, tensors: int, stratum: int | None = None, used: bool = True) -> None:
        """``elems`` parameter elements in ``tensors`` tensors; ``used=False``: no
        gradient reaches them (``set_to_none`` leaves their ``.grad`` None and Adam
        keeps no state for them)."""
        b, led = self.b, self.led
        led.add("parameters", elems * b, stratum, STATE)
        if not used:
            return
        led.add("optimizer_state", 2 * elems * b + STEP_BYTES * tensors, stratum, STATE)
        self.grads.append((elems * b, stratum))
        led.param_grads.append((elems * b, stratum))


def buffer_terms(led: Ledger, dev: Device) -> None:
    """The model's buffers (index tensors, edge lists, BatchNorm running statistics,
    the Hi-C input's principal axes and centre) and the data batch, held throughout
    the step."""
    s, B, b = dev.spec, dev.B, dev.spec.dtype_bytes
    E, h = s.n_edges, s.hidden
    # edge src/dst (shared by the model and its graph convolution), weight, sign, coef
    n = 2 * E * INDEX_BYTES + 3 * E * b + s.n_genes * INDEX_BYTES
    bn = 2 * (2 * h * b + INDEX_BYTES)  # two BatchNorm layers: running mean, var, count
    n += bn * (2 if s.n_genes else 1)
    if s.n_features:
        # anchor nodes, feature strata (the model), feature anchors (the decoder)
        n += s.n_anchors * INDEX_BYTES
        led.add("buffers", n, None, STATE)
        # per feature: its stratum and anchor, and (the plain decoder, not one sharded by
        # S2 or S5) its place in the padded softmax over strata (decoders._strata_means)
        indices = 3 if dev.hp_div == 1 and dev.fp_div == 1 else 2
        for k, fk in enumerate(s.features_per_stratum):
            # the indices; the input's axes and centre (whole on every rank)
            projection = (s.hic_pcs + 1) * fk * b if s.hic_pcs else 0
            led.add("buffers", indices * fk * INDEX_BYTES + projection, k or None, STATE)
            # every tp rank holds the dense batch with all features (twice when the
            # encoder reads a thinned copy of it)
            led.add("data_batch", (2 if s.hic_input_copy else 1) * B * fk * b, k or None, STATE)
    else:
        led.add("buffers", n, None, STATE)
    led.add("data_batch", B * s.n_genes * b, None, STATE)


# ---------------------------------------------------------------- parts of the forward pass
def encoder_terms(led: Ledger, name: str, dev: Device, widths: list[int]) -> None:
    """An :class:`~ampflow.model.encoders.Encoder` on ``sum(widths)`` input columns
    (``widths[k]`` of stratum ``k``; one entry for the RNA encoder): its saved
    activations, parameters and backward step.

    Backward: the first Linear's weight gradient (``h x n_in``) is allocated while the
    input it is computed from is still alive; the hidden layers' gradients (``B x h``)
    are small beside it.
    """
    s, B, b = dev.spec, dev.B, dev.spec.dtype_bytes
    h, d = s.hidden, s.latent
    step = led.step(name)
    shard = FEATURE_PARALLEL if name == "hic_encoder" else None
    params = _Params(led, dev)
    enc0 = encoder_params(0, h, d, shard)
    params.add(_local(enc0, dev), len(enc0))
    for k, width in enumerate(widths):
        led.add(name, dev.fp(B * width) * b if shard else B * width * b, k or None)  # first Linear's input
        cols = _per_stratum(enc0, encoder_params(width, h, d, shard), dev)
        params.add(cols, 0, k or None)
        step.transient.append((cols * b, k or None))
    # LeakyReLU input, BatchNorm input, dropout mask, next layer's input; dropout(p=0)
    # returns its input unchanged, so it saves no mask
    per_b_h = 4 if s.dropout > 0 else 3
    for _ in range(2):
        led.add(name, per_b_h * B * h * b)
        led.add(name, 4 * h * b)  # running mean/var, save_mean, save_invstd
    led.add(name, B * d * b)  # softplus input of the std head
    step.transient.append((2 * B * h * b, None))
    step.kept.extend(params.grads)


def cell_noise_terms(led: Ledger, dev: Device) -> None:
    """The reparameterised cell latent ``loc + std * eps``: the noise is saved."""
    led.step("cell_latents")
    led.add("cell_latents", dev.B * dev.spec.latent * dev.spec.dtype_bytes)


def graph_encoder_terms(led: Ledger, dev: Device) -> BackwardStep:
    """Two graph convolutions, SELU, the Normal head and the node noise.

    Backward: each convolution's message gradient (``E x d``, gathered along the edges)
    and the node gradient it is scattered into (``N x d``). The step consumes the node
    gradients the graph decoder and the node KL left.
    """
    s, b = dev.spec, dev.spec.dtype_bytes
    E, N, d = s.n_edges, s.n_nodes, s.latent
    step = led.step("graph_encoder")
    params = _Params(led, dev)
    graph = graph_encoder_params(N, d)
    params.add(_local(graph, dev), len(graph))
    led.add("graph_encoder", 2 * E * d * b)  # the two convolutions' messages
    led.add("graph_encoder", 3 * N * d * b)  # SELU input, Normal-head input, softplus input
    led.add("graph_encoder", N * d * b)  # node noise
    step.transient.append((E * d * b + N * d * b, None))
    step.kept.extend(params.grads)
    return step


def rna_decoder_terms(led: Ledger, dev: Device, first: bool = True) -> None:
    """The NB decoder and likelihood. ``first=False``: the cross-reconstruction pass
    (from the Hi-C latent), which reads the gene latents, the library and a cell latent
    that the first passes already hold.

    Backward: the NB log-likelihood's derivatives hold four ``B x G`` temporaries above
    its saved tensors at their peak (the gradient of the mean, of ``log(theta + mu)``
    and the two terms of each ``log`` / ``lgamma`` derivative).
    """
    s, B, b = dev.spec, dev.B, dev.spec.dtype_bytes
    G, d = s.n_genes, s.latent
    phase = PRE if first else POST
    step = led.step("rna_decoder")
    if first:
        params = _Params(led, dev)
        nb = nb_decoder_params(G, s.n_batches)
        params.add(_local(nb, dev), len(nb))
        step.kept.extend(params.grads)
        led.add("rna_decoder", B * d * b + G * d * b + B * b)  # u, gathered gene latents, library
    # u v^T and its softmax, softplus scale, theta; NB: log input, theta-weighted
    # difference, log(mu) input, lgamma input, log(theta) input
    led.add("rna_decoder", 2 * B * G * b + 2 * G * b, None, phase)
    led.add("rna_decoder", 4 * B * G * b + G * b, None, phase)
    step.transient.append((4 * B * G * b, None))


def hic_decoder_terms(led: Ledger, dev: Device, first: bool = True) -> None:
    """The stratified ZINB decoder and its likelihood, per stratum.

    ``first=False``: the cross-reconstruction pass (from the RNA latent). Everything
    it computes is new (``u_D``, every block's activations, decode and
    likelihood) and comes after the last mark; the cell latent, anchor latents,
    library and feature indices it reads are already held.

    Backward, in reverse: the ZINB log-likelihood first, whose derivatives hold eight
    ``B x F`` temporaries above its saved tensors at their peak (the zero mask already
    freed), and leave the gradient of the mean (``B x F``) for the strata to consume;
    then each stratum's decode (the softmax and scale gradients, ``B x |F_k|``, and the
    naive decode's scattered ``B x n`` score gradient or key-first's ``n x D`` key
    gradient) and block (the hand-written attention backward's ``dq``, ``dk``, ``dv``
    and two ``H x rows x (2w + 1)`` score blocks, or the feed-forward's ``2 f n D``
    gradient, whichever is larger).
    """
    s, B, b = dev.spec, dev.B, dev.spec.dtype_bytes
    hp, fp, key_first = dev.hp, dev.fp, dev.key_first
    n, d, D, H, f = s.n_anchors, s.latent, s.D, s.heads, s.ffn_mult
    fps, L = s.features_per_stratum, s.n_strata

    def at(k):  # phase of stratum k's terms: its place in the loop, or after the loop
        return k if first else POST

    nb = s.n_batches
    head_step = led.step("hic_decoder_head")
    block = stratum_block_params(d, D, f, s.attention)
    if first:
        params = _Params(led, dev)
        head0 = hic_decoder_shared_params(d, D, 0, 0, nb)
        # D-proportional head parameters (u_proj) feed only the strata k >= 1: with one
        # stratum they get no gradient, so neither a gradient nor Adam state exists
        unused = {m: p for m, p in head0.items() if p.shard == HIDDEN_PARALLEL} if L == 1 else {}
        used = {m: p for m, p in head0.items() if m not in unused}
        params.add(_local(used, dev), len(used))
        params.add(_local(unused, dev), len(unused), used=False)
        for k, fk in enumerate(fps):
            # per-feature vectors and loadings
            head = _per_stratum(head0, hic_decoder_shared_params(d, D, 1, fk, nb), dev)
            params.add(head, 0, k or None)
        head_step.kept.extend(params.grads)
        led.add("hic_decoder_head", B * d * b)  # u
        if nb:  # what the loadings read: u and the batch indicators, side by side
            led.add("hic_decoder_head", B * (d + nb) * b)
        # The anchor latents are gathered before the decoder runs and saved by stratum
        # 0's product (naive) or by block 1's LayerNorm (key-first); with key-first and
        # one stratum, never (they are then freed with the forward pass's locals).
        if not key_first or L > 1:
            led.add("hic_decoder_head", n * d * b)
        for k in range(L):  # contacts per stratum (B, L), column k
            led.add("hic_decoder_head", B * b, k or None, 0)
    if nb and not first:  # the cross pass's own [u, c]
        led.add("hic_decoder_head", B * (d + nb) * b, None, POST)
    if D != d and L > 1:
        led.add("hic_decoder_head", hp(B * D) * b, None, at(1))  # u_D, first saved by stratum 1

    _, attention = attention_transients(n, s.window, dev.chunk or None, H, hp(n * D), b)
    scores = H * banded_score_elements(n, s.window) * b  # (H, n, 2w + 1), no mask, chunked or not

    feed_forward = 2 * f * hp(n * D) * b  # the backward's transient of one block's feed-forward

    def attention_part(k: int, step: BackwardStep) -> None:
        """Stratum k's block up to its attention: its parameters (first pass), the input
        LayerNorm, the projections and the attention's probabilities."""
        if first:
            bp = _Params(led, dev)
            bp.add(_local(block, dev), len(block), k)
            step.kept.extend(bp.grads)
        led.add("stratum_norms", n * d * b + 2 * n * b, k, at(k))
        if s.attention:
            led.add("stratum_projections", 5 * hp(n * D) * b, k, at(k))
            led.add("stratum_attention_scores", scores, k, at(k))
        else:
            led.add("stratum_projections", 2 * hp(n * D) * b, k, at(k))

    def feed_forward_part(k: int) -> None:
        """Stratum k's feed-forward: its LayerNorm's statistics and the GEGLU's tensors."""
        led.add("stratum_norms", 2 * n * b, k, at(k))
        led.add("stratum_feed_forward", 4 * f * hp(n * D) * b, k, at(k))

    # stacked strata (the single-process training step, unchunked: decoders.stacked_keys):
    # every block's attention is one part of the forward pass, every block's feed-forward
    # the next and every stratum's decode the one after, so each backward holds the
    # transients of all strata at once. The batched products also save the stacked copies
    # of the blocks' parameters, and the feed-forward's LayerNorm its normalised input
    # (each stratum's scale and shift applied apart).
    stacked = dev.stacked and L > 1
    if stacked:
        attention_step = led.step("stratum_block")
        for k in range(1, L):
            attention_part(k, attention_step)
            led.add("stratum_parameters_stacked", _local(block, dev) * b, k, at(k))
            if s.attention:
                attention_step.transient.append((attention, k))
        feed_forward_step = led.step("stratum_feed_forward")
        for k in range(1, L):
            feed_forward_part(k)
            led.add("stratum_norms", hp(n * D) * b, k, at(k))
            feed_forward_step.transient.append((feed_forward, k))
        decode_step = led.step("stratum_decode")
    for k in range(L):
        fk = fps[k]
        if k and not stacked:
            step = led.step("stratum_block")
            attention_part(k, step)
            feed_forward_part(k)
            step.transient.append((max(feed_forward, attention) if s.attention else feed_forward, k))
        step = decode_step if stacked else led.step("stratum_decode")
        # the scattered gradient of the gathered keys (key-first) or of the B x n scores,
        # and the keys' gradient
        width_k = hp(D) if k else d
        scatter = (fp(fk) * width_k if key_first else B * n) * b + n * width_k * b
        step.transient.append((2 * fp(B * fk) * b + scatter, k or None))
        if k == 0:
            step.release.append((fp(B * s.n_features) * b, None))  # the mean's gradient
        if k == 0:  # logits, softmax, softplus scale
            led.add("stratum0_decode", 2 * fp(B * fk) * b + fp(fk) * b, None, at(0))
            if key_first:
                led.add("stratum0_decode", fp(fk * d) * b, None, at(0))  # gathered anchor latents
        else:
            keys = ceil_div(fk * D, max(dev.hp_div, dev.fp_div)) if key_first else hp(n * D)
            led.add("stratum_decode", keys * b + 2 * fp(B * fk) * b + fp(fk) * b, k, at(k))
        if stacked:
            # one softmax over the strata side by side, each padded to the widest
            # (decoders._strata_means): its saved output is that wide
            led.add("stratum_decode", B * (max(fps) - fk) * b, k or None, at(k))
    if stacked:
        # The backward of that softmax holds two gradients of its padded width, and
        # frees them before the logits' gradients and the scattered score gradients
        # above are made: the step's transient is the larger of the two moments.
        softmax = 2 * B * L * max(fps) * b
        head = sum(x for x, _ in decode_step.transient)
        decode_step.transient.append((max(0, softmax - head), None))

    step = led.step("zinb_likelihood")
    for k, fk in enumerate(fps):
        # five float (B, F) intermediates + the bool zero mask; theta and log input
        led.add("zinb_likelihood", 5 * fp(B * fk) * b + fp(B * fk) + 2 * fp(fk) * b, k or None, POST)
        step.transient.append((8 * fp(B * fk) * b - fp(B * fk), k or None))
    step.kept.append((fp(B * s.n_features) * b, None))  # the mean's gradient, consumed by the strata


def cell_kl_terms(led: Ledger, dev: Device) -> None:
    """KL terms of both cell latents (``loc``, ``std``, ``std + eps``) and the
    alignment difference (shared dimensions)."""
    s, B, b = dev.spec, dev.B, dev.spec.dtype_bytes
    d = s.latent
    led.step("cell_latents")
    if s.n_features:
        led.add("cell_latents", 3 * B * d * b, None, POST)
    if s.n_genes:
        led.add("cell_latents", 3 * B * d * b, None, POST)
        if s.n_features:
            aligned = d if s.shared is None else s.shared
            led.add("cell_latents", B * aligned * b, None, POST)


def graph_decoder_terms(led: Ledger, dev: Device, nodes: BackwardStep) -> None:
    """Sampled edges and negatives of the graph loss, and the node KL.

    Backward: the product of gathered node latents gets two gradients (``en x d`` for
    the negatives, then ``es x d`` for the positives), scattered into one node gradient
    (``N x d``) that stays until the graph encoder consumes it; the node KL leaves the
    gradients of ``loc`` and ``std`` (``N x d`` each) after four ``N x d``
    temporaries.
    """
    s, b = dev.spec, dev.spec.dtype_bytes
    E, d, N = s.n_edges, s.latent, s.n_nodes
    if E:
        step = led.step("graph_decoder")
        es = min(s.graph_batch, E)
        en = s.neg_samples * es
        # positives: s, t indices; v[s], v[t]; sign, logit, target, weight
        gdec = 2 * es * INDEX_BYTES + 2 * es * d * b + 4 * es * b
        if en:  # negatives: indices, gathered latents, repeated sign, logit, target
            gdec += 2 * en * INDEX_BYTES + 2 * en * d * b + 3 * en * b
        led.add("graph_decoder", gdec, None, POST)
        step.transient.append((2 * max(en, es) * d * b, None))
        step.kept.append((N * d * b, None))
    step = led.step("graph_encoder")
    led.add("graph_encoder", 3 * N * d * b, None, POST)  # node KL
    step.transient.append((4 * N * d * b, None))
    step.kept.append((2 * N * d * b, None))
    # the graph encoder's step (``nodes``) consumes the node gradients left here
    nodes.release.append(((3 if E else 2) * N * d * b, None))
