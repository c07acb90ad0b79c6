"""Training a drafter against a frozen target: data and anchors, losses, the jitted train step,
the checkpointed training run, and target pretraining for the tiny test models."""
