"""Cost model: predicted seconds per training step of the Hi-C decoder and the encoders, from shapes only.

The diagnosis (:mod:`ampflow.amp.decide.diagnose`) uses it to choose the plan's free knob, the query
chunk of S3, as the fastest candidate among those that fit the memory budget. It counts
the part of a step the knobs change, the Hi-C decoder's strata (their attention blocks
and decode, forward and backward), and the encoders' matrix products, which the mesh
divides (each device encodes its share of the batch), on one device:

``seconds = attention FLOPs / attention rate + dense FLOPs / dense rate
+ encoder FLOPs / encoder rate + attention calls x query chunks x per-chunk overhead
+ collectives x latency``

* **attention FLOPs**: the banded kernel (:func:`ampflow.model.attention.local_attention_banded`)
  of each attention stratum, ``H n (12 D_h (R + 2w) + 9 W)`` forward and backward (six
  block products over the ``R + 2w`` keys a block of ``R`` queries sees, softmax work
  on the ``W = 2w + 1`` band scores; ``D_h`` the head width on this rank: S5 divides it
  by tp). They depend on the chunk only where it caps ``R``
  (:func:`ampflow.contract.attention_blocks.block_rows`).
* **dense FLOPs**: each stratum block's projections and feed-forward
  (``2 n D (d (1 or 2) + 3 f D)`` forward, over tp under S5) and every stratum's decode
  (``2 B D n``, or ``2 B D |F_k|`` key-first, S4), three times the forward for forward and
  backward.
* **per-chunk overhead**: each query chunk of each attention call is one more group of
  blocks (:func:`ampflow.contract.attention_blocks.band_groups`), a fixed number of kernel
  launches per head whatever ``W``: the calibrated ``chunk_overhead_s`` per group. One
  block (no chunk) is one group (two when ``R`` does not divide ``n``).
* **collectives** (tp >= 2): S5 all-reduces each attention chunk's scores (forward) and
  their gradient (backward), plus six per stratum block (LayerNorm, GEGLU and output
  partial sums, forward and backward); S2 four per stratum (the softmax normaliser's max
  and sum, forward and backward). Latency only; their bytes do not depend on the knobs.

What is left out (graph, likelihood, optimizer, data loading, elementwise work) does not
depend on the chunk or on key-first decode, so it cannot change the choice; the
prediction is a comparison between candidates, not a forecast of the whole step's wall
time.

The constants (:class:`CostConstants`) come from a calibration (:mod:`.calibrate`, a
micro-benchmark of the banded kernel at two chunk settings, of one stratum-block matmul
and of the encoder's hidden layers on the training device, written to
``calibration.json``), or without one from
:data:`DEFAULT_CONSTANTS`. They are rounded to three significant digits when read, so a
plan is a pure function of (profile, devices, calibration file).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ...base.atomic import write_text_atomic
from ...base.errors import InputError, read_json
from ...contract.attention_blocks import band_groups, band_width, block_rows
from ...contract.profile import Profile, as_profile
from ...contract.strategies import CHUNKED_ATTENTION, FEATURE_PARALLEL, HIDDEN_PARALLEL, KEY_FIRST_DECODE

CALIBRATION_VERSION = 3
#: Significant digits of the constants (as written and as read) and of predicted seconds.
CONSTANT_DIGITS = 3
SECONDS_DIGITS = 4

#: Collectives per attention chunk (scores forward, their gradient backward) and per
#: stratum block otherwise under S5; per stratum under S2.
S5_PER_CHUNK, S5_PER_BLOCK, S2_PER_STRATUM = 2, 6, 4


def sig(x: float, digits: int = CONSTANT_DIGITS) -> float:
    """``x`` rounded to ``digits`` significant digits (a float that prints the same everywhere)."""
    return float(f"{float(x):.{digits}g}")


def attention_flops(n: int, window: int, heads: int, head_dim: float, chunk: int | None = None) -> float:
    """FLOPs of one banded attention call, forward and backward.

    Per head and query, six block products over the ``R + 2w`` keys its block sees
    (forward: scores and weighted values; backward: ``dv``, ``dp``, ``dq`` and ``dk``),
    ``2 D_h`` each per key: ``12 D_h (R + 2w)``; and per band score 5 (softmax, masking)
    forward and 4 (softmax gradient) backward: ``9 W``.
    """
    width = band_width(n, window)
    span = block_rows(n, window, chunk) + width - 1
    return float(heads) * n * (12.0 * head_dim * span + 9.0 * width)


def encoder_flops(rows: float, n_in: float, hidden: int, latent: int = 0) -> float:
    """FLOPs of one cell encoder (:class:`ampflow.model.encoders.Encoder`) over ``rows``
    cells, forward and backward, counting its matrix products.

    Per cell: the first layer ``2 n_in h`` forward and ``2 n_in h`` for its weight's
    gradient (the input needs none); the second ``2 h^2`` forward and ``4 h^2`` backward
    (weight and input gradients); the two Normal heads (``latent`` wide) ``4 h d``
    forward and ``8 h d`` backward. ``latent`` 0 counts the hidden layers alone (what the
    calibration times).
    """
    return float(rows) * (4.0 * n_in * hidden + 6.0 * hidden * hidden + 12.0 * hidden * latent)


@dataclass(frozen=True)
class CostConstants:
    """The device's constants of the cost model.

    Attributes
    ----------
    attention_flops_per_s : float
        Rate of the banded kernel's elementwise work (:func:`attention_flops`).
    dense_flops_per_s : float
        Rate of the decoder's matrix products.
    encoder_flops_per_s : float
        Rate of the encoders' matrix products (:func:`encoder_flops`).
    chunk_overhead_s : float
        Seconds one query chunk of one attention call adds (forward and backward), at
        ``band_width`` scores per query.
    band_width : int
        ``2w + 1`` of the calibration; the overhead scales with it.
    collective_s : float
        Latency of one all-reduce within the tp group (not measured by the
        calibration, which sees one device: a default, editable in the file).
    source : str
        Where they come from: ``"defaults"`` or ``"calibrated on <device>"``.
    """

    attention_flops_per_s: float
    dense_flops_per_s: float
    encoder_flops_per_s: float
    chunk_overhead_s: float
    band_width: int
    collective_s: float
    source: str = "defaults"

    def __post_init__(self):
        for name in ("attention_flops_per_s", "dense_flops_per_s", "encoder_flops_per_s", "chunk_overhead_s", "collective_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0) or (name.endswith("per_s") and v <= 0):
                raise InputError("must be a finite number > 0 (>= 0 for times)", key=name, value=v)
        if int(self.band_width) < 1:
            raise InputError("must be >= 1", key="band_width", value=self.band_width)

    def rounded(self) -> CostConstants:
        """The constants at :data:`CONSTANT_DIGITS` significant digits."""
        return CostConstants(
            sig(self.attention_flops_per_s), sig(self.dense_flops_per_s), sig(self.encoder_flops_per_s),
            sig(self.chunk_overhead_s), int(self.band_width), sig(self.collective_s), self.source,
        )  # fmt: skip

    def to_dict(self) -> dict:
        """The numbers (JSON), without the source."""
        d = asdict(self.rounded())
        d.pop("source")
        return d

    def chunk_overhead(self) -> float:
        """Seconds per query chunk (group of blocks) of one attention call: launches and
        dispatch, the same whatever the band width (``band_width`` records the
        calibration's, for the reader)."""
        return self.chunk_overhead_s


#: Without a calibration file: :func:`ampflow.amp.cost.calibrate.calibrate` on one thread of a
#: shared x86 server CPU with the default model (4 heads of 8, w 8; 4,096 anchors;
#: hidden 256, batch 32), rounded: the blocked banded kernel's products run at a few
#: GFLOP/s (as counted by :func:`attention_flops`), the stratum block's matmul and the
#: encoder's hidden layers at about 50 GFLOP/s, and a query chunk (one group of blocks:
#: a few dozen small kernels, forward and backward) costs about 0.4 ms. A GPU's rates are
#: far higher and its overhead per chunk of the same order (launches): calibrate there.
#: The collective latency is a guess for an all-reduce of a few KiB within one node.
DEFAULT_CONSTANTS = CostConstants(
    attention_flops_per_s=4.0e9,
    dense_flops_per_s=5.0e10,
    encoder_flops_per_s=5.0e10,
    chunk_overhead_s=4.0e-4,
    band_width=17,
    collective_s=5.0e-5,
)


def solve_calibration(one_block_s: float, chunked_s: float, blocks: int, flops: float, dense_s: float, dense_flops: float,
                      encoder_s: float, encoder_flops: float, width: int, collective_s: float = DEFAULT_CONSTANTS.collective_s,
                      source: str = "defaults") -> CostConstants:  # fmt: skip
    """Constants from the micro-benchmark's timings.

    The banded kernel took ``one_block_s`` in one block and ``chunked_s`` in ``blocks``
    chunks (same ``flops``); so ``chunk_overhead = (chunked - one) / (blocks - 1)`` and
    ``attention rate = flops / (one - chunk_overhead)``. Timing noise can make the
    difference non-positive (the overhead is then taken as 1% of one block's time per
    chunk) or leave almost nothing for the FLOPs (at least a tenth of one block's time
    is then given to them). ``dense_s`` timed ``dense_flops`` of matrix products,
    ``encoder_s`` the encoder's hidden layers' ``encoder_flops``.
    """
    if blocks < 2:
        raise ValueError(f"blocks must be >= 2, got {blocks}")
    if min(one_block_s, chunked_s, dense_s, encoder_s) <= 0 or min(flops, dense_flops, encoder_flops) <= 0:
        raise ValueError("timings and FLOPs must be > 0")
    overhead = (chunked_s - one_block_s) / (blocks - 1)
    if overhead <= 0:
        overhead = 0.01 * one_block_s
    work = max(one_block_s - overhead, 0.1 * one_block_s)
    return CostConstants(flops / work, dense_flops / dense_s, encoder_flops / encoder_s, overhead, int(width), collective_s,
                         source).rounded()  # fmt: skip


# ---------------------------------------------------------------- the calibration file
def write_calibration(path, doc: dict) -> Path:
    """Write a calibration document (from :func:`ampflow.amp.cost.calibrate.calibrate`) atomically."""
    write_text_atomic(path, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return Path(path)


def constants_from_doc(doc: dict, path=None) -> CostConstants:
    """The constants of a calibration document, rounded; a bad document names the key."""
    if not isinstance(doc, dict) or not isinstance(doc.get("constants"), dict):
        raise InputError("a calibration file needs a 'constants' object", path=path)
    c = doc["constants"]
    missing = sorted({"attention_flops_per_s", "dense_flops_per_s", "encoder_flops_per_s", "chunk_overhead_s", "band_width"} - set(c))
    if missing:
        # a file from before a constant existed: its device was never timed for it
        raise InputError("calibration constants missing (run `ampflow calibrate` again)", path=path, key="constants", value=missing)
    try:
        return CostConstants(
            float(c["attention_flops_per_s"]), float(c["dense_flops_per_s"]), float(c["encoder_flops_per_s"]),
            float(c["chunk_overhead_s"]), int(c["band_width"]), float(c.get("collective_s", DEFAULT_CONSTANTS.collective_s)),
            f"calibrated on {doc.get('device', 'an unnamed device')}",
        ).rounded()  # fmt: skip
    except InputError as e:
        raise InputError(e.message, path=path, key=e.key, value=e.value) from None
    except (TypeError, ValueError) as e:
        raise InputError(f"malformed calibration constants ({e})", path=path, key="constants") from None


def read_calibration(path) -> CostConstants:
    """The constants of ``calibration.json``; a missing file or bad JSON is an InputError."""
    path = Path(path)
    return constants_from_doc(read_json(path, "calibration file"), path)


# ---------------------------------------------------------------- the step
@dataclass(frozen=True)
class StepShape:
    """What the cost model needs of a profile: the Hi-C decoder's shapes, the encoders'
    and the batch."""

    n_anchors: int
    features_per_stratum: tuple[int, ...]
    window: int
    heads: int
    D: int
    latent: int
    ffn_mult: int
    attention: bool
    batch_size: int
    hidden: int
    rna_inputs: int  # the RNA encoder's input genes; 0: no RNA encoder

    @property
    def n_strata(self) -> int:
        return len(self.features_per_stratum)

    @classmethod
    def from_profile(cls, profile: Profile | dict) -> StepShape | None:
        """From a profile (None without Hi-C). Strata without a feature count are taken
        as ``n_anchors`` features."""
        profile = as_profile(profile)
        hic = profile.hic
        if hic is None:
            return None
        cfg = profile.model
        n = int(hic.n_anchors or 0)
        given = list(hic.features_per_stratum or ())
        L = int(hic.n_strata if hic.n_strata is not None else (len(given) or 1))
        fps = given[:L] + [n] * (L - len(given[:L]))
        window = cfg.window if hic.window is None else int(hic.window)
        attention = cfg.attention if hic.attention is None else bool(hic.attention)
        rna = int(profile.rna.n_features or 0) if profile.rna is not None else 0
        return cls(n, tuple(fps), window, cfg.heads, cfg.D, cfg.latent_dim, cfg.ffn_mult, attention, int(profile.train.batch_size),
                   cfg.hidden_dim, rna)  # fmt: skip

    @property
    def hic_inputs(self) -> int:
        """The Hi-C encoder's input features: every stratum's."""
        return sum(self.features_per_stratum)


@dataclass(frozen=True)
class StepCost:
    """Predicted seconds of one step's Hi-C decoder and encoders on one device, by term."""

    seconds: float
    attention_s: float
    dense_s: float
    encoder_s: float
    overhead_s: float
    collective_s: float
    blocks: int  # query chunks per attention call (1: one block)
    collectives: int

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("seconds", "attention_s", "dense_s", "encoder_s", "overhead_s", "collective_s"):
            d[k] = sig(d[k], SECONDS_DIGITS)
        return d


def _ceil(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def step_cost(shape: StepShape, constants: CostConstants, names=(), dp: int = 1, tp: int = 1, chunk: int = 0) -> StepCost:
    """Predicted seconds per step of the Hi-C decoder and the encoders for one candidate.

    Parameters
    ----------
    shape : StepShape
    constants : CostConstants
    names : iterable of str
        Strategy names: ``chunked_attention`` (with ``chunk > 0``), ``key_first_decode``,
        ``hidden_parallel`` and ``feature_parallel`` (these two only with ``tp >= 2``).
    dp, tp : int
        The mesh: each device decodes ``ceil(B / dp)`` cells.
    chunk : int
        Query rows per attention block; 0 (or S3 not in ``names``): one block.

    Returns
    -------
    StepCost
    """
    names = frozenset(names)
    c = constants
    hp = tp if HIDDEN_PARALLEL in names and tp > 1 else 1
    fp = tp if FEATURE_PARALLEL in names and tp > 1 else 1
    key_first = KEY_FIRST_DECODE in names
    n, D, d, f, H = shape.n_anchors, shape.D, shape.latent, shape.ffn_mult, shape.heads
    L, fps = shape.n_strata, shape.features_per_stratum
    B = _ceil(shape.batch_size, dp)
    blocks_k = L - 1  # stratum blocks (k >= 1)
    att_calls = blocks_k if shape.attention and n > 0 else 0
    chunked = chunk if CHUNKED_ATTENTION in names and chunk else None
    blocks = max(1, len(list(band_groups(n, shape.window, chunked))))

    att_flops = att_calls * attention_flops(n, shape.window, H, D / H / hp, chunked)
    dense_fwd = blocks_k * 2.0 * n * D * (d * (2 if shape.attention else 1) + 3 * f * D) / hp
    for k, fk in enumerate(fps):
        width_k = d if k == 0 else D
        if key_first:
            dense_fwd += 2.0 * B * width_k * fk / (fp if k == 0 else max(hp, fp))
        else:
            dense_fwd += 2.0 * B * width_k * n / (1 if k == 0 else hp)
    overhead = att_calls * blocks * c.chunk_overhead()
    collectives = 0
    if hp > 1:
        collectives += att_calls * S5_PER_CHUNK * blocks + blocks_k * S5_PER_BLOCK
    if fp > 1:
        collectives += L * S2_PER_STRATUM
    enc_flops = encoder_flops(B, shape.hic_inputs / fp, shape.hidden, d)
    if shape.rna_inputs:
        enc_flops += encoder_flops(B, shape.rna_inputs, shape.hidden, d)
    att_s = att_flops / c.attention_flops_per_s
    dense_s = 3.0 * dense_fwd / c.dense_flops_per_s
    enc_s = enc_flops / c.encoder_flops_per_s
    coll_s = collectives * c.collective_s
    return StepCost(att_s + dense_s + enc_s + overhead + coll_s, att_s, dense_s, enc_s, overhead, coll_s, blocks, collectives)


def cost_for_profile(profile: Profile | dict, names, dp: int, tp: int, chunk: int, constants: CostConstants = DEFAULT_CONSTANTS) -> StepCost | None:
    """:func:`step_cost` for a profile (None without Hi-C): the signature the diagnosis calls."""
    shape = StepShape.from_profile(profile)
    return None if shape is None else step_cost(shape, constants, names, dp, tp, chunk)


def describe(constants: CostConstants) -> str:
    """One line: the constants and where they come from."""
    c = constants.rounded()
    return (
        f"attention {c.attention_flops_per_s:.3g} FLOP/s, dense {c.dense_flops_per_s:.3g} FLOP/s, "
        f"encoders {c.encoder_flops_per_s:.3g} FLOP/s, "
        f"{c.chunk_overhead_s * 1e3:.3g} ms per query chunk at {c.band_width} scores per query, "
        f"{c.collective_s * 1e6:.3g} us per collective ({'the documented defaults: no calibration file' if c.source == 'defaults' else c.source})"
    )
