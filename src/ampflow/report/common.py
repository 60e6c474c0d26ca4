"""What every report figure and page shares: Agg figures, atomic writes, JSONL, HTML."""

from __future__ import annotations

import html
import json
import logging
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from ..base.atomic import atomic_path, write_text_atomic
from ..base.errors import InputError, require_file

log = logging.getLogger(__name__)

#: Okabe-Ito colours: distinct for colour-blind readers, in a fixed order.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
PASS_COLOUR, FAIL_COLOUR, LIMIT_COLOUR = "#0072B2", "#D55E00", "#444444"

GIB = 2**30
MIB = 2**20


def colour(i: int) -> str:
    """The ``i``-th colour of :data:`PALETTE`, cycling."""
    return PALETTE[i % len(PALETTE)]


def new_figure(nrows: int = 1, ncols: int = 1, size=(7.0, 4.5), **kw):
    """A constrained-layout Figure on the Agg canvas (no pyplot, no global state) and its axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes


def save_png(fig, path, dpi: int = 120) -> Path:
    """Write ``fig`` as a PNG at ``path`` (atomically); returns the path."""
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    return path


def note(ax, text: str) -> None:
    """Grey centred text in an empty panel (e.g. "no cells with labels")."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666666", wrap=True)


def read_jsonl(path, what: str, partial_last: bool = False) -> list[dict]:
    """Rows of a JSON-lines file; blank lines skipped, a malformed line is an InputError.

    ``partial_last``: a malformed last line *without* its newline is skipped with a
    warning instead, for files appended line by line by a job that may be killed mid-write
    (a writer ends every line with a newline, so only a cut line lacks one)."""
    path = require_file(path, what)
    rows = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if partial_last and not line.endswith("\n"):  # only the file's last line can lack one
                    log.warning("%s %s, line %d: skipped a half-written last line (%s: %.60r)", what, path, n, e.msg, line)
                    continue
                raise InputError(f"not valid JSON: {e.msg}", path=path, line=n) from None
            if not isinstance(row, dict):
                raise InputError("expected one JSON object per line", path=path, line=n)
            rows.append(row)
    return rows


# ---------------------------------------------------------------- HTML pages
_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.2em; color: #222; font-size: 14px; }
h1 { font-size: 1.35em; margin: 0 0 .4em 0; }
h2 { font-size: 1.1em; margin: 1.2em 0 .4em 0; }
p.lead { color: #555; margin: .2em 0 1em 0; }
table { border-collapse: collapse; margin: .3em 0 1em 0; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f0f3f7; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.bad td { background: #fdecea; }
tr.good td { background: #edf7ed; }
code { background: #f3f3f3; padding: 0 .2em; }
.bar { display: inline-block; height: .8em; background: #0072B2; vertical-align: middle; }
.bar.over { background: #D55E00; }
"""


def esc(value) -> str:
    return html.escape(str(value))


def html_table(df: pd.DataFrame, numeric: Iterable[str] = (), row_class=None, index: bool = False) -> str:
    """A plain HTML table of ``df`` (values escaped); ``numeric`` columns right-aligned,
    ``row_class(row) -> str`` an optional CSS class per row."""
    numeric = set(numeric)
    cols = ([df.index.name or ""] if index else []) + [str(c) for c in df.columns]
    head = "".join(f'<th class="num">{esc(c)}</th>' if c in numeric else f"<th>{esc(c)}</th>" for c in cols)
    body = []
    for idx, row in df.iterrows():
        cells = [f"<td>{esc(idx)}</td>"] if index else []
        for c in df.columns:
            v = row[c]
            text = "" if v is None or (isinstance(v, float) and pd.isna(v)) else v
            cls = ' class="num"' if str(c) in numeric else ""
            cells.append(f"<td{cls}>{esc(text)}</td>")
        cls = row_class(row) if row_class else ""
        body.append(f'<tr class="{cls}">' + "".join(cells) + "</tr>" if cls else "<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def html_page(title: str, parts: Iterable[str], lead: str = "") -> str:
    """A self-contained HTML page (inline CSS, no scripts): the report shows it in a frame."""
    lead_html = f'<p class="lead">{esc(lead)}</p>' if lead else ""
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(title)}</title><style>{_CSS}</style></head>\n"
        f"<body><h1>{esc(title)}</h1>{lead_html}\n" + "\n".join(parts) + "\n</body></html>\n"
    )


def write_html(path, title: str, parts: Iterable[str], lead: str = "") -> Path:
    path = Path(path)
    write_text_atomic(path, html_page(title, parts, lead))
    return path
