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
   the load average. Also packed batches (``pack: true`` on the CPU:
   ``plan_varlen``, short sequences one after another, up to 256 tokens, attention
   per sequence, no mask), which the CPU default leaves off.
4. GPU, only when CUDA is available: tokens/s of a model of esm2_t33_650M's shape
   (1280 wide, 33 blocks, 20 heads) in float32 and under bfloat16 autocast on the same
   sorted batches, and the mean GPU utilisation the telemetry sampler saw meanwhile.

5. ``--device cuda --dtype bfloat16`` (alone: parts 1-4 do not run, and nothing is read
   from ``../shared``): per GPU, per model shape (``--device-shapes``: ESM-2 650M and 3B,
   ESM C 600M, DNABERT-S; random weights built in code from the published configs, never
   downloaded) and input set (synthetic inputs drawn with a seed from the real files'
   length quantiles, :data:`LENGTH_QUANTILES`), through ``Embedder.embed``: tokens/s and
   sequences/s packed without mask (``varlen``), padded, packed rows with a
   block-diagonal mask (``masked``, ESM-2 and ESM C) and one sequence at a time
   (``alone``, on a sample), each against the floor the card's own measured bf16 matmul
   rate sets (2 x parameters FLOP per token), with the padding fraction and peak memory;
   then the cosine of the packed vectors to the ones alone, the attention kernel chosen,
   and the components of a profiler trace of one packed pass (attention, matmul, layer
   norm, gather, elementwise; host = the wall time the GPU was idle). ``--quick-gpu`` is
   the short version ``make gpu-check`` runs (the mixed proteins and the viral reads, 600
   each, one repeat). ``--device cpu --device-shapes tiny,tiny_esmc,tiny_dna`` runs the
   same code on the CPU (the tests do).

The model is esm2_t6_8M-shaped by default (``--shape``); its weights are random, which
does not change the work a forward pass does. CPU figures depend on what else the
machine runs: the load average is printed first.

Examples::

    python scripts/bench_extract.py
    python scripts/bench_extract.py --shape t12 --budget 8192 --repeats 5
    python scripts/bench_extract.py --skip-batching --skip-workers --shape t12   # part 3 only
    python scripts/bench_extract.py --quick   # tiny models, a few sequences: does it run
    python scripts/bench_extract.py --device cuda --dtype bfloat16   # part 5, on a GPU node
    python scripts/bench_extract.py --quick-gpu   # its short version (make gpu-check)
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

from ampflow.extract.batching import fixed_batches, padding_fraction, plan_batches, plan_varlen, token_budget_batches
from ampflow.extract.config import ExtractSettings, ModelSpec
from ampflow.extract.dnabert import DnabertConfig, DnabertModel
from ampflow.extract.esmc import EsmcConfig, EsmcModel, EsmcTokenizer
from ampflow.extract.models import PACKABLE, Embedder, load_embedder
from ampflow.extract.run import extract_fasta
from ampflow.extract.telemetry import GpuSampler
from ampflow.extract.tiny import ESM2_650M, TINY, dna_tokenizer, esm2_model, write_dnabert_s, write_esm2
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
# Part 5's model shapes: esm2_t33_650M_UR50D and esm2_t36_3B_UR50D (their config.json),
# ESM C 600M (esm/pretrained.py) and DNABERT-S (its config.json); (kind, shape)
DEVICE_SHAPES = {
    "tiny": ("esm2", TINY),
    "tiny_esmc": ("esmc", {"d_model": 32, "n_heads": 4, "n_layers": 2}),
    "tiny_dna": ("dnabert_s", {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}),
    "650M": ("esm2", ESM2_650M),
    "3B": ("esm2", {"hidden": 2560, "layers": 36, "heads": 40, "intermediate": 10240}),
    "esmc600M": ("esmc", {"d_model": 1152, "n_heads": 18, "n_layers": 36}),
    "dnabert_s": ("dnabert_s", {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}),
}
# The targets for the packed path on the mixed protein set, as shares of the floor
TARGETS = {("3B", "prodigal_proteins"): 0.50, ("650M", "prodigal_proteins"): 0.35}
# Length quantiles (0, 5, ..., 100 %) of real inputs, letters per sequence, computed once
# with numpy.percentile from the files of ../shared/data/fasta/ (2026-11-26) and written
# here so that the benchmark travels without that folder: (file, sequences, quantiles).
LENGTH_QUANTILES = {
    # Prodigal proteins of VIBRANT's mixed example (metagenomic proteins, 31-4,254)
    "prodigal_proteins": (
        "vibrant_mixed_example_prodigal.faa",
        181,
        [31, 53, 66, 79, 89, 96, 106, 112, 116, 139, 159, 181, 208, 255, 290, 317, 365, 410, 483, 659, 4254],
    ),
    # UniProt proteins of the ESM examples
    "esm_proteins": ("esm_some_proteins.fasta", 15, [71, 77, 87, 98, 99, 100, 107, 124, 142, 153, 156, 202, 304, 435, 487, 552, 613, 653, 793, 898, 935]),
    # a phage's proteins (VIBRANT's Microviridae example)
    "viral_proteins": (
        "vibrant_Microviridae_MH552510.2.faa",
        12,
        [68, 68, 70, 79, 85, 85, 88, 93, 94, 94, 278, 461, 461, 462, 467, 470, 470, 548, 672, 694, 694],
    ),
    # viral DNA: VirNucPro's reads (all 298 nt) and VIBRANT's mixed genomes
    "viral_reads": ("virnucpro_sample_viral_test.fasta", 10, [298] * 21),
    "viral_genomes": (
        "vibrant_mixed_example.fasta",
        10,
        [910, 910, 910, 1473, 2198, 3289, 4673, 5707, 6039, 6385, 6842, 7298, 7404, 7466, 11368, 17190, 21045, 22444, 30180, 60102, 90023],
    ),
}
PROTEIN_SETS = ("prodigal_proteins", "esm_proteins", "viral_proteins")
DNA_SETS = ("viral_reads", "viral_genomes")
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
    p.add_argument("--device", choices=["cpu", "cuda"], help="part 5 only, on this device (synthetic inputs)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="part 5's dtype (the CPU uses float32)")
    p.add_argument("--device-shapes", default="650M,3B,esmc600M,dnabert_s", help="part 5's model shapes, of " + ", ".join(DEVICE_SHAPES))
    p.add_argument("--device-sets", default=",".join(PROTEIN_SETS), help="part 5's protein input sets, of " + ", ".join(PROTEIN_SETS))
    p.add_argument("--device-dna-sets", default=",".join(DNA_SETS), help="part 5's DNA input sets (DNABERT-S), of " + ", ".join(DNA_SETS))
    p.add_argument("--device-n", type=int, default=2000, help="synthetic proteins per input set in part 5")
    p.add_argument("--device-dna-n", type=int, default=2000, help="synthetic DNA sequences per input set in part 5")
    p.add_argument("--alone-n", type=int, default=64, help="part 5's sample run one sequence at a time (and the cosine check)")
    p.add_argument("--profile-n", type=int, default=400, help="sequences of part 5's profiled packed pass")
    p.add_argument(
        "--quick-gpu",
        action="store_true",
        help="part 5's short version (gpu-check): 650M, 3B, ESM C 600M, DNABERT-S on the mixed proteins and viral reads, 1 repeat",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic sequences")
    args = p.parse_args(argv)
    for name in args.device_shapes.split(","):
        if name not in DEVICE_SHAPES:
            p.error(f"--device-shapes: unknown shape {name!r} (known: {', '.join(DEVICE_SHAPES)})")
    for name in args.device_sets.split(","):
        if name not in PROTEIN_SETS:
            p.error(f"--device-sets: unknown input set {name!r} (known: {', '.join(PROTEIN_SETS)})")
    for name in args.device_dna_sets.split(","):
        if name not in DNA_SETS:
            p.error(f"--device-dna-sets: unknown input set {name!r} (known: {', '.join(DNA_SETS)})")
    if args.quick_gpu:
        args.device = args.device or "cuda"
        args.device_sets, args.device_dna_sets, args.repeats = "prodigal_proteins", "viral_reads", 1
        args.device_n, args.device_dna_n, args.alone_n, args.profile_n = 600, 600, 32, 200
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
    # pack: true on the CPU: its batches, sequences one after another, no mask
    packed = plan_varlen(lengths, "cpu", args.budget, kind=emb.kind)
    schemes["packed, no mask (pack: true)"] = packed
    rows = {("packed", *b) for b in packed}

    def key(name: str, b: list[int]) -> tuple:
        return ("packed", *b) if name.startswith("packed") else tuple(b)

    timed(emb, toks, schemes[next(iter(schemes))][:2], 1)  # warm-up
    best: dict[tuple, float] = {}
    vecs = {name: np.empty((len(seqs), emb.dim), dtype=np.float32) for name in schemes}
    for _ in range(args.repeats + 1):
        for name, batches in schemes.items():
            for b in batches:
                k = key(name, b)
                members = [toks[i] for i in b]
                t0 = time.perf_counter()
                got = emb.embed_varlen(members) if k in rows else emb.embed_batch(members)
                vecs[name][b] = got[emb.products[0]]
                best[k] = min(best.get(k, float("inf")), time.perf_counter() - t0)
    sec = {name: sum(best[key(name, b)] for b in batches) for name, batches in schemes.items()}
    print(f"{label}: {len(seqs)} sequences, {min(lengths)}-{max(lengths)} tokens (mean {np.mean(lengths):.0f})")
    print(f"  {'scheme':<38} {'batches':>7} {'padding':>8} {'seconds':>8} {'seq/s':>8} {'vs one':>7}")
    names = list(schemes)
    one = sec[names[1]]
    for name, batches in schemes.items():
        pad = padding_fraction(lengths, batches)
        if name.startswith("packed"):
            pad = 0.0
        print(f"  {name:<38} {len(batches):>7} {100 * pad:>7.1f}% {sec[name]:>8.2f} {len(seqs) / sec[name]:>8.1f} {one / sec[name]:>6.2f}x")
    diff = max(float(np.abs(vecs[n] - vecs[names[1]]).max()) for n in names)
    ratio = one / sec[names[0]]
    print(f"  default / one at a time: {ratio:.3f}x sequences/s (load average {os.getloadavg()[0]:.2f}); vectors differ by <= {diff:.2g}")
    print(f"  packed / one at a time: {one / sec[names[3]]:.3f}x sequences/s")
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


def synthetic_lengths(name: str, n: int, seed: int) -> np.ndarray:
    """``n`` lengths drawn from the quantiles of :data:`LENGTH_QUANTILES` ``[name]``
    (inverse transform, linear between quantiles): the real file's distribution, at any n."""
    _, _, q = LENGTH_QUANTILES[name]
    u = np.random.default_rng(seed).random(n) * 100
    return np.rint(np.interp(u, np.linspace(0, 100, len(q)), q)).astype(int)


def synthetic_sequences(name: str, n: int, seed: int, letters: str = "ACDEFGHIKLMNPQRSTVWY") -> list[str]:
    """Random sequences of :func:`synthetic_lengths` (same seed, same sequences)."""
    rng = np.random.default_rng(seed + 1)
    alphabet = np.array(list(letters))
    return ["".join(rng.choice(alphabet, size=int(k))) for k in synthetic_lengths(name, n, seed)]


def matmul_rate(device: str, dtype, size: int) -> float:
    """The card's measured matmul FLOP/s in ``dtype`` (square products of ``size``): the
    rate the model's floor is set against, not the data sheet's."""
    import torch

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 20 if device == "cuda" else 3
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * size**3 * reps / (time.perf_counter() - t0)


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def build_device_model(shape_name: str, device: str, tdtype):
    """(kind, model, tokenizer, depth, non-embedding parameters) of a part 5 shape, random
    weights built on ``device`` in ``tdtype`` (never downloaded)."""
    import torch

    kind, shape = DEVICE_SHAPES[shape_name]
    with torch.device(device):
        if kind == "esm2":
            from transformers import AutoTokenizer

            with tempfile.TemporaryDirectory() as tmp:
                tokenizer = AutoTokenizer.from_pretrained(str(write_esm2(Path(tmp) / "vocab", seed=0)), local_files_only=True)
            model = esm2_model(0, **shape)
            depth = shape["layers"]
        elif kind == "esmc":
            torch.manual_seed(0)
            model = EsmcModel(EsmcConfig(**shape))
            tokenizer, depth = EsmcTokenizer(), shape["n_layers"]
        else:
            tokenizer = dna_tokenizer(0)
            torch.manual_seed(0)
            model = DnabertModel(DnabertConfig(vocab_size=len(tokenizer), **shape))
            depth = shape["num_hidden_layers"]
    model = model.to(tdtype).eval()
    embedding = ("embeddings.", "embed.", "sequence_head.", "pooler.", "contact_head.")  # lookups, heads never run
    # 2 x parameters FLOP per token: the blocks' weights (the embedding is a lookup)
    params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith(embedding))
    return kind, model, tokenizer, depth, params


# kernel names -> the components the profile reports (first match wins); inductor's
# fused pointwise / reduction kernels (triton_poi_fused__to_copy_cat_mul...: the rotary,
# GELU) name the operations they fuse, copy and cat among them: elementwise, not copies
COMPONENTS = (
    ("attention", ("flash", "fmha", "attention", "attn", "flex", "triton_tem", "sdpa", "softmax")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "addmm", "aten::mm", "linear", "bmm")),
    ("layer norm", ("layer_norm", "layernorm")),
    ("elementwise", ("triton_poi", "triton_red", "triton_per")),
    ("gather/copy", ("index", "gather", "scatter", "embedding", "bincount", "cat", "copy", "memcpy", "memset", "repeat_interleave")),
)


def component(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in COMPONENTS if any(k in low for k in keys)), "elementwise")


def profile_components(emb: Embedder, seqs: list[str], device: str) -> tuple[dict, float]:
    """Where one packed ``embed`` spends its time: device kernel time per component
    (CPU: the operators' own time) and ``host``, the wall time the device was idle;
    seconds each, and the wall seconds."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        emb.embed(seqs)
        sync(device)
    wall = time.perf_counter() - t0
    out: dict[str, float] = {}
    if device == "cuda":
        for e in prof.events():
            # user annotations on the device (torch.compile's "Torch-Compiled Region",
            # inductor's "## Call CompiledFxGraph") span kernels already counted
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation:
                c = component(e.name)
                out[c] = out.get(c, 0.0) + e.time_range.elapsed_us() / 1e6
    else:
        for e in prof.key_averages():
            if e.key.startswith("aten::"):
                c = component(e.key)
                out[c] = out.get(c, 0.0) + e.self_cpu_time_total / 1e6
    busy = sum(out.values())
    out["host"] = max(0.0, wall - busy) if device == "cuda" else 0.0
    return out, wall


def part_device(args) -> list[dict]:
    """Part 5: per shape and input set, packed without mask (``varlen``), padded (the
    GPU's path before it), packed rows with a block-diagonal mask (``masked``, ESM-2 and
    ESM C) and one sequence at a time (``alone``, on a sample), each through
    ``Embedder.embed`` (the extraction's own batching), median of ``--repeats`` runs
    against the floor the card's measured matmul rate sets; then the profile of one
    packed pass and the cosine of packed against alone vectors."""
    import torch

    device = args.device
    dtype = args.dtype if device == "cuda" else "float32"
    tdtype = getattr(torch, dtype)
    if device == "cuda" and not torch.cuda.is_available():
        print("part 5: --device cuda but CUDA is not available; nothing measured")
        return []
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    rate = matmul_rate(device, tdtype, 8192 if device == "cuda" else 512)
    print(f"\n5. {name}, torch {torch.__version__}, {dtype}: measured matmul rate {rate / 1e12:.3g} TFLOP/s; "
          f"median of {args.repeats} run(s); seed {args.seed}")  # fmt: skip
    print(f"{'shape':<10} {'input set':<18} {'path':<7} {'seqs':>6} {'tokens':>9} {'padding':>8} {'seconds':>8} "
          f"{'tokens/s':>10} {'seq/s':>8} {'of floor':>8} {'peak MiB':>9}")  # fmt: skip
    rows = []
    for shape_name in args.device_shapes.split(","):
        t_build = time.perf_counter()
        kind, model, tokenizer, depth, params = build_device_model(shape_name, device, tdtype)
        print(f"{shape_name:<10} {kind}, {params / 1e6:.0f}M block parameters, built in {time.perf_counter() - t_build:.1f} s")
        sets = args.device_dna_sets if kind == "dnabert_s" else args.device_sets
        for set_name in sets.split(","):
            if kind == "dnabert_s":
                seqs = [s[:10000] for s in synthetic_sequences(set_name, args.device_dna_n, args.seed, letters="ACGT")]
            else:
                seqs = [s[:1022] for s in synthetic_sequences(set_name, args.device_n, args.seed)]
            sample = seqs[: args.alone_n]
            paths = ["varlen", "padded"] + (["masked"] if kind in PACKABLE else []) + ["alone"]
            got: dict[str, dict] = {}
            vectors: dict[str, np.ndarray] = {}
            for path in paths:
                pack = path in ("varlen", "masked")
                emb = Embedder(
                    kind, model, tokenizer, [depth], device=device, dtype=dtype, pack=pack, packed_attention="mask" if path == "masked" else "varlen"
                )
                if path == "alone":
                    emb.tokens_per_batch = 1  # one sequence per batch on any device
                todo = sample if path == "alone" else seqs
                # warm-up: the kernels of every shape (flex_attention compiles per length)
                emb.embed(todo if path == "varlen" and emb.attention_backend == "flex" else todo[:16])
                runs = []
                for _ in range(args.repeats):
                    base = 0
                    if device == "cuda":
                        sync(device)
                        torch.cuda.reset_peak_memory_stats()
                        base = torch.cuda.memory_allocated()
                    t0 = time.perf_counter()
                    out, stats = emb.embed(todo)
                    sync(device)
                    sec = time.perf_counter() - t0
                    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device == "cuda" else float("nan")
                    runs.append((sec, peak, stats, out))
                sec = float(np.median([r[0] for r in runs]))
                peak = max(r[1] for r in runs)
                stats, out = runs[0][2], runs[0][3]
                vectors[path] = out[emb.products[0]][: len(sample)]
                floor = 2 * params * stats["tokens"] / rate
                row = {
                    "shape": shape_name, "kind": kind, "set": set_name, "path": path, "sequences": len(todo), "tokens": stats["tokens"],
                    "padding": 1 - stats["tokens"] / stats["padded_tokens"], "seconds": sec, "tokens_per_s": stats["tokens"] / sec,
                    "sequences_per_s": len(todo) / sec, "floor_seconds": floor, "of_floor": floor / sec, "peak_mib": peak,
                    "attention": stats.get("attention"), "tokens_per_batch": stats.get("tokens_per_batch"), "batches": stats["batches"],
                }  # fmt: skip
                rows.append(row)
                got[path] = row
                print(f"{shape_name:<10} {set_name:<18} {path:<7} {len(todo):>6} {stats['tokens']:>9} "
                      f"{100 * row['padding']:>7.1f}% {sec:>8.2f} {row['tokens_per_s']:>10.0f} {row['sequences_per_s']:>8.1f} "
                      f"{100 * row['of_floor']:>7.1f}% {peak:>9.0f}")  # fmt: skip
                if path == "varlen":
                    varlen_emb = emb
            v = got["varlen"]
            ratios = "; ".join(f"varlen / {p}: {v['tokens_per_s'] / got[p]['tokens_per_s']:.2f}x tokens/s" for p in paths[1:])
            print(f"{shape_name:<10} {set_name:<18} {ratios}")
            c = cosines(vectors["varlen"], vectors["alone"])
            print(f"{shape_name:<10} {set_name:<18} cosine varlen vs alone ({len(sample)} sequences): min {c.min():.6f}, "
                  f"attention {v['attention']}, {v['tokens_per_batch']} tokens per batch, {v['batches']} batches")  # fmt: skip
            got["varlen"]["min_cosine"] = float(c.min())
            comp, wall = profile_components(varlen_emb, seqs[: args.profile_n], device)
            total = sum(comp.values()) or 1.0
            top = ", ".join(f"{k} {100 * t / total:.0f}% ({1e3 * t:.0f} ms)" for k, t in sorted(comp.items(), key=lambda kv: -kv[1]))
            print(f"{shape_name:<10} {set_name:<18} profile of varlen ({min(args.profile_n, len(seqs))} sequences, {wall:.2f} s): {top}")
            got["varlen"]["profile"] = comp
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    for r in rows:
        want = TARGETS.get((r["shape"], r["set"]))
        if r["path"] == "varlen" and want is not None:
            print(f"target {r['shape']} {r['set']}: varlen at {100 * r['of_floor']:.1f}% of the floor, target {100 * want:.0f}%: "
                  f"{'MET' if r['of_floor'] >= want else 'BELOW'}")  # fmt: skip
    return rows


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device:
        part_device(args)
        return 0
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
