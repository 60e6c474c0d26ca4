"""ampflow: single-cell Hi-C + RNA co-assays from raw pairs to sharded multi-GPU training."""

__version__ = "0.1.0"
