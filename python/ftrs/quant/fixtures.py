"""Random quantized blocks for tests and tiny checkpoints.

NVFP4's scale bytes are any of 0..0x7F (zero, subnormals, 0x7F's zero, the largest, 448); its
tensor scale is not in the blocks and is the caller's.

Any bytes form a valid GGUF block once its fp16 scale fields hold finite numbers (MXFP4: once
its e8m0 exponent is in range): the quants are plain bit fields. The scale fields get random values of a magnitude that puts the weights
in about [-0.3, 0.3], the range of the tiny random models.
"""

from __future__ import annotations

import numpy as np

from ftrs.quant.formats import block_format

#: Byte offsets of each type's fp16 fields, and a typical magnitude for them.
_F16_FIELDS: dict[str, tuple[tuple[int, ...], float]] = {
    "Q8_0": ((0,), 2e-3), "Q4_0": ((0,), 3e-2), "Q4_1": ((0, 2), 3e-2),
    "Q5_0": ((0,), 1.5e-2), "Q5_1": ((0, 2), 1.5e-2), "Q2_K": ((80, 82), 5e-3),
    "Q3_K": ((108,), 2.5e-3), "Q4_K": ((0, 2), 3e-4), "Q5_K": ((0, 2), 1.5e-4),
    "Q6_K": ((208,), 7e-5), "IQ4_NL": ((0,), 2.4e-3), "IQ4_XS": ((0,), 7e-5),
    "IQ2_XXS": ((0,), 1.5e-3), "IQ2_XS": ((0,), 1.5e-3), "IQ2_S": ((0,), 1.5e-3),
    "IQ3_XXS": ((0,), 5e-4), "IQ3_S": ((0,), 5e-4), "IQ1_S": ((0,), 1.5e-2),
}
#: IQ1_M keeps its fp16 d in the top nibbles of the four u16 scale words at bytes 48..56.
_IQ1_M_SCALE = 1.5e-2
#: MXFP4 (no fp16 field): e8m0 exponents 2^-7..2^-5, e2m1 values up to 6: weights within 0.19.
_MXFP4_EXPONENTS = (120, 123)
RANDOM_TYPES = (*_F16_FIELDS, "MXFP4", "IQ1_M")


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, row_bytes) uint8: random quants, finite random fp16 scales."""
    f = block_format(qtype)
    if cols % f.block_elems:
        raise ValueError(f"{qtype}: {cols} columns is not a whole number of blocks")
    nblocks = rows * cols // f.block_elems
    raw = rng.integers(0, 256, size=(nblocks, f.block_bytes), dtype=np.uint8)
    if qtype == "MXFP4":
        raw[:, 0] = rng.integers(*_MXFP4_EXPONENTS, size=nblocks, dtype=np.uint8)
        return raw.reshape(rows, -1)
    if qtype == "NVFP4":  # the blocks only: the caller adds the tensor scale
        raw[:, :4] = rng.integers(0, 0x80, size=(nblocks, 4), dtype=np.uint8)
        return raw.reshape(rows, -1)
    if qtype == "IQ1_M":
        d = (rng.uniform(0.2, 1.0, size=nblocks) * _IQ1_M_SCALE).astype(np.float16).view(np.uint16)
        words = raw[:, 48:56].copy().view(np.uint16) & 0x0FFF
        nibbles = (d[:, None] >> np.array([0, 4, 8, 12], dtype=np.uint16)) & 0xF
        raw[:, 48:56] = (words | (nibbles << 12)).astype(np.uint16).view(np.uint8)
        return raw.reshape(rows, -1)
    offsets, scale = _F16_FIELDS[qtype]
    for off in offsets:
        val = rng.uniform(0.2, 1.0, size=nblocks) * scale
        if len(offsets) == 2 and off == offsets[1] and qtype in ("Q4_1", "Q5_1"):
            val = -rng.uniform(0.5, 1.0, size=nblocks) * scale * (8 if qtype == "Q4_1" else 16)
        raw[:, off:off + 2] = val.astype(np.float16).view(np.uint8).reshape(nblocks, 2)
    return raw.reshape(rows, -1)
