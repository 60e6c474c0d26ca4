"""Training-step time of the paired model at mm10's real shapes, by component, against
the FLOP floor, with the old attention kernel and plan beside the new ones.

Shapes (``--shapes``, resolution:strata) are built from a chrom.sizes file the way the
workflow builds them, without contact data (a step's cost depends on shapes, not on
values): anchors are the bins of the kept chromosomes (mm10 chr1-19, X), Hi-C features
every cis bin pair ``(b, b + k)`` for ``k < strata``
(:func:`ampflow.prepare.strata.candidate_index`, all candidates kept, as a few hundred
cells keep nearly all of them), ``--genes`` genes, and a guidance graph of genes and
anchors (each gene linked to one anchor, ``--graph-degree`` cis contact edges per
anchor, both directions, self-loops). Counts are Poisson: RNA with per-gene
log-normal rates and ``--umis`` per cell, Hi-C with ``--contacts`` per cell, a feature
of stratum ``k`` getting a share that falls as ``1/(k+1)``. The model is
:class:`~ampflow.model.paired.PairedModel` with the config's defaults, trained by Adam
as the trainer trains it (``model.train()``, pretraining loss weights).

Two variants run on every shape, each on a freshly built model with the same seed:

* new: the banded kernel (:func:`~ampflow.model.attention.local_attention`, the model's
  default) under the plan that :func:`ampflow.amp.decide.diagnose.diagnose` makes today for
  one device of ``--memory-gib`` (its chunk size and key-first decode), applied with
  :func:`ampflow.parallel.parallelize.parallelize` as the trainer applies it;
* old (``--old per-offset``, the default): the same plan run by the per-offset banded
  kernel the blocked one replaced (``scripts/attention_baselines.py``: the same band
  math, one band column at a time);
* old (``--old chunked``): the same plan with chunk ``--old-chunk`` (2048, what the
  planner picked at 1 Mb when it took the largest power of two that fits) run by the
  kernel the model dispatched to before any banded one,
  ``local_attention_chunked`` (``scripts/attention_baselines.py``) (``local_attention_full`` for
  chunk 0). Where its saved probabilities, ``H * sum(C_i * (C_i + 2w))`` floats per
  stratum over the clipped chunks, would exceed ``--max-old-gib`` in all strata
  together, the old variant is skipped and the estimate is printed.

The switch rebinds the kernel name the Hi-C decoder calls for the duration of the old
variant only; the model's default is untouched.

Per shape: one warm-up step of each variant, which counts FLOPs, then rounds of one
instrumented step of each variant followed by one plain step of each, on the same
batches: taking turns, the variants share whatever load other processes put on the
CPU. ``--steps`` rounds, or fewer (at least one) where the warm-ups say that they would
take more than ``--shape-seconds``. Medians over the rounds are reported:

* seconds by component: ``encoders`` (``PairedModel.encode``: input transforms and both
  encoders), ``graph`` (graph encoder and node sample, and the graph loss), each
  stratum's attention block (``StratumBlock.forward``: norms, projections, the kernel,
  the feed-forward), ``decode`` (the Hi-C decoder less its blocks, and the RNA
  decoder), ``likelihood`` (``NB``/``ZINB.log_prob``), ``other forward`` (what the
  forward does outside those: KL and alignment terms, the samples), ``backward``
  (``loss.backward()``, whole) and ``optimizer`` (``zero_grad`` + ``Adam.step``).
  Times are exclusive (a block's time is not counted in ``decode``) and measured by
  forward hooks and wrappers that the benchmark installs and removes; with
  ``--threads`` > 1 the clock stops when the caller's thread does, which is when the
  op's threads are done (CPU ops are synchronous);
* the plain step's wall time, with nothing installed: the check that the components
  add up (their sum over the plain step is printed, of the medians and of the fastest
  steps, the latter being what other processes' load disturbs least);
* the FLOP floor: the step's FLOPs, as :class:`torch.utils.flop_counter.FlopCounterMode`
  counts them (matrix products only: ``mm``, ``addmm``, ``bmm``, convolutions,
  forward and backward, ``2 m n k`` each; elementwise work, softmax, ``lgamma``, gathers
  and scatters count zero) in the new variant, plus the band attention's products,
  which the banded kernel does elementwise and the counter does not see:
  ``4 D P`` forward and ``8 D P`` backward per stratum, ``P`` being the in-window
  (query, key) pairs. That is the work the model's math needs, whichever kernel runs,
  so it is one floor for both variants. Divided by this CPU's rate on a
  ``--matmul``-square fp32 matrix product (best of 5, same threads, measured in this
  run) it gives the floor in seconds; the ratio printed is floor / measured (1.0 = at
  the floor). Per component the forward FLOPs are attributed by module
  (``backward`` gets the step's backward FLOPs; ``likelihood`` and ``optimizer`` have
  none the counter sees, so no ratio). The old kernel's own matrix products
  (``chunk + 2w`` scores per query) are printed as what its blocks execute;
* a plain step's CPU seconds (``time.process_time``, all threads), split into user and
  system time, and its minor page faults (``getrusage``): system time there is mostly
  the kernel zero-filling pages of large tensors that the allocator maps afresh each
  step. On a CPU that other processes share, wall time also counts the time this
  process waits for a core, CPU time does not: the speed-up and the floor ratio are
  printed in both (the CPU floor divides the FLOPs by the product's GFLOP per CPU
  second). With one thread the CPU figures hardly depend on the load; with more, an
  idle thread's spinning at a barrier counts as CPU time too.

Threads: ``torch.set_num_threads(--threads)`` once for the whole run (default: the
cores this process may use); the matrix-product rate is measured with the same count,
once per shape. On a CPU shared with other work, more threads than idle cores slow the
many small operations of the attention blocks most (each waits for its slowest thread);
``--threads 1`` then gives steadier figures.
On a GPU (``--device cuda``) the model, its optimizer and the batches live on the GPU;
every clock reading is preceded by ``torch.cuda.synchronize()`` (the component
regions, the plain steps, the matrix product), so that a region's seconds are those of
its kernels and not of their launch; the synchronisations themselves cost a few
microseconds each and serialise the host with the device, so the components sum to a
little more than a plain step. The floor's rate is the GPU's measured fp32 rate on the
``--matmul``-square product (TF32 as torch's settings allow it), and the plan is made
for the GPU's memory. CPU seconds and page faults are then the host's, not the work's.
Progress goes to stderr; the tables to stdout.

The HiRES-size case (``--hires``) runs the trainer instead, as the workflow runs it
(:class:`ampflow.train.trainer.Trainer` on a :class:`ampflow.train.data.PairedData`,
the template's ``train`` section from ``config/config.yaml``, its early stopping and
threads; no plan, so the model runs as built), on ``--hires-cells`` synthetic cells (HiRES:
7,469) at each shape: the shape as above, the counts Poisson as above but sparse, every
cell trained on (no ``split`` column, no batches). Per shape and mode (``--modes``:
``eager`` = ``train.compile`` and ``train.cuda_graphs`` false, today's step;
``compiled`` = compile only; ``graphed`` = CUDA graphs only (a GPU only);
``compiled+graphed``, each reading the counts as they are (``train.hic_keep_min: 1``);
``eager-thinned`` and ``graphed-thinned``: the same with the default thinning
(``train.hic_keep_min: 0.15``, ``train.hic_thinned: encoder``: the counts whole and the
encoder's thinned copy), thinned on the host eagerly and on the device when graphed, what thinning costs beside
the plain mode) one epoch of full batches, cut to the steps needed, without early
stopping, checkpoints or output files (a subclass of the trainer adds the probes):

* ``--hires-warmup`` steps first (the compile or the capture, the trainer's measured
  first steps), then ``--hires-steps`` timed ones: steps/s between two
  synchronisations, the trainer's own reads of its loss terms (every ``train.log_every``
  steps) included; the first step's seconds, the compile's
  (``StaticStep.compile_seconds``) and the captures' (timed around
  ``StaticStep._capture``) are printed apart; seconds per epoch are the template's
  steps per epoch (``ceil(training cells / batch)``, its validation tenth set aside) at
  that rate, the per-epoch validation and the trailing batch not counted;
* 2 steps under a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that counts
  host syncs inside ``Trainer._train_step`` (not the trainer's reads between steps):
  ``aten._local_scalar_dense`` (``.item()``, ``bool()``) of a CUDA tensor, copies from a
  CUDA tensor to the CPU, and CUDA ops whose output size depends on values (nonzero,
  masked_select, unique); those inside ``optimizer.step`` are counted apart (on a CPU
  every scalar read counts; the trainer's fused Adam there reads none, the loop it
  replaced read each parameter's step count once per step). On CUDA the same steps also run under CUDA's sync debug mode
  (``torch.cuda.set_sync_debug_mode``), whose warnings count every synchronising call,
  compiled code and host-to-device copies from pageable memory included. While a dispatch
  mode is active torch.compile runs the forward eagerly (dynamo skips frames under one):
  the dispatch-mode counts of a compiled step are those of its eager forward; the sync
  debug mode's are not;
* launches: on CUDA 3 steps under ``torch.profiler``: host launch calls per step (kernel
  launches, async copies and memsets, graph launches; a replayed graph is one
  ``cudaGraphLaunch``) and the GPU's kernel and copy events per step (the profiler traces
  a graph's kernels, so for a graphed step this is what the graph runs); on a CPU 2 steps
  under the profiler counting aten ops that no other aten op called (what the step
  launches), beside the ops the dispatch mode saw; from the same profile, the time per
  step summed over the GPU's kernels and copies (CUDA: beside the wall time, whether the
  GPU is busy or waits) or over the aten ops' own CPU time, and the names that take the
  most of it (what limits the step);
* the floors, per shape, from one step of a fresh model on a batch of the data, with the
  rates measured in the same run: the FLOP floor as above (counted matrix products plus
  the band's products) at the ``--matmul`` product's rate, and a bytes floor: the bytes a
  step must move at least, at the bandwidth of a ``--copy-mib`` tensor copy (bytes read
  plus written per second, best of 5). The bytes model: each parameter read by the
  forward, its gradient written by the backward, and Adam reading parameter, gradient and
  both moments and writing parameter and moments (9 x 4 bytes per parameter); the batch's
  dense inputs read once; every tensor the forward saves for the backward (distinct
  storages, parameters and inputs excluded) written once and read once. Both ratios are
  floor / measured seconds per step.

With ``--hires-early-stopping`` the first shape is then trained to early stopping under
the template's train section unchanged (both stages, their epochs as a ceiling, early
stopping, checkpoints; mode ``--early-stopping-mode``) and the wall time to stop, the
epochs run and steps/s (validation included) are printed, or ``did not stop within N s``
once ``--early-stopping-seconds`` have passed; beside them, the seconds spent outside the
steps: validation, early stopping's copies of the best weights, and checkpoints. A mode
that fails prints one line, ``FAILED``, with its error (its traceback to stderr) and the
rest still runs; the exit status is then 1. One line per figure set, each starting ``hires RES:STRATA MODE:``.

Examples::

    python scripts/bench_train.py                                # a few minutes on 2 cores
    python scripts/bench_train.py --shapes 1000000:10 --steps 5
    python scripts/bench_train.py --threads 1 --cells 512 --batch 64
    python scripts/bench_train.py --device cuda --shapes 1000000:10 --batch 64
    python scripts/bench_train.py --hires --device cuda --batch 32 --contacts 20000 \
        --modes eager compiled graphed --compiled-shapes 1000000:10 --hires-early-stopping
    python scripts/bench_train.py --hires --shapes 1000000:10 --hires-cells 512 --modes eager compiled
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

try:
    import ampflow  # noqa: F401
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from ampflow.amp.decide.diagnose import diagnose
from ampflow.io.genome import make_bins, read_chromsizes, resolution_label
from ampflow.model import decoders, paired, prob
from ampflow.model.attention import local_attention_full
from ampflow.model.paired import GraphSpec, PairedModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_baselines import chunk_blocks, local_attention_chunked, local_attention_per_offset  # noqa: E402

from ampflow.contract.config import ModelConfig, TrainConfig
from ampflow.contract.profile import ProfileTrain
from ampflow.parallel.parallelize import parallelize
from ampflow.prepare.strata import candidate_index

log = logging.getLogger("bench_train")

REPO = Path(__file__).resolve().parents[1]
# the shared data folder, as the tests find it (AMPFLOW_SHARED_DATA, else shared/ beside the checkout)
SHARED_DATA = Path(os.environ.get("AMPFLOW_SHARED_DATA") or REPO.parent / "shared" / "data")
DEFAULT_SIZES = SHARED_DATA / "annotation" / "mm10.chrom.sizes"
MM10_CHROMS = [f"chr{i}" for i in range(1, 20)] + ["chrX"]
GIB = 2**30

# rows of the table, in order; the attention rows ("attention k=..") go after "graph"
HEAD = ["encoders", "graph"]
TAIL = ["decode", "likelihood", "other forward", "backward", "optimizer"]


# ------------------------------------------------------------------------ shapes
@dataclass
class Shape:
    """The tensors one resolution gives the model."""

    label: str
    n_strata: int
    feature_anchor: torch.Tensor  # (F,) stratum-major
    feature_stratum: torch.Tensor  # (F,)
    graph: GraphSpec
    n_genes: int
    resolution: int  # bp: the data says it, as a workflow's does (model.hic_max_distance reads it)

    @property
    def n_anchors(self) -> int:
        return int((self.feature_stratum == 0).sum())

    @property
    def features_per_stratum(self) -> list[int]:
        return torch.bincount(self.feature_stratum, minlength=self.n_strata).tolist()


def build_shape(sizes: dict[str, int], resolution: int, n_strata: int, n_genes: int, degree: int, seed: int) -> Shape:
    """Strata features and a guidance graph of mm10 at ``resolution`` (see the module doc)."""
    bins = make_bins(sizes, resolution)
    _, var = candidate_index(bins, list(sizes), n_strata)
    anchor = torch.from_numpy(var["anchor"].to_numpy(np.int64))
    stratum = torch.from_numpy(var["stratum"].to_numpy(np.int64))
    g = torch.Generator().manual_seed(seed)
    n = int((stratum == 0).sum())
    # contact edges stay on each anchor's chromosome: a partner drawn from its range
    chrom_codes = torch.from_numpy(bins["chrom"].cat.codes.to_numpy(np.int64))
    starts = torch.searchsorted(chrom_codes, torch.arange(len(sizes)))
    ends = torch.cat([starts[1:], torch.tensor([n])])
    a = torch.arange(n).repeat(degree)
    lo, hi = starts[chrom_codes[a]], ends[chrom_codes[a]]
    b = lo + (torch.rand(a.numel(), generator=g) * (hi - lo)).long()
    keep = a != b
    a, b = a[keep], b[keep]
    genes = torch.arange(n_genes)
    gene_anchor = torch.randint(n, (n_genes,), generator=g)
    one_src = torch.cat([genes, n_genes + a])
    one_dst = torch.cat([n_genes + gene_anchor, n_genes + b])
    n_nodes = n_genes + n
    loops = torch.arange(n_nodes)
    src = torch.cat([one_src, one_dst, loops])
    dst = torch.cat([one_dst, one_src, loops])
    weight = torch.cat([torch.ones(n_genes), torch.rand(a.numel(), generator=g) * 0.9 + 0.1])
    weight = torch.cat([weight, weight, torch.ones(n_nodes)])
    graph = GraphSpec(
        src=src, dst=dst, weight=weight, sign=torch.ones(src.numel()), n_nodes=n_nodes,
        gene_nodes=torch.arange(n_genes), anchor_nodes=torch.arange(n_genes, n_nodes),
    )  # fmt: skip
    return Shape(f"{resolution_label(resolution)}/{n_strata}", n_strata, anchor, stratum, graph, n_genes, resolution)


class Cells:
    """Poisson counts of a pool of ``n`` cells, drawn batch by batch (the same batch
    index always gives the same cells' counts)."""

    def __init__(self, shape: Shape, n: int, batch: int, umis: float, contacts: float, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.n, self.batch, self.seed = n, batch, seed
        rate = torch.exp(torch.randn(shape.n_genes, generator=g) * 1.5)
        self.gene_share = rate / rate.sum()
        # a feature's expected share of a cell's contacts falls with its distance as 1/(k+1)
        decay = 1.0 / (shape.feature_stratum.double() + 1.0)
        self.feature_share = (decay / decay.sum()).float()
        self.umis, self.contacts = umis, contacts

    def __len__(self) -> int:
        return max(1, self.n // self.batch)

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + i % len(self))
        depth = torch.exp(torch.randn(self.batch, 1, generator=g) * 0.4)
        rna = torch.poisson(depth * self.umis * self.gene_share, generator=g)
        hic = torch.poisson(depth * self.contacts * self.feature_share, generator=g)
        return rna, hic


# ------------------------------------------------------------------------ plans and kernels
def shape_profile(shape: Shape, batch: int) -> dict:
    """The profile (:func:`ampflow.amp.profile.profile_data`'s fields that the diagnosis
    reads) of ``shape`` under the default model and training settings."""
    cfg = ModelConfig()
    fps = shape.features_per_stratum
    cells = 1000
    return {
        "version": 1,
        "modalities": {
            "rna": {"prob_model": "NB", "n_features": shape.n_genes, "n_cells": cells},
            "hic": {
                "prob_model": "HiCZINB",
                "n_features": sum(fps),
                "n_cells": cells,
                "n_strata": shape.n_strata,
                "n_anchors": shape.n_anchors,
                "features_per_stratum": fps,
                "attention": cfg.attention,
                "window": cfg.window,
                "heads": cfg.heads,
            },
        },
        "graph": {"n_nodes": shape.graph.n_nodes, "n_edges": int(shape.graph.src.numel())},
        "model": cfg.to_dict(),
        "train": ProfileTrain.from_config(TrainConfig(batch_size=batch)).to_dict(),
    }


def old_local_attention(q, k, v, window, chunk=None, scale=None):
    """What ``local_attention`` ran before the banded kernel: full masked attention
    without a chunk, else the chunked kernel (``chunk + 2w`` scores per query)."""
    if not chunk:
        return local_attention_full(q, k, v, window, scale)
    return local_attention_chunked(q, k, v, window, chunk, scale)


@contextlib.contextmanager
def kernel(fn):
    """The Hi-C decoder's attention kernel is ``fn`` inside the block."""
    saved = decoders.local_attention
    decoders.local_attention = fn
    try:
        yield
    finally:
        decoders.local_attention = saved


def band_pairs(n: int, window: int) -> int:
    """In-window (query, key) pairs ``|i - j| <= window`` of a sequence of ``n``
    (closed form: the full band less the two corners it loses at the ends; whichever
    kernel computes it)."""
    n, w = int(n), min(int(window), max(int(n) - 1, 0))
    return n * (2 * w + 1) - w * (w + 1)


def chunked_pairs(n: int, window: int, chunk: int) -> int:
    """(query, key) scores the chunked kernel computes: ``sum (e - s)(ke - ks)``."""
    return sum((e - s) * (ke - ks) for s, e, ks, ke in chunk_blocks(n, window, chunk))


# ------------------------------------------------------------------------ timing
def synchronizer(device: str):
    """What to call before reading a clock on ``device``: ``torch.cuda.synchronize`` on
    CUDA (kernels run asynchronously), nothing on CPU (ops are synchronous)."""
    return torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)


class Clock:
    """Exclusive seconds per label of nested regions (a region's children are not
    counted in it). ``sync`` runs before every clock reading (see
    :func:`synchronizer`)."""

    def __init__(self, sync=None):
        self.seconds: dict[str, float] = {}
        self._stack: list[list] = []
        self._sync = sync or (lambda: None)

    def enter(self, label: str) -> None:
        self._sync()
        self._stack.append([label, time.perf_counter(), 0.0])

    def exit(self, label: str) -> None:
        self._sync()
        name, t0, inner = self._stack.pop()
        if name != label:
            raise RuntimeError(f"timed regions out of order: {label} closed inside {name}")
        dt = time.perf_counter() - t0
        self.seconds[label] = self.seconds.get(label, 0.0) + dt - inner
        if self._stack:
            self._stack[-1][2] += dt

    @contextlib.contextmanager
    def region(self, label: str):
        self.enter(label)
        try:
            yield
        finally:
            self.exit(label)

    def wrap(self, fn, label: str):
        def timed(*args, **kwargs):
            with self.region(label):
                return fn(*args, **kwargs)

        return timed


def attention_label(k: int) -> str:
    return f"attention k={k}"


@contextlib.contextmanager
def instrumented(model: PairedModel, clock: Clock):
    """Hooks and wrappers that time the model's components on ``clock``; all removed
    on exit."""
    handles = []

    def hook(module, label):
        handles.append(module.register_forward_pre_hook(lambda m, a: clock.enter(label)))
        handles.append(module.register_forward_hook(lambda m, a, o: clock.exit(label)))

    hook(model.hic_decoder, "decode")
    if model.has_rna:
        hook(model.rna_decoder, "decode")
    for k, block in enumerate(model.hic_decoder.blocks, 1):
        hook(block, attention_label(k))
    # methods and functions, not modules: wrapped on the instance, the module or the class
    model.encode = clock.wrap(PairedModel.encode.__get__(model), "encoders")
    model.node_latents = clock.wrap(PairedModel.node_latents.__get__(model), "graph")
    saved = (paired.graph_nll, prob.NB.log_prob, prob.ZINB.log_prob)
    paired.graph_nll = clock.wrap(saved[0], "graph")
    prob.NB.log_prob = clock.wrap(saved[1], "likelihood")
    prob.ZINB.log_prob = clock.wrap(saved[2], "likelihood")
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        del model.encode, model.node_latents
        paired.graph_nll, prob.NB.log_prob, prob.ZINB.log_prob = saved


def train_step(model, optimizer, rna, hic, weights, generator, clock: Clock | None = None) -> None:
    """One training step as the trainer runs it in one process (timed on ``clock``)."""
    clock = clock or Clock()
    with clock.region("optimizer"):
        optimizer.zero_grad(set_to_none=True)
    with clock.region("other forward"):
        terms = model(rna, hic, weights, generator=generator)
    with clock.region("backward"):
        terms["total"].backward()
    with clock.region("optimizer"):
        optimizer.step()


def counted_step(model, optimizer, rna, hic, weights, generator) -> tuple[dict[str, int], dict[str, int]]:
    """One step under FlopCounterMode: FLOPs by module (inclusive) of the forward, and
    of forward + backward (only its ``Global`` total is read)."""
    optimizer.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as both:
        with FlopCounterMode(display=False) as fwd:
            terms = model(rna, hic, weights, generator=generator)
        terms["total"].backward()
    optimizer.step()

    def by_module(counter):
        return {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}

    return by_module(fwd), by_module(both)


def forward_flops_by_component(by_module: dict[str, int], n_blocks: int, root: str = "PairedModel") -> dict[str, int]:
    """The counter's inclusive per-module forward FLOPs as the table's components."""

    def f(name: str) -> int:
        return by_module.get(f"{root}.{name}" if name else root, 0)

    blocks = {attention_label(k): f(f"hic_decoder.blocks.{k - 1}") for k in range(1, n_blocks + 1)}
    out = {
        "encoders": f("rna_encoder") + f("hic_encoder"),
        "graph": f("graph_encoder"),
        **blocks,
        "decode": f("hic_decoder") - sum(blocks.values()) + f("rna_decoder"),
        "likelihood": 0,
    }
    out["other forward"] = f("") - sum(out.values())
    return out


@dataclass(frozen=True)
class Rate:
    """A matrix product's best rate: GFLOP per second of wall time, and per CPU second
    of this process (all its threads)."""

    wall: float
    cpu: float


def matmul_rate(n: int, repeats: int = 5, device: str = "cpu") -> Rate:
    """The device's best fp32 rate on an ``n x n @ n x n`` product (on CUDA between
    synchronisations)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g).to(device), torch.randn(n, n, generator=g).to(device)
    sync = synchronizer(device)
    a @ b  # first touch (and, on CUDA, the cuBLAS handle and its workspace)
    wall = cpu = math.inf
    for _ in range(repeats):
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        a @ b
        sync()
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return Rate(2 * n**3 / wall / 1e9, 2 * n**3 / cpu / 1e9)


# ------------------------------------------------------------------------ the variants
@dataclass
class Result:
    seconds: dict[str, float]  # component -> median seconds per step
    step: float  # median plain step
    step_min: float  # fastest plain step
    cpu_s: float  # median CPU seconds (all threads) of a plain step
    usage: tuple[float, float, float]  # median user s, system s, minor page faults of a plain step
    instrumented: float  # median instrumented step (sum of components)
    instrumented_min: float  # fastest instrumented step
    forward_flops: dict[str, int]  # component -> counted forward FLOPs
    step_flops: int  # counted forward + backward FLOPs
    block_flops: int  # counted forward FLOPs of the attention blocks x 3 (with backward)


class Variant:
    """A model built under ``plan`` whose blocks run ``attention_fn``, with its own
    optimizer and sampling generator (the same seeds for every variant)."""

    def __init__(self, tag: str, shape: Shape, plan, attention_fn, seed: int, device: str = "cpu"):
        self.tag, self.fn, self.n_blocks = tag, attention_fn, shape.n_strata - 1
        self.device, self.sync = device, synchronizer(device)
        torch.manual_seed(seed)
        model = PairedModel(ModelConfig(), shape.n_genes, shape.feature_anchor, shape.feature_stratum, shape.n_strata, shape.graph)
        self.model = parallelize(model, plan).to(device)
        self.model.train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=TrainConfig().pretrain.lr)
        self.weights = TrainConfig().pretrain.weights
        self.gen = torch.Generator().manual_seed(seed)
        self.per_step: list[dict[str, float]] = []
        self.plain: list[float] = []
        self.cpu: list[float] = []
        self.usage: list[tuple[float, float, float]] = []

    def warm_up(self, rna, hic) -> None:
        """The first step, counting FLOPs (the optimizer's state is created here)."""
        rna, hic = rna.to(self.device), hic.to(self.device)
        with kernel(self.fn):
            fwd, both = counted_step(self.model, self.optimizer, rna, hic, self.weights, self.gen)
        self.fwd = forward_flops_by_component(fwd, self.n_blocks)
        self.step_flops = both.get("Global", 0)
        # forward x 3: every product in a block has two in backward (a gradient for each
        # operand). The counter's own per-module backward attribution is not used: the
        # blocks share their input, and it assigns each block's backward to the others too.
        self.block_flops = 3 * sum(self.fwd[attention_label(k)] for k in range(1, self.n_blocks + 1))

    def step(self, rna, hic, timed: bool) -> float:
        """One step, by component (``timed``) or whole; returns its seconds."""
        rna, hic = rna.to(self.device), hic.to(self.device)
        with kernel(self.fn):
            if timed:
                clock = Clock(self.sync)
                with instrumented(self.model, clock):
                    train_step(self.model, self.optimizer, rna, hic, self.weights, self.gen, clock)
                self.per_step.append(clock.seconds)
                return sum(clock.seconds.values())
            self.sync()
            r0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
            train_step(self.model, self.optimizer, rna, hic, self.weights, self.gen)
            self.sync()
            self.plain.append(time.perf_counter() - t0)
            self.cpu.append(time.process_time() - c0)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            self.usage.append((r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt))
            return self.plain[-1]

    def result(self) -> Result:
        labels = sorted({k for s in self.per_step for k in s})
        return Result(
            seconds={k: statistics.median(s.get(k, 0.0) for s in self.per_step) for k in labels},
            step=statistics.median(self.plain),
            step_min=min(self.plain),
            cpu_s=statistics.median(self.cpu),
            usage=tuple(statistics.median(u[i] for u in self.usage) for i in range(3)),
            instrumented=statistics.median(sum(s.values()) for s in self.per_step),
            instrumented_min=min(sum(s.values()) for s in self.per_step),
            forward_flops=self.fwd,
            step_flops=self.step_flops,
            block_flops=self.block_flops,
        )


def measure(label: str, variants: list[Variant], cells: Cells, steps: int, seconds: float) -> tuple[dict[str, Result], int]:
    """Warm up every variant, then time them in turns on the same batches: a round is
    one instrumented step of each variant, then one plain step of each, so that the
    load other processes put on a shared CPU falls on all of them alike.

    Rounds: ``steps``, or fewer (at least one) where the warm-up steps say that
    ``steps`` rounds would take more than ``seconds``. Returns the results and the
    rounds run."""
    warm = 0.0
    for v in variants:
        t0 = time.perf_counter()
        v.warm_up(*cells.get(0))
        v.sync()
        warm += time.perf_counter() - t0
        log.info("%s %s: warm-up step (FLOPs counted) %.2f s", label, v.tag, time.perf_counter() - t0)
    rounds = max(1, min(steps, int(seconds // (2 * warm))))
    if rounds < steps:
        log.info("%s: %d timed round(s) instead of %d: a round takes about %.0f s (--shape-seconds %g)",
                 label, rounds, steps, 2 * warm, seconds)  # fmt: skip
    steps = rounds
    for i in range(steps):
        rna, hic = cells.get(1 + i)
        for timed in (True, False):
            for v in variants:
                s = v.step(rna, hic, timed)
                log.info("%s %s: %s step %d/%d %.2f s", label, v.tag, "instrumented" if timed else "plain", i + 1, steps, s)
    return {v.tag: v.result() for v in variants}, steps


# ------------------------------------------------------------------------ the report
def floor_flops(new: Result, n_anchors: int, window: int, D: int) -> dict[str, int]:
    """FLOPs of each component that the model's math needs (see the module doc): the
    new variant's counted forward FLOPs, ``backward`` the rest of its counted step, and
    each stratum's band products added (``4 D P`` forward, ``8 D P`` backward)."""
    band = 4 * D * band_pairs(n_anchors, window)
    out = dict(new.forward_flops)
    blocks = [k for k in out if k.startswith("attention")]
    for k in blocks:
        out[k] += band
    out["backward"] = new.step_flops - sum(new.forward_flops.values()) + 2 * band * len(blocks)
    out["optimizer"] = 0
    return out


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def ratio(flops: int, rate: float, seconds: float) -> float | None:
    """Floor over measured: ``flops / rate`` seconds against ``seconds``."""
    return flops / (rate * 1e9) / seconds if flops and seconds > 0 else None


def shape_report(shape: Shape, res: dict[str, Result], floor: dict[str, int], rates: Rate) -> list[str]:
    """The table of one shape (a column pair per variant) and its summary lines."""
    rows = HEAD + [attention_label(k) for k in range(1, shape.n_strata)] + TAIL
    total = sum(floor.values())
    rate = rates.wall
    cols = [(tag, res[tag]) for tag in ("old", "new") if tag in res]
    head = f"  {'component':<18} {'GFLOP':>8}"
    for tag, _ in cols:
        head += f" {tag + ' s/step':>12} {'floor ratio':>11}"
    lines = [head]
    for row in rows:
        line = f"  {row:<18} {floor.get(row, 0) / 1e9:>8.3f}"
        for _, r in cols:
            s = r.seconds.get(row, 0.0)
            line += f" {s:>12.4f} {fmt_ratio(ratio(floor.get(row, 0), rate, s)):>11}"
        lines.append(line)
    line = f"  {'sum of components':<18} {'':>8}"
    for _, r in cols:
        line += f" {r.instrumented:>12.4f} {'':>11}"
    lines.append(line)
    line = f"  {'plain step':<18} {total / 1e9:>8.3f}"
    for _, r in cols:
        line += f" {r.step:>12.4f} {fmt_ratio(ratio(total, rate, r.step)):>11}"
    lines.append(line)
    floor_s = total / (rate * 1e9)
    floor_cpu = total / (rates.cpu * 1e9)
    lines.append("")
    for tag, r in cols:
        user, system, faults = r.usage
        lines.append(
            f"  {tag}: step {r.step:.4f} s; floor {floor_s:.4f} s ({total / 1e9:.2f} GFLOP at {rate:.1f} GFLOP/s): "
            f"floor ratio {floor_s / r.step:.3f}; its components sum to {r.instrumented / r.step:.2f}x its plain step "
            f"(medians; fastest steps: {r.instrumented_min / r.step_min:.2f}x); {1 / r.step:.2f} steps/s"
        )
        lines.append(
            f"  {tag}: CPU {r.cpu_s:.4f} s per step ({user:.3f} user, {system:.3f} system, all threads; "
            f"{faults:,.0f} minor page faults); CPU floor {floor_cpu:.4f} s ({rates.cpu:.1f} GFLOP per CPU s): "
            f"ratio {floor_cpu / r.cpu_s:.3f}"
        )
    if "old" in res:
        needed = sum(floor[attention_label(k)] for k in range(1, shape.n_strata)) * 3  # forward + backward (2x)
        lines.append(
            f"  old: its attention blocks execute {res['old'].block_flops / 1e9:.2f} GFLOP of matrix products "
            f"(forward + backward) where the band needs {needed / 1e9:.2f}"
        )
    if "old" in res and "new" in res:
        old, new = res["old"], res["new"]
        lines.append(f"  new / old speed-up: {old.step / new.step:.1f}x wall, {old.cpu_s / new.cpu_s:.1f}x CPU seconds (plain steps, same run)")
    return lines


# ------------------------------------------------------------------------ the HiRES-size case
HIRES_MODES = {  # mode -> (train.compile, train.cuda_graphs)
    "eager": (False, False),
    "compiled": (True, False),
    "graphed": (False, True),
    "graphed-loop": (False, True),  # graphed, the Hi-C decoder's strata one at a time (as before stacking)
    "compiled+graphed": (True, True),
    "eager-thinned": (False, False),  # with Hi-C thinning (THINNING): on the host
    "graphed-thinned": (False, True),  # the same on a GPU: thinned on the device, beside the resident counts
}
#: modes whose step runs the strata one at a time where the step would stack them
LOOP_MODES = {"graphed-loop"}
#: modes whose trainer thins the Hi-C counts each step reads, with these settings (the
#: defaults: the encoder's own copy thinned from 0.15)
THINNED_MODES, THINNING = {"eager-thinned", "graphed-thinned"}, {"hic_keep_min": 0.15, "hic_thinned": "encoder"}
TEMPLATE_CONFIG = REPO / "config" / "config.yaml"


class TimeLimit(Exception):
    """The run passed its deadline (``--early-stopping-seconds``)."""


def hires_counts(shape: Shape, n: int, umis: float, contacts: float, seed: int, device: str, chunk: int = 256):
    """Sparse (CSR, float32) RNA and Hi-C counts of ``n`` cells, Poisson as :class:`Cells`
    draws them (per-gene log-normal rates, ``1/(k+1)`` stratum shares, a log-normal
    depth per cell), drawn densely on ``device`` ``chunk`` cells at a time and kept sparse
    on the host."""
    import scipy.sparse as sp

    g = torch.Generator().manual_seed(seed)
    rate = torch.exp(torch.randn(shape.n_genes, generator=g) * 1.5)
    gene_share = (rate / rate.sum()).to(device)
    decay = 1.0 / (shape.feature_stratum.double() + 1.0)
    feature_share = (decay / decay.sum()).float().to(device)
    dg = torch.Generator(device).manual_seed(seed + 1)
    parts: dict[str, list] = {"rna": [], "hic": []}
    for start in range(0, n, chunk):
        b = min(chunk, n - start)
        depth = torch.exp(torch.randn(b, 1, generator=dg, device=device) * 0.4)
        for key, share, total in (("rna", gene_share, umis), ("hic", feature_share, contacts)):
            dense = torch.poisson(depth * total * share, generator=dg)
            rows, cols = dense.nonzero(as_tuple=True)
            vals = dense[rows, cols]
            parts[key].append(sp.csr_matrix((vals.cpu().numpy(), (rows.cpu().numpy(), cols.cpu().numpy())), shape=dense.shape, dtype=np.float32))
            del dense
    return sp.vstack(parts["rna"], format="csr"), sp.vstack(parts["hic"], format="csr")


def hires_data(shape: Shape, n: int, umis: float, contacts: float, seed: int, device: str):
    """A :class:`~ampflow.train.data.PairedData` of ``n`` synthetic cells at ``shape``,
    with no ``split`` column (every cell trains) and no batches."""
    import pandas as pd

    from ampflow.train.data import PairedData

    rna, hic = hires_counts(shape, n, umis, contacts, seed, device)
    return PairedData(
        obs=pd.DataFrame(index=pd.Index([f"cell{i}" for i in range(n)], name="cell")),
        rna=rna, hic=hic, feature_anchor=shape.feature_anchor, feature_stratum=shape.feature_stratum,
        n_strata=shape.n_strata, graph=shape.graph, meta={"hic": {"resolution": shape.resolution}},
        genes=[f"gene{i}" for i in range(shape.n_genes)], features=[f"f{i}" for i in range(hic.shape[1])],
    )  # fmt: skip


def template_train_config(path: Path = TEMPLATE_CONFIG) -> TrainConfig:
    """The template's ``train`` section (``config/config.yaml``), as the workflow reads it."""
    import yaml

    section = (yaml.safe_load(path.read_text()) or {}).get("train")
    if not isinstance(section, dict):
        raise SystemExit(f"{path}: no train section")
    return TrainConfig.from_dict(section)


def is_host_sync(func, args, kwargs, cuda: bool) -> bool:
    """Whether an aten call makes the host wait for the device: a scalar read
    (``_local_scalar_dense``: ``.item()``, ``bool(t)``) of a CUDA tensor, a copy from a
    CUDA tensor to the CPU, or a CUDA op whose output size depends on values. In a CPU
    run (``cuda`` false) every scalar read counts: the reads a GPU run would wait for."""
    aten = torch.ops.aten
    if func is aten._local_scalar_dense.default:
        return args[0].is_cuda or not cuda
    if func is aten._to_copy.default:
        src, dev = args[0], kwargs.get("device")
        return src.is_cuda and dev is not None and torch.device(dev).type == "cpu"
    if func in (aten.copy_.default,):
        return (not args[0].is_cuda) and args[1].is_cuda
    if func in (aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_consecutive.default):
        return args[0].is_cuda
    return False


class SyncCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts aten ops dispatched, and host syncs (:func:`is_host_sync`) outside and
    inside ``optimizer.step`` (its hooks set :attr:`in_optimizer`)."""

    def __init__(self, cuda: bool = False):
        super().__init__()
        self.cuda = cuda
        self.ops = self.syncs = self.optimizer_syncs = 0
        self.in_optimizer = False
        self.names: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if is_host_sync(func, args, kwargs, self.cuda):
            if self.in_optimizer:
                self.optimizer_syncs += 1
            else:
                self.syncs += 1
                self.names[str(func)] = self.names.get(str(func), 0) + 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting_syncs(optimizer, counter: SyncCounter):
    """``counter`` active, with ``optimizer.step`` marked; on CUDA also CUDA's own
    sync debug mode, whose warnings (one per synchronising call, compiled code and
    graph replays included) are collected in ``counter.cuda_syncs``."""
    import warnings

    pre = optimizer.register_step_pre_hook(lambda *a: setattr(counter, "in_optimizer", True))
    post = optimizer.register_step_post_hook(lambda *a: setattr(counter, "in_optimizer", False))
    cuda = torch.cuda.is_available() and next(iter(optimizer.param_groups[0]["params"])).is_cuda
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                with counter:
                    yield counter
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        counter.cuda_syncs = sum(1 for w in caught if "synchroniz" in str(w.message).lower()) if cuda else None
    finally:
        pre.remove()
        post.remove()


def profile_counts(prof, steps: int) -> dict[str, float]:
    """Per step from a CUDA profile: host launch calls (kernel launches, async copies and
    memsets, graph launches), graph launches, and the GPU's kernel and memory events
    (what ran, a graph's kernels included where the profiler traces into graphs)."""
    launch_names = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaMemcpyAsync",
                    "cudaMemsetAsync", "cudaGraphLaunch", "cuGraphLaunch")  # fmt: skip
    launches = graphs = gpu = 0
    for e in prof.events():
        name = e.name
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            gpu += 1
        elif name.startswith(launch_names):
            launches += 1
            graphs += name.startswith(("cudaGraphLaunch", "cuGraphLaunch"))
    return {"launches": launches / steps, "graph_launches": graphs / steps, "gpu_events": gpu / steps}


def time_by_kernel(prof, steps: int, device: str, top: int = 6) -> tuple[float, list[tuple[str, float]]]:
    """Where a profiled step's time goes: the summed time per step (ms) of the GPU's
    kernel and copy events (``cuda``; a graph's kernels included where the profiler
    traces into graphs) or of the aten ops' own CPU time (``cpu``), and the ``top``
    names by their share of it, as ``(name, share)``. Beside the step's wall time the
    sum says whether the GPU is busy or waits between kernels."""
    totals: dict[str, float] = {}
    for e in prof.events():
        if device == "cuda":
            if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            us = e.time_range.elapsed_us()
        else:
            if not e.name.startswith("aten::"):
                continue
            us = e.self_cpu_time_total
        totals[e.name] = totals.get(e.name, 0.0) + us
    whole = sum(totals.values())
    ranked = sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    return whole / steps / 1e3, [(name, us / whole if whole else 0.0) for name, us in ranked]


def cpu_op_counts(prof, steps: int) -> float:
    """aten ops per step that nothing but Python, autograd or compiled code called (no
    aten op above them in the profile): on a CPU, what the step launches. The profiler,
    unlike a dispatch mode, lets a compiled step run compiled (its fused kernels are no
    aten ops, its matrix products are)."""
    n = 0
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        n += parent is None
    return n / steps


@dataclass
class StepPlan:
    """The steps of one timed run: ``warmup`` (compile, capture, the trainer's measured
    first steps), ``timed`` (steps/s), ``counted`` (host syncs and aten ops), ``profiled``
    (kernel launches; CUDA only), in that order, all in one epoch of full batches."""

    warmup: int
    timed: int
    counted: int
    profiled: int

    @property
    def total(self) -> int:
        return self.warmup + self.timed + self.counted + self.profiled


def bench_trainer_class():
    """:class:`~ampflow.train.trainer.Trainer` with the benchmark's probes: an epoch cut
    to ``limit`` full batches (None: the trainer's batches), a clock, sync counting and a
    profile around the planned steps, a deadline, and no output files (the workflow's
    embeddings and model.pt are not what is timed)."""
    from ampflow.train.trainer import Trainer

    class BenchTrainer(Trainer):
        def setup(self, plan: StepPlan | None, limit: int | None, deadline: float | None):
            self.bench_plan, self.bench_limit, self.deadline = plan, limit, deadline
            self.capture_seconds = 0.0
            self.first_step_seconds = None
            self.timed_seconds = None
            self.counter = None
            self.profile = None
            self.epochs_seen: dict[str, set] = {}
            if self.static is not None and self.static.mode.graphs:
                capture = self.static._capture

                def timed_capture(*a, **k):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    capture(*a, **k)
                    self.capture_seconds += time.perf_counter() - t0

                self.static._capture = timed_capture

        def sync(self):
            if self.device.type == "cuda":
                torch.cuda.synchronize()

        def batches(self, stage, epoch):
            out = super().batches(stage, epoch)
            if self.bench_limit is None:
                return out
            return [b for b in out if len(b) == self.cfg.batch_size][: self.bench_limit]

        def _train_step(self, idx, stage_name, stage_cfg, epoch):
            if self.deadline is not None and time.perf_counter() > self.deadline:
                raise TimeLimit
            self.epochs_seen.setdefault(stage_name, set()).add(epoch)
            p, i = self.bench_plan, self.step
            if p is None:
                return super()._train_step(idx, stage_name, stage_cfg, epoch)
            if i == 0:
                t0 = time.perf_counter()
                row = super()._train_step(idx, stage_name, stage_cfg, epoch)
                self.sync()
                self.first_step_seconds = time.perf_counter() - t0
                return row
            if i == p.warmup:
                self.sync()
                self._t0 = time.perf_counter()
            if i == p.warmup + p.timed:
                self.sync()
                self.timed_seconds = time.perf_counter() - self._t0
            if p.warmup + p.timed <= i < p.warmup + p.timed + p.counted:
                self.counter = self.counter or SyncCounter(cuda=self.device.type == "cuda")
                with counting_syncs(self.optimizer, self.counter) as c:
                    row = super()._train_step(idx, stage_name, stage_cfg, epoch)
                self.cuda_syncs = getattr(self, "cuda_syncs", 0) + (c.cuda_syncs or 0)
                return row
            first_profiled = p.warmup + p.timed + p.counted
            # a profiler that fails costs the launch counts only, not the mode's figures
            if p.profiled and i == first_profiled:
                self.sync()
                try:
                    activities = [torch.profiler.ProfilerActivity.CPU]
                    if self.device.type == "cuda":
                        activities.append(torch.profiler.ProfilerActivity.CUDA)
                    prof = torch.profiler.profile(activities=activities)
                    prof.__enter__()
                    self.profile = prof
                except Exception as e:  # noqa: BLE001
                    self.profile = f"{type(e).__name__}: {str(e)[:200]}"
            row = super()._train_step(idx, stage_name, stage_cfg, epoch)
            if p.profiled and i == first_profiled + p.profiled - 1 and not isinstance(self.profile, str):
                self.sync()
                try:
                    self.profile.__exit__(None, None, None)
                except Exception as e:  # noqa: BLE001
                    self.profile = f"{type(e).__name__}: {str(e)[:200]}"
            return row

        def _write_outputs(self, metrics_path, model_state):
            pass

    return BenchTrainer


@dataclass
class ModeResult:
    steps_per_s: float
    first_step_s: float
    compile_s: float
    capture_s: float
    syncs: float  # per step, outside optimizer.step (the dispatch mode's count)
    optimizer_syncs: float  # per step, inside optimizer.step
    cuda_syncs: float | None  # per step, CUDA's sync debug mode (None on CPU)
    sync_names: dict
    ops: float  # aten ops dispatched per step
    launches: dict | float | str | None  # profile_counts (CUDA), cpu_op_counts (CPU); a str: why the profile failed
    kernel_time: tuple | None = None  # time_by_kernel of the same profile (None: no profile)


def hires_train_config(args, mode: str, device: str, epochs: int, early: bool) -> TrainConfig:
    """The template's train section with the run's batch, device and mode; without
    ``early`` one pretraining epoch, no finetuning, no early stopping and no checkpoint
    (the timed steps are those of the template's first stage)."""
    base = template_train_config(args.template)
    compile_, graphs = HIRES_MODES[mode]
    cfg = replace(base, batch_size=args.batch, device=device, compile=compile_, cuda_graphs=graphs, seed=args.seed)
    # the other modes read the counts as they are, whatever the template thins: the
    # thinned modes' cost is measured beside them
    cfg = replace(cfg, **THINNING) if mode in THINNED_MODES else replace(cfg, hic_keep_min=1.0)
    if args.threads:  # the threads the floor's matrix-product rate was measured with
        cfg = replace(cfg, threads=args.threads)
    if early:
        return cfg
    from ampflow.contract.config import EarlyStoppingConfig, StageConfig

    return replace(
        cfg,
        checkpoint_every=10**9,
        pretrain=StageConfig(epochs, base.pretrain.lr, base.pretrain.weights),
        finetune=StageConfig(0, base.finetune.lr, base.finetune.weights),
        early_stopping=EarlyStoppingConfig(validation=base.early_stopping.validation, patience=0),
    )


def run_mode(args, data, mode: str, plan: StepPlan, device: str) -> ModeResult:
    """``plan.total`` steps of the trainer in ``mode`` on ``data``; the figures."""
    import tempfile

    from ampflow.contract.config import ModelConfig as MC

    cfg = hires_train_config(args, mode, device, 1, early=False)
    with tempfile.TemporaryDirectory(prefix="bench-hires-") as tmp:
        trainer = bench_trainer_class()(data, MC(), cfg, tmp)
        if mode in LOOP_MODES and trainer.static is not None:
            from ampflow.train.static_step import stack_strata

            stack_strata(trainer.model, False)
        trainer.setup(plan, plan.total, None)
        trainer.fit()
    if trainer.step != plan.total or trainer.timed_seconds is None:
        raise RuntimeError(f"ran {trainer.step} steps, planned {plan.total}")
    c = trainer.counter
    static = trainer.static
    launches, kernel_time = trainer.profile, None
    if launches is not None and not isinstance(launches, str):
        try:
            launches = profile_counts(trainer.profile, plan.profiled) if device == "cuda" else cpu_op_counts(trainer.profile, plan.profiled)
            kernel_time = time_by_kernel(trainer.profile, plan.profiled, device)
        except Exception as e:  # noqa: BLE001
            launches = f"{type(e).__name__}: {str(e)[:200]}"
    res = ModeResult(
        steps_per_s=plan.timed / trainer.timed_seconds,
        first_step_s=trainer.first_step_seconds,
        compile_s=static.compile_seconds if static is not None else 0.0,
        capture_s=trainer.capture_seconds,
        syncs=c.syncs / plan.counted,
        optimizer_syncs=c.optimizer_syncs / plan.counted,
        cuda_syncs=trainer.cuda_syncs / plan.counted if device == "cuda" else None,
        sync_names=dict(c.names),
        ops=c.ops / plan.counted,
        launches=launches,
        kernel_time=kernel_time,
    )
    del trainer, static
    return res


@dataclass
class Floors:
    flops: int  # per step: counted matrix products + the band's products
    bytes: int  # per step (see the module doc)
    parts: dict  # bytes by part
    gflops: float  # measured matmul rate
    gbytes: float  # measured copy bandwidth (bytes read + written per second) / 1e9

    @property
    def flop_s(self) -> float:
        return self.flops / (self.gflops * 1e9)

    @property
    def byte_s(self) -> float:
        return self.bytes / (self.gbytes * 1e9)


def copy_bandwidth(mib: int, device: str, repeats: int = 5) -> float:
    """Best bytes per second (read + written) of a ``mib`` MiB tensor copy on ``device``."""
    n = mib * 2**20 // 4
    a, b = torch.ones(n, device=device), torch.empty(n, device=device)
    sync = synchronizer(device)
    b.copy_(a)
    best = math.inf
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        b.copy_(a)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best


def hires_floors(args, shape: Shape, data, device: str) -> Floors:
    """The step's FLOP floor and bytes floor, from one counted step of a fresh model on a
    batch of ``data`` (see the module doc), and the device's rates measured now."""
    cfg = ModelConfig()
    torch.manual_seed(args.seed)
    model = PairedModel(cfg, shape.n_genes, shape.feature_anchor, shape.feature_stratum, shape.n_strata, shape.graph).to(device)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=TrainConfig().pretrain.lr)
    rna, hic = data.batch(np.arange(args.batch))
    rna, hic = rna.to(device), hic.to(device)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {rna.untyped_storage().data_ptr(), hic.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip and ptr not in saved:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, both = counted_step(model, optimizer, rna, hic, TrainConfig().pretrain.weights, torch.Generator().manual_seed(args.seed))
    band = 4 * cfg.D * band_pairs(shape.n_anchors, cfg.window)
    flops = both.get("Global", 0) + 3 * band * (shape.n_strata - 1)
    n_params = sum(p.numel() for p in model.parameters())
    parts = {
        # forward reads each parameter, backward writes its gradient, Adam reads
        # parameter, gradient and both moments and writes parameter and moments
        "parameters": 9 * 4 * n_params,
        "batch": (rna.numel() + hic.numel()) * 4,
        # written by the forward, read by the backward
        "activations": 2 * sum(saved.values()),
    }
    del model, optimizer
    rate = matmul_rate(args.matmul, device=device).wall
    bw = copy_bandwidth(args.copy_mib, device) / 1e9
    return Floors(flops, sum(parts.values()), parts, rate, bw)


def shape_key(resolution: int, strata: int) -> str:
    return f"{resolution}:{strata}"


def run_hires(args, sizes) -> int:
    """The HiRES-size case: for each shape, the trainer's steps in each mode (see the
    module doc); then, with ``--hires-early-stopping``, training to early stopping."""
    from ampflow.train.early_stopping import validation_split
    from ampflow.train.trainer import epoch_batches

    device = args.device
    cuda = device == "cuda"
    template = template_train_config(args.template)
    failed = 0
    where = f"CUDA {torch.cuda.get_device_name(0)}" if cuda else f"CPU, {usable_cores()} usable cores"
    print(f"hires: {args.hires_cells} synthetic cells, batch {args.batch}, fp32, torch {torch.__version__}, {where}; "
          f"steps per mode: {args.hires_warmup} warm-up, {args.hires_steps} timed, 2 counted, {3 if cuda else 2} profiled")  # fmt: skip
    n_train = len(validation_split(np.arange(args.hires_cells), template.early_stopping, args.seed)[0])
    epoch_steps = len(epoch_batches(n_train, args.batch, args.seed, 0, 0))
    plan = StepPlan(args.hires_warmup, args.hires_steps, 2, 3 if cuda else 2)
    if args.hires_cells < plan.total * args.batch:
        raise SystemExit(f"--hires-cells {args.hires_cells} gives fewer than the {plan.total} full batches of {args.batch} a mode runs")
    for resolution, n_strata in args.shapes:
        key = shape_key(resolution, n_strata)
        t0 = time.perf_counter()
        shape = build_shape(sizes, resolution, n_strata, args.genes, args.graph_degree, args.seed)
        data = hires_data(shape, args.hires_cells, args.umis, args.contacts, args.seed, device)
        print(f"\nhires {key} ({shape.label}): {shape.n_anchors:,} anchors, {data.hic.shape[1]:,} Hi-C features, "
              f"{shape.n_genes:,} genes; {data.hic.nnz / data.n_cells:,.0f} Hi-C and {data.rna.nnz / data.n_cells:,.0f} RNA "
              f"nonzeros per cell; built in {time.perf_counter() - t0:.1f} s")  # fmt: skip
        sys.stdout.flush()
        floors = None
        try:
            floors = hires_floors(args, shape, data, device)
            p = floors.parts
            print(f"hires {key} floors: {floors.flops / 1e9:.2f} GFLOP/step at {floors.gflops:.0f} GFLOP/s = {floors.flop_s * 1e3:.3f} ms; "
                  f"{floors.bytes / 1e9:.3f} GB/step (parameters {p['parameters'] / 1e9:.3f}, batch {p['batch'] / 1e9:.3f}, "
                  f"activations {p['activations'] / 1e9:.3f}) at {floors.gbytes:.0f} GB/s = {floors.byte_s * 1e3:.3f} ms")  # fmt: skip
        except Exception as e:  # noqa: BLE001 - one line per failure, the rest still runs
            failed += 1
            log.exception("hires %s floors failed", key)
            print(f"hires {key} floors: FAILED {type(e).__name__}: {str(e)[:300]}")
        modes = [m for m in args.modes if not (HIRES_MODES[m][0] and args.compiled_shapes and (resolution, n_strata) not in args.compiled_shapes)]
        eager = None
        for mode in modes:
            if HIRES_MODES[mode][1] and not cuda:
                print(f"hires {key} {mode}: skipped (CUDA graphs need a GPU)")
                continue
            try:
                r = run_mode(args, data, mode, plan, device)
            except Exception as e:  # noqa: BLE001
                failed += 1
                log.exception("hires %s %s failed", key, mode)
                print(f"hires {key} {mode}: FAILED {type(e).__name__}: {str(e)[:300]}")
                sys.stdout.flush()
                continue
            finally:
                if cuda:
                    torch._dynamo.reset()
                    torch.cuda.empty_cache()
            if mode == "eager":
                eager = r.steps_per_s
            vs = f"eager {eager:.1f}: {r.steps_per_s / eager:.1f}x" if eager else "no eager run"
            if isinstance(r.launches, str):
                launches = f"launches/step unknown (profiler failed: {r.launches}; aten ops dispatched/step {r.ops:.0f})"
            elif isinstance(r.launches, float):
                launches = f"launches/step {r.launches:.0f} (aten ops called from outside aten; {r.ops:.0f} dispatched under a dispatch mode)"
            elif r.launches is not None:
                la = r.launches
                launches = f"launches/step {la['launches']:.0f} (graph launches {la['graph_launches']:.0f}), GPU kernels+copies/step {la['gpu_events']:.0f}"
            else:
                launches = f"launches/step {r.ops:.0f} (aten ops dispatched)"
            syncs = f"host syncs/step {r.syncs:g} (+{r.optimizer_syncs:g} in optimizer.step"
            syncs += f"; CUDA sync debug mode {r.cuda_syncs:g})" if r.cuda_syncs is not None else ", Adam's step counts)"
            ratios = (f"FLOP floor ratio {floors.flop_s * r.steps_per_s:.4f}, bytes floor ratio {floors.byte_s * r.steps_per_s:.4f}"
                      if floors else "floors failed")  # fmt: skip
            print(f"hires {key} {mode}: {r.steps_per_s:.2f} steps/s ({vs}), {launches}, {syncs}, "
                  f"compile {r.compile_s:.1f} s, capture {r.capture_s:.2f} s, first step {r.first_step_s:.2f} s, "
                  f"epoch {epoch_steps / r.steps_per_s:.2f} s ({epoch_steps} steps), {ratios}")  # fmt: skip
            if r.kernel_time is not None:
                busy, ranked = r.kernel_time
                what = "GPU kernel and copy time" if cuda else "aten ops' own CPU time"
                print(f"hires {key} {mode}: {what} {busy:.2f} ms/step against {1e3 / r.steps_per_s:.2f} ms/step of wall time; "
                      + ", ".join(f"{name[:70]} {share:.0%}" for name, share in ranked))  # fmt: skip
            if r.sync_names:
                print(f"hires {key} {mode}: host syncs by op: {r.sync_names}")
            sys.stdout.flush()
        del data
    if args.hires_early_stopping:
        failed += run_early_stopping(args, sizes, device)
    return 1 if failed else 0


class TimeBetweenSteps:
    """Seconds a training run spends outside its steps, by part: the validation loss, the
    copies of the best weights that early stopping keeps, and checkpoints. Each timed
    from a device sync before to one after (so a step still running is not counted);
    :meth:`restore` puts the trainer's own functions back."""

    def __init__(self, trainer):
        from ampflow.train import trainer as trainer_module

        self.seconds = {"validation": 0.0, "best-weight copies": 0.0, "checkpoints": 0.0}
        self._module, self._validation = trainer_module, trainer_module.validation_loss
        self._trainer = trainer
        trainer_module.validation_loss = self._timed("validation", self._validation)
        trainer.early.update = self._timed("best-weight copies", trainer.early.update)
        trainer._save_checkpoint = self._timed("checkpoints", trainer._save_checkpoint)

    def _timed(self, name: str, fn):
        def run(*args, **kwargs):
            self._trainer.sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._trainer.sync()
                self.seconds[name] += time.perf_counter() - t0

        return run

    def restore(self) -> None:
        self._module.validation_loss = self._validation
        del self._trainer.early.update, self._trainer._save_checkpoint


def run_early_stopping(args, sizes, device: str) -> int:
    """Train the HiRES-size case at the first shape to early stopping with the
    template's train section (mode ``--early-stopping-mode``), at most
    ``--early-stopping-seconds``; prints the wall time, epochs and steps/s. 1 on failure."""
    import tempfile

    from ampflow.contract.config import ModelConfig as MC

    resolution, n_strata = args.shapes[0]
    key, mode = shape_key(resolution, n_strata), args.early_stopping_mode
    limit = args.early_stopping_seconds
    try:
        shape = build_shape(sizes, resolution, n_strata, args.genes, args.graph_degree, args.seed)
        data = hires_data(shape, args.hires_cells, args.umis, args.contacts, args.seed, device)
        cfg = hires_train_config(args, mode, device, 0, early=True)
        with tempfile.TemporaryDirectory(prefix="bench-hires-") as tmp:
            trainer = bench_trainer_class()(data, MC(), cfg, tmp)
            spent = TimeBetweenSteps(trainer)
            t0 = time.perf_counter()
            trainer.setup(None, None, t0 + limit)
            try:
                trainer.fit()
                stopped = True
            except TimeLimit:
                stopped = False
            finally:
                spent.restore()
            trainer.sync()
            wall = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001
        log.exception("hires early-stopping failed")
        print(f"hires early-stopping {key} {mode}: FAILED {type(e).__name__}: {str(e)[:300]}")
        return 1
    epochs = ", ".join(f"{s} {len(e)} of {dict(cfg.stages)[s].epochs}" for s, e in trainer.epochs_seen.items())
    parts = ", ".join(f"{name} {sec:.1f} s" for name, sec in spent.seconds.items())
    rate = (f"{trainer.step / wall:.1f} steps/s (validation each epoch included); of the wall time {parts}, "
            f"the rest (steps, batches, metrics) {wall - sum(spent.seconds.values()):.1f} s")  # fmt: skip
    if stopped:
        print(f"hires early-stopping {key} {mode}: trained to early stopping in {wall:.1f} s: epochs {epochs}, {trainer.step} steps, {rate}")
    else:
        print(f"hires early-stopping {key} {mode}: did not stop within {limit:g} s: epochs {epochs} so far, {trainer.step} steps, {rate}")
    return 0


def parse_shape(text: str) -> tuple[int, int]:
    try:
        res, strata = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RESOLUTION:STRATA, got {text!r}") from None
    if res < 1 or strata < 1:
        raise argparse.ArgumentTypeError(f"resolution and strata must be >= 1, got {text!r}")
    return res, strata


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GIB


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chrom-sizes", type=Path, default=DEFAULT_SIZES, help="chrom.sizes (default: the shared mm10 one)")
    p.add_argument("--chroms", nargs="+", default=MM10_CHROMS, help="chromosomes whose bins are anchors")
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=[(1_000_000, 10), (500_000, 20), (100_000, 30)],
                   metavar="RES:STRATA", help="resolution in bp and number of strata")  # fmt: skip
    p.add_argument("--genes", type=int, default=2000)
    p.add_argument("--graph-degree", type=int, default=10, help="cis contact edges per anchor in the guidance graph")
    p.add_argument("--cells", type=int, default=256, help="cells in the pool the batches are drawn from")
    p.add_argument("--batch", type=int, default=TrainConfig.batch_size, help="cells per step")
    p.add_argument("--umis", type=float, default=5000.0, help="mean RNA counts per cell")
    p.add_argument("--contacts", type=float, default=100_000.0, help="mean Hi-C contacts per cell within the strata")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant (median reported), after 1 warm-up")
    p.add_argument("--shape-seconds", type=float, default=90.0,
                   help="fewer steps (at least 1) on a shape whose warm-up says --steps would take longer")  # fmt: skip
    p.add_argument("--old", choices=["per-offset", "chunked"], default="per-offset",
                   help="the old variant: the per-offset banded kernel under the same plan, or the chunked kernel")  # fmt: skip
    p.add_argument("--old-chunk", type=int, default=2048, help="chunk of the old plan (--old chunked)")
    p.add_argument("--max-old-gib", type=float, default=6.0,
                   help="skip the old kernel where its saved probabilities would exceed this many GiB")  # fmt: skip
    p.add_argument("--memory-gib", type=float, default=None, help="device memory the plan is made for (default: this machine's)")
    p.add_argument("--matmul", type=int, default=2048, help="size of the square product that measures the CPU's rate")
    p.add_argument("--threads", type=int, default=None, help="torch threads for the whole run (default: usable cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the steps run (default cpu)")
    h = p.add_argument_group("the HiRES-size case (--hires): the trainer's steps per mode, instead of the component table")
    h.add_argument("--hires", action="store_true", help="run the HiRES-size case")
    h.add_argument("--hires-cells", type=int, default=7469, help="synthetic cells (HiRES: 7,469)")
    h.add_argument("--hires-steps", type=int, default=20, help="timed steps per mode, after the warm-up")
    h.add_argument("--hires-warmup", type=int, default=5, help="steps before the clock starts (compile, capture, measured steps)")
    h.add_argument("--modes", nargs="*", choices=list(HIRES_MODES), default=["eager", "compiled", "graphed"],
                   help="step modes: eager (today's step), compiled (torch.compile), graphed (CUDA graph; strata stacked), "
                        "graphed-loop (the same, strata one at a time), compiled+graphed")  # fmt: skip
    h.add_argument("--compiled-shapes", type=parse_shape, nargs="*", default=None, metavar="RES:STRATA",
                   help="run the compiled modes at these shapes only (default: every shape)")  # fmt: skip
    h.add_argument("--hires-early-stopping", action="store_true", help="then train the first shape to early stopping")
    h.add_argument("--early-stopping-mode", choices=list(HIRES_MODES), default=None, help="its mode (default: graphed on CUDA, eager on CPU)")
    h.add_argument("--early-stopping-seconds", type=float, default=600.0, help="stop it after this many seconds")
    h.add_argument("--template", type=Path, default=TEMPLATE_CONFIG, help="the config whose train section the trainer runs")
    h.add_argument("--copy-mib", type=int, default=None, help="size of the copy that measures bandwidth (default 1024 on CUDA, 256 on CPU)")
    args = p.parse_args(argv)
    if args.early_stopping_mode is None:
        args.early_stopping_mode = "graphed" if args.device == "cuda" else "eager"
    if args.copy_mib is None:
        args.copy_mib = 1024 if args.device == "cuda" else 256
    if args.hires and (min(args.hires_cells, args.hires_steps, args.copy_mib, args.hires_warmup) < 1):
        p.error("--hires-cells, --hires-steps, --hires-warmup and --copy-mib must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible to torch")
    if min(args.genes, args.cells, args.steps, args.matmul) < 1 or args.batch < 2 or args.old_chunk < 0:
        p.error("genes, cells, steps and matmul must be >= 1, batch >= 2 and old-chunk >= 0")
    if args.cells < args.batch:
        p.error("--cells must be at least --batch")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads or usable_cores())
    cuda = args.device == "cuda"
    if args.hires:
        return run_hires(args, read_chromsizes(args.chrom_sizes, args.chroms))
    if args.memory_gib:
        memory = int(args.memory_gib * GIB)
    else:
        memory = torch.cuda.get_device_properties(0).total_memory if cuda else physical_memory()
    where = f"CUDA {torch.cuda.get_device_name(0)}" if cuda else "CPU"
    sizes = read_chromsizes(args.chrom_sizes, args.chroms)
    genome = args.chrom_sizes.name.split(".")[0]
    cfg = ModelConfig()
    print(
        f"paired-model training step by component; torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"fp32, {where}; model defaults (latent {cfg.latent_dim}, D {cfg.D}, {cfg.heads} heads, window {cfg.window}, "
        f"hidden {cfg.hidden_dim}); batch {args.batch} of {args.cells} cells; {args.genes} genes"
    )
    if hasattr(os, "getloadavg"):
        print(f"load average (1 min) before the run: {os.getloadavg()[0]:.2f} on {usable_cores()} usable cores")
    summary = []
    for resolution, n_strata in args.shapes:
        t0 = time.perf_counter()
        shape = build_shape(sizes, resolution, n_strata, args.genes, args.graph_degree, args.seed)
        cells = Cells(shape, args.cells, args.batch, args.umis, args.contacts, args.seed)
        plan = diagnose(shape_profile(shape, args.batch), 1, memory)
        old_plan = replace(plan, chunk_size=args.old_chunk or None) if args.old == "chunked" else plan
        n, w, h = shape.n_anchors, cfg.window, cfg.heads
        log.info("%s: shape built in %.1f s", shape.label, time.perf_counter() - t0)
        print(
            f"\n{genome} {shape.label}: {n:,} anchors, {sum(shape.features_per_stratum):,} Hi-C features, "
            f"{args.genes:,} genes, graph {shape.graph.n_nodes:,} nodes / {shape.graph.src.numel():,} edges"
        )
        print(f"  new: banded kernel, {plan.summary()}")
        variants = [Variant("new", shape, plan, decoders.local_attention, args.seed, args.device)]
        old_chunk = old_plan.chunk
        pairs = chunked_pairs(n, w, old_chunk) if old_chunk else n * n
        old_bytes = h * pairs * 4 * (n_strata - 1)
        if args.old == "per-offset":
            print(f"  old: per-offset banded kernel, {old_plan.summary()}")
            variants.insert(0, Variant("old", shape, old_plan, local_attention_per_offset, args.seed, args.device))
        elif old_bytes > args.max_old_gib * GIB:
            print(
                f"  old: skipped: the {'chunked' if old_chunk else 'full'} kernel (chunk {old_chunk or '-'}) would save "
                f"{old_bytes / GIB:.1f} GiB of probabilities ({h} heads x {pairs:,} scores x 4 B x {n_strata - 1} strata) "
                f"> --max-old-gib {args.max_old_gib:g}"
            )
        else:
            print(f"  old: chunked kernel, {old_plan.summary()}")
            variants.insert(0, Variant("old", shape, old_plan, old_local_attention, args.seed, args.device))
        rates = matmul_rate(args.matmul, device=args.device)
        res, rounds = measure(shape.label, variants, cells, args.steps, args.shape_seconds)
        print(
            f"  matrix-product rate {rates.wall:.1f} GFLOP/s wall, {rates.cpu:.1f} GFLOP per CPU s "
            f"({args.matmul}^2 fp32 @ on {args.device}, best of 5, before the steps)"
        )
        print(f"  medians of {rounds} step(s) per variant after 1 warm-up")
        del variants
        if cuda:
            torch.cuda.empty_cache()
        floor = floor_flops(res["new"], n, w, cfg.D)
        for line in shape_report(shape, res, floor, rates):
            print(line)
        sys.stdout.flush()
        summary.append((shape.label, res, sum(floor.values()), rates))
    print("\nsummary: plain steps, median seconds (fastest); CPU seconds count all threads")
    print(
        f"  {'shape':<10} {'new s/step':>16} {'old s/step':>16} {'speed-up':>8} {'new CPU s':>9} {'old CPU s':>9} "
        f"{'speed-up':>8} {'floor s':>8} {'floor ratio':>11} {'by CPU s':>8}"
    )
    for label, res, flops, rates in summary:
        new, old = res["new"], res.get("old")
        floor_s, floor_cpu = flops / (rates.wall * 1e9), flops / (rates.cpu * 1e9)
        line = f"  {label:<10} {f'{new.step:.3f} ({new.step_min:.3f})':>16}"
        if old is None:
            line += f" {'skipped':>16} {'-':>8} {new.cpu_s:>9.3f} {'-':>9} {'-':>8}"
        else:
            line += (
                f" {f'{old.step:.3f} ({old.step_min:.3f})':>16} {f'{old.step / new.step:.1f}x':>8}"
                f" {new.cpu_s:>9.3f} {old.cpu_s:>9.3f} {f'{old.cpu_s / new.cpu_s:.1f}x':>8}"
            )
        print(f"{line} {floor_s:>8.4f} {floor_s / new.step:>11.3f} {floor_cpu / new.cpu_s:>8.3f}")
    if hasattr(os, "getloadavg"):
        print(f"load average (1 min) after the run: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
