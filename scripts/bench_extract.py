#!/usr/bin/env python
"""Benchmark feature extraction on a real protein set with a randomly initialised ESM-2.

Every figure printed is measured in this run, on the proteins of ``--fasta`` (default:
the 181 Prodigal proteins of ``../shared/data/fasta/vibrant_mixed_example_prodigal.faa``,
31-4,254 residues, cut at 1022 as the extraction does):

1. Batching, one process, ``--threads`` torch threads: length-sorted batches under a
   token budget (``--budget``, what ``ampflow extract`` does) against fixed-size batches
   in input order (size = budget / mean tokens per sequence, the same mean batch). Per
   scheme: batches, padding fraction (padded positions / computed positions), seconds
   (best of ``--repeats``), sequences/s, tokens/s; the ratio sorted / fixed is the
   figure. Both schemes give the same vectors (the largest difference is printed).
2. Workers: the whole job (split, spawn, model loading, chunks, merge) with 1 and with 2
   CPU worker processes of one thread each; sequences/s over the job's wall time and over
   the time the workers computed.
3. The CPU batch rule, one process, ``--threads`` threads: the batches ``ampflow extract``
   makes on the CPU (``plan_batches(..., "cpu", --budget, kind=...)``) against one sequence at a
   time (``tokens_per_batch: 1``) and against the old rule (sorted under a 4096-token
   budget), on the proteins and on the DNA of ``--dna-fasta`` (default: the 10 reads of
   ``virnucpro_sample_viral_test.fasta``) through a DNABERT-S-shaped model
   (``--dna-shape``; ``base`` = DNABERT-S's 768 wide, 12 blocks, 12 heads). The three
   schemes take turns within each repeat (so a change in the machine's load falls on all
   of them); each batch counts with its best of ``--repeats`` + 1 (of all its runs where
   two schemes share it). The figure is default /
   one at a time in sequences/s, which the default rule must keep >= 1.0, printed with
   the load average.
4. GPU, only when CUDA is available: tokens/s of a model of esm2_t33_650M's shape
   (1280 wide, 33 blocks, 20 heads) in float32 and under bfloat16 autocast on the same
   sorted batches, and the mean GPU utilisation the telemetry sampler saw meanwhile.

The model is esm2_t6_8M-shaped by default (``--shape``); its weights are random, which
does not change the work a forward pass does. CPU figures depend on what else the
machine runs: the load average is printed first.

Examples::

    python scripts/bench_extract.py
    python scripts/bench_extract.py --shape t12 --budget 8192 --repeats 5
    python scripts/bench_extract.py --skip-batching --skip-workers --shape t12   # part 3 only
    python scripts/bench_extract.py --quick   # tiny models, a few sequences: does it run
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

try:
    import ampflow  # noqa: F401
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from ampflow.extract.batching import fixed_batches, padding_fraction, plan_batches, token_budget_batches
from ampflow.extract.config import ExtractSettings, ModelSpec
from ampflow.extract.models import Embedder, load_embedder
from ampflow.extract.run import extract_fasta
from ampflow.extract.telemetry import GpuSampler
from ampflow.extract.tiny import ESM2_650M, TINY, esm2_model, write_dnabert_s, write_esm2
from ampflow.io.fasta import DNA, PROTEIN, FastaCleaner, FastaPolicy

REPO = Path(__file__).resolve().parent.parent
DEFAULT_FASTA = REPO.parent / "shared" / "data" / "fasta" / "vibrant_mixed_example_prodigal.faa"
DEFAULT_DNA = REPO.parent / "shared" / "data" / "fasta" / "virnucpro_sample_viral_test.fasta"
SHAPES = {
    "tiny": TINY,
    "t6": {"hidden": 320, "layers": 6, "heads": 20, "intermediate": 1280},  # esm2_t6_8M
    "t12": {"hidden": 480, "layers": 12, "heads": 20, "intermediate": 1920},  # esm2_t12_35M
}
DNA_SHAPES = {
    "tiny": TINY,
    "small": {"hidden": 256, "layers": 4, "heads": 4, "intermediate": 1024},
    "base": {"hidden": 768, "layers": 12, "heads": 12, "intermediate": 3072},  # DNABERT-S
}
OLD_BUDGET = 4096  # the CPU's batches before plan_batches: sorted under the GPU's budget
# the config the bench reads its proteins with: whole headers as ids (Prodigal), ESM-2's limit
POLICY = FastaPolicy(ids="header")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fasta", type=Path, default=DEFAULT_FASTA, help="protein FASTA (default: %(default)s)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="t6", help="ESM-2 size of the CPU parts")
    p.add_argument("--budget", type=int, default=4096, help="tokens per batch (padded length x sequences)")
    p.add_argument("--repeats", type=int, default=2, help="timed passes per scheme (best is reported)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the one-process part")
    p.add_argument("--sequences-per-file", type=int, default=20, help="chunk size of the worker part")
    p.add_argument("--dna-fasta", type=Path, default=DEFAULT_DNA, help="DNA FASTA of part 3 (default: %(default)s)")
    p.add_argument("--dna-shape", choices=sorted(DNA_SHAPES), default="base", help="DNABERT-S size of part 3")
    p.add_argument("--skip-batching", action="store_true", help="leave out part 1")
    p.add_argument("--skip-workers", action="store_true", help="leave out part 2")
    p.add_argument("--quick", action="store_true", help="tiny models, 30 proteins, 1 repeat, no part 2: does it run")
    args = p.parse_args(argv)
    if args.quick:
        args.shape, args.dna_shape, args.repeats, args.skip_workers = "tiny", "tiny", 1, True
    return args


def timed(embedder: Embedder, toks, batches, repeats: int) -> tuple[float, np.ndarray]:
    """Best seconds over ``repeats`` passes of all batches, and the vectors in input order."""
    out = np.empty((len(toks), embedder.dim), dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for b in batches:
            out[b] = embedder.embed_batch([toks[i] for i in b])[embedder.products[0]]
        if embedder.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


def part_batching(args, seqs, folder) -> None:
    import torch

    torch.set_num_threads(args.threads)
    emb = load_embedder(ModelSpec(kind="esm2", tiny=True), folder, [SHAPES[args.shape]["layers"]])
    toks = emb.tokenize(seqs)
    lengths = [len(t.ids) for t in toks]
    size = max(1, round(args.budget / np.mean(lengths)))
    schemes = {
        f"sorted, token budget {args.budget}": token_budget_batches(lengths, args.budget),
        f"input order, {size} per batch": fixed_batches(len(seqs), size),
    }
    print(f"\n1. batching ({args.threads} thread(s), best of {args.repeats})")
    print(f"{'scheme':<34} {'batches':>7} {'padding':>8} {'seconds':>8} {'seq/s':>8} {'tokens/s':>9}")
    rates, pads, vecs = [], [], []
    timed(emb, toks, schemes[next(iter(schemes))][:1], 1)  # warm-up
    for name, batches in schemes.items():
        sec, vec = timed(emb, toks, batches, args.repeats)
        pad = padding_fraction(lengths, batches)
        rates.append(len(seqs) / sec)
        pads.append(pad)
        vecs.append(vec)
        print(f"{name:<34} {len(batches):>7} {100 * pad:>7.1f}% {sec:>8.2f} {rates[-1]:>8.1f} {sum(lengths) / sec:>9.0f}")
    print(f"sorted / input order: {rates[0] / rates[1]:.2f}x sequences/s, padding {100 * pads[0]:.1f}% vs {100 * pads[1]:.1f}%")
    print(f"largest difference between the two schemes' vectors: {np.abs(vecs[0] - vecs[1]).max():.2g} (fp32)")


def part_cpu_rule(args, label: str, emb: Embedder, seqs: list[str]) -> float:
    """Part 3 for one model: the CPU rule against one at a time and the old budget; the
    ratio default / one at a time (sequences/s).

    A scheme's seconds are the sum of its batches' best seconds over the repeats, and a
    batch two schemes share (the same indices: the same computation) counts its best over
    both for both: on a shared machine other processes' bursts hit single batches, and a
    best of whole passes (10 s each) keeps some of them, noise larger than the difference
    measured (the default rule runs most proteins alone, as one at a time does).
    """
    toks = emb.tokenize(seqs)
    lengths = [len(t.ids) for t in toks]
    schemes = {
        f"default CPU rule (budget {args.budget})": plan_batches(lengths, "cpu", args.budget, kind=emb.kind),
        "one at a time (tokens_per_batch 1)": plan_batches(lengths, "cpu", 1, kind=emb.kind),
        f"old: sorted, token budget {OLD_BUDGET}": token_budget_batches(lengths, OLD_BUDGET),
    }
    timed(emb, toks, schemes[next(iter(schemes))][:2], 1)  # warm-up
    best: dict[tuple, float] = {}
    vecs = {name: np.empty((len(seqs), emb.dim), dtype=np.float32) for name in schemes}
    for _ in range(args.repeats + 1):
        for name, batches in schemes.items():
            for b in batches:
                t0 = time.perf_counter()
                vecs[name][b] = emb.embed_batch([toks[i] for i in b])[emb.products[0]]
                best[tuple(b)] = min(best.get(tuple(b), float("inf")), time.perf_counter() - t0)
    sec = {name: sum(best[tuple(b)] for b in batches) for name, batches in schemes.items()}
    print(f"{label}: {len(seqs)} sequences, {min(lengths)}-{max(lengths)} tokens (mean {np.mean(lengths):.0f})")
    print(f"  {'scheme':<38} {'batches':>7} {'padding':>8} {'seconds':>8} {'seq/s':>8} {'vs one':>7}")
    names = list(schemes)
    one = sec[names[1]]
    for name, batches in schemes.items():
        pad = padding_fraction(lengths, batches)
        print(f"  {name:<38} {len(batches):>7} {100 * pad:>7.1f}% {sec[name]:>8.2f} {len(seqs) / sec[name]:>8.1f} {one / sec[name]:>6.2f}x")
    diff = max(float(np.abs(vecs[n] - vecs[names[1]]).max()) for n in names)
    ratio = one / sec[names[0]]
    print(f"  default / one at a time: {ratio:.3f}x sequences/s (load average {os.getloadavg()[0]:.2f}); vectors differ by <= {diff:.2g}")
    return ratio


def part_cpu(args, seqs, folder) -> None:
    import torch

    torch.set_num_threads(args.threads)
    print(f"\n3. CPU batch rule ({args.threads} thread(s), each batch's best of {args.repeats + 1}, schemes in turn)")
    emb = load_embedder(ModelSpec(kind="esm2", tiny=True), folder, [SHAPES[args.shape]["layers"]])
    part_cpu_rule(args, f"ESM-2 {args.shape} shape, proteins of {args.fasta.name}", emb, seqs)
    if not args.dna_fasta.is_file():
        print(f"DNA part skipped: {args.dna_fasta} not found")
        return
    spec = ModelSpec(kind="dnabert_s", tiny=True)
    dna = [r.seq for r in FastaCleaner(args.dna_fasta, DNA, POLICY, spec.letters).records()]
    shape = DNA_SHAPES[args.dna_shape]
    with tempfile.TemporaryDirectory() as tmp:
        emb = load_embedder(spec, write_dnabert_s(Path(tmp) / "dnabert", seed=0, **shape), [shape["layers"]])
    part_cpu_rule(args, f"DNABERT-S {args.dna_shape} shape {shape}, {args.dna_fasta.name}", emb, dna)


def part_workers(args, folder) -> None:
    print(f"\n2. worker processes (whole job, 1 thread each, {args.sequences_per_file} sequences per chunk)")
    print(f"{'workers':>7} {'wall s':>7} {'seq/s':>7} {'compute s':>9} {'seq/s computing':>16}")
    spec = ModelSpec(kind="esm2", tiny=True)
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1, 2):
            out = Path(tmp) / f"w{n}"
            settings = ExtractSettings(sequences_per_file=args.sequences_per_file, fasta=POLICY, device="cpu", cpu_workers=n)
            t0 = time.perf_counter()
            s = extract_fasta(args.fasta, spec, "bench", out / "work", out / "x.h5ad", out / "r.tsv", out / "t.jsonl", settings=settings, model_folder=folder)
            wall = time.perf_counter() - t0
            # the pool's own span: the slowest worker's compute seconds
            busy = max(w.get("seconds", 0.0) for w in s["run"]["workers"])
            rates[n] = s["run"]["computed"] / wall
            print(f"{n:>7} {wall:>7.1f} {rates[n]:>7.1f} {busy:>9.1f} {s['run']['computed'] / busy:>16.1f}")
    print(f"2 workers / 1 worker: {rates[2] / rates[1]:.2f}x sequences/s over the whole job")


def part_gpu(args, seqs) -> None:
    import torch

    if not torch.cuda.is_available():
        print("\n4. GPU part skipped: CUDA is not available")
        return
    from transformers import AutoTokenizer

    print(f"\n4. GPU: esm2_t33_650M shape, random weights, {torch.cuda.get_device_name(0)}")
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = write_esm2(Path(tmp) / "vocab", seed=0)  # the tokenizer files only
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    model = esm2_model(0, **ESM2_650M)
    entry = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    for dtype in ("float32", "bfloat16"):
        emb = Embedder("esm2", model, tokenizer, [ESM2_650M["layers"]], device="cuda", dtype=dtype)
        toks = emb.tokenize(seqs)
        lengths = [len(t.ids) for t in toks]
        batches = token_budget_batches(lengths, args.budget)
        timed(emb, toks, batches[:2], 1)  # warm-up
        with tempfile.TemporaryDirectory() as tmp:
            sampler = GpuSampler(Path(tmp) / "t.jsonl", [entry], interval=0.2).start()
            sec, _ = timed(emb, toks, batches, args.repeats)
            util = sampler.stop().get(entry, {}).get("mean_utilization_gpu", float("nan"))
        print(f"{dtype:>9}: {sum(lengths) / sec:>9.0f} tokens/s, {len(seqs) / sec:>7.1f} sequences/s, mean GPU utilisation {util:.0f}%")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.fasta.is_file():
        print(f"bench_extract: {args.fasta} not found (the shared data folder is absent); nothing measured")
        return 0
    cleaner = FastaCleaner(args.fasta, PROTEIN, POLICY, 1022)
    seqs = [r.seq for r in cleaner.records()][: 30 if args.quick else None]
    lengths = [len(s) for s in seqs]
    print(
        f"{args.fasta.name}: {len(seqs)} proteins, {min(lengths)}-{max(lengths)} residues after the 1022 cut "
        f"(mean {np.mean(lengths):.0f}); ESM-2 {args.shape} shape {SHAPES[args.shape]}, random weights"
    )
    if hasattr(os, "getloadavg"):
        print(f"load average (1 min) before the run: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_esm2(Path(tmp) / "esm2", seed=0, **SHAPES[args.shape])
        if not args.skip_batching:
            part_batching(args, seqs, folder)
        if not args.skip_workers:
            part_workers(args, folder)
        part_cpu(args, seqs, folder)
    if not args.quick:
        part_gpu(args, seqs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
