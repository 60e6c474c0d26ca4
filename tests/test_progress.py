"""The trainer's progress lines: the ETA against the true remaining time of a run whose
steps take known times (a simulated clock, so the referee is arithmetic, not a timer)."""

from __future__ import annotations

import logging
import re

from ampflow.base.progress import Progress


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _eta(lines):
    return float(re.search(r"ETA (\d+)s", lines[-1]).group(1))


def _run(total, done, step_seconds, first_seconds, restart_after_first, n_steps, caplog):
    clock = Clock()
    log = logging.getLogger("test.progress")
    with caplog.at_level(logging.INFO, logger="test.progress"):
        p = Progress(total, "steps", log, every=0.0, clock=clock, done=done)
        for i in range(n_steps):
            clock.t += first_seconds if i == 0 else step_seconds
            p.update()
            if i == 0 and restart_after_first:
                p.restart_clock()
    return [r.getMessage() for r in caplog.records]


def test_eta_after_twenty_steps_is_the_remaining_time_despite_a_slow_first_step(caplog):
    # 1000 steps of 0.1 s after a first step of 5 s (warm-up): 980 left after 20 -> 98 s
    lines = _run(1000, 0, 0.1, 5.0, True, 20, caplog)
    assert abs(_eta(lines) - 98.0) <= 0.25 * 98.0, lines[-1]
    # counting the warm-up in the rate, as before, reads more than twice that
    caplog.clear()
    assert _eta(_run(1000, 0, 0.1, 5.0, False, 20, caplog)) > 2 * 98.0


def test_a_resumed_run_rates_only_its_own_steps(caplog):
    # resumed at step 500 of 1000: 20 steps of 0.1 s later, 480 left -> 48 s
    lines = _run(1000, 500, 0.1, 0.1, True, 20, caplog)
    assert "520/1000" in lines[-1]
    assert abs(_eta(lines) - 48.0) <= 0.25 * 48.0, lines[-1]
