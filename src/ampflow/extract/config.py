"""Extraction settings: typed and validated, built from the config's ``extract`` section."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..base.errors import InputError, reject_unknown_keys
from ..io.fasta import DNA, PROTEIN, Alphabet, FastaPolicy

KINDS = ("esm2", "dnabert_s", "esmc")
ALPHABETS = {"esm2": PROTEIN, "dnabert_s": DNA, "esmc": PROTEIN}
# letters a model reads at most, when the config leaves max_length null: ESM-2 was
# trained on 1022 residues + 2 special tokens; DNABERT-S (ALiBi) has no hard limit, but
# attention memory grows with the square of the length; ESM C (rotary, no position
# table) has no hard limit either: 2046 letters + <cls>/<eos> = 2048 tokens (a hosted
# ESM C API, biolm.ai, takes up to 2048 letters; the training context is not checked here)
DEFAULT_MAX_LENGTH = {"esm2": 1022, "dnabert_s": 10000, "esmc": 2046}
# mean: over the sequence's own tokens (fair-esm's mean_representations); mean_special:
# special tokens too (DNABERT-S's model card: torch.mean(hidden_states[0], dim=0));
# bos: the first token (<cls> / [CLS], fair-esm's bos_representations)
POOLINGS = ("mean", "mean_special", "bos")
DEFAULT_POOLING = {"esm2": "mean", "dnabert_s": "mean_special", "esmc": "mean"}
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
        ``esm2`` (transformers ``EsmModel``), ``dnabert_s`` (our MosaicBERT/ALiBi code) or
        ``esmc`` (EvolutionaryScale's ESM C, our code: :mod:`~ampflow.extract.esmc`).
    source
        A local folder or a hub name present in the local hub cache (nothing is
        downloaded); for ``esmc`` also the weights file itself (``esmc_300m_2024_12_v0.pth``).
    tiny
        The workflow builds a tiny randomly initialised model of this kind into
        ``resources/models/{name}`` (demo and tests); ``source`` is then that folder.
    layer
        Hidden state(s) to pool, one int or a list computed in one pass: 0 = embeddings,
        n = after block n, negative counts from the end (-1 = the last block, after ESM-2's
        and ESM C's final layer norm). The first is the output's ``X``, the others ``obsm``.
    pooling
        One of, or a list of: ``mean`` over sequence tokens (no special tokens, no padding),
        ``mean_special`` (special tokens included), ``bos`` (the first token, ``<cls>`` /
        ``[CLS]``). Default: ``mean`` for ESM-2 (fair-esm's mean representation) and
        ESM C, ``mean_special`` for DNABERT-S (its model card's mean over every token).
    per_token
        Also write every sequence token's vector per layer (``{name}.{model}.tokens.h5``).
    max_length
        Letters per sequence the model reads (null: 1022 for ESM-2, 10000 for DNABERT-S,
        2046 for ESM C); longer ones follow ``extract.fasta.too_long``.
    tokens_per_batch
        Token budget of one batch (padded length x sequences) over length-sorted sequences.
    attention_per_batch
        Budget of attention elements per head (sequences x padded length squared) of one
        batch; null: the batch planner's default (see ``batching.plan_batches``).
    pack
        ``true``: a batch's sequences packed one after another, no padding, no mask,
        attention over the sequence boundaries (a variable-length kernel on CUDA), each
        with its own positions from 0; ``false``: padded batches. null (default): on for
        CUDA, off on the CPU (see ``models.Embedder`` for why).
    dtype
        Compute dtype on GPU: the weights are loaded in it (bfloat16/float16 halve the
        memory) and it runs under autocast; the CPU always uses float32.
    """

    kind: str
    source: str = ""
    tiny: bool = False
    layer: int | tuple = -1
    pooling: str | tuple | None = None
    per_token: bool = False
    max_length: int | None = None
    tokens_per_batch: int = 4096
    attention_per_batch: int | None = None
    dtype: str = "bfloat16"
    pack: bool | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InputError(f"must be one of {', '.join(KINDS)}", key="extract.models.kind", value=self.kind)
        if not self.source and not self.tiny:
            raise InputError("give a local folder or a cached hub name (or tiny: true)", key="extract.models.source", value=self.source)
        # lists from the config become tuples: a spec is hashable (models are kept per spec)
        for key in ("layer", "pooling"):
            if isinstance(getattr(self, key), list):
                object.__setattr__(self, key, tuple(getattr(self, key)))
        layers = self.layer if isinstance(self.layer, tuple) else [self.layer]
        if not layers or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers) or len(set(layers)) != len(layers):
            raise InputError("must be an integer or a list of different integers", key="extract.models.layer", value=self.layer)
        poolings = self.pooling if isinstance(self.pooling, tuple) else [self.pooling or DEFAULT_POOLING.get(self.kind)]
        if not poolings or any(p not in POOLINGS for p in poolings) or len(set(poolings)) != len(poolings):
            raise InputError(f"must be one of {', '.join(POOLINGS)} or a list of them", key="extract.models.pooling", value=self.pooling)
        if self.attention_per_batch is not None and self.attention_per_batch < 1:
            raise InputError("must be >= 1 (or null)", key="extract.models.attention_per_batch", value=self.attention_per_batch)
        if self.dtype not in DTYPES:
            raise InputError(f"must be one of {', '.join(DTYPES)}", key="extract.models.dtype", value=self.dtype)
        if self.max_length is not None and self.max_length < 1:
            raise InputError("must be >= 1 (or null)", key="extract.models.max_length", value=self.max_length)
        if self.pack not in (True, False, None):
            raise InputError("must be true, false or null", key="extract.models.pack", value=self.pack)
        if self.tokens_per_batch < 1:
            raise InputError("must be >= 1", key="extract.models.tokens_per_batch", value=self.tokens_per_batch)

    @property
    def alphabet(self) -> Alphabet:
        return ALPHABETS[self.kind]

    @property
    def layers(self) -> list[int]:
        """The layers asked for, as written (negative ones not yet resolved)."""
        return list(self.layer) if isinstance(self.layer, tuple) else [self.layer]

    @property
    def poolings(self) -> list[str]:
        if isinstance(self.pooling, tuple):
            return list(self.pooling)
        return [self.pooling or DEFAULT_POOLING[self.kind]]

    @property
    def letters(self) -> int:
        """The max_length in effect."""
        return self.max_length if self.max_length is not None else DEFAULT_MAX_LENGTH[self.kind]

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpec:
        if "kind" not in (d or {}):
            raise InputError("missing", key="extract.models.kind")
        return _from_dict(cls, d, "extract.models")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ExtractSettings:
    """How one model's job runs (config section ``extract`` without inputs/models).

    sequences_per_file
        Most sequences in one chunk of work; fewer when that leaves a worker idle.
    cache
        The content-addressed vector cache (``cache.py``); may be shared by several
        workflows and jobs. Empty: ``cache`` in the extraction's output folder.
    deadline, load_deadline
        Seconds a worker may go without progress (a finished batch; while loading, modules
        imported and bytes read) computing a chunk, or loading its model, before it is
        killed and replaced (its chunk goes back to the queue). Counted from its last
        progress, not its start: a slow load that keeps reading is never killed.
    """

    sequences_per_file: int = 10000
    fasta: FastaPolicy = field(default_factory=FastaPolicy)
    device: str = "auto"
    gpus: int = 1
    cpu_workers: int = 1
    threads: int = 1
    max_attempts: int = 2
    telemetry_interval: float = 5.0
    cache: str = ""
    deadline: float = 600.0
    load_deadline: float = 1800.0

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
        for key in ("deadline", "load_deadline"):
            if getattr(self, key) <= 0:
                raise InputError("must be > 0 (seconds)", key=f"extract.{key}", value=getattr(self, key))
        if self.telemetry_interval <= 0:
            raise InputError("must be > 0", key="extract.telemetry_interval", value=self.telemetry_interval)

    @property
    def uses_gpus(self) -> bool:
        """Whether the job's workers run on GPUs (``device`` not cpu and ``gpus`` > 0)."""
        return self.device != "cpu" and self.gpus > 0

    @property
    def job_threads(self) -> int:
        """Cores the job reserves: ``threads`` per worker, one worker per GPU or
        ``cpu_workers`` on the CPU."""
        return self.threads * max(self.gpus if self.uses_gpus else self.cpu_workers, 1)

    def gpu_job_resources(self, offer) -> dict:
        """The GPU partition and CPUs per GPU (a :class:`~ampflow.contract.allocation.ClusterOffer`)
        of a job that asks for GPUs; none otherwise."""
        if not self.uses_gpus:
            return {}
        out = {"cpus_per_gpu": offer.cpus_per_gpu}
        if offer.gpu_partition:
            out["slurm_partition"] = offer.gpu_partition
        return out

    @classmethod
    def from_dict(cls, d: dict | None) -> ExtractSettings:
        d = {k: v for k, v in (d or {}).items() if k not in ("inputs", "models")}
        return _from_dict(cls, d, "extract", fasta=FastaPolicy.from_dict)

    def to_dict(self) -> dict:
        return asdict(self)


def input_policy(settings: ExtractSettings, name: str, override: dict | None) -> FastaPolicy:
    """The FASTA policy of input ``name``: ``extract.fasta`` with the input's own
    ``policy`` keys over it."""
    if not override:
        return settings.fasta
    reject_unknown_keys(dict(override), FastaPolicy, f"extract.inputs.{name}.policy")
    return FastaPolicy(**{**settings.fasta.to_dict(), **override})


def output_files(name: str, model: str, spec: ModelSpec, policy: FastaPolicy) -> dict[str, str]:
    """The files one input gives with one model (names inside the extraction's output
    folder): h5ad, report, telemetry, progress, and windows / tokens when asked for."""
    out = {kind: f"{name}.{model}.{suffix}" for kind, suffix in OUTPUT_SUFFIXES.items()}
    if policy.too_long == "window":
        out["windows"] = f"{name}.{model}.windows.h5ad"
    if spec.per_token:
        out["tokens"] = f"{name}.{model}.tokens.h5"
    return out


OUTPUT_SUFFIXES = {"h5ad": "h5ad", "report": "report.tsv", "telemetry": "telemetry.jsonl", "progress": "progress.jsonl"}
