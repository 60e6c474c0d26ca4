"""ESM C (EvolutionaryScale's ESM Cambrian, 2024-12) in plain PyTorch, and its loader adapter.

EvolutionaryScale's ``esm`` package (3.1.x) pins ``transformers<4.48.2``, ``torchtext``
and ``biotite==0.41.2``: installed beside torch 2.13 and transformers 5 it would
downgrade transformers, tokenizers and numpy and bring a torchtext built for torch 2.3.
This module is the same network, written from the package's ``esm/models/esmc.py``,
``esm/layers/{transformer_stack,blocks,attention,rotary}.py`` (GitHub commit 6e89bf7;
the 3.1.6 wheel's network code differs only in formatting), with the
same parameter names, so the published state dicts (``data/weights/esmc_300m_2024_12_v0.pth``
of EvolutionaryScale/esmc-300m-2024-12, ``esmc_600m_2024_12_v0.pth`` of -600m-) load as
they are:

* ``embed``: a 64-row token embedding (the vocabulary has 33 tokens), no positions;
* per block (pre-LN), with residual scaling ``1 / sqrt(n_layers / 36)``: LayerNorm and a
  fused q/k/v projection without bias (``attn.layernorm_qkv``), LayerNorms without bias
  on q and k over the whole width (``attn.q_ln``, ``attn.k_ln``), rotary embeddings per
  head (GPT-NeoX halves, base 10000, positions from 0 counting special tokens and
  padding), ``scaled_dot_product_attention`` where a token attends to the tokens of its
  own kind (real with real, padding with padding: the reference's ``sequence_id`` mask,
  so no row is empty), ``attn.out_proj``; then LayerNorm + SwiGLU (``ffn.0``, ``ffn.1``
  to twice the hidden width, ``ffn.3`` back; hidden = 8/3 x width rounded up to 256);
* ``transformer.norm``: a final LayerNorm without bias (the reference's ``embeddings``);
* ``sequence_head`` (the masked-LM head): written by :func:`~ampflow.extract.tiny.write_esmc`
  so a tiny checkpoint has every key a published one has, never built for extraction.

Layers as for ESM-2: 0 = the token embeddings, k = after block k, the last = after the
final LayerNorm (the reference's ``output.embeddings``; its ``hidden_states[-1]`` is the
same block's output before that norm).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..base.errors import InputError
from .checkpoint import Checkpoint, kept_blocks
from .varlen import Fused

# esm/utils/constants/esm3.py SEQUENCE_VOCAB (ESM3's sequence tokenizer, which ESM C uses):
# one token per letter, <cls> first and <eos> last, unknown letters -> <unk>
SEQUENCE_VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>"] + list("LAGVSERTIDPKQNFYMHWCXBUZO") + [".", "-", "|", "<mask>"]
EMBED_ROWS = 64  # nn.Embedding(64, d_model): rows past the vocabulary are never used
ROTARY_BASE = 10000.0
FFN_EXPANSION = 8 / 3  # TransformerStack's expansion_ratio for ESM C


@dataclass(frozen=True)
class EsmcConfig:
    """ESM C's three shape numbers (the reference's ``ESMC(d_model, n_heads, n_layers)``)."""

    d_model: int = 960
    n_heads: int = 15
    n_layers: int = 30

    def __post_init__(self):
        for key in ("d_model", "n_heads", "n_layers"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise InputError("must be an integer >= 1", key=key, value=getattr(self, key))
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise InputError("d_model must be n_heads x an even head width (rotary)", key="d_model", value=self.d_model)

    @property
    def hidden_size(self) -> int:  # the name the Embedder reads
        return self.d_model

    @property
    def num_hidden_layers(self) -> int:
        return self.n_layers

    @property
    def ffn_hidden(self) -> int:
        """blocks.swiglu_correction_fn: 8/3 x d_model rounded up to a multiple of 256."""
        return int((FFN_EXPANSION * self.d_model + 255) // 256 * 256)

    @property
    def residue_scale(self) -> float:
        """Every block divides its residual branches by this (of the whole depth)."""
        return math.sqrt(self.n_layers / 36)

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# esm/pretrained.py: ESMC_300M_202412, ESMC_600M_202412
PUBLISHED = {"esmc_300m": EsmcConfig(960, 15, 30), "esmc_600m": EsmcConfig(1152, 18, 36)}


# ---------------------------------------------------------------- tokens
class EsmcTokenizer:
    """ESM C's sequence vocabulary, built in code: one id per letter, ``<cls>`` before and
    ``<eos>`` after, letters outside the vocabulary (lower case too) ``<unk>``, as the
    reference's ``EsmSequenceTokenizer`` (a BPE without merges) encodes them."""

    char_level = True  # the Embedder looks letters up in get_vocab() itself

    def __init__(self):
        self._vocab = {tok: i for i, tok in enumerate(SEQUENCE_VOCAB)}
        self.cls_token_id = self._vocab["<cls>"]
        self.pad_token_id = self._vocab["<pad>"]
        self.eos_token_id = self._vocab["<eos>"]
        self.unk_token_id = self._vocab["<unk>"]
        self.mask_token_id = self._vocab["<mask>"]

    def __len__(self) -> int:
        return len(self._vocab)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def encode(self, seq: str) -> list[int]:
        v, unk = self._vocab, self.unk_token_id
        return [self.cls_token_id, *(v.get(c, unk) for c in seq), self.eos_token_id]


# ---------------------------------------------------------------- the network
def rotary_tables(length: int, head_width: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``(length, head_width)`` of positions 0..length-1: the reference's
    frequencies in float32, each half of the head width with the same table, cast to the
    dtype of q and k as the reference's cache is."""
    inv_freq = 1.0 / (ROTARY_BASE ** (torch.arange(0, head_width, 2, device=device, dtype=torch.float32) / head_width))
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    return torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x (B, L, H, D)`` by position: ``x cos + rotate_half(x) sin`` with
    ``rotate_half([a, b]) = [-b, a]`` over the halves of D (not interleaved)."""
    a, b = x.chunk(2, dim=-1)
    if cos.dim() == 3:  # per-token tables (B, L, D): packed rows, positions per sequence
        cos, sin = cos[:, :, None], sin[:, :, None]
    else:
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + torch.cat([-b, a], dim=-1) * sin


def _rotate_qk(q, k, cos, sin):
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


_ROTATE_QK = Fused(_rotate_qk)  # one kernel on CUDA for the chain of elementwise passes


class EsmcAttention(nn.Module):
    def __init__(self, cfg: EsmcConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.layernorm_qkv = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 3 * d, bias=False))
        self.out_proj = nn.Linear(d, d, bias=False)
        self.q_ln = nn.LayerNorm(d, bias=False)
        self.k_ln = nn.LayerNorm(d, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x (B, L, D)``, ``mask (B, 1, L, L)`` True where a query may see a key."""
        q, k, v = self.layernorm_qkv(x).chunk(3, dim=-1)
        # under autocast the norms run in float32: back to the projection's dtype
        q, k = self.q_ln(q).to(q.dtype), self.k_ln(k).to(q.dtype)
        heads = (self.n_heads, -1)
        q = apply_rotary(q.unflatten(-1, heads), cos, sin).transpose(1, 2)
        k = apply_rotary(k.unflatten(-1, heads), cos, sin).transpose(1, 2)
        v = v.unflatten(-1, heads).transpose(1, 2)
        ctx = F.scaled_dot_product_attention(q, k, v, mask)  # (B, H, L, D/H)
        return self.out_proj(ctx.transpose(1, 2).flatten(2))

    def forward_packed(self, x: torch.Tensor, packed, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x (T, D)`` of packed sequences (:class:`~ampflow.extract.varlen.Packed`),
        ``cos``/``sin (T, D/H)`` at each token's position in its sequence."""
        from .varlen import attention

        q, k, v = self.layernorm_qkv(x).chunk(3, dim=-1)
        q, k = self.q_ln(q).to(q.dtype), self.k_ln(k).to(q.dtype)
        heads = (self.n_heads, -1)
        q, k = _ROTATE_QK(q.unflatten(-1, heads), k.unflatten(-1, heads), cos, sin)  # (T, H, D/H)
        return self.out_proj(attention(q, k, v.unflatten(-1, heads), packed).flatten(1))


class SwiGLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class EsmcBlock(nn.Module):
    def __init__(self, cfg: EsmcConfig):
        super().__init__()
        d, h = cfg.d_model, cfg.ffn_hidden
        self.attn = EsmcAttention(cfg)
        self.ffn = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * h, bias=False), SwiGLU(), nn.Linear(h, d, bias=False))
        self.scale = cfg.residue_scale

    def forward(self, x, mask, cos, sin):
        x = x + self.attn(x, mask, cos, sin) / self.scale
        return x + self.ffn(x) / self.scale

    def forward_packed(self, x, packed, cos, sin):
        x = x + self.attn.forward_packed(x, packed, cos, sin) / self.scale
        return x + self.ffn(x) / self.scale


class EsmcStack(nn.Module):
    def __init__(self, cfg: EsmcConfig, n_blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(EsmcBlock(cfg) for _ in range(n_blocks))
        # the final norm belongs to the last block: absent when the network is cut
        self.norm = nn.LayerNorm(cfg.d_model, bias=False) if n_blocks == cfg.n_layers else None


def sequence_head(d_model: int) -> nn.Module:
    """The masked-LM head (regression_head.RegressionHead(d_model, 64))."""
    return nn.Sequential(nn.Linear(d_model, d_model), nn.GELU(), nn.LayerNorm(d_model), nn.Linear(d_model, EMBED_ROWS))


class EsmcModel(nn.Module):
    """The ESM C encoder, its first ``n_blocks`` blocks (all by default).

    Parameters
    ----------
    cfg
        The whole model's shape (the residual scaling depends on its full depth).
    n_blocks
        Blocks built; the final norm only when all are.
    head
        Also build the masked-LM ``sequence_head`` (to write complete checkpoints).
    """

    def __init__(self, cfg: EsmcConfig, n_blocks: int | None = None, head: bool = False):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(EMBED_ROWS, cfg.d_model)
        self.transformer = EsmcStack(cfg, cfg.n_layers if n_blocks is None else min(n_blocks, cfg.n_layers))
        self.sequence_head = sequence_head(cfg.d_model) if head else None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_layers: int | None = None) -> torch.Tensor:
        n = len(self.transformer.blocks) if n_layers is None else n_layers
        return self.hidden_states(input_ids, attention_mask, [n])[n]

    def hidden_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: list[int], positions: torch.Tensor | None = None
    ) -> dict[int, torch.Tensor]:
        """Hidden states ``(B, L, d_model)`` after each of ``layers`` blocks (0 = the token
        embeddings; the model's depth = after the final norm), from one pass that stops
        at the deepest one. ``attention_mask (B, L)``: 1 at tokens, 0 at padding; or, for
        packed rows, each row's sequences numbered 1, 2, ... (a token sees the tokens of
        its number only) with ``positions (B, L)`` each sequence's rotary positions
        from 0."""
        mask = (attention_mask[:, :, None] == attention_mask[:, None, :])[:, None]
        x, out, deepest, dtype = self._embedded(input_ids, layers)
        if deepest == 0:
            return out
        cos, sin = rotary_tables(x.shape[1], self.config.d_model // self.config.n_heads, x.device, dtype)
        if positions is not None:  # (B, L, D): each token its own sequence's position
            cos, sin = cos[positions], sin[positions]
        for i, block in enumerate(self.transformer.blocks[:deepest], start=1):
            x = block(x, mask, cos, sin)
            if i == self.config.n_layers and self.transformer.norm is not None:
                x = self.transformer.norm(x)
            if i in layers:
                out[i] = x
        return out

    def _embedded(self, input_ids: torch.Tensor, layers: list[int]) -> tuple[torch.Tensor, dict, int, torch.dtype]:
        """The token embeddings, the outputs so far (layer 0's if asked for), the deepest
        layer asked for and the dtype of q and k (the projections' output: autocast's, or
        the weights'). Raises ValueError for a layer outside the blocks built."""
        built = len(self.transformer.blocks)
        if any(not 0 <= layer <= built for layer in layers):
            raise ValueError(f"layers {layers} outside 0..{built} (the blocks built)")
        x = self.embed(input_ids)
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        return x, ({0: x} if 0 in layers else {}), max(layers), dtype

    def hidden_states_packed(self, input_ids: torch.Tensor, packed, layers: list[int]) -> dict[int, torch.Tensor]:
        """:meth:`hidden_states` of packed sequences: ``input_ids (T,)`` one sequence after
        another (:class:`~ampflow.extract.varlen.Packed`), states ``(T, d_model)``; no
        mask, each sequence's rotary positions from 0, attention over ``cu_seqlens``."""
        x, out, deepest, dtype = self._embedded(input_ids, layers)
        if deepest == 0:
            return out
        cos, sin = rotary_tables(packed.max_len, self.config.d_model // self.config.n_heads, x.device, dtype)
        cos, sin = cos[packed.positions], sin[packed.positions]
        for i, block in enumerate(self.transformer.blocks[:deepest], start=1):
            x = block.forward_packed(x, packed, cos, sin)
            if i == self.config.n_layers and self.transformer.norm is not None:
                x = self.transformer.norm(x)
            if i in layers:
                out[i] = x
        return out


# ---------------------------------------------------------------- files
def weights_file(source) -> Path:
    """The checkpoint of an ESM C ``source``: the file itself, or the one ``*.pth`` (or
    ``model.safetensors``) inside the folder (the hub's ``data/weights/esmc_*.pth``)."""
    p = Path(source)
    if p.is_file():
        return p
    if not p.is_dir():
        raise InputError("no such file or folder", path=p)
    found = [f for f in sorted(p.rglob("*.pth")) + sorted(p.glob("model.safetensors")) if not any(s.startswith(".") for s in f.relative_to(p).parts)]
    if not found:
        raise InputError("no ESM C weights in the folder (a *.pth state dict such as data/weights/esmc_300m_2024_12_v0.pth, or model.safetensors)", path=p)
    if len(found) > 1:
        raise InputError(f"several weight files in the folder ({', '.join(str(f.relative_to(p)) for f in found)}); give the one to use as the source", path=p)
    return found[0]


def config_file(source) -> Path | None:
    """The ``config.json`` of an ESM C ``source``: in the folder given; for a weights
    file, beside it, or at the root of the hub's layout (``ROOT/data/weights/FILE``)."""
    p = Path(source)
    if p.is_dir():
        candidates = [p / "config.json"]
    else:
        candidates = [p.parent / "config.json"]
        if p.parent.parts[-2:] == ("data", "weights"):
            candidates.append(p.parent.parent.parent / "config.json")
    return next((c for c in candidates if c.is_file()), None)


_BLOCK = re.compile(r"^transformer\.blocks\.(\d+)\.")


def read_config(source, checkpoint=None) -> EsmcConfig:
    """The shape of the ESM C at ``source``: its ``config.json`` (:func:`config_file`) where
    it names ``d_model``/``n_heads``/``n_layers`` (as :func:`~ampflow.extract.tiny.write_esmc`
    writes; the hub's holds ``{}``), the rest from the checkpoint: the width from
    ``embed.weight``, the depth from the blocks, the heads from the published models
    (:data:`PUBLISHED`; another width needs ``n_heads`` in ``config.json``)."""
    weights = weights_file(source)
    given: dict = {}
    config = config_file(source)
    if config is not None:
        try:
            raw = json.loads(config.read_text())
        except ValueError as e:
            raise InputError(f"not JSON ({e})", path=config) from None
        given = {k: raw[k] for k in ("d_model", "n_heads", "n_layers") if isinstance(raw, dict) and k in raw}
    if len(given) < 3:
        ckpt = checkpoint or Checkpoint(weights.parent, files=[weights.name])
        try:
            keys = ckpt.keys()
            if "embed.weight" not in keys:
                raise InputError("not an ESM C state dict: no key embed.weight", path=weights)
            given.setdefault("d_model", int(ckpt.shape("embed.weight")[1]))
            blocks = {int(m.group(1)) for k in keys if (m := _BLOCK.match(k))}
            given.setdefault("n_layers", max(blocks) + 1 if blocks else 0)
        finally:
            if checkpoint is None:
                ckpt.close()
        if "n_heads" not in given:
            known = {c.d_model: c.n_heads for c in PUBLISHED.values()}
            if given["d_model"] not in known:
                raise InputError(
                    f"an ESM C of width {given['d_model']} is not a published one (widths {sorted(known)}): "
                    'say its heads in a config.json beside the weights, e.g. {"n_heads": 16}', path=weights,
                )  # fmt: skip
            given["n_heads"] = known[given["d_model"]]
    try:
        return EsmcConfig(**given)
    except InputError as e:
        raise InputError(f"ESM C shape: {e}", path=weights) from None


class EsmcAdapter:
    """How :func:`~ampflow.extract.weights.load_model` builds and fills :class:`EsmcModel`:
    key names as the reference model's ``state_dict`` (the masked-LM head skipped, blocks
    past the cut and the final norm of a cut network skipped)."""

    OPTIONAL = ()

    def __init__(self, source, n_blocks: int | None):
        self.weights = weights_file(source)
        self._ckpt = Checkpoint(self.weights.parent, files=[self.weights.name])
        try:
            self.config = read_config(source, self._ckpt)
        except BaseException:
            self._ckpt.close()
            raise
        self.total = self.config.n_layers
        self.blocks = kept_blocks(self.total, n_blocks)

    def checkpoint(self):
        return self._ckpt

    def skeleton(self) -> nn.Module:
        with torch.device("meta"):
            return EsmcModel(self.config, self.blocks)

    def name(self, key: str, prefixed: bool) -> str | None:
        if key.startswith("sequence_head."):
            return None
        m = _BLOCK.match(key)
        if m is not None and self.blocks <= int(m.group(1)) < self.total:
            return None
        if self.blocks < self.total and key.startswith("transformer.norm."):
            return None
        return key

    def is_prefixed(self, keys: list[str]) -> bool:
        return False

    def computed(self, model: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
        return {}  # the rotary tables are computed per pass
