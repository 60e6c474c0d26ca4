"""ESM-2 as extraction loads it: transformers' ``EsmModel`` without pooler (the network is
transformers'; this module holds its adapter for :func:`ampflow.extract.weights.load_model`)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from .checkpoint import SKIP, FolderAdapter, past_cut


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
