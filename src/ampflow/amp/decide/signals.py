"""Bottleneck signals: named tests on a profile, each with the evidence it used.

A signal is added by registering it (:func:`register_signal`); diagnose reads the
registry and never names signals itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...contract.profile import ModalityProfile, Profile, as_profile

HIGH_INPUT_DIMENSIONALITY = "HIGH_INPUT_DIMENSIONALITY"
ATTENTION_DECODER = "ATTENTION_DECODER"
HEAVY_DECOMPOSITION = "HEAVY_DECOMPOSITION"


@dataclass(frozen=True)
class Signal:
    """``test(profile, settings) -> (raised, evidence)``: ``profile`` a
    :class:`~ampflow.contract.profile.Profile`; evidence is a JSON-able dict."""

    name: str
    summary: str
    test: Callable[[Profile, dict], tuple[bool, dict]]


SIGNALS: dict[str, Signal] = {}
DEFAULT_SETTINGS = {"dimensionality_ratio": 10.0}


def register_signal(signal: Signal) -> Signal:
    if signal.name in SIGNALS:
        raise ValueError(f"signal {signal.name} is registered already")
    SIGNALS[signal.name] = signal
    return signal


def unregister_signal(name: str) -> None:
    SIGNALS.pop(name, None)


def _strata(hic: ModalityProfile) -> int:
    """The Hi-C decoder's strata; one where the profile gives none."""
    return 1 if hic.n_strata is None else hic.n_strata


def _high_input(profile: Profile, settings: dict) -> tuple[bool, dict]:
    hic = profile.hic
    if hic is None:
        return False, {"reason": "no Hi-C modality"}
    others = {m: v.n_features for m, v in profile.modalities.items() if m != "hic"}
    if not others:
        # Hi-C only: no ratio to take; S4 then follows the predicted peak (strategies.py)
        return False, {"hic_features": hic.n_features, "reason": "no other modality"}
    other, n_other = max(others.items(), key=lambda kv: (kv[1], kv[0]))
    ratio = hic.n_features / max(n_other, 1)
    threshold = float(settings.get("dimensionality_ratio", DEFAULT_SETTINGS["dimensionality_ratio"]))
    return ratio >= threshold, {
        "hic_features": hic.n_features,
        "next_largest": other,
        "next_largest_features": n_other,
        "ratio": round(ratio, 4),
        "threshold": threshold,
    }


def _attention(profile: Profile, settings: dict) -> tuple[bool, dict]:
    hic = profile.hic
    if hic is None:
        return False, {"reason": "no Hi-C modality"}
    on = bool(hic.attention) and _strata(hic) > 1
    return on, {"attention": bool(hic.attention), "window": hic.window, "n_strata": hic.n_strata}


def _heavy(profile: Profile, settings: dict) -> tuple[bool, dict]:
    hic = profile.hic
    if hic is None:
        return False, {"reason": "no Hi-C modality"}
    blocks = (_strata(hic) - 1) if hic.attention else 0
    return blocks > 1, {"attention_strata": blocks, "n_strata": hic.n_strata}


register_signal(Signal(HIGH_INPUT_DIMENSIONALITY, "Hi-C features / next-largest modality's features >= threshold", _high_input))
register_signal(Signal(ATTENTION_DECODER, "the Hi-C decoder uses attention", _attention))
register_signal(Signal(HEAVY_DECOMPOSITION, "the decoder has more than one attention stratum", _heavy))


def evaluate_signals(profile: Profile | dict, settings: dict | None = None) -> dict:
    """``{name: {"raised": bool, "summary": str, "evidence": {...}}}`` for every registered signal."""
    settings = {**DEFAULT_SETTINGS, **(settings or {})}
    profile = as_profile(profile)
    out = {}
    for name in sorted(SIGNALS):
        sig = SIGNALS[name]
        raised, evidence = sig.test(profile, settings)
        out[name] = {"raised": bool(raised), "summary": sig.summary, "evidence": evidence}
    return out
