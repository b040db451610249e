"""Triton kernels, each beside its pure-torch reference (the selector comes with the MoE kernel)."""
