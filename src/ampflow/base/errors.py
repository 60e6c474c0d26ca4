"""One exception family for bad user input, shown without a traceback by the CLI."""

from __future__ import annotations

import json
from pathlib import Path


class InputError(ValueError):
    """Bad user input: says which file, line or key, and which value.

    Parameters
    ----------
    message
        What is wrong, in words a user can act on.
    path
        The file the problem is in.
    line
        1-based line number in ``path`` (if the problem is on a line).
    key
        Config key, column or record name (if the problem is a key).
    value
        The offending value.
    """

    def __init__(self, message, *, path=None, line=None, key=None, value=None):
        # one line, whatever a library's message held (pandas ends some with a newline)
        self.message = " ".join(str(message).split())
        self.path = None if path is None else str(path)
        self.line = line
        self.key = key
        self.value = value
        super().__init__(self._format())

    def _format(self) -> str:
        where = ""
        if self.path is not None:
            where = self.path
            if self.line is not None:
                where += f":{self.line}"
        parts = [f"{where}: " if where else ""]
        if self.key is not None:
            parts.append(f"{self.key}: ")
        parts.append(self.message)
        if self.value is not None:
            parts.append(f" (value: {self.value!r})")
        return "".join(parts)


def require_file(path, what: str = "input file") -> Path:
    """Return ``path`` as a Path, or raise InputError if it is not a readable file."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{what} does not exist", path=p)
    if p.is_dir():
        raise InputError(f"{what} is a directory, expected a file", path=p)
    return p


def read_json(path, what: str = "input file"):
    """The parsed JSON of ``path``; a missing file or bad JSON is an InputError naming it
    (and the line)."""
    p = require_file(path, what)
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"not valid JSON: {e.msg}", path=p, line=e.lineno) from None


def reject_unknown_keys(d: dict, cls, key: str) -> None:
    """Raise InputError if ``d`` (a config section) has keys that are not fields of the
    dataclass ``cls``; ``key`` names the section in the message."""
    from dataclasses import fields

    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise InputError(f"unknown key(s); known: {sorted(known)}", key=key, value=unknown)


def read_fields(cls, d, key: str, **convert):
    """``cls(**d)`` for a JSON object ``d`` holding fields of the dataclass ``cls``: not an
    object, an unknown key or a value ``convert[name]`` cannot read is an InputError naming
    ``key`` (``key.name`` for a value); None is kept as None. An InputError a converter
    raises (a nested section naming its own key) passes unchanged."""
    if not isinstance(d, dict):
        raise InputError("must be a JSON object", key=key, value=type(d).__name__)
    reject_unknown_keys(d, cls, key)
    kw = {}
    for name, v in d.items():
        try:
            kw[name] = convert[name](v) if name in convert and v is not None else v
        except InputError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise InputError(f"malformed ({type(e).__name__}: {e})", key=f"{key}.{name}", value=v) from None
    return cls(**kw)
