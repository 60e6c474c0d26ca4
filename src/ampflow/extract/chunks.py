"""Split a FASTA file into chunk files in the job's work folder.

Layout of ``work`` (one folder per input and model, outside Snakemake's declared
outputs, so a failed job does not delete finished chunks)::

    split.json          manifest: input size/mtime, split settings, chunks (name, count, sha256)
    sequences.tsv       every kept sequence in input order: index, id, lengths, record, line
    report.tsv          one row per problem record: what was found and what was done
    chunks/chunk-00000.fa   cleaned sequences, '>{index}' headers, one line each
    out/chunk-00000.npy, out/chunk-00000.done   vectors and marker (see markers.py)

Chunk names and contents depend only on the input and the split settings, so they are
the same on every run. The manifest is written last: when it matches the input (size
and modification time) and the settings, the chunks are reused without reading the
FASTA again.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from ..io.atomic import atomic_path, write_text_atomic
from ..io.fasta import FastaCleaner, FastaPolicy, Problem
from .config import ModelSpec

log = logging.getLogger(__name__)

MANIFEST_VERSION = 1


def chunk_name(i: int) -> str:
    return f"chunk-{i:05d}"


@dataclass
class Manifest:
    """What a split produced (``split.json``)."""

    input: dict
    settings: dict
    chunks: list[dict]  # name, n, sha256, bytes
    summary: dict
    n_sequences: int
    version: int = MANIFEST_VERSION
    reused: bool = field(default=False, compare=False)

    def to_json(self) -> str:
        d = {k: getattr(self, k) for k in ("version", "input", "settings", "chunks", "summary", "n_sequences")}
        return json.dumps(d, indent=1, sort_keys=True) + "\n"


def split_settings(spec: ModelSpec, policy: FastaPolicy, sequences_per_file: int) -> dict:
    return {
        "alphabet": spec.alphabet.name,
        "max_length": spec.letters,
        "fasta": policy.to_dict(),
        "sequences_per_file": sequences_per_file,
    }


def input_stamp(fasta) -> dict:
    st = Path(fasta).stat()
    return {"name": Path(fasta).name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _reusable(work: Path, stamp: dict, settings: dict) -> Manifest | None:
    path = work / "split.json"
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if d.get("version") != MANIFEST_VERSION or d.get("input") != stamp or d.get("settings") != settings:
        return None
    for c in d["chunks"]:
        p = work / "chunks" / f"{c['name']}.fa"
        if not p.is_file() or p.stat().st_size != c["bytes"]:
            return None
    if not (work / "sequences.tsv").is_file() or not (work / "report.tsv").is_file():
        return None
    return Manifest(d["input"], d["settings"], d["chunks"], d["summary"], d["n_sequences"], reused=True)


def _write_chunk(path: Path, records) -> dict:
    data = "".join(f">{index}\n{seq}\n" for index, seq in records).encode()
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return {"name": path.stem, "n": len(records), "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


SEQUENCE_COLUMNS = ("index", "id", "length", "original_length", "record", "line")


def _writer(fh, columns):
    """A TSV writer with its header row written (fields with tabs or quotes are quoted)."""
    w = csv.writer(fh, delimiter="\t", lineterminator="\n", quoting=csv.QUOTE_MINIMAL)
    w.writerow(columns)
    return w


def split_fasta(fasta, work, spec: ModelSpec, policy: FastaPolicy, sequences_per_file: int) -> Manifest:
    """Clean ``fasta`` under ``policy`` and write its chunks (or reuse the last split).

    Raises InputError for a record whose problem's policy is ``fail``.
    """
    work = Path(work)
    stamp = input_stamp(fasta)
    settings = split_settings(spec, policy, sequences_per_file)
    found = _reusable(work, stamp, settings)
    if found is not None:
        log.info("%s: reusing the split of %d sequences into %d chunk(s)", fasta, found.n_sequences, len(found.chunks))
        return found

    cleaner = FastaCleaner(fasta, spec.alphabet, policy, spec.letters)
    chunk_dir = work / "chunks"
    chunk_dir.mkdir(parents=True, exist_ok=True)
    chunks: list[dict] = []
    pending: list[tuple[int, str]] = []
    n = 0
    # one pass, streamed: only the current chunk's sequences are in memory
    with atomic_path(work / "sequences.tsv") as tmp, open(tmp, "w", newline="") as fh:
        table = _writer(fh, SEQUENCE_COLUMNS)
        for rec in cleaner.records():
            table.writerow((n, rec.id, len(rec.seq), rec.original_length, rec.number, rec.line))
            pending.append((n, rec.seq))
            n += 1
            if len(pending) == sequences_per_file:
                chunks.append(_write_chunk(chunk_dir / f"{chunk_name(len(chunks))}.fa", pending))
                pending = []
        if pending:
            chunks.append(_write_chunk(chunk_dir / f"{chunk_name(len(chunks))}.fa", pending))
    summary = cleaner.summary()
    if not n:
        log.warning("%s: no sequence left after the extract.fasta policies (%s): the outputs will be empty", fasta, summary)

    # chunks of an earlier, longer split are no longer part of this one
    names = {c["name"] for c in chunks}
    for old in chunk_dir.glob("chunk-*.fa"):
        if old.stem not in names:
            old.unlink()
            for p in (work / "out").glob(f"{old.stem}.*"):
                p.unlink()
    with atomic_path(work / "report.tsv") as tmp, open(tmp, "w", newline="") as fh:
        _writer(fh, Problem.COLUMNS).writerows(p.row() for p in cleaner.problems)
    manifest = Manifest(stamp, settings, chunks, summary, n)
    write_text_atomic(work / "split.json", manifest.to_json())
    log.info(
        "%s: %d record(s) read, %d kept in %d chunk(s) of up to %d; %s",
        fasta, summary.get("records", 0), n, len(chunks), sequences_per_file,
        ", ".join(f"{k} {v}" for k, v in summary.items() if k not in ("records", "kept")) or "no problem found",
    )  # fmt: skip
    return manifest


def read_chunk(path, expect_sha256: str) -> list[str]:
    """The sequences of a chunk file, after checking it is the file the split wrote."""
    data = Path(path).read_bytes()
    if hashlib.sha256(data).hexdigest() != expect_sha256:
        raise RuntimeError(f"{path}: differs from the split manifest (changed or truncated); remove split.json to split again")
    lines = data.decode().split("\n")
    return lines[1::2][: len(lines) // 2]
