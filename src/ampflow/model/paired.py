"""The paired HiGLUE-style model: RNA and Hi-C of the same cells, linked by a guidance graph.

Built with ``n_genes = 0`` it is the Hi-C-only model (users with scHi-C alone): no RNA
encoder or decoder, and no RNA, alignment or cross-reconstruction terms; the Hi-C
encoder, the stratified decoder and the graph (anchors only) train as in the paired
model. Its inputs keep their shapes, the RNA batch being ``(B, 0)``, so that the
trainer, data parallelism and the memory measurement run one code path for both.

Single-process reference. The parallel strategies wrap or re-shard this model; they
never edit it, and their results are tested against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..contract.config import LossWeights, ModelConfig
from .decoders import NBDecoder, StratifiedZINBDecoder
from .encoders import Encoder, HiCInput, rna_input, stratum_totals
from .graph import GraphEncoder, graph_nll
from .prob import kl_normal


@dataclass
class GraphSpec:
    """Edges (both directions, self-loops included) and where genes and anchors sit."""

    src: torch.Tensor
    dst: torch.Tensor
    weight: torch.Tensor
    sign: torch.Tensor
    n_nodes: int
    gene_nodes: torch.Tensor  # (G,) node index of each RNA feature
    anchor_nodes: torch.Tensor  # (n_anchors,) node index of each anchor


class PairedModel(nn.Module):
    """Encoders, decoders and graph for paired RNA + Hi-C.

    Parameters
    ----------
    cfg : ModelConfig
    n_genes : int
        RNA features; 0 builds the Hi-C-only model (:attr:`has_rna` False).
    feature_anchor, feature_stratum : (F,) long
        Hi-C features in stratum-major order.
    n_strata : int
    graph : GraphSpec
    n_batches : int
        Batches the decoders are conditioned on (0: none; see
        :attr:`~ampflow.contract.config.ModelConfig.batch_key`). The encoders never see
        them, so a cell of any batch, one training never saw included, is embedded.
    """

    #: Terms that are means over the batch's cells.
    CELL_TERMS = ("rna_nll", "hic_nll", "rna_kl", "hic_kl", "align", "cross")
    #: Terms of the graph alone: the same whichever cells are in the batch.
    SHARED_TERMS = ("graph_nll", "graph_kl")

    def __init__(self, cfg: ModelConfig, n_genes: int, feature_anchor, feature_stratum, n_strata: int, graph: GraphSpec, n_batches: int = 0):
        super().__init__()
        self.cfg = cfg
        d = cfg.latent_dim
        self.n_strata = n_strata
        self.n_batches = n_batches
        self.register_buffer("feature_stratum", feature_stratum.long(), persistent=False)
        self.register_buffer("gene_nodes", graph.gene_nodes.long(), persistent=False)
        self.register_buffer("anchor_nodes", graph.anchor_nodes.long(), persistent=False)
        for name in ("src", "dst", "weight", "sign"):
            self.register_buffer(f"edge_{name}", getattr(graph, name), persistent=False)
        self.graph_encoder = GraphEncoder(graph.n_nodes, d, graph.src, graph.dst, graph.weight, graph.sign)
        self.has_rna = n_genes > 0
        # the Hi-C-only model has no RNA modules at all (not empty ones): its state dict,
        # parameter order and optimizer state are those of the Hi-C branch and the graph
        if self.has_rna:
            self.rna_encoder = Encoder(n_genes, cfg.hidden_dim, d, cfg.dropout)
        self.hic_input = HiCInput.from_config(cfg, feature_stratum, n_strata)
        self.hic_encoder = Encoder(len(feature_anchor), cfg.hidden_dim, d, cfg.dropout)
        if self.has_rna:
            self.rna_decoder = NBDecoder(n_genes, n_batches)
        self.hic_decoder = StratifiedZINBDecoder(
            d, cfg.D, cfg.heads, cfg.window, cfg.ffn_mult, cfg.attention, cfg.chunk,
            feature_anchor, feature_stratum, n_strata, key_first=cfg.key_first, n_batches=n_batches, scored=cfg.hic_scored_strata(n_strata),
        )  # fmt: skip

    def encode(self, rna: torch.Tensor, hic: torch.Tensor):
        """Cell latent distributions: ((loc, std) RNA, (loc, std) Hi-C), each (B, d);
        the RNA pair is None in the Hi-C-only model."""
        h = self.hic_encoder(self.hic_input(hic))
        if not self.has_rna:
            return None, h
        return self.rna_encoder(rna_input(rna, rna.sum(1))), h

    def node_latents(self, sample: bool, eps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(v, loc, std) of the graph nodes, each (n_nodes, d); v is a reparameterised
        sample when ``sample``, with standard-normal ``eps`` (n_nodes, d) if given."""
        loc, std = self.graph_encoder()
        if not sample:
            return loc, loc, std
        return loc + std * (torch.randn_like(std) if eps is None else eps), loc, std

    def forward(self, rna: torch.Tensor, hic: torch.Tensor, weights: LossWeights, generator=None, on_stratum=None, noise=None, cond=None,
                graph_sample=None, hic_in: torch.Tensor | None = None) -> dict:  # fmt: skip
        """Loss terms and their weighted total for one batch of paired cells.

        Every term is normalised per element (as GLUE does) so that their sizes are
        comparable across datasets.

        Parameters
        ----------
        rna : (B, G) counts (float)
        hic : (B, F) counts (float)
        weights : LossWeights
        generator : torch.Generator, optional
            Edge and negative sampling of the graph loss (None: the global RNG).
        on_stratum : callable, optional
            Called with k after stratum k of the Hi-C decoder is built.
        noise : (eps_rna, eps_hic, eps_nodes), optional
            Standard-normal draws of shapes (B, d), (B, d) and (n_nodes, d) used for the
            reparameterised samples instead of the model's own ``randn_like`` draws (in
            training mode only). Data parallelism passes each rank its rows of one
            full-batch draw so that the ranks together sample what one process would.
        cond : (B, n_batches), optional
            The cells' batch indicators (one-hot), for a model with ``n_batches``;
            None for one without.
        graph_sample : (idx, nt), optional
            The graph loss's edge indices and negative targets
            (:func:`~ampflow.model.graph.graph_sample_sizes`) instead of drawing them from
            ``generator``.
        hic_in : (B, F), optional
            What the Hi-C encoder reads instead of ``hic`` (``train.hic_thinned:
            encoder``: a thinned copy, so that the encoder learns to denoise); the
            likelihood and its per-stratum totals still read ``hic``.

        Returns
        -------
        dict of 0-d tensors: the terms named in :attr:`CELL_TERMS` and
        :attr:`SHARED_TERMS` (``cross`` only when ``weights.cross``) and ``total``;
        the Hi-C-only model has no ``rna_nll``, ``rna_kl``, ``align`` or ``cross``
        (``eps_rna`` of ``noise`` is then not used).
        """
        r, (h_loc, h_std) = self.encode(rna, hic if hic_in is None else hic_in)
        sample = self.training
        eps_rna, eps_hic, eps_nodes = noise if noise is not None else (None, None, None)
        if self.has_rna:  # drawn first: the global RNG's order is RNA, Hi-C, nodes
            r_loc, r_std = r
            u_rna = (r_loc + r_std * (torch.randn_like(r_std) if eps_rna is None else eps_rna)) if sample else r_loc
        u_hic = (h_loc + h_std * (torch.randn_like(h_std) if eps_hic is None else eps_hic)) if sample else h_loc
        v, v_loc, v_std = self.node_latents(sample, eps_nodes)
        # both decoders read the nodes' latent means: sampled ones put noise of the
        # prior's size into every key and gene loading, and the decoders learnt to
        # ignore the cell latent (the graph loss still reads the samples)
        v_anchors = v_loc.index_select(0, self.anchor_nodes)
        totals = stratum_totals(hic, self.feature_stratum, self.n_strata)

        terms = {}
        if self.has_rna:
            v_genes, rna_lib = v_loc.index_select(0, self.gene_nodes), rna.sum(1)
            terms["rna_nll"] = -self.rna_decoder(u_rna, v_genes, rna_lib, cond).log_prob(rna).mean()
        terms["hic_nll"] = self.hic_decoder.mean_nll(u_hic, v_anchors, totals, hic, on_stratum, cond)
        if self.has_rna:
            terms["rna_kl"] = kl_normal(r_loc, r_std).sum(1).mean() / rna.shape[1]
        terms["hic_kl"] = kl_normal(h_loc, h_std).sum(1).mean() / hic.shape[1]
        terms["graph_nll"] = graph_nll(
            v, self.edge_src, self.edge_dst, self.edge_weight, self.edge_sign,
            self.cfg.neg_samples, self.cfg.graph_batch, generator, graph_sample,
        )  # fmt: skip
        terms["graph_kl"] = kl_normal(v_loc, v_std).sum(1).mean() / v.shape[0]
        if self.has_rna:
            # the Hi-C latent is pulled onto the RNA latent, not both onto each other: a
            # symmetric pull lets both shrink towards one point before either is informative.
            # Only the shared dimensions are pulled: the last ``private_dim`` of each latent
            # keep what only that modality knows (see train.embeddings.joint_latent)
            s = self.cfg.shared_dim
            terms["align"] = (r_loc[:, :s].detach() - h_loc[:, :s]).square().sum(1).mean() / s
            if weights.cross:
                terms["cross"] = -self.rna_decoder(u_hic, v_genes, rna_lib, cond).log_prob(rna).mean() + self.hic_decoder.mean_nll(
                    u_rna, v_anchors, totals, hic, cond=cond
                )
        terms["total"] = self.weighted_total(terms, weights)
        return terms

    @staticmethod
    def weighted_total(terms: dict, weights: LossWeights, cell_scale: float = 1.0, shared_scale: float = 1.0) -> torch.Tensor:
        """The weighted sum of the loss terms, cell terms times ``cell_scale`` and graph
        terms times ``shared_scale``.

        Data parallelism needs the two scales apart: a rank holding B_r of B cells
        weighs its cell terms by B_r / B and the graph terms, which every rank computes
        alike, by 1 / dp, so that the ranks' totals sum to the full batch's. The terms
        are added in one fixed order; with both scales 1 this is the total that
        :meth:`forward` reports, bit for bit (multiplying by 1.0 is exact).

        Parameters
        ----------
        terms : dict of 0-d tensors, as :meth:`forward` returns them
        weights : LossWeights
        cell_scale, shared_scale : float

        Returns
        -------
        0-d tensor
        """
        c, s = cell_scale, shared_scale
        if "rna_nll" not in terms:  # the Hi-C-only model: no RNA, alignment or cross terms
            total = c * (terms["hic_nll"] + weights.hic_kl * terms["hic_kl"])
            return total + s * (weights.graph * (terms["graph_nll"] + terms["graph_kl"]))
        total = c * (terms["rna_nll"] + terms["hic_nll"] + weights.kl * terms["rna_kl"] + weights.hic_kl * terms["hic_kl"])
        total = total + s * (weights.graph * (terms["graph_nll"] + terms["graph_kl"]))
        total = total + c * (weights.align * terms["align"])
        if weights.cross:
            total = total + c * (weights.cross * terms["cross"])
        return total

    @torch.no_grad()
    def embed(self, rna: torch.Tensor, hic: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Latent means (B, d) of the RNA and Hi-C encoders (call in eval mode); the
        RNA one is None in the Hi-C-only model."""
        r, (h_loc, _) = self.encode(rna, hic)
        return (None if r is None else r[0]), h_loc
