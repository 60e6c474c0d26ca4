"""The parameter shapes of the paired model, per component: one description for the
modules and for the memory model.

The modules in :mod:`ampflow.model` build their layers from these functions (sizes are
read from here, not restated), and :mod:`ampflow.amp.memory.predict` counts parameters,
gradients and optimizer state from the same functions, so adding a parameter to a
component is one edit here (plus the module line that creates it), and
``tests/test_memory_model.py`` checks the description against ``named_parameters`` of
the real modules.

Every function returns ``{name: ParamShape}`` with names relative to the component and
in the order in which :meth:`torch.nn.Module.named_parameters` lists them (a module's
own parameters first, then its submodules' in the order they were assigned).
Checkpoints and sharded optimizer state map parameters by name and position, so that
order is part of the contract.

Torch-free: the profile and the diagnosis read it without building a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .strategies import FEATURE_PARALLEL, HIDDEN_PARALLEL

#: Strategies that split a parameter along one of its dimensions.
SPLITTING = (FEATURE_PARALLEL, HIDDEN_PARALLEL)


@dataclass(frozen=True)
class ParamShape:
    """Shape of one parameter and the dimension a tensor-parallel strategy splits.

    Parameters
    ----------
    shape : tuple of int
    shard : str or None
        The strategy that gives each rank of the tp group a slice of this parameter:
        :data:`~ampflow.contract.strategies.HIDDEN_PARALLEL` (S5; the dimension is
        proportional to the decoder width D), :data:`~ampflow.contract.strategies.FEATURE_PARALLEL`
        (S2; the dimension has one entry per Hi-C feature), or None (replicated).
    dim : int
        The dimension ``shard`` splits (ignored when ``shard`` is None).
    """

    shape: tuple[int, ...]
    shard: str | None = None
    dim: int = 0

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(x) for x in self.shape))
        if any(x < 0 for x in self.shape):
            raise ValueError(f"negative size in shape {self.shape}")
        if self.shard is not None:
            if self.shard not in SPLITTING:
                raise ValueError(f"shard must be one of {SPLITTING} or None, got {self.shard!r}")
            if not 0 <= self.dim < len(self.shape):
                raise ValueError(f"dim {self.dim} out of range for shape {self.shape}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_numel(self, parts: dict[str, int] | None = None) -> int:
        """Elements one rank holds when ``parts[shard]`` ranks split :attr:`dim`.

        A dimension that does not divide evenly is cut into near-equal pieces; the
        largest piece is counted (the rank with the most memory).
        """
        n = (parts or {}).get(self.shard, 1) if self.shard else 1
        if n == 1:
            return self.numel
        shape = list(self.shape)
        shape[self.dim] = -(-shape[self.dim] // n)
        return math.prod(shape)


def _prefixed(prefix: str, params: dict[str, ParamShape]) -> dict[str, ParamShape]:
    return {f"{prefix}.{name}": p for name, p in params.items()}


# ------------------------------------------------------------------ encoders
#: Positions in ``Encoder.body`` (Linear, LeakyReLU, BatchNorm1d, Dropout, twice) of the
#: layers that hold parameters: (Linear, BatchNorm1d) per hidden layer.
ENCODER_LAYERS = ((0, 2), (4, 6))


def encoder_params(n_in: int, hidden: int, latent: int, input_shard: str | None = None) -> dict[str, ParamShape]:
    """:class:`~ampflow.model.encoders.Encoder`: two hidden layers and a Normal head.

    Parameters
    ----------
    n_in, hidden, latent : int
        Input features, hidden width, latent size.
    input_shard : str or None
        Strategy that splits the input features (the Hi-C encoder's input columns under
        S2, :data:`~ampflow.contract.strategies.FEATURE_PARALLEL`).
    """
    p: dict[str, ParamShape] = {}
    width, shard = n_in, input_shard  # only the first layer reads the input features
    for linear, norm in ENCODER_LAYERS:
        p[f"body.{linear}.weight"] = ParamShape((hidden, width), shard, 1)
        p[f"body.{linear}.bias"] = ParamShape((hidden,))
        p[f"body.{norm}.weight"] = ParamShape((hidden,))
        p[f"body.{norm}.bias"] = ParamShape((hidden,))
        width, shard = hidden, None
    for head in ("loc", "std"):
        p[f"{head}.weight"] = ParamShape((latent, hidden))
        p[f"{head}.bias"] = ParamShape((latent,))
    return p


def graph_encoder_params(n_nodes: int, latent: int) -> dict[str, ParamShape]:
    """:class:`~ampflow.model.graph.GraphEncoder`: node embeddings and a Normal head
    (the graph convolutions hold only buffers)."""
    p = {"embedding": ParamShape((n_nodes, latent))}
    for head in ("loc", "std"):
        p[f"{head}.weight"] = ParamShape((latent, latent))
        p[f"{head}.bias"] = ParamShape((latent,))
    return p


# ------------------------------------------------------------------ decoders
def nb_decoder_params(n_genes: int, n_batches: int = 0) -> dict[str, ParamShape]:
    """:class:`~ampflow.model.decoders.NBDecoder`: per-gene scale, bias, log dispersion;
    with batches, a bias per gene and batch."""
    p = {name: ParamShape((n_genes,)) for name in ("scale_lin", "bias", "log_theta")}
    if n_batches:
        p["batch_bias"] = ParamShape((n_genes, n_batches))
    return p


def stratum_block_params(latent: int, D: int, ffn_mult: int, attention: bool) -> dict[str, ParamShape]:
    """:class:`~ampflow.model.decoders.StratumBlock`, the keys of one stratum k >= 1.

    S5 splits every D-proportional parameter: the channels of D (rows of ``w_v``,
    ``w_k``, both LayerNorm vectors of ``norm_ff`` and ``w_out.bias``), the input
    channels of ``w_ff`` (its output rows are the two GEGLU halves, whose slices the
    ranks take after an all-reduce, so only its bias is split by rows) and the
    feed-forward width ``ffn_mult * D`` of ``w_out``. The input LayerNorm acts on the
    replicated latents and stays whole.
    """
    f = ffn_mult
    p = {
        "norm_in.weight": ParamShape((latent,)),
        "norm_in.bias": ParamShape((latent,)),
        "w_v.weight": ParamShape((D, latent), HIDDEN_PARALLEL, 0),
    }
    if attention:
        p["w_k.weight"] = ParamShape((D, latent), HIDDEN_PARALLEL, 0)
    p.update({
        "norm_ff.weight": ParamShape((D,), HIDDEN_PARALLEL, 0),
        "norm_ff.bias": ParamShape((D,), HIDDEN_PARALLEL, 0),
        "w_ff.weight": ParamShape((2 * f * D, D), HIDDEN_PARALLEL, 1),
        "w_ff.bias": ParamShape((2 * f * D,), HIDDEN_PARALLEL, 0),
        "w_out.weight": ParamShape((D, f * D), HIDDEN_PARALLEL, 1),
        "w_out.bias": ParamShape((D,), HIDDEN_PARALLEL, 0),
    })  # fmt: skip
    return p


#: Per-feature vectors of the Hi-C decoder, in registration order.
FEATURE_VECTORS = ("scale_lin", "bias", "log_theta", "zi_logits")


def hic_decoder_shared_params(latent: int, D: int, n_strata: int, n_features: int, n_batches: int = 0) -> dict[str, ParamShape]:
    """The parameters of :class:`~ampflow.model.decoders.StratifiedZINBDecoder` that
    are not in a stratum block: per-feature vectors (split by S2), the projection
    ``u_proj`` of the cell latent to width D when ``D != latent`` (split by S5) and the
    per-feature loadings of the cell latent (one row per feature, split by S2), with
    ``n_batches`` more columns when the model is conditioned on batches (the per-batch
    biases, read by the batch indicators).

    The size of each is linear in ``n_strata`` and ``n_features``, which lets the
    memory model attribute a stratum's share by evaluating this with one stratum and
    its features.
    """
    p = {name: ParamShape((n_features,), FEATURE_PARALLEL, 0) for name in FEATURE_VECTORS}
    if D != latent:
        p["u_proj.weight"] = ParamShape((D, latent), HIDDEN_PARALLEL, 0)
    p["loading"] = ParamShape((n_features, latent + n_batches), FEATURE_PARALLEL, 0)
    return p


def hic_decoder_params(latent: int, D: int, ffn_mult: int, attention: bool, n_strata: int, n_features: int, n_batches: int = 0) -> dict[str, ParamShape]:
    """All parameters of a :class:`~ampflow.model.decoders.StratifiedZINBDecoder`:
    its own per-feature vectors and loadings, ``blocks.{k-1}.*`` for strata ``k = 1 .. L-1``,
    then ``u_proj``."""
    shared = hic_decoder_shared_params(latent, D, n_strata, n_features, n_batches)
    p = {name: shared[name] for name in (*FEATURE_VECTORS, "loading")}
    block = stratum_block_params(latent, D, ffn_mult, attention)
    for i in range(n_strata - 1):
        p.update(_prefixed(f"blocks.{i}", block))
    p.update({name: s for name, s in shared.items() if name not in p})
    return p


# ------------------------------------------------------------------ the paired model
def paired_model_params(cfg, n_genes: int, n_strata: int, n_features: int, n_nodes: int, n_batches: int = 0) -> dict[str, ParamShape]:
    """All parameters of a :class:`~ampflow.model.paired.PairedModel` built with the
    :class:`~ampflow.contract.config.ModelConfig` ``cfg``, by full name (``n_genes = 0``:
    the Hi-C-only model, without RNA encoder and decoder; ``n_batches``: the batches
    it is conditioned on, 0 for none)."""
    d = cfg.latent_dim
    p: dict[str, ParamShape] = {}
    p.update(_prefixed("graph_encoder", graph_encoder_params(n_nodes, d)))
    if n_genes:
        p.update(_prefixed("rna_encoder", encoder_params(n_genes, cfg.hidden_dim, d)))
    p.update(_prefixed("hic_encoder", encoder_params(n_features, cfg.hidden_dim, d, FEATURE_PARALLEL)))
    if n_genes:
        p.update(_prefixed("rna_decoder", nb_decoder_params(n_genes, n_batches)))
    p.update(_prefixed("hic_decoder", hic_decoder_params(d, cfg.D, cfg.ffn_mult, cfg.attention, n_strata, n_features, n_batches)))
    return p
