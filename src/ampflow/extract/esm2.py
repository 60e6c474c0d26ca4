"""ESM-2 as extraction loads it: transformers' ``EsmModel`` without pooler (the network is
transformers'; this module holds its adapter for :func:`ampflow.extract.weights.load_model`)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from torch import nn

from .checkpoint import SKIP, FolderAdapter, past_cut
from .varlen import Fused


class Esm2Adapter(FolderAdapter):
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

    def read_config(self, folder: Path):
        from transformers import EsmConfig

        return EsmConfig.from_pretrained(str(folder), local_files_only=True)

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
        if self.blocks < self.total and (past_cut(key, self.blocks, self.total) or key.startswith("encoder.emb_layer_norm_after.")):
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


# ---------------------------------------------------------------- packed, no mask
def _inv_freq(model: nn.Module) -> torch.Tensor:
    """The rotary frequencies: one shared buffer (transformers >= 4.5x's ``rotary_embeddings``)
    or, in older layouts, each attention layer's own (all equal)."""
    rot = getattr(model, "rotary_embeddings", None)
    if rot is None and len(model.encoder.layer):
        rot = getattr(model.encoder.layer[0].attention.self, "rotary_embeddings", None)
    if rot is None:
        raise ValueError("packed attention needs ESM-2's rotary embeddings (position_embedding_type: rotary)")
    return rot.inv_freq


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` for ``x (T, H, D)``: in float32, GPT-NeoX halves."""
    xf = x.float()
    a, b = xf.chunk(2, dim=-1)
    return (xf * cos[:, None] + torch.cat([-b, a], dim=-1) * sin[:, None]).to(x.dtype)


def _rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _gelu(x: torch.Tensor) -> torch.Tensor:
    """ESM's exact GELU (transformers' ``modeling_esm.gelu``)."""
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


# on CUDA each one kernel instead of ~10 (the rotation in float32) and 4 (the GELU), each
# pass over (T, width): at ESM-2 3B's width they would take about as long as the products
_ROTATE_QK = Fused(_rotate_qk)
_GELU = Fused(_gelu)


def hidden_states_packed(model: nn.Module, ids: torch.Tensor, packed, layers: list[int]) -> dict[int, torch.Tensor]:
    """Hidden states ``(T, hidden)`` of packed sequences (``ids (T,)``,
    :class:`~ampflow.extract.varlen.Packed`) after each of ``layers`` blocks of
    transformers' ``EsmModel`` ``model`` (0 = the embeddings; the model's depth = after
    its final LayerNorm), from one pass over its own modules and weights.

    transformers' forward computes rotary positions from the tensor's length and turns
    any mask into a dense one, so a packed row would need a (T, T) mask: this walks the
    same modules with each token's position in its sequence and attention over
    ``cu_seqlens`` (:func:`~ampflow.extract.varlen.attention`). Token dropout rescales
    each sequence by its own share of ``<mask>``, as the model does for one sequence.
    ``EsmModel`` itself is the referee (tests/test_extract_varlen.py).
    """
    from .varlen import attention

    cfg = model.config
    if getattr(cfg, "position_embedding_type", "absolute") != "rotary":
        raise ValueError("packed attention is for rotary ESM-2 (position_embedding_type: rotary)")
    emb = model.embeddings
    x = emb.word_embeddings(ids)
    if emb.token_dropout:
        masked = ids == emb.mask_token_id
        x = x.masked_fill(masked[:, None], 0.0)
        lens = torch.tensor(packed.lengths, device=ids.device, dtype=torch.float32)
        observed = torch.zeros(len(packed.lengths), device=ids.device).index_add_(0, packed.seq_index, masked.float()) / lens
        x = (x * (1 - 0.15 * 0.8) / (1 - observed)[packed.seq_index, None]).to(x.dtype)
    if emb.layer_norm is not None:
        x = emb.layer_norm(x)
    out = {0: x} if 0 in layers else {}
    deepest = max(layers)
    if deepest == 0:
        return out
    freqs = packed.positions[:, None].float() * _inv_freq(model).to(device=x.device, dtype=torch.float32)
    angles = torch.cat([freqs, freqs], dim=-1)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    heads = cfg.num_attention_heads
    blocks = model.encoder.layer
    for i, layer in enumerate(blocks[:deepest], start=1):
        att = layer.attention
        h = att.LayerNorm(x)
        sa = att.self
        width = sa.attention_head_size
        # transformers scales q by 1/sqrt(width) before the rotation; here the kernel
        # scales the scores (the same rounding for ESM-2's widths, powers of two)
        q, k = _ROTATE_QK(sa.query(h).unflatten(-1, (heads, width)), sa.key(h).unflatten(-1, (heads, width)), cos, sin)
        v = sa.value(h).unflatten(-1, (heads, width))
        ctx = attention(q, k, v, packed)
        x = att.output(ctx.flatten(1), x)
        # EsmIntermediate is dense + the exact GELU
        x = layer.output(_GELU(layer.intermediate.dense(layer.LayerNorm(x))), x)
        if i == len(blocks) and model.encoder.emb_layer_norm_after is not None:
            x = model.encoder.emb_layer_norm_after(x)
        if i in layers:
            out[i] = x
    return out
