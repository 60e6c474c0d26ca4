"""The plan's decisions: signals, the strategy registry, the CPU figures, diagnose (see :mod:`ampflow.amp`)."""
