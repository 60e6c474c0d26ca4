"""The inputs and the output of the memory model: :class:`ShapeSpec` (the shapes and
settings that determine a training step's memory) and :class:`Estimate` (the predicted
bytes, by component and by stratum). :mod:`ampflow.amp.memory.predict` computes one from
the other; both are re-exported there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...contract.config import TRAIN_DTYPE_BYTES, ModelConfig

#: Bytes per element of the dtypes the model may be measured in; the trainer's own
#: ``train.dtype`` choices (:data:`ampflow.contract.config.TRAIN_DTYPE_BYTES`) plus the half types.
DTYPE_BYTES = {**TRAIN_DTYPE_BYTES, "bfloat16": 2, "float16": 2}
#: Optimizers whose state the model counts (Adam and AdamW keep the same state).
OPTIMIZERS = ("adam", "adamw")
#: The phases of a training step whose peaks the model predicts, in order.
PHASES = ("end_of_forward", "backward", "optimizer_step")


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
    cross : bool
        Whether the step trains the cross-reconstruction term (``LossWeights.cross >
        0``): RNA decoded from the Hi-C latent and Hi-C from the RNA latent, a second
        pass through both decoders (every stratum block included) whose activations
        are alive at the end of the forward pass. It needs both modalities; a spec
        without one has nothing to cross.
    shared : int or None
        The latent dimensions the alignment term compares (``latent - private_dim``);
        None: all ``latent``.
    n_batches : int
        Batches the decoders are conditioned on (0: none): the Hi-C loadings get
        that many more columns, read with the cell latent (``B x (d + n_batches)``),
        and the RNA decoder a bias per gene and batch.
    hic_pcs : int
        Principal axes the Hi-C encoder's input is projected on (``model.hic_pcs``; 0:
        none): buffers of the axes and their centre, ``(hic_pcs + 1) x n_features``.
    hic_input_copy : bool
        Whether the Hi-C encoder reads a copy of the batch's Hi-C counts apart from
        those the likelihood scores (``train.hic_thinned: encoder``): one more
        ``B x n_features`` batch held through the step.
    optimizer_foreach : bool
        Whether the optimizer updates all parameters in one pass of foreach kernels,
        as ``torch.optim.Adam`` does on CUDA (its temporary, ``sqrt`` of the second
        moments, is as large as all parameters), or with the fused kernel the trainer
        runs on CPU (:func:`ampflow.train.trainer.make_optimizer`: no temporary). Plans
        are for accelerators: True by default; a CPU run is described with False.
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
    cross: bool = False
    shared: int | None = None
    optimizer_foreach: bool = True
    n_batches: int = 0
    hic_pcs: int = 0
    hic_input_copy: bool = False

    def __post_init__(self):
        object.__setattr__(self, "features_per_stratum", tuple(int(x) for x in self.features_per_stratum))
        object.__setattr__(self, "cross", bool(self.cross))
        object.__setattr__(self, "hic_input_copy", bool(self.hic_input_copy))
        for name in ("n_cells_batch", "latent", "hidden", "D", "heads", "ffn_mult", "graph_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("n_genes", "n_features", "n_anchors", "n_nodes", "n_edges", "window", "neg_samples", "n_batches", "hic_pcs"):
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
        cross: bool = False,
        n_batches: int = 0,
        hic_input_copy: bool = False,
    ) -> ShapeSpec:
        """The spec of a :class:`~ampflow.model.paired.PairedModel` built with
        ``model_config`` on data of these shapes.

        ``chunk`` and ``key_first`` of the config are not part of the spec: pass them
        to :func:`~ampflow.amp.memory.predict.predict` (they are strategies S3 and S4).
        ``cross``: whether the step trains the cross-reconstruction term;
        ``n_batches``: the batches the decoders are conditioned on (0: none);
        ``hic_input_copy``: the encoder reads its own copy of the Hi-C batch.
        """
        fps = tuple(int(x) for x in features_per_stratum)
        c = model_config
        return cls(
            n_cells_batch=int(batch_size), n_genes=int(n_genes), n_features=sum(fps),
            features_per_stratum=fps, n_anchors=int(n_anchors), n_nodes=int(n_nodes),
            n_edges=int(n_edges), latent=c.latent_dim, hidden=c.hidden_dim, D=c.D,
            heads=c.heads, window=c.window, ffn_mult=c.ffn_mult, attention=c.attention,
            neg_samples=c.neg_samples, graph_batch=c.graph_batch, dtype_bytes=int(dtype_bytes),
            dropout=c.dropout, cross=cross, shared=c.shared_dim, n_batches=int(n_batches), hic_pcs=c.hic_pcs,
            hic_input_copy=hic_input_copy,
        )  # fmt: skip


@dataclass(frozen=True)
class Estimate:
    """Predicted bytes of one steady-state training step on one device.

    Attributes
    ----------
    total : int
        The allocator's peak of the step: the largest of :attr:`phases` (what the
        trainer reports as ``peak_bytes``). ``total == base + sum(strata)``.
    base : int
        Everything of the peak not attributable to an attention stratum: state of the
        encoders, graph and shared decoder parts, their activations, gradients and
        transients, and stratum 0's decode and likelihood terms.
    per_stratum : float
        Mean of :attr:`strata` (0 when ``L = 1``), so that
        ``total == base + (L - 1) * per_stratum`` up to rounding. The slope of a line
        fitted to ``total`` against ``L`` estimates it; the intercept estimates
        ``base - per_stratum``.
    strata : tuple of int
        Marginal bytes of each attention stratum ``k = 1 .. L-1`` at the peak: its
        block's parameters, optimizer state (and gradients, when the peak holds
        them), its saved activations (those still held), and every
        term proportional to ``|F_k|`` (encoder input columns and weights, per-feature
        parameters and loadings, decode, likelihood, index entries).
    components : dict of str to int
        ``total`` broken down by what holds the bytes at the peak (sums to
        ``total``; the saved activations of parts that the backward pass has already
        run are gone, and a phase without gradients has none):

        ``parameters``, ``optimizer_state``
            Model state (Adam: two moments per parameter, a 4-byte step per tensor).
        ``buffers``
            The model's buffers: int64 indices (feature anchors and strata, anchor and
            gene nodes, edge lists), edge weights, signs and coefficients, BatchNorm
            running statistics.
        ``data_batch``
            The dense input batch, ``B x (G + F)`` in the run's dtype (``F`` twice
            with :attr:`ShapeSpec.hic_input_copy`).
        ``gradients``
            Gradients held at the peak: of the parameters, and of activations still to
            be consumed (the mean of the ZINB, the node latents).
        ``backward_transient``
            At a backward peak: what the part holding it (:attr:`peak_part`)
            allocates above what was held when its backward began.
        ``optimizer_transient``
            At an optimizer-step peak: Adam's temporaries.
        ``gradient_all_reduce``
            Under data parallelism, when the all-reduce of the gradients holds the
            peak: its flat buffer of every gradient.
        ``rna_encoder``, ``hic_encoder``
            MLP activations: input (``B x G`` / ``B x F``, saved by the first
            Linear), per layer the LeakyReLU input, BatchNorm input and its four
            ``(h,)`` vectors, the dropout mask and the next layer's input, and the
            softplus input of the std head.
        ``cell_latents``
            Reparameterisation noise of both cell latents, their KL terms (``loc``,
            ``std``, ``std + eps``) and the alignment difference.
        ``graph_encoder``
            Two graph convolutions (messages ``E x d``; their edge indices and
            coefficients are buffers), SELU, Normal head, node noise and node KL terms.
        ``graph_decoder``
            Sampled edges and negatives: gathered node latents, signs, logits,
            targets, weights and their int64 indices.
        ``rna_decoder``
            NB decoder (``u``, gathered gene latents, ``B x G`` product and softmax)
            and the NB likelihood's ``B x G`` intermediates.
        ``hic_decoder_head``
            The Hi-C decoder's shared inputs: ``u`` (and ``u_D`` when ``D != d``),
            contacts per stratum ``B x L``, anchor latents.
        ``stratum0_decode``
            Stratum 0's logits, softmax and per-feature softplus scale.
        ``stratum_norms``
            Per attention stratum: LayerNorm statistics (``4 n``) and the normalised
            input ``n x d`` (replicated under S5).
        ``stratum_projections``
            Per attention stratum, D-proportional ``n x D`` tensors: values, keys,
            scaled queries, attention sum, feed-forward LayerNorm output.
        ``stratum_attention_scores``
            Per attention stratum: the banded kernel's softmax probabilities
            ``H n (2w + 1)`` (``w`` clipped to ``n - 1``; no mask), with or without
            S3's query chunks.
        ``stratum_feed_forward``
            Per attention stratum, GEGLU: ``w_ff`` output ``2 f n D``, GELU output
            and product ``f n D`` each.
        ``stratum_decode``
            Per attention stratum: keys ``n x D`` saved by ``u_D key^T`` (naive) or
            gathered keys ``|F_k| x D`` (key-first, S4), logits and softmax
            ``B x |F_k|``, softplus scale.
        ``zinb_likelihood``
            ZINB over ``B x F``: five float intermediates, the bool zero mask, two
            ``(F,)`` vectors.

        With :attr:`ShapeSpec.cross` the second pass through both decoders adds to
        ``rna_decoder``, ``hic_decoder_head``, ``stratum0_decode``, the ``stratum_*``
        components and ``zinb_likelihood`` what it creates anew (the cell latents, node
        latents, libraries and index tensors it reads are already held).
    marks : tuple of int
        Predicted bytes held after stratum ``k``'s part of the forward pass
        (``k = 0 .. L-1``): the state, the activations saved so far and the strata
        means waiting for their concatenation (``B x |F_j|``, ``j <= k``); the
        trainer's ``stratum_bytes``. The cross-reconstruction pass comes after the last
        mark.
    transient : dict of str to int
        Short-lived forward intermediates: ``decode_scores`` (the naive decode's
        ``B x n`` product, removed by S4) and ``attention_scores`` (one query block's
        ``H x rows x (2w + 1)`` scores before the softmax: ``rows = n`` without S3, the
        chunk with it). Their backward counterparts, alive when more is held, are the
        ones the backward phase counts.
    phases : dict of str to int
        The predicted peak of each phase: ``end_of_forward`` (state and saved
        activations), ``backward`` (the largest over the backward pass's parts) and
        ``optimizer_step``.
    peak_phase : str
        The phase holding :attr:`total`.
    peak_part : str
        At a backward peak, the part of the model whose backward holds it
        (``zinb_likelihood``, ``graph_decoder``, ...); else :attr:`peak_phase`.
    """

    total: int
    base: int
    per_stratum: float
    components: dict = field(default_factory=dict)
    strata: tuple = ()
    marks: tuple = ()
    transient: dict = field(default_factory=dict)
    phases: dict = field(default_factory=dict)
    peak_phase: str = ""
    peak_part: str = ""
