"""Count decoders: the RNA NB decoder and the stratified ZINB Hi-C decoder.

Plain modules: no process groups, no knowledge of how they will be parallelised.
The Hi-C decoder is the memory bottleneck AMP targets: every stratum k >= 1 has an
attention block over the anchors, all blocks read the same node latents V, so all
L-1 blocks' activations are alive at backward time and memory grows linearly in L.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..base.errors import InputError
from ..contract.model_shapes import hic_decoder_shared_params, nb_decoder_params, stratum_block_params
from .attention import local_attention
from .layers import layer_norm_from, linear_from, parameter_from
from .prob import NB, ZINB

#: Initial value of the key term's scale parameter (softplus(-5) = 0.0067): the keys
#: start random, and at full scale their noise taught the encoder to ignore the cells.
KEY_SCALE_INIT = -5.0

#: Standard deviation of the initial per-feature loadings W_f.
LOADING_INIT_STD = 0.1


class NBDecoder(nn.Module):
    """RNA: mean = softmax(scale * u . V_genes^T + bias + c . b_g) * library; NB(mean, theta).

    ``c`` is the cell's batch indicator (one-hot over ``n_batches``) and ``b_g`` the
    gene's bias per batch (``batch_bias``, starting at 0); without batches the term is
    absent.
    """

    def __init__(self, n_genes: int, n_batches: int = 0):
        super().__init__()
        p = nb_decoder_params(n_genes, n_batches)
        self.scale_lin = parameter_from(p, "scale_lin", 0.0)
        self.bias = parameter_from(p, "bias", 0.0)
        self.log_theta = parameter_from(p, "log_theta", 0.0)
        self.batch_bias = parameter_from(p, "batch_bias", 0.0) if n_batches else None

    def forward(self, u: torch.Tensor, v_genes: torch.Tensor, library: torch.Tensor, cond: torch.Tensor | None = None) -> NB:
        """u: (B, d), v_genes: (G, d), library: (B,), cond: (B, n_batches) batch
        indicators (None without batches) -> NB over (B, G)."""
        logits = F.softplus(self.scale_lin) * (u @ v_genes.T) + self.bias
        if self.batch_bias is not None:
            if cond is None or cond.shape != (u.shape[0], self.batch_bias.shape[1]):
                raise ValueError(
                    f"the decoder is conditioned on {self.batch_bias.shape[1]} batches: it needs their indicators, (B, {self.batch_bias.shape[1]})"
                )
            logits = logits + cond @ self.batch_bias.T
        mu = torch.softmax(logits, dim=1) * library.unsqueeze(1)
        return NB(mu, self.log_theta.exp())


def scored_features(bounds: list[int], scored: tuple[int, int] | None) -> tuple[int, int] | None:
    """The features ``[lo, hi)`` of the strata ``scored`` (first, last inclusive) among
    strata laid out at ``bounds``; None when that is every feature (or ``scored`` is
    None). An error naming ``model.hic_likelihood`` when they hold no feature."""
    if scored is None:
        return None
    first, last = scored
    lo, hi = bounds[first], bounds[max(first, last + 1)]
    if hi <= lo:
        raise InputError(f"would score strata {first}-{last} of the data's {len(bounds) - 1}, which hold no feature: widen the reach "
                         "(model.hic_max_distance or hic_max_stratum, hic_diagonal) or score every stratum (all)",
                         key="model.hic_likelihood", value=scored)  # fmt: skip
    return None if (lo, hi) == (0, bounds[-1]) else (lo, hi)


class StratumBlock(nn.Module):
    """Keys of one stratum k >= 1 from the anchor latents V.

    h = LN(V); x = W_v h; key = x + LocalAttn(q = W_k h, k = W_k h, v = x; window w);
    key = key + GEGLU(W_ff LN(key)). Values are W_v h (not h) so that the width D
    may differ from the latent size.
    """

    def __init__(self, latent: int, D: int, heads: int, window: int, ffn_mult: int, attention: bool, chunk: int):
        super().__init__()
        self.heads, self.window, self.attention, self.chunk = heads, window, attention, chunk
        p = stratum_block_params(latent, D, ffn_mult, attention)
        self.norm_in = layer_norm_from(p, "norm_in")
        self.w_v = linear_from(p, "w_v")
        self.w_k = linear_from(p, "w_k") if "w_k.weight" in p else None
        self.norm_ff = layer_norm_from(p, "norm_ff")
        self.w_ff = linear_from(p, "w_ff")
        self.w_out = linear_from(p, "w_out")

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        """v: (n_anchors, latent) -> key: (n_anchors, D)."""
        h = self.norm_in(v)
        x = self.w_v(h)
        key = x
        if self.attention:
            n, D = x.shape
            qk = self.w_k(h).view(n, self.heads, D // self.heads).transpose(0, 1)  # (H, n, D/H)
            val = x.view(n, self.heads, D // self.heads).transpose(0, 1)
            att = local_attention(qk, qk, val, self.window, chunk=self.chunk or None)
            key = x + att.transpose(0, 1).reshape(n, D)
        a, g = self.w_ff(self.norm_ff(key)).chunk(2, dim=-1)
        return key + self.w_out(a * F.gelu(g))


def _stacked(blocks, name: str) -> torch.Tensor:
    """Parameter ``name`` of every block, stacked on a new first axis."""
    return torch.stack([b.get_parameter(name) for b in blocks])


def _stacked_linear(blocks, name: str, x: torch.Tensor) -> torch.Tensor:
    """Every block's linear layer ``name`` on its own slice of ``x`` (S, n, in): one
    batched product for all of them."""
    w = _stacked(blocks, f"{name}.weight").transpose(1, 2)  # (S, in, out)
    if getattr(blocks[0], name).bias is None:
        return torch.bmm(x, w)
    return torch.baddbmm(_stacked(blocks, f"{name}.bias").unsqueeze(1), x, w)


def _stacked_norm(blocks, name: str, x: torch.Tensor) -> torch.Tensor:
    """Every block's LayerNorm ``name`` on ``x`` ((n, C) shared, or (S, n, C) one slice per
    block): the normalisation once, then each block's scale and shift."""
    ref = getattr(blocks[0], name)
    h = F.layer_norm(x, ref.normalized_shape, eps=ref.eps)
    return torch.addcmul(_stacked(blocks, f"{name}.bias").unsqueeze(1), h, _stacked(blocks, f"{name}.weight").unsqueeze(1))


def stacked_keys(blocks, v: torch.Tensor) -> torch.Tensor:
    """The keys of every stratum k >= 1 at once: ``(S, n_anchors, D)`` with row ``k - 1``
    equal to ``blocks[k - 1](v)`` (:class:`StratumBlock`), each block's parameters
    stacked so that every operation is one kernel for all strata instead of one per
    stratum (a step's kernel count then barely grows with the strata). The banded
    attention runs over a leading strata axis. Same math as the blocks one by one; the
    sums in another order (float rounding)."""
    first = blocks[0]
    S, n = len(blocks), v.shape[0]
    h = _stacked_norm(blocks, "norm_in", v)  # (S, n, latent)
    x = _stacked_linear(blocks, "w_v", h)  # (S, n, D)
    key = x
    if first.attention:
        D, H = x.shape[-1], first.heads
        qk = _stacked_linear(blocks, "w_k", h).view(S, n, H, D // H).transpose(1, 2)  # (S, H, n, D/H)
        val = x.view(S, n, H, D // H).transpose(1, 2)
        att = local_attention(qk, qk, val, first.window, chunk=first.chunk or None)
        key = x + att.transpose(1, 2).reshape(S, n, D)
    a, g = _stacked_linear(blocks, "w_ff", _stacked_norm(blocks, "norm_ff", key)).chunk(2, dim=-1)
    return key + _stacked_linear(blocks, "w_out", a * F.gelu(g))


class StratifiedZINBDecoder(nn.Module):
    """Hi-C strata decoder ("HiCZINB").

    For stratum 0 the key of anchor a is V[a]; for k >= 1 it is block_k(V)[a]. Over the
    features F_k of stratum k (feature f = anchor pair (a_f, a_f + k)):
    logits_k = softplus(scale_f) * (u_D . key_k[a_f]) + [u, c] . W_f + bias_f,
    mean_k = softmax(logits_k) * n_k, with n_k the cell's observed contacts in stratum k.
    ZINB with per-feature dispersion and zero-inflation. With batches, ``c`` is the
    cell's batch indicator (one-hot over ``n_batches``) and the last ``n_batches``
    columns of the loadings W_f, starting at 0, are the feature's bias per batch: the
    decoder, not the latent, accounts for what differs between batches. Without
    batches ``[u, c] = u``.

    Why this form (measured on real cortex cells, ``scripts/bench_science.py``):

    * ``n_k`` observed, not ``library * w_k(u)``: a cell's distance decay (its share of
      contacts per stratum) varies with depth, cycle and sequencing batch; predicting it
      from u made the latent carry it (ARI against batch 0.3). Conditioning on the band
      totals divides the decay out, as band normalisation does, and the latent is left
      with where in each band the contacts fall.
    * ``u . W_f``, a loading per feature (scVI's linear decoder): the keys of a stratum
      are a function of the anchor a_f alone, shared through the graph encoder and the
      stratum blocks, which cannot express a cell type's change at a given bin pair;
      without loadings the latent kept about half the type information of a PCA of the
      same input. The key term stays (it is what the graph ties to genes and what AMP
      plans the memory of), its scale starting small (:data:`KEY_SCALE_INIT`) so that
      random keys do not drown the latent's signal before they have learnt anything.

    Parameters
    ----------
    latent, D, heads, window, ffn_mult, attention, chunk
        See :class:`~ampflow.contract.config.ModelConfig`.
    feature_anchor : (F,) long
        Anchor index a_f of every feature, features in stratum-major order.
    feature_stratum : (F,) long
        Stratum of every feature (non-decreasing).
    n_strata : int
    key_first : bool
        S4: gather keys first, ``u . key[F_k]^T``, instead of ``(u . key^T)[:, F_k]``.
    n_batches : int
        Batches the decoder is conditioned on (0: none).
    scored : (int, int), optional
        The first and last stratum (inclusive) whose features :meth:`mean_nll` scores
        (``model.hic_likelihood``); None: every feature. The decoder decodes every
        stratum either way (:meth:`forward`).
    """

    def __init__(self, latent, D, heads, window, ffn_mult, attention, chunk, feature_anchor, feature_stratum, n_strata, key_first=False, n_batches=0,
                 scored: tuple[int, int] | None = None):  # fmt: skip
        super().__init__()
        counts = torch.bincount(feature_stratum, minlength=n_strata)
        self.n_strata = n_strata
        self.key_first = key_first
        self.bounds = [0] + torch.cumsum(counts, 0).tolist()
        #: the scored strata's features, a range since the features are in stratum-major
        #: order (None: all of them), and those strata (None: all)
        self.scored_features = scored_features(self.bounds, scored)
        self.scored_strata = None if self.scored_features is None else scored
        self.register_buffer("feature_anchor", feature_anchor.long(), persistent=False)
        self.register_buffer("feature_stratum", feature_stratum.long(), persistent=False)
        #: every feature's place in the strata laid side by side, each padded to the
        #: widest (:meth:`_strata_means`): stratum k's j-th feature at k * width + j
        self.padded_width = int(counts.max()) if n_strata else 0
        first = torch.tensor(self.bounds[:-1], dtype=torch.long)
        offset = torch.arange(int(counts.sum())) - first[feature_stratum.long()]
        self.register_buffer("padded_position", feature_stratum.long() * self.padded_width + offset, persistent=False)
        #: one pass over all strata (:meth:`_stacked_logits`) instead of a loop; set by
        #: the training step where no per-stratum hook is asked for
        self.stack_strata = False
        self.blocks = nn.ModuleList(StratumBlock(latent, D, heads, window, ffn_mult, attention, chunk) for _ in range(1, n_strata))
        self.n_batches = n_batches
        p = hic_decoder_shared_params(latent, D, n_strata, int(counts.sum()), n_batches)
        self.u_proj = linear_from(p, "u_proj") if "u_proj.weight" in p else None
        self.scale_lin = parameter_from(p, "scale_lin", KEY_SCALE_INIT)
        self.bias = parameter_from(p, "bias", 0.0)
        self.log_theta = parameter_from(p, "log_theta", 0.0)
        self.zi_logits = parameter_from(p, "zi_logits", -2.0)
        loading = torch.randn(p["loading"].shape) * LOADING_INIT_STD
        loading[:, latent:] = 0.0  # the per-batch biases start at none
        self.loading = nn.Parameter(loading)

    def loading_input(self, u: torch.Tensor, cond: torch.Tensor | None) -> torch.Tensor:
        """What the loadings read: ``u``, followed by the batch indicators ``cond``
        (B, n_batches) when the decoder is conditioned on batches."""
        if not self.n_batches:
            return u
        if cond is None or cond.shape != (u.shape[0], self.n_batches):
            raise ValueError(f"the decoder is conditioned on {self.n_batches} batches: it needs their indicators, (B, {self.n_batches})")
        return torch.cat([u, cond], dim=1)

    def stratum_logits(self, k: int, u: torch.Tensor, u_D: torch.Tensor, v_anchors: torch.Tensor, u_load: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over the features of stratum k: (B, |F_k|); ``u_load`` is
        :meth:`loading_input` (None: ``u``, a decoder without batches)."""
        lo, hi = self.bounds[k], self.bounds[k + 1]
        anchors = self.feature_anchor[lo:hi]
        if k == 0:
            key, q = v_anchors, u
        else:
            key, q = self.blocks[k - 1](v_anchors), u_D
        if self.key_first:
            raw = q @ key.index_select(0, anchors).T
        else:
            raw = (q @ key.T).index_select(1, anchors)
        return self._head(raw, u if u_load is None else u_load, lo, hi)

    def _head(self, raw: torch.Tensor, u_load: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Logits of features ``lo:hi`` from their key scores ``raw`` (B, hi - lo): the
        scaled scores, the loadings' term and the bias."""
        return F.softplus(self.scale_lin[lo:hi]) * raw + u_load @ self.loading[lo:hi].T + self.bias[lo:hi]

    def _stacked_logits(self, u: torch.Tensor, u_D: torch.Tensor, v_anchors: torch.Tensor, u_load: torch.Tensor) -> torch.Tensor:
        """Logits over every feature, ``(B, F)``: :meth:`stratum_logits` of each stratum
        side by side, the strata k >= 1 from :func:`stacked_keys` in one product."""
        lo = self.bounds[1]
        a0, rest = self.feature_anchor[:lo], self.feature_anchor[lo:]
        keys = stacked_keys(self.blocks, v_anchors).flatten(0, 1)  # ((L-1) n, D)
        rows = (self.feature_stratum[lo:] - 1) * v_anchors.shape[0] + rest  # each feature's key row
        if self.key_first:
            raw = torch.cat([u @ v_anchors.index_select(0, a0).T, u_D @ keys.index_select(0, rows).T], dim=1)
        else:
            raw = torch.cat([(u @ v_anchors.T).index_select(1, a0), (u_D @ keys.T).index_select(1, rows)], dim=1)
        return self._head(raw, u_load, 0, self.bounds[-1])

    def _strata_means(self, logits: torch.Tensor, band_totals: torch.Tensor) -> torch.Tensor:
        """Every stratum's softmax times its band total, ``(B, F)`` from the logits of all
        features ``(B, F)``: the strata side by side in a ``(B, L, width)`` block, each
        padded with the dtype's lowest value (whose exponential is 0), one softmax over
        the last axis, and back to the features' order. A fixed handful of kernels where
        a softmax and a product per stratum made the count grow with the strata."""
        B, L, width = logits.shape[0], self.n_strata, self.padded_width
        padded = logits.new_full((B, L * width), torch.finfo(logits.dtype).min)
        padded[:, self.padded_position] = logits  # index_put: saves only the positions for backward (index_copy also saves the logits)
        means = torch.softmax(padded.view(B, L, width), dim=-1) * band_totals.unsqueeze(-1)
        return means.view(B, L * width).index_select(1, self.padded_position)

    def forward(
        self,
        u: torch.Tensor,
        v_anchors: torch.Tensor,
        band_totals: torch.Tensor,
        on_stratum: Callable[[int], None] | None = None,
        cond: torch.Tensor | None = None,
    ) -> ZINB:
        """u: (B, latent), v_anchors: (n_anchors, latent), band_totals: (B, L), cond:
        (B, n_batches) batch indicators (None without batches) -> ZINB over (B, F).

        ``on_stratum(k)`` is called after stratum k's part of the graph is built (the
        trainer measures memory there).
        """
        u_D = self.u_proj(u) if self.u_proj is not None else u
        u_load = self.loading_input(u, cond)
        if self.stack_strata and on_stratum is None and self.n_strata > 1:
            mu = self._strata_means(self._stacked_logits(u, u_D, v_anchors, u_load), band_totals)
        else:
            means = []
            for k in range(self.n_strata):
                logits = self.stratum_logits(k, u, u_D, v_anchors, u_load)
                means.append(torch.softmax(logits, dim=1) * band_totals[:, k : k + 1])
                if on_stratum is not None:
                    on_stratum(k)
            mu = torch.cat(means, dim=1)
        return ZINB(mu, self.log_theta.exp(), self.zi_logits.expand_as(mu))

    def mean_nll(
        self,
        u: torch.Tensor,
        v_anchors: torch.Tensor,
        band_totals: torch.Tensor,
        x: torch.Tensor,
        on_stratum: Callable[[int], None] | None = None,
        cond: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Negative log-likelihood of counts ``x`` (B, F), averaged over cells and the
        scored features (``scored``: all of them by default).

        The one place the model turns the decoder into its loss term, so that a sharded
        decoder (S2, S5) can compute the same number from its share of the features.
        """
        log_p = self(u, v_anchors, band_totals, on_stratum, cond).log_prob(x)
        if self.scored_features is None:
            return -log_p.mean()
        # the mean over cells first: its gradient is the (B, F) one the whole mean's is,
        # and the slice's is (F,)
        lo, hi = self.scored_features
        return -log_p.mean(0)[lo:hi].mean()
