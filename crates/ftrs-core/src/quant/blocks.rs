//! Block layouts of the GGUF weight types and their scalar decoders.
//!
//! Each type stores a row of weights as `cols / block_elems` blocks of `block_bytes` bytes,
//! exactly as ggml writes them (little-endian fp16 scales; `gguf.quants` in Python is the
//! reference these decoders are tested against). A decoder turns one block into its
//! `block_elems` fp32 weights, computing each weight the way the reference does (scale products
//! in fp32, then `d * q - m`), so a decoded block equals the reference bit for bit.
//!
//! The decoders are the portable path: [`super::dequantize`] and the generic kernel use them;
//! the SIMD kernels decode the hot types in registers instead and are tested against them.

use half::{bf16, f16};

use crate::error::{CoreError, Result};

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

/// A GGUF weight type the kernels can read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QType {
    /// Plain fp32.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// 32 weights: fp16 d, 32 x i8; w = d * q.
    Q8_0,
    /// 32 weights: fp16 d, 16 B of nibbles; w = d * (q - 8).
    Q4_0,
    /// 32 weights: fp16 d, fp16 m, 16 B of nibbles; w = d * q + m.
    Q4_1,
    /// 32 weights: fp16 d, u32 high bits, 16 B of nibbles; w = d * (q - 16).
    Q5_0,
    /// 32 weights: fp16 d, fp16 m, u32 high bits, 16 B of nibbles; w = d * q + m.
    Q5_1,
    /// 256 weights: 16 B 4+4-bit scales/mins, 64 B of 2-bit quants, fp16 d, fp16 dmin.
    Q2K,
    /// 256 weights: 32 B high-bit mask, 64 B of 2-bit quants, 12 B 6-bit scales, fp16 d.
    Q3K,
    /// 256 weights: fp16 d, fp16 dmin, 12 B 6-bit scales/mins, 128 B of nibbles.
    Q4K,
    /// 256 weights: as Q4_K plus 32 B of fifth bits before the nibbles.
    Q5K,
    /// 256 weights: 128 B low nibbles, 64 B high 2 bits, 16 x i8 scales, fp16 d.
    Q6K,
    /// 32 weights (OCP MXFP4, ggml's `block_mxfp4`): e8m0 exponent e, 16 B of e2m1 nibbles
    /// (low: elements 0..16, high: 16..32); w = e2m1(q) * 2^(e - 127).
    Mxfp4,
    /// 32 weights: fp16 d, 16 B of nibbles (low: 0..16, high: 16..32) indexing the non-linear
    /// table [`IQ4_VALUES`]; w = d * IQ4_VALUES[q].
    Iq4Nl,
    /// 256 weights: fp16 d, u16 high scale bits, 4 B of low scale nibbles, 128 B of nibbles;
    /// eight 32-weight sub-blocks with 6-bit scales `ls`: w = (d * (ls - 32)) * IQ4_VALUES[q].
    Iq4Xs,
    /// 64 weights (NVFP4, ggml's `block_nvfp4`): four ue4m3 scales `s`, one per 16 weights,
    /// then 8 B of e2m1 nibbles per 16 (low: its elements 0..8, high: 8..16);
    /// w = e2m1(q) * ue4m3(s). A tensor of this type carries one fp32 scale after its rows
    /// ([`QType::tail_bytes`]: NVFP4's per-tensor `weight_scale_2`) that multiplies every weight.
    Nvfp4,
    /// 256 weights: fp16 d, 8 x (4 grid bytes, u32 of sign indices and a scale); [`super::iq`].
    Iq2Xxs,
    /// 256 weights: fp16 d, 32 u16 of grid and sign indices, 16 4-bit scales.
    Iq2Xs,
    /// 256 weights: fp16 d, grid bytes, sign bits, high index bits, 16 4-bit scales.
    Iq2S,
    /// 256 weights: fp16 d, 64 grid bytes (4 weights each), 8 u32 of signs and a scale.
    Iq3Xxs,
    /// 256 weights: fp16 d, grid bytes, ninth index bits, sign bits, 8 4-bit scales.
    Iq3S,
    /// 256 weights: fp16 d, grid bytes, 8 u16 of high index bits, a scale and delta's sign.
    Iq1S,
    /// 256 weights: grid bytes, nibbles of high index bits and delta's sign, 4 u16 of scales
    /// holding the fp16 d in their top nibbles.
    Iq1M,
}

/// IQ4_NL's and IQ4_XS's 16 levels (ggml's `kvalues_iq4nl`).
pub const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

impl QType {
    /// Every supported type, in the order of [`QType::name`]'s table.
    pub const ALL: [QType; 24] = [
        QType::F32,
        QType::F16,
        QType::BF16,
        QType::Q8_0,
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q2K,
        QType::Q3K,
        QType::Q4K,
        QType::Q5K,
        QType::Q6K,
        QType::Mxfp4,
        QType::Iq4Nl,
        QType::Iq4Xs,
        QType::Nvfp4,
        QType::Iq2Xxs,
        QType::Iq2Xs,
        QType::Iq2S,
        QType::Iq3Xxs,
        QType::Iq3S,
        QType::Iq1S,
        QType::Iq1M,
    ];

    /// The GGUF name (`"Q4_K"`, `"F16"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            QType::F32 => "F32",
            QType::F16 => "F16",
            QType::BF16 => "BF16",
            QType::Q8_0 => "Q8_0",
            QType::Q4_0 => "Q4_0",
            QType::Q4_1 => "Q4_1",
            QType::Q5_0 => "Q5_0",
            QType::Q5_1 => "Q5_1",
            QType::Q2K => "Q2_K",
            QType::Q3K => "Q3_K",
            QType::Q4K => "Q4_K",
            QType::Q5K => "Q5_K",
            QType::Q6K => "Q6_K",
            QType::Mxfp4 => "MXFP4",
            QType::Iq4Nl => "IQ4_NL",
            QType::Iq4Xs => "IQ4_XS",
            QType::Nvfp4 => "NVFP4",
            QType::Iq2Xxs => "IQ2_XXS",
            QType::Iq2Xs => "IQ2_XS",
            QType::Iq2S => "IQ2_S",
            QType::Iq3Xxs => "IQ3_XXS",
            QType::Iq3S => "IQ3_S",
            QType::Iq1S => "IQ1_S",
            QType::Iq1M => "IQ1_M",
        }
    }

    /// Parses a GGUF type name (case-insensitive); an unsupported one, or an i-quant whose
    /// grid is not installed ([`super::iq::set_grid`]), is a `Config` error naming it.
    pub fn parse(name: &str) -> Result<Self> {
        let t = Self::lookup(name)?;
        if !super::iq::ready(t) {
            return Err(CoreError::Config(format!(
                "{} needs its grid installed first (quant_set_grid)",
                t.name()
            )));
        }
        Ok(t)
    }

    /// The type named `name` (case-insensitive), whether or not it can be decoded yet.
    pub fn lookup(name: &str) -> Result<Self> {
        let upper = name.to_ascii_uppercase();
        QType::ALL
            .into_iter()
            .find(|t| t.name() == upper)
            .ok_or_else(|| {
                let known: Vec<&str> = QType::ALL.iter().map(|t| t.name()).collect();
                CoreError::Config(format!(
                    "unsupported weight type {name:?}: the quantized kernels read {}",
                    known.join(", ")
                ))
            })
    }

    /// `(elements per block, bytes per block)`, as `GGML_QUANT_SIZES` gives them.
    pub fn block_info(self) -> (usize, usize) {
        match self {
            QType::F32 => (1, 4),
            QType::F16 | QType::BF16 => (1, 2),
            QType::Q8_0 => (32, 34),
            QType::Q4_0 => (32, 18),
            QType::Q4_1 => (32, 20),
            QType::Q5_0 => (32, 22),
            QType::Q5_1 => (32, 24),
            QType::Q2K => (QK_K, 84),
            QType::Q3K => (QK_K, 110),
            QType::Q4K => (QK_K, 144),
            QType::Q5K => (QK_K, 176),
            QType::Q6K => (QK_K, 210),
            QType::Mxfp4 => (32, 17),
            QType::Iq4Nl => (32, 18),
            QType::Iq4Xs => (QK_K, 136),
            QType::Nvfp4 => (64, 36),
            QType::Iq2Xxs => (QK_K, 66),
            QType::Iq2Xs => (QK_K, 74),
            QType::Iq2S => (QK_K, 82),
            QType::Iq3Xxs => (QK_K, 98),
            QType::Iq3S => (QK_K, 110),
            QType::Iq1S => (QK_K, 50),
            QType::Iq1M => (QK_K, 56),
        }
    }

    /// Bytes a tensor of this type carries after its rows: NVFP4's fp32 tensor scale (4,
    /// little-endian), none for the others.
    pub fn tail_bytes(self) -> usize {
        match self {
            QType::Nvfp4 => 4,
            _ => 0,
        }
    }
}

/// Reads the little-endian fp16 at `b[i..i + 2]` as fp32.
#[inline(always)]
pub fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// The e2m1 values doubled, by nibble (sign in bit 3), as ggml keeps them: the block scale is
/// halved to match ([`e8m0_half`]), so every product stays exact.
pub const E2M1_X2: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// The e8m0 exponent byte `e` as `2^(e - 128)` in fp32, built from its bits as ggml's
/// `ggml_e8m0_to_fp32_half` does (exact; `e < 2` gives the subnormals `2^-128`, `2^-127`).
#[inline(always)]
pub fn e8m0_half(e: u8) -> f32 {
    let e = e as u32;
    f32::from_bits(if e < 2 {
        0x0020_0000 << e
    } else {
        (e - 1) << 23
    })
}

/// The unsigned e4m3 scale byte `s` (bias 7, no sign; NVFP4's block scale) halved, as
/// `gguf.quants.NVFP4.ue4m3_to_fp32` reads it: `(1 + m / 8) * 2^(e - 8)`, `m * 2^-10` for e = 0;
/// 0x7F (e4m3's NaN) reads as 0, and bit 7 is ignored. Exact: built from its bits.
#[inline(always)]
pub fn ue4m3_half(s: u8) -> f32 {
    UE4M3_HALF[s as usize]
}

/// [`ue4m3_half`] of every byte, made at compile time (the kernels look a scale up per 16
/// weights).
static UE4M3_HALF: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut s = 0;
    while s < 256 {
        let (e, m) = (((s >> 3) & 0x0F) as u32, (s & 7) as u32);
        t[s] = if s == 0x7F {
            0.0
        } else if e == 0 {
            m as f32 * (1.0 / 1024.0)
        } else {
            f32::from_bits(((e + 119) << 23) | (m << 20))
        };
        s += 1;
    }
    t
};

/// The 6-bit (scale, min) pair `j` (0..8) of a Q4_K/Q5_K block's 12 packed bytes.
///
/// Bytes 0..4 hold scales 0..4 (low 6 bits) and the top 2 bits of scales 4..8; bytes 4..8 the
/// same for the mins; bytes 8..12 the low 4 bits of scales 4..8 (low nibble) and mins 4..8
/// (high nibble).
#[inline(always)]
pub fn scale_min_k4(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// The 16 signed 6-bit scales of a Q3_K block (12 packed bytes), each minus 32.
///
/// Scale `j` has its low 4 bits in byte `j % 8` (low nibble for j < 8, high for j >= 8) and its
/// top 2 bits in byte `8 + j % 4` at bit `2 * (j / 4)`.
#[inline(always)]
pub fn scales_q3k(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 8 { s[j] & 0x0F } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = ((low | (high << 4)) as i8) - 32;
    }
    out
}

/// Decodes one block `b` (exactly `block_bytes` long) of type `t` into `out`
/// (exactly `block_elems` long).
pub fn decode_block(t: QType, b: &[u8], out: &mut [f32]) {
    debug_assert_eq!(b.len(), t.block_info().1);
    debug_assert_eq!(out.len(), t.block_info().0);
    match t {
        QType::F32 => out[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        QType::F16 => out[0] = f16_at(b, 0),
        QType::BF16 => out[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        QType::Q8_0 => {
            let d = f16_at(b, 0);
            for (o, &q) in out.iter_mut().zip(&b[2..34]) {
                *o = (q as i8) as f32 * d;
            }
        }
        QType::Q4_0 => {
            let d = f16_at(b, 0);
            for (l, &q) in b[2..18].iter().enumerate() {
                out[l] = d * ((q & 0x0F) as i32 - 8) as f32;
                out[l + 16] = d * ((q >> 4) as i32 - 8) as f32;
            }
        }
        QType::Q4_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            for (l, &q) in b[4..20].iter().enumerate() {
                out[l] = d * (q & 0x0F) as f32 + m;
                out[l + 16] = d * (q >> 4) as f32 + m;
            }
        }
        QType::Q5_0 => {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for (l, &q) in b[6..22].iter().enumerate() {
                let lo = (q & 0x0F) | ((((qh >> l) & 1) as u8) << 4);
                let hi = (q >> 4) | ((((qh >> (l + 16)) & 1) as u8) << 4);
                out[l] = d * (lo as i32 - 16) as f32;
                out[l + 16] = d * (hi as i32 - 16) as f32;
            }
        }
        QType::Q5_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            for (l, &q) in b[8..24].iter().enumerate() {
                let lo = (q & 0x0F) | ((((qh >> l) & 1) as u8) << 4);
                let hi = (q >> 4) | ((((qh >> (l + 16)) & 1) as u8) << 4);
                out[l] = d * lo as f32 + m;
                out[l + 16] = d * hi as f32 + m;
            }
        }
        QType::Q2K => decode_q2k(b, out),
        QType::Q3K => decode_q3k(b, out),
        QType::Q4K => decode_q4k(b, out),
        QType::Q5K => decode_q5k(b, out),
        QType::Q6K => decode_q6k(b, out),
        QType::Mxfp4 => {
            let d = e8m0_half(b[0]);
            for (l, &q) in b[1..17].iter().enumerate() {
                out[l] = d * E2M1_X2[(q & 0x0F) as usize] as f32;
                out[l + 16] = d * E2M1_X2[(q >> 4) as usize] as f32;
            }
        }
        QType::Iq4Nl => {
            let d = f16_at(b, 0);
            for (l, &q) in b[2..18].iter().enumerate() {
                out[l] = d * IQ4_VALUES[(q & 0x0F) as usize] as f32;
                out[l + 16] = d * IQ4_VALUES[(q >> 4) as usize] as f32;
            }
        }
        QType::Iq4Xs => decode_iq4xs(b, out),
        QType::Iq2Xxs
        | QType::Iq2Xs
        | QType::Iq2S
        | QType::Iq3Xxs
        | QType::Iq3S
        | QType::Iq1S
        | QType::Iq1M => super::iq::decode(t, b, out),
        QType::Nvfp4 => {
            for j in 0..4 {
                let d = ue4m3_half(b[j]);
                for (l, &q) in b[4 + 8 * j..12 + 8 * j].iter().enumerate() {
                    out[16 * j + l] = d * E2M1_X2[(q & 0x0F) as usize] as f32;
                    out[16 * j + 8 + l] = d * E2M1_X2[(q >> 4) as usize] as f32;
                }
            }
        }
    }
}

/// IQ4_XS: sub-block `s` (32 weights) has the 6-bit scale `ls` whose low 4 bits are nibble
/// `s % 2` of `scales_l[s / 2]` (byte 4 + s / 2) and whose top 2 bits are bits `2s..2s+2` of
/// the u16 `scales_h` (bytes 2..4); its 16 bytes of nibbles hold elements 0..16 (low) and
/// 16..32 (high).
fn decode_iq4xs(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    for s in 0..8 {
        let low = (b[4 + s / 2] >> (4 * (s % 2))) & 0x0F;
        let high = ((scales_h >> (2 * s)) & 3) as u8;
        let dl = d * (((low | (high << 4)) as i32) - 32) as f32;
        let qs = &b[8 + 16 * s..24 + 16 * s];
        for (l, &q) in qs.iter().enumerate() {
            out[32 * s + l] = dl * IQ4_VALUES[(q & 0x0F) as usize] as f32;
            out[32 * s + l + 16] = dl * IQ4_VALUES[(q >> 4) as usize] as f32;
        }
    }
}

/// Q2_K: element `128 h + 32 s + l` is bits `2s..2s+2` of `qs[32 h + l]`, in sub-block
/// `(128 h + 32 s + l) / 16` with scale `d * (sc & 15)` and min `dmin * (sc >> 4)`.
fn decode_q2k(b: &[u8], out: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for h in 0..2 {
        for s in 0..4 {
            for half in 0..2 {
                let sub = 8 * h + 2 * s + half;
                let dl = d * (scales[sub] & 0x0F) as f32;
                let ml = dmin * (scales[sub] >> 4) as f32;
                for l in 16 * half..16 * half + 16 {
                    let q = (qs[32 * h + l] >> (2 * s)) & 3;
                    out[128 * h + 32 * s + l] = dl * q as f32 - ml;
                }
            }
        }
    }
}

/// Q3_K: element `128 h + 32 s + l` has low bits `2s..2s+2` of `qs[32 h + l]` and, unless bit
/// `4 h + s` of `hmask[l]` is set, 4 subtracted; times `d * scale[(128 h + 32 s + l) / 16]`.
fn decode_q3k(b: &[u8], out: &mut [f32]) {
    let (hmask, qs) = (&b[0..32], &b[32..96]);
    let sc = scales_q3k(&b[96..108]);
    let d = f16_at(b, 108);
    for h in 0..2 {
        for s in 0..4 {
            for half in 0..2 {
                let sub = 8 * h + 2 * s + half;
                let dl = d * sc[sub] as f32;
                for l in 16 * half..16 * half + 16 {
                    let low = ((qs[32 * h + l] >> (2 * s)) & 3) as i32;
                    let high = ((hmask[l] >> (4 * h + s)) & 1) as i32;
                    out[128 * h + 32 * s + l] = dl * (low - 4 * (1 - high)) as f32;
                }
            }
        }
    }
}

/// Q4_K: sub-block `2c` holds the low nibbles of `qs[32c..32c+32]`, sub-block `2c+1` the high
/// ones; element = `d * sc * q - dmin * m` with the sub-block's (sc, m).
fn decode_q4k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for c in 0..4 {
        let (s0, m0) = scale_min_k4(scales, 2 * c);
        let (s1, m1) = scale_min_k4(scales, 2 * c + 1);
        let (d0, dm0) = (d * s0 as f32, dmin * m0 as f32);
        let (d1, dm1) = (d * s1 as f32, dmin * m1 as f32);
        for l in 0..32 {
            let q = qs[32 * c + l];
            out[64 * c + l] = d0 * (q & 0x0F) as f32 - dm0;
            out[64 * c + 32 + l] = d1 * (q >> 4) as f32 - dm1;
        }
    }
}

/// Q5_K: as Q4_K, with bit `j` of `qh[l]` the fifth bit of element `l` of sub-block `j`.
fn decode_q5k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for c in 0..4 {
        let (s0, m0) = scale_min_k4(scales, 2 * c);
        let (s1, m1) = scale_min_k4(scales, 2 * c + 1);
        let (d0, dm0) = (d * s0 as f32, dmin * m0 as f32);
        let (d1, dm1) = (d * s1 as f32, dmin * m1 as f32);
        for l in 0..32 {
            let q = qs[32 * c + l];
            let lo = (q & 0x0F) | (((qh[l] >> (2 * c)) & 1) << 4);
            let hi = (q >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
            out[64 * c + l] = d0 * lo as f32 - dm0;
            out[64 * c + 32 + l] = d1 * hi as f32 - dm1;
        }
    }
}

/// Q6_K: element `128 h + 32 s + l` has low nibble `(ql[64 h + 32 (s & 1) + l] >> 4 (s >> 1))`
/// and high bits `2s..2s+2` of `qh[32 h + l]`; minus 32, times `d * scale[element / 16]`.
fn decode_q6k(b: &[u8], out: &mut [f32]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for h in 0..2 {
        for s in 0..4 {
            for half in 0..2 {
                let sub = 8 * h + 2 * s + half;
                let dl = d * (scales[sub] as i8) as f32;
                for l in 16 * half..16 * half + 16 {
                    let low = (ql[64 * h + 32 * (s & 1) + l] >> (4 * (s >> 1))) & 0x0F;
                    let high = (qh[32 * h + l] >> (2 * s)) & 3;
                    let q = (low | (high << 4)) as i32 - 32;
                    out[128 * h + 32 * s + l] = dl * q as f32;
                }
            }
        }
    }
}
