"""Model loading (ESM-2, DNABERT-S) and batched, pooled inference.

:class:`Embedder` holds one model and its tokenizer on one device. Sequences are
tokenized once, grouped into length-sorted batches under a token budget, run under
``torch.inference_mode`` (autocast on GPU when the dtype asks for it) and mean-pooled
over the tokens the pooling names; padding never enters a mean, and attention never
looks at padding, so a sequence's vector does not depend on its batch.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..io.errors import InputError
from .batching import token_budget_batches
from .config import ModelSpec

log = logging.getLogger(__name__)


def resolve_source(source: str) -> Path:
    """A model folder: ``source`` itself, or its snapshot in the local hub cache."""
    p = Path(source)
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, local_files_only=True))
    except Exception as e:  # not a repo name, or not cached: say what to do
        raise InputError(
            f"neither a local folder nor a model in the local hub cache ({type(e).__name__}); "
            "download it first, e.g. `hf download NAME`, or give its folder",
            key="extract.models.source", value=source,
        ) from None  # fmt: skip


def fingerprint(folder) -> str:
    """sha256 over the names and contents of a model folder's files (weights, config,
    vocabulary): a marker made with other weights does not count as done."""
    h = hashlib.sha256()
    folder = Path(folder)
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts):
            h.update(rel.encode() + b"\0")
            with open(p, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return "sha256:" + h.hexdigest()


def model_shape(folder) -> tuple[int, int]:
    """Number of transformer blocks and hidden size, from the folder's ``config.json``."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise InputError("model folder has no config.json", path=folder)
    cfg = json.loads(path.read_text())
    return int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])


def resolve_layer(layer: int, n_layers: int) -> int:
    """Layer index in 0..n_layers (negative counts from the end: -1 = n_layers)."""
    idx = layer if layer >= 0 else n_layers + 1 + layer
    if not 0 <= idx <= n_layers:
        raise InputError(f"the model has layers 0..{n_layers} (or -1..-{n_layers + 1})", key="extract.models.layer", value=layer)
    return idx


@dataclass
class Tokenized:
    """One sequence's token ids and which of them are pooled."""

    ids: list[int]
    pooled: list[bool]


class Embedder:
    """A model + tokenizer on one device that turns sequences into pooled vectors.

    Parameters
    ----------
    kind
        ``esm2`` or ``dnabert_s``.
    model
        transformers ``EsmModel`` (blocks already cut to the layer) or
        :class:`~ampflow.extract.dnabert.DnabertModel`.
    tokenizer
        The folder's transformers tokenizer.
    layer
        Blocks to run (0..n_layers).
    pooling
        ``mean`` (sequence tokens) or ``mean_special`` (special tokens too).
    device, dtype
        ``cpu``/``cuda``; ``float32``/``bfloat16``/``float16`` (autocast, CUDA only).
    """

    def __init__(self, kind: str, model, tokenizer, layer: int, pooling: str = "mean", device: str = "cpu", dtype: str = "float32"):
        import torch

        self.kind = kind
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.layer = layer
        self.pooling = pooling
        self.device = device
        self.dtype = dtype if device.startswith("cuda") else "float32"
        self.pad_id = tokenizer.pad_token_id
        self.dim = model.config.hidden_size
        self._autocast = None if self.dtype == "float32" else getattr(torch, self.dtype)
        self._char_vocab = None
        from transformers import EsmTokenizer

        if isinstance(tokenizer, EsmTokenizer):
            # one token per letter: a dict lookup gives the tokenizer's own ids, without
            # its slow per-sequence splitting (checked in the tests)
            self._char_vocab = tokenizer.get_vocab()

    # ---------------------------------------------------------------- tokens
    def tokenize(self, seqs: list[str]) -> list[Tokenized]:
        if self._char_vocab is not None:
            v, unk = self._char_vocab, self.tokenizer.unk_token_id
            cls, eos = self.tokenizer.cls_token_id, self.tokenizer.eos_token_id
            out = [Tokenized([cls, *(v.get(c, unk) for c in s), eos], [False, *([True] * len(s)), False]) for s in seqs]
        else:
            enc = self.tokenizer(list(seqs), add_special_tokens=True, return_special_tokens_mask=True, return_attention_mask=False)
            out = [Tokenized(ids, [not m for m in mask]) for ids, mask in zip(enc["input_ids"], enc["special_tokens_mask"])]
        if self.pooling == "mean_special":
            for t in out:
                t.pooled = [True] * len(t.ids)
        return out

    # ---------------------------------------------------------------- forward
    def _hidden(self, ids, mask):
        if self.kind == "esm2":
            return self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        return self.model(ids, mask, n_layers=self.layer)

    def embed_batch(self, batch: list[Tokenized]) -> np.ndarray:
        """Pooled vectors (len(batch), dim), float32, for one padded batch."""
        import torch

        s = max(len(t.ids) for t in batch)
        ids = torch.full((len(batch), s), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), s), dtype=torch.long)
        pooled = torch.zeros((len(batch), s), dtype=torch.bool)
        for i, t in enumerate(batch):
            n = len(t.ids)
            ids[i, :n] = torch.tensor(t.ids)
            mask[i, :n] = 1
            pooled[i, :n] = torch.tensor(t.pooled)
        ids, mask, pooled = ids.to(self.device), mask.to(self.device), pooled.to(self.device)
        with torch.inference_mode():
            if self._autocast is not None:
                with torch.autocast("cuda", dtype=self._autocast):
                    h = self._hidden(ids, mask)
            else:
                h = self._hidden(ids, mask)
            h = h.float().masked_fill(~pooled[..., None], 0.0)
            out = h.sum(1) / pooled.sum(1, keepdim=True)
        return out.cpu().numpy()

    def embed(self, seqs: list[str], tokens_per_batch: int, on_batch: Callable[[int, int, int], None] | None = None):
        """Vectors (len(seqs), dim) in input order, and token statistics.

        ``on_batch(sequences, tokens, padded_tokens)`` is called after every batch.
        """
        toks = self.tokenize(seqs)
        lengths = [len(t.ids) for t in toks]
        out = np.empty((len(seqs), self.dim), dtype=np.float32)
        stats = {"tokens": 0, "padded_tokens": 0, "batches": 0}
        for b in token_budget_batches(lengths, tokens_per_batch):
            out[b] = self.embed_batch([toks[i] for i in b])
            real, padded = sum(lengths[i] for i in b), len(b) * max(lengths[i] for i in b)
            stats["tokens"] += real
            stats["padded_tokens"] += padded
            stats["batches"] += 1
            if on_batch is not None:
                on_batch(len(b), real, padded)
        return out, stats


def load_embedder(spec: ModelSpec, folder, layer: int, device: str = "cpu") -> Embedder:
    """Load the model of ``spec`` from ``folder`` onto ``device`` (once per worker)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder = Path(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if tokenizer.pad_token_id is None:
        raise InputError("the model's tokenizer has no padding token", path=folder)
    if spec.kind == "esm2":
        from transformers import EsmModel

        model = EsmModel.from_pretrained(str(folder), local_files_only=True, add_pooling_layer=False)
        if layer < model.config.num_hidden_layers:
            # blocks past the layer are never run; the final layer norm belongs to the last block
            model.encoder.layer = model.encoder.layer[:layer]
            model.encoder.emb_layer_norm_after = None
    else:
        from .dnabert import load_dnabert

        model = load_dnabert(folder)
    return Embedder(spec.kind, model, tokenizer, layer, spec.pooling, device, spec.dtype)
