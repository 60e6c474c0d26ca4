"""S1 data parallelism: the ranks of a dp group share each batch's cells and together
compute exactly the single-process loss and gradients.

Three things would make a naive split inexact, and each is handled here:

* Loss weights. The per-cell terms are means over the batch's cells but the graph terms
  do not depend on the cells and every rank computes them alike. A rank holding B_r of
  the batch's B cells therefore weighs its cell terms by B_r / B and the graph terms by
  1 / dp (:meth:`~ampflow.model.paired.PairedModel.weighted_total`), and the gradients
  are all-reduced with a SUM, not an average: the ranks' scaled losses add up to the
  full batch's loss, so their gradients add up to its gradient, for any split of the
  cells (equal or not) and any dp. With dp a power of two the 1 / dp scaling is exact.
* Batch normalisation. Encoder BatchNorm layers are swapped for
  :class:`~ampflow.parallel.sync_batchnorm.SyncBatchNorm1d` so that they normalise with
  statistics of the whole batch.
* Sampling noise. Every rank draws the reparameterisation noise for the whole batch
  (and the graph's nodes) from one generator seeded alike on every rank, and keeps its
  own rows; the graph loss's edge sampling uses the same generator. Dropout masks are
  still drawn per rank from the global RNG, so exact equality with one process needs
  ``dropout = 0``; the graph and the noise stay identical across ranks either way.

Parameters must start equal on every rank (same seed, or :func:`broadcast_state`).
"""

from __future__ import annotations

import heapq

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from ..contract.config import LossWeights
from ..model.paired import PairedModel
from .clip import ZScoreBound, clip_gradients
from .mesh import Mesh
from .sync_batchnorm import convert_sync_batchnorm


# ----------------------------------------------------------------- splitting a batch
def contiguous_split(batch_size: int, dp: int) -> list[torch.Tensor]:
    """Rows of each dp rank: contiguous, near-equal (sizes differ by at most one).

    Returns
    -------
    list of dp (B_r,) long tensors
    """
    return list(torch.tensor_split(torch.arange(batch_size), dp))


def balanced_split(contacts_per_cell, dp: int) -> list[torch.Tensor]:
    """Rows of each dp rank such that every rank gets a near-equal total of Hi-C contacts.

    Greedy largest-first (LPT): cells in decreasing order of contacts (ties by row) go
    to the rank with the least contacts so far (ties: fewer cells, then lower rank).
    Deterministic, so every rank computes the same split from the same batch. Counting
    cells in the tie-break spreads contact-free cells and gives every rank a cell when
    B >= dp.

    Parameters
    ----------
    contacts_per_cell : (B,) array-like
        Hi-C contacts of each cell of the batch (e.g. ``hic.sum(1)``).
    dp : int

    Returns
    -------
    list of dp (B_r,) long tensors, each sorted
    """
    c = np.asarray(torch.as_tensor(contacts_per_cell).detach().cpu().double())
    order = sorted(range(len(c)), key=lambda i: (-c[i], i))
    heap = [(0.0, 0, r) for r in range(dp)]  # (contacts, cells, rank)
    rows: list[list[int]] = [[] for _ in range(dp)]
    for i in order:
        load, n, r = heapq.heappop(heap)
        rows[r].append(i)
        heapq.heappush(heap, (load + float(c[i]), n + 1, r))
    return [torch.tensor(sorted(r), dtype=torch.long) for r in rows]


def work_ratio(contacts_per_cell, split: list[torch.Tensor]) -> float:
    """max / mean of the ranks' contact totals under ``split`` (1.0 is perfect balance).

    Parameters
    ----------
    contacts_per_cell : (B,) array-like
    split : list of (B_r,) long tensors
    """
    c = torch.as_tensor(contacts_per_cell).detach().cpu().double()
    totals = torch.stack([c[rows].sum() for rows in split])
    mean = float(totals.mean())
    return float(totals.max()) / mean if mean > 0 else 1.0


# ----------------------------------------------------------------- setup
def draw_noise(model: PairedModel, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standard-normal reparameterisation noise for a whole batch, for ``forward(noise=...)``.

    Drawn on the generator's device (then moved to the model's), in the model's dtype,
    in a fixed order: RNA cells, Hi-C cells, graph nodes.

    Returns
    -------
    eps_rna, eps_hic : (batch_size, d)
    eps_nodes : (n_nodes, d)
    """
    emb = model.graph_encoder.embedding  # (n_nodes, d): the latent size, dtype and device
    n_nodes, d = emb.shape

    def draw(n):
        return torch.randn(n, d, generator=generator, dtype=emb.dtype, device=generator.device).to(emb.device)

    return draw(batch_size), draw(batch_size), draw(n_nodes)


@torch.no_grad()
def broadcast_state(model: nn.Module, mesh: Mesh) -> None:
    """Copy dp rank 0's parameters and buffers to the other ranks of its dp group, in place."""
    if mesh.dp_group is None:
        return
    for t in model.state_dict().values():
        dist.broadcast(t, group=mesh.dp_group, group_src=0)


def parallelize_data_parallel(model: nn.Module, mesh: Mesh, broadcast: bool = True) -> nn.Module:
    """Make ``model`` ready for :class:`DataParallelStep` on ``mesh`` (in place).

    With dp > 1 every ``nn.BatchNorm1d`` becomes a sync BatchNorm over the dp group
    (Parameter objects kept, so an existing optimizer stays valid) and, if
    ``broadcast``, dp rank 0's parameters and buffers are copied to the other ranks.
    With dp = 1 the model is returned unchanged.
    """
    if mesh.dp_group is None:
        return model
    model = convert_sync_batchnorm(model, mesh.dp_group)
    if broadcast:
        broadcast_state(model, mesh)
    return model


def sum_gradients(parameters, group) -> None:
    """All-reduce (sum) ``.grad`` over ``group`` in place, one collective per dtype.

    Parameters whose ``.grad`` is None are skipped: which ones those are follows from
    the model's structure, not from the cells, so it is the same on every rank.
    """
    if group is None:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


# ----------------------------------------------------------------- the step
class DataParallelStep:
    """One S1 training step on this rank's share of a batch.

    Parameters
    ----------
    mesh : Mesh
        Its dp group carries the collectives; with dp = 1 the step is the plain
        single-process step, bit for bit.
    clip : float or ZScoreBound, optional
        Clip the whole model's gradient norm to this before the update
        (:func:`~ampflow.parallel.clip.clip_gradients`, ``train.clip_grad_norm``);
        None: no clipping.
    """

    def __init__(self, mesh: Mesh, clip: float | ZScoreBound | None = None):
        self.mesh = mesh
        self.group = mesh.dp_group
        self.clip = clip
        #: the last step's gradient norm before clipping (0-d, on the device); None
        #: without ``clip``
        self.norm: torch.Tensor | None = None

    def step(self, model: PairedModel, optimizer: torch.optim.Optimizer, rna: torch.Tensor, hic: torch.Tensor,
             weights: LossWeights, rows: torch.Tensor, batch_size: int | None = None,
             generator: torch.Generator | None = None, on_stratum=None, on_phase=None, cond=None, hic_in=None) -> dict:  # fmt: skip
        """Forward on this rank's rows, backward, gradient all-reduce, clipping (if
        ``clip``), ``optimizer.step()``.

        The model must be in training mode and prepared by :func:`parallelize_data_parallel`.

        Parameters
        ----------
        model : PairedModel
        optimizer : torch.optim.Optimizer
        rna, hic : (B, G), (B, F) counts of the whole batch, or, when ``batch_size`` is
            given, (B_r, G), (B_r, F) counts of this rank's rows only (so that no rank
            has to densify the whole batch).
        weights : LossWeights
        rows : (B_r,) long
            This rank's rows of the batch (:func:`contiguous_split`, :func:`balanced_split`);
            the ranks' rows together must be every row once.
        batch_size : int, optional
            B, when ``rna`` / ``hic`` hold this rank's rows only.
        generator : torch.Generator
            Seeded alike on every rank: the noise of the whole batch and the graph
            loss's edge sampling are drawn from it. Required when dp > 1; with dp = 1 it
            is passed to the model as is and the noise comes from the global RNG, as in
            the plain step.
        on_stratum : callable, optional
            Passed to the model (memory marks).
        on_phase : callable, optional
            Called with ``"forward"``, ``"backward"`` and ``"optimizer_step"`` as each
            phase begins (:func:`ampflow.train.measured_memory.measure_step` measures each
            phase's peak).
        cond : (B, n_batches) or (B_r, n_batches), optional
            Batch indicators of the rows of ``rna`` / ``hic`` (a model conditioned on
            batches); taken by ``rows`` alike.
        hic_in : (B, F) or (B_r, F), optional
            What the Hi-C encoder reads instead of ``hic`` (a thinned copy; the model's
            ``hic_in``); taken by ``rows`` alike.

        Returns
        -------
        dict of 0-d tensors (detached)
            The full batch's loss terms and ``total``, equal on every rank (graph terms
            as computed here; cell terms combined over the group).
        """
        rows = torch.as_tensor(rows, dtype=torch.long)
        if batch_size is None:
            batch_size = rna.shape[0]
            rna, hic = rna[rows.to(rna.device)], hic[rows.to(hic.device)]
            cond = None if cond is None else cond[rows.to(cond.device)]
            hic_in = None if hic_in is None else hic_in[rows.to(hic_in.device)]
        n_local, dp = rows.numel(), self.mesh.dp
        if self.group is None:
            noise = None
        else:
            if generator is None:
                raise ValueError("data parallelism needs a generator seeded alike on every rank (noise and graph sampling)")
            self._check_rows(n_local, batch_size, rna.device)
            eps_rna, eps_hic, eps_nodes = draw_noise(model, batch_size, generator)
            local = rows.to(eps_rna.device)
            noise = (eps_rna[local], eps_hic[local], eps_nodes)

        phase = on_phase or (lambda name: None)
        optimizer.zero_grad(set_to_none=True)
        phase("forward")
        terms = model(rna, hic, weights, generator=generator, on_stratum=on_stratum, noise=noise, cond=cond, hic_in=hic_in)
        cell_scale, shared_scale = n_local / batch_size, 1.0 / dp
        loss = model.weighted_total(terms, weights, cell_scale, shared_scale)
        phase("backward")
        loss.backward()
        sum_gradients(model.parameters(), self.group)
        phase("optimizer_step")
        if self.clip is not None:
            self.norm = clip_gradients(model, self.clip)
        optimizer.step()
        return self._global_terms(terms, loss, cell_scale, shared_scale)

    def _check_rows(self, n_local: int, batch_size: int, device) -> None:
        """Every rank learns every rank's row count, so that a bad split fails on all
        ranks at once instead of hanging some of them in a collective (on the data's
        device: NCCL takes no CPU tensors)."""
        counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(self.mesh.dp)]
        dist.all_gather(counts, torch.tensor([n_local], device=device), group=self.group)
        counts = [int(c) for c in counts]
        if sum(counts) != batch_size or min(counts) < 1:
            raise ValueError(f"the ranks' rows {counts} must split a batch of {batch_size} cells with at least one cell each")

    @torch.no_grad()
    def _global_terms(self, terms: dict, loss: torch.Tensor, cell_scale: float, shared_scale: float) -> dict:
        if self.group is None:  # the plain step's own numbers
            return {k: v.detach() for k, v in terms.items()}
        # the scaled terms add up over the ranks to the full batch's, as the loss does
        names = [k for k in terms if k != "total"]
        scale = [cell_scale if k in PairedModel.CELL_TERMS else shared_scale for k in names]
        local = torch.stack([terms[k].detach() * s for k, s in zip(names, scale)] + [loss.detach()])
        dist.all_reduce(local, group=self.group)
        return dict(zip(names + ["total"], local.unbind()))
