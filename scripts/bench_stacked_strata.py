#!/usr/bin/env python
"""The training step with the Hi-C decoder's strata stacked against the loop over strata.

At mm10's real shapes (chr1-19 and X, every cis pair, 2,000 genes, batch 32, the default
model) the one-process training step (:class:`~ampflow.train.static_step.StaticStep`,
eager, Adam with foreach kernels as on CUDA) runs with the strata one at a time and then
stacked (:func:`~ampflow.model.decoders.stacked_keys`). Printed per shape: the operations
dispatched per step and those that compute (every aten call but views and scalar reads,
counted with a dispatch mode: what a GPU turns into kernels), steps/s on this device
(median of ``--reps``, the two variants taking turns), and the ratios stacked / loop.
The loop is the baseline measured in the same run.

Usage::

    python scripts/bench_stacked_strata.py                       # CPU, the three shapes
    python scripts/bench_stacked_strata.py --device cuda         # on a GPU (eager, no graph)
    python scripts/bench_stacked_strata.py --shapes 1000000:10 --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ampflow.contract.config import LossWeights
from ampflow.train.static_step import StaticStep, StepMode, stack_strata

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_memory_model as bmm  # noqa: E402

#: aten calls that only make views or read a scalar: no kernel on a GPU
NO_KERNEL = {
    "view", "t", "expand", "as_strided", "_unsafe_view", "slice", "transpose", "detach", "select", "unsqueeze",
    "squeeze", "permute", "alias", "split", "split_with_sizes", "unbind", "chunk", "narrow", "_reshape_alias",
    "view_as", "diagonal", "unfold", "lift_fresh", "_local_scalar_dense",
}  # fmt: skip


class OpCount(TorchDispatchMode):
    """Every aten call, and those that compute."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.computing = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        self.computing += func.overloadpacket.__name__ not in NO_KERNEL
        return func(*args, **(kwargs or {}))


def _step_runner(shape: bmm.Config, sizes: Path, device: str, stacked: bool):
    """A model of ``shape`` on ``device`` and a function running one training step."""
    model, rna, hic, _, _ = bmm.build(shape, torch.float32, sizes)
    model = model.to(device).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    step = StaticStep(model, optimizer, StepMode(reason="benchmark"), torch.Generator(device).manual_seed(1), stack=stacked)
    assert step.stacked == stacked and stack_strata(model, stacked) == stacked
    bufs = step.buffers(rna.shape[0], rna.shape[1], hic.shape[1], 0)
    bufs.rna.copy_(rna.to(device))
    bufs.hic.copy_(hic.to(device))
    weights = LossWeights(cross=0.0)

    def run():
        out = step.step(bufs, weights, rna.shape[0])
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shapes", nargs="*", default=["1000000:10", "500000:20", "100000:30"], metavar="RES:STRATA")
    ap.add_argument("--reps", type=int, default=3, help="timed steps per variant (medians)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default torch's)")
    ap.add_argument("--data-dir", type=Path, default=None, help="shared data folder with annotation/ (default: /work/shared/data or ../shared/data)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dirs = [args.data_dir] if args.data_dir else [Path("/work/shared/data"), bmm.REPO.parent / "shared" / "data"]
    sizes = next((d / bmm.MM10_SIZES for d in dirs if (d / bmm.MM10_SIZES).is_file()), None)
    if sizes is None:
        print(f"bench_stacked_strata: {bmm.MM10_SIZES} not found in {', '.join(map(str, dirs))}; nothing measured")
        return 0
    print(f"stacked strata vs the loop: {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, batch 32, fp32")
    for text in args.shapes:
        res, strata = (int(x) for x in text.split(":"))
        shape = bmm.Config(f"mm10 {res}:{strata}", n_strata=strata, resolution=res, n_genes=2000)
        runners = {v: _step_runner(shape, sizes, args.device, v) for v in (False, True)}
        counts, seconds = {}, {False: [], True: []}
        for v, run in runners.items():
            run()  # warm-up (Adam's state)
            with OpCount() as c:
                run()
            counts[v] = c
        for _ in range(args.reps):
            for v, run in runners.items():  # taking turns: a load that comes and goes hits both
                t0 = time.perf_counter()
                run()
                seconds[v].append(time.perf_counter() - t0)
        rate = {v: 1.0 / statistics.median(s) for v, s in seconds.items()}
        lo, st = counts[False], counts[True]
        print(
            f"{res}:{strata}: computing ops/step {lo.computing} -> {st.computing} ({st.computing / lo.computing:.2f}x), "
            f"all ops {lo.calls} -> {st.calls}; steps/s {rate[False]:.2f} -> {rate[True]:.2f} ({rate[True] / rate[False]:.2f}x)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
