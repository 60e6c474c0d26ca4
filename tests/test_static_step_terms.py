"""The static step's output names the terms the model computed: ``cross`` is computed
only where the stage's weights train it (the template's default weights do not), so the
step returns it only then, and the trainer's rows name every value rightly."""

from __future__ import annotations

import pytest
import torch
from parallel_equivalence import _problem

from ampflow.contract.config import LossWeights
from ampflow.train.static_step import TERM_ORDER, StaticStep, StepMode, forward_terms


@pytest.mark.parametrize("cross", [0.0, 0.5])
def test_terms_are_those_the_weights_train(cross):
    model, rna, hic, cond = _problem(torch.float32, "narrow")
    model.train()
    weights = LossWeights(cross=cross)
    step = StaticStep(model, torch.optim.Adam(model.parameters(), lr=1e-3), StepMode(reason="test"), torch.Generator().manual_seed(0))
    bufs = step.buffers(rna.shape[0], rna.shape[1], hic.shape[1], 0 if cond is None else cond.shape[1])
    bufs.rna.copy_(rna)
    bufs.hic.copy_(hic)
    if cond is not None:
        bufs.cond.copy_(cond)
    out = step.step(bufs, weights, full_batch=rna.shape[0])
    # the model's own terms on the same buffers (after the update: the names, not the values, are compared)
    with torch.no_grad():
        terms = forward_terms(model, weights, bufs.rna, bufs.hic, bufs.cond, bufs.eps_rna, bufs.eps_hic, bufs.eps_nodes, bufs.edge_idx, bufs.neg_idx)
    assert step.term_names() == [k for k in TERM_ORDER if k in terms]
    assert ("cross" in step.term_names()) == (cross > 0)
    assert out.shape == (len(terms),)
    # the total is the last value in either case, as the trainer's rows name it
    assert step.term_names()[-1] == "total"
