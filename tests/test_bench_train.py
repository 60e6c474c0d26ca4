"""scripts/bench_train.py on a tiny genome: every component is in the table with its
seconds, every variant has a floor ratio, and the components add up to the step.

The sum is checked against an independent clock: the script times plain steps with
nothing installed, apart from the instrumented steps whose components it sums.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import load_script

bt = load_script("bench_train")
STRATA = 4
NUMBER = r"(\d+\.\d+)"


@pytest.fixture
def sizes(tmp_path):
    path = tmp_path / "tiny.chrom.sizes"
    path.write_text("chrA\t3000000\nchrB\t2000000\nchrM\t16000\n")
    return path


def run(capsys, sizes, *extra) -> str:
    argv = [
        "--chrom-sizes", str(sizes), "--chroms", "chrA", "chrB", "--shapes", f"100000:{STRATA}",
        "--genes", "30", "--graph-degree", "3", "--cells", "16", "--batch", "8", "--steps", "5",
        "--matmul", "256", "--threads", "1", "--memory-gib", "1", *extra,
    ]  # fmt: skip
    assert bt.main(argv) == 0
    return capsys.readouterr().out


def test_table_has_every_component_and_ratio(capsys, sizes):
    out = run(capsys, sizes)
    assert "tiny 100kb/4: 50 anchors" in out
    components = ["encoders", "graph", *(f"attention k={k}" for k in range(1, STRATA)), "decode", "likelihood",
                  "other forward", "backward", "optimizer"]  # fmt: skip
    rows = {}
    for name in [*components, "sum of components", "plain step"]:
        line = next((x for x in out.splitlines() if x.strip().startswith(name + " ")), None)
        assert line is not None, (name, out)
        rows[name] = [float(x) for x in re.findall(r"-?\d+\.\d+", line[len(name) + 2 :])]
    # GFLOP, then (seconds, floor ratio) for old and for new
    plain = rows["plain step"]
    assert len(plain) == 5 and plain[0] > 0, plain
    old_ratio, new_ratio = plain[2], plain[4]
    assert all(s > 0 for s in plain[1::2]), plain
    assert 0 < old_ratio <= 1.5 and 0 < new_ratio <= 1.5, plain
    for name in components:
        assert len(rows[name]) >= 3 and all(x >= 0 for x in rows[name]), (name, rows[name])
    # the components of an instrumented step add up to about a plain step timed apart
    # (a shared CPU's load makes single steps vary)
    # (the fastest of each: other processes' load on a shared CPU only ever adds time)
    sums = [float(x) for x in re.findall(r"components sum to \d+\.\d+x .*fastest steps: (\d+\.\d+)x", out)]
    assert len(sums) == 2, out
    assert all(0.5 <= x <= 2.0 for x in sums), sums
    assert re.search(rf"new / old speed-up: {NUMBER}x", out)
    summary = out[out.index("summary") :]
    assert re.search(r"100kb/4 .* \d+\.\d+x .* \d+\.\d+\s*$", summary.splitlines()[2]), summary


def test_old_kernel_skipped_with_its_reason(capsys, sizes):
    out = run(capsys, sizes, "--old", "chunked", "--max-old-gib", "0", "--steps", "1")
    assert "old: skipped: the chunked kernel (chunk 2048) would save" in out
    assert "old s/step" not in out.split("summary")[0]
    assert re.search(r"100kb/4 .* skipped ", out)
    assert re.search(rf"new: step {NUMBER} s; floor {NUMBER} s .* floor ratio {NUMBER}", out)


def test_band_and_chunk_pair_counts():
    """The floor's attention term counts in-window pairs; the old kernel's, its blocks."""
    n, w = 20, 3
    assert bt.band_pairs(n, w) == sum(1 for i in range(n) for j in range(n) if abs(i - j) <= w)
    assert bt.chunked_pairs(n, w, 8) == 8 * 11 + 8 * 14 + 4 * 7
    assert bt.chunked_pairs(n, w, 64) == n * n


# ------------------------------------------------------------------------ the HiRES-size case
HIRES_CELLS, HIRES_BATCH = 96, 8


def run_hires(capsys, sizes, *extra) -> tuple[int, str]:
    argv = [
        "--hires", "--chrom-sizes", str(sizes), "--chroms", "chrA", "chrB", "--shapes", f"100000:{STRATA}",
        "--genes", "30", "--graph-degree", "3", "--batch", str(HIRES_BATCH), "--hires-cells", str(HIRES_CELLS),
        "--hires-steps", "3", "--hires-warmup", "2", "--contacts", "2000", "--umis", "500",
        "--matmul", "256", "--copy-mib", "16", *extra,
    ]  # fmt: skip
    rc = bt.main(argv)
    return rc, capsys.readouterr().out


def mode_line(out: str, mode: str) -> re.Match:
    m = re.search(
        rf"^hires 100000:{STRATA} {re.escape(mode)}: {NUMBER} steps/s \(eager {NUMBER}: {NUMBER}x\), launches/step (\d+) "
        rf"\(aten ops called from outside aten; (\d+) dispatched under a dispatch mode\), "
        rf"host syncs/step (\d+) \(\+(\d+) in optimizer.step, Adam's step counts\), "
        rf"compile {NUMBER} s, capture {NUMBER} s, first step {NUMBER} s, epoch {NUMBER} s \((\d+) steps\), "
        rf"FLOP floor ratio {NUMBER}, bytes floor ratio {NUMBER}$",
        out,
        re.M,
    )
    assert m, (mode, out)
    return m


def check_mode(out: str, mode: str) -> dict:
    m = mode_line(out, mode)
    steps_s, eager_s, ratio = (float(m.group(i)) for i in (1, 2, 3))
    launches, dispatched, syncs, opt_syncs = (int(m.group(i)) for i in (4, 5, 6, 7))
    compile_s, capture_s, _first, epoch_s = (float(m.group(i)) for i in (8, 9, 10, 11))
    epoch_steps = int(m.group(12))
    flop_ratio, bytes_ratio = float(m.group(13)), float(m.group(14))
    # the ratio is printed from unrounded rates: its bounds are those of the printed
    # figures (steps/s to 0.01, eager and the ratio to 0.1); at an eager 1.8 steps/s the
    # eager's rounding alone moves a ratio near 38 by 1
    lo = (steps_s - 0.005) / (eager_s + 0.05) - 0.05
    hi = (steps_s + 0.005) / (eager_s - 0.05) + 0.05 if eager_s > 0.05 else float("inf")
    assert steps_s > 0 and lo <= ratio <= hi, m.group(0)
    assert syncs == 0, m.group(0)  # nothing inside the step waits for the host
    assert opt_syncs == 0, m.group(0)  # the fused Adam reads no step count back (the loop read one per parameter)
    # the ops launched from outside aten are among those dispatched (a compiled step's
    # fused kernels are neither; under a dispatch mode it runs its forward eagerly)
    assert 0 < launches < dispatched and capture_s == 0.0
    # the template validates on a tenth of the cells; the rest make the epoch's batches
    train = HIRES_CELLS - round(0.1 * HIRES_CELLS)
    assert epoch_steps == math.ceil(train / HIRES_BATCH)
    assert epoch_s == pytest.approx(epoch_steps / steps_s, rel=0.02, abs=0.011)
    assert 0 < flop_ratio <= 1.5 and 0 < bytes_ratio <= 1.5, m.group(0)
    return {"compile": compile_s, "launches": launches, "dispatched": dispatched, "steps_s": steps_s}


def test_hires_eager_and_early_stopping_limit(capsys, sizes):
    rc, out = run_hires(capsys, sizes, "--modes", "eager", "graphed", "--hires-early-stopping", "--early-stopping-seconds", "1")
    assert rc == 0, out
    assert f"hires 100000:{STRATA} graphed: skipped (CUDA graphs need a GPU)" in out
    eager = check_mode(out, "eager")
    assert eager["compile"] == 0.0
    floors = re.search(rf"floors: {NUMBER} GFLOP/step at (\d+) GFLOP/s = {NUMBER} ms; {NUMBER} GB/step .* at (\d+) GB/s = {NUMBER} ms", out)
    assert floors and all(float(floors.group(i)) > 0 for i in range(1, 7)), out
    # two stages of at least patience + 1 epochs do not fit in 1 s on a CPU; the steps run
    # are those of the epochs begun (the template validates on a tenth: 86 cells, 11 batches)
    # and the stages' ceilings are the template's
    template = bt.template_train_config()
    ceilings = (template.pretrain.epochs, template.finetune.epochs)
    m = re.search(
        rf"hires early-stopping 100000:{STRATA} eager: did not stop within 1 s: epochs pretrain (\d+) of {ceilings[0]}"
        rf"(?:, finetune (\d+) of {ceilings[1]})? so far, (\d+) steps",
        out,
    )
    assert m, out
    pre, fine, steps = int(m.group(1)), int(m.group(2) or 0), int(m.group(3))
    per_epoch = math.ceil((HIRES_CELLS - round(0.1 * HIRES_CELLS)) / HIRES_BATCH)
    done = per_epoch * (pre + fine - 1)  # every epoch but the last begun ran whole
    assert done < steps <= done + per_epoch, (pre, fine, steps)


@pytest.mark.slow
def test_hires_eager_and_compiled_on_cpu(capsys, sizes):
    """One compile (about a minute on two cores): the compiled step launches fewer aten
    ops than the eager one and reads no scalar but Adam's counts."""
    rc, out = run_hires(capsys, sizes, "--modes", "eager", "compiled")
    assert rc == 0, out
    eager, compiled = check_mode(out, "eager"), check_mode(out, "compiled")
    assert compiled["compile"] > 0 and eager["compile"] == 0.0
    assert compiled["launches"] < eager["launches"], out


def test_host_sync_counter_counts_scalar_reads_and_optimizer_reads():
    """The counter against a known answer: two ``.item()`` reads in the step, and one per
    parameter inside ``Adam.step`` (its step counts, on CPU)."""
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    opt = torch.optim.Adam(params, lr=0.1)
    counter = bt.SyncCounter()
    with bt.counting_syncs(opt, counter):
        loss = sum((p * p).sum() for p in params)
        loss.item()
        bool(loss > 0)
        loss.backward()
        opt.step()
    assert (counter.syncs, counter.optimizer_syncs) == (2, len(params))
    assert counter.ops > 0 and counter.cuda_syncs is None


def test_profile_counts_from_events():
    """Host launch calls, graph launches and GPU events per step, from profiler events."""

    class Event:
        def __init__(self, name, cuda=False):
            self.name = name
            self.device_type = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU

    class Prof:
        def events(self):
            host = ["cudaLaunchKernel"] * 6 + ["cudaGraphLaunch"] * 2 + ["cudaMemcpyAsync"] * 2 + ["aten::mm"] * 5
            return [Event(n) for n in host] + [Event("gemm", cuda=True)] * 8

    assert bt.profile_counts(Prof(), 2) == {"launches": 5.0, "graph_launches": 1.0, "gpu_events": 4.0}


def test_time_by_kernel_sums_per_step_and_ranks_the_names():
    """GPU kernel time per step and each name's share, from profiler events whose times
    are known: host events are left out on CUDA, only aten ops' own time counts on CPU."""

    class Span:
        def __init__(self, us):
            self.us = us

        def elapsed_us(self):
            return self.us

    class Event:
        def __init__(self, name, us, cuda=False, self_us=0.0):
            self.name = name
            self.device_type = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
            self.time_range = Span(us)
            self.self_cpu_time_total = self_us

    class Prof:
        def events(self):
            gpu = [Event("gemm", 300.0, cuda=True)] * 2 + [Event("softmax", 200.0, cuda=True), Event("copy", 200.0, cuda=True)]
            host = [Event("cudaLaunchKernel", 5000.0, self_us=50.0), Event("aten::mm", 900.0, self_us=600.0), Event("aten::add", 100.0, self_us=200.0)]
            return gpu + host

    busy, ranked = bt.time_by_kernel(Prof(), 2, "cuda", top=2)
    assert busy == pytest.approx(0.5)  # 1,000 us of kernels over 2 steps
    assert ranked == [("gemm", pytest.approx(0.6)), ("copy", pytest.approx(0.2))]  # a tie goes by name
    busy, ranked = bt.time_by_kernel(Prof(), 2, "cpu")
    assert busy == pytest.approx(0.4)  # aten ops' own time only: 800 us over 2 steps
    assert ranked == [("aten::mm", pytest.approx(0.75)), ("aten::add", pytest.approx(0.25))]


def test_time_between_steps_times_each_part_and_puts_the_trainer_back(monkeypatch):
    """The early-stopping run's split of its wall time: validation, best-weight copies and
    checkpoints each get at least the time they slept (a lower bound that holds on a busy
    machine), the calls still return their values, and restore leaves the trainer's and
    the module's own functions in place."""
    import time

    from ampflow.train import trainer as trainer_module

    def validation_loss(*args):
        time.sleep(0.01)
        return 2.0

    class Early:
        def update(self, loss, epoch, snapshot):
            time.sleep(0.02)
            return loss > 1

    class Trainer:
        def __init__(self):
            self.early = Early()

        def sync(self):
            pass

        def _save_checkpoint(self):
            time.sleep(0.03)

    monkeypatch.setattr(trainer_module, "validation_loss", validation_loss)
    trainer = Trainer()
    spent = bt.TimeBetweenSteps(trainer)
    assert trainer_module.validation_loss() == 2.0
    assert trainer.early.update(2.0, 0, None) is True
    trainer._save_checkpoint()
    trainer._save_checkpoint()
    spent.restore()
    assert spent.seconds["validation"] >= 0.01
    assert spent.seconds["best-weight copies"] >= 0.02
    assert spent.seconds["checkpoints"] >= 0.06
    assert trainer_module.validation_loss is validation_loss
    assert "update" not in vars(trainer.early) and "_save_checkpoint" not in vars(trainer)


def test_the_plain_hires_modes_read_every_contact_and_the_thinned_ones_thin():
    """Referee: the mode table written out by hand. ``eager``, ``graphed`` and the rest
    keep every contact whatever the template thins (``train.hic_keep_min``), the
    ``-thinned`` modes thin the encoder's copy from 0.15; the template's other training
    settings are kept."""
    import argparse

    args = argparse.Namespace(template=bt.TEMPLATE_CONFIG, batch=16, seed=0, threads=0)
    template = bt.template_train_config()
    thinned = {"eager-thinned", "graphed-thinned"}
    assert thinned < set(bt.HIRES_MODES)
    for mode in bt.HIRES_MODES:
        cfg = bt.hires_train_config(args, mode, "cpu", 1, True)
        assert cfg.hic_keep_min == (0.15 if mode in thinned else 1.0), mode
        assert cfg.encoder_copy == (mode in thinned), mode
        assert (cfg.early_stopping, cfg.clip_grad_norm, cfg.pretrain) == (template.early_stopping, template.clip_grad_norm, template.pretrain), mode
