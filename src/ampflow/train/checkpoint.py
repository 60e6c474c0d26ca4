"""Checkpoints that a killed run resumes from bit-identically (on CPU).

A checkpoint holds the model, the optimizer, every RNG state (python, numpy, torch,
CUDA, the graph sampler's generator), the data-order position, the stage and the
step. Files are written atomically; on start the newest loadable one is used, and a
corrupt newest file falls back to the one before it with a warning.

Checkpoints belong to one attempt of one configuration. The run key (a hash of the data
and settings) tells configurations apart; ``finished.json``, written once a run's
outputs are all written, closes the attempt. A run that finds it starts from step 0 and
deletes the finished attempt's checkpoints: re-running a finished training (Snakemake's
``--forcerun``, or new code) trains again from scratch, while a killed or failed run,
which never wrote the marker, resumes from its newest checkpoint.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
from pathlib import Path

import numpy as np
import torch

from ..base.atomic import atomic_path, write_text_atomic

log = logging.getLogger(__name__)
NAME = re.compile(r"^step-(\d{8})\.pt$")
STALE = re.compile(r"^\.tmp-\d+-step-\d{8}\.pt$")  # atomic_path temporaries of checkpoints
FINISHED = "finished.json"
PARTIAL_METRICS = "metrics.partial.jsonl"


def rng_state(generator: torch.Generator, cuda: bool = False) -> dict:
    """Every RNG state of this process; ``cuda`` (a run on CUDA): its current GPU's too.
    Only then: a run on CPU cores must not touch CUDA on a machine with GPUs (reading
    their states would start a CUDA context on every GPU, from every process)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"key": torch.as_tensor(np_state[1].astype(np.int64)), "rest": [np_state[0], *map(float, np_state[2:])]},
        "torch": torch.get_rng_state(),
        "generator": generator.get_state(),
    }
    if cuda:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict, generator: torch.Generator, cuda: bool = False) -> None:
    """Restore :func:`rng_state`'s states; the CUDA one only for a run on CUDA (an older
    checkpoint holds every GPU's: a list)."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    name, pos, has_gauss, cached = state["numpy"]["rest"]
    np.random.set_state((name, state["numpy"]["key"].numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    generator.set_state(state["generator"])
    if cuda and "cuda" in state:
        if isinstance(state["cuda"], (list, tuple)):
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            torch.cuda.set_rng_state(state["cuda"])


def save_torch(obj, path) -> None:
    """``torch.save`` into an open file: the zip's root folder is then ``archive``, not the
    file's name, which for a temporary file holds the process id and made two identical
    runs write different bytes."""
    with open(path, "wb") as f:
        torch.save(obj, f)


def save(folder, step: int, payload: dict, keep: int) -> Path:
    """Write ``step-{step}.pt`` atomically and remove all but the newest ``keep``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:08d}.pt"
    with atomic_path(path) as tmp:
        save_torch(payload, tmp)
    for old in list_checkpoints(folder)[keep:]:
        old.unlink(missing_ok=True)
    return path


def list_checkpoints(folder) -> list[Path]:
    """Checkpoints in ``folder``, newest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if NAME.match(p.name)]
    return sorted(found, key=lambda p: int(NAME.match(p.name).group(1)), reverse=True)


def remove_stale_temps(folder) -> None:
    """Delete half-written checkpoints a killed run left under their temporary names
    (each as large as a checkpoint; nothing else would ever remove them)."""
    folder = Path(folder)
    if folder.is_dir():
        for p in folder.iterdir():
            if STALE.match(p.name):
                log.info("removing %s, left by an interrupted checkpoint write", p)
                p.unlink(missing_ok=True)


def mark_finished(folder, run_key: str, step: int) -> Path:
    """Close the attempt whose checkpoints are in ``folder``: its outputs are written.
    Call after the last output is in place (a crash before it leaves a resumable run)."""
    path = Path(folder) / FINISHED
    record = {"run_key": run_key, "steps": int(step), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_text_atomic(path, json.dumps(record, sort_keys=True) + "\n")
    return path


def clear_finished(folder) -> bool:
    """Delete the checkpoints (and the metrics working copy) of a finished attempt, the
    marker last; True if ``folder`` held one. A kill half-way leaves the marker, so the
    next start clears the rest."""
    folder = Path(folder)
    marker = folder / FINISHED
    if not marker.is_file():
        return False
    for p in [*list_checkpoints(folder), folder / PARTIAL_METRICS]:
        p.unlink(missing_ok=True)
    marker.unlink()
    return True


def load_latest(folder, run_key: str | None = None) -> tuple[dict, Path] | tuple[None, None]:
    """The newest checkpoint that loads and belongs to ``run_key``, or (None, None).

    Checkpoints of a finished attempt (``finished.json``) are not resumed from: they are
    deleted, and the run starts from step 0. Checkpoints of another run (different data
    or settings, e.g. after the config changed) cannot be resumed from either: they are
    deleted with a warning, so that they neither shadow nor mix with this run's.
    """
    remove_stale_temps(folder)
    if clear_finished(folder):
        log.info("%s held the checkpoints of a finished run (its outputs were written): deleted; training from step 0", folder)
        return None, None
    for path in list_checkpoints(folder):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file means: try the previous one
            log.warning("checkpoint %s is unreadable (%s: %s); falling back to the previous one", path, type(e).__name__, e)
            continue
        if run_key is not None and state.get("run_key") != run_key:
            log.warning("checkpoint %s is from another run (data or settings changed); deleting it", path)
            path.unlink(missing_ok=True)
            continue
        return state, path
    return None, None
