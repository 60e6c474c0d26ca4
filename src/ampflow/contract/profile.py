"""The profile's contract (``profile.json``): its ``train`` section, the config it was made
with, its hash, and reading and writing it.

:func:`ampflow.amp.profile.profile_data` builds a profile from a data folder's metadata;
the signals, the memory model and the diagnosis read it. What they need of the model and
training settings is read here, with the defaults of :mod:`.config`, so no stage restates
a default.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields

from ..base.atomic import write_text_atomic
from ..base.errors import InputError, read_json
from .config import ModelConfig, TrainConfig

PROFILE_VERSION = 1


@dataclass(frozen=True)
class ProfileTrain:
    """What the memory model needs of the ``train`` section (the optimizer is Adam)."""

    batch_size: int = TrainConfig.batch_size
    dtype: str = TrainConfig.dtype
    optimizer: str = "adam"
    cross_reconstruction: bool = False

    @classmethod
    def from_config(cls, train: TrainConfig) -> ProfileTrain:
        return cls(train.batch_size, train.dtype, "adam", train.cross_reconstruction)

    @classmethod
    def from_dict(cls, d: dict | None) -> ProfileTrain:
        """From a profile's ``train`` section; keys left out take their defaults."""
        d = dict(d or {})
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise InputError("unknown key(s) in the profile's train section", key="train", value=unknown)
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)


def model_config(profile: dict) -> ModelConfig:
    """The model settings a profile was made with."""
    return ModelConfig.from_dict(profile.get("model"))


def train_settings(profile: dict) -> ProfileTrain:
    """The training settings a profile was made with."""
    return ProfileTrain.from_dict(profile.get("train"))


def canonical_json(profile: dict) -> str:
    """The profile as compact JSON with sorted keys: the form that is hashed."""
    return json.dumps(profile, sort_keys=True, separators=(",", ":"))


def profile_hash(profile: dict) -> str:
    """SHA-256 (hex) of :func:`canonical_json`; equal profiles give equal hashes."""
    return hashlib.sha256(canonical_json(profile).encode()).hexdigest()


def write_profile(path, profile: dict) -> None:
    """Write ``profile.json`` atomically (indent 2, sorted keys)."""
    write_text_atomic(path, json.dumps(profile, indent=2, sort_keys=True) + "\n")


def read_profile(path) -> dict:
    """``profile.json``; a missing file or bad JSON is an InputError naming it."""
    return read_json(path, "profile")
