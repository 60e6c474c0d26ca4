"""The static training step (train/static_step.py) against the eager step, and the
trainer's step without host round-trips.

* Equivalence: the compiled step (inductor, on CPU and CUDA) and the CUDA-graphed step
  (CUDA only) give the eager step's loss terms and every gradient, and the parameters
  after Adam within Adam's tolerance, on the parallel-equivalence problem and on the
  demo's model, from the same draws. Referee: the plain model's eager forward and
  autograd, in float64 from the same draws; fp32 within 1e-5 relative, or six times the
  eager fp32 step's own worst error where that is larger (the rule every parallel
  strategy is held to); with ``dropout = 0``, since the modes draw dropout masks from
  other streams.
* Host syncs inside the trainer's step: a dispatch mode counts ``_local_scalar_dense``
  (``.item()``, ``float(t)``) and copies from a GPU to the CPU; none may happen in a step
  (the loss terms are read every ``log_every`` steps). On CPU, Adam keeps its step counts
  on the CPU (capturable Adam is CUDA-only) and reads them: those reads are counted
  apart, and a CUDA run must have none at all.
* Deferred reads: rows read every 4 steps are the rows read every step; a NaN loss stops
  the run naming the step where it appeared.
* A killed and resumed compiled run equals an uninterrupted one bit for bit (CPU), and a
  graphed one on CUDA under ``train.deterministic``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers import SyncCount
from parallel_equivalence import CLIP, LR, WEIGHTS, _adam_tolerance, _clip, _problem, _rel, encoder_input

from ampflow.base.errors import InputError
from ampflow.train.static_step import StaticStep, StepMode, choose_mode, draw_step, forward_terms

CUDA = torch.cuda.is_available()
GPU = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]
# (device, mode, stacked strata): None is the step's own choice (stacked on a GPU)
MODES = [
    pytest.param("cpu", StepMode(reason="test"), True, id="cpu-stacked"),
    pytest.param("cpu", StepMode(compile=True, reason="test"), None, id="cpu-compiled", marks=pytest.mark.slow),
    pytest.param("cpu", StepMode(compile=True, reason="test"), True, id="cpu-compiled-stacked", marks=pytest.mark.slow),
    # the compiled ones are slow there too (inductor compiles forward and backward, a minute
    # or more each): `make gpu-check` runs the fast GPU tests, `pytest -m gpu` every one
    pytest.param("cuda", StepMode(compile=True, reason="test"), None, id="cuda-compiled", marks=[*GPU, pytest.mark.slow]),
    pytest.param("cuda", StepMode(graphs=True, reason="test"), None, id="cuda-graphed", marks=GPU),
    pytest.param("cuda", StepMode(compile=True, graphs=True, reason="test"), None, id="cuda-compiled-graphed", marks=[*GPU, pytest.mark.slow]),
]


def _demo_problem(tmp: Path):
    """The demo's model (config/demo.yaml's, dropout off) on a batch of its prepared cells."""
    from helpers import prepare

    from ampflow.contract.config import ModelConfig
    from ampflow.demo import write_demo
    from ampflow.train.data import load_paired
    from ampflow.train.trainer import build_model

    data = load_paired(prepare(write_demo(tmp / "demo", n_cells=24, seed=0, n_genes=300), tmp / "work"))
    demo = yaml.safe_load((Path(__file__).parents[1] / "config" / "demo.yaml").read_text())
    cfg = ModelConfig.from_dict({**demo["model"], "dropout": 0.0})
    torch.manual_seed(0)
    model = build_model(cfg, data)
    rna, hic = data.batch(data.train_rows[:8])
    return model, rna, hic, None


def _one_step(model, rna, hic, cond, mode: StepMode | None, device: str, seed: int = 11, fp64: bool = False,
              stack: bool | None = None, hic_in=None) -> dict:  # fmt: skip
    """One step of ``model`` on the batch, with the draws of a generator seeded ``seed``:
    through :class:`StaticStep` in ``mode`` (``stack``: its strata stacked or not, None
    its own choice), or (None) the plain eager forward and autograd, the Hi-C decoder's
    strata one at a time; ``fp64``: the eager step in float64 from the same (float32)
    draws, widened. Every step clips the gradient's norm to ``CLIP`` (checked to bite).
    Loss terms, gradients (clipped) and parameters after Adam. ``hic_in``: what the
    Hi-C encoder reads apart from ``hic`` (a second static buffer)."""
    if fp64:
        model, rna, hic = model.double(), rna.double(), hic.double()
        cond = None if cond is None else cond.double()
        hic_in = None if hic_in is None else hic_in.double()
    model = model.to(device).train()
    opt = torch.optim.Adam(model.parameters(), lr=LR, capturable=mode is not None and mode.graphs)
    gen = torch.Generator(device).manual_seed(seed)
    names = None
    if mode is None:
        holder = StaticStep(model, opt, StepMode(), gen, stack=False)
        bufs = holder.buffers(rna.shape[0], rna.shape[1], hic.shape[1], 0 if cond is None else cond.shape[1], hic_in is not None)
        _fill(bufs, rna, hic, cond, device, hic_in)
        if fp64:  # the float32 draws, widened: the generator draws other numbers in float64
            narrow = dataclasses.replace(bufs, **{k: getattr(bufs, k).float() for k in ("eps_rna", "eps_hic", "eps_nodes")})
            draw_step(model, narrow, gen)
            for k in ("eps_rna", "eps_hic", "eps_nodes", "edge_idx", "neg_idx"):
                getattr(bufs, k).copy_(getattr(narrow, k))
        else:
            draw_step(model, bufs, gen)
        opt.zero_grad(set_to_none=True)
        terms = forward_terms(model, WEIGHTS, bufs.rna, bufs.hic, bufs.cond, bufs.eps_rna, bufs.eps_hic, bufs.eps_nodes, bufs.edge_idx, bufs.neg_idx,
                              bufs.hic_in)  # fmt: skip
        terms["total"].backward()
        _clip(model)
        opt.step()
        names = holder.term_names()
        values = torch.stack([terms[k].detach() for k in names])
    else:
        step = StaticStep(model, opt, mode, gen, stack=stack, clip=CLIP)
        chunked = bool(model.hic_decoder.blocks[0].chunk)
        assert step.stacked == ((device == "cuda" if stack is None else stack) and not chunked)
        bufs = step.buffers(rna.shape[0], rna.shape[1], hic.shape[1], 0 if cond is None else cond.shape[1], hic_in is not None)
        _fill(bufs, rna, hic, cond, device, hic_in)
        values = step.step(bufs, WEIGHTS, full_batch=rna.shape[0])
        names = step.term_names()
    return {
        "terms": dict(zip(names, values.cpu().unbind())),
        "grads": {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None},
        "params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
    }


def _fill(bufs, rna, hic, cond, device, hic_in=None):
    bufs.rna.copy_(rna.to(device))
    bufs.hic.copy_(hic.to(device))
    if cond is not None:
        bufs.cond.copy_(cond.to(device))
    if hic_in is not None:
        bufs.hic_in.copy_(hic_in.to(device))


@pytest.mark.parametrize("problem", ["equivalence", "demo"])
@pytest.mark.parametrize("device, mode, stack", MODES)
def test_static_step_equals_the_eager_step(device, mode, stack, problem, tmp_path):
    make = (lambda: _problem(torch.float32, "narrow")) if problem == "equivalence" else (lambda: _demo_problem(tmp_path))
    # the equivalence problem's encoder reads its own thinned copy (a second buffer)
    hic_in = encoder_input("narrow", make()[2]) if problem == "equivalence" else None
    ref = _one_step(*make(), None, device, hic_in=hic_in)
    got = _one_step(*make(), mode, device, stack=stack, hic_in=hic_in)
    truth = _one_step(*make(), None, device, fp64=True, hic_in=hic_in)
    assert got["terms"].keys() == ref["terms"].keys() == truth["terms"].keys()
    assert got["grads"].keys() == ref["grads"].keys() and len(ref["grads"]) == len(ref["params"])
    # as the parallel strategies are held (tests/parallel_equivalence.py): against the
    # same step in float64, to six times the eager float32 step's worst relative error
    # there (at least 1e-5): a sum that cancels (a bias gradient over signed rows) is
    # rounded differently by fused kernels that add in another order
    # a gradient that vanishes in exact arithmetic (a bias the freshly built demo model's
    # normalisation cancels: 1e-20 in float64) is rounding alone in float32, and has no
    # relative error to speak of: it must stay as small as rounding, at the scale of the
    # largest gradient
    scale = max(float(g.norm()) for g in truth["grads"].values())
    vanishing = {n for n, g in truth["grads"].items() if float(g.norm()) <= 1e-9 * scale}
    for n in vanishing:
        assert float(got["grads"][n].norm()) <= 1e-5 * scale, f"grad {n} vanishes in float64 but is {float(got['grads'][n].norm()):.3g}"
    compared = [(kind, n) for kind in ("terms", "grads") for n in ref[kind] if n not in vanishing or kind == "terms"]
    one = [_rel(ref[kind][n], truth[kind][n]) for kind, n in compared]
    assert max(one) <= 1e-4, f"the eager float32 step is {max(one):.3g} from float64, more than rounding"
    bound = max(1e-5, 6 * max(one))
    for kind, k in compared:
        err = _rel(got[kind][k], truth[kind][k].float())
        assert err <= bound, f"{kind} {k}: relative error {err:.3g} from float64 (bound {bound:.3g}; eager {_rel(ref[kind][k], truth[kind][k].float()):.3g})"
    for n in ref["params"]:
        tol = _adam_tolerance(ref["grads"][n], torch.float32)
        if n in vanishing:  # Adam's first step, lr g / (|g| + eps), of rounding noise g in each run
            tol = 1e-6 + LR * torch.clamp((got["grads"][n].abs() + ref["grads"][n].abs()) / 1e-8, max=2.0)
        assert bool(((got["params"][n] - ref["params"][n]).abs() <= tol).all()), n
    # the two runs did something: the step moved every parameter that has a gradient
    before = make()[0].state_dict()
    assert any(not torch.equal(before[n].cpu(), ref["params"][n]) for n in ref["params"])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_graphed_step_keeps_a_zscore_bound_as_the_eager_step_does():
    """A :class:`~ampflow.parallel.clip.ZScoreBound` (``train.clip_grad_norm: zscore``)
    lives on the device and the graph updates it: the capture's warm-up steps must leave
    it as it was. It starts from a state whose mean is far below this problem's norms, so
    that every step is a spike and is scaled. Referee: the eager step on the same GPU from
    the same draws (the graph replays its kernels): the bound's state and the parameters
    equal after 8 steps, every step scaled in both."""
    from ampflow.parallel.clip import ZScoreBound

    runs = []
    for mode in (StepMode(reason="test"), StepMode(graphs=True, reason="test")):
        model, rna, hic, cond = _problem(torch.float32, "narrow")
        model = model.to("cuda").train()
        opt = torch.optim.Adam(model.parameters(), lr=LR, capturable=mode.graphs)
        bound = ZScoreBound()
        bound.load({"count": 100.0, "mean": 0.01, "var": 1e-6}, torch.float32, "cuda")
        step = StaticStep(model, opt, mode, torch.Generator("cuda").manual_seed(5), stack=True, clip=bound)
        bufs = step.buffers(rna.shape[0], rna.shape[1], hic.shape[1], 0 if cond is None else cond.shape[1])
        _fill(bufs, rna, hic, cond, "cuda")
        scaled = []
        for _ in range(8):
            step.step(bufs, WEIGHTS, full_batch=rna.shape[0])
            scaled.append(float(bound.last) != float("inf"))
        runs.append((scaled, bound.state(), {n: p.detach().cpu() for n, p in model.named_parameters()}))
    (s_eager, b_eager, p_eager), (s_graph, b_graph, p_graph) = runs
    assert s_eager == s_graph == [True] * 8
    assert b_graph["count"] == b_eager["count"] == 108  # the capture's warm-up steps undone
    for k in ("mean", "var"):
        assert abs(b_graph[k] - b_eager[k]) <= 1e-5 * abs(b_eager[k]), k
    for n in p_eager:
        torch.testing.assert_close(p_graph[n], p_eager[n], rtol=1e-5, atol=1e-7, msg=n)


def test_choose_mode():
    """auto: graphs on one GPU, no compile; several processes stay eager; graphs need CUDA."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not choose_mode("auto", "auto", cpu, 1).static
    m = choose_mode("auto", "auto", cuda, 1)
    assert m.graphs and not m.compile
    assert choose_mode(True, "auto", cpu, 1).compile
    assert not choose_mode(True, True, cuda, 2).static
    with pytest.raises(InputError, match="train.cuda_graphs"):
        choose_mode("auto", True, cpu, 1)


# ------------------------------------------------------------------ the trainer's step
def _hic_only_data(n_cells=40):
    from helpers import batched_paired_data

    return batched_paired_data(n_cells)


def _cfg(device, **kw):
    from ampflow.contract.config import EarlyStoppingConfig, LossWeights, StageConfig, TrainConfig

    w = LossWeights()
    base = dict(seed=0, batch_size=8, checkpoint_every=4, checkpoint_seconds=0, threads=1, device=device, pretrain=StageConfig(2, 1e-2, w),
                finetune=StageConfig(1, 1e-3, w), early_stopping=EarlyStoppingConfig(patience=0))  # fmt: skip
    return TrainConfig(**{**base, **kw})


MODEL_KW = dict(latent_dim=6, hidden_dim=16, heads=2, window=2, dropout=0.0)


@pytest.mark.parametrize(
    "device, graphs",
    [pytest.param("cpu", False, id="cpu-eager"), pytest.param("cuda", False, id="cuda-eager", marks=GPU),
     pytest.param("cuda", True, id="cuda-graphed", marks=GPU)],
)  # fmt: skip
def test_no_host_sync_inside_the_step(device, graphs, tmp_path):
    from ampflow.contract.config import ModelConfig
    from ampflow.train.trainer import MEASURED_STEPS, Trainer

    cfg = _cfg(device, cuda_graphs=graphs, checkpoint_every=1000)
    trainer = Trainer(_hic_only_data(), ModelConfig(**MODEL_KW), cfg, tmp_path / "run")
    counts, real = [], trainer._train_step

    captured = []

    def counted(idx, *a, **kw):
        # after the measured steps (whose measurement reads the allocator, by design)
        if trainer.measured_steps < MEASURED_STEPS:
            return real(idx, *a, **kw)
        before = getattr(trainer.static, "captures", 0)
        with SyncCount() as c:
            row = real(idx, *a, **kw)
        if getattr(trainer.static, "captures", 0) != before:
            # a capture (once per learning rate) waits for the GPU by design: it copies
            # the model out to the host and back around its warm-up
            captured.append(c)
        else:
            counts.append(c)
        return row

    trainer._train_step = counted
    assert trainer.fit() is True
    assert len(counts) >= 3
    # the one capture after the measured steps: the finetune stage's learning rate
    assert len(captured) == (1 if graphs else 0)
    for c in counts:
        assert sum(c.syncs.values()) == 0, dict(c.syncs)
    if device == "cuda" and graphs:
        assert sum(c.optimizer_reads for c in counts) == 0  # capturable Adam: counts on the GPU
    elif device == "cpu":  # the fused Adam reads nothing back; the mode saw it run in every step
        assert sum(c.optimizer_reads for c in counts) == 0
        assert all(c.ops["_fused_adam_"] == 1 for c in counts), [dict(c.ops) for c in counts][:1]


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_rows_read_every_few_steps_are_the_rows_read_every_step(tmp_path):
    """Referee: the same run reading its terms after every step."""
    from ampflow.contract.config import ModelConfig
    from ampflow.train.trainer import Trainer

    data = _hic_only_data()
    runs = {}
    for every in (1, 4):
        t = Trainer(data, ModelConfig(**MODEL_KW), _cfg("cpu", checkpoint_every=1000), tmp_path / f"every{every}")
        t.read_every = every
        written, real = [], t._flush

        def flush(files, t=t, real=real, written=written):
            written.append(len(t.pending))
            return real(files)

        t._flush = flush
        assert t.fit() is True
        runs[every] = (_rows(tmp_path / f"every{every}"), written)
    one, four = runs[1][0], runs[4][0]
    assert [(r["step"], r["stage"], r["epoch"], r["loss"]) for r in one] == [(r["step"], r["stage"], r["epoch"], r["loss"]) for r in four]
    assert max(runs[4][1]) > 1 and max(runs[1][1]) == 1  # read in groups, and singly


def test_a_nan_loss_names_its_step(tmp_path):
    from ampflow.contract.config import ModelConfig
    from ampflow.train.trainer import Trainer

    t = Trainer(_hic_only_data(), ModelConfig(**MODEL_KW), _cfg("cpu", checkpoint_every=1000), tmp_path / "run")
    t.read_every = 4
    real = t._train_step

    def poisoned(idx, *a, **kw):
        if t.step == 2:  # the third step's loss is NaN
            with torch.no_grad():
                for p in t.model.hic_encoder.parameters():
                    p.fill_(float("nan"))
        return real(idx, *a, **kw)

    t._train_step = poisoned
    with pytest.raises(FloatingPointError, match="at step 3 "):
        t.fit()


@pytest.mark.parametrize(
    "device, kw",
    [pytest.param("cpu", {"compile": True}, id="cpu-compiled", marks=pytest.mark.slow),
     pytest.param("cuda", {"cuda_graphs": True}, id="cuda-graphed", marks=GPU)],
)  # fmt: skip
def test_killed_and_resumed_static_run_equals_an_uninterrupted_one(device, kw, tmp_path):
    from trainer_doubles import StoppingTrainer

    from ampflow.contract.config import ModelConfig
    from ampflow.train.trainer import Trainer

    data = _hic_only_data()
    cfg = _cfg(device, **kw)
    try:
        assert Trainer(data, ModelConfig(**MODEL_KW), cfg, tmp_path / "a").fit() is True
        assert StoppingTrainer(data, ModelConfig(**MODEL_KW), cfg, tmp_path / "b", stop_after=5).fit() is False
        resumed = Trainer(data, ModelConfig(**MODEL_KW), cfg, tmp_path / "b")
        assert resumed.mode.static
        assert resumed.fit() is True
    finally:
        torch.use_deterministic_algorithms(False)
    ra, rb = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert [r["step"] for r in ra] == [r["step"] for r in rb] and len(ra) > 5
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
    ma = torch.load(tmp_path / "a" / "model.pt", map_location="cpu", weights_only=True)["state_dict"]
    mb = torch.load(tmp_path / "b" / "model.pt", map_location="cpu", weights_only=True)["state_dict"]
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


def test_the_compiled_forward_is_one_graph():
    """Referee: dynamo's own account (``torch._dynamo.explain``) of the compiled forward on
    the equivalence problem: one graph and no break. A break inside the banded kernel made
    a frame per stratum, guarded on the stratum's index, and past torch's recompile limit
    (8) the remaining strata ran eagerly."""
    import torch._dynamo

    model, rna, hic, cond = _problem(torch.float32, "narrow")
    model.train()
    step = StaticStep(model, torch.optim.Adam(model.parameters()), StepMode(), torch.Generator().manual_seed(0))
    bufs = step.buffers(rna.shape[0], rna.shape[1], hic.shape[1], cond.shape[1])
    _fill(bufs, rna, hic, cond, "cpu")
    draw_step(model, bufs, step.generator)
    args = (bufs.rna, bufs.hic, bufs.cond, bufs.eps_rna, bufs.eps_hic, bufs.eps_nodes, bufs.edge_idx, bufs.neg_idx)
    explained = torch._dynamo.explain(forward_terms)(model, WEIGHTS, *args)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [r.reason[:200] for r in explained.break_reasons]


class _ReplayedCapture:
    """Stands in for a CUDA graph on the CPU: ``replay`` runs the step as it was captured,
    with the loss weights it was captured with, and writes ``bufs.out`` in place."""

    def __init__(self, step, bufs, weights):
        self.step, self.bufs, self.weights = step, bufs, weights

    def replay(self):
        self.bufs.out = self.step._compute(self.bufs, self.weights)


def test_a_stage_with_other_loss_weights_is_captured_anew(monkeypatch):
    """A graph replays the loss it was captured with. Two stages at the same learning rate
    whose weights differ (the second trains ``cross``): the second stage's step returns its
    own terms, equal to the eager step's with its weights (the referee), and the first
    stage's repeated step replays without a new capture."""
    first, second = dataclasses.replace(WEIGHTS, cross=0.0), WEIGHTS

    def run(stages, graphed):
        m, rna, hic, cond = _problem(torch.float32, "narrow")  # the same model each time, dropout off
        step = StaticStep(m.train(), torch.optim.Adam(m.parameters(), lr=LR), StepMode(), torch.Generator().manual_seed(3))
        captured = []
        if graphed:
            step.mode = StepMode(graphs=True, reason="test")

            def capture(bufs, key):
                captured.append(key)
                step._graph = (key, _ReplayedCapture(step, bufs, key[2]), bufs)

            monkeypatch.setattr(step, "_capture", capture)
        bufs = step.buffers(rna.shape[0], rna.shape[1], hic.shape[1], cond.shape[1])
        _fill(bufs, rna, hic, cond, "cpu")
        out = [dict(zip(step.term_names(w), step.step(bufs, w, full_batch=rna.shape[0]).unbind())) for w in stages]
        return out, captured

    stages = [first, first, second]
    want, _ = run(stages, graphed=False)
    got, captured = run(stages, graphed=True)
    assert [k[2] for k in captured] == [first, second]
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for name in w:
            torch.testing.assert_close(g[name], w[name], rtol=1e-6, atol=0)
    assert "cross" in got[2] and "cross" not in got[0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_resident_counts_densify_to_the_matrix_rows(device):
    """Referee: scipy's own dense rows of the CSR matrix, for rows of every length (empty
    ones included), repeated rows and two batch sizes."""
    import numpy as np
    import scipy.sparse as sp

    from ampflow.train.device_cells import DeviceCells, padded_bytes

    rng = np.random.default_rng(0)
    dense = rng.poisson(0.3, size=(50, 37)).astype(np.float32)
    dense[[3, 17]] = 0  # cells without a contact
    dense[5] = rng.poisson(5.0, size=37)  # the longest row sets the padding
    mat = sp.csr_matrix(dense)
    cells = DeviceCells(mat, device)
    assert cells.width == int(np.diff(mat.indptr).max()) and cells.nbytes == padded_bytes(mat)
    for rows in ([5, 3, 0, 49, 17, 5], list(range(50))):
        out = torch.full((len(rows), 37), -1.0, device=device)  # overwritten whole
        cells.densify(torch.as_tensor(rows, device=device), out)
        np.testing.assert_array_equal(out.cpu().numpy(), mat[rows].toarray())


def test_validation_loss_does_not_depend_on_its_batches():
    """A GPU validates in larger batches than it trains: the loss is the cell-weighted mean
    of per-cell terms under eval-mode normalisation (running statistics), so the batches
    change its rounding only. Referee: the same loss over one cell at a time."""
    import numpy as np

    from ampflow.contract.config import LossWeights, ModelConfig
    from ampflow.train.early_stopping import validation_loss
    from ampflow.train.trainer import build_model

    data = _hic_only_data(40)
    data.use_batches("batch")
    torch.manual_seed(0)
    model = build_model(ModelConfig(**MODEL_KW), data)
    rows, w = np.arange(3, 40), LossWeights()
    single = validation_loss(model, data, rows, w, 1, "cpu", torch.float32)
    for batch in (8, 64):
        got = validation_loss(model, data, rows, w, batch, "cpu", torch.float32)
        assert abs(got - single) <= 1e-6 * abs(single), (batch, got, single)


@pytest.mark.parametrize("thinned", ["both", "encoder"])
def test_resident_counts_fill_the_static_buffers_as_the_host_batch(thinned, tmp_path):
    """The trainer's loading of a static step from counts held as padded rows (the GPU's
    path), run on the CPU: the Hi-C buffer (and with ``hic_thinned: encoder`` the
    encoder's copy) equal the host's batch of the same step, thinned by the same keys.
    Referee: :meth:`PairedData.hic_batch` (scipy rows thinned by the compiled loop or
    the tensor kernels), and the copy differs from the counts."""
    import numpy as np

    from ampflow.contract.config import ModelConfig
    from ampflow.train.device_cells import DeviceCells
    from ampflow.train.trainer import Trainer

    data = _hic_only_data()
    trainer = Trainer(data, ModelConfig(**MODEL_KW), _cfg("cpu", hic_keep_min=0.3, hic_thinned=thinned), tmp_path / "run")
    trainer.step = 7
    trainer.resident = {"hic": DeviceCells(data.hic, "cpu", thinned=True), **({"rna": DeviceCells(data.rna, "cpu")} if data.has_rna else {})}
    if data.batch_names:
        trainer.resident["codes"] = torch.as_tensor(data.batch_codes, dtype=torch.long)
    step = StaticStep(trainer.model, trainer.optimizer, StepMode(reason="test"), torch.Generator())
    cells = np.asarray(trainer.train_rows[:8])
    bufs = step.buffers(len(cells), data.rna.shape[1], data.hic.shape[1], data.n_batches, trainer.cfg.encoder_copy)
    trainer._load_static(cells, bufs)
    thinned_host = data.hic_batch(cells, thinning=(0.3, trainer.cfg.seed, 7))
    if thinned == "both":
        assert bufs.hic_in is None
        assert torch.equal(bufs.hic, thinned_host)
    else:
        assert torch.equal(bufs.hic, data.hic_batch(cells)) and torch.equal(bufs.hic_in, thinned_host)
        assert bufs.hic_in.sum() < bufs.hic.sum()
