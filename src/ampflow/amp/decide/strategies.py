"""Parallel strategies (S-numbers in docs and plans, names in code) and when they apply.

Strategy names are spelled only in :mod:`ampflow.contract.strategies`; this registry
attaches to each its S-number, summary and diagnosis rule. A strategy is added by registering it (:func:`register_strategy`) with a rule that,
given the diagnosis so far, returns the sentence saying why it applies (or None).
:mod:`.diagnose` walks the registry in ``order`` and never names strategies itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ...base.progress import human_bytes
from ...contract.profile import Profile
from ...contract.strategies import CHUNKED_ATTENTION, DATA_PARALLEL, FEATURE_PARALLEL, HIDDEN_PARALLEL, KEY_FIRST_DECODE
from .signals import ATTENTION_DECODER, HEAVY_DECOMPOSITION, HIGH_INPUT_DIMENSIONALITY


@dataclass
class Context:
    """What a strategy's rule may look at."""

    profile: Profile
    signals: dict  # name -> {"raised", "evidence", ...}
    devices: int
    budget: float  # bytes per device
    chosen: list[str] = field(default_factory=list)  # strategy names chosen so far, in order
    # peak(names, dp, tp, chunk) -> bytes per device: the predicted peak plus one query
    # block's transient attention scores
    peak: Callable[..., float] | None = None
    best_chunk: int = 0  # the chunk size that would be used (0: one block)

    def raised(self, name: str) -> bool:
        return bool(self.signals.get(name, {}).get("raised"))

    @property
    def has_hic(self) -> bool:
        return self.profile.hic is not None

    @property
    def hic_only(self) -> bool:
        """Hi-C is the only modality (a dataset without RNA)."""
        return self.has_hic and len(self.profile.modalities) == 1


@dataclass(frozen=True)
class Strategy:
    """A strategy: ``rule(ctx)`` returns why it applies, or None.

    ``multi_process``: needs more than one device. ``uses_tp``: shards over the
    tensor-parallel group (so the mesh gets a tp degree). ``knob``: a setting the
    diagnosis tunes for it (``"chunk"``: the fastest chunk size that fits, by the cost
    model; one block, no chunk, is a candidate, and when it wins the strategy is not
    listed) or a switch it turns on (``"key_first"``).
    """

    id: str
    name: str
    summary: str
    order: int
    multi_process: bool
    uses_tp: bool
    rule: Callable[[Context], str | None]
    knob: str | None = None


STRATEGIES: dict[str, Strategy] = {}


def register_strategy(strategy: Strategy) -> Strategy:
    if strategy.name in STRATEGIES:
        raise ValueError(f"strategy {strategy.name} is registered already")
    STRATEGIES[strategy.name] = strategy
    return strategy


def unregister_strategy(name: str) -> None:
    STRATEGIES.pop(name, None)


def ordered() -> list[Strategy]:
    return sorted(STRATEGIES.values(), key=lambda s: (s.order, s.name))


def _data_parallel(ctx: Context) -> str | None:
    if ctx.devices > 1:
        return f"{ctx.devices} devices: data parallelism is the multi-process substrate (cells split over the dp groups)."
    return None


def _feature_parallel(ctx: Context) -> str | None:
    if ctx.raised(HIGH_INPUT_DIMENSIONALITY):
        ev = ctx.signals[HIGH_INPUT_DIMENSIONALITY]["evidence"]
        return f"Hi-C has {ev['ratio']:g}x the features of {ev['next_largest']} (>= {ev['threshold']:g}): shard every stratum's features over the tp group."
    return None


def _chunked_attention(ctx: Context) -> str | None:
    if ctx.raised(ATTENTION_DECODER):
        return (
            "the Hi-C decoder uses local attention: evaluate its banded kernel in query chunks "
            "(transient scores O(C(2w+1)) per head instead of O(N(2w+1)); saved memory is O(N(2w+1)) either way)."
        )
    return None


def _key_first(ctx: Context) -> str | None:
    if ctx.raised(HIGH_INPUT_DIMENSIONALITY):
        return "many Hi-C features: gather each stratum's keys before the product, avoiding the batch x anchors intermediate."
    # Hi-C alone has no second modality to measure its dimensionality against, but its
    # decoder is the same bottleneck: key-first is then chosen when the peak needs it and
    # it lowers the peak (it saves |F_k| x D keys instead of n x D: less when strata are sparse)
    if ctx.hic_only and ctx.peak is not None:
        peak = ctx.peak(ctx.chosen, ctx.devices, 1, ctx.best_chunk)
        if peak > ctx.budget:
            with_it = ctx.peak([*ctx.chosen, KEY_FIRST_DECODE], ctx.devices, 1, ctx.best_chunk)
            if with_it < peak:
                return (
                    f"Hi-C is the only modality and the predicted peak {human_bytes(peak)} exceeds the budget "
                    f"{human_bytes(ctx.budget)}: gathering each stratum's keys before the product lowers it to {human_bytes(with_it)}."
                )
    return None


def _hidden_parallel(ctx: Context) -> str | None:
    if not ctx.raised(HEAVY_DECOMPOSITION) or ctx.peak is None:
        return None
    peak = ctx.peak(ctx.chosen, ctx.devices, 1, ctx.best_chunk)
    if peak > ctx.budget:
        n = ctx.signals[HEAVY_DECOMPOSITION]["evidence"]["attention_strata"]
        return (
            f"{n} attention strata keep their activations until backward and the predicted peak "
            f"{human_bytes(peak)} exceeds the budget {human_bytes(ctx.budget)} without it: split the decoder width D over the tp group."
        )
    return None


register_strategy(Strategy("S1", DATA_PARALLEL, "ranks take different cells; gradients averaged", 10, True, False, _data_parallel))
register_strategy(Strategy("S2", FEATURE_PARALLEL, "each tp rank owns a shard of every stratum's features", 20, True, True, _feature_parallel))
register_strategy(Strategy("S3", CHUNKED_ATTENTION, "local attention by query chunks against their windows", 30, False, False, _chunked_attention, "chunk"))
register_strategy(Strategy("S4", KEY_FIRST_DECODE, "u . key[F_k]^T instead of (u . key^T)[:, F_k]", 40, False, False, _key_first, "key_first"))
register_strategy(Strategy("S5", HIDDEN_PARALLEL, "the decoder width D split over the tp group", 50, True, True, _hidden_parallel))
