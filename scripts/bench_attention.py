#!/usr/bin/env python
"""Benchmark sliding-window attention: full masked versus chunked (strategy S3).

For each sequence length N (``--sizes``) and fixed heads H, width D, window w and chunk
C, both :func:`ampflow.model.attention.local_attention_full` and
:func:`~ampflow.model.attention.local_attention_chunked` run forward + backward on the
same random fp32 inputs. Every figure printed is measured in this run:

* seconds, best of ``--repeats`` after ``--warmup`` untimed passes (forward alone and
  forward + backward). On a shared CPU other processes' load makes single passes
  noisy (two OpenMP threads wait on each other when one is descheduled, which hurts
  the many small ops of the chunked method most); ``--threads 1`` or more repeats help;
* bytes saved for backward, counted with
  :class:`~ampflow.train.memory.SavedTensorBytes` during the first warm-up pass (q, k, v are
  leaves requiring grad and are not counted);
* on CUDA, ``torch.cuda.max_memory_allocated`` over one forward + backward;
* the ratios full / chunked of the above, and the largest absolute difference between
  the two methods' outputs and gradients.

The full method needs several ``H x N x N`` tensors at once. Its peak is estimated as
``H * N**2 * (4 * itemsize + 1)`` bytes (scores, masked scores, softmax output and two
gradients of that size alive in backward, plus the bool mask); when the estimate exceeds
``--max-full-gib`` the full run is skipped, and the estimate is printed with the reason.
The score-tensor term of the memory model (DESIGN §4: ``H*N*N`` unchunked,
``H*N*(C+2w)`` chunked, here summed exactly over the clipped edge chunks) is printed
beside the measured saved bytes.

Examples::

    python scripts/bench_attention.py
    python scripts/bench_attention.py --sizes 2048 8192 --repeats 5
    python scripts/bench_attention.py --device cuda --max-full-gib 40
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

try:
    from ampflow.model.attention import local_attention_chunked, local_attention_full
    from ampflow.train.memory import SavedTensorBytes
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from ampflow.model.attention import local_attention_chunked, local_attention_full
    from ampflow.train.memory import SavedTensorBytes

GIB = 1024**3
MIB = 1024**2
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 27000], help="sequence lengths N")
    p.add_argument("--dim", type=int, default=128, help="head width D (Dk = Dv)")
    p.add_argument("--window", type=int, default=128, help="half-width w of the window")
    p.add_argument("--chunk", type=int, default=256, help="query rows C per chunk")
    p.add_argument("--heads", type=int, default=1, help="attention heads H")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (best is reported)")
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed passes first (the first counts bytes)"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
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
    if min(args.sizes) < 1 or min(args.chunk, args.repeats, args.warmup) < 1 or args.window < 0:
        p.error("sizes, chunk, repeats and warmup must be >= 1 and window >= 0")
    return args


def full_peak_estimate(n: int, heads: int, itemsize: int) -> int:
    """Estimated peak bytes of full masked attention's N x N tensors (forward + backward)."""
    return heads * n * n * (4 * itemsize + 1)


def score_model_bytes(n: int, heads: int, itemsize: int, window: int, chunk: int | None) -> int:
    """The memory model's score term: saved softmax elements times itemsize."""
    if chunk is None:
        return heads * n * n * itemsize
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
    h, d, w, c = args.heads, args.dim, args.window, args.chunk
    print(
        f"sliding-window attention fwd+bwd: H={h} D={d} w={w} C={c} {args.dtype} "
        f"device={device} torch {torch.__version__} threads={torch.get_num_threads()} "
        f"repeats={args.repeats} (best of, after {args.warmup} warm-up)"
    )
    if hasattr(os, "getloadavg"):
        # Other processes' load decides CPU timings here more than anything else.
        load = os.getloadavg()[0]
        print(f"load average (1 min) before the run: {load:.2f} on {os.cpu_count()} CPUs")
    if device.type == "cuda":
        print(f"GPU: {torch.cuda.get_device_name(device)}")
    methods = {
        "full": lambda q, k, v: local_attention_full(q, k, v, w),
        "chunked": lambda q, k, v: local_attention_chunked(q, k, v, w, c),
    }
    for n in args.sizes:
        g = torch.Generator(device="cpu").manual_seed(args.seed + n)
        q, k, v, grad_out = (
            torch.randn(h, n, d, generator=g, dtype=dtype).to(device) for _ in range(4)
        )
        for t in (q, k, v):
            t.requires_grad_(True)
        print(f"\nN={n}")
        results = {}
        est = full_peak_estimate(n, h, itemsize)
        for name, fn in methods.items():
            if name == "full" and est > args.max_full_gib * GIB:
                print(
                    f"  full     skipped: estimated peak {fmt_bytes(est)} "
                    f"(H*N^2*(4*{itemsize}+1) bytes) > --max-full-gib {args.max_full_gib:g}"
                )
                continue
            r = results[name] = run_method(fn, q, k, v, grad_out, args.repeats, args.warmup)
            model = score_model_bytes(n, h, itemsize, w, None if name == "full" else c)
            line = (
                f"  {name:<8} fwd {r['fwd'] * 1e3:9.1f} ms   fwd+bwd {r['total'] * 1e3:9.1f} ms"
                f"   saved {fmt_bytes(r['saved']):>10}  (score model {fmt_bytes(model)})"
            )
            if name == "full":
                line += f"   est. peak {fmt_bytes(est)}"
            if "cuda_peak" in r:
                line += (
                    f"   cuda max_memory_allocated {fmt_bytes(r['cuda_peak'])}"
                    f" (+{fmt_bytes(r['cuda_extra'])} over inputs)"
                )
            print(line)
        if len(results) == 2:
            f, ch = results["full"], results["chunked"]
            ratios = (
                f"  full/chunked: fwd {f['fwd'] / ch['fwd']:.2f}x   "
                f"fwd+bwd {f['total'] / ch['total']:.2f}x   saved {f['saved'] / ch['saved']:.2f}x"
            )
            if "cuda_peak" in f:
                ratios += f"   cuda peak {f['cuda_peak'] / ch['cuda_peak']:.2f}x"
            print(ratios)
            diffs = [
                (a - b).abs().max().item()
                for a, b in zip([f["out"], *f["grads"]], [ch["out"], *ch["grads"]])
            ]
            print(
                "  max |full - chunked|: out {:.2e}  dq {:.2e}  dk {:.2e}  dv {:.2e}".format(
                    *diffs
                )
            )
        del q, k, v, grad_out, results
    return 0


if __name__ == "__main__":
    sys.exit(main())
