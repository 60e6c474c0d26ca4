"""DNABERT-S's attention without a (B, H, S, S) float32 bias.

The referee is the dense implementation this replaced, kept here only: one (B, H, S, S)
float32 ALiBi + padding bias for the whole batch, cast to the compute dtype in every
block. The production path must give the same vectors without building it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from largest_output import LargestOutput

from ampflow.extract.dnabert import DnabertConfig, DnabertModel


def dense_bias(model: DnabertModel, attention_mask: torch.Tensor) -> torch.Tensor:
    """The replaced ``attention_bias``: (B, H, S, S) float32, -inf at padded keys."""
    s = attention_mask.shape[1]
    pos = torch.arange(s)
    alibi = -model.encoder.slopes.float()[:, None, None] * (pos[None, :] - pos[:, None]).abs()
    pad = torch.zeros(attention_mask.shape, dtype=torch.float32).masked_fill(attention_mask == 0, float("-inf"))
    return alibi[None] + pad[:, None, None, :]


def dense_forward(model: DnabertModel, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The replaced forward pass (every block), with the same modules' weights."""
    x = model.embeddings(ids)
    bias = dense_bias(model, attention_mask)
    for block in model.encoder.layer:
        att = block.attention.self
        b, s, d = x.shape
        qkv = att.Wqkv(x).view(b, s, 3, att.heads, d // att.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype)).transpose(1, 2).reshape(b, s, d)
        x = block.mlp(block.attention.output(o, x))
    return x


def random_model(seed: int, heads: int, layers: int = 2, hidden: int = 48) -> DnabertModel:
    torch.manual_seed(seed)
    model = DnabertModel(DnabertConfig(vocab_size=64, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=64))
    for p in model.parameters():  # the default init leaves LayerNorms at 1/0: perturb them too
        p.data += 0.1 * torch.randn_like(p)
    return model.eval()


def random_batch(seed: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.randint(5, 64, (len(lengths), s), generator=g)
    mask = (torch.arange(s)[None] < torch.tensor(lengths)[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def pooled(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask[..., None].to(h.dtype)
    return ((h * m).sum(1) / m.sum(1)).float()


CASES = [  # (seed, heads, lengths)
    (0, 4, [37, 37, 37]),  # no padding: the shared bias alone
    (1, 4, [50, 41, 9, 1]),
    (2, 6, [64, 63, 20]),  # a head count that is not a power of two (MosaicBERT's slopes)
    (3, 12, [33, 17, 17, 2, 30]),
]


@pytest.mark.parametrize("seed,heads,lengths", CASES)
@pytest.mark.parametrize("elements", [None, 1, "three_heads"])
def test_equals_dense_bias_fp32(seed, heads, lengths, elements):
    model = random_model(seed, heads)
    ids, mask = random_batch(seed, lengths)
    b, s = ids.shape
    if elements is not None:  # one head a call, or three
        model.encoder.bias_elements = 1 if elements == 1 else 3 * b * s * s
    with torch.no_grad():
        got = model(ids, mask)
        ref = dense_forward(model, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed,heads,lengths", CASES[1:])
def test_equals_dense_bias_bf16(seed, heads, lengths):
    model = random_model(seed, heads)
    ids, mask = random_batch(seed, lengths)
    with torch.no_grad():
        ref32 = pooled(dense_forward(model, ids, mask), mask)
        model = model.to(torch.bfloat16)
        model.encoder.bias_elements = ids.shape[0] * ids.shape[1] ** 2  # one head a call
        got = pooled(model(ids, mask), mask)
        ref = pooled(dense_forward(model, ids, mask), mask)
    assert F.cosine_similarity(got, ref).min() >= 0.999
    assert F.cosine_similarity(got, ref32).min() >= 0.999


@pytest.mark.parametrize("lengths", [[96, 80, 70, 5], [96] * 4])
def test_no_batch_by_heads_by_s_squared_fp32_tensor(lengths):
    heads = 4
    model = random_model(5, heads, hidden=16)
    ids, mask = random_batch(5, lengths)
    b, s = ids.shape
    full = b * heads * s * s
    with torch.no_grad(), LargestOutput(torch.float32) as seen_ref:
        dense_forward(model, ids, mask)
    assert seen_ref.largest >= full  # the check below can see such a tensor
    # the default budget (2^24 elements) fits every head of this small batch, so that the
    # check means something here the budget is one head's (B, 1, S, S) mask
    model.encoder.bias_elements = b * s * s
    with torch.no_grad(), LargestOutput(torch.float32) as seen:
        model(ids, mask)
    assert seen.largest < full
    # nothing beyond one head's mask, the shared ALiBi, or the gated MLP's (B, S, 2 x 64)
    assert seen.largest <= max(b * s * s, heads * s * s, b * s * 2 * 64)


def test_heads_per_call_follow_the_budget():
    model = random_model(0, 12)
    bias = model.encoder.attention_bias(torch.ones(64, 2000, dtype=torch.long))
    assert bias.key_pad is None and bias.alibi.shape == (1, 12, 2000, 2000)
    # 64 DNABERT-S reads of 2,000 tokens: one head a call, 2.6 x 10^8 elements, not the
    # 3.1 x 10^9 of all twelve (11 GiB in float32)
    assert bias.heads_per_call(64, 2000, 12) == 1
    assert bias.heads_per_call(8, 512, 12) == 8
    assert bias.heads_per_call(4, 128, 12) == 12


@pytest.mark.parametrize("seed,heads,lengths", CASES)
@pytest.mark.parametrize("backend", ["segments", "flex"])
def test_packed_equals_dense_bias_fp32(seed, heads, lengths, backend):
    """Packed without mask (ALiBi restarting with each sequence): every real token's state
    equals the dense referee's on the padded batch."""
    from ampflow.extract.varlen import pack

    model = random_model(seed, heads)
    ids, mask = random_batch(seed, lengths)
    real = mask.bool()
    with torch.no_grad():
        ref = dense_forward(model, ids, mask)
        got = model.hidden_states_packed(ids[real], pack(lengths, "cpu", backend), [2])[2]
    torch.testing.assert_close(got, ref[real], atol=1e-5, rtol=1e-5)
