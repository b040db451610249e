# mypy: allow-untyped-defs
# (Triton reads the annotations of @triton.jit functions itself: its kernels carry none but tl.constexpr.)
"""What every kernel module shares: whether Triton imports, whether it interprets, dot precision.

Triton decides at decoration time whether `@triton.jit` compiles or interprets (its
`TRITON_INTERPRET` knob), and its own `tl.*` helpers when it is first imported, so the knob
must be set before anything imports Triton (`tests/conftest.py` does, without a GPU). The interpreter runs `tl.dot` on numpy, which has no
bf16 (it multiplies the raw uint16 bits), so under it the kernels upcast dot operands to fp32
(`UPCAST`); compiled, they feed the tensor cores in the storage dtype.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def triton_importable() -> bool:
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:  # a broken install is as good as none: the references run
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU with numpy (`TRITON_INTERPRET=1`)."""
    if not triton_importable():
        return False
    import triton

    return bool(triton.knobs.runtime.interpret)


def dot_precision(dtype: torch.dtype) -> str:
    """`input_precision` of `tl.dot`: IEEE for fp32 operands (never TF32), the default otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if triton_importable():
    import triton
    import triton.language as tl

    def _round_to(x, dtype: tl.constexpr):
        """fp32 `x` rounded to nearest-even in `dtype`. bf16 goes through the bits: the
        interpreter's own fp32->bf16 cast truncates, and a store would cast the same way."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dtype)

    # Interpreted, a kernel's body runs as Python, and each call of a nested `@triton.jit`
    # function re-patches `triton.language` (~5 ms): called plainly, the same body is free
    # (the kernel tests of this package spend about a third of their time there otherwise).
    round_to = _round_to if interpreting() else triton.jit(_round_to)
