"""``ampflow <command>``: argument parsing only; each command calls library functions.

One module per stage holds that stage's subcommands (:mod:`.prepare`, :mod:`.amp`,
:mod:`.train`, :mod:`.extract`, :mod:`.report`). Bad input
(:class:`~ampflow.base.errors.InputError`) is printed as one line without a traceback and
exits with status 2; programming errors keep their tracebacks.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from ..base.errors import InputError
from . import amp, extract, prepare, report, train

log = logging.getLogger("ampflow")


def _not_shown(record: logging.LogRecord) -> bool:
    """False for the record of a bad-input error: :func:`main` prints that one line to
    stderr itself, so the terminal shows it once; the log file keeps the record."""
    return not getattr(record, "printed", False)


def _setup_logging(logfile: str | None, verbose: bool) -> None:
    console = logging.StreamHandler(sys.stderr)
    console.addFilter(_not_shown)
    handlers: list[logging.Handler] = [console]
    if logfile:
        Path(logfile).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(logfile, mode="a"))
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=handlers,
        force=True,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ampflow", description=__doc__.splitlines()[0])
    p.add_argument("--log", default=None, help="also append log lines to this file")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)
    for group in (prepare, amp, train, extract, report):
        group.add_commands(sub)
    return p


def main(argv=None) -> int:
    # NVML numbers GPUs by PCI bus, CUDA by default fastest first: on a node of mixed GPUs
    # the plan's device i (NVML) and torch's cuda:i would be different cards. Set before
    # any command touches CUDA (it reads the variable once, at its first call); torchrun's
    # processes and the extraction workers inherit it. A user's own setting is kept.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else map(str, argv))
    _setup_logging(args.log, args.verbose)
    try:
        rc = args.func(args)
    except InputError as e:
        log.error("%s", e, extra={"printed": True})
        print(f"ampflow {args.command}: error: {e}", file=sys.stderr)
        return 2
    return rc or 0
