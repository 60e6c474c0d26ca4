"""FASTA records for feature extraction: parsing, cleaning, and one policy per problem.

Real FASTA files differ: wrapped or one-line sequences, lower case (soft-masked DNA),
a terminal ``*`` after Prodigal proteins, ambiguity codes (protein ``X B Z J U O``, DNA
``N`` and the IUPAC codes), empty records, duplicate ids (Prodigal names every protein
of a contig after the contig's first word), descriptions after the id, CRLF line ends.
:func:`clean_records` turns raw records into the sequences a model sees and says, per
record, what it found and what it did (kept, replaced, truncated, renamed, skipped);
problems whose policy is ``fail`` raise an :class:`~ampflow.base.errors.InputError` with
the file, the record's header line and the value.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from ..base.errors import InputError, reject_unknown_keys
from .textfile import numbered_lines


@dataclass(frozen=True)
class Alphabet:
    """The letters a model kind reads: standard ones, ambiguity codes, and the code
    for "unknown" that ``ambiguous: replace`` writes instead of the others."""

    name: str
    standard: str
    ambiguous: str
    unknown: str
    stop: str = ""

    @property
    def letters(self) -> frozenset:
        return frozenset(self.standard + self.ambiguous)


PROTEIN = Alphabet("protein", "ACDEFGHIKLMNPQRSTVWY", "XBZJUO", "X", stop="*")
DNA = Alphabet("dna", "ACGT", "NRYKMSWBDHV", "N")

# problem -> the actions its policy may take; the first one listed is a key's default
POLICIES = {
    "empty": ("skip", "fail"),
    "invalid": ("fail", "skip"),
    "ambiguous": ("keep", "replace", "skip", "fail"),
    "duplicate_ids": ("fail", "skip", "rename"),
    "too_long": ("truncate", "window", "skip", "fail"),
}
ID_MODES = ("first_word", "header")


@dataclass(frozen=True)
class FastaPolicy:
    """What to do with each kind of problem record (config section ``extract.fasta``).

    empty
        No letters left (after removing a terminal stop): ``skip`` or ``fail``.
    invalid
        Letters outside the alphabet (digits, gaps, an internal ``*``): ``fail`` or ``skip``.
    ambiguous
        Ambiguity codes: ``keep`` (the tokenizer sees them), ``replace`` (each becomes
        ``X`` / ``N``), ``skip`` or ``fail``.
    duplicate_ids
        An id seen before in the file: ``fail``, ``skip`` (the first one is kept) or
        ``rename`` (``id_2``, ``id_3``, ...).
    too_long
        Longer than the model's maximum: ``truncate`` (the first ``max_length`` letters),
        ``window`` (embedded in windows of ``max_length`` letters, see :func:`windows`),
        ``skip`` or ``fail``.
    overlap
        Letters consecutive windows share under ``too_long: window`` (0: tiles, as
        VirNucPro cuts contigs; context at window edges grows with the overlap).
    ids
        ``first_word`` of the header (the FASTA convention) or the whole ``header``.
    """

    empty: str = "skip"
    invalid: str = "fail"
    ambiguous: str = "keep"
    duplicate_ids: str = "fail"
    too_long: str = "truncate"
    overlap: int = 0
    ids: str = "first_word"

    def __post_init__(self):
        for problem, actions in POLICIES.items():
            if getattr(self, problem) not in actions:
                raise InputError(f"must be one of {', '.join(actions)}", key=f"extract.fasta.{problem}", value=getattr(self, problem))
        if not isinstance(self.overlap, int) or self.overlap < 0:
            raise InputError("must be an integer >= 0", key="extract.fasta.overlap", value=self.overlap)
        if self.ids not in ID_MODES:
            raise InputError(f"must be one of {', '.join(ID_MODES)}", key="extract.fasta.ids", value=self.ids)

    @classmethod
    def from_dict(cls, d: dict | None) -> FastaPolicy:
        d = dict(d or {})
        reject_unknown_keys(d, cls, "extract.fasta")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RawRecord:
    """One record as written: its number in the file (1-based), header line number,
    header text (without ``>``) and letters with line breaks and blanks removed."""

    number: int
    line: int
    header: str
    seq: str


@dataclass
class Record:
    """A record as the model will see it."""

    number: int
    line: int
    id: str
    seq: str
    original_length: int


@dataclass
class Problem:
    """One finding on one record: a row of the per-input report."""

    number: int
    line: int
    id: str
    length: int
    problem: str
    action: str
    detail: str

    COLUMNS = ("record", "line", "id", "length", "problem", "action", "detail")

    def row(self) -> tuple:
        return (self.number, self.line, self.id, self.length, self.problem, self.action, self.detail)


def read_fasta(path) -> Iterator[RawRecord]:
    """Yield the records of a FASTA file (plain or gzipped) in file order.

    Lines starting with ``;`` (old comment lines) and blank lines are ignored; anything
    else before the first ``>`` is not FASTA and raises InputError.
    """
    header = None
    start = number = 0
    parts: list[str] = []
    for lineno, text in numbered_lines(path):
        if text.startswith(">"):
            if header is not None:
                yield RawRecord(number, start, header, "".join(parts))
            number += 1
            header, start, parts = text[1:].strip(), lineno, []
        elif text.startswith(";") or not text.strip():
            continue
        elif header is None:
            raise InputError("not FASTA: sequence letters before the first '>' header", path=path, line=lineno, value=text[:40].rstrip())
        else:
            parts.append("".join(text.split()))
    if header is None:
        raise InputError("no FASTA record (no line starting with '>')", path=path)
    yield RawRecord(number, start, header, "".join(parts))


def windows(length: int, window: int, overlap: int = 0) -> list[tuple[int, int]]:
    """``(start, end)`` (0-based, end exclusive) of the windows a record of ``length``
    letters is embedded in under ``too_long: window``.

    Windows of ``window`` letters start every ``window - overlap`` letters; the last one
    ends at the record's end (it starts earlier and overlaps its neighbour more), so every
    window has ``window`` letters and the record is covered once or more. A record that
    fits is one window.
    """
    if length <= window:
        return [(0, length)]
    step = window - overlap
    if step < 1:
        raise InputError(f"must be smaller than the window ({window} letters)", key="extract.fasta.overlap", value=overlap)
    starts = list(range(0, length - window, step)) + [length - window]
    return [(s, s + window) for s in starts]


def _counts(letters) -> str:
    """'2 x N, 1 x R' for a multiset of letters, most frequent first."""
    return ", ".join(f"{n} x {c!r}" for c, n in sorted(Counter(letters).items(), key=lambda kv: (-kv[1], kv[0])))


class FastaCleaner:
    """Apply a :class:`FastaPolicy` to the raw records of one file.

    Parameters
    ----------
    path
        The file (for messages).
    alphabet
        :data:`PROTEIN` or :data:`DNA`.
    policy
        The per-problem actions.
    max_length
        Most letters a model reads (ESM-2: 1022 residues).

    After iterating, ``problems`` holds one :class:`Problem` per finding and
    ``summary()`` the counts.
    """

    def __init__(self, path, alphabet: Alphabet, policy: FastaPolicy, max_length: int):
        self.path = Path(path)
        self.alphabet = alphabet
        self.policy = policy
        self.max_length = max_length
        self.problems: list[Problem] = []
        self.counts = Counter()
        self._seen: dict[str, int] = {}  # id -> header line of its first record

    def _found(self, raw: RawRecord, rid: str, length: int, problem: str, detail: str) -> str:
        action = getattr(self.policy, problem)
        if action == "fail":
            raise InputError(
                f"record {rid!r}: {problem.replace('_', ' ')} ({detail}); set extract.fasta.{problem} "
                f"to one of {', '.join(a for a in POLICIES[problem] if a != 'fail')} to go on",
                path=self.path, line=raw.line, value=raw.header[:80],
            )  # fmt: skip
        done = {
            "skip": "skipped", "keep": "kept", "replace": "replaced", "truncate": "truncated", "rename": "renamed",
            "window": "windowed",
        }[action]  # fmt: skip
        self.problems.append(Problem(raw.number, raw.line, rid, length, problem, done, detail))
        self.counts[f"{problem}_{done}"] += 1
        return action

    def clean(self, raw: RawRecord) -> Record | None:
        """The cleaned record, or None when a policy skips it."""
        self.counts["records"] += 1
        words = raw.header.split()
        if not words:
            raise InputError("record without an id (empty header)", path=self.path, line=raw.line, value=">" + raw.header)
        rid = words[0] if self.policy.ids == "first_word" else " ".join(words)
        seq = raw.seq
        if not seq.isupper():
            if any(c.islower() for c in seq):
                self.counts["lower_case"] += 1
            seq = seq.upper()
        a = self.alphabet
        if a.stop and seq.endswith(a.stop):
            seq = seq.rstrip(a.stop)
            self.counts["stop_removed"] += 1
        if not seq:
            self._found(raw, rid, 0, "empty", "no letters")
            return None
        bad = set(seq) - a.letters
        if bad:
            if self._found(raw, rid, len(seq), "invalid", _counts(c for c in seq if c in bad)) == "skip":
                return None
        amb = set(seq) & set(a.ambiguous)
        if amb:
            action = self._found(raw, rid, len(seq), "ambiguous", _counts(c for c in seq if c in amb))
            if action == "skip":
                return None
            if action == "replace":
                seq = seq.translate({ord(c): a.unknown for c in a.ambiguous})
        original = len(seq)
        if original > self.max_length:
            detail = f"{original} letters, maximum {self.max_length}"
            if self.policy.too_long == "window":
                detail += f"; {len(windows(original, self.max_length, self.policy.overlap))} windows"
            action = self._found(raw, rid, original, "too_long", detail)
            if action == "skip":
                return None
            if action == "truncate":
                seq = seq[: self.max_length]
        if rid in self._seen:
            first = self._seen[rid]
            if self.policy.duplicate_ids == "rename":
                n = 2
                while f"{rid}_{n}" in self._seen:
                    n += 1
                detail = f"first at line {first}; renamed to {rid}_{n}"
                self._found(raw, rid, original, "duplicate_ids", detail)
                rid = f"{rid}_{n}"
            elif self._found(raw, rid, original, "duplicate_ids", f"first at line {first}") == "skip":
                return None
        self._seen[rid] = raw.line
        self.counts["kept"] += 1
        return Record(raw.number, raw.line, rid, seq, original)

    def records(self) -> Iterator[Record]:
        """Cleaned records of the file, in file order."""
        for raw in read_fasta(self.path):
            rec = self.clean(raw)
            if rec is not None:
                yield rec

    def summary(self) -> dict:
        """Counts: records read, kept, and per problem and action."""
        return {k: int(v) for k, v in sorted(self.counts.items())}
