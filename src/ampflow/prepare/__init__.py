"""From validated inputs to model-ready files: binning, strata matrices, guidance graph."""
