"""A training step with no host round-trip: static buffers, draws made on the device,
loss terms left on the device, optionally compiled (``torch.compile``) and, on one GPU,
captured whole in a CUDA graph.

The eager step (:class:`~ampflow.parallel.data_parallel.DataParallelStep`) launches a few
thousand small kernels from Python and draws its noise from the global RNG and its graph
sample from a CPU generator (copied to the GPU mid-step). This step computes the same loss
and gradients from explicit draws:

* the reparameterisation noise (RNA cells, Hi-C cells, graph nodes) and the graph loss's
  edge indices and negative targets are drawn by :func:`draw_step` from one generator on
  the model's device (seeded from ``train.seed``; saved in checkpoints), into the step's
  static buffers, before the step runs;
* the batch is written into static buffers too: gathered and densified on the device from
  the resident counts (:class:`~ampflow.train.device_cells.DeviceCells`), or densified on
  the host and copied from pinned memory without waiting;
* the step returns its loss terms as one device tensor (:data:`TERM_ORDER` order); the
  trainer reads them every ``train.log_every`` steps, not every step.

``mode.compile`` runs the forward through ``torch.compile`` (inductor: its backward is
compiled too); ``mode.graphs`` captures forward, backward and ``Adam(capturable=True)``'s
update in one :class:`torch.cuda.CUDAGraph` per learning rate and loss weights (a training
stage), for the full batch shape.
Capture needs warm-up iterations, which update the model: its parameters, buffers and the
optimizer's state are put back afterwards (in place, so the graph's addresses hold), so the
first replayed step is the first training step. The trailing batch of an epoch (fewer
cells) runs the same function eagerly, in every mode: no padding, so its loss is that of
its cells alone, and no second compile or graph (a second graph would hold a second set
of activations).

With dropout the compiled and graphed steps draw their masks from other random streams
than the eager one (inductor's and the graph's Philox offsets): equal in distribution,
not in values; with ``model.dropout = 0`` every mode computes the eager step's loss and
gradients from the same draws (tests/test_static_step.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from ..base.errors import InputError
from ..contract.config import LossWeights
from ..model.graph import graph_sample_sizes
from ..model.paired import PairedModel
from ..parallel.clip import ZScoreBound, clip_gradients

log = logging.getLogger(__name__)

#: Loss terms in the order of the step's output vector; a model lacks some (Hi-C only:
#: no RNA, alignment or cross terms): :meth:`StaticStep.term_names` lists its own.
TERM_ORDER = ("rna_nll", "hic_nll", "rna_kl", "hic_kl", "graph_nll", "graph_kl", "align", "cross", "total")

#: Warm-up iterations before a capture (PyTorch's CUDA Graphs notes use a few, on a side
#: stream, so that lazily made state, cuBLAS handles and the optimizer's moments exist).
WARMUP_ITERS = 3


@dataclass
class StepMode:
    """How the training step runs, and why (logged by the trainer)."""

    compile: bool = False
    graphs: bool = False
    reason: str = "eager"

    @property
    def static(self) -> bool:
        """Whether the step runs through :class:`StaticStep` (compiled or graphed)."""
        return self.compile or self.graphs

    def describe(self) -> str:
        kind = " + ".join(k for k, on in (("torch.compile", self.compile), ("CUDA graph", self.graphs)) if on) or "eager"
        return f"{kind} ({self.reason})"


def choose_mode(compile_setting, graphs_setting, device: torch.device, world: int) -> StepMode:
    """The step's mode from ``train.compile`` and ``train.cuda_graphs`` (each ``auto``,
    true or false).

    ``auto`` compiles nowhere (``scripts/bench_train.py --hires --modes eager compiled``
    on 2 CPU cores: 1.0x to 1.1x the eager step at mm10 1 Mb/10, 500 kb/20 and 100 kb/30,
    for a compile of 50 to 100 s) and captures CUDA graphs on one GPU. A
    multi-process mesh stays eager whatever the settings: capture of the collectives is not
    proven yet (the plan's strategies run eagerly, as before). CUDA graphs need CUDA.
    """
    cuda = device.type == "cuda"
    if world > 1:
        asked = compile_setting is True or graphs_setting is True
        return StepMode(reason=f"{world} processes: the multi-process step stays eager" + (" (train.compile/cuda_graphs ignored)" if asked else ""))
    if graphs_setting is True and not cuda:
        raise InputError(f"CUDA graphs need a GPU; this run trains on {device.type}", key="train.cuda_graphs", value=graphs_setting)
    graphs = cuda if graphs_setting == "auto" else bool(graphs_setting)
    compiled = False if compile_setting == "auto" else bool(compile_setting)
    why = f"train.compile {compile_setting}, train.cuda_graphs {graphs_setting}" + ("" if cuda else " (CPU)")
    return StepMode(compile=compiled, graphs=graphs, reason=why)


@dataclass
class StepBuffers:
    """The static inputs of one batch shape (B cells) on the model's device."""

    rna: torch.Tensor  # (B, G)
    hic: torch.Tensor  # (B, F)
    cond: torch.Tensor | None  # (B, n_batches)
    eps_rna: torch.Tensor  # (B, d)
    eps_hic: torch.Tensor  # (B, d)
    eps_nodes: torch.Tensor  # (n_nodes, d)
    edge_idx: torch.Tensor  # (m,) long
    neg_idx: torch.Tensor  # (m * neg_samples,) long
    hic_in: torch.Tensor | None = None  # (B, F) what the Hi-C encoder reads, when not hic
    out: torch.Tensor | None = None  # (n_terms,) the step's terms (a graph's static output)
    extra: dict = field(default_factory=dict)


def draw_step(model: PairedModel, bufs: StepBuffers, generator: torch.Generator) -> None:
    """Every random draw of one step, into ``bufs``, from ``generator`` (on the model's
    device), in a fixed order: RNA noise, Hi-C noise, node noise, edges, negatives."""
    for t in (bufs.eps_rna, bufs.eps_hic, bufs.eps_nodes):
        t.normal_(generator=generator)
    n_edges, n_nodes = model.edge_src.numel(), bufs.eps_nodes.shape[0]
    bufs.edge_idx.random_(0, n_edges, generator=generator)
    bufs.neg_idx.random_(0, n_nodes, generator=generator)


def forward_terms(model: PairedModel, weights: LossWeights, rna, hic, cond, eps_rna, eps_hic, eps_nodes, edge_idx, neg_idx, hic_in=None) -> dict:
    """The model's loss terms for one batch from explicit draws (what is compiled)."""
    return model(rna, hic, weights, noise=(eps_rna, eps_hic, eps_nodes), cond=cond, graph_sample=(edge_idx, neg_idx), hic_in=hic_in)


def stack_strata(model: PairedModel, on: bool | None = None) -> bool:
    """Let the Hi-C decoder compute every stratum's keys and logits in one pass
    (:func:`~ampflow.model.decoders.stacked_keys`): a few kernels for all strata instead
    of a few hundred per stratum. ``on=None``: on a GPU, where the step is a stream of
    small kernels (on 2 CPU cores, foreach Adam: 1.06x the loop's steps/s at mm10
    1 Mb/10, but 0.91x at 500 kb/20 and 0.57x at 100 kb/30, where each stratum's tensors
    fit the caches and all strata's do not). Never where the plan chunks the attention
    (S3): the chunks bound one block's transient scores, and stacking would hold every
    stratum's at once. Returns whether it is on."""
    dec = model.hic_decoder
    if on is None:
        on = next(model.parameters()).device.type == "cuda"
    on = bool(on) and len(dec.blocks) > 0 and not dec.blocks[0].chunk
    dec.stack_strata = on
    return on


class StaticStep:
    """Runs training steps of ``model`` with ``optimizer`` in ``mode`` (one process).

    Parameters
    ----------
    model : PairedModel
        On its device, in training mode.
    optimizer : torch.optim.Optimizer
        ``Adam(capturable=True)`` for CUDA graphs (its state lives on the device).
    mode : StepMode
    generator : torch.Generator
        On the model's device: every draw of every step (:func:`draw_step`).
    stack : bool, optional
        Every stratum of the Hi-C decoder in one pass (:func:`stack_strata`; None: on a
        GPU).
    clip : float or ZScoreBound, optional
        Clip the gradient's norm to this before the update (``train.clip_grad_norm``;
        :func:`~ampflow.parallel.clip.clip_gradients`, on the device, captured with
        the step; a :class:`~ampflow.parallel.clip.ZScoreBound`'s state too); None: no
        clipping.
    """

    def __init__(self, model: PairedModel, optimizer: torch.optim.Optimizer, mode: StepMode, generator: torch.Generator,
                 stack: bool | None = None, clip: float | ZScoreBound | None = None):  # fmt: skip
        self.model, self.optimizer, self.mode, self.generator = model, optimizer, mode, generator
        self.clip = clip
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if isinstance(clip, ZScoreBound):  # its state exists before a capture saves it
            clip.prepare(self.dtype, self.device)
        #: the last step's gradient norm before clipping (a buffer a graph writes); None
        #: without ``clip``
        self.norm = None if clip is None else torch.zeros((), device=self.device)
        if mode.graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        stack_strata(model, stack)
        self.fn = forward_terms
        self.compile_seconds = 0.0
        if mode.compile:
            self.fn = torch.compile(forward_terms, dynamic=False)
        self._buffers: dict[int, StepBuffers] = {}
        # ((B, lr, weights), CUDAGraph, StepBuffers): a graph holds the loss weights it was
        # captured with (their factors, which terms exist), so a stage that changes them
        # captures anew even at the same learning rate
        self._graph: tuple | None = None
        self.captures = 0
        self._side = None  # the capture stream (CUDA graphs), made at the first capture
        #: bytes allocated at the peak of the last capture (what a replay's step uses:
        #: the graph replays the captured allocations in its private pool); None: no graph
        self.graph_peak: int | None = None
        self._weights: LossWeights | None = None  # the last step's (which terms it returns)
        self.eager_steps = 0  # steps that ran outside a graph (trailing batches, warm-up excluded)

    @property
    def stacked(self) -> bool:
        """Whether the Hi-C decoder runs its strata in one pass (:func:`stack_strata`)."""
        return self.model.hic_decoder.stack_strata

    # ------------------------------------------------------------- buffers
    def term_names(self, weights: LossWeights | None = None) -> list[str]:
        """The terms of the step's output, in order: ``cross`` only where ``weights``
        (default: the last step's; none yet: every term) train it, as the model computes
        it only then."""
        weights = weights or self._weights
        has_rna = self.model.has_rna
        cross = weights is None or bool(weights.cross)
        names = [t for t in TERM_ORDER if (has_rna or t not in ("rna_nll", "rna_kl", "align", "cross")) and (t != "cross" or cross)]
        return names

    def buffers(self, batch: int, n_genes: int, n_features: int, n_batches: int, encoder_copy: bool = False) -> StepBuffers:
        """The static buffers of a batch of ``batch`` cells (made once per shape);
        ``encoder_copy``: with a second Hi-C buffer the encoder reads (``hic_in``)."""
        b = self._buffers.get(batch)
        if b is None:
            n_nodes, d = self.model.graph_encoder.embedding.shape
            m, n_neg = graph_sample_sizes(self.model.edge_src.numel(), self.model.cfg.neg_samples, self.model.cfg.graph_batch)
            kw = dict(device=self.device, dtype=self.dtype)
            b = StepBuffers(
                rna=torch.zeros(batch, n_genes, **kw), hic=torch.zeros(batch, n_features, **kw),
                cond=torch.zeros(batch, n_batches, **kw) if n_batches else None,
                eps_rna=torch.zeros(batch, d, **kw), eps_hic=torch.zeros(batch, d, **kw), eps_nodes=torch.zeros(n_nodes, d, **kw),
                edge_idx=torch.zeros(m, dtype=torch.long, device=self.device),
                neg_idx=torch.zeros(n_neg, dtype=torch.long, device=self.device),
                hic_in=torch.zeros(batch, n_features, **kw) if encoder_copy else None,
            )  # fmt: skip
            self._buffers[batch] = b
        return b

    # ------------------------------------------------------------- the step
    def _compute(self, bufs: StepBuffers, weights: LossWeights, fn=None) -> torch.Tensor:
        """Forward (``fn``, default the step's own), backward and update on ``bufs``; the
        terms as one (n_terms,) tensor."""
        self.optimizer.zero_grad(set_to_none=True)
        terms = (fn or self.fn)(self.model, weights, bufs.rna, bufs.hic, bufs.cond, bufs.eps_rna, bufs.eps_hic, bufs.eps_nodes, bufs.edge_idx, bufs.neg_idx,
                                     bufs.hic_in)  # fmt: skip
        terms["total"].backward()
        if self.clip is not None:
            self.norm.copy_(clip_gradients(self.model, self.clip))
        self.optimizer.step()
        return torch.stack([terms[k].detach() for k in self.term_names(weights)])

    def step(self, bufs: StepBuffers, weights: LossWeights, full_batch: int) -> torch.Tensor:
        """One training step on the batch already in ``bufs`` (draws made here). Returns
        the loss terms (:meth:`term_names` order) as a new device tensor: no host sync."""
        self._weights = weights
        draw_step(self.model, bufs, self.generator)
        batch = bufs.rna.shape[0]
        if batch != full_batch:  # the epoch's trailing batch: eager, no second compile or graph
            self.eager_steps += 1
            return self._compute(bufs, weights, forward_terms)
        if not self.mode.graphs:
            t0 = time.perf_counter()
            out = self._compute(bufs, weights)
            if self.mode.compile and self.compile_seconds == 0.0:
                self.compile_seconds = time.perf_counter() - t0  # the first call compiles
                log.info("torch.compile: the step compiled in %.1f s (batch of %d cells)", self.compile_seconds, batch)
            return out
        key = (batch, tuple(g["lr"] for g in self.optimizer.param_groups), weights)
        if self._graph is None or self._graph[0] != key:
            self._capture(bufs, key)
        self._graph[1].replay()
        return self._graph[2].out.clone()

    def step_memory(self, memory):
        """A measured step's :class:`~ampflow.train.measured_memory.StepMemory` as the step
        uses memory: a replay allocates nothing, so with a graph the peak is its capture's."""
        if memory is None or self.graph_peak is None:
            return memory
        return dataclasses.replace(memory, peak=max(memory.peak, self.graph_peak), peak_phase="graph")

    # ------------------------------------------------------------- capture
    def _clip_tensors(self) -> list[torch.Tensor]:
        return self.clip.tensors() if isinstance(self.clip, ZScoreBound) else []

    def _capture(self, bufs: StepBuffers, key: tuple) -> None:
        """Capture the whole step for ``key`` = (``bufs``' batch, the learning rates,
        the loss weights), leaving the model and optimizer as they were before the warm-up."""
        batch, lr, weights = key
        self._graph = None  # the old graph's memory goes back first
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        saved = _snapshot(self.model, self.optimizer)
        clip_state = [t.clone() for t in self._clip_tensors()]  # the warm-up steps update a ZScoreBound
        # dropout draws from the device's default generator: the warm-up must leave it
        # where it was, or a run resumed from a checkpoint (capturing at another step)
        # would draw other masks than the uninterrupted run (a replay advances it as an
        # eager step does)
        rng = torch.cuda.get_rng_state(self.device)
        # one side stream for every warm-up and capture: cuBLAS keeps a workspace per
        # stream (66 MiB), so a new stream per capture would add one each time
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_ITERS):
                self._compute(bufs, weights)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.cuda.graph(graph, stream=side):
            bufs.out = self._compute(bufs, weights)
        self.graph_peak = int(torch.cuda.max_memory_allocated())
        _restore(self.model, self.optimizer, saved)
        for t, v in zip(self._clip_tensors(), clip_state):
            t.copy_(v)
        torch.cuda.set_rng_state(rng, self.device)
        torch.cuda.synchronize()
        self._graph = (key, graph, bufs)
        self.captures += 1
        log.info("CUDA graph: captured the whole step (batch of %d cells, lr %s) in %.2f s, %d warm-up iterations undone",
                 batch, ", ".join(f"{x:g}" for x in lr), time.perf_counter() - t0, WARMUP_ITERS)  # fmt: skip


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
    """Copies of the parameters, buffers and optimizer state (None: no state yet), in
    host memory: on the device they would sit beside the capture (up to three times the
    parameters' bytes) and raise its peak above the step's, which the plan predicts."""
    params = [_host_copy(p) for p in model.parameters()]
    buffers = [_host_copy(b) for b in model.buffers()]
    state = [{k: (_host_copy(v) if torch.is_tensor(v) else v) for k, v in optimizer.state[p].items()} if p in optimizer.state else None
             for g in optimizer.param_groups for p in g["params"]]  # fmt: skip
    return params, buffers, state


@torch.no_grad()
def _restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: tuple) -> None:
    """Put back what :func:`_snapshot` copied, in place (a captured graph keeps the
    tensors' addresses). State made by the warm-up (a fresh optimizer's moments and step
    counts) goes back to zero, which is what a fresh Adam starts from."""
    params, buffers, state = saved
    for p, v in zip(model.parameters(), params):
        p.copy_(v)
    for b, v in zip(model.buffers(), buffers):
        b.copy_(v)
    for p, s in zip((p for g in optimizer.param_groups for p in g["params"]), state):
        for k, v in optimizer.state.get(p, {}).items():
            if not torch.is_tensor(v):
                continue
            if s is None:
                v.zero_()
            else:
                v.copy_(s[k])
