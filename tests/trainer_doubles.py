"""A trainer killed after a given step, as a test double.

:class:`StoppingTrainer` is the real :class:`~ampflow.train.trainer.Trainer` that dies
(:class:`Killed`) when it is about to start step ``stop_after + 1`` or to write its
outputs after step ``stop_after``: whatever the real loop did up to there (the metrics rows,
the checkpoints due, an epoch's or a stage's end) is on disk or lost as it would be on a
kill. Its :meth:`fit` returns False then, as a run that did not finish.

A training run in processes of its own (``ampflow train``, torchrun's ranks) gets the same
from the environment :func:`stop_env` makes: a ``sitecustomize.py`` first on PYTHONPATH
(:mod:`process_doubles`) loads this file in every Python process where :data:`ENV` is set,
and :func:`install` makes the real ``Trainer`` stop so the moment ``ampflow.train.trainer``
is imported. ``ampflow train``
then exits 0, as after any ``fit()`` (the next run resumes).
"""

from __future__ import annotations

from pathlib import Path

from process_doubles import after_import, process_env

ENV = "AMPFLOW_TEST_STOP_AFTER"


class Killed(Exception):
    """The double's stand-in for the process being killed."""


def make_stopping(trainer_cls, stop_after: int | None = None):
    """Patch ``trainer_cls`` in place so that every instance stops after ``stop_after``
    steps (its own ``stop_after`` attribute wins where it has one)."""
    real_step, real_outputs, real_fit = trainer_cls._train_step, trainer_cls._write_outputs, trainer_cls.fit

    def limit(self) -> int | None:
        own = getattr(self, "stop_after", None)
        return stop_after if own is None else own

    def _train_step(self, *a, **kw):
        if limit(self) is not None and self.step >= limit(self):
            raise Killed(f"killed before step {self.step + 1}")
        return real_step(self, *a, **kw)

    def _write_outputs(self, *a, **kw):
        if limit(self) is not None and self.step >= limit(self):
            raise Killed(f"killed after step {self.step}, before the outputs")
        return real_outputs(self, *a, **kw)

    def fit(self) -> bool:
        try:
            return real_fit(self)
        except Killed:
            return False

    trainer_cls._train_step, trainer_cls._write_outputs, trainer_cls.fit = _train_step, _write_outputs, fit
    return trainer_cls


def _stopping_class():
    from ampflow.train.trainer import Trainer

    class StoppingTrainer(Trainer):
        """``Trainer(..., stop_after=k)``: killed after step ``k`` (None: never)."""

        def __init__(self, *args, stop_after: int | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.stop_after = stop_after

    return make_stopping(StoppingTrainer)


def __getattr__(name):  # StoppingTrainer without importing torch at collection
    if name == "StoppingTrainer":
        cls = _stopping_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


_MODULE = "ampflow.train.trainer"


def install(steps: str) -> None:
    """Make this process's ``Trainer`` stop after ``steps`` steps, now or when imported."""
    after_import(_MODULE, lambda module: make_stopping(module.Trainer, int(steps)))


def stop_env(folder: Path, steps: int, env: dict | None = None) -> dict:
    """An environment (``env``, or this process's) in which every training process stops
    after ``steps`` steps (:func:`process_doubles.process_env`)."""
    return process_env(folder, env, **{ENV: int(steps)})
