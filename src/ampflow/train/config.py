"""Training settings: typed, validated, built from the config's ``train`` section."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from ..io.errors import InputError
from ..model.paired import LossWeights


@dataclass(frozen=True)
class StageConfig:
    """One training stage: epochs, learning rate and loss weights."""

    epochs: int
    lr: float
    weights: LossWeights

    @classmethod
    def from_dict(cls, d: dict, key: str) -> "StageConfig":
        d = dict(d)
        w = d.pop("weights", {}) or {}
        unknown = sorted(set(d) - {"epochs", "lr"})
        if unknown:
            raise InputError("unknown key(s); known: epochs, lr, weights", key=key, value=unknown)
        known_w = {f.name for f in fields(LossWeights)}
        if set(w) - known_w:
            raise InputError(f"unknown loss weight(s); known: {sorted(known_w)}", key=f"{key}.weights", value=sorted(set(w) - known_w))
        cfg = cls(epochs=int(d.get("epochs", 0)), lr=float(d.get("lr", 1e-3)), weights=LossWeights(**w))
        if cfg.epochs < 0 or cfg.lr <= 0:
            raise InputError("epochs must be >= 0 and lr > 0", key=key, value=d)
        return cfg


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run (config section ``train``)."""

    seed: int = 0
    batch_size: int = 32
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    threads: int = 1
    device: str = "auto"
    dtype: str = "float32"
    gpus: int = 1
    pretrain: StageConfig = field(default_factory=lambda: StageConfig(300, 2e-3, LossWeights()))
    finetune: StageConfig = field(default_factory=lambda: StageConfig(60, 5e-4, LossWeights()))

    def __post_init__(self):
        if self.batch_size < 2:
            raise InputError("must be >= 2 (batch normalisation needs two cells)", key="train.batch_size", value=self.batch_size)
        if self.checkpoint_every < 1 or self.keep_checkpoints < 1 or self.threads < 1:
            raise InputError("checkpoint_every, keep_checkpoints and threads must be >= 1", key="train", value=asdict(self))
        if self.device not in ("auto", "cpu", "cuda"):
            raise InputError("must be auto, cpu or cuda", key="train.device", value=self.device)
        if self.dtype not in ("float32", "float64"):
            raise InputError("must be float32 or float64", key="train.dtype", value=self.dtype)

    @property
    def stages(self) -> list[tuple[str, StageConfig]]:
        return [("pretrain", self.pretrain), ("finetune", self.finetune)]

    @classmethod
    def from_dict(cls, d: dict | None) -> "TrainConfig":
        d = dict(d or {})
        stages = {k: StageConfig.from_dict(d.pop(k), f"train.{k}") for k in ("pretrain", "finetune") if k in d}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InputError(f"unknown key(s); known: {sorted(known)}", key="train", value=unknown)
        return cls(**d, **stages)

    def to_dict(self) -> dict:
        return asdict(self)
