"""Re-runs on CPU repeat bit for bit, on one thread and on several.

Referee: the run itself, repeated. Two trainings with the same data, config, seed and
thread count must end with every parameter equal. The model is big enough (the graph
encoder's gathers over about 9,000 edges) that a gather whose backward adds with atomics
across threads (indexing's ``index_put_(accumulate=True)``, parallel above 32,768
elements) makes two 2-thread runs differ: it did, in the graph encoder's parameters,
before the model's gathers became ``index_select``.
"""

from __future__ import annotations

import pandas as pd
import pytest
import scipy.sparse as sp
import torch
from synthetic_shapes import SYNTHETIC_META, synthetic_features, synthetic_graph
from torch.utils._python_dispatch import TorchDispatchMode

from ampflow.contract.config import LossWeights, ModelConfig, TrainConfig
from ampflow.model.paired import PairedModel
from ampflow.train.data import PairedData
from ampflow.train.trainer import Trainer

N_CELLS, N_GENES, N_ANCHORS, N_STRATA = 48, 2000, 500, 3
MODEL = ModelConfig(latent_dim=8, hidden_dim=32, heads=2, window=2)


@pytest.fixture(scope="module")
def data() -> PairedData:
    """RNA and Hi-C counts of cells in two batches (the decoders' batch columns train too)."""
    g = torch.Generator().manual_seed(0)
    anchor, stratum = synthetic_features(N_ANCHORS, N_STRATA, 1.0, 0, g)
    kind = torch.arange(N_CELLS) % 2
    rna = torch.poisson((torch.rand(2, N_GENES, generator=g) * 2)[kind], generator=g)
    hic = torch.poisson((torch.rand(2, len(anchor), generator=g) * 2 + 0.2)[kind], generator=g)
    obs = pd.DataFrame({"batch": [f"b{i % 3 // 2}" for i in range(N_CELLS)]}, index=[f"c{i}" for i in range(N_CELLS)])
    return PairedData(
        obs=obs, rna=sp.csr_matrix(rna.numpy()), hic=sp.csr_matrix(hic.numpy()), feature_anchor=anchor,
        feature_stratum=stratum, n_strata=N_STRATA, graph=synthetic_graph(N_GENES, N_ANCHORS, g), meta=SYNTHETIC_META,
    )  # fmt: skip


def train(data: PairedData, threads: int, deterministic: bool, out) -> dict[str, torch.Tensor]:
    cfg = TrainConfig.from_dict({
        "seed": 3, "batch_size": 16, "checkpoint_every": 1000, "threads": threads, "device": "cpu", "deterministic": deterministic,
        "pretrain": {"epochs": 3}, "finetune": {"epochs": 1}, "early_stopping": {"patience": 0},
    })  # fmt: skip
    before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        trainer = Trainer(data, MODEL, cfg, out)
        assert trainer.fit() and torch.get_num_threads() == threads
        assert torch.are_deterministic_algorithms_enabled() is deterministic
        return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    finally:
        torch.set_num_threads(before[0])
        torch.use_deterministic_algorithms(before[1], warn_only=before[2])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("deterministic", [True, False], ids=["switch-on", "switch-off"])
def test_training_twice_gives_every_parameter_identical(data, threads, deterministic, tmp_path):
    """With torch's deterministic switch (``train.deterministic``) and without it: the
    model's own kernels repeat, the switch is only a safety net on CPU."""
    # two folders as two workflow runs have them: other parents, the same run name
    a = train(data, threads, deterministic, tmp_path / "a" / "run")
    b = train(data, threads, deterministic, tmp_path / "b" / "run")
    assert list(a) == list(b) and any(k.startswith("graph_encoder.") for k in a)
    differ = {k: float((a[k].double() - b[k].double()).abs().max()) for k in a if not torch.equal(a[k], b[k])}
    assert not differ, f"{threads} thread(s): parameters differ between two identical runs: {differ}"
    # and the files a user compares: the same bytes
    for name in ("model.pt", "embeddings.h5ad"):
        assert (tmp_path / "a/run" / name).read_bytes() == (tmp_path / "b/run" / name).read_bytes(), name


class AtomicAdds(TorchDispatchMode):
    """Records the CPU kernels whose sums depend on thread scheduling: indexing's
    backward (``index_put`` with ``accumulate=True``) and the scatter adds."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name()
        accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False) if "index_put" in name else False
        if accumulate or "scatter_add" in name or "scatter_reduce" in name or name.startswith("aten::put"):
            self.seen.append(name)
        return func(*args, **kwargs)


def test_a_training_step_runs_no_thread_ordered_sum(data):
    """Forward and backward of the model (RNA, Hi-C, graph, batch columns): no kernel whose
    sum order follows the threads. Guards the cases the repeat test's size cannot reach."""
    torch.manual_seed(0)
    model = PairedModel(MODEL, N_GENES, data.feature_anchor, data.feature_stratum, N_STRATA, data.graph, n_batches=2)
    rna = torch.from_numpy(data.rna[:8].toarray())
    hic = torch.from_numpy(data.hic[:8].toarray())
    cond = torch.eye(2)[torch.arange(8) % 2]
    with AtomicAdds() as mode:
        terms = model(rna, hic, LossWeights(), generator=torch.Generator().manual_seed(0), cond=cond)
        terms["total"].backward()
    assert all(p.grad is not None for p in model.graph_encoder.parameters())
    assert mode.seen == [], sorted(set(mode.seen))


def test_a_saved_model_does_not_carry_its_temporary_files_name(tmp_path):
    """``torch.save`` to a path names the zip's root folder after the file, and the
    atomic write's temporary file holds the process id: two workflow runs' model.pt
    differed in those bytes only. Saved through an open file, any two names give the
    same bytes (torch's own loader reads both back)."""
    from ampflow.train.checkpoint import save_torch

    obj = {"w": torch.arange(6.0).reshape(2, 3), "genes": ["a", "b"]}
    paths = [tmp_path / ".tmp-111-model.pt", tmp_path / ".tmp-222222-model.pt"]
    for p in paths:
        save_torch(obj, p)
    assert paths[0].read_bytes() == paths[1].read_bytes()
    back = torch.load(paths[1], weights_only=True)
    assert torch.equal(back["w"], obj["w"]) and back["genes"] == obj["genes"]
