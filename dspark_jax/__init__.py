"""dspark-jax: DSpark speculative decoding (semi-autoregressive drafting, confidence-scheduled
verification) in JAX."""

__version__ = "0.1.0"
