"""Check the analytic memory model (ampflow.amp.memory.predict) against the allocator's peak.

For each shape a :class:`~ampflow.model.paired.PairedModel` is built on synthetic
features (no count data): either random (Hi-C features in stratum-major order, anchors
``0..n-1`` at stratum 0 and a random subset of the valid pairs ``(a, a + k)`` for
``k >= 1``) or those of a real genome (every cis bin pair ``(i, i + k)`` of mm10,
chr1-19 and X, at a resolution, from ``annotation/mm10.chrom.sizes``), with a random
guidance graph (gene-anchor and anchor-anchor edges, both directions, self-loops).

Two training steps then run on CPU as the trainer runs them
(:func:`ampflow.train.measured_memory.measured_step`: ``zero_grad(set_to_none=True)``, forward,
backward, Adam's step, :func:`ampflow.train.trainer.make_optimizer`'s). The second is the steady state: Adam's moments
exist and the first step's gradients are freed before its forward pass. Its memory is
measured by the allocator (the profiler's allocation and free events summed in time
order, transients included, from the bytes held when the step began:
:class:`ampflow.train.measured_memory.AllocatorTrace`) and compared with
:func:`~ampflow.amp.memory.predict.predict` from shapes alone (Adam's fused kernel, as
the trainer runs it on CPU). Every shape runs in float32 and float64.

On CUDA (``--device cuda``) the steps run on the GPU, Adam with its foreach kernels
(the spec's ``optimizer_foreach``), and the caching allocator is the referee:
``max_memory_allocated`` (what the trainer logs as ``peak_bytes``), net of the bytes
allocated before the step that are no tensor of it (the persistent cuBLAS/cuBLASLt
workspaces and the rounding of the held tensors:
:attr:`ampflow.train.measured_memory.StepMemory.persistent`), is compared with the prediction;
the requested peak (``memory_stats()["requested_bytes.all.peak"]``: no 512 B rounding,
net of the same base) and the reserved peak (segments held, fragmentation included)
are printed beside it. The CUDA shapes (:func:`cuda_configurations`) are the
demo-sized one, mm10 at 1 Mb with 10 strata at batch 32 and 64, and the four shapes of
the issue; dtypes ``fp32,bf16`` (bf16 where the GPU supports it).

``--step static`` runs both steps through the training step of one process
(:class:`~ampflow.train.static_step.StaticStep`, draws made on the device, every
stratum in one pass where nothing is chunked: the prediction then counts the strata
stacked), ``--step compiled`` the same through ``torch.compile``, and
``--step graphed`` (CUDA) captures the whole step in a CUDA graph: the first step is the
warm-up and capture, and the figure compared is the capture's allocator peak (a replay
allocates nothing: the graph's private pool holds what the capture allocated), net of the
same persistent bytes.

Printed per shape and dtype: the predicted peak, the allocator's peak, their ratio
(allocator / predicted), the phase holding each peak, the first step's allocator peak
(no Adam state yet) and the seconds of the measured step; then the worst ratio, a
least-squares fit of ``M(L)`` over a sweep of the number of strata, and the predicted
components of the largest shape.

Usage::

    python scripts/bench_memory_model.py --check          # every shape, about 15 min on 2 cores
    python scripts/bench_memory_model.py --quick --check  # small shapes, a minute
    python scripts/bench_memory_model.py --only mm10      # shapes whose name contains mm10
    python scripts/bench_memory_model.py --device cuda --check   # the CUDA shapes on the GPU

``--check``: exit status 1 if any ratio is outside ``1 +- --tolerance`` (default 10 %).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ampflow.amp.memory.predict import Estimate, ShapeSpec, fit_linear, predict
from ampflow.contract.config import LossWeights, ModelConfig
from ampflow.model.paired import PairedModel
from ampflow.train.measured_memory import StepMemory, measure_step, measured_step
from ampflow.train.static_step import StaticStep, StepMode
from ampflow.train.trainer import make_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_shapes import synthetic_features, synthetic_graph  # noqa: E402

MIB = 2**20
REPO = Path(__file__).resolve().parent.parent
MM10_SIZES = "annotation/mm10.chrom.sizes"
MM10_CHROMS = [f"chr{i}" for i in range(1, 20)] + ["chrX"]
DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Config:
    """One benchmark shape."""

    name: str
    n_anchors: int = 0  # random features: anchors; 0 with ``resolution``
    n_strata: int = 2
    batch: int = 32
    chunk: int = 0
    key_first: bool = False
    decoder_dim: int | None = None
    attention: bool = True
    n_genes: int = 1000
    keep: float = 0.5  # share of the valid pairs kept in each stratum k >= 1
    stratum_size: int = 0  # > 0: exactly this |F_k| for every k >= 1 (M(L) is then a line)
    cross: bool = False  # train the cross-reconstruction term (a second pass through both decoders)
    resolution: int = 0  # > 0: the features of mm10 at this bin size (every cis pair)
    seed: int = 0


def genome_features(sizes: Path, resolution: int, n_strata: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(feature_anchor, feature_stratum)`` of every cis bin pair ``(i, i + k)``,
    ``k < n_strata``, of mm10 chr1-19 and X at ``resolution`` (what the prepare stage
    builds before it drops pairs no cell has)."""
    from ampflow.io.genome import make_bins, read_chromsizes
    from ampflow.prepare.strata import candidate_index

    bins = make_bins(read_chromsizes(sizes, MM10_CHROMS), resolution)
    _, var = candidate_index(bins, MM10_CHROMS, n_strata)
    return torch.as_tensor(var["anchor"].to_numpy()), torch.as_tensor(var["stratum"].to_numpy())


def build(cfg: Config, dtype: torch.dtype, sizes: Path | None = None):
    """Model, batch and the :class:`ShapeSpec` of one shape."""
    g = torch.Generator().manual_seed(cfg.seed)
    if cfg.resolution:
        anchor, stratum = genome_features(sizes, cfg.resolution, cfg.n_strata)
    else:
        anchor, stratum = synthetic_features(cfg.n_anchors, cfg.n_strata, cfg.keep, cfg.stratum_size, g)
    n_anchors = int(anchor[stratum == 0].numel())
    graph = synthetic_graph(cfg.n_genes, n_anchors, g)
    mcfg = ModelConfig(decoder_dim=cfg.decoder_dim, chunk=cfg.chunk, key_first=cfg.key_first, attention=cfg.attention)
    torch.manual_seed(cfg.seed)
    model = PairedModel(mcfg, cfg.n_genes, anchor, stratum, cfg.n_strata, graph).to(dtype)
    rna = torch.poisson(torch.full((cfg.batch, cfg.n_genes), 2.0), generator=g).to(dtype)
    hic = torch.poisson(torch.full((cfg.batch, anchor.numel()), 0.3), generator=g).to(dtype)
    fps = torch.bincount(stratum, minlength=cfg.n_strata).tolist()
    spec = ShapeSpec.from_model(
        mcfg, cfg.batch, cfg.n_genes, fps, n_anchors, graph.n_nodes, graph.src.numel(),
        dtype_bytes=torch.finfo(dtype).bits // 8, cross=cfg.cross,
    )  # fmt: skip
    # the trainer's Adam on CPU: the fused kernel, no temporaries
    return model, rna, hic, replace(spec, optimizer_foreach=False), mcfg


@dataclass
class Result:
    cfg: Config
    dtype: str
    spec: ShapeSpec
    est: Estimate
    first: StepMemory
    steady: StepMemory
    seconds: float

    @property
    def net(self) -> int:
        """The steady step's allocator peak net of the persistent bytes (0 on CPU)."""
        return self.steady.peak - self.steady.persistent

    @property
    def ratio(self) -> float:
        return self.net / self.est.total

    @property
    def requested_ratio(self) -> float | None:
        """CUDA: the requested peak over the prediction, net of what was requested
        before the step and is no tensor of it."""
        s = self.steady
        if s.requested is None or s.base_requested is None or s.held is None:
            return None
        return (s.requested - max(s.base_requested - s.held, 0)) / self.est.total


def static_steps(model, optimizer, rna, hic, weights, mode: StepMode) -> tuple[StepMemory, StepMemory]:
    """Two steps through :class:`StaticStep` in ``mode``, strata stacked (where not
    chunked, on any device), each measured as the trainer measures it; with CUDA graphs
    the second step's peak is the capture's."""
    step = StaticStep(model.train(), optimizer, mode, torch.Generator(rna.device).manual_seed(1), stack=True)
    bufs = step.buffers(rna.shape[0], rna.shape[1], hic.shape[1], 0)
    bufs.rna.copy_(rna)
    bufs.hic.copy_(hic)
    memories = []
    for _ in range(2):
        _, memory = measure_step(lambda on_stratum=None, on_phase=None: step.step(bufs, weights, rna.shape[0]), model, optimizer, bufs.rna, bufs.hic)
        memories.append(step.step_memory(memory))
    return memories[0], memories[1]


def run(cfg: Config, dtype: str, sizes: Path | None = None, device: str = "cpu", step: str = "eager") -> Result:
    """Two training steps on ``device``; the second (steady state) is the one compared."""
    model, rna, hic, spec, mcfg = build(cfg, DTYPES[dtype], sizes)
    if device != "cpu":
        model, rna, hic = model.to(device), rna.to(device), hic.to(device)
        # torch.optim.Adam's default on CUDA: foreach kernels over all parameters
        spec = replace(spec, optimizer_foreach=True)
    optimizer = make_optimizer(model.parameters(), 1e-3, 0.0, capturable=step == "graphed")
    weights = LossWeights(cross=1.0 if cfg.cross else 0.0)
    t0 = time.perf_counter()
    if step == "eager":
        _, first = measured_step(model, optimizer, rna, hic, weights, torch.Generator().manual_seed(1))
        t0 = time.perf_counter()
        _, steady = measured_step(model, optimizer, rna, hic, weights, torch.Generator().manual_seed(2))
    else:
        first, steady = static_steps(model, optimizer, rna, hic, weights, StepMode(compile=step == "compiled", graphs=step == "graphed"))
    seconds = time.perf_counter() - t0
    del model, optimizer, rna, hic
    if device != "cpu":
        torch.cuda.empty_cache()  # the next shape starts from the workspaces alone
    # the static step (every mode but eager) stacks the strata where it does not chunk
    est = predict(spec, chunk=mcfg.chunk, key_first=mcfg.key_first, stacked=step != "eager")
    return Result(cfg, dtype, spec, est, first, steady, seconds)


def configurations(quick: bool) -> list[Config]:
    if quick:
        return [
            Config("n200 L2 full", 200, 2, 16),
            Config("n200 L8 chunk kf", 200, 8, 8, chunk=32, key_first=True),
            Config("n300 L5 full kf D64", 300, 5, 16, key_first=True, decoder_dim=64),
            Config("n400 L4 chunk", 400, 4, 32, chunk=64),
            Config("n500 L3 chunk kf", 500, 3, 16, chunk=64, key_first=True),
            Config("n300 L4 no-attention", 300, 4, 16, attention=False),
            Config("n300 L4 chunk kf cross", 300, 4, 16, chunk=64, key_first=True, cross=True),
            Config("n600 L6 full G3000", 600, 6, 64, n_genes=3000, keep=1.0),
            Config("n500 L2 B8 G20000", 500, 2, 8, n_genes=20_000),  # the optimizer step holds the peak
        ]
    return [
        # the four shapes of the issue: n 1000-4000 anchors, 8-16 strata, full and
        # chunked, key-first on and off
        Config("1k L16 full", 1000, 16, 32),
        Config("2k L8 chunk kf", 2000, 8, 32, chunk=256, key_first=True),
        Config("3k L12 chunk", 3000, 12, 32, chunk=256),
        Config("4k L8 full kf", 4000, 8, 32, key_first=True),
        Config("2k L8 full D64 cross", 2000, 8, 32, decoder_dim=64, cross=True),
        Config("3k L6 no-attention B64", 3000, 6, 64, attention=False),
        Config("5.4k L10 chunk B128", 5400, 10, 128, chunk=256),
        Config("1k L4 B8 G30000", 1000, 4, 8, n_genes=30_000, keep=1.0),  # the optimizer step holds the peak
        # mm10 chr1-19 and X, every cis pair, 2,000 genes, model defaults
        Config("mm10 1Mb L10", n_strata=10, resolution=1_000_000, n_genes=2000),
        Config("mm10 500kb L20", n_strata=20, resolution=500_000, n_genes=2000),
        Config("mm10 100kb L30", n_strata=30, resolution=100_000, n_genes=2000),
    ]


def cuda_configurations() -> list[Config]:
    """The shapes run on a GPU: the demo-sized one, mm10 1 Mb / 10 strata at batch 32
    and 64, then the issue's four."""
    quick, full = configurations(True), configurations(False)
    mm10 = next(c for c in full if c.name == "mm10 1Mb L10")
    return [
        next(c for c in quick if c.name == "n600 L6 full G3000"),
        mm10,
        replace(mm10, name="mm10 1Mb L10 B64", batch=64),
        *full[:4],
        next(c for c in full if c.name == "mm10 500kb L20"),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (a minute instead of a quarter of an hour)")
    ap.add_argument("--check", action="store_true", help="exit 1 if any ratio is outside 1 +- tolerance")
    ap.add_argument("--tolerance", type=float, default=0.10, help="largest allowed |ratio - 1| (default 0.10)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    ap.add_argument("--dtypes", default=None, help="dtypes to run (default fp32,fp64 on CPU, fp32,bf16 on CUDA)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the steps run (default cpu)")
    ap.add_argument(
        "--step",
        default="eager",
        choices=["eager", "static", "compiled", "graphed"],
        help="the step measured: eager (default), the one-process static step (strata stacked), the same torch.compile'd, or captured in a CUDA graph (CUDA)",
    )
    ap.add_argument("--only", default="", help="run only the shapes whose name contains this")
    ap.add_argument("--sweep", default="2,4,8,16", help="numbers of strata of the linearity sweep ('' skips it)")
    ap.add_argument("--data-dir", type=Path, default=None, help="shared data folder with annotation/ (default: /work/shared/data or ../shared/data)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    if args.step == "graphed" and not cuda:
        ap.error("--step graphed needs --device cuda")
    if cuda and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible to torch", file=sys.stderr)
        return 2
    default = ("fp32,bf16" if torch.cuda.is_bf16_supported() else "fp32") if cuda else "fp32,fp64"
    dtypes = [d for d in (args.dtypes or default).split(",") if d]
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown:
        ap.error(f"--dtypes: unknown {unknown}; known: {sorted(DTYPES)}")
    shapes = (cuda_configurations() if not args.quick else configurations(True)) if cuda else configurations(args.quick)
    configs = [c for c in shapes if args.only in c.name]
    sizes = None
    if any(c.resolution for c in configs):
        dirs = [args.data_dir] if args.data_dir else [Path("/work/shared/data"), REPO.parent / "shared" / "data"]
        sizes = next((d / MM10_SIZES for d in dirs if (d / MM10_SIZES).is_file()), None)
        if sizes is None:
            print(f"genome shapes skipped: no {MM10_SIZES} under {', '.join(map(str, dirs))}")
            configs = [c for c in configs if not c.resolution]

    if cuda:
        from ampflow.amp.memory.cuda import cuda_overheads

        props = torch.cuda.get_device_properties(0)
        o = cuda_overheads()
        print(f"CUDA: {props.name}, {props.total_memory / 2**30:.1f} GiB, sm{props.major}{props.minor}; torch {torch.__version__}; "
              f"expected cuBLAS(Lt) workspaces {o.workspace_bytes / MIB:.1f} MiB ({os.environ.get('CUBLAS_WORKSPACE_CONFIG', 'default')}); "
              "'allocator' below is max_memory_allocated net of the persistent bytes before the step")  # fmt: skip
    header = (
        f"{'shape':24s} {'n':>6s} {'L':>3s} {'B':>4s} {'F':>8s} {'chunk':>5s} {'kf':>3s} {'dtype':>5s} "
        f"{'predicted MiB':>13s} {'allocator MiB':>13s} {'ratio':>6s}  {'predicted phase':26s} {'measured phase':15s} "
        f"{'1st step MiB':>12s} {'s':>6s}"
    ) + (f" {'persist MiB':>11s} {'req ratio':>9s} {'reserved MiB':>12s}" if cuda else "")
    print(f"step: {args.step}")
    print(header)
    print("-" * len(header))
    results: list[Result] = []
    for cfg in configs:
        for dtype in dtypes:
            r = run(cfg, dtype, sizes, args.device, args.step)
            results.append(r)
            s = r.spec
            phase = r.est.peak_phase + (f" ({r.est.peak_part})" if r.est.peak_phase == "backward" else "")
            flag = "" if abs(r.ratio - 1) <= args.tolerance else "  OUT"
            print(
                f"{cfg.name:24s} {s.n_anchors:6d} {s.n_strata:3d} {s.n_cells_batch:4d} {s.n_features:8d} {cfg.chunk or '-':>5} "
                f"{'on' if cfg.key_first else 'off':>3s} {dtype:>5s} {r.est.total / MIB:13.1f} {r.net / MIB:13.1f} "
                f"{r.ratio:6.3f}  {phase:26s} {r.steady.peak_phase:15s} {(r.first.peak - r.first.persistent) / MIB:12.1f} {r.seconds:6.1f}"
                + (f" {r.steady.persistent / MIB:11.1f} {r.requested_ratio or float('nan'):9.3f} {(r.steady.reserved or 0) / MIB:12.1f}" if cuda else "")
                + flag,
                flush=True,
            )  # fmt: skip

    worst = max(results, key=lambda r: abs(r.ratio - 1), default=None)
    ok = worst is None or abs(worst.ratio - 1) <= args.tolerance
    if worst is not None:
        print()
        print(f"worst ratio {worst.ratio:.3f} ({worst.cfg.name}, {worst.dtype}); allocator / predicted in "
              f"[{min(r.ratio for r in results):.3f}, {max(r.ratio for r in results):.3f}] over {len(results)} runs "
              f"(tolerance 1 +- {args.tolerance:g}): {'ok' if ok else 'OUTSIDE'}")  # fmt: skip

    if args.sweep:
        # Linearity in L at one setting: equal |F_k| so that M(L) is a line
        sweep = [int(x) for x in args.sweep.split(",")]
        n_sweep = 500 if args.quick else 2000
        base_cfg = Config("sweep", n_sweep, 2, 32, chunk=64 if args.quick else 256, key_first=True, stratum_size=n_sweep // 4)
        runs = [run(replace(base_cfg, n_strata=L, name=f"sweep L{L}"), "fp32", device=args.device) for L in sweep]
        meas, pred = [r.net for r in runs], [r.est.total for r in runs]
        m_slope, m_icpt = fit_linear(sweep, meas)
        p_slope, p_icpt = fit_linear(sweep, pred)
        last = runs[-1].est
        print()
        print(f"M(L) sweep, n={base_cfg.n_anchors}, B={base_cfg.batch}, chunk={base_cfg.chunk}, key-first, fp32, L = {sweep}")
        print(f"  allocator (MiB): {', '.join(f'{m / MIB:.2f}' for m in meas)}")
        print(f"  predicted (MiB): {', '.join(f'{p / MIB:.2f}' for p in pred)}  (phases: {', '.join(r.est.peak_part for r in runs)})")
        print(
            f"  slope     fitted to allocator {m_slope / MIB:9.4f} MiB | to predicted {p_slope / MIB:9.4f} MiB"
            f" | predicted M_stratum {last.per_stratum / MIB:9.4f} MiB"
        )
        print(f"  intercept fitted to allocator {m_icpt / MIB:9.4f} MiB | to predicted {p_icpt / MIB:9.4f} MiB")

    if results:
        big = max(results, key=lambda r: r.est.total)
        print()
        print(f"predicted components of '{big.cfg.name}' ({big.dtype}) at its peak, {big.est.peak_phase} ({big.est.peak_part}), MiB:")
        for k, v in sorted(big.est.components.items(), key=lambda kv: -kv[1]):
            print(f"  {k:26s} {v / MIB:12.1f}")
        print("  phases: " + ", ".join(f"{k} {v / MIB:.1f}" for k, v in big.est.phases.items()))
        print("  measured phases: " + ", ".join(f"{k} {v / MIB:.1f}" for k, v in big.steady.phases.items()))
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
