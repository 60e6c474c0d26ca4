"""Process groups and sharded operators that apply a plan's strategies to the plain model."""
