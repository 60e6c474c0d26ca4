"""What a training step holds at its peak, predicted from the model's shapes (see :mod:`ampflow.amp`)."""
