"""What a training step costs in time: the cost model and its calibration (see :mod:`ampflow.amp`)."""
