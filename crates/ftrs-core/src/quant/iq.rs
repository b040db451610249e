//! The i-quants of three bits and less (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S):
//! their grids and scalar decoders.
//!
//! Each 256-weight super-block holds indices into a grid of 8-weight (IQ1, IQ2) or 4-weight
//! (IQ3) vectors, signs, and small scales under one fp16 scale. The grids are tables of the
//! format that no rule computes; this crate does not carry them. The host process installs
//! each one once ([`set_grid`]; `ftrs.quant` reads them from the `gguf` package), and a type
//! whose grid is not installed is refused by [`super::QType::parse`], so no decoder runs
//! without its table. The sign table is computable: entry `i` of the 128 is `i`'s seven bits
//! and an eighth that makes the count of ones even.
//!
//! Every weight is computed with ggml's reference operations in its order (scale products in
//! fp32, then times the grid value, then the sign), so a decoded block equals ggml's
//! `dequantize_row_*` bit for bit (tested from Python against it and the `gguf` package).

use std::sync::OnceLock;

use super::blocks::{f16_at, QType};
use crate::error::{CoreError, Result};

const IQ1_DELTA: f32 = 0.125;

/// The installed grids, by type (entries x width values, row-major).
static GRIDS: [OnceLock<Box<[f32]>>; 7] = [const { OnceLock::new() }; 7];

/// The 8-wide grids as rows of 8 signed bytes (IQ1's values times 8, so that the delta
/// `±0.125` is `±1` in the same unit), zero-padded to 2048 rows, for the integer kernels:
/// an index masked to 11 bits needs no bounds check.
static ROWS8: [OnceLock<Box<[u64; 2048]>>; 7] = [const { OnceLock::new() }; 7];
/// The 4-wide grids (IQ3) as rows of 4 bytes, zero-padded to 512 rows.
static ROWS4: [OnceLock<Box<[u32; 512]>>; 7] = [const { OnceLock::new() }; 7];

/// `(slot, entries, width)` of an i-quant type's grid; None for every other type.
fn grid_shape(t: QType) -> Option<(usize, usize, usize)> {
    Some(match t {
        QType::Iq2Xxs => (0, 256, 8),
        QType::Iq2Xs => (1, 512, 8),
        QType::Iq2S => (2, 1024, 8),
        QType::Iq3Xxs => (3, 256, 4),
        QType::Iq3S => (4, 512, 4),
        QType::Iq1S => (5, 2048, 8),
        QType::Iq1M => (6, 2048, 8),
        _ => return None,
    })
}

/// Installs the grid of `t` (entries x width values, row-major). A second call with the same
/// values is a no-op; different values, a wrong length or a type without a grid are errors.
pub fn set_grid(t: QType, values: &[f32]) -> Result<()> {
    let (slot, entries, width) =
        grid_shape(t).ok_or_else(|| CoreError::Config(format!("{} has no grid", t.name())))?;
    if values.len() != entries * width {
        return Err(CoreError::Config(format!(
            "{} grid: {} values, expected {entries} x {width}",
            t.name(),
            values.len()
        )));
    }
    let unit = if matches!(t, QType::Iq1S | QType::Iq1M) {
        8.0
    } else {
        1.0
    };
    if let Some(v) = values
        .iter()
        .find(|v| v.fract() != 0.0 || !(-128.0..=127.0).contains(&(*v * unit)))
    {
        return Err(CoreError::Config(format!(
            "{} grid: value {v} is not an integer of the format's range",
            t.name()
        )));
    }
    let held = GRIDS[slot].get_or_init(|| values.into());
    if **held != *values {
        return Err(CoreError::Config(format!(
            "{} grid already installed with other values",
            t.name()
        )));
    }
    let byte = |v: &f32| (*v * unit) as i8 as u8;
    if width == 8 {
        ROWS8[slot].get_or_init(|| {
            let mut rows = Box::new([0u64; 2048]);
            for (r, v) in rows.iter_mut().zip(held.chunks_exact(8)) {
                *r = u64::from_le_bytes(std::array::from_fn(|j| byte(&v[j])));
            }
            rows
        });
    } else {
        ROWS4[slot].get_or_init(|| {
            let mut rows = Box::new([0u32; 512]);
            for (r, v) in rows.iter_mut().zip(held.chunks_exact(4)) {
                *r = u32::from_le_bytes(std::array::from_fn(|j| byte(&v[j])));
            }
            rows
        });
    }
    Ok(())
}

/// The 8-wide grid in `slot` (0 IQ2_XXS, 1 IQ2_XS, 2 IQ2_S, 5 IQ1_S, 6 IQ1_M: [`grid_shape`]'s
/// order, the integer kernels' `KIND`) as byte rows (see [`ROWS8`]).
pub(crate) fn rows8(slot: usize) -> &'static [u64; 2048] {
    ROWS8[slot]
        .get()
        .expect("QType::parse refuses an i-quant whose grid is not installed")
}

/// The 4-wide grid in `slot` (3 IQ3_XXS, 4 IQ3_S) as byte rows (see [`ROWS4`]).
pub(crate) fn rows4(slot: usize) -> &'static [u32; 512] {
    ROWS4[slot]
        .get()
        .expect("QType::parse refuses an i-quant whose grid is not installed")
}

/// Byte `k` of entry `i` is 0xFF (-1) where bit `k` of sign index `i`'s byte (its seven bits
/// and the parity bit) is set, 1 elsewhere: the second operand of a byte `vpsignb`.
pub(crate) static SIGNS7_BYTES: [u64; 128] = {
    let mut t = [0u64; 128];
    let mut i = 0u32;
    while i < 128 {
        let byte = i | ((i.count_ones() & 1) << 7);
        let mut k = 0;
        while k < 8 {
            let b: u64 = if byte >> k & 1 == 1 { 0xFF } else { 1 };
            t[i as usize] |= b << (8 * k);
            k += 1;
        }
        i += 1;
    }
    t
};

/// Whether `t` is one of the i-quants with a grid.
pub fn grid_type(t: QType) -> bool {
    grid_shape(t).is_some()
}

/// Whether `t` can be decoded: not an i-quant with a grid, or one whose grid is installed.
pub fn ready(t: QType) -> bool {
    grid_shape(t).is_none_or(|(slot, _, _)| GRIDS[slot].get().is_some())
}

#[inline(always)]
fn grid(t: QType) -> &'static [f32] {
    let (slot, _, _) = grid_shape(t).expect("an i-quant type");
    GRIDS[slot]
        .get()
        .expect("QType::parse refuses an i-quant whose grid is not installed")
}

/// The signs (±1) of the 8 weights each 7-bit sign index stands for (its bits and a parity
/// bit: `SIGNS_OF_BYTE` of the byte they make).
static SIGNS7: [[f32; 8]; 128] = sign_table(true);
/// The signs (±1) of 8 weights whose sign bits are a byte (bit k: weight k negative).
static SIGNS_OF_BYTE: [[f32; 8]; 256] = sign_table(false);

const fn sign_table<const N: usize>(parity: bool) -> [[f32; 8]; N] {
    let mut t = [[1.0f32; 8]; N];
    let mut i = 0u32;
    while (i as usize) < N {
        let byte = if parity {
            i | ((i.count_ones() & 1) << 7)
        } else {
            i
        };
        let mut k = 0;
        while k < 8 {
            if byte >> k & 1 == 1 {
                t[i as usize][k] = -1.0;
            }
            k += 1;
        }
        i += 1;
    }
    t
}

fn signs7(i: u32) -> &'static [f32; 8] {
    &SIGNS7[(i & 0x7F) as usize]
}

fn u16_at(b: &[u8], i: usize) -> u32 {
    u16::from_le_bytes([b[i], b[i + 1]]) as u32
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// Decodes one block of an i-quant type `t` into its 256 weights (inlined into the generic
/// kernel, so it is compiled for the kernel's target features).
#[inline(always)]
pub fn decode(t: QType, b: &[u8], out: &mut [f32]) {
    let g = grid(t);
    match t {
        QType::Iq2Xxs => iq2_xxs(g, b, out),
        QType::Iq2Xs => iq2_xs(g, b, out),
        QType::Iq2S => iq2_s(g, b, out),
        QType::Iq3Xxs => iq3_xxs(g, b, out),
        QType::Iq3S => iq3_s(g, b, out),
        QType::Iq1S => iq1_s(g, b, out),
        QType::Iq1M => iq1_m(g, b, out),
        _ => unreachable!("not an i-quant: {}", t.name()),
    }
}

/// Row `idx` of an 8-wide grid.
#[inline(always)]
fn row8(g: &[f32], idx: usize) -> &[f32; 8] {
    g[8 * idx..8 * idx + 8].try_into().expect("8 values")
}

/// Row `idx` of a 4-wide grid.
#[inline(always)]
fn row4(g: &[f32], idx: usize) -> &[f32; 4] {
    g[4 * idx..4 * idx + 4].try_into().expect("4 values")
}

/// `o = db * row * signs`, weight by weight.
#[inline(always)]
fn put<const N: usize>(o: &mut [f32], db: f32, row: &[f32; N], signs: &[f32]) {
    let o: &mut [f32; N] = o.try_into().expect("N outputs");
    let signs: &[f32; N] = signs.try_into().expect("N signs");
    for j in 0..N {
        o[j] = db * row[j] * signs[j];
    }
}

/// `o = dl * (row + delta)`, weight by weight.
#[inline(always)]
fn put_delta(o: &mut [f32], dl: f32, row: &[f32; 8], delta: f32) {
    let o: &mut [f32; 8] = o.try_into().expect("8 outputs");
    for j in 0..8 {
        o[j] = dl * (row[j] + delta);
    }
}

/// fp16 d; 8 groups of 32 weights: 4 grid bytes, then a u32 of four 7-bit sign indices and a
/// 4-bit scale `s` (bits 28..32); w = d * (0.5 + s) * 0.25 * grid * sign.
#[inline(always)]
fn iq2_xxs(g: &[f32], b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (ib, o32) in out.chunks_exact_mut(32).enumerate() {
        let q = &b[2 + 8 * ib..10 + 8 * ib];
        let aux = u32_at(q, 4);
        let db = d * (0.5 + (aux >> 28) as f32) * 0.25;
        for (l, o) in o32.chunks_exact_mut(8).enumerate() {
            put(o, db, row8(g, q[l] as usize), signs7(aux >> (7 * l)));
        }
    }
}

/// fp16 d; 32 u16 (9-bit grid index, 7-bit sign index); 16 4-bit scales, one a 16 weights.
#[inline(always)]
fn iq2_xs(g: &[f32], b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (k, o) in out.chunks_exact_mut(8).enumerate() {
        let q = u16_at(b, 2 + 2 * k);
        let s = (b[66 + k / 4] >> (4 * (k / 2 % 2))) & 0x0F;
        let db = d * (0.5 + s as f32) * 0.25;
        put(o, db, row8(g, (q & 511) as usize), signs7(q >> 9));
    }
}

/// fp16 d; 32 grid bytes; 32 sign bytes (a bit a weight); 8 bytes of the indices' 2 high
/// bits; 16 4-bit scales.
#[inline(always)]
fn iq2_s(g: &[f32], b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (k, o) in out.chunks_exact_mut(8).enumerate() {
        let idx = b[2 + k] as usize | ((b[66 + k / 4] as usize >> (2 * (k % 4))) & 3) << 8;
        let s = (b[74 + k / 4] >> (4 * (k / 2 % 2))) & 0x0F;
        let db = d * (0.5 + s as f32) * 0.25;
        put(o, db, row8(g, idx), &SIGNS_OF_BYTE[b[34 + k] as usize]);
    }
}

/// fp16 d; 64 grid bytes (4 weights each); 8 u32 of four 7-bit sign indices and a 4-bit scale;
/// w = d * (0.5 + s) * 0.5 * grid * sign.
#[inline(always)]
fn iq3_xxs(g: &[f32], b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (ib, o32) in out.chunks_exact_mut(32).enumerate() {
        let aux = u32_at(b, 66 + 4 * ib);
        let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
        for (l, o8) in o32.chunks_exact_mut(8).enumerate() {
            let signs = signs7(aux >> (7 * l));
            let (lo, hi) = o8.split_at_mut(4);
            let at = 2 + 8 * ib + 2 * l;
            put(lo, db, row4(g, b[at] as usize), &signs[..4]);
            put(hi, db, row4(g, b[at + 1] as usize), &signs[4..]);
        }
    }
}

/// fp16 d; 64 grid bytes; 8 bytes of the indices' ninth bits; 32 sign bytes; 8 4-bit scales,
/// one a 32 weights; w = d * (1 + 2 s) * grid * sign.
#[inline(always)]
fn iq3_s(g: &[f32], b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (k, o) in out.chunks_exact_mut(4).enumerate() {
        let idx = b[2 + k] as usize | ((b[66 + k / 8] as usize >> (k % 8)) & 1) << 8;
        let s = (b[106 + k / 16] >> (4 * (k / 8 % 2))) & 0x0F;
        let db = d * (1 + 2 * s as i32) as f32;
        let signs = &SIGNS_OF_BYTE[b[74 + k / 2] as usize][4 * (k % 2)..][..4];
        put(o, db, row4(g, idx), signs);
    }
}

/// fp16 d; 32 grid bytes; 8 u16: four 3-bit high index parts, a 3-bit scale, delta's sign;
/// w = d * (2 s + 1) * (grid ± 0.125).
#[inline(always)]
fn iq1_s(g: &[f32], b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (ib, o32) in out.chunks_exact_mut(32).enumerate() {
        let qh = u16_at(b, 34 + 2 * ib);
        let dl = d * (2 * ((qh >> 12) & 7) + 1) as f32;
        let delta = if qh & 0x8000 == 0 {
            IQ1_DELTA
        } else {
            -IQ1_DELTA
        };
        for (l, o) in o32.chunks_exact_mut(8).enumerate() {
            let idx = b[2 + 4 * ib + l] as usize | (((qh >> (3 * l)) & 7) as usize) << 8;
            put_delta(o, dl, row8(g, idx), delta);
        }
    }
}

/// 32 grid bytes; 16 bytes of two nibbles (3 high index bits, delta's sign); 4 u16 of four
/// 3-bit scales (one a 16 weights) whose top nibbles together are the fp16 d.
#[inline(always)]
fn iq1_m(g: &[f32], b: &[u8], out: &mut [f32]) {
    let sc: [u32; 4] = std::array::from_fn(|k| u16_at(b, 48 + 2 * k));
    let bits = (sc[0] >> 12) | ((sc[1] >> 8) & 0xF0) | ((sc[2] >> 4) & 0xF00) | (sc[3] & 0xF000);
    let d = half::f16::from_bits(bits as u16).to_f32();
    for (k, o) in out.chunks_exact_mut(8).enumerate() {
        let nib = (b[32 + k / 2] >> (4 * (k % 2))) & 0x0F;
        let idx = b[k] as usize | ((nib & 7) as usize) << 8;
        let sub = k / 2; // the 16-weight scale
        let s = (sc[sub / 4] >> (3 * (sub % 4))) & 7;
        let dl = d * (2 * s + 1) as f32;
        let delta = if nib & 8 == 0 { IQ1_DELTA } else { -IQ1_DELTA };
        put_delta(o, dl, row8(g, idx), delta);
    }
}

#[cfg(test)]
pub(crate) mod test_grids {
    //! Grids for the crate's own tests: values of each format's range in a fixed pseudo-random
    //! order (the real tables come from the host; decoding against them is tested there).
    use super::*;

    /// Installs a test grid for every i-quant type not yet installed.
    pub fn install() {
        let levels: [(QType, &[f32]); 7] = [
            (QType::Iq2Xxs, &[8.0, 25.0, 43.0]),
            (QType::Iq2Xs, &[8.0, 25.0, 43.0]),
            (QType::Iq2S, &[8.0, 25.0, 43.0]),
            (
                QType::Iq3Xxs,
                &[4.0, 12.0, 20.0, 28.0, 36.0, 44.0, 52.0, 62.0],
            ),
            (QType::Iq3S, &[1.0, 3.0, 5.0, 7.0, 9.0, 11.0, 13.0, 15.0]),
            (QType::Iq1S, &[-1.0, 0.0, 1.0]),
            (QType::Iq1M, &[-1.0, 0.0, 1.0]),
        ];
        for (t, lv) in levels {
            let (slot, entries, width) = grid_shape(t).unwrap();
            let mut x = 0x9E37_79B9u32 ^ slot as u32;
            let values: Vec<f32> = (0..entries * width)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    lv[x as usize % lv.len()]
                })
                .collect();
            if GRIDS[slot].get().is_none() {
                let _ = set_grid(t, &values); // a racing test thread installs the same values
            }
        }
    }
}
