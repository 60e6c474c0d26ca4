"""Attention over packed sequences without a dense mask.

A packed batch is every sequence's tokens one after another, ``(T, ...)`` with ``T`` the
sum of the lengths, described by :class:`Packed` (``cu_seqlens``: where each sequence
starts). The per-token parts of a block (projections, layer norms, feed-forward) run on
the ``(T, D)`` tensor as they would on one sequence; only attention needs the sequence
boundaries, and :func:`attention` takes them from ``cu_seqlens`` instead of a
``(T, T)`` block-diagonal mask (``scaled_dot_product_attention`` with any mask never
runs the FlashAttention kernel and computes every masked block it then discards).

Backends, the first that works chosen once per device and logged (:func:`choose`):

* ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention over
  ``cu_seqlens``; CUDA, half precision; no bias, so not for ALiBi);
* ``flex``: ``flex_attention`` compiled, with a document ``BlockMask`` (fully masked
  blocks skipped) and ALiBi as a score modification;
* ``segments``: ``scaled_dot_product_attention`` on each sequence in turn (its ALiBi
  bias per sequence): the CPU's path, and the fallback, exact on any device.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

BACKENDS = ("varlen", "flex", "segments")
# flex_attention is compiled per token count: the packed length is padded up to a
# multiple of this, so a run compiles for a few lengths, not one per batch
FLEX_PAD = 1024
# environment override of the backend (the benchmark compares them): one of BACKENDS
ENV = "AMPFLOW_VARLEN_ATTENTION"


@dataclass
class Packed:
    """Sequences of ``lengths`` tokens packed one after another on ``device``."""

    lengths: list[int]
    cu_seqlens: torch.Tensor  # int32 (n + 1,): where each sequence starts, then T
    positions: torch.Tensor  # long (T,): each token's position in its sequence, from 0
    seq_index: torch.Tensor  # long (T,): each token's sequence
    backend: str
    cache: dict = field(default_factory=dict)  # the flex block mask, built once a batch

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    @property
    def total(self) -> int:
        return sum(self.lengths)


def pack(lengths: list[int], device, backend: str) -> Packed:
    """:class:`Packed` of ``lengths`` on ``device`` (built on the host, one copy each)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} not one of {BACKENDS}")
    lens = torch.tensor(lengths, dtype=torch.long)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lens)
    pos = torch.arange(int(lens.sum())) - torch.repeat_interleave(cu[:-1].long(), lens)
    return Packed(list(lengths), cu.to(device), pos.to(device), seq.to(device), backend)


def alibi_bias(slopes: torch.Tensor, n: int, dtype) -> torch.Tensor:
    """ALiBi ``-slope_h |i - j|`` as (1, H, n, n): float32 first, then rounded once to
    ``dtype`` (as :class:`~ampflow.extract.dnabert.BertEncoder` builds it)."""
    pos = torch.arange(n, device=slopes.device)
    return (-slopes.float()[:, None, None] * (pos[None, :] - pos[:, None]).abs())[None].to(dtype)


def _segments(q, k, v, packed: Packed, slopes):
    out = torch.empty_like(q)
    at = 0
    for n in packed.lengths:
        s = slice(at, at + n)
        bias = None if slopes is None else alibi_bias(slopes, n, q.dtype)
        o = F.scaled_dot_product_attention(q[s].transpose(0, 1)[None], k[s].transpose(0, 1)[None], v[s].transpose(0, 1)[None], attn_mask=bias)
        out[s] = o[0].transpose(0, 1)
        at += n
    return out


def _varlen(q, k, v, packed: Packed, slopes):
    from torch.nn.attention.varlen import varlen_attn

    if slopes is not None:
        raise NotImplementedError("varlen_attn takes no bias (ALiBi)")
    m = packed.max_len
    # the kernel's layout (ESM C's v is a view into the fused q/k/v projection)
    q, k, v = (x if x.is_contiguous() else x.contiguous() for x in (q, k, v))
    # positional arguments only: the signature torch 2.10-2.13 share
    return varlen_attn(q, k, v, packed.cu_seqlens, packed.cu_seqlens, m, m)


_FLEX = {}


def _flex_fn(device_type: str):
    """flex_attention, compiled on CUDA (eager flex materialises every score)."""
    if device_type not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX[device_type] = torch.compile(flex_attention) if device_type == "cuda" else flex_attention
    return _FLEX[device_type]


FLEX_BLOCK = 128  # flex_attention's default sparse block


def document_block_mask(packed: Packed, padded: int, device):
    """flex_attention's ``BlockMask`` for packed sequences padded to ``padded`` tokens
    (padding: one more sequence), built from the sequence boundaries in O(blocks):
    query block i sees the key blocks from the start of its first token's sequence to the
    end of its last one's (a contiguous range, sequences being contiguous). The element
    mask (same sequence) is applied within those blocks. ``create_block_mask`` would
    evaluate the mask on every one of the ``padded^2`` pairs."""
    from torch.nn.attention.flex_attention import BlockMask

    t = packed.total
    doc = torch.full((padded,), len(packed.lengths), dtype=torch.long, device=device)
    doc[:t] = packed.seq_index
    bounds = torch.cat([packed.cu_seqlens.long(), torch.tensor([padded], device=device)])
    nb = padded // FLEX_BLOCK
    first = torch.arange(nb, device=device) * FLEX_BLOCK
    lo = bounds[doc[first]] // FLEX_BLOCK
    hi = (bounds[doc[first + FLEX_BLOCK - 1] + 1] - 1) // FLEX_BLOCK
    count = (hi - lo + 1).to(torch.int32)
    idx = (lo[:, None] + torch.arange(nb, device=device)[None]).clamp(max=nb - 1).to(torch.int32)

    def same_sequence(b, h, qi, ki):
        return doc[qi] == doc[ki]

    return BlockMask.from_kv_blocks(count[None, None], idx[None, None], BLOCK_SIZE=FLEX_BLOCK, mask_mod=same_sequence)


_ALIBI_MODS: dict = {}


def _alibi_mod(slopes: torch.Tensor):
    """The ALiBi score modification of ``slopes``, one function per model's slopes (a new
    closure per call would be a new function to the compiled kernel)."""
    key = (slopes.data_ptr(), slopes.device)
    if key not in _ALIBI_MODS:
        sl = slopes.float()

        # within one sequence the distance of token indices is that of positions
        def alibi(score, b, h, qi, ki):
            return score - sl[h] * (qi - ki).abs()

        _ALIBI_MODS[key] = alibi
    return _ALIBI_MODS[key]


def flex_pad(device_type: str) -> int:
    """The multiple the packed length is padded up to for ``flex`` on this device type."""
    return FLEX_PAD if device_type == "cuda" else FLEX_BLOCK


def _flex(q, k, v, packed: Packed, slopes):
    t = q.shape[0]
    pad = flex_pad(q.device.type)
    tp = math.ceil(t / pad) * pad
    if "block_mask" not in packed.cache:
        packed.cache["block_mask"] = document_block_mask(packed, tp, q.device)

    def lay(x):  # (T, H, D) -> (1, H, Tp, D)
        x = x.transpose(0, 1)[None]
        return F.pad(x, (0, 0, 0, tp - t)) if tp > t else x

    score_mod = None if slopes is None else _alibi_mod(slopes)
    out = _flex_fn(q.device.type)(lay(q), lay(k), lay(v), score_mod=score_mod, block_mask=packed.cache["block_mask"])
    return out[0, :, :t].transpose(0, 1)


_IMPL = {"varlen": _varlen, "flex": _flex, "segments": _segments}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed, slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention ``(T, H, D) -> (T, H, D)``, each token over its own sequence's
    tokens only, scaled by ``1/sqrt(D)``; with ALiBi ``slopes (H,)`` the bias
    ``-slope_h |i - j|`` per sequence. ``varlen`` falls back to ``segments`` for ALiBi
    and for float32 (FlashAttention is half precision only)."""
    backend = packed.backend
    if backend == "varlen" and (slopes is not None or q.dtype == torch.float32):
        backend = "segments"
    shape = (backend, q.shape[-1], q.dtype, q.device.type)
    if backend == "segments" or shape in _UNSUPPORTED:
        return _segments(q, k, v, packed, slopes)
    try:
        return _IMPL[backend](q, k, v, packed, slopes)
    except Exception as e:
        from .batching import is_out_of_memory

        if is_out_of_memory(e):  # the batch is split by the caller
            raise
        # a shape the probe did not cover (flex needs a head width >= 16): the exact
        # per-sequence path from now on for this shape, said once
        _UNSUPPORTED.add(shape)
        first = str(e).splitlines()[0][:160] if str(e) else ""
        log.warning(
            "%s attention failed for head width %d, %s (%s: %s); per-sequence attention instead", backend, q.shape[-1], q.dtype, type(e).__name__, first
        )
        return _segments(q, k, v, packed, slopes)


_UNSUPPORTED: set = set()


_CHOSEN: dict = {}


def _probe(backend: str, device: torch.device, dtype, alibi: bool) -> None:
    """Run ``backend`` against ``segments`` on two packed batches of two sequences whose
    padded lengths differ; raises if it fails or disagrees. Compiled ``flex`` compiles
    for the first length and, at the second, once for lengths that vary (torch's
    automatic dynamic shapes; one graph per padded length would stop at dynamo's limit
    of 8 and run eager flex, which materialises every score): that compile happens
    here, where a failure passes the backend over, not in the middle of the run."""
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    slopes = torch.tensor([0.5, 0.25], device=device) if alibi else None
    for lengths in ([10, 14], [10, 14 + flex_pad(device.type)]):
        q, k, v = (torch.randn(sum(lengths), 2, 64, generator=g).to(device=device, dtype=dtype) for _ in range(3))
        p = pack(lengths, device, backend)
        got = _IMPL[backend](q, k, v, p, slopes)
        ref = _segments(q, k, v, p, slopes)
        err = (got.float() - ref.float()).abs().max().item()
        if not err < (2e-2 if dtype != torch.float32 else 1e-4):
            raise RuntimeError(f"{backend} differs from per-sequence attention by {err:.3g} (sequences of {lengths} tokens)")


def choose(device, dtype=torch.float32, alibi: bool = False) -> str:
    """The backend for ``device`` and compute ``dtype`` (with ALiBi or not): on CUDA the
    first of ``varlen`` (not for ALiBi or float32), ``flex``, ``segments`` whose probe
    runs and agrees with per-sequence attention; ``segments`` on the CPU (its SDPA per
    sequence is what one-at-a-time runs). ``AMPFLOW_VARLEN_ATTENTION`` forces one.
    Chosen once per (device, dtype, ALiBi) and logged with why the others were not."""
    device = torch.device(device)
    key = (device.type, device.index, dtype, alibi, os.environ.get(ENV))
    if key in _CHOSEN:
        return _CHOSEN[key]
    forced = os.environ.get(ENV)
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{ENV}={forced!r}: must be one of {', '.join(BACKENDS)}")
        order = [forced]
    elif device.type == "cuda":
        order = [b for b in BACKENDS if not (b == "varlen" and (alibi or dtype == torch.float32))]
    else:
        order = ["segments"]
    why = []
    chosen = "segments"
    for b in order:
        try:
            _probe(b, device, dtype, alibi)
        except Exception as e:  # an API absent in this torch, a kernel this GPU lacks
            why.append(f"{b}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
            continue
        chosen = b
        break
    # a kernel passed over on a GPU (an API this torch lacks, an out-of-memory probe beside
    # another worker) holds for the whole run: a warning, not a line among the others
    level = logging.WARNING if why and device.type == "cuda" else logging.INFO
    log.log(level, "packed attention on %s (%s%s): %s%s", device, dtype, ", ALiBi" if alibi else "", chosen, f" (not {'; '.join(why)})" if why else "")
    _CHOSEN[key] = chosen
    return chosen


def chosen_backends() -> dict:
    """What :func:`choose` chose so far: ``"device dtype [alibi]" -> backend``."""
    return {f"{k[0]}{'' if k[1] is None else ':' + str(k[1])} {str(k[2]).removeprefix('torch.')}{' alibi' if k[3] else ''}": v for k, v in _CHOSEN.items()}


class Fused:
    """``fn`` compiled on CUDA (``torch.compile``, dynamic shapes: one kernel for a chain
    of elementwise operations that would each read and write the whole ``(T, ...)``
    tensor), as is elsewhere. A compilation that fails (no Triton, no C compiler) is
    logged once and the eager function used from then on: the same values, slower."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = None
        self.failed = False

    def __call__(self, *args):
        if self.failed or args[0].device.type != "cuda":
            return self.fn(*args)
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, dynamic=True)
        try:
            return self.compiled(*args)
        except Exception as e:  # a backend this machine lacks: eager from now on
            from .batching import is_out_of_memory

            if is_out_of_memory(e):  # a batch too large, not a compiler missing: the caller splits it
                raise
            log.warning(
                "torch.compile of %s failed (%s: %s); running it eagerly", self.fn.__name__, type(e).__name__, str(e).splitlines()[0][:160] if str(e) else ""
            )
            self.failed = True
            return self.fn(*args)
