"""What a repeatable CPU training step costs: the model's gathers as ``index_select``
(backward adds in index order) against the indexing they replaced (backward
``index_put_(accumulate=True)``, atomic adds across threads), with torch's deterministic
switch (``train.deterministic``) on and off, at mm10's real shapes.

Shapes, counts and the step are ``bench_train.py``'s (the model's defaults, Adam,
pretraining weights). The "indexing" variant rebinds ``Tensor.index_select`` to the
equivalent indexing for the duration of its steps only, which is exactly the
formulation before the change. Per shape and variant: the median seconds of a plain step
(variants take turns, so they share whatever load the machine has), and the referee of
repeatability: the gradients of two steps from the same model, batch and seed compared
bit for bit, ``repeats`` or ``DIFFERS`` (with the largest difference).

    python scripts/bench_determinism.py                  # mm10 1 Mb/10 and 500 kb/20, 2 threads
    python scripts/bench_determinism.py --shapes 1000000:10 --threads 4 --steps 10
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import DEFAULT_SIZES, Cells, build_shape, parse_shape  # noqa: E402

from ampflow.contract.config import LossWeights, ModelConfig  # noqa: E402
from ampflow.io.genome import read_chromsizes, resolution_label  # noqa: E402
from ampflow.model.paired import PairedModel  # noqa: E402

_INDEX_SELECT = torch.Tensor.index_select


def _by_indexing(self, dim, index):
    """``index_select`` as indexing: the same values, the backward the model had before."""
    return self[(slice(None),) * dim + (index,)]


@contextlib.contextmanager
def gathers(kind: str, switch: bool):
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(switch)
    if kind == "indexing":
        torch.Tensor.index_select = _by_indexing
    try:
        yield
    finally:
        torch.Tensor.index_select = _INDEX_SELECT
        torch.use_deterministic_algorithms(was)


VARIANTS = [("index_select", False), ("index_select", True), ("indexing", False), ("indexing", True)]


def step(model, optimizer, rna, hic, seed: int) -> float:
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    terms = model(rna, hic, LossWeights(), generator=torch.Generator().manual_seed(seed))
    terms["total"].backward()
    optimizer.step()
    return time.perf_counter() - t0


def gradients(model, rna, hic) -> dict[str, torch.Tensor]:
    """One forward and backward; the global seed fixed too (dropout draws from it)."""
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    model(rna, hic, LossWeights(), generator=torch.Generator().manual_seed(0))["total"].backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def repeatability(model, rna, hic) -> str:
    a, b = gradients(model, rna, hic), gradients(model, rna, hic)
    worst = max(float((a[n] - b[n]).abs().max()) for n in a)
    differ = [n for n in a if not torch.equal(a[n], b[n])]
    return "repeats" if not differ else f"DIFFERS ({len(differ)} tensors, up to {worst:.1e})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=[(1_000_000, 10), (500_000, 20)])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant (after one warm-up)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--genes", type=int, default=2000)
    p.add_argument("--chrom-sizes", type=Path, default=DEFAULT_SIZES)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = read_chromsizes(args.chrom_sizes, [f"chr{i}" for i in range(1, 20)] + ["chrX"])
    print(f"CPU training step, repeatable gathers vs atomic ones; torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}, fp32")
    for resolution, n_strata in args.shapes:
        shape = build_shape(sizes, resolution, n_strata, args.genes, 8, 0)
        rna, hic = Cells(shape, 4 * args.batch, args.batch, 2000.0, 5000.0, 0).get(0)
        models = {}
        for v in VARIANTS:
            torch.manual_seed(0)
            model = PairedModel(ModelConfig(), shape.n_genes, shape.feature_anchor, shape.feature_stratum, shape.n_strata, shape.graph)
            models[v] = (model, torch.optim.Adam(model.parameters(), lr=1e-3))
        times: dict = {v: [] for v in VARIANTS}
        for i in range(args.steps + 1):
            for v in VARIANTS:
                with gathers(*v):
                    s = step(*models[v], rna, hic, i)
                if i:
                    times[v].append(s)
        label = f"mm10 {resolution_label(resolution)}/{n_strata}"
        print(f"\n{label}: {shape.n_anchors:,} anchors, {len(shape.feature_anchor):,} features, graph {shape.graph.src.numel():,} edges")
        base = statistics.median(times[VARIANTS[0]])
        for v in VARIANTS:
            with gathers(*v):
                rep = repeatability(models[v][0], rna, hic)
            med = statistics.median(times[v])
            print(f"  {v[0]:<13} switch {'on ' if v[1] else 'off'}  {med * 1e3:8.1f} ms/step  {med / base:5.2f}x  gradients {rep}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
