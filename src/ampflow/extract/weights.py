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
import json
import logging
import os
import re
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from torch import nn

from ..io.errors import InputError
from .esmc import EsmcAdapter

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SKIP = None  # a checkpoint key that is known but not read (a head, a block not built)
_LAYER = re.compile(r"^encoder\.layer\.(\d+)\.")


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


def _config_json(folder: Path) -> None:
    if not (folder / "config.json").is_file():
        raise InputError("model folder has no config.json", path=folder)


# ---------------------------------------------------------------- the networks
def _blocks(total: int, n_blocks: int | None) -> int:
    if n_blocks is None:
        return total
    if n_blocks < 0:
        raise ValueError(f"n_blocks must be >= 0, got {n_blocks}")
    return min(n_blocks, total)


def _past_cut(name: str, blocks: int, total: int) -> bool:
    """A block the cut network does not have (but the checkpoint's network does)."""
    m = _LAYER.match(name)
    return m is not None and blocks <= int(m.group(1)) < total


class _Esm2:
    """transformers' ``EsmModel`` without pooler, as ``from_pretrained`` gives it."""

    # transformers' own renamings for ESM checkpoints (its conversion_mapping "esm" and
    # "legacy" entries): older checkpoints, and ``save_pretrained`` in transformers 5, name
    # layer norms gamma/beta and keep the rotary frequencies per layer (5 even writes a
    # literal "*" for the layer). The frequencies are taken from the checkpoint when there,
    # as transformers does: a checkpoint saved in half precision has them rounded.
    RENAMES = (
        (re.compile(r"LayerNorm\.gamma$"), "LayerNorm.weight"),
        (re.compile(r"LayerNorm\.beta$"), "LayerNorm.bias"),
        (re.compile(r"^encoder\.layer\.(\d+|\*)\.attention\.self\.rotary_embeddings\.inv_freq$"), "rotary_embeddings.inv_freq"),
    )
    OPTIONAL = ("rotary_embeddings.inv_freq",)

    def __init__(self, folder: Path, n_blocks: int | None):
        from transformers import EsmConfig

        _config_json(folder)
        self.folder = folder
        self.config = EsmConfig.from_pretrained(str(folder), local_files_only=True)
        self.total = self.config.num_hidden_layers
        self.blocks = _blocks(self.total, n_blocks)

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(self.folder)

    def skeleton(self) -> nn.Module:
        from transformers import EsmModel

        with torch.device("meta"):
            model = EsmModel(self.config, add_pooling_layer=False)
        # the contact head (attention maps -> contacts) is never run for embeddings
        model.contact_head = None
        if self.blocks < self.total:
            # the final layer norm belongs to the last block, as in the full model's hidden_states
            model.encoder.layer = model.encoder.layer[: self.blocks]
            model.encoder.emb_layer_norm_after = None
        return model

    def name(self, key: str, prefixed: bool) -> str | None:
        if prefixed:
            # a model with a task head (EsmForMaskedLM: lm_head): the encoder is under esm.
            if not key.startswith("esm."):
                return SKIP
            key = key.removeprefix("esm.")
        for pattern, new in self.RENAMES:
            key = pattern.sub(new, key)
        if key.startswith(("contact_head.", "pooler.")) or key in ("embeddings.position_ids", "embeddings.position_embeddings.weight"):
            # unused heads; position ids are computed; absolute positions are unused by
            # rotary ESM-2 (transformers ignores them too)
            return SKIP
        if self.blocks < self.total and (_past_cut(key, self.blocks, self.total) or key.startswith("encoder.emb_layer_norm_after.")):
            return SKIP
        return key

    def is_prefixed(self, keys: list[str]) -> bool:
        return any(k.startswith("esm.") for k in keys)

    def computed(self, model: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
        """Values for the buffers a checkpoint need not hold."""
        emb = model.embeddings
        out = {"embeddings.position_ids": torch.arange(emb.position_ids.shape[-1], device=device).expand((1, -1))}
        if model.rotary_embeddings is not None:
            inv_freq, _ = model.rotary_embeddings.compute_default_rope_parameters(self.config)
            out["rotary_embeddings.inv_freq"] = inv_freq.to(device)
        return out


class _Dnabert:
    """:class:`~ampflow.extract.dnabert.DnabertModel`, from the hub's parameter names."""

    OPTIONAL = ()

    def __init__(self, folder: Path, n_blocks: int | None):
        from .dnabert import DnabertConfig

        _config_json(folder)
        self.folder = folder
        self.config = DnabertConfig.from_json(folder / "config.json")
        self.total = self.config.num_hidden_layers
        self.blocks = _blocks(self.total, n_blocks)

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(self.folder)

    def skeleton(self) -> nn.Module:
        from .dnabert import DnabertModel

        with torch.device("meta"):
            model = DnabertModel(self.config)
        # the CLS pooler is never run for embeddings
        model.pooler = None
        model.encoder.layer = model.encoder.layer[: self.blocks]
        return model

    def name(self, key: str, prefixed: bool) -> str | None:
        if key.startswith("cls."):  # the masked-LM head
            return SKIP
        key = key.removeprefix("bert.")
        if key.startswith("pooler.") or _past_cut(key, self.blocks, self.total):
            return SKIP
        return key

    def is_prefixed(self, keys: list[str]) -> bool:
        return False

    def computed(self, model: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
        from .dnabert import alibi_slopes

        return {"encoder.slopes": torch.tensor(alibi_slopes(self.config.num_attention_heads), device=device)}


ARCHITECTURES = {"esm2": _Esm2, "dnabert_s": _Dnabert, "esmc": EsmcAdapter}


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
def load_lock(path):
    """Hold an exclusive ``flock`` on ``path`` (created if need be) while in the block.

    Workers of one job that load their models under the same lock load one after
    another. The kernel releases the lock when the file is closed, also when the
    process dies, so a killed worker never leaves the others waiting.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        t0 = time.monotonic()
        fcntl.flock(fd, fcntl.LOCK_EX)
        log.info("waited %.1f s for the model-loading lock %s", time.monotonic() - t0, path)
        yield
    finally:
        os.close(fd)
