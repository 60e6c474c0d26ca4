"""AMP: profile the data and model, diagnose bottlenecks, plan the parallel strategies."""
