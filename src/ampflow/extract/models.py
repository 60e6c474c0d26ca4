"""Model loading (ESM-2, DNABERT-S, ESM C) and batched, pooled inference.

:class:`Embedder` holds one model and its tokenizer on one device. Sequences are
tokenized once, grouped into length-sorted batches under a token budget, run under
``torch.inference_mode`` (autocast on GPU when the dtype asks for it) and mean-pooled
over the tokens the pooling names; padding never enters a mean, and attention never
looks at padding, so a sequence's vector does not depend on its batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..base.atomic import write_text_atomic
from ..base.errors import InputError
from .config import ModelSpec

log = logging.getLogger(__name__)


def resolve_source(source: str, kind: str = "esm2") -> Path:
    """A model folder: ``source`` itself, or its snapshot in the local hub cache; for
    ``esmc`` also a weights file (EvolutionaryScale's ``.pth``)."""
    p = Path(source)
    if p.is_dir():
        return p
    if p.is_file():
        if kind == "esmc":
            return p
        raise InputError(f"a file; a {kind} model is a folder (config.json, weights, vocabulary)", key="extract.models.source", value=source)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, local_files_only=True))
    except Exception as e:  # not a repo name, or not cached: say what to do
        raise InputError(
            f"neither a local folder nor a model in the local hub cache ({type(e).__name__}); "
            "download it first, e.g. `hf download NAME`, or give its folder",
            key="extract.models.source", value=source,
        ) from None  # fmt: skip


def _model_files(folder: Path):
    """(name relative to the folder, path) of the model's files, sorted; hidden ones
    (a hub cache's .locks, editors' files) left out. A file (ESM C's weights) is its
    own one file, with the ``config.json`` that gives its shape, if any."""
    if folder.is_file():
        from .esmc import config_file

        config = config_file(folder)
        yield from ([("config.json", config)] if config is not None else []) + [(folder.name, folder)]
        return
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts):
            yield rel.as_posix(), p


def fingerprint(folder) -> str:
    """sha256 over the names and contents of a model folder's files (weights, config,
    vocabulary): vectors made with other weights are never taken from the cache."""
    h = hashlib.sha256()
    for rel, p in _model_files(Path(folder)):
        h.update(rel.encode() + b"\0")
        with open(p, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return "sha256:" + h.hexdigest()


def _file_stats(folder: Path) -> list:
    return [[rel, p.stat().st_size, p.stat().st_mtime_ns] for rel, p in _model_files(folder)]


def cached_fingerprint(folder, work) -> str:
    """:func:`fingerprint`, read again only when a file's name, size or modification time
    changed since the last job (``{work}/fingerprint.json``): hashing ESM-2 3B's 11 GB
    takes a minute, listing its files a millisecond."""
    folder = Path(folder).resolve()
    path = Path(work) / "fingerprint.json"
    stats = _file_stats(folder)
    try:
        saved = json.loads(path.read_text())
        if saved["folder"] == str(folder) and saved["files"] == stats:
            return saved["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = fingerprint(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"folder": str(folder), "files": stats, "fingerprint": digest}, indent=1) + "\n")
    return digest


def model_shape(folder, kind: str = "esm2") -> tuple[int, int]:
    """Number of transformer blocks and hidden size, from the folder's ``config.json``
    (ESM C: :func:`~ampflow.extract.esmc.read_config`, which may read the weights' shapes)."""
    if kind == "esmc":
        from .esmc import read_config

        cfg = read_config(folder)
        return cfg.n_layers, cfg.d_model
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


# the kinds whose sequences can share a masked row (packed_attention: mask): rotary
# positions restart per sequence (DNABERT-S's ALiBi would need a bias per row; the
# varlen path gives it ALiBi per sequence instead)
PACKABLE = ("esm2", "esmc")


@dataclass
class Tokenized:
    """One sequence's token ids and which of them are the sequence's own (not special)."""

    ids: list[int]
    own: list[bool]


def product_names(layers: list[int], poolings: list[str], per_token: bool) -> list[str]:
    """Names of what one pass computes per sequence: ``L{layer}.{pooling}`` vectors, then
    ``L{layer}.tokens`` (every own token's vector) when asked for."""
    names = [f"L{layer}.{p}" for layer in layers for p in poolings]
    return names + ([f"L{layer}.tokens" for layer in layers] if per_token else [])


class Embedder:
    """A model + tokenizer on one device that turns sequences into pooled vectors.

    Parameters
    ----------
    kind
        ``esm2``, ``dnabert_s`` or ``esmc``.
    model
        transformers ``EsmModel`` (blocks already cut to the deepest layer),
        :class:`~ampflow.extract.dnabert.DnabertModel` or
        :class:`~ampflow.extract.esmc.EsmcModel` (each cut likewise).
    tokenizer
        The folder's transformers tokenizer, or ESM C's
        :class:`~ampflow.extract.esmc.EsmcTokenizer`.
    layers
        Hidden states to pool (each 0..n_layers), all from one pass.
    poolings
        ``mean`` (own tokens), ``mean_special`` (special tokens too), ``bos`` (first token).
    per_token
        Also return every own token's vector per layer.
    device, dtype
        ``cpu``/``cuda``; ``float32``/``bfloat16``/``float16`` (autocast, CUDA only).
    tokens_per_batch, attention_per_batch
        The batch budgets (:func:`~ampflow.extract.batching.plan_batches`).
    pack
        Pack a batch's sequences one after another, without padding or mask: every
        per-token part of a block runs on the ``(tokens, width)`` tensor and attention
        over the sequence boundaries (:mod:`~ampflow.extract.varlen`: FlashAttention's
        variable-length kernel on CUDA, ``flex_attention`` for DNABERT-S's ALiBi,
        attention per sequence on the CPU; the choice is logged and in the stats), each
        sequence with its own rotary positions or ALiBi from 0. None (the default): on
        for CUDA, off on the CPU, where the batch rule already pads little (it runs long
        sequences alone) and packed batches measured no faster
        (``scripts/bench_extract.py``, part 3). On a GPU a packed batch holds as many
        tokens as :func:`~ampflow.extract.batching.packed_token_budget` gives for the
        device's free memory (first-fit decreasing; the out-of-memory back-off halves it).
    packed_attention
        ``varlen`` (the above) or ``mask``: rows of :func:`~ampflow.extract.batching.plan_packed`
        with a block-diagonal mask through the models' own forward (ESM-2, ESM C; the
        earlier packed path, kept as the benchmark's comparison).
    """

    def __init__(
        self, kind: str, model, tokenizer, layers: list[int], poolings: list[str] = ("mean",), per_token: bool = False,
        device: str = "cpu", dtype: str = "float32", tokens_per_batch: int = 4096, attention_per_batch: int | None = None,
        pack: bool | None = None, packed_attention: str = "varlen",
    ):  # fmt: skip
        import torch

        self.kind = kind
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.layers = list(layers)
        self.poolings = list(poolings)
        self.per_token = per_token
        self.products = product_names(self.layers, self.poolings, per_token)
        self.device = device
        self.dtype = dtype if device.startswith("cuda") else "float32"
        self.tokens_per_batch = tokens_per_batch
        self.attention_per_batch = attention_per_batch
        if pack is None:
            pack = device.startswith("cuda")
        if pack not in (True, False):
            raise InputError("must be true, false or null", key="extract.models.pack", value=pack)
        if packed_attention not in ("varlen", "mask"):
            raise InputError("must be varlen or mask", key="packed_attention", value=packed_attention)
        if pack and packed_attention == "mask" and kind not in PACKABLE:
            raise InputError(f"masked packed rows are for {', '.join(PACKABLE)} (rotary positions), not {kind}", key="extract.models.pack", value=pack)
        self.pack = pack
        self.packed_attention = packed_attention
        self.varlen_tokens: int | None = None  # the packed token budget; None: the memory model's
        self._backend: str | None = None
        self.row_tokens = 1024  # the plan's row length (plan_packed) replaces it
        self.pad_id = tokenizer.pad_token_id
        self.dim = model.config.hidden_size
        self._autocast = None if self.dtype == "float32" else getattr(torch, self.dtype)
        self._char_vocab = None
        from transformers import EsmTokenizer

        if isinstance(tokenizer, EsmTokenizer) or getattr(tokenizer, "char_level", False):
            # one token per letter: a dict lookup gives the tokenizer's own ids, without
            # its slow per-sequence splitting (checked in the tests)
            self._char_vocab = tokenizer.get_vocab()

    # ---------------------------------------------------------------- tokens
    def tokenize(self, seqs: list[str]) -> list[Tokenized]:
        if self._char_vocab is not None:
            v, unk = self._char_vocab, self.tokenizer.unk_token_id
            cls, eos = self.tokenizer.cls_token_id, self.tokenizer.eos_token_id
            return [Tokenized([cls, *(v.get(c, unk) for c in s), eos], [False, *([True] * len(s)), False]) for s in seqs]
        enc = self.tokenizer(list(seqs), add_special_tokens=True, return_special_tokens_mask=True, return_attention_mask=False)
        return [Tokenized(ids, [not m for m in mask]) for ids, mask in zip(enc["input_ids"], enc["special_tokens_mask"])]

    # ---------------------------------------------------------------- forward
    def _precision(self):
        """Autocast to the configured dtype on CUDA, else nothing."""
        if self._autocast is None:
            return contextlib.nullcontext()
        import torch

        return torch.autocast("cuda", dtype=self._autocast)

    def _hidden(self, ids, mask, positions=None) -> dict:
        """Hidden states of every asked layer, from one forward pass. Packed rows
        (``positions`` given): ``mask`` numbers each row's sequences 1, 2, ... (0 at
        padding) and ``positions`` counts each sequence's tokens from 0."""
        if positions is not None:
            return self._hidden_packed(ids, mask, positions)
        if self.kind == "esm2":
            deepest = max(self.layers)
            out = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=deepest > 0)
            # hidden_states[k]: after block k (0: the embeddings). The model is cut after
            # the deepest block, so its output is that layer's; it is after the final
            # LayerNorm only when nothing was cut (as fair-esm's last representation)
            return {layer: out.last_hidden_state if layer == deepest else out.hidden_states[layer] for layer in self.layers}
        return self.model.hidden_states(ids, mask, self.layers)

    def _hidden_packed(self, ids, segments, positions) -> dict:
        if self.kind == "esmc":
            return self.model.hidden_states(ids, segments, self.layers, positions=positions)
        import torch

        # ESM-2 (transformers EsmModel): its embeddings take the 0/1 mask (they zero
        # padding; token dropout rescales by the row's share of <mask>, which is why a
        # sequence holding <mask> never shares a row: see _rows); the encoder takes a
        # prepared 4D mask as is and the rotary positions as position_ids
        real = (segments > 0).long()
        emb = self.model.embeddings(input_ids=ids, attention_mask=real)
        see = (segments[:, :, None] == segments[:, None, :])[:, None]  # padding sees padding: no empty row
        if self.model.config._attn_implementation != "sdpa":  # eager adds the mask
            see = torch.zeros(see.shape, dtype=emb.dtype, device=see.device).masked_fill(~see, torch.finfo(emb.dtype).min)
        deepest = max(self.layers)
        out = self.model(inputs_embeds=emb, attention_mask=see, position_ids=positions, output_hidden_states=deepest > 0)
        return {layer: out.last_hidden_state if layer == deepest else out.hidden_states[layer] for layer in self.layers}

    def _rows(self, batch: list[Tokenized]) -> list[list[int]]:
        """Packed rows of a batch (positions into it): first-fit decreasing into rows of
        the plan's length; with ESM-2's token dropout, a sequence holding ``<mask>``
        has a row of its own (the rescaling is by the row's share of <mask>)."""
        from .batching import pack_rows

        mask_id = getattr(self.tokenizer, "mask_token_id", None)
        alone = [j for j, t in enumerate(batch) if self.kind == "esm2" and mask_id is not None and mask_id in t.ids]
        rest = [j for j in range(len(batch)) if j not in set(alone)]
        rows = [[rest[k] for k in r] for r in pack_rows([len(batch[j].ids) for j in rest], self.row_tokens)]
        return rows + [[j] for j in alone]

    def embed_packed(self, batch: list[Tokenized], rows: list[list[int]]) -> dict:
        """:meth:`embed_batch` for sequences packed into ``rows`` (lists of positions into
        ``batch``): the same products, pooled per sequence over its own tokens only."""
        import torch

        if len(rows) == len(batch):  # a row each: the padded batch, without the gathers
            return self.embed_batch(batch)
        lens = [len(t.ids) for t in batch]
        s = max(sum(lens[j] for j in r) for r in rows)
        ids = torch.full((len(rows), s), self.pad_id, dtype=torch.long)
        seg = torch.zeros((len(rows), s), dtype=torch.long)
        pos = torch.zeros((len(rows), s), dtype=torch.long)
        own = torch.zeros((len(rows), s), dtype=torch.bool)
        which = torch.full((len(rows), s), -1, dtype=torch.long)  # the sequence (position in batch) of each token
        where = [(0, 0, 0)] * len(batch)
        for r, members in enumerate(rows):
            at = 0
            for k, j in enumerate(members, start=1):
                n, t = lens[j], batch[j]
                ids[r, at : at + n] = torch.tensor(t.ids)
                seg[r, at : at + n] = k
                pos[r, at : at + n] = torch.arange(n)
                own[r, at : at + n] = torch.tensor(t.own)
                which[r, at : at + n] = j
                where[j] = (r, at, n)
                at += n
        ids, seg, pos = ids.to(self.device), seg.to(self.device), pos.to(self.device)
        own, which = own.to(self.device), which.to(self.device)
        first = torch.tensor([w[:2] for w in where], device=self.device)
        out = {}
        with torch.inference_mode():
            if self._autocast is not None:
                with torch.autocast("cuda", dtype=self._autocast):
                    states = self._hidden(ids, seg, pos)
            else:
                states = self._hidden(ids, seg, pos)
            for layer, h in states.items():
                h = h.float()
                flat = h.reshape(-1, h.shape[-1])
                for p in self.poolings:
                    if p == "bos":
                        v = h[first[:, 0], first[:, 1]]
                    else:
                        keep = (own if p == "mean" else seg > 0).reshape(-1)
                        idx = which.reshape(-1)[keep]
                        total = torch.zeros((len(batch), h.shape[-1]), dtype=h.dtype, device=h.device).index_add_(0, idx, flat[keep])
                        v = total / torch.bincount(idx, minlength=len(batch))[:, None].to(h.dtype)
                    out[f"L{layer}.{p}"] = v.cpu().numpy()
                if self.per_token:
                    hc, oc = h.cpu(), own.cpu()
                    out[f"L{layer}.tokens"] = [hc[r, a : a + n][oc[r, a : a + n]].numpy() for r, a, n in where]
        return out

    @property
    def attention_backend(self) -> str:
        """The packed attention kernel for this model, device and dtype (chosen once, logged)."""
        if self._backend is None:
            import contextlib

            import torch

            from .varlen import choose

            dtype = self._autocast or next(self.model.parameters()).dtype
            # probed as it will run (a compiled kernel is specialised to both)
            amp = torch.autocast("cuda", dtype=self._autocast) if self._autocast is not None else contextlib.nullcontext()
            with torch.inference_mode(), amp:
                self._backend = choose(self.device, dtype, alibi=self.kind == "dnabert_s")
        return self._backend

    def _hidden_varlen(self, ids, packed) -> dict:
        if self.kind == "esm2":
            from .esm2 import hidden_states_packed

            return hidden_states_packed(self.model, ids, packed, self.layers)
        return self.model.hidden_states_packed(ids, packed, self.layers)

    def embed_varlen(self, batch: list[Tokenized]) -> dict:
        """:meth:`embed_batch` for sequences packed one after another (no padding, no
        mask: :mod:`~ampflow.extract.varlen`): the same products, pooled per sequence."""
        import torch

        from .varlen import pack

        lens = [len(t.ids) for t in batch]
        ids = torch.tensor([i for t in batch for i in t.ids], dtype=torch.long).to(self.device)
        own = torch.tensor([o for t in batch for o in t.own], dtype=torch.bool).to(self.device)
        packed = pack(lens, self.device, self.attention_backend)
        starts = packed.cu_seqlens[:-1].long()
        out = {}
        with torch.inference_mode():
            with self._precision():
                states = self._hidden_varlen(ids, packed)
            counts = {}
            for layer, h in states.items():
                h = h.float()
                for p in self.poolings:
                    if p == "bos":
                        v = h[starts]
                    else:
                        if p not in counts:
                            keep = own if p == "mean" else torch.ones_like(own)
                            idx = packed.seq_index[keep]
                            counts[p] = (keep, idx, torch.bincount(idx, minlength=len(batch))[:, None].float())
                        keep, idx, n = counts[p]
                        v = torch.zeros((len(batch), h.shape[-1]), device=h.device).index_add_(0, idx, h[keep]) / n
                    out[f"L{layer}.{p}"] = v.cpu().numpy()
                if self.per_token:
                    hc, oc = h.cpu(), own.cpu()
                    out[f"L{layer}.tokens"] = [part[o].numpy() for part, o in zip(hc.split(lens), oc.split(lens))]
        return out

    def embed_batch(self, batch: list[Tokenized]) -> dict:
        """Every product for one padded batch: pooled ``(len(batch), dim)`` float32 arrays,
        and for ``L{k}.tokens`` a list of ``(own tokens, dim)`` arrays."""
        import torch

        s = max(len(t.ids) for t in batch)
        ids = torch.full((len(batch), s), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), s), dtype=torch.long)
        own = torch.zeros((len(batch), s), dtype=torch.bool)
        for i, t in enumerate(batch):
            n = len(t.ids)
            ids[i, :n] = torch.tensor(t.ids)
            mask[i, :n] = 1
            own[i, :n] = torch.tensor(t.own)
        ids, mask, own = ids.to(self.device), mask.to(self.device), own.to(self.device)
        real = mask.bool()
        out = {}
        with torch.inference_mode():
            with self._precision():
                states = self._hidden(ids, mask)
            for layer, h in states.items():
                h = h.float()
                for p in self.poolings:
                    if p == "bos":
                        v = h[:, 0]
                    else:
                        keep = own if p == "mean" else real
                        v = h.masked_fill(~keep[..., None], 0.0).sum(1) / keep.sum(1, keepdim=True)
                    out[f"L{layer}.{p}"] = v.cpu().numpy()
                if self.per_token:
                    hc = h.cpu()
                    out[f"L{layer}.tokens"] = [hc[i][own[i].cpu()].numpy() for i in range(len(batch))]
        return out

    def packed_budget(self) -> int:
        """Tokens of one packed batch: on CUDA what the device's free memory holds
        (:func:`~ampflow.extract.batching.packed_token_budget`); on the CPU
        ``tokens_per_batch`` (its batch rule caps it further)."""
        if not self.device.startswith("cuda"):
            return self.tokens_per_batch
        import torch

        from .batching import packed_token_budget

        device = torch.device(self.device)
        free, _ = torch.cuda.mem_get_info(device)
        # the driver's free memory leaves out what this process's allocator holds cached
        # and unused (the blocks of the batches before): this batch can have them too
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        cfg = self.model.config
        inner = getattr(cfg, "intermediate_size", None) or 2 * getattr(cfg, "ffn_hidden", 2 * self.dim)
        width = 2 if self._autocast is not None else 4
        return packed_token_budget(free, self.dim, inner, width, len(self.layers))

    def embed(self, seqs: list[str], on_batch: Callable[[int, int, int], None] | None = None):
        """Every product for ``seqs`` in input order, and statistics.

        Batches follow :func:`~ampflow.extract.batching.plan_batches`; a batch that runs
        out of memory is split and retried (:func:`~ampflow.extract.batching.embed_with_backoff`),
        and ``stats["splits"]`` says which. ``on_batch(sequences, tokens, padded_tokens)``
        is called after every batch.
        """
        from .batching import embed_with_backoff, packed_padded_tokens, plan_batches, plan_packed, plan_varlen

        toks = self.tokenize(seqs)
        lengths = [len(t.ids) for t in toks]
        n = len(seqs)
        out: dict = {}
        for name in self.products:
            out[name] = [None] * n if name.endswith(".tokens") else np.empty((n, self.dim), dtype=np.float32)
        stats = {"tokens": 0, "padded_tokens": 0, "batches": 0}

        varlen = self.pack and self.packed_attention == "varlen"

        def run(b: list[int]) -> None:
            members = [toks[i] for i in b]
            if varlen:
                got = self.embed_varlen(members)
            else:
                got = self.embed_packed(members, self._rows(members)) if self.pack else self.embed_batch(members)
            for name, v in got.items():
                if name.endswith(".tokens"):
                    for i, a in zip(b, v):
                        out[name][i] = a
                else:
                    out[name][b] = v

        def done(b: list[int]) -> None:
            real = sum(lengths[i] for i in b)
            if varlen:
                padded = real
            elif self.pack:
                padded = packed_padded_tokens([lengths[i] for i in b], self._rows([toks[i] for i in b]))
            else:
                padded = len(b) * max(lengths[i] for i in b)
            stats["tokens"] += real
            stats["padded_tokens"] += padded
            stats["batches"] += 1
            if on_batch is not None:
                on_batch(len(b), real, padded)

        if varlen:
            budget = self.varlen_tokens or self.packed_budget()
            batches = plan_varlen(lengths, self.device, budget, kind=self.kind)
            stats["attention"] = self.attention_backend
            stats["tokens_per_batch"] = budget
        elif self.pack:
            batches, self.row_tokens = plan_packed(lengths, self.device, self.tokens_per_batch, self.attention_per_batch, kind=self.kind)
        else:
            batches = plan_batches(lengths, self.device, self.tokens_per_batch, self.attention_per_batch, kind=self.kind)
        _, stats["splits"] = embed_with_backoff(batches, run, lengths, None, on_batch=done)
        return out, stats


def load_embedder(spec: ModelSpec, folder, layers: list[int], device: str = "cpu") -> Embedder:
    """Load the model of ``spec`` from ``folder`` onto ``device`` (once per worker): only
    the blocks up to the deepest of ``layers``, its weights in the run's dtype, tensor by
    tensor straight to the device (``weights.load_model``; GPU workers take turns with
    ``weights.load_lock`` around it, see :mod:`.worker`)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .esmc import EsmcTokenizer
    from .weights import load_model

    hf_logging.disable_progress_bar()
    folder = Path(folder)
    # ESM C's vocabulary is built in code (its folder holds only the weights)
    tokenizer = EsmcTokenizer() if spec.kind == "esmc" else AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if tokenizer.pad_token_id is None:
        raise InputError("the model's tokenizer has no padding token", path=folder)
    # float32 on the CPU: the weights stay the file's pages, one copy shared by every
    # worker (bfloat16 there would give each worker a converted copy of its own)
    dtype = spec.dtype if device.startswith("cuda") else "float32"
    model = load_model(spec.kind, folder, dtype=dtype, device=device, n_blocks=max(layers))
    return Embedder(
        spec.kind, model, tokenizer, layers, spec.poolings, spec.per_token, device, dtype,
        spec.tokens_per_batch, spec.attention_per_batch, spec.pack,
    )  # fmt: skip
