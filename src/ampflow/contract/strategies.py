"""The names of the parallel strategies: the only place they are spelled.

S-numbers are for people (docs, plans, reports); code uses these names. The diagnosis
attaches a rule to each (:mod:`ampflow.amp.decide.strategies`), :func:`ampflow.parallel.parallelize.parallelize`
applies them, and the memory model divides the terms each one targets.
"""

from __future__ import annotations

DATA_PARALLEL = "data_parallel"  # S1: ranks take different cells
FEATURE_PARALLEL = "feature_parallel"  # S2: each tp rank owns a shard of every stratum's features
CHUNKED_ATTENTION = "chunked_attention"  # S3: local attention by query chunks
KEY_FIRST_DECODE = "key_first_decode"  # S4: u . key[F_k]^T
HIDDEN_PARALLEL = "hidden_parallel"  # S5: the decoder width D split over the tp group

#: The built-in strategies in S-number order.
BUILT_IN = (DATA_PARALLEL, FEATURE_PARALLEL, CHUNKED_ATTENTION, KEY_FIRST_DECODE, HIDDEN_PARALLEL)
