"""Torch reference implementation of the DSpark drafter (parity oracle for the JAX code)."""
