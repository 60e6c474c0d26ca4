"""Inputs -> sequences the model reads (items) -> chunks of work for the workers.

Each input FASTA is split once into its own folder (``{work}/inputs/{name}/``)::

    split.json   manifest: input size/mtime, split settings, counts, FASTA summary
    records.tsv  every kept record in input order: index, id, lengths, record, line, windows
    items.tsv    what the model reads, in input order: record index, start, end, key
    items.fa     each distinct item once, '>{key}' headers, one line each
    report.tsv   one row per problem record: what was found and what was done

An item is a whole record, or one window of a record under ``too_long: window``. Its
key is the hash of its letters (:func:`item_key`): the cache (``cache.py``) is keyed by
it, so where a sequence sits in which file never matters. The manifest is written last:
when it matches the input (size and modification time) and the settings, the split is
reused without reading the FASTA again.

Then every run writes the queue: the items of all inputs that the cache lacks, each
once, in input order, cut into chunk files (``{work}/queue/chunk-00000.fa``, '>{key}'
headers), small enough that every worker gets several.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..base.atomic import atomic_path, write_text_atomic
from ..io.fasta import FastaCleaner, FastaPolicy, Problem, windows
from .config import ModelSpec

log = logging.getLogger(__name__)

MANIFEST_VERSION = 2
RECORD_COLUMNS = ("index", "id", "length", "original_length", "record", "line", "windows")
ITEM_COLUMNS = ("record", "start", "end", "key")
# chunks per worker the queue aims at: a slow device takes fewer, and the last chunk
# to finish is a small share of the job
CHUNKS_PER_WORKER = 4


def chunk_name(i: int) -> str:
    return f"chunk-{i:05d}"


def item_key(seq: str) -> str:
    """The cache key of a sequence: 128 bits of the sha256 of its letters."""
    return hashlib.sha256(seq.encode()).hexdigest()[:32]


@dataclass
class Manifest:
    """What a split produced (``split.json``)."""

    input: dict
    settings: dict
    summary: dict
    n_records: int
    n_items: int
    n_distinct: int
    version: int = MANIFEST_VERSION
    reused: bool = field(default=False, compare=False)

    def to_json(self) -> str:
        keys = ("version", "input", "settings", "summary", "n_records", "n_items", "n_distinct")
        return json.dumps({k: getattr(self, k) for k in keys}, indent=1, sort_keys=True) + "\n"


def split_settings(spec: ModelSpec, policy: FastaPolicy) -> dict:
    return {"alphabet": spec.alphabet.name, "max_length": spec.letters, "fasta": policy.to_dict()}


def input_stamp(fasta) -> dict:
    st = Path(fasta).stat()
    return {"name": Path(fasta).name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


FILES = ("records.tsv", "items.tsv", "items.fa", "report.tsv")


def _reusable(folder: Path, stamp: dict, settings: dict) -> Manifest | None:
    try:
        d = json.loads((folder / "split.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if d.get("version") != MANIFEST_VERSION or d.get("input") != stamp or d.get("settings") != settings:
        return None
    if not all((folder / f).is_file() for f in FILES):
        return None
    return Manifest(d["input"], d["settings"], d["summary"], d["n_records"], d["n_items"], d["n_distinct"], reused=True)


def _writer(fh, columns):
    """A TSV writer with its header row written (fields with tabs or quotes are quoted)."""
    w = csv.writer(fh, delimiter="\t", lineterminator="\n", quoting=csv.QUOTE_MINIMAL)
    w.writerow(columns)
    return w


def split_fasta(fasta, folder, spec: ModelSpec, policy: FastaPolicy) -> Manifest:
    """Clean ``fasta`` under ``policy`` into ``folder`` (or reuse the last split).

    Raises InputError for a record whose problem's policy is ``fail``.
    """
    folder = Path(folder)
    stamp = input_stamp(fasta)
    settings = split_settings(spec, policy)
    found = _reusable(folder, stamp, settings)
    if found is not None:
        log.info("%s: reusing the split of %d record(s) into %d item(s)", fasta, found.n_records, found.n_items)
        return found

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "split.json").unlink(missing_ok=True)
    cleaner = FastaCleaner(fasta, spec.alphabet, policy, spec.letters)
    seen: set[str] = set()
    n = n_items = 0
    # one pass, streamed: only the current record is in memory (and the keys seen)
    with (
        atomic_path(folder / "records.tsv") as rtmp, open(rtmp, "w", newline="") as rfh,
        atomic_path(folder / "items.tsv") as itmp, open(itmp, "w", newline="") as ifh,
        atomic_path(folder / "items.fa") as ftmp, open(ftmp, "w") as ffh,
    ):  # fmt: skip
        records, items = _writer(rfh, RECORD_COLUMNS), _writer(ifh, ITEM_COLUMNS)
        for rec in cleaner.records():
            spans = windows(len(rec.seq), spec.letters, policy.overlap) if policy.too_long == "window" else [(0, len(rec.seq))]
            records.writerow((n, rec.id, len(rec.seq), rec.original_length, rec.number, rec.line, len(spans)))
            for start, end in spans:
                piece = rec.seq[start:end]
                key = item_key(piece)
                items.writerow((n, start, end, key))
                if key not in seen:
                    seen.add(key)
                    ffh.write(f">{key}\n{piece}\n")
            n_items += len(spans)
            n += 1
    summary = cleaner.summary()
    if not n:
        log.warning("%s: no sequence left after the FASTA policies (%s): the outputs will be empty", fasta, summary)
    with atomic_path(folder / "report.tsv") as tmp, open(tmp, "w", newline="") as fh:
        _writer(fh, Problem.COLUMNS).writerows(p.row() for p in cleaner.problems)
    manifest = Manifest(stamp, settings, summary, n, n_items, len(seen))
    write_text_atomic(folder / "split.json", manifest.to_json())
    log.info(
        "%s: %d record(s) read, %d kept as %d item(s) (%d distinct); %s",
        fasta, summary.get("records", 0), n, n_items, len(seen),
        ", ".join(f"{k} {v}" for k, v in summary.items() if k not in ("records", "kept")) or "no problem found",
    )  # fmt: skip
    return manifest


def read_items_fasta(path):
    """``(key, sequence)`` pairs of an ``items.fa`` or chunk file, in file order."""
    with open(path) as fh:
        while True:
            header = fh.readline()
            if not header:
                return
            yield header[1:].rstrip("\n"), fh.readline().rstrip("\n")


def chunk_size(n_todo: int, workers: int, most: int) -> int:
    """Sequences per chunk: up to ``most``, and few enough that each worker gets
    :data:`CHUNKS_PER_WORKER` chunks (a small job still fills every worker)."""
    return max(1, min(most, math.ceil(n_todo / (max(workers, 1) * CHUNKS_PER_WORKER))))


def write_queue(work, folders: list[Path], cached, workers: int, most: int) -> tuple[list[dict], int, int]:
    """Write the chunk files of every item of ``folders`` that ``cached`` (a set-like of
    keys) lacks, each key once, in input order; the chunks, the items read, the keys
    found in the cache."""
    qdir = Path(work) / "queue"
    shutil.rmtree(qdir, ignore_errors=True)
    qdir.mkdir(parents=True)
    todo: dict[str, str] = {}
    n_items = n_cached = 0
    for folder in folders:
        for key, seq in read_items_fasta(folder / "items.fa"):
            n_items += 1
            if key in cached:
                n_cached += 1
            elif key not in todo:
                todo[key] = seq
    size = chunk_size(len(todo), workers, most)
    chunks, pending = [], []
    for key, seq in todo.items():
        pending.append((key, seq))
        if len(pending) == size:
            chunks.append(_write_chunk(qdir / f"{chunk_name(len(chunks))}.fa", pending))
            pending = []
    if pending:
        chunks.append(_write_chunk(qdir / f"{chunk_name(len(chunks))}.fa", pending))
    return chunks, n_items, n_cached


def _write_chunk(path: Path, records) -> dict:
    data = "".join(f">{key}\n{seq}\n" for key, seq in records).encode()
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return {"name": path.stem, "n": len(records), "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def read_chunk(path, expect_sha256: str) -> tuple[list[str], list[str]]:
    """The keys and sequences of a chunk file, after checking it is the file the queue wrote."""
    data = Path(path).read_bytes()
    if hashlib.sha256(data).hexdigest() != expect_sha256:
        raise RuntimeError(f"{path}: differs from the queue (changed or truncated); run the extraction again")
    lines = data.decode().split("\n")
    n = len(lines) // 2
    return [h[1:] for h in lines[0 : 2 * n : 2]], lines[1 : 2 * n : 2]
