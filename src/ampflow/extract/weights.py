"""Loading an extraction model with at most one host copy of its weights.

Every extraction worker (one per GPU, or several on a CPU) loads its own model. Built
whole and then filled from a state dict (as DNABERT-S was), each worker holds a private
fp32 host copy (randomly initialised, then overwritten from the checkpoint) before it is
cast and moved. ESM-2's
``from_pretrained`` (transformers 5) avoids the copy for fp32 safetensors on the CPU, but
the model stayed fp32 with bf16 only applied by autocast, so ESM-2 15B does not fit a
40/48 GB card, and every block was read even when only the first ones are run.
Here instead:

* the network is built on the ``meta`` device (shapes only, no memory, no random init);
* the checkpoint's tensors are read one at a time, each converted to the asked dtype and
  put on the asked device as it is read, and assigned into the network in place of its
  meta tensors, so the host holds one tensor at a time in transit, never a second model;
* on the CPU, a tensor already in the asked dtype is not copied but used where it lies
  in the memory-mapped ``.safetensors`` file (safetensors' ``mmap`` backend hands out
  zero-copy views): its pages are the kernel's page cache, which every worker mapping the
  same file shares, so N CPU workers hold one copy of the weights between them;
* with ``n_blocks`` only the first blocks are built and their weights read: the blocks
  after the extracted layer are never run;
* buffers that are not in checkpoints (ESM-2's position ids, DNABERT's ALiBi slopes) are
  computed on the device.

:func:`load_lock` lets the workers of one job load one after another, so that a node
does not read the same file N times at once nor hold N tensors in transit.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from ..base.errors import InputError
from .checkpoint import SKIP
from .dnabert import DnabertAdapter
from .esm2 import Esm2Adapter
from .esmc import EsmcAdapter

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Each model kind's adapter (:mod:`.checkpoint` lists what one provides): the one table
#: from ``extract.models.kind`` to how its network is built and filled.
ARCHITECTURES = {"esm2": Esm2Adapter, "dnabert_s": DnabertAdapter, "esmc": EsmcAdapter}


# ---------------------------------------------------------------- loading
def load_model(kind: str, folder, dtype: str = "float32", device: str = "cpu", n_blocks: int | None = None) -> nn.Module:
    """The model of ``kind`` in ``folder``, in eval mode, its parameters in ``dtype`` on
    ``device``.

    Parameters
    ----------
    kind
        ``esm2`` (a transformers ``EsmModel`` without pooler; checkpoints of ``EsmModel``
        or of ``EsmForMaskedLM`` as on the hub), ``dnabert_s``
        (:class:`~ampflow.extract.dnabert.DnabertModel`) or ``esmc``
        (:class:`~ampflow.extract.esmc.EsmcModel`, EvolutionaryScale's state dicts).
    folder
        A model folder: ``config.json`` and ``model.safetensors`` (or
        ``pytorch_model.bin``, or shards of either with their index); for ``esmc`` the
        ``.pth`` file or a folder holding one (:func:`~ampflow.extract.esmc.weights_file`).
    dtype
        ``float32``, ``bfloat16`` or ``float16``: the parameters are held in it (buffers
        such as rotary frequencies stay float32).
    device
        Where the parameters go, tensor by tensor (``cpu``, ``cuda:1``, ...).
    n_blocks
        Build and read only the first ``n_blocks`` transformer blocks (0 = embeddings
        only); ESM-2's final layer norm is then dropped too, so the output equals the
        full model's ``hidden_states[n_blocks]``. ``None``, or at least the model's
        depth: the whole model.
    """
    if kind not in ARCHITECTURES:
        raise ValueError(f"unknown model kind {kind!r}")
    if dtype not in DTYPES:
        raise InputError(f"dtype must be one of {sorted(DTYPES)}", key="extract.models.dtype", value=dtype)
    folder, device, param_dtype = Path(folder), torch.device(device), DTYPES[dtype]
    t0 = time.monotonic()
    arch = ARCHITECTURES[kind](folder, n_blocks)
    ckpt = arch.checkpoint()
    try:
        model = arch.skeleton()
        wanted = model.state_dict()  # meta tensors: parameters and persistent buffers
        params = {name for name, _ in model.named_parameters()}
        keys = ckpt.keys()
        prefixed = arch.is_prefixed(keys)
        source: dict[str, str] = {}
        unexpected = []
        for key in keys:
            name = arch.name(key, prefixed)
            if name is SKIP or (name in source and name in arch.OPTIONAL):
                continue
            if name not in wanted or name in source:
                unexpected.append(key)
            else:
                source[name] = key
        missing = [n for n in wanted if n not in source and n not in arch.OPTIONAL]
        if missing or unexpected:
            raise InputError(
                f"checkpoint does not match the {kind} network: missing {missing[:5]}, unexpected {unexpected[:5]}"
                + (f" ({len(missing)} missing, {len(unexpected)} unexpected in all)" if len(missing) > 5 or len(unexpected) > 5 else ""),
                path=ckpt.where,
            )  # fmt: skip
        state = {}
        for name, key in source.items():
            # parameters in the asked precision; buffers (rotary frequencies) as float32
            want = param_dtype if name in params else torch.float32
            state[name] = ckpt.read(key, wanted[name].shape, want, device)
        computed = arch.computed(model, device)
        for name, value in computed.items():
            if name in wanted:  # a persistent buffer the checkpoint did not hold
                state.setdefault(name, value)
            else:
                module_name, _, attr = name.rpartition(".")
                setattr(model.get_submodule(module_name), attr, value)
        model.load_state_dict(state, strict=True, assign=True)
    finally:
        ckpt.close()  # the mapped views handed out stay valid: they hold the mapping
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"{kind}: not loaded, still on the meta device: {left}")
    log.info(
        "loaded %s from %s (%d of %d blocks, %s, %s) in %.1f s",
        kind, folder, arch.blocks, arch.total, dtype, device, time.monotonic() - t0,
    )  # fmt: skip
    return model.requires_grad_(False).eval()


@contextmanager
def load_lock(path, on_wait=None, on_turn=None):
    """Hold an exclusive ``flock`` on ``path`` (created if need be) while in the block.

    Workers of one job that load their models under the same lock load one after
    another. The kernel releases the lock when the file is closed, also when the
    process dies, so a killed worker never leaves the others waiting. When another
    process holds it, ``on_wait()`` is called before blocking and ``on_turn()`` once the
    lock is ours (a worker tells its pool it is waiting, not hung).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            t0 = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)
            if on_turn is not None:
                on_turn()
            log.info("waited %.1f s for the model-loading lock %s", time.monotonic() - t0, path)
        yield
    finally:
        os.close(fd)
