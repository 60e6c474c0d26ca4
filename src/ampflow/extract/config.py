"""Extraction settings: typed and validated, built from the config's ``extract`` section."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..io.errors import InputError, reject_unknown_keys
from ..io.fasta import DNA, PROTEIN, Alphabet, FastaPolicy

KINDS = ("esm2", "dnabert_s")
ALPHABETS = {"esm2": PROTEIN, "dnabert_s": DNA}
# letters a model reads at most, when the config leaves max_length null: ESM-2 was
# trained on 1022 residues + 2 special tokens; DNABERT-S (ALiBi) has no hard limit, but
# attention memory grows with the square of the length
DEFAULT_MAX_LENGTH = {"esm2": 1022, "dnabert_s": 10000}
POOLINGS = ("mean", "mean_special")
DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


def _from_dict(cls, d: dict | None, key: str, **nested):
    d = dict(d or {})
    reject_unknown_keys(d, cls, key)
    for name, build in nested.items():
        if name in d:
            d[name] = build(d[name])
    return cls(**d)


@dataclass(frozen=True)
class ModelSpec:
    """One feature model (an entry of ``extract.models``).

    kind
        ``esm2`` (transformers ``EsmModel``) or ``dnabert_s`` (our MosaicBERT/ALiBi code).
    source
        A local folder or a hub name present in the local hub cache (nothing is downloaded).
    tiny
        The workflow builds a tiny randomly initialised model of this kind into
        ``resources/models/{name}`` (demo and tests); ``source`` is then that folder.
    layer
        Hidden state to pool: 0 = embeddings, n = after block n, negative counts from the
        end (-1 = the last block, after ESM-2's final layer norm).
    pooling
        ``mean`` over sequence tokens (no special tokens, no padding) or ``mean_special``
        (special tokens included, as DNABERT-S's model card does).
    max_length
        Letters per sequence the model reads (null: 1022 for ESM-2, 10000 for DNABERT-S);
        longer ones follow ``extract.fasta.too_long``.
    tokens_per_batch
        Token budget of one batch (padded length x sequences) over length-sorted sequences.
    dtype
        Compute dtype on GPU (autocast for bfloat16/float16); the CPU always uses float32.
    """

    kind: str
    source: str = ""
    tiny: bool = False
    layer: int = -1
    pooling: str = "mean"
    max_length: int | None = None
    tokens_per_batch: int = 4096
    dtype: str = "bfloat16"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InputError(f"must be one of {', '.join(KINDS)}", key="extract.models.kind", value=self.kind)
        if not self.source and not self.tiny:
            raise InputError("give a local folder or a cached hub name (or tiny: true)", key="extract.models.source", value=self.source)
        if self.pooling not in POOLINGS:
            raise InputError(f"must be one of {', '.join(POOLINGS)}", key="extract.models.pooling", value=self.pooling)
        if self.dtype not in DTYPES:
            raise InputError(f"must be one of {', '.join(DTYPES)}", key="extract.models.dtype", value=self.dtype)
        if self.max_length is not None and self.max_length < 1:
            raise InputError("must be >= 1 (or null)", key="extract.models.max_length", value=self.max_length)
        if self.tokens_per_batch < 1:
            raise InputError("must be >= 1", key="extract.models.tokens_per_batch", value=self.tokens_per_batch)

    @property
    def alphabet(self) -> Alphabet:
        return ALPHABETS[self.kind]

    @property
    def letters(self) -> int:
        """The max_length in effect."""
        return self.max_length if self.max_length is not None else DEFAULT_MAX_LENGTH[self.kind]

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        if "kind" not in (d or {}):
            raise InputError("missing", key="extract.models.kind")
        return _from_dict(cls, d, "extract.models")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ExtractSettings:
    """How one (FASTA, model) job runs (config section ``extract`` without inputs/models)."""

    sequences_per_file: int = 10000
    fasta: FastaPolicy = field(default_factory=FastaPolicy)
    device: str = "auto"
    gpus: int = 1
    cpu_workers: int = 1
    threads: int = 1
    max_attempts: int = 2
    telemetry_interval: float = 5.0

    def __post_init__(self):
        if self.sequences_per_file < 1:
            raise InputError("must be >= 1", key="extract.sequences_per_file", value=self.sequences_per_file)
        if self.device not in DEVICES:
            raise InputError(f"must be one of {', '.join(DEVICES)}", key="extract.device", value=self.device)
        for key in ("cpu_workers", "threads", "max_attempts"):
            if getattr(self, key) < 1:
                raise InputError("must be >= 1", key=f"extract.{key}", value=getattr(self, key))
        if self.gpus < 0:
            raise InputError("must be >= 0", key="extract.gpus", value=self.gpus)
        if self.telemetry_interval <= 0:
            raise InputError("must be > 0", key="extract.telemetry_interval", value=self.telemetry_interval)

    @classmethod
    def from_dict(cls, d: dict | None) -> "ExtractSettings":
        d = {k: v for k, v in (d or {}).items() if k not in ("inputs", "models")}
        return _from_dict(cls, d, "extract", fasta=FastaPolicy.from_dict)

    def to_dict(self) -> dict:
        return asdict(self)
