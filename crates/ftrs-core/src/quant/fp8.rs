//! FP8 block-scaled weights (`quant_method: fp8`, as DeepSeek's and Qwen's FP8 checkpoints ship
//! them): one `float8_e4m3fn` byte per weight, row-major, then one fp32 scale per `br x bc` tile,
//! row-major over the tile grid (`ceil(rows / br) x ceil(cols / bc)`, little-endian): the
//! `FP8_BLOCK` buffer of `python/ftrs/quant/formats.py`, weights and scales in one block so the
//! pool and the link carry them together.
//!
//! [`matmul`] decodes each weight row once into an fp32 row buffer, each weight times its tile's
//! scale in one fp32 multiply (the reference's `w.float() * scale`, so the buffer holds exactly
//! the reference's dequantized row), then dots it with every activation row: a row buffer of
//! `cols` floats stays in L1/L2 while `n` activation rows read it, so prefill decodes once per
//! weight row. The result differs from the reference (dequantize, then an fp32 matmul) only in
//! the order of the fp32 sums. With one activation row (decode) and AVX2, the weights meet x in
//! registers instead ([`super::simd::fp8_dot`]: no row buffer; each tile's sum times its scale,
//! one more rounding per tile; 1.34 -> 0.81 ms a 2880 x 2880 call here). The AVX2 decode reads
//! an e4m3 byte as the fp16 with the same sign, exponent and mantissa bits moved up (`e4m3 =
//! fp16 * 2^8`, subnormals included), converted by F16C; the two NaN codes stay NaN.

use half::f16;

use super::{simd, Isa};
use crate::error::{CoreError, Result};

/// The e4m3 (fn: no infinities) byte `b` as fp32, exactly; `0x7F` and `0xFF` are NaN.
#[inline(always)]
pub fn e4m3(b: u8) -> f32 {
    if b & 0x7F == 0x7F {
        return f32::NAN;
    }
    // sign to bit 15, exponent and mantissa under fp16's: the fp16 read is the value / 2^8
    let bits = (((b & 0x7F) as u16) << 7) | (((b & 0x80) as u16) << 8);
    f16::from_bits(bits).to_f32() * 256.0
}

/// The scale grid of a `rows x cols` matrix in `br x bc` tiles: `(ceil(rows / br), ceil(cols /
/// bc))`.
pub fn grid(rows: usize, cols: usize, block: (usize, usize)) -> (usize, usize) {
    (rows.div_ceil(block.0), cols.div_ceil(block.1))
}

/// Bytes of a `rows x cols` FP8_BLOCK buffer: the weights, then the fp32 scales.
pub fn tensor_bytes(rows: usize, cols: usize, block: (usize, usize)) -> usize {
    let (gr, gc) = grid(rows, cols, block);
    rows * cols + 4 * gr * gc
}

/// Checks the buffer against `rows x cols` in `block` tiles; returns the scales as fp32.
fn check(weight: &[u8], rows: usize, cols: usize, block: (usize, usize)) -> Result<Vec<f32>> {
    if rows == 0 || cols == 0 || block.0 == 0 || block.1 == 0 {
        return Err(CoreError::Config(format!(
            "FP8_BLOCK: rows {rows}, cols {cols} and block {block:?} must be positive"
        )));
    }
    let want = rows
        .checked_mul(cols)
        .and_then(|w| w.checked_add(4 * grid(rows, cols, block).0 * grid(rows, cols, block).1))
        .ok_or_else(|| CoreError::Config(format!("FP8_BLOCK: {rows} x {cols} overflows")))?;
    if weight.len() != want {
        let (gr, gc) = grid(rows, cols, block);
        return Err(CoreError::Config(format!(
            "FP8_BLOCK weight of {rows} x {cols} in {}x{} tiles: expected {want} bytes ({rows} x \
             {cols} e4m3, then {gr} x {gc} fp32 scales), got {}",
            block.0,
            block.1,
            weight.len()
        )));
    }
    Ok(weight[rows * cols..]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// `buf[c] = e4m3(w[c]) * scales[c / bc]` for one weight row (the portable decode).
pub fn decode_row_portable(w: &[u8], scales: &[f32], bc: usize, buf: &mut [f32]) {
    for ((wt, bt), &s) in w.chunks(bc).zip(buf.chunks_mut(bc)).zip(scales) {
        for (o, &b) in bt.iter_mut().zip(wt) {
            *o = e4m3(b) * s;
        }
    }
}

/// One decoded row against the `n` activation rows of `x`: `o[i] = dot(row, x[i])`.
fn dot_rows(row: &[f32], x: &[f32], n: usize, o: &mut [f32]) {
    let cols = row.len();
    for (i, oi) in o.iter_mut().enumerate().take(n) {
        *oi = simd::dot_f32(row, &x[i * cols..][..cols]);
    }
}

/// `out[i * rows + r] = sum_c x[i * cols + c] * W[r, c]` for `n = x.len() / cols` rows of `x`,
/// `weight` the FP8_BLOCK buffer of a `rows x cols` matrix with `block = (br, bc)` tiles.
/// `threads` = 0 uses [`super::threads::default_threads`]. Sizes are checked first: a mismatch is a
/// `Config` error and nothing is written.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    weight: &[u8],
    x: &[f32],
    out: &mut [f32],
    rows: usize,
    cols: usize,
    block: (usize, usize),
    threads: usize,
    isa: Isa,
) -> Result<()> {
    let scales = check(weight, rows, cols, block)?;
    let n = super::check_x_out(x, out, rows, cols)?;
    let (br, bc) = block;
    let gc = grid(rows, cols, block).1;
    let w = &weight[..rows * cols];
    let run = |chunk: &[u8], o: &mut [f32]| {
        // the chunk's first row: its offset in the weights (the split is by whole rows)
        let r0 = (chunk.as_ptr() as usize - w.as_ptr() as usize) / cols;
        let mut buf = vec![0f32; cols];
        for (k, (wr, or)) in chunk
            .chunks_exact(cols)
            .zip(o.chunks_exact_mut(n))
            .enumerate()
        {
            let srow = &scales[(r0 + k) / br * gc..][..gc];
            match isa {
                Isa::Portable => {
                    decode_row_portable(wr, srow, bc, &mut buf);
                    dot_rows(&buf, x, n, or);
                }
                // one activation row: decode and multiply in registers, no row buffer
                Isa::Avx2 | Isa::Avx512 if n == 1 => {
                    or[0] = simd::fp8_dot(wr, srow, bc, x, &mut buf);
                }
                Isa::Avx2 | Isa::Avx512 => {
                    simd::fp8_decode(wr, srow, bc, &mut buf);
                    dot_rows(&buf, x, n, or);
                }
            }
        }
    };
    super::by_rows(w, cols, rows, n, threads, out, run);
    Ok(())
}

/// The reference dequantization: `out[r * cols + c] = e4m3(W[r, c]) * scale of its tile`.
pub fn dequantize(
    weight: &[u8],
    out: &mut [f32],
    rows: usize,
    cols: usize,
    block: (usize, usize),
) -> Result<()> {
    let scales = check(weight, rows, cols, block)?;
    if out.len() != rows * cols {
        return Err(CoreError::Config(format!(
            "out has {} floats: expected {rows} x {cols}",
            out.len()
        )));
    }
    let gc = grid(rows, cols, block).1;
    for (r, (wr, or)) in weight[..rows * cols]
        .chunks_exact(cols)
        .zip(out.chunks_exact_mut(cols))
        .enumerate()
    {
        decode_row_portable(wr, &scales[r / block.0 * gc..][..gc], block.1, or);
    }
    Ok(())
}
