"""Run a function on several gloo processes (FileStore, no ports) and collect results."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world, store_path, out_dir, fn, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_world(fn, world: int, tmp_path, *args) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes; the per-rank return values.

    Results travel through files (tensors die with the child otherwise). ``fn`` must
    be importable (defined at module level).
    """
    out_dir = Path(tmp_path) / f"world{world}-{fn.__name__}"
    out_dir.mkdir(parents=True, exist_ok=True)
    store = str(out_dir / "store")
    try:
        mp.spawn(_worker, args=(world, store, str(out_dir), fn, args), nprocs=world, join=True)
    except Exception as e:
        errors = "\n".join(p.read_text() for p in sorted(out_dir.glob("rank*.err")))
        raise AssertionError(f"a rank failed:\n{errors}") from e
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
