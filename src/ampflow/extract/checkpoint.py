"""The tensors of a model's weight files, read one at a time, and what every
architecture's adapter shares (see :mod:`ampflow.extract.weights` for how a model is
built from them with at most one host copy).

An adapter (``Esm2Adapter`` in :mod:`.esm2`, ``DnabertAdapter`` in :mod:`.dnabert`,
``EsmcAdapter`` in :mod:`.esmc`, beside its network) says how to build its network on the
meta device and which checkpoint key fills which tensor:

* ``checkpoint()``: the :class:`Checkpoint` to read;
* ``skeleton()``: the network on the meta device, cut at ``blocks``;
* ``name(key, prefixed)``: the network's name for a checkpoint key, or :data:`SKIP`;
* ``is_prefixed(keys)``: whether the keys carry a task model's prefix;
* ``computed(model, device)``: buffers a checkpoint need not hold;
* ``OPTIONAL``, ``blocks``, ``total``.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path

import torch

from ..base.errors import InputError

SKIP = None  # a checkpoint key that is known but not read (a head, a block not built)
LAYER = re.compile(r"^encoder\.layer\.(\d+)\.")


# ---------------------------------------------------------------- the checkpoint
class Checkpoint:
    """The tensors of a model folder, read one at a time.

    ``model.safetensors`` (or shards named by ``model.safetensors.index.json``) is
    preferred; ``pytorch_model.bin`` (or its shards) is opened with ``torch.load(mmap=True)``,
    which maps the file instead of reading it whole. ``files`` names the weight files
    (in ``folder``) instead: ``.safetensors`` ones, or state dicts saved by ``torch.save``
    (ESM C's ``.pth``).
    """

    def __init__(self, folder: Path, files: list[str] | None = None):
        self.folder = folder
        self._stack = ExitStack()
        self._bins: dict[str, dict] = {}
        if files is not None:
            self.safetensors = all(f.endswith(".safetensors") for f in files)
            if not self.safetensors and any(f.endswith(".safetensors") for f in files):
                raise ValueError(f"safetensors and torch files mixed: {files}")
        else:
            for name in ("model.safetensors", "pytorch_model.bin"):
                index = folder / f"{name}.index.json"
                if (folder / name).is_file():
                    files = [name]
                elif index.is_file():
                    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
                else:
                    continue
                self.safetensors = name.endswith(".safetensors")
                break
            else:
                raise InputError("no weights (model.safetensors or pytorch_model.bin, or their shards) in the model folder", path=folder)
        # what an error names: the weight file, or the folder of several
        self.where = folder / files[0] if len(files) == 1 else folder
        self.file_of: dict[str, str] = {}
        for f in files:
            for key in self._open(f)["keys"]:
                self.file_of[key] = f

    def _open(self, file: str) -> dict:
        if file not in self._bins:
            path = self.folder / file
            if not path.is_file():
                raise InputError(f"the weights index names {file}, which is not in the model folder", path=self.folder)
            if self.safetensors:
                from safetensors import safe_open

                # mmap: zero-copy views of the file; pread: a tensor read into fresh memory,
                # for tensors that are converted or moved anyway (mapped pages read for a
                # conversion would count in this process until the file is closed)
                mmap = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu", backend="mmap"))
                pread = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu", backend="pread"))
                self._bins[file] = {"keys": list(mmap.offset_keys()), "mmap": mmap, "pread": pread}
            else:
                tensors = _load_state_dict(path)
                self._bins[file] = {"keys": list(tensors), "tensors": tensors}
        return self._bins[file]

    def keys(self) -> list[str]:
        return list(self.file_of)

    def shape(self, key: str) -> torch.Size:
        """The shape of tensor ``key`` (nothing read but the header or the mapping)."""
        opened = self._open(self.file_of[key])
        if self.safetensors:
            return torch.Size(opened["mmap"].get_slice(key).get_shape())
        return opened["tensors"][key].shape

    def read(self, key: str, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The tensor ``key`` as ``dtype`` on ``device``; a zero-copy view of the file where
        that needs no conversion."""
        opened = self._open(self.file_of[key])
        t = opened["mmap"].get_tensor(key) if self.safetensors else opened["tensors"][key]
        if t.shape != shape:
            raise InputError(f"checkpoint tensor {key} has shape {tuple(t.shape)}, the network {tuple(shape)}", path=self.folder / self.file_of[key])
        if t.dtype == dtype and t.device == device:
            return t
        if self.safetensors:
            t = opened["pread"].get_tensor(key)
        return t.to(device=device, dtype=dtype)

    def close(self) -> None:
        self._stack.close()
        self._bins.clear()


def _load_state_dict(path: Path) -> dict:
    """A ``torch.save``d state dict, memory-mapped (files of the zip format, torch >= 1.6)
    or else read; tensors only (``weights_only``: no code in the file is run)."""
    try:
        try:
            tensors = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            tensors = torch.load(path, map_location="cpu", weights_only=True)  # the legacy format
    except Exception as e:  # a truncated file, not a torch file, unpickling refused
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise InputError(f"cannot read the weights ({type(e).__name__}: {first})", path=path) from None
    if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
        raise InputError("not a state dict (a dict of names to tensors)", path=path)
    return tensors


def require_config_json(folder: Path) -> None:
    if not (folder / "config.json").is_file():
        raise InputError("model folder has no config.json", path=folder)


# ---------------------------------------------------------------- what adapters share
def kept_blocks(total: int, n_blocks: int | None) -> int:
    """The blocks a network cut at ``n_blocks`` keeps (all for None)."""
    if n_blocks is None:
        return total
    if n_blocks < 0:
        raise ValueError(f"n_blocks must be >= 0, got {n_blocks}")
    return min(n_blocks, total)


def past_cut(name: str, blocks: int, total: int) -> bool:
    """A block the cut network does not have (but the checkpoint's network does)."""
    m = LAYER.match(name)
    return m is not None and blocks <= int(m.group(1)) < total


class FolderAdapter:
    """What the adapters of a hub-style model folder (``config.json`` beside the weights)
    share: the folder's config (:meth:`read_config`), its depth, the blocks kept, and the
    folder's :class:`Checkpoint`. Subclasses give ``read_config`` and the rest of the
    adapter (see the module docstring)."""

    OPTIONAL: tuple[str, ...] = ()

    def __init__(self, folder: Path, n_blocks: int | None):
        require_config_json(folder)
        self.folder = folder
        self.config = self.read_config(folder)
        self.total = self.config.num_hidden_layers
        self.blocks = kept_blocks(self.total, n_blocks)

    def read_config(self, folder: Path):
        raise NotImplementedError

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(self.folder)
