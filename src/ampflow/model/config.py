"""Model hyper-parameters: one typed dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from ..io.errors import InputError


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and switches of the paired model (config section ``model``).

    ``decoder_dim`` is the Hi-C decoder's hidden width D (None: the latent size); it is
    the dimension the hidden-parallel strategy shards. ``chunk`` > 0 turns on chunked
    local attention (S3) with query chunks of that many anchors; ``key_first`` the
    key-first decode (S4). Both give the same numbers as the naive forms.
    """

    latent_dim: int = 32
    hidden_dim: int = 256
    decoder_dim: int | None = None
    heads: int = 4
    window: int = 8
    attention: bool = True
    chunk: int = 0
    key_first: bool = False
    ffn_mult: int = 2
    dropout: float = 0.1
    neg_samples: int = 5
    graph_batch: int = 4096

    def __post_init__(self):
        for name in ("latent_dim", "hidden_dim", "heads", "ffn_mult", "graph_batch"):
            if getattr(self, name) < 1:
                raise InputError("must be >= 1", key=f"model.{name}", value=getattr(self, name))
        for name in ("window", "chunk", "neg_samples"):
            if getattr(self, name) < 0:
                raise InputError("must be >= 0", key=f"model.{name}", value=getattr(self, name))
        if not 0 <= self.dropout < 1:
            raise InputError("must be in [0, 1)", key="model.dropout", value=self.dropout)
        if self.D % self.heads:
            raise InputError(f"decoder width {self.D} is not divisible by heads", key="model.heads", value=self.heads)

    @property
    def D(self) -> int:
        return self.decoder_dim or self.latent_dim

    @classmethod
    def from_dict(cls, d: dict | None) -> "ModelConfig":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InputError(f"unknown key(s); known: {sorted(known)}", key="model", value=unknown)
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)
