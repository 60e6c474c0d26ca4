#!/usr/bin/env python
"""Benchmark sliding-window attention: the model's banded kernel versus the per-offset
baseline it replaced, chunked (S3) and full masked attention.

For each sequence length N (``--sizes``, default the Hi-C decoder's anchors on mm10 at
1 Mb, 500 kb and 100 kb) and fixed heads H, head width D and window w,
:func:`ampflow.model.attention.local_attention_banded` (the blocked kernel the model
runs; unchunked, and with each chunk of ``--chunks``), the per-offset kernel it replaced
(``scripts/attention_baselines.py``, one band column at a time: kept only as this
baseline), ``local_attention_chunked`` (``scripts/attention_baselines.py``) (with each chunk of
``--chunks``) and :func:`~ampflow.model.attention.local_attention_full` run forward +
backward on the same random inputs (``--dtype`` float32, float64 or bfloat16; bfloat16
is meant for the GPU). Every figure printed is measured in this run:

* seconds, best of ``--repeats`` after ``--warmup`` untimed passes (forward alone and
  forward + backward). On a shared CPU other processes' load makes single passes
  noisy (two OpenMP threads wait on each other when one is descheduled, which hurts
  many small ops most); ``--threads 1`` or more repeats help;
* bytes saved for backward, counted with
  :class:`~ampflow.train.measured_memory.SavedTensorBytes` during the first warm-up pass (q, k, v are
  leaves requiring grad and are not counted);
* on CUDA, ``torch.cuda.max_memory_allocated`` over one forward + backward;
* the ratios of each method's time and saved bytes to the unchunked banded kernel's,
  and the largest absolute difference of its outputs and gradients from the banded
  ones.

The full method needs several ``H x N x N`` tensors at once. Its peak is estimated as
``H * N**2 * (4 * itemsize + 1)`` bytes (scores, masked scores, softmax output and two
gradients of that size alive in backward, plus the bool mask); when the estimate exceeds
``--max-full-gib`` the full run is skipped, and the estimate is printed with the reason.
The score term of the memory model (DESIGN §4: ``H*N*(2w+1)`` banded, ``H*N*N`` full,
and for the chunked kernel ``H*N*(C+2w)`` summed exactly over the clipped edge chunks)
is printed beside the measured saved bytes.

Examples::

    python scripts/bench_attention.py
    python scripts/bench_attention.py --sizes 2700 27000 --chunks 128 2048 --threads 1
    python scripts/bench_attention.py --device cuda --dtype bfloat16 --max-full-gib 40

The last lines (``summary N=...``) give, per N, the per-offset baseline's and full
attention's forward + backward time over the blocked kernel's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

try:
    from ampflow.model.attention import band_width, local_attention_banded, local_attention_full
    from ampflow.train.measured_memory import SavedTensorBytes
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from ampflow.model.attention import band_width, local_attention_banded, local_attention_full
    from ampflow.train.measured_memory import SavedTensorBytes
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_baselines import local_attention_chunked, local_attention_per_offset  # noqa: E402

GIB = 1024**3
MIB = 1024**2
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Defaults: the Hi-C decoder's anchors on mm10 (its bins over chr1-19, X and Y)
    # at 1 Mb, 500 kb and 100 kb, and the default model's head width (D = latent 32 over
    # 4 heads)
    p.add_argument("--sizes", type=int, nargs="+", default=[2737, 5462, 27268], help="sequence lengths N")
    p.add_argument("--dim", type=int, default=8, help="head width D (Dk = Dv)")
    p.add_argument("--window", type=int, default=8, help="half-width w of the window")
    p.add_argument("--chunks", type=int, nargs="+", default=[128, 2048], help="query rows C per chunk (S3)")
    p.add_argument("--heads", type=int, default=4, help="attention heads H")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (best is reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed passes first (the first counts bytes)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--max-full-gib",
        type=float,
        default=4.0,
        help="skip full masked attention when its estimated peak exceeds this many GiB",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda requested but CUDA is not available")
    if min(args.sizes) < 1 or min(*args.chunks, args.repeats, args.warmup) < 1 or args.window < 0:
        p.error("sizes, chunk, repeats and warmup must be >= 1 and window >= 0")
    return args


def full_peak_estimate(n: int, heads: int, itemsize: int) -> int:
    """Estimated peak bytes of full masked attention's N x N tensors (forward + backward)."""
    return heads * n * n * (4 * itemsize + 1)


def score_model_bytes(n: int, heads: int, itemsize: int, window: int, kind: str, chunk: int = 0) -> int:
    """The memory model's score term: saved softmax elements times itemsize."""
    if kind == "full":
        return heads * n * n * itemsize
    if kind in ("banded", "per-offset"):
        return heads * n * band_width(n, window) * itemsize
    total = 0
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        total += (e - s) * (min(n, e + window) - max(0, s - window))
    return heads * total * itemsize


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fwd_bwd(fn, q, k, v, grad_out) -> tuple[float, float]:
    """Seconds of the forward and of forward + backward of one pass."""
    for t in (q, k, v):
        t.grad = None
    _sync(q.device)
    t0 = time.perf_counter()
    out = fn(q, k, v)
    _sync(q.device)
    t1 = time.perf_counter()
    out.backward(grad_out)
    _sync(q.device)
    return t1 - t0, time.perf_counter() - t0


def run_method(fn, q, k, v, grad_out, repeats: int, warmup: int) -> dict:
    """Warm-up passes (the first counts saved bytes and keeps results), then timed ones."""
    device = q.device
    for t in (q, k, v):
        t.grad = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    with SavedTensorBytes() as saved:
        out = fn(q, k, v)
    out.backward(grad_out)
    _sync(device)
    res = {
        "saved": saved.nbytes,
        "out": out.detach(),
        "grads": [t.grad.detach().clone() for t in (q, k, v)],
    }
    if device.type == "cuda":
        res["cuda_peak"] = torch.cuda.max_memory_allocated(device)
        res["cuda_extra"] = res["cuda_peak"] - base
    del out
    for _ in range(warmup - 1):
        _fwd_bwd(fn, q, k, v, grad_out)
    times = [_fwd_bwd(fn, q, k, v, grad_out) for _ in range(repeats)]
    res["fwd"] = min(t[0] for t in times)
    res["total"] = min(t[1] for t in times)
    return res


def fmt_bytes(b: float) -> str:
    return f"{b / GIB:.2f} GiB" if b >= GIB else f"{b / MIB:.1f} MiB"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    h, d, w = args.heads, args.dim, args.window
    print(
        f"sliding-window attention fwd+bwd: H={h} D={d} w={w} C={args.chunks} {args.dtype} "
        f"device={device} torch {torch.__version__} threads={torch.get_num_threads()} "
        f"repeats={args.repeats} (best of, after {args.warmup} warm-up)"
    )
    if hasattr(os, "getloadavg"):
        # Other processes' load decides CPU timings here more than anything else.
        load = os.getloadavg()[0]
        print(f"load average (1 min) before the run: {load:.2f} on {os.cpu_count()} CPUs")
    if device.type == "cuda":
        print(f"GPU: {torch.cuda.get_device_name(device)}")
    # (label, kind, chunk, function); the unchunked banded kernel first: the baseline
    methods = [("banded", "banded", 0, lambda q, k, v: local_attention_banded(q, k, v, w)),
               ("per-offset", "per-offset", 0, lambda q, k, v: local_attention_per_offset(q, k, v, w))]  # fmt: skip
    for c in args.chunks:
        methods.append((f"banded C={c}", "banded", c, lambda q, k, v, c=c: local_attention_banded(q, k, v, w, c)))
    for c in args.chunks:
        methods.append((f"chunked C={c}", "chunked", c, lambda q, k, v, c=c: local_attention_chunked(q, k, v, w, c)))
    methods.append(("full", "full", 0, lambda q, k, v: local_attention_full(q, k, v, w)))
    summary = []
    for n in args.sizes:
        g = torch.Generator(device="cpu").manual_seed(args.seed + n)
        q, k, v, grad_out = (torch.randn(h, n, d, generator=g, dtype=dtype).to(device) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_(True)
        print(f"\nN={n}   ({band_width(n, w)} scores per query needed)")
        base = None
        ratios = {}
        est = full_peak_estimate(n, h, itemsize)
        for label, kind, c, fn in methods:
            if kind == "full" and est > args.max_full_gib * GIB:
                print(f"  {label:<15} skipped: estimated peak {fmt_bytes(est)} (H*N^2*(4*{itemsize}+1) bytes) > --max-full-gib {args.max_full_gib:g}")
                continue
            r = run_method(fn, q, k, v, grad_out, args.repeats, args.warmup)
            model = score_model_bytes(n, h, itemsize, w, kind, c)
            line = (
                f"  {label:<15} fwd {r['fwd'] * 1e3:9.1f} ms   fwd+bwd {r['total'] * 1e3:9.1f} ms"
                f"   saved {fmt_bytes(r['saved']):>10}  (score model {fmt_bytes(model)})"
            )
            if "cuda_peak" in r:
                line += f"   cuda peak {fmt_bytes(r['cuda_peak'])} (+{fmt_bytes(r['cuda_extra'])} over inputs)"
            if base is None:
                base = r
            else:
                ratios[label] = r["total"] / base["total"]
                diff = max((a - b).abs().max().item() for a, b in zip([r["out"], *r["grads"]], [base["out"], *base["grads"]]))
                line += f"\n  {'':<15} / banded: fwd+bwd {r['total'] / base['total']:.2f}x   saved {r['saved'] / base['saved']:.2f}x   max |diff| {diff:.1e}"
                if "cuda_peak" in r:
                    line += f"   cuda peak {r['cuda_peak'] / base['cuda_peak']:.2f}x"
            print(line)
            del r
        summary.append(
            f"summary N={n} {args.dtype} {device.type}: banded fwd+bwd {base['total'] * 1e3:.2f} ms; "
            f"per-offset / banded {ratios['per-offset']:.2f}x; " + (f"full / banded {ratios['full']:.2f}x" if "full" in ratios else "full skipped")
        )
        del q, k, v, grad_out, base
    print()
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
