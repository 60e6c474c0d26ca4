"""Periodic progress lines (count, rate, ETA) for long loops, written through logging."""

from __future__ import annotations

import logging
import time


class Progress:
    """Log ``done/total``, rate and ETA at most every ``every`` seconds (and at the end).

    Parameters
    ----------
    total
        Number of items expected.
    what
        Noun for the items, e.g. ``"cells"``.
    logger
        Where the lines go (the rule's ``log:`` file via the CLI's handler).
    """

    def __init__(self, total: int, what: str, logger: logging.Logger, every: float = 5.0, verb: str = "done", clock=time.monotonic, done: int = 0):
        self.total = total
        self.what = what
        self.logger = logger
        self.every = every
        self.verb = verb
        self.clock = clock
        self.done = done  # items done before this run (a resumed one): not in the rate
        self.start = clock()
        self._base = done  # items done when the clock (re)started
        self._last = self.start

    def update(self, n: int = 1) -> None:
        self.done += n
        now = self.clock()
        if now - self._last >= self.every or self.done >= self.total:
            self._last = now
            self.logger.info(self.line(now))

    def restart_clock(self) -> None:
        """Rates and ETA from now on, over the items done from now on (e.g. once workers
        have loaded their model, or after a first step that paid for warming up)."""
        self.start = self._last = self.clock()
        self._base = self.done

    def line(self, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        elapsed = max(now - self.start, 1e-9)
        rate = (self.done - self._base) / elapsed
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        pct = 100.0 * self.done / self.total if self.total else 100.0
        eta = f"{left:.0f}s" if left != float("inf") else "?"
        return f"{self.verb} {self.done}/{self.total} {self.what} ({pct:.1f}%), {rate:.1f} {self.what}/s, ETA {eta}"


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; binary units up to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.2f} TiB"
