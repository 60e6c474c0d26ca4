"""DNABERT-S / DNABERT-2 encoder (MosaicBERT with ALiBi) in plain PyTorch.

The hub checkpoints (zhihan1996/DNABERT-S, zhihan1996/DNABERT-2-117M) ship their own
``bert_layers.py`` (remote code, unpadded layers, a Triton flash-attention kernel). Under
transformers 5 ``from_pretrained`` builds models on the meta device and that code fails
(``rebuild_alibi_tensor``), and remote code races on ``HF_MODULES_CACHE`` when several
workers load it at once. This module is the same network, written padded with an
additive attention bias, with the same parameter names, so the checkpoint's state dict
loads as is:

* embeddings: word + token type (no positions: ALiBi), LayerNorm;
* per layer: fused ``Wqkv``, attention with bias ``-slope_h * |i - j|`` plus a padding
  mask, output projection + residual + LayerNorm, gated GELU MLP (``gated_layers``
  without bias, ``wo``) + residual + LayerNorm (post-LN throughout);
* a CLS pooler, as the checkpoint has one (never run: :func:`load_dnabert` neither
  builds nor reads it).

Building from ``config.json`` and then loading the state dict is the path NOTES.md
recommends; nothing runs remote code. :func:`load_dnabert` builds on the meta device and
streams the tensors in (:mod:`ampflow.extract.weights`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..io.errors import InputError


@dataclass(frozen=True)
class DnabertConfig:
    """The ``config.json`` keys the network needs (DNABERT-S defaults)."""

    vocab_size: int = 4096
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 2
    pad_token_id: int = 0

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise InputError("hidden_size must be a multiple of num_attention_heads", key="hidden_size", value=self.hidden_size)

    @classmethod
    def from_json(cls, path) -> "DnabertConfig":
        raw = json.loads(Path(path).read_text())
        return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def alibi_slopes(n_heads: int) -> list[float]:
    """ALiBi head slopes (Press et al.), as MosaicBERT computes them for any head count."""

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        return power_of_2(n_heads)
    closest = 2 ** math.floor(math.log2(n_heads))
    return power_of_2(closest) + alibi_slopes(2 * closest)[0::2][: n_heads - closest]


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: DnabertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # token type 0 everywhere, as the reference does without token_type_ids
        x = self.word_embeddings(input_ids) + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: DnabertConfig):
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.Wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x: (B, S, D); bias: (B, H, S, S) additive (ALiBi + padding). Returns (B, S, D)."""
        b, s, d = x.shape
        qkv = self.Wqkv(x).view(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, S, Dh)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))
        return out.transpose(1, 2).reshape(b, s, d)


class BertSelfOutput(nn.Module):
    def __init__(self, cfg: DnabertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(h) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: DnabertConfig):
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, bias), x)


class BertGatedLinearUnitMLP(nn.Module):
    def __init__(self, cfg: DnabertConfig):
        super().__init__()
        self.inner = cfg.intermediate_size
        self.gated_layers = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gated_layers(x)
        h = F.gelu(h[..., : self.inner]) * h[..., self.inner :]
        return self.layernorm(self.wo(h) + x)


class BertLayer(nn.Module):
    def __init__(self, cfg: DnabertConfig):
        super().__init__()
        self.attention = BertAttention(cfg)
        self.mlp = BertGatedLinearUnitMLP(cfg)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attention(x, bias))


class BertEncoder(nn.Module):
    def __init__(self, cfg: DnabertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.register_buffer("slopes", torch.tensor(alibi_slopes(cfg.num_attention_heads)), persistent=False)

    def attention_bias(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, S) 1/0 mask -> (B, H, S, S) bias: -slope_h |i - j|, -inf at padded keys."""
        s = attention_mask.shape[1]
        pos = torch.arange(s, device=attention_mask.device)
        alibi = -self.slopes.float()[:, None, None] * (pos[None, :] - pos[:, None]).abs()  # (H, S, S)
        pad = torch.zeros(attention_mask.shape, dtype=torch.float32, device=attention_mask.device)
        pad = pad.masked_fill(attention_mask == 0, float("-inf"))
        return alibi[None] + pad[:, None, None, :]


class BertPooler(nn.Module):
    def __init__(self, cfg: DnabertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)


class DnabertModel(nn.Module):
    """The DNABERT-S encoder. ``forward`` returns hidden states (B, S, hidden_size) after
    ``n_layers`` blocks (all by default; 0 = the embedding output)."""

    def __init__(self, cfg: DnabertConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        self.pooler = BertPooler(cfg)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_layers: int | None = None) -> torch.Tensor:
        n = len(self.encoder.layer) if n_layers is None else n_layers
        return self.hidden_states(input_ids, attention_mask, [n])[n]

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: list[int]) -> dict[int, torch.Tensor]:
        """Hidden states after each of ``layers`` blocks (0 = the embedding output), from
        one pass that stops at the deepest one."""
        x = self.embeddings(input_ids)
        out = {0: x} if 0 in layers else {}
        bias = self.encoder.attention_bias(attention_mask)
        for i, block in enumerate(self.encoder.layer[: max(layers)], start=1):
            x = block(x, bias)
            if i in layers:
                out[i] = x
        return out


def load_dnabert(folder, dtype: str = "float32", device: str = "cpu", n_blocks: int | None = None) -> DnabertModel:
    """Build from ``config.json`` and stream the checkpoint in, tensor by tensor (see
    :func:`ampflow.extract.weights.load_model`); the pooler is neither built nor read."""
    from .weights import load_model

    return load_model("dnabert_s", folder, dtype, device, n_blocks)
