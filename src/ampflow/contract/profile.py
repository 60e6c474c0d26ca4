"""The profile's contract (``profile.json``): the typed :class:`Profile` its readers see,
its ``train`` section, the config it was made with, its hash, and reading and writing it.

:func:`ampflow.amp.profile.profile_data` builds a profile (a JSON object) from a data
folder's metadata; the signals, the memory and cost models and the diagnosis read it as a
:class:`Profile` (:func:`as_profile`). What they need of the model and training settings
is read here, with the defaults of :mod:`.config`, so no stage restates a default.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields, replace

from ..base.atomic import write_text_atomic
from ..base.errors import InputError, read_fields, read_json
from .config import ModelConfig, TrainConfig

PROFILE_VERSION = 1


@dataclass(frozen=True)
class ProfileTrain:
    """What the memory model needs of the ``train`` section (the optimizer is Adam)."""

    batch_size: int = TrainConfig.batch_size
    dtype: str = TrainConfig.dtype
    optimizer: str = "adam"
    cross_reconstruction: bool = False
    #: the Hi-C encoder reads a thinned copy of the batch (``train.hic_thinned: encoder``)
    hic_encoder_copy: bool = False

    @classmethod
    def from_config(cls, train: TrainConfig) -> ProfileTrain:
        return cls(train.batch_size, train.dtype, "adam", train.cross_reconstruction, train.encoder_copy)

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


def model_config(profile: Profile | dict) -> ModelConfig:
    """The model settings a profile was made with."""
    return profile.model if isinstance(profile, Profile) else ModelConfig.from_dict(profile.get("model"))


def train_settings(profile: Profile | dict) -> ProfileTrain:
    """The training settings a profile was made with."""
    return profile.train if isinstance(profile, Profile) else ProfileTrain.from_dict(profile.get("train"))


@dataclass(frozen=True)
class ModalityProfile:
    """One modality of a profile (``modalities.<name>``), as the h5ad metadata gave it.

    A count the profile does not hold is None (a hand-written profile may give only some):
    each reader says what it takes in its place. The Hi-C fields are None for RNA.

    Attributes
    ----------
    n_features, n_cells, nnz : int or None
        Features (genes, or Hi-C features over all strata), cells and stored values.
    prob_model, x_encoding : str or None
        The likelihood the decoder uses and the matrix's encoding.
    sources : dict or None
        Which values were inferred, and from what.
    n_strata, n_anchors : int or None
        Hi-C: distance strata and anchors (bins) per stratum.
    features_per_stratum : tuple of int or None
        Hi-C: features of each stratum.
    attention, window, heads : bool, int, int or None
        Hi-C: the decoder's settings the profile was made with.
    resolution : int or None
        Hi-C: bin size in bp.
    """

    n_features: int | None = None
    n_cells: int | None = None
    nnz: int | None = None
    prob_model: str | None = None
    x_encoding: str | None = None
    sources: dict | None = None
    n_strata: int | None = None
    n_anchors: int | None = None
    features_per_stratum: tuple[int, ...] | None = None
    attention: bool | None = None
    window: int | None = None
    heads: int | None = None
    resolution: int | None = None

    @classmethod
    def from_dict(cls, d, name: str) -> ModalityProfile:
        ints = dict.fromkeys(("n_features", "n_cells", "nnz", "n_strata", "n_anchors", "window", "heads", "resolution"), int)
        return read_fields(cls, d, f"modalities.{name}", features_per_stratum=lambda v: tuple(int(x) for x in v), sources=dict,
                           attention=bool, prob_model=str, x_encoding=str, **ints)  # fmt: skip


@dataclass(frozen=True)
class Profile:
    """A profile as its readers see it (:func:`ampflow.amp.profile.profile_data` writes it).

    Attributes
    ----------
    modalities : dict of str to ModalityProfile
        ``rna`` and/or ``hic``, in the file's order.
    n_nodes, n_edges : int
        The guidance graph's size (0 when the profile gives none).
    batch_key : str or None
        The model's ``batch_key``.
    n_batches : int
        The batches the decoders are conditioned on (0: none).
    model : ModelConfig
        The model settings it was made with.
    train : ProfileTrain
        The training settings the memory model needs.
    hash : str
        :func:`profile_hash` of the JSON object it was read from (what a plan records).
    """

    modalities: dict[str, ModalityProfile] = field(default_factory=dict)
    n_nodes: int = 0
    n_edges: int = 0
    batch_key: str | None = None
    n_batches: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    train: ProfileTrain = field(default_factory=ProfileTrain)
    hash: str = field(default="", compare=False)

    @property
    def rna(self) -> ModalityProfile | None:
        return self.modalities.get("rna")

    @property
    def hic(self) -> ModalityProfile | None:
        return self.modalities.get("hic")

    def with_batch_size(self, batch_size: int) -> Profile:
        """The same profile with ``train.batch_size`` set (the host-memory check weighs others)."""
        return replace(self, train=replace(self.train, batch_size=int(batch_size)))

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        """From ``profile.json``'s object: ``modalities``, ``model`` and ``train`` are required
        (a missing one is an InputError naming it); other sections take their defaults.
        The sections the profile adds for the reader (``signals``, ``memory``, ``inputs``,
        ``data_dir``, ``version``) are not read."""
        if not isinstance(d, dict):
            raise InputError("a profile must be a JSON object", value=type(d).__name__)
        for key in ("modalities", "model", "train"):
            if key not in d:
                raise InputError("profile lacks a required section", key=key)
        mods = d["modalities"]
        if not isinstance(mods, dict):
            raise InputError("must be a JSON object", key="modalities", value=type(mods).__name__)
        graph, batches = d.get("graph") or {}, d.get("batches") or {}
        try:
            counts = {"n_nodes": int(graph.get("n_nodes", 0)), "n_edges": int(graph.get("n_edges", 0)),
                      "n_batches": int(batches.get("n_batches", 0))}  # fmt: skip
        except (TypeError, ValueError, AttributeError) as e:
            raise InputError(f"malformed graph or batches section ({type(e).__name__}: {e})", key="graph/batches") from None
        return cls(
            modalities={name: ModalityProfile.from_dict(m, name) for name, m in mods.items()},
            batch_key=batches.get("key"),
            model=ModelConfig.from_dict(d.get("model")),
            train=ProfileTrain.from_dict(d.get("train")),
            hash=profile_hash(d),
            **counts,
        )


def as_profile(profile: Profile | dict) -> Profile:
    """``profile`` as a :class:`Profile` (a JSON object is read with :meth:`Profile.from_dict`)."""
    return profile if isinstance(profile, Profile) else Profile.from_dict(profile)


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
    """``profile.json``'s object; a missing file or bad JSON is an InputError naming it."""
    return read_json(path, "profile")
