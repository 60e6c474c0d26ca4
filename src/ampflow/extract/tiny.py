"""Tiny, randomly initialised models shaped like ESM-2, DNABERT-S and ESM C, built locally.

For the demo, the tests and the benchmarks: nothing is downloaded and no weights are
committed. Each folder has what the real model's folder has, so that the same loaders
read both: ESM-2 a transformers ``EsmModel`` (``config.json``, ``model.safetensors``) with
the real 33-token ``vocab.txt``; DNABERT-S a ``config.json`` with the hub's keys, a
``model.safetensors`` with the hub's parameter names, and a real byte-pair-encoding
``tokenizer.json`` (``tokenizers`` library, trained here on random DNA) that adds
``[CLS]``/``[SEP]`` as DNABERT-S's does; ESM C a ``torch.save``d state dict with every
key of EvolutionaryScale's (masked-LM head included) at the hub's path
``data/weights/esmc_tiny_v0.pth``, and a ``config.json`` naming its shape (the hub's
holds ``{}``: the published shapes are known). Same seed, same weights.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

from ..base.atomic import atomic_path

if TYPE_CHECKING:
    import torch

# facebook/esm2_*: 4 specials, 25 amino-acid codes, '.', '-', one null to pad to 32, mask
ESM_VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>"] + list("LAGVSERTIDPKQNFYMHWCXBUZO") + [".", "-", "<null_1>", "<mask>"]
DNA_SPECIALS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]

# esm2_t33_650M_UR50D and DNABERT-S (for the benchmark's full-size shapes)
ESM2_650M = {"hidden": 1280, "layers": 33, "heads": 20, "intermediate": 5120}
TINY = {"hidden": 32, "layers": 2, "heads": 4, "intermediate": 64}


def _quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def esm2_model(seed: int = 0, hidden: int = 32, layers: int = 2, heads: int = 4, intermediate: int = 64):
    """A randomly initialised transformers ``EsmModel`` of ESM-2's architecture."""
    import torch
    from transformers import EsmConfig, EsmModel

    _quiet()
    cfg = EsmConfig(
        vocab_size=len(ESM_VOCAB),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=1026,
        position_embedding_type="rotary",
        token_dropout=True,
        emb_layer_norm_before=False,
        mask_token_id=ESM_VOCAB.index("<mask>"),
        pad_token_id=ESM_VOCAB.index("<pad>"),
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(seed)
    return EsmModel(cfg, add_pooling_layer=False).eval()


def write_esm2(folder, seed: int = 0, **shape) -> Path:
    """Write an ESM-2-shaped model folder (atomically)."""
    from transformers import EsmTokenizer

    folder = Path(folder)
    with atomic_path(folder) as tmp:
        tmp.mkdir(parents=True)
        (tmp / "vocab.txt").write_text("\n".join(ESM_VOCAB) + "\n")
        EsmTokenizer(str(tmp / "vocab.txt")).save_pretrained(tmp)
        esm2_model(seed, **{**TINY, **shape}).save_pretrained(tmp)
    return folder


def dna_tokenizer(seed: int = 0, vocab_size: int = 512):
    """A byte-pair-encoding tokenizer over A, C, G, T, N trained on random DNA, with
    DNABERT-2's special tokens and ``[CLS] $A [SEP]`` post-processing."""
    from tokenizers import Tokenizer, models, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    # enough text for merges up to ~5 bases a token, as DNABERT-S's 4096-token vocabulary gives
    corpus = ["".join(rng.choice("ACGT") for _ in range(rng.randint(200, 2000))) for _ in range(200)]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=DNA_SPECIALS, initial_alphabet=list("ACGTN"), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]")


def write_dnabert_s(folder, seed: int = 0, hidden: int = 32, layers: int = 2, heads: int = 4, intermediate: int = 64) -> Path:
    """Write a DNABERT-S-shaped model folder (atomically)."""
    import torch
    from safetensors.torch import save_file

    from .dnabert import DnabertConfig, DnabertModel

    folder = Path(folder)
    tokenizer = dna_tokenizer(seed)
    cfg = DnabertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
    )
    torch.manual_seed(seed)
    model = DnabertModel(cfg)
    with atomic_path(folder) as tmp:
        tmp.mkdir(parents=True)
        tokenizer.save_pretrained(tmp)
        # the class name the hub's DNABERT-S folder gives (older transformers need it)
        tc = json.loads((tmp / "tokenizer_config.json").read_text())
        tc["tokenizer_class"] = "PreTrainedTokenizerFast"
        (tmp / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
        config = {
            **cfg.to_json(),
            "architectures": ["BertModel"],
            "model_type": "bert",
            "alibi_starting_size": 512,
            "attention_probs_dropout_prob": 0.0,
            "hidden_dropout_prob": 0.1,
            "hidden_act": "gelu",
            "max_position_embeddings": 512,
            "position_embedding_type": "absolute",
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return folder


def esmc_model(seed: int = 0, hidden: int = 32, layers: int = 2, heads: int = 4):
    """A randomly initialised :class:`~ampflow.extract.esmc.EsmcModel` with its masked-LM
    head; the LayerNorms random too (torch initialises them to 1 and 0, which would hide
    a norm read from the wrong key)."""
    import torch

    from .esmc import EsmcConfig, EsmcModel

    torch.manual_seed(seed)
    model = EsmcModel(EsmcConfig(d_model=hidden, n_heads=heads, n_layers=layers), head=True).eval()
    return randomise_norms_(model)


def randomise_norms_(model: torch.nn.Module) -> torch.nn.Module:
    """Random LayerNorm scales and shifts (from torch's global generator), so that a norm
    read from the wrong key, or left at its initial 1 and 0, shows in the outputs."""
    import torch

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.copy_(1 + 0.2 * torch.randn_like(m.weight))
                if m.bias is not None:
                    m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model


ESMC_WEIGHTS = "data/weights/esmc_tiny_v0.pth"


def write_esmc(folder, seed: int = 0, hidden: int = 32, layers: int = 2, heads: int = 4) -> Path:
    """Write an ESM C-shaped model folder (atomically): ``config.json`` and the state dict
    at :data:`ESMC_WEIGHTS`, as ``torch.save`` writes EvolutionaryScale's."""
    import torch

    folder = Path(folder)
    model = esmc_model(seed, hidden, layers, heads)
    with atomic_path(folder) as tmp:
        (tmp / ESMC_WEIGHTS).parent.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(model.config.to_json(), indent=2, sort_keys=True) + "\n")
        torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, tmp / ESMC_WEIGHTS)
    return folder


def write_tiny(kind: str, folder, seed: int = 0) -> Path:
    """A tiny model folder of ``kind`` (``esm2``, ``dnabert_s`` or ``esmc``)."""
    if kind == "esm2":
        return write_esm2(folder, seed)
    if kind == "dnabert_s":
        return write_dnabert_s(folder, seed)
    if kind == "esmc":
        return write_esmc(folder, seed)
    raise ValueError(f"unknown model kind {kind!r}")
