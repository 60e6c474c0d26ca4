"""A dispatch mode that records the largest tensor any aten op returns: how tests show
that a kernel never builds some tensor (an N x N score matrix, a dense B x H x S x S
bias) without trusting the kernel's own account."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargestOutput(TorchDispatchMode):
    """Records the largest number of elements of any tensor an aten op returns
    (of ``dtype`` only, when given)."""

    def __init__(self, dtype: torch.dtype | None = None):
        super().__init__()
        self.dtype = dtype
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and (self.dtype is None or t.dtype == self.dtype):
                self.largest = max(self.largest, t.numel())
        return out
