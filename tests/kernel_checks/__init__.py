"""Triton kernel tests. A package (for its conftest), so its name is importable from tests/:
not `kernels`, which transformers probes for as an optional library and would then import."""
