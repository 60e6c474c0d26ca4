"""Helpers shared by the extraction tests: tiny models built once, random FASTA files."""

from __future__ import annotations

import random
from pathlib import Path

from ampflow.extract.tiny import write_tiny

ALPHABETS = {"esm2": "ACDEFGHIKLMNPQRSTVWY", "dnabert_s": "ACGT"}
_MODELS: dict[str, Path] = {}


def tiny_models_in(tmp_path_factory) -> dict[str, Path]:
    """Tiny ESM-2 and DNABERT-S-shaped model folders, built once per test session."""
    if not _MODELS:
        root = tmp_path_factory.mktemp("models")
        _MODELS.update({kind: write_tiny(kind, root / kind, seed=0) for kind in ALPHABETS})
    return _MODELS


def random_fasta(path: Path, kind: str, n: int, seed: int = 0, lengths=(5, 400)) -> Path:
    """``n`` random sequences of ``kind``'s standard letters, wrapped at 60."""
    rng = random.Random(seed)
    letters = ALPHABETS[kind]
    with open(path, "w") as fh:
        for i in range(n):
            seq = "".join(rng.choice(letters) for _ in range(rng.randint(*lengths)))
            fh.write(f">s{i} sequence {i}\n" + "\n".join(seq[j : j + 60] for j in range(0, len(seq), 60)) + "\n")
    return path
