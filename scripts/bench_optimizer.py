"""What Adam's step costs at mm10's real shapes, by implementation, against the bytes it
must move.

The model's parameters are ``bench_train.py``'s (the model's defaults at each shape:
the Hi-C encoder's first layer alone is ``F x hidden``, 200 million weights at 100 kb/30),
each given a fixed random gradient. Three implementations of the same Adam take turns
on their own copies of the parameters, under torch's deterministic switch as the trainer
runs (``train.deterministic``):

* ``loop``: ``torch.optim.Adam(foreach=False)``, a handful of elementwise kernels per
  parameter, each a pass over it (what the trainer ran on CPU before, torch's default
  there);
* ``foreach``: the same kernels over all parameters at once (torch's default on CUDA);
* ``fused``: one kernel that reads and writes each element once
  (:func:`ampflow.train.trainer.make_optimizer`'s choice outside CUDA graphs).

Per shape and implementation: the median seconds of a step over ``--steps`` turns after
one warm-up (which creates the state), its ratio to the floor, the bytes Adam must move
(each parameter, its gradient and two moments read, the parameter and moments written:
28 bytes per fp32 parameter) at this machine's copy bandwidth measured in the same run,
and the referee of the arithmetic: the largest difference of its parameters from the
loop's after the steps, relative to the largest parameter.

    python scripts/bench_optimizer.py                         # mm10 1 Mb/10, 500 kb/20, 100 kb/30
    python scripts/bench_optimizer.py --shapes 1000000:10 --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import DEFAULT_SIZES, MM10_CHROMS, build_shape, copy_bandwidth, parse_shape, usable_cores  # noqa: E402

from ampflow.contract.config import ModelConfig, TrainConfig  # noqa: E402
from ampflow.io.genome import read_chromsizes  # noqa: E402
from ampflow.model.paired import PairedModel  # noqa: E402

IMPLEMENTATIONS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
BYTES_PER_PARAMETER = 7 * 4  # fp32: parameter, gradient and two moments read; parameter and moments written


def parameters_of(shape, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The model's parameters at ``shape`` and a fixed random gradient for each."""
    torch.manual_seed(seed)
    model = PairedModel(ModelConfig(), shape.n_genes, shape.feature_anchor, shape.feature_stratum, shape.n_strata, shape.graph)
    params = [p.detach() for p in model.parameters()]
    g = torch.Generator().manual_seed(seed + 1)
    grads = [torch.randn(p.shape, generator=g) * 1e-2 for p in params]
    return params, grads


def bench_shape(shape, steps: int, bandwidth: float, seed: int) -> list[str]:
    params, grads = parameters_of(shape, seed)
    n = sum(p.numel() for p in params)
    lr = TrainConfig().pretrain.lr
    runs = {}
    for name, kw in IMPLEMENTATIONS.items():
        copies = [p.clone().requires_grad_() for p in params]
        for c, g in zip(copies, grads):
            c.grad = g  # shared: Adam reads the gradients only
        runs[name] = (copies, torch.optim.Adam(copies, lr=lr, **kw), [])
    for turn in range(steps + 1):
        for _, opt, times in runs.values():
            t0 = time.perf_counter()
            opt.step()
            if turn:  # the first creates the state
                times.append(time.perf_counter() - t0)
    floor = n * BYTES_PER_PARAMETER / bandwidth
    loop = runs["loop"][0]
    scale = max(float(p.detach().abs().max()) for p in loop)
    lines = [f"{shape.label}: {n / 1e6:,.1f} M parameters in {len(params)} tensors; floor {floor * 1e3:.1f} ms "
             f"({n * BYTES_PER_PARAMETER / 1e9:.2f} GB at {bandwidth / 1e9:.1f} GB/s copy bandwidth)"]  # fmt: skip
    base = statistics.median(runs["loop"][2])
    for name, (copies, _, times) in runs.items():
        t = statistics.median(times)
        diff = max(float((a - b).abs().max()) for a, b in zip(copies, loop)) / scale
        lines.append(f"  {name:8s} {t * 1e3:9.1f} ms/step  floor ratio {floor / t:.3f}  {base / t:.2f}x the loop  "
                     f"largest difference from the loop after {steps + 1} steps: {diff:.1e} of the largest parameter")  # fmt: skip
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chrom-sizes", type=Path, default=DEFAULT_SIZES)
    p.add_argument("--chroms", nargs="+", default=MM10_CHROMS)
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=[(1_000_000, 10), (500_000, 20), (100_000, 30)])
    p.add_argument("--genes", type=int, default=2000)
    p.add_argument("--graph-degree", type=int, default=10)
    p.add_argument("--steps", type=int, default=7, help="timed steps per implementation (median), after 1 warm-up")
    p.add_argument("--threads", type=int, default=usable_cores())
    p.add_argument("--copy-mib", type=int, default=512, help="tensor size of the copy that measures the bandwidth")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not a.chrom_sizes.exists():
        print(f"skipped: {a.chrom_sizes} not present (--chrom-sizes)")
        return 0
    torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)  # as the trainer runs
    sizes = read_chromsizes(a.chrom_sizes, a.chroms)
    bandwidth = copy_bandwidth(a.copy_mib, "cpu")
    print(f"Adam's step on CPU, torch {torch.__version__}, {a.threads} threads; copy bandwidth {bandwidth / 1e9:.1f} GB/s (best of 5, {a.copy_mib} MiB)")
    for resolution, strata in a.shapes:
        shape = build_shape(sizes, resolution, strata, a.genes, a.graph_degree, a.seed)
        print("\n".join(bench_shape(shape, a.steps, bandwidth, a.seed)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
