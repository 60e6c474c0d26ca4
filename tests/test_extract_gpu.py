"""Extraction on a real GPU (skipped without CUDA): half-precision loading straight to the
device, host memory of two GPU workers loading one after another, a real CUDA
out-of-memory error split and retried; the GPU telemetry of a small extraction, read back
the way the report reads it.

The model is a randomly initialised ESM-2 of esm2_t33_650M's shape (2.6 GB of fp32
weights; random weights do the same work as trained ones). Referees: the CPU in float32
(transformers' own loading), the kernel's count of the workers' memory, the same
sequences in small batches that fit.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LETTERS = "ACDEFGHIKLMNPQRSTVWY"


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    from ampflow.extract.tiny import ESM2_650M, write_esm2

    return write_esm2(tmp_path_factory.mktemp("m") / "esm650", seed=0, **ESM2_650M)


def proteins(n, seed=0, lengths=(30, 1022)) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(LETTERS) for _ in range(rng.randint(*lengths))) for _ in range(n)]


def test_bfloat16_weights_on_the_gpu_match_the_cpu(big_model):
    """Loaded in bf16 straight to the GPU: parameters bf16 on cuda, GPU memory near the
    bf16 weights, vectors within bf16 precision of transformers' fp32 CPU model."""
    from transformers import EsmModel

    from ampflow.extract.config import ModelSpec
    from ampflow.extract.models import load_embedder

    spec = ModelSpec(kind="esm2", source=str(big_model), dtype="bfloat16")
    torch.cuda.reset_peak_memory_stats()
    emb = load_embedder(spec, big_model, [33], device="cuda")
    params = {p.dtype for p in emb.model.parameters()}
    weights = sum(p.numel() * p.element_size() for p in emb.model.parameters())
    peak_load = torch.cuda.max_memory_allocated()
    seqs = proteins(24, seed=1)
    got, stats = emb.embed(seqs)
    ref_model = EsmModel.from_pretrained(str(big_model), add_pooling_layer=False).eval()
    ref = []
    with torch.no_grad():
        for s in seqs[:6]:
            ids = torch.tensor([emb.tokenize([s])[0].ids])
            ref.append(ref_model(input_ids=ids).last_hidden_state[0, 1:-1].mean(0).numpy())
    ref = np.stack(ref)
    v = got["L33.mean"][:6]
    cos = (v * ref).sum(1) / np.linalg.norm(v, axis=1) / np.linalg.norm(ref, axis=1)
    print(f"\nbf16 on GPU: params {params}, weights {weights / 2**30:.2f} GiB, peak after load {peak_load / 2**30:.2f} GiB; "
          f"cosine to fp32 CPU min {cos.min():.5f}; {stats['batches']} batches")  # fmt: skip
    assert params == {torch.bfloat16} and next(emb.model.parameters()).is_cuda
    assert peak_load < 1.1 * weights
    assert cos.min() > 0.999


def _pss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_two_gpu_workers_load_one_after_another_near_one_host_copy(big_model, tmp_path, monkeypatch):
    """Two workers on the GPU (the same one here) load the 650M model in bf16, one after
    another (the job's load lock): the workers' summed host memory, sampled every 50 ms
    (PSS: shared pages counted once), peaks near one worker's, far below one fp32 copy."""
    from ampflow.extract.config import ExtractSettings, ModelSpec
    from ampflow.extract.run import extract_model

    # enough work that the second worker, waiting its turn to load, gets chunks: an H100
    # computed 200 of these proteins in 2 s, before the second worker was ready, and the
    # pool rightly ended it unused; with packed rows (the GPU's default) one worker on an
    # H200 did all of 3,000 in 9 s, while the other waited 14 s for the loading lock
    fasta = tmp_path / "p.fa"
    fasta.write_text("".join(f">p{i}\n{s}\n" for i, s in enumerate(proteins(12_000, seed=2, lengths=(50, 400)))))
    file_bytes = (big_model / "model.safetensors").stat().st_size
    peaks = {"pss": 0, "rss": 0}
    stop = threading.Event()

    def sample():
        me = os.getpid()
        while not stop.is_set():
            kids = [int(c) for c in Path(f"/proc/{me}/task/{me}/children").read_text().split()]
            try:
                peaks["pss"] = max(peaks["pss"], sum(_pss(k) for k in kids))
                peaks["rss"] = max(peaks["rss"], sum(_rss(k) for k in kids))
            except (FileNotFoundError, ProcessLookupError):
                pass
            time.sleep(0.05)

    # two workers on the one GPU (each sees it as its only device)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        job = extract_model(
            {"p": {"fasta": fasta}}, ModelSpec(kind="esm2", source=str(big_model)), "esm", tmp_path / "work", tmp_path / "out",
            ExtractSettings(gpus=2, device="cuda"),
        )  # fmt: skip
    finally:
        stop.set()
        t.join()
    workers = job["run"]["workers"]
    print(f"\n2 GPU workers, bf16: host peak PSS {peaks['pss'] / 2**30:.2f} GiB, RSS {peaks['rss'] / 2**30:.2f} GiB; "
          f"one fp32 copy {file_bytes / 2**30:.2f} GiB; workers {workers}")  # fmt: skip
    assert len(workers) == 2 and all(w.get("chunks", 0) >= 1 for w in workers)
    assert peaks["pss"] <= 1.3 * file_bytes


def test_telemetry_samples_every_gpu_of_a_small_extraction(tmp_path):
    """A tiny ESM-2 on every GPU torch sees, sampled every 0.1 s: the input's telemetry
    file, read by the report's reader, has at least one sample per GPU worker, with
    memory used > 0 (NVML counts the CUDA context at least) and utilisation in 0..100;
    the report's peak per GPU equals the sampler's own; the figure's line per GPU."""
    from ampflow.extract.config import ExtractSettings, ModelSpec
    from ampflow.extract.pool import gpu_slots
    from ampflow.extract.run import extract_model
    from ampflow.extract.tiny import write_esm2
    from ampflow.report import extraction as ex

    n = torch.cuda.device_count()
    model = write_esm2(tmp_path / "esm_tiny", seed=0)
    fasta = tmp_path / "p.fa"
    fasta.write_text("".join(f">p{i}\n{s}\n" for i, s in enumerate(proteins(64, seed=4, lengths=(20, 200)))))
    job = extract_model(
        {"p": {"fasta": fasta}}, ModelSpec(kind="esm2", source=str(model)), "esm", tmp_path / "work", tmp_path / "out",
        ExtractSettings(gpus=n, device="cuda", telemetry_interval=0.1, sequences_per_file=16),
    )  # fmt: skip
    path = tmp_path / "out" / "p.esm.telemetry.jsonl"
    assert path.is_file(), f"no telemetry file at {path}"
    samples = ex.read_gpu_samples(path)
    print(f"\ntelemetry: {len(samples)} samples of {n} GPU(s); notes {samples.attrs['notes']}; sampler {job['run']['gpu']}")
    assert not samples.empty, f"{path}: no sample, notes {samples.attrs['notes']}"
    slots = gpu_slots(n)
    counts = samples.groupby("gpu").size()
    assert sorted(counts.index) == sorted(slots) and counts.min() >= 1, (dict(counts), slots)
    bad = samples[(samples["memory_used_bytes"] <= 0) | ~samples["utilization_pct"].between(0, 100)]
    assert bad.empty, f"{path}: samples with no memory used or utilisation outside 0..100:\n{bad}"
    summary = ex.gpu_summary(samples).set_index("gpu")
    for gpu, own in job["run"]["gpu"].items():
        assert summary.loc[gpu, "peak_memory_gib"] * 2**30 == own["peak_memory_used"], (gpu, own)
    lines = ex.gpu_summary_lines(summary.reset_index())
    assert len(lines) == len(slots) and all(line.startswith("GPU ") and "median utilisation" in line for line in lines)
    assert ex.plot_gpu_timelines(samples, tmp_path / "gpus.png").is_file()


def _oom_child(folder: str, q) -> None:
    import torch

    from ampflow.extract.config import ModelSpec
    from ampflow.extract.models import load_embedder

    torch.cuda.set_per_process_memory_fraction(6 * 2**30 / torch.cuda.get_device_properties(0).total_memory)
    seqs = proteins(64, seed=3, lengths=(900, 1022))
    spec = ModelSpec(kind="esm2", source=folder, dtype="float32", tokens_per_batch=10**6, attention_per_batch=10**12, pack=False)
    big = load_embedder(spec, folder, [33], "cuda")
    got, stats = big.embed(seqs)
    big.tokens_per_batch, big.attention_per_batch = 2048, None
    small, _ = big.embed(seqs)
    # packed without mask, every sequence in one batch of ~61k tokens, 4 GiB allowed
    # (the weights take 2.6): halved until it fits
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(4 * 2**30 / torch.cuda.get_device_properties(0).total_memory)
    big.pack, big.varlen_tokens = True, 10**6
    packed, pstats = big.embed(seqs)
    q.put((got["L33.mean"], small["L33.mean"], stats["splits"], packed["L33.mean"], pstats["splits"]))


def test_a_real_cuda_oom_is_split_and_retried(big_model):
    """With 6 GiB of the GPU allowed and a budget that puts 64 long proteins in one batch,
    CUDA really runs out of memory: the batch is split until it fits, and the vectors
    equal those of small batches (fp32)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_oom_child, args=(str(big_model), q))
    p.start()
    got, small, splits, packed, psplits = q.get(timeout=500)
    p.join()
    diff = float(np.abs(got - small).max())
    pdiff = float(np.abs(packed - small).max())
    print(f"\nreal CUDA OOM: {len(splits)} split(s), first {splits[:3]}; max abs difference to small batches {diff:.2g}; "
          f"packed: {len(psplits)} split(s), difference {pdiff:.2g}")  # fmt: skip
    assert splits and diff < 1e-4
    assert psplits and pdiff < 1e-4
