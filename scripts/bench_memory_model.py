"""Check the analytic memory model (ampflow.amp.memory_model) against real training steps.

For each configuration a :class:`~ampflow.model.paired.PairedModel` is built on random
synthetic shapes (no data files): Hi-C features in stratum-major order with anchors
``0..n-1`` at stratum 0 and a random subset of the valid pairs ``(a, a + k)`` for
``k >= 1``, and a random guidance graph (gene-anchor and anchor-anchor edges, both
directions, self-loops). One training step then runs on CPU exactly as the trainer runs
it (``ampflow.train.memory.measured_step``: ``model.train()``, Adam, ``SavedTensorBytes`` around the forward,
backward, ``optimizer.step()``, then ``state_bytes``), and the measured bytes are
compared with :func:`~ampflow.amp.memory_model.predict` from shapes alone. Some
configurations train the cross-reconstruction term (a second pass through both
decoders) or run in float64 or bfloat16.

A sweep over the number of strata at one setting fits ``M(L)`` by least squares and
compares the fitted slope and intercept with the predicted ones.

Exit status 1 if any relative error exceeds ``--tolerance`` (default 10 %).

Usage::

    python scripts/bench_memory_model.py            # full set, a few minutes on 2 cores
    python scripts/bench_memory_model.py --quick    # smaller shapes, seconds
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace

import torch

from ampflow.amp.memory_model import Estimate, ShapeSpec, fit_linear, predict
from ampflow.model.paired import PairedModel
from ampflow.model.synthetic import synthetic_features, synthetic_graph
from ampflow.spec.config import LossWeights, ModelConfig
from ampflow.train.memory import measured_step

MIB = 2**20


@dataclass(frozen=True)
class Config:
    """One benchmark configuration."""

    name: str
    n_anchors: int
    n_strata: int
    batch: int
    chunk: int = 0
    key_first: bool = False
    dtype: torch.dtype = torch.float32
    decoder_dim: int | None = None
    attention: bool = True
    n_genes: int = 1000
    keep: float = 0.5  # share of the valid pairs kept in each stratum k >= 1
    stratum_size: int = 0  # > 0: exactly this |F_k| for every k >= 1 (M(L) is then a line)
    cross: bool = False  # train the cross-reconstruction term (a second pass through both decoders)
    seed: int = 0


def build(cfg: Config):
    """Model, batch and the :class:`ShapeSpec` of one configuration."""
    g = torch.Generator().manual_seed(cfg.seed)
    anchor, stratum = synthetic_features(cfg.n_anchors, cfg.n_strata, cfg.keep, cfg.stratum_size, g)
    graph = synthetic_graph(cfg.n_genes, cfg.n_anchors, g)
    mcfg = ModelConfig(
        decoder_dim=cfg.decoder_dim, chunk=cfg.chunk, key_first=cfg.key_first, attention=cfg.attention
    )
    torch.manual_seed(cfg.seed)
    model = PairedModel(mcfg, cfg.n_genes, anchor, stratum, cfg.n_strata, graph).to(cfg.dtype)
    rna = torch.poisson(torch.full((cfg.batch, cfg.n_genes), 2.0), generator=g).to(cfg.dtype)
    hic = torch.poisson(torch.full((cfg.batch, anchor.numel()), 0.3), generator=g).to(cfg.dtype)
    fps = torch.bincount(stratum, minlength=cfg.n_strata).tolist()
    spec = ShapeSpec.from_model(
        mcfg, cfg.batch, cfg.n_genes, fps, cfg.n_anchors, graph.n_nodes, graph.src.numel(),
        dtype_bytes=torch.finfo(cfg.dtype).bits // 8, cross=cfg.cross,
    )  # fmt: skip
    return model, rna, hic, spec, mcfg


def train_step(model: PairedModel, rna: torch.Tensor, hic: torch.Tensor, cross: bool = False) -> tuple[int, list[int]]:
    """One step as :meth:`ampflow.train.trainer.Trainer._train_step` runs it on CPU.

    Returns
    -------
    peak : int
        State + saved activations (bytes).
    marks : list of int
        The same after each stratum of the Hi-C decoder.
    """
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    weights = LossWeights(cross=1.0 if cross else 0.0)
    _, peak, marks = measured_step(model, optimizer, rna, hic, weights, torch.Generator().manual_seed(1))
    return peak, marks


def run(cfg: Config) -> tuple[int, list[int], Estimate, float]:
    model, rna, hic, spec, mcfg = build(cfg)
    t0 = time.perf_counter()
    measured, marks = train_step(model, rna, hic, cfg.cross)
    seconds = time.perf_counter() - t0
    est = predict(spec, chunk=mcfg.chunk, key_first=mcfg.key_first)
    del model, rna, hic
    return measured, marks, est, seconds


def bf16_check() -> str | None:
    """None if a bf16 training step runs on this CPU, else why not."""
    try:
        run(Config("probe", 16, 3, 4, chunk=4, dtype=torch.bfloat16, n_genes=8))
    except (RuntimeError, NotImplementedError, TypeError) as e:  # an op without a bf16 CPU kernel
        return f"{type(e).__name__}: {e}"
    return None


def configurations(quick: bool) -> list[Config]:
    bf16 = torch.bfloat16
    if quick:
        return [
            Config("n200 L2 full", 200, 2, 16),
            Config("n200 L8 chunk kf", 200, 8, 8, chunk=32, key_first=True),
            Config("n300 L5 full kf D64", 300, 5, 16, key_first=True, decoder_dim=64),
            Config("n400 L4 chunk", 400, 4, 32, chunk=64),
            Config("n500 L3 chunk kf", 500, 3, 16, chunk=64, key_first=True),
            Config("n300 L4 no-attention", 300, 4, 16, attention=False),
            Config("n300 L4 chunk kf cross", 300, 4, 16, chunk=64, key_first=True, cross=True),
            Config("n200 L4 full fp64", 200, 4, 16, dtype=torch.float64),
            Config("n200 L4 full bf16", 200, 4, 16, dtype=bf16),
            Config("n400 L3 chunk kf bf16", 400, 3, 16, chunk=64, key_first=True, dtype=bf16),
        ]
    return [
        Config("1k L2 full", 1000, 2, 64),
        Config("1k L32 chunk kf", 1000, 32, 16, chunk=128, key_first=True),
        Config("2k L8 full kf D64", 2000, 8, 32, key_first=True, decoder_dim=64),
        Config("4k L4 full", 4096, 4, 32),
        Config("5.4k L10 chunk B128", 5400, 10, 128, chunk=256),
        Config("5.4k L10 chunk kf D128", 5400, 10, 32, chunk=256, key_first=True, decoder_dim=128),
        Config("5.4k L32 chunk kf (500kb)", 5400, 32, 32, chunk=256, key_first=True),
        Config("27k L10 chunk kf (100kb)", 27000, 10, 32, chunk=256, key_first=True),
        Config("3k L6 no-attention", 3000, 6, 64, attention=False),
        Config("2k L8 chunk kf cross", 2000, 8, 32, chunk=256, key_first=True, cross=True),
        Config("2k L8 full D64 cross", 2000, 8, 32, decoder_dim=64, cross=True),
        Config("2k L8 chunk kf fp64", 2000, 8, 32, chunk=256, key_first=True, dtype=torch.float64),
        Config("2k L8 full bf16", 2000, 8, 32, dtype=bf16),
        Config("5.4k L6 chunk kf bf16", 5400, 6, 64, chunk=256, key_first=True, dtype=bf16),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (seconds instead of minutes)")
    ap.add_argument("--tolerance", type=float, default=0.10, help="largest allowed |relative error| (default 0.10)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    ap.add_argument("--sweep", default="2,4,8,16", help="numbers of strata of the linearity sweep (default 2,4,8,16)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    configs = configurations(args.quick)
    skip_bf16 = bf16_check()
    if skip_bf16:
        print(f"bf16 configurations skipped: a bf16 training step fails on this CPU ({skip_bf16})")
        configs = [c for c in configs if c.dtype != torch.bfloat16]

    rows = []
    header = f"{'configuration':27s} {'n':>6s} {'L':>3s} {'B':>4s} {'chunk':>5s} {'kf':>3s} {'dtype':>5s} {'measured MiB':>13s} {'predicted MiB':>14s} {'error':>8s} {'marks err':>9s} {'s':>6s}"
    print(header)
    print("-" * len(header))
    for cfg in configs:
        measured, marks, est, seconds = run(cfg)
        err = (est.total - measured) / measured
        marks_err = max(abs(p - m) / m for p, m in zip(est.marks, marks))
        dtype = {torch.bfloat16: "bf16", torch.float64: "fp64"}.get(cfg.dtype, "fp32")
        line = (
            f"{cfg.name:27s} {cfg.n_anchors:6d} {cfg.n_strata:3d} {cfg.batch:4d} {cfg.chunk or '-':>5} "
            f"{'on' if cfg.key_first else 'off':>3s} {dtype:>5s} {measured / MIB:13.2f} {est.total / MIB:14.2f} "
            f"{100 * err:+7.3f}% {100 * marks_err:8.3f}% {seconds:6.1f}"
        )
        print(line, flush=True)
        rows.append((cfg, measured, est, err))

    # Linearity in L at one setting: equal |F_k| so that M(L) is a line.
    sweep = [int(x) for x in args.sweep.split(",")]
    n_sweep = 500 if args.quick else 2000
    base_cfg = Config("sweep", n_sweep, 2, 32, chunk=64 if args.quick else 256, key_first=True, stratum_size=n_sweep // 4)
    meas_L, pred_L, ests = [], [], []
    for L in sweep:
        measured, _, est, _ = run(replace(base_cfg, n_strata=L, name=f"sweep L{L}"))
        meas_L.append(measured)
        pred_L.append(est.total)
        ests.append(est)
        rows.append((replace(base_cfg, n_strata=L, name=f"sweep L{L}"), measured, est, (est.total - measured) / measured))
    m_slope, m_icpt = fit_linear(sweep, meas_L)
    p_slope, p_icpt = fit_linear(sweep, pred_L)
    last = ests[-1]
    print()
    print(f"M(L) sweep, n={base_cfg.n_anchors}, B={base_cfg.batch}, chunk={base_cfg.chunk}, key-first, fp32, L = {sweep}")
    print(f"  measured (MiB):  {', '.join(f'{m / MIB:.2f}' for m in meas_L)}")
    print(f"  predicted (MiB): {', '.join(f'{p / MIB:.2f}' for p in pred_L)}")
    print(f"  slope     fitted to measured {m_slope / MIB:10.4f} MiB | fitted to predicted {p_slope / MIB:10.4f} MiB | predicted M_stratum {last.per_stratum / MIB:10.4f} MiB")
    print(f"  intercept fitted to measured {m_icpt / MIB:10.4f} MiB | fitted to predicted {p_icpt / MIB:10.4f} MiB | predicted M_base - M_stratum {(last.base - last.per_stratum) / MIB:10.4f} MiB")
    slope_err = (p_slope - m_slope) / m_slope
    icpt_err = (p_icpt - m_icpt) / m_icpt
    print(f"  slope error {100 * slope_err:+.3f}%, intercept error {100 * icpt_err:+.3f}%")

    big = max(rows, key=lambda r: r[1])
    print()
    print(f"predicted components of '{big[0].name}' (MiB):")
    for k, v in sorted(big[2].components.items(), key=lambda kv: -kv[1]):
        print(f"  {k:26s} {v / MIB:12.2f}")
    print(f"  {'M_base':26s} {big[2].base / MIB:12.2f}")
    print(f"  {'M_stratum':26s} {big[2].per_stratum / MIB:12.2f}")
    print("  transient (not in total): " + ", ".join(f"{k} {v / MIB:.2f}" for k, v in big[2].transient.items()))

    print()
    print("summary")
    print(f"{'configuration':27s} {'measured MiB':>13s} {'predicted MiB':>14s} {'error':>8s}")
    worst = 0.0
    for cfg, measured, est, err in rows:
        worst = max(worst, abs(err))
        flag = "" if abs(err) <= args.tolerance else "  FAIL"
        print(f"{cfg.name:27s} {measured / MIB:13.2f} {est.total / MIB:14.2f} {100 * err:+7.3f}%{flag}")
    for label, e in (("sweep slope", slope_err), ("sweep intercept", icpt_err)):
        worst = max(worst, abs(e))
        print(f"{label:27s} {'':13s} {'':14s} {100 * e:+7.3f}%{'' if abs(e) <= args.tolerance else '  FAIL'}")
    ok = worst <= args.tolerance
    print(f"worst |error| {100 * worst:.3f}% (tolerance {100 * args.tolerance:g}%): {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
