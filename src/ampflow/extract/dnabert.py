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
  mask (the bias shared by the batch, the mask per sequence, combined a few heads at a
  time: see :meth:`BertSelfAttention.forward`), output projection + residual +
  LayerNorm, gated GELU MLP (``gated_layers`` without bias, ``wo``) + residual +
  LayerNorm (post-LN throughout);
* a CLS pooler, as the checkpoint has one (never run: :class:`DnabertAdapter` neither
  builds nor reads it).

Building from ``config.json`` and then loading the state dict is the path NOTES.md
recommends; nothing runs remote code. ``load_model("dnabert_s", folder)``
(:mod:`ampflow.extract.weights`) builds it on the meta device through :class:`DnabertAdapter`
and streams the tensors in.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..base.errors import InputError
from .checkpoint import SKIP, FolderAdapter, past_cut


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
    def from_json(cls, path) -> DnabertConfig:
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


# see BertEncoder.bias_elements
BIAS_ELEMENTS = 1 << 24


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

    def forward(self, x: torch.Tensor, bias: AttentionBias) -> torch.Tensor:
        """x: (B, S, D); bias: the batch's shared ALiBi and key padding. Returns (B, S, D).

        Without padding the (1, H, S, S) ALiBi goes to attention as is, broadcast over the
        batch. With padding, ALiBi and the padded keys must be one additive mask per
        sequence, (B, heads, S, S): it is built a few heads at a time
        (:attr:`AttentionBias.elements` at most), never for every head of every sequence
        at once, and in the compute dtype. It is rebuilt in every block (memory traffic
        of one masked_fill, no matmul): keeping it across blocks would hold what this
        avoids. Under the planner's default attention budget (B x S^2 <= 2^22) every
        head fits one call, as before.
        """
        b, s, d = x.shape
        qkv = self.Wqkv(x).view(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, S, Dh)
        alibi = bias.alibi if bias.alibi.dtype == q.dtype else bias.alibi.to(q.dtype)
        if bias.key_pad is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=alibi)
        else:
            step = bias.heads_per_call(b, s, self.heads)
            out = torch.cat(
                [
                    F.scaled_dot_product_attention(
                        q[:, h : h + step],
                        k[:, h : h + step],
                        v[:, h : h + step],
                        attn_mask=alibi[:, h : h + step].masked_fill(bias.key_pad, float("-inf")),
                    )  # fmt: skip
                    for h in range(0, self.heads, step)
                ],
                dim=1,
            )
        return out.transpose(1, 2).reshape(b, s, d)

    def forward_packed(self, x: torch.Tensor, packed, slopes: torch.Tensor) -> torch.Tensor:
        """``x (T, D)`` of packed sequences (:class:`~ampflow.extract.varlen.Packed`):
        ALiBi per sequence, no mask, no padding."""
        from .varlen import attention

        t, d = x.shape
        q, k, v = self.Wqkv(x).view(t, 3, self.heads, d // self.heads).unbind(1)
        return attention(q, k, v, packed, slopes).reshape(t, d)


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

    def forward(self, x: torch.Tensor, bias: AttentionBias) -> torch.Tensor:
        return self.output(self.self(x, bias), x)

    def forward_packed(self, x: torch.Tensor, packed, slopes: torch.Tensor) -> torch.Tensor:
        return self.output(self.self.forward_packed(x, packed, slopes), x)


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

    def forward(self, x: torch.Tensor, bias: AttentionBias) -> torch.Tensor:
        return self.mlp(self.attention(x, bias))

    def forward_packed(self, x: torch.Tensor, packed, slopes: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attention.forward_packed(x, packed, slopes))


class BertEncoder(nn.Module):
    def __init__(self, cfg: DnabertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.register_buffer("slopes", torch.tensor(alibi_slopes(cfg.num_attention_heads)), persistent=False)
        # The most elements of a padded batch's additive mask built at once (2^24: 32 MiB
        # in bfloat16): attention is called on as many heads at a time as fit, so a
        # batch's mask costs this much, not B x H x S^2; more heads a call only saves
        # kernel launches, which matter for short sequences, and those fit whole.
        self.bias_elements = BIAS_ELEMENTS

    def attention_bias(self, attention_mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> AttentionBias:
        """(B, S) 1/0 mask -> the ALiBi ``-slope_h |i - j|`` as one (1, H, S, S) tensor in
        ``dtype`` shared by every sequence, and the padded keys as a (B, 1, 1, S) boolean
        (None when nothing is padded): B times smaller than the (B, H, S, S) float32 sum
        this once built, which a batch of 64 DNABERT-S reads of 2,000 tokens made 11 GiB."""
        s = attention_mask.shape[1]
        pos = torch.arange(s, device=attention_mask.device)
        # float32 first, then rounded once to the compute dtype (as the sum was)
        alibi = (-self.slopes.float()[:, None, None] * (pos[None, :] - pos[:, None]).abs())[None].to(dtype)
        pad = attention_mask == 0
        key_pad = pad[:, None, None, :] if bool(pad.any()) else None
        return AttentionBias(alibi, key_pad, self.bias_elements)


class AttentionBias:
    """What every attention block of one batch shares: ALiBi ``alibi`` (1, H, S, S) and
    the padded keys ``key_pad`` (B, 1, 1, S) bool, or None without padding."""

    def __init__(self, alibi: torch.Tensor, key_pad: torch.Tensor | None, elements: int):
        self.alibi = alibi
        self.key_pad = key_pad
        self.elements = elements

    def heads_per_call(self, batch: int, length: int, heads: int) -> int:
        """Heads whose (B, heads, S, S) padded bias fits in :attr:`elements` (at least one)."""
        return max(1, min(heads, self.elements // (batch * length * length)))


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
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        bias = self.encoder.attention_bias(attention_mask, dtype)
        for i, block in enumerate(self.encoder.layer[: max(layers)], start=1):
            x = block(x, bias)
            if i in layers:
                out[i] = x
        return out

    def hidden_states_packed(self, input_ids: torch.Tensor, packed, layers: list[int]) -> dict[int, torch.Tensor]:
        """:meth:`hidden_states` of packed sequences: ``input_ids (T,)`` one sequence after
        another (:class:`~ampflow.extract.varlen.Packed`), states ``(T, hidden_size)``;
        ALiBi restarts with each sequence, no mask, no padding."""
        x = self.embeddings(input_ids)
        out = {0: x} if 0 in layers else {}
        for i, block in enumerate(self.encoder.layer[: max(layers)], start=1):
            x = block.forward_packed(x, packed, self.encoder.slopes)
            if i in layers:
                out[i] = x
        return out


class DnabertAdapter(FolderAdapter):
    """How :func:`~ampflow.extract.weights.load_model` builds and fills :class:`DnabertModel`,
    from the hub's parameter names (the masked-LM head and the CLS pooler neither built nor read)."""

    def read_config(self, folder: Path) -> DnabertConfig:
        return DnabertConfig.from_json(folder / "config.json")

    def skeleton(self) -> nn.Module:
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
        if key.startswith("pooler.") or past_cut(key, self.blocks, self.total):
            return SKIP
        return key

    def is_prefixed(self, keys: list[str]) -> bool:
        return False

    def computed(self, model: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
        return {"encoder.slopes": torch.tensor(alibi_slopes(self.config.num_attention_heads), device=device)}
