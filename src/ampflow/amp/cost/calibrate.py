"""Calibration of the cost model (:mod:`.model`): a micro-benchmark on the training device.

Times, forward and backward, the banded attention kernel the model runs
(:func:`ampflow.model.attention.local_attention_banded`) at the model's head count, head
width and window over ``anchors`` anchors, in one block and in ``blocks`` query chunks,
one matrix product of the stratum block's feed-forward shape, and the cell encoder's two
hidden layers (:class:`ampflow.model.encoders.Encoder`) at the model's hidden width over
one batch of ``train.batch_size`` cells of :data:`ENCODER_INPUTS` features. The two kernel timings
share their FLOPs, so their difference is the per-chunk overhead and the rest of one
block's time gives the kernel's rate (:func:`~.model.solve_calibration`). Each
timing is the fastest of ``reps`` runs after a warm-up, the two chunk settings
interleaved so that a load that comes and goes touches both.

The result (``calibration.json``) is what the diagnosis reads; a plan is a pure function
of it, the profile and the devices.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from ...contract.attention_blocks import band_groups, band_width
from ...contract.config import ModelConfig, TrainConfig
from .model import CALIBRATION_VERSION, attention_flops, encoder_flops, solve_calibration

log = logging.getLogger(__name__)

#: Anchors and query chunks of the micro-benchmark: big enough that one block's FLOPs
#: show beside its overhead, small enough to take about a second on one CPU thread.
ANCHORS = 4096
BLOCKS = 64
#: Input features of the encoder timed: the rate of its skinny products depends on the
#: batch and the hidden width (both timed as the model has them) far more than on this.
ENCODER_INPUTS = 4096


def _device(train: TrainConfig) -> torch.device:
    if train.device == "cuda" or (train.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def _device_name(dev: torch.device, threads: int) -> str:
    if dev.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(dev)})"
    return f"cpu ({threads} thread{'s' if threads != 1 else ''})"


def _timer(dev: torch.device):
    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def run(fn) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    return run


def calibrate(model: ModelConfig | None = None, train: TrainConfig | None = None, anchors: int = ANCHORS,
              blocks: int = BLOCKS, reps: int = 5, seed: int = 0, threads: int | None = None) -> dict:  # fmt: skip
    """Run the micro-benchmark; return the calibration document (JSON-able).

    Parameters
    ----------
    model : ModelConfig, optional
        Heads, head width ``D / heads`` and window of the kernel timed, and the encoder's
        ``hidden_dim``; default the default model.
    train : TrainConfig, optional
        ``device`` (auto: CUDA when visible) and ``threads`` (CPU) the training runs with,
        and the ``batch_size`` the encoder is timed at.
    anchors : int
        Sequence length ``N`` of the kernel timed.
    blocks : int
        Query chunks of the chunked timing (chunk ``ceil(N / blocks)``), >= 2.
    reps : int
        Timed runs per setting; the fastest counts.
    seed : int
    threads : int, optional
        CPU threads to time with: those the plan will give each training process
        (:func:`ampflow.amp.decide.cpu.threads_per_process`); default ``train.threads`` when it
        is an integer, else 1.

    Returns
    -------
    dict
        ``version``, ``device``, ``torch``, ``shape``, ``measured`` (seconds) and
        ``constants`` (:class:`~.model.CostConstants`, rounded).
    """
    from ...model.attention import local_attention_banded

    model = model or ModelConfig()
    train = train or TrainConfig()
    if blocks < 2 or anchors < blocks:
        raise ValueError(f"need anchors >= blocks >= 2, got anchors={anchors}, blocks={blocks}")
    dev = _device(train)
    threads_before = torch.get_num_threads()
    threads = int(threads or train.explicit_threads or 1)
    if dev.type == "cpu":
        torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(seed)
        H, D, w, f = model.heads, model.D, model.window, model.ffn_mult
        Dh = D // H
        chunk = math.ceil(anchors / blocks)
        n_blocks = len(list(band_groups(anchors, w, chunk)))
        q = torch.randn(H, anchors, Dh, generator=g).to(dev).requires_grad_()
        v = torch.randn(H, anchors, Dh, generator=g).to(dev).requires_grad_()
        x = torch.randn(anchors, D, generator=g).to(dev).requires_grad_()
        weight = torch.randn(2 * f * D, D, generator=g).to(dev).requires_grad_()
        B, hidden = train.batch_size, model.hidden_dim
        cells = torch.randn(B, ENCODER_INPUTS, generator=g).to(dev)  # data: no gradient
        layer1 = torch.randn(hidden, ENCODER_INPUTS, generator=g).to(dev).requires_grad_()
        layer2 = torch.randn(hidden, hidden, generator=g).to(dev).requires_grad_()

        def attention(c):
            def fn():
                local_attention_banded(q, q, v, w, c).sum().backward()

            return fn

        def dense():
            (x @ weight.T).sum().backward()

        def encoder():
            ((cells @ layer1.T) @ layer2.T).sum().backward()

        timed = _timer(dev)
        one, many, mm = attention(None), attention(chunk), dense
        for fn in (one, many, mm, encoder):  # warm-up
            timed(fn)
        t_one = t_many = t_mm = t_enc = math.inf
        for _ in range(max(1, reps)):
            t_one = min(t_one, timed(one))
            t_many = min(t_many, timed(many))
            t_mm = min(t_mm, timed(mm))
            t_enc = min(t_enc, timed(encoder))
        name = _device_name(dev, threads)
        flops = attention_flops(anchors, w, H, Dh)
        dense_flops = 3.0 * 2.0 * anchors * D * 2 * f * D
        enc_flops = encoder_flops(B, ENCODER_INPUTS, hidden)
        width = band_width(anchors, w)
        constants = solve_calibration(t_one, t_many, n_blocks, flops, t_mm, dense_flops, t_enc, enc_flops, width,
                                      source=f"calibrated on {name}")  # fmt: skip
    finally:
        torch.set_num_threads(threads_before)
    doc = {
        "version": CALIBRATION_VERSION,
        "device": name,
        "torch": torch.__version__,
        "shape": {
            "anchors": anchors,
            "heads": H,
            "head_dim": Dh,
            "window": w,
            "band_width": width,
            "D": D,
            "ffn_mult": f,
            "batch_size": B,
            "hidden_dim": hidden,
            "encoder_inputs": ENCODER_INPUTS,
            "chunk": chunk,
            "blocks": n_blocks,
            "reps": reps,
        },  # fmt: skip
        "measured": {
            "one_block_s": t_one,
            "chunked_s": t_many,
            "dense_s": t_mm,
            "encoder_s": t_enc,
            "attention_flops": flops,
            "dense_flops": dense_flops,
            "encoder_flops": enc_flops,
        },  # fmt: skip
        "constants": constants.to_dict(),
    }
    log.info("calibration on %s: one block %.3g s, %d chunks %.3g s, matmul %.3g s, encoder %.3g s -> %s", name, t_one, n_blocks,
             t_many, t_mm, t_enc, doc["constants"])  # fmt: skip
    return doc
