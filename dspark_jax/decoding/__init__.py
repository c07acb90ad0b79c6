"""Speculative decoding: sampling filters, lossless acceptance, verification schedulers, the
engine's device programs, its host loop and its metrics."""
