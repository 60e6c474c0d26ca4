"""The config sections ``model``, ``train`` and ``evaluate`` as typed dataclasses, validated on construction.

Torch-free, so that the profile and the diagnosis (which never build a model) read the
same defaults and validation as the trainer does. The Snakemake schema documents the same
defaults; ``tests/test_config.py`` holds the two together.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from ..base.errors import InputError, reject_unknown_keys

#: ``train.clip_grad_norm``'s value for a bound that follows the run's own norms
#: (:class:`~ampflow.parallel.clip.ZScoreBound`)
CLIP_ZSCORE = "zscore"
#: ``train.hic_thinned``: what reads the thinned Hi-C counts (the encoder and the
#: likelihood, or the encoder alone).
HIC_THINNED = ("both", "encoder")


def batch_names(values) -> list[str]:
    """The batches a model is conditioned on, given its cells' batch values: the
    distinct values (as text, sorted) when there are two or more, else none. The one
    rule of the trainer and of the profile that plans for it."""
    names = sorted({str(v) for v in values})
    return names if len(names) >= 2 else []


#: ``model.hic_band_weight``: the weight of each stratum in the Hi-C encoder's input
#: (:class:`ampflow.model.encoders.HiCInput`): the training cells' mean count per feature
#: of the stratum, its square root, or none (every stratum alike).
HIC_BAND_WEIGHTS = ("mean", "sqrt", "none")
#: ``model.hic_transform``: what the Hi-C encoder's input does to the weighed counts
#: (:class:`ampflow.model.encoders.HiCInput`): ``log1p``, or nothing (``linear``).
HIC_TRANSFORMS = ("linear", "log1p")
#: ``model.hic_likelihood``: the Hi-C features the likelihood scores: those of the strata
#: the encoder reads (``reach``: ``hic_diagonal`` and the farthest stratum), or every one.
HIC_LIKELIHOODS = ("reach", "all")


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and switches of the paired model (config section ``model``).

    ``private_dim`` is how many trailing latent dimensions the alignment leaves to one
    modality (None: a quarter of ``latent_dim``); see :mod:`ampflow.train.embeddings`.
    ``decoder_dim`` is the Hi-C decoder's hidden width D (None: the latent size); it is
    the dimension the hidden-parallel strategy shards. ``chunk`` > 0 turns on chunked
    local attention (S3) with query chunks of that many anchors; ``key_first`` the
    key-first decode (S4). Both give the same numbers as the naive forms.
    ``batch_key`` is the cell-sheet column naming each cell's batch (sequencing run,
    donor, library): with two or more batches the decoders learn a bias per feature
    and batch, which the encoders never see, so the latent is left what the batches
    share and cells of a batch training never saw embed all the same (as scGLUE's
    decoders do). A data file without the column, or with one batch, trains without it;
    None turns it off.
    ``hic_band_weight``, ``hic_diagonal``, ``hic_transform``, ``hic_max_stratum`` and
    ``hic_pcs`` say how the Hi-C encoder weighs the strata, whether it reads stratum 0,
    whether it takes the log of what it reads, the farthest stratum it reads (None: all)
    and on how many of the training cells' principal axes it projects its input (0:
    none; see :class:`~ampflow.model.encoders.HiCInput`). ``hic_max_distance`` gives that
    reach in base pairs instead, the same at every resolution a workflow trains:
    :meth:`at_resolution` turns it into the farthest stratum of a configuration's data
    (training does, so ``model.pt`` keeps the stratum); ``hic_max_stratum``, when set,
    is the reach and ``hic_max_distance`` is dropped. ``hic_likelihood`` says which
    features the Hi-C likelihood scores: ``reach``, those of the strata the encoder reads
    (:meth:`hic_strata_read`), or ``all``; the decoder decodes every stratum either way.
    """

    latent_dim: int = 12
    private_dim: int | None = None
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
    batch_key: str | None = "batch"
    hic_band_weight: str = "mean"
    hic_diagonal: bool = False
    hic_transform: str = "linear"
    hic_max_stratum: int | None = None
    hic_max_distance: int | None = 3_000_000
    hic_pcs: int = 20
    hic_likelihood: str = "reach"

    def __post_init__(self):
        if self.hic_transform not in HIC_TRANSFORMS:
            raise InputError(f"must be one of {', '.join(HIC_TRANSFORMS)}", key="model.hic_transform", value=self.hic_transform)
        if self.hic_band_weight not in HIC_BAND_WEIGHTS:
            raise InputError(f"must be one of {', '.join(HIC_BAND_WEIGHTS)}", key="model.hic_band_weight", value=self.hic_band_weight)
        if not isinstance(self.hic_diagonal, bool):
            raise InputError("must be true or false", key="model.hic_diagonal", value=self.hic_diagonal)
        if self.hic_max_stratum is not None and (
            isinstance(self.hic_max_stratum, bool) or not isinstance(self.hic_max_stratum, int) or self.hic_max_stratum < 0
        ):
            raise InputError("must be a stratum number >= 0 or null", key="model.hic_max_stratum", value=self.hic_max_stratum)
        d = self.hic_max_distance
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 0):
            raise InputError("must be a distance in base pairs >= 0 or null", key="model.hic_max_distance", value=d)
        if d is not None and self.hic_max_stratum is not None:
            # a stratum set is the reach: a config that sets hic_max_stratum keeps it under
            # the default reach in base pairs, which the schema fills in beside it
            object.__setattr__(self, "hic_max_distance", None)
        if isinstance(self.hic_pcs, bool) or not isinstance(self.hic_pcs, int) or self.hic_pcs < 0:
            raise InputError("must be an integer >= 0 (0: no projection)", key="model.hic_pcs", value=self.hic_pcs)
        if self.hic_likelihood not in HIC_LIKELIHOODS:
            raise InputError(f"must be one of {', '.join(HIC_LIKELIHOODS)}", key="model.hic_likelihood", value=self.hic_likelihood)
        if self.batch_key is not None and (not isinstance(self.batch_key, str) or not self.batch_key):
            raise InputError("must be a column name or null", key="model.batch_key", value=self.batch_key)
        for name in ("latent_dim", "hidden_dim", "heads", "ffn_mult", "graph_batch"):
            if getattr(self, name) < 1:
                raise InputError("must be >= 1", key=f"model.{name}", value=getattr(self, name))
        for name in ("window", "chunk", "neg_samples"):
            if getattr(self, name) < 0:
                raise InputError("must be >= 0", key=f"model.{name}", value=getattr(self, name))
        if self.private_dim is not None and not 0 <= self.private_dim < self.latent_dim:
            raise InputError(f"must be in [0, latent_dim = {self.latent_dim})", key="model.private_dim", value=self.private_dim)
        if not 0 <= self.dropout < 1:
            raise InputError("must be in [0, 1)", key="model.dropout", value=self.dropout)
        if self.D % self.heads:
            raise InputError(f"decoder width {self.D} is not divisible by heads", key="model.heads", value=self.heads)

    @property
    def D(self) -> int:
        return self.decoder_dim or self.latent_dim

    def hic_strata_read(self, n_strata: int) -> tuple[int, int]:
        """The first and last stratum (inclusive) of ``n_strata`` the Hi-C encoder reads:
        from 0 with ``hic_diagonal``, else 1, to ``hic_max_stratum`` (None: the last). A
        reach still in base pairs (:meth:`at_resolution` not applied) reads them all."""
        last = n_strata - 1 if self.hic_max_stratum is None else min(self.hic_max_stratum, n_strata - 1)
        return (0 if self.hic_diagonal else 1), last

    def hic_scored_strata(self, n_strata: int) -> tuple[int, int]:
        """The first and last stratum (inclusive) the Hi-C likelihood scores
        (``hic_likelihood``): those the encoder reads, or all ``n_strata``."""
        return self.hic_strata_read(n_strata) if self.hic_likelihood == "reach" else (0, n_strata - 1)

    def at_resolution(self, resolution: int | None, path=None) -> ModelConfig:
        """These settings for data binned at ``resolution`` bp: ``hic_max_distance`` as
        the farthest stratum within it (``distance // resolution``: stratum k lies k bins
        off the diagonal); unchanged without ``hic_max_distance``. Data of no known
        resolution cannot take a reach in base pairs: an error naming ``path``."""
        if self.hic_max_distance is None:
            return self
        if not resolution:
            raise InputError("is a reach in base pairs, but the data's resolution is not known (uns['ampflow']['resolution'])",
                             path=path, key="model.hic_max_distance", value=self.hic_max_distance)  # fmt: skip
        return replace(self, hic_max_distance=None, hic_max_stratum=int(self.hic_max_distance) // int(resolution))

    @property
    def private(self) -> int:
        """The trailing latent dimensions the alignment leaves alone (``private_dim``;
        None: a quarter of the latent)."""
        return self.latent_dim // 4 if self.private_dim is None else self.private_dim

    @property
    def shared_dim(self) -> int:
        """The leading latent dimensions that the alignment pulls together."""
        return self.latent_dim - self.private

    @classmethod
    def from_dict(cls, d: dict | None) -> ModelConfig:
        d = dict(d or {})
        reject_unknown_keys(d, cls, "model")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LossWeights:
    """Weights of the loss terms (one set per training stage).

    ``kl`` weighs the RNA cell latent's KL term, ``hic_kl`` the Hi-C cell latent's. The
    Hi-C one is 5 by default. At 1 (the plain ELBO) the Hi-C latents of training cells
    came to carry each cell's own noise, within-type spread three times that of cells
    the model never saw, and k-means over all cells fell below a PCA of the same
    contacts on real cortex cells; at 50 the latent collapses (``scripts/bench_science.py``,
    ablation ``hic_kl1``). On all 400 labelled cells of that source
    (``scripts/bench_science.py --lee``) 20, the default before, left the latent about two
    effective dimensions, and 5 scored higher on new batches and held-out cells; on 174
    of them the two are level.
    """

    kl: float = 1.0
    hic_kl: float = 5.0
    graph: float = 0.02
    align: float = 20.0
    cross: float = 0.0


@dataclass(frozen=True)
class StageConfig:
    """One training stage: epochs, learning rate and loss weights."""

    epochs: int
    lr: float
    weights: LossWeights

    @classmethod
    def from_dict(cls, d: dict, key: str) -> StageConfig:
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
class EarlyStoppingConfig:
    """When training stops before its epochs are spent (``train.early_stopping``).

    ``validation`` is the share of the training cells (a fixed subset drawn from
    ``train.seed``) that no batch contains and whose loss is computed after every epoch;
    a stage stops once that loss has not improved on its best by more than
    ``min_delta`` (relative) for ``patience`` epochs, and the best epoch's weights are
    restored. ``patience: 0`` turns it off (every epoch of every stage runs, and no cell
    is set aside). The held-out cells of ``evaluate.holdout`` are never among them.
    """

    validation: float = 0.1
    # 30, not 10: a loss spike (a training cell's posterior width collapsing for a few
    # steps) takes 10 to 20 epochs to recover from, and a stage that stopped inside it
    # kept the weights from before it, a model a fifth of the way trained (real cortex
    # cells, scripts/bench_science.py: ablation patience10)
    patience: int = 30
    min_delta: float = 1e-4

    def __post_init__(self):
        v = self.validation
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
            raise InputError("must be a number in (0, 1)", key="train.early_stopping.validation", value=v)
        if isinstance(self.patience, bool) or not isinstance(self.patience, int) or self.patience < 0:
            raise InputError("must be an integer >= 0 (0: off)", key="train.early_stopping.patience", value=self.patience)
        if isinstance(self.min_delta, bool) or not isinstance(self.min_delta, (int, float)) or self.min_delta < 0:
            raise InputError("must be a number >= 0", key="train.early_stopping.min_delta", value=self.min_delta)

    @property
    def on(self) -> bool:
        return self.patience > 0

    @classmethod
    def from_dict(cls, d: dict | None) -> EarlyStoppingConfig:
        d = dict(d or {})
        reject_unknown_keys(d, cls, "train.early_stopping")
        return cls(**d)


#: Bytes per element of the dtypes a run may train in (``train.dtype``).
TRAIN_DTYPE_BYTES = {"float32": 4, "float64": 8}


#: ``train.threads`` that takes the plan's figure (:attr:`ampflow.contract.plan.Plan.threads`).
AUTO_THREADS = "auto"
#: ``amp.devices`` that plans for the GPUs the devices record lists (:func:`amp_devices`).
AUTO_DEVICES = "auto"


def check_amp_devices(value) -> int | str:
    """``amp.devices`` checked: an integer >= 1, or ``"auto"`` (an integer given as text,
    as on a command line, becomes the integer)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if value == AUTO_DEVICES or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise InputError(f"must be an integer >= 1 or {AUTO_DEVICES!r} (the visible GPUs)", key="amp.devices", value=value)


def amp_devices(value, host: dict | None) -> int:
    """The devices a plan is made for: ``amp.devices`` as given, or for ``"auto"`` the
    GPUs ``host`` lists (``devices.json`` of :func:`ampflow.devices.probe_devices`: the
    GPUs the devices job saw, which are those the train job gets). ``auto`` plans for
    GPUs only: with none listed it is an InputError naming the key and the fix, before
    anything is planned, not a plan for one CPU process."""
    value = check_amp_devices(value)
    if value != AUTO_DEVICES:
        return int(value)
    host = host or {}
    gpus = len(host.get("devices") or [])
    if gpus:
        return gpus
    seen = f"NVML: {host['nvml']}; " if host.get("nvml") else ""
    raise InputError(
        f"'auto' plans for the visible GPUs and none is visible ({seen}CUDA_VISIBLE_DEVICES="
        f"{host.get('cuda_visible_devices')}); run it where GPUs are, or give the processes as a number "
        f"and train them on CPU cores (train.device: cpu, as config/demo.yaml does)",
        key="amp.devices", value=AUTO_DEVICES,
    )  # fmt: skip


def gpu_settings(config: dict) -> list[tuple[str, object]]:
    """The settings of a workflow config (``train``, ``amp``) that need a visible GPU:
    ``train.device: cuda``, ``amp.devices: auto`` and ``amp.device_memory_gb: auto``,
    as ``(key, value)`` in that order. The workflow checks them before a local run
    starts any job, so that a GPU config on a machine without one fails at once."""
    train, amp = config.get("train") or {}, config.get("amp") or {}
    out = []
    if train.get("device") == "cuda":
        out.append(("train.device", "cuda"))
    if amp.get("devices") == AUTO_DEVICES:
        out.append(("amp.devices", AUTO_DEVICES))
    if amp.get("device_memory_gb") == "auto":
        out.append(("amp.device_memory_gb", "auto"))
    return out


def require_gpus(config: dict, host: dict) -> None:
    """InputError naming the first of :func:`gpu_settings` (and the others) when ``host``
    (:func:`ampflow.devices.probe_devices`) lists no GPU; nothing otherwise."""
    need = gpu_settings(config)
    if not need or host.get("devices"):
        return
    key, value = need[0]
    named = ", ".join(f"{k}: {v}" for k, v in need)
    seen = f"NVML: {host['nvml']}; " if host.get("nvml") else ""
    raise InputError(
        f"this config needs a GPU ({named}) and none is visible here ({seen}CUDA_VISIBLE_DEVICES="
        f"{host.get('cuda_visible_devices')}); nothing was run. To train on CPU cores set train.device: cpu and give "
        f"amp.devices and amp.device_memory_gb as numbers, as config/demo.yaml does (make demo)",
        key=key, value=value,
    )  # fmt: skip


#: ``train.checkpoint_seconds: auto`` on a GPU: at most about this much training is
#: lost to a crash, and checkpoints cost a few percent of a fast step's time.
GPU_CHECKPOINT_SECONDS = 30.0


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run (config section ``train``).

    ``threads`` is the torch CPU threads of each training process: an integer, or
    ``"auto"``, the plan's figure (on CPU: the cores the allocation gives divided by the
    mesh's processes; see :mod:`ampflow.amp.decide.cpu`), and 1 where the plan has none. Both
    repeat for identical inputs: the plan is a pure function of the profile,
    ``devices.json`` and the calibration.

    ``deterministic`` (default true) turns on torch's deterministic algorithms. On CUDA
    it makes a run repeat bit for bit on one machine (CUDA's ``index_add_``/scatter
    kernels otherwise add with atomics in a varying order) and sets
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` where unset. On CPU a run repeats bit for bit for
    a given thread count either way (the model gathers with ``index_select``, whose
    backward adds in index order, not with indexing, whose backward adds with atomics
    across threads); the switch makes any such atomic CPU kernel run serially. Different
    thread counts give different roundings (matrix products split their sums by thread),
    so the same ``threads`` is part of "the same run": ``auto`` takes it from the plan.

    ``clip_grad_norm`` (default ``zscore``) caps the norm of the whole model's gradient
    before each update: ``zscore`` scales down the steps whose norm is a spike against
    the run's own moving mean and spread (:class:`~ampflow.parallel.clip.ZScoreBound`),
    a number is a fixed cap, null none. A fixed cap needs the data's scale: on real
    cortex cells a step's norm has a median of 0.04 and a run that blows up reaches 45 to
    119 (:mod:`ampflow.parallel.clip`), where 1 helped; on the demo a step's norm has a
    median of 31 (12 to 236), and 1 would scale them all.

    ``weight_decay`` (default 0: none) is AdamW's decoupled decay: each step shrinks
    every parameter by ``lr x weight_decay`` besides Adam's step, so that a weight the
    gradient does not keep up fades (:func:`ampflow.train.trainer.make_optimizer`).

    ``hic_keep_min`` (default 0.15; 1: off) thins the Hi-C counts each training step
    reads: each cell keeps each contact with a probability drawn per cell and step
    uniformly from ``[hic_keep_min, 1]`` (:mod:`ampflow.train.thinning`), so the encoder
    never sees a training cell twice with the same counts.

    ``hic_thinned`` (default ``encoder``) says what reads the thinned counts: the
    encoder alone, a denoising encoder that reads the thinned copy and is scored by the
    likelihood on the counts whole (one more ``(B, F)`` batch is held in the step), or
    ``both``, the encoder and the likelihood (the decoder then reconstructs the
    shallower cell, and a shallow copy's latent need only explain a shallow cell). On
    the Lee cells the encoder alone, thinned from 0.15, clustered held-out cells at 0.89
    and new batches at 0.80, against 0.86 and 0.76 for both thinned from 0.3
    (``docs/measurements.md``).
    """

    seed: int = 0
    batch_size: int = 32
    checkpoint_every: int = 50
    checkpoint_seconds: float | str = "auto"
    keep_checkpoints: int = 3
    threads: int | str = AUTO_THREADS
    device: str = "auto"
    dtype: str = "float32"
    deterministic: bool = True
    log_every: int = 20
    compile: bool | str = "auto"
    cuda_graphs: bool | str = "auto"
    clip_grad_norm: float | str | None = CLIP_ZSCORE
    weight_decay: float = 0.0
    hic_keep_min: float = 0.15
    hic_thinned: str = "encoder"
    pretrain: StageConfig = field(default_factory=lambda: StageConfig(600, 5e-3, LossWeights()))
    finetune: StageConfig = field(default_factory=lambda: StageConfig(60, 1e-3, LossWeights()))
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)

    def __post_init__(self):
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 2:
            raise InputError("must be an integer >= 2 (batch normalisation needs two cells)", key="train.batch_size", value=self.batch_size)
        if self.checkpoint_every < 1 or self.keep_checkpoints < 1:
            raise InputError("checkpoint_every and keep_checkpoints must be >= 1", key="train", value=asdict(self))
        c = self.checkpoint_seconds
        if c != "auto" and (isinstance(c, bool) or not isinstance(c, (int, float)) or not c >= 0):
            raise InputError("must be a number of seconds >= 0 or auto", key="train.checkpoint_seconds", value=c)
        t = self.threads
        if t != AUTO_THREADS and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise InputError(f"must be an integer >= 1 or {AUTO_THREADS!r}", key="train.threads", value=t)
        if self.device not in ("auto", "cpu", "cuda"):
            raise InputError("must be auto, cpu or cuda", key="train.device", value=self.device)
        if self.dtype not in TRAIN_DTYPE_BYTES:
            raise InputError(f"must be one of {', '.join(TRAIN_DTYPE_BYTES)}", key="train.dtype", value=self.dtype)
        if not isinstance(self.deterministic, bool):
            raise InputError("must be true or false", key="train.deterministic", value=self.deterministic)
        c = self.clip_grad_norm
        if c is not None and c != CLIP_ZSCORE and (isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < float("inf")):
            raise InputError("must be a number > 0, zscore (a bound from the run's own norms) or null (no clipping)",
                             key="train.clip_grad_norm", value=c)  # fmt: skip
        w = self.weight_decay
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < float("inf"):
            raise InputError("must be a number >= 0 (0: none)", key="train.weight_decay", value=w)
        k = self.hic_keep_min
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not 0 < k <= 1:
            raise InputError("must be a number > 0 and <= 1 (1: the counts as they are)", key="train.hic_keep_min", value=k)
        if self.hic_thinned not in HIC_THINNED:
            raise InputError(f"must be one of {', '.join(HIC_THINNED)} (what reads the thinned Hi-C counts)", key="train.hic_thinned",
                             value=self.hic_thinned)  # fmt: skip
        if isinstance(self.log_every, bool) or not isinstance(self.log_every, int) or self.log_every < 1:
            raise InputError("must be an integer >= 1", key="train.log_every", value=self.log_every)
        for key in ("compile", "cuda_graphs"):
            if getattr(self, key) not in (True, False, "auto"):
                raise InputError("must be true, false or auto", key=f"train.{key}", value=getattr(self, key))

    def checkpoint_interval(self, device_type: str) -> float:
        """Seconds a checkpoint waits after the last one (it is written at the first
        multiple of ``checkpoint_every`` steps after that): ``checkpoint_seconds``, or for
        ``auto`` :data:`GPU_CHECKPOINT_SECONDS` on a GPU and none on CPU. On one H200 a
        HiRES-size run checkpointing every 50 graphed steps (0.6 s of training, a 123 MB
        checkpoint at mm10 1 Mb/10) trained at 44.5 steps/s against 85 without; on 2 CPU
        cores the same 50 steps take about 9 s and a checkpoint 0.2 to 0.6 s."""
        if self.checkpoint_seconds == "auto":
            return GPU_CHECKPOINT_SECONDS if device_type == "cuda" else 0.0
        return float(self.checkpoint_seconds)

    @property
    def explicit_threads(self) -> int | None:
        """``threads`` when it is an integer; None for ``"auto"``."""
        return None if self.threads == AUTO_THREADS else int(self.threads)

    @property
    def stages(self) -> list[tuple[str, StageConfig]]:
        return [("pretrain", self.pretrain), ("finetune", self.finetune)]

    @property
    def encoder_copy(self) -> bool:
        """Whether the Hi-C encoder reads a thinned copy apart from the counts the
        likelihood scores (``hic_thinned: encoder`` with thinning on)."""
        return self.hic_keep_min < 1 and self.hic_thinned == "encoder"

    @property
    def cross_reconstruction(self) -> bool:
        """Whether any stage trains the cross-reconstruction term (it adds a second pass
        through both decoders, so the memory model counts it)."""
        return any(stage.weights.cross > 0 for _, stage in self.stages)

    @classmethod
    def from_dict(cls, d: dict | None) -> TrainConfig:
        d = dict(d or {})
        stages = {k: StageConfig.from_dict(d.pop(k), f"train.{k}") for k in ("pretrain", "finetune") if k in d}
        if "early_stopping" in d:
            stages["early_stopping"] = EarlyStoppingConfig.from_dict(d.pop("early_stopping"))
        reject_unknown_keys(d, cls, "train")
        return cls(**d, **stages)

    def to_dict(self) -> dict:
        return asdict(self)


def calibration_sections(model: ModelConfig, train: TrainConfig) -> dict:
    """The parts of the ``model`` and ``train`` sections that the cost model's calibration
    (:func:`ampflow.amp.cost.calibrate.calibrate`) measures with, and nothing else.

    The kernel it times has the decoder's heads, width ``D`` (``decoder_dim``, else the
    latent size: given here resolved) and window, the matrix product the feed-forward
    shape ``ffn_mult``, the encoder's hidden layers ``hidden_dim`` over a batch of
    ``train.batch_size`` cells; it runs on ``train.device`` (``auto`` is left as it is: it
    is resolved on the node that runs the job) with ``train.threads``. Seeds, schedules,
    learning rates, loss weights, dropout and ``train.dtype`` (the benchmark times
    float32) change nothing it measures. The ``devices`` rule hands these to ``ampflow
    calibrate`` as its params, so that Snakemake times the machine again only when one
    of them changes; the plan takes the whole sections.

    Returns
    -------
    dict
        ``{"model": {...}, "train": {...}}``: sections that
        :meth:`ModelConfig.from_dict` and :meth:`TrainConfig.from_dict` read back into
        configs that calibrate alike.
    """
    return {
        "model": {"decoder_dim": model.D, "heads": model.heads, "window": model.window, "ffn_mult": model.ffn_mult, "hidden_dim": model.hidden_dim},
        "train": {"device": train.device, "threads": train.threads, "batch_size": train.batch_size},
    }


@dataclass(frozen=True)
class EvaluateConfig:
    """How the embedding is scored (config section ``evaluate``).

    ``holdout`` is the share of QC-passing cells held out of everything that is fitted
    (HVG choice, the strata feature filter, training) so that scores can be taken on
    cells the model never saw; 0 holds out none. ``seed`` draws which cells, apart from
    ``train.seed``, so that retraining with another seed keeps the same held-out cells.
    """

    label_key: str = "cell_type"
    holdout: float = 0.2
    seed: int = 0

    def __post_init__(self):
        h = self.holdout
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 <= h < 1:
            raise InputError("must be a number in [0, 1)", key="evaluate.holdout", value=h)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InputError("must be an integer >= 0", key="evaluate.seed", value=self.seed)
        if not isinstance(self.label_key, str) or not self.label_key:
            raise InputError("must be a column name", key="evaluate.label_key", value=self.label_key)

    @classmethod
    def from_dict(cls, d: dict | None) -> EvaluateConfig:
        d = dict(d or {})
        reject_unknown_keys(d, cls, "evaluate")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)
