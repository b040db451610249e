//! Unit tests of the block decoders and kernels.
//!
//! Decoders: blocks packed by hand from known quants and scales (an encoder written here from
//! the ggml block structs) decode to `d * q - m` computed directly. Kernels: every type, both
//! kernel families, n = 1..=10 activation rows, against a float64 dot of the decoded weights,
//! within the fp32 accumulation bound `cols * eps * sum |x| (|w| + 2 |offset|)`.

use half::{bf16, f16};

use super::blocks::{decode_block, scale_min_k4, scales_q3k, QType};
use super::{dequantize, expert_ffn, experts_ffn, group_routes, matmul, Isa, Route, RoutedExpert};
use crate::error::CoreError;

/// Deterministic xorshift stream.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Offsets of the fp16 scale fields inside one block of `t`.
fn scale_fields(t: QType) -> &'static [usize] {
    match t {
        QType::Q8_0
        | QType::Q4_0
        | QType::Q5_0
        | QType::Iq4Nl
        | QType::Iq4Xs
        | QType::Iq2Xxs
        | QType::Iq2Xs
        | QType::Iq2S
        | QType::Iq3Xxs
        | QType::Iq3S
        | QType::Iq1S => &[0],
        QType::Q4_1 | QType::Q5_1 | QType::Q4K | QType::Q5K => &[0, 2],
        QType::Q2K => &[80, 82],
        QType::Q3K => &[108],
        QType::Q6K => &[208],
        QType::F32 | QType::F16 | QType::BF16 | QType::Mxfp4 | QType::Nvfp4 | QType::Iq1M => &[],
    }
}

/// `rows x cols` random weights of type `t`: random bytes with finite fp16 scales.
fn random_weights(t: QType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    super::iq::test_grids::install();
    let (be, bb) = t.block_info();
    let blocks = rows * cols / be;
    let mut w = Vec::with_capacity(blocks * bb);
    for _ in 0..blocks {
        match t {
            QType::F32 => w.extend_from_slice(&rng.unit().to_le_bytes()),
            QType::F16 => w.extend_from_slice(&f16::from_f32(rng.unit()).to_le_bytes()),
            QType::BF16 => w.extend_from_slice(&bf16::from_f32(rng.unit()).to_le_bytes()),
            _ => {
                let mut b: Vec<u8> = (0..bb).map(|_| rng.next() as u8).collect();
                for &off in scale_fields(t) {
                    let s = f16::from_f32(rng.unit() * 0.1).to_le_bytes();
                    b[off..off + 2].copy_from_slice(&s);
                }
                if t == QType::Iq1M {
                    // its fp16 d is the top nibbles of the four u16 scale words at 48..56
                    let d = f16::from_f32(rng.unit() * 0.1).to_bits();
                    for k in 0..4 {
                        let at = 48 + 2 * k + 1;
                        b[at] = (b[at] & 0x0F) | ((((d >> (4 * k)) & 0xF) as u8) << 4);
                    }
                }
                if t == QType::Mxfp4 {
                    b[0] = 118 + (rng.next() % 12) as u8; // 2^-10 .. 2^1: finite products
                }
                w.extend_from_slice(&b);
            }
        }
    }
    if t.tail_bytes() == 4 {
        // a tensor scale that is not a power of two, so its rounding shows
        w.extend_from_slice(&(0.37 + 0.1 * rng.unit()).to_le_bytes());
    }
    w
}

fn decode_all(t: QType, w: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * cols];
    dequantize(t, w, &mut out, rows, cols, 1).unwrap();
    out
}

/// The weights with their quant bits zeroed, decoded: the per-element offset term.
fn offsets(t: QType, w: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let (_, bb) = t.block_info();
    // (start, end) byte ranges of scales and mins, kept; the quant bits are zeroed.
    let keep: &[(usize, usize)] = match t {
        QType::Q4_1 | QType::Q5_1 => &[(0, 4)],
        QType::Q4K | QType::Q5K => &[(0, 16)],
        QType::Q2K => &[(0, 16), (80, 84)],
        _ => return vec![0.0; rows * cols],
    };
    let mut z = vec![0u8; w.len()];
    for (zb, wb) in z.chunks_exact_mut(bb).zip(w.chunks_exact(bb)) {
        for &(a, b) in keep {
            zb[a..b].copy_from_slice(&wb[a..b]);
        }
    }
    decode_all(t, &z, rows, cols)
}

fn check_kernel(t: QType, isa: Isa, rows: usize, cols: usize, n: usize, seed: u64) {
    let mut rng = Rng(seed);
    let w = random_weights(t, rows, cols, &mut rng);
    let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
    let mut out = vec![f32::NAN; n * rows];
    matmul(t, &w, &x, &mut out, rows, cols, 2, isa).unwrap();
    let wf = decode_all(t, &w, rows, cols);
    let off = offsets(t, &w, rows, cols);
    let eps = f32::EPSILON as f64;
    let x8 = super::rounds_activations(t, isa);
    for i in 0..n {
        for r in 0..rows {
            let (mut exact, mut mag, mut round) = (0f64, 0f64, 0f64);
            for c in 0..cols {
                let (xv, wv) = (x[i * cols + c] as f64, wf[r * cols + c] as f64);
                exact += xv * wv;
                mag += xv.abs() * (wv.abs() + 2.0 * (off[r * cols + c] as f64).abs());
                if x8 {
                    // x as two int8 digits per 32-block: off by at most half a step of the low
                    // digit, amax / (127 * 508), times the weight without its min (the min
                    // meets the exact block sum; Q2_K's, per 16 values, the rounded one: the
                    // whole weight); 1 % for the fp32 rounding of x / d
                    let b = &x[i * cols + c / 32 * 32..][..32];
                    let amax = b.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
                    let min = if t == QType::Q2K {
                        0.0
                    } else {
                        off[r * cols + c] as f64
                    };
                    round += amax / 64516.0 * 1.01 * (wv - min).abs();
                }
            }
            let got = out[i * rows + r] as f64;
            let tol = (cols as f64 + 4.0) * eps * mag + round * (1.0 + 1e-6) + 1e-30;
            assert!(
                (got - exact).abs() <= tol,
                "{} {:?} rows={rows} cols={cols} n={n} [{i},{r}]: {got} vs {exact} (tol {tol})",
                t.name(),
                isa
            );
        }
    }
}

#[test]
fn kernels_match_float64_dot_of_decoded_weights() {
    let isas = Isa::available();
    for t in QType::ALL {
        let (be, _) = t.block_info();
        let cols = if be == 1 {
            77
        } else {
            2 * be.max(32) * if be == 32 { 3 } else { 1 }
        };
        for &isa in &isas {
            for n in 1..=10 {
                check_kernel(t, isa, 7, cols, n, 1 + n as u64);
            }
        }
    }
}

/// Long rows: 37 32-blocks, where the AVX-512 Q5_1 kernel (scales 16 blocks at a time, blocks in
/// pairs) runs two whole groups, then a partial one ending on an odd block; and the demo's
/// 1536-wide down rows (6 super-blocks) for Q4_K and Q6_K.
#[test]
fn kernels_match_on_rows_longer_than_a_scale_group() {
    for (t, cols) in [
        (QType::Q8_0, 37 * 32),
        (QType::Q4_1, 37 * 32),
        (QType::Q5_1, 37 * 32),
        (QType::Mxfp4, 37 * 32),
        (QType::Iq4Nl, 37 * 32),
        (QType::Iq4Xs, 6 * 256),
        (QType::Nvfp4, 21 * 64),
        (QType::Q3K, 6 * 256),
        (QType::Q2K, 6 * 256),
        (QType::Q5K, 6 * 256),
        (QType::Q4K, 6 * 256),
        (QType::Q6K, 6 * 256),
        (QType::Iq1S, 6 * 256),
        (QType::Iq1M, 6 * 256),
        (QType::Iq2Xxs, 6 * 256),
        (QType::Iq2Xs, 6 * 256),
        (QType::Iq2S, 6 * 256),
        (QType::Iq3Xxs, 6 * 256),
        (QType::Iq3S, 6 * 256),
    ] {
        for &isa in &Isa::available() {
            for n in [1, 2, 5, 8, 9] {
                check_kernel(t, isa, 5, cols, n, 40 + n as u64);
            }
        }
    }
}

#[test]
fn large_matrix_splits_across_threads_with_the_same_result() {
    let mut rng = Rng(9);
    let (rows, cols) = (301, 1024);
    let w = random_weights(QType::Q4K, rows, cols, &mut rng);
    let x: Vec<f32> = (0..3 * cols).map(|_| rng.unit()).collect();
    let (mut one, mut many) = (vec![0f32; 3 * rows], vec![0f32; 3 * rows]);
    matmul(QType::Q4K, &w, &x, &mut one, rows, cols, 1, Isa::detect()).unwrap();
    matmul(QType::Q4K, &w, &x, &mut many, rows, cols, 3, Isa::detect()).unwrap();
    assert_eq!(
        one, many,
        "rows are independent: the split must not change any bit"
    );
}

/// Packs 32 nibbles the Q4_0 way: element l in the low nibble of byte l, l + 16 in the high.
fn pack_nibbles32(q: &[u8; 32]) -> [u8; 16] {
    std::array::from_fn(|l| q[l] | (q[l + 16] << 4))
}

#[test]
fn q8_0_and_q4_0_decode_hand_packed_blocks() {
    let mut b = vec![0u8; 34];
    b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
    for l in 0..32 {
        b[2 + l] = (l as i8 - 16) as u8;
    }
    let mut out = [0f32; 32];
    decode_block(QType::Q8_0, &b, &mut out);
    for (l, &o) in out.iter().enumerate() {
        assert_eq!(o, 0.5 * (l as f32 - 16.0));
    }
    let q: [u8; 32] = std::array::from_fn(|l| (l * 7 % 16) as u8);
    let mut b = vec![0u8; 18];
    b[0..2].copy_from_slice(&f16::from_f32(-2.0).to_le_bytes());
    b[2..18].copy_from_slice(&pack_nibbles32(&q));
    decode_block(QType::Q4_0, &b, &mut out);
    for l in 0..32 {
        assert_eq!(out[l], -2.0 * (q[l] as f32 - 8.0));
    }
}

/// MXFP4 by the OCP spec: e2m1 code `s eem` is `(-1)^s * 2^(ee - 1) * (1 + m / 2)` (ee > 0) or
/// `(-1)^s * m / 2` (ee = 0), times the scale `2^(e - 127)`; written out here, not from ggml's
/// doubled table.
#[test]
fn mxfp4_decodes_hand_packed_blocks_by_the_ocp_values() {
    let e2m1 = [0.0f32, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let value = |code: u8| {
        let v = e2m1[(code & 7) as usize];
        if code & 8 != 0 {
            -v
        } else {
            v
        }
    };
    let q: [u8; 32] = std::array::from_fn(|l| ((l * 11 + l / 16) % 16) as u8);
    // 2^0, 2^-3, 2^3, and the two subnormal-scale exponents 0 and 1 (2^-127, 2^-126)
    for (e, scale) in [
        (127u8, 1.0f64),
        (124, 0.125),
        (130, 8.0),
        (0, 2f64.powi(-127)),
        (1, 2f64.powi(-126)),
    ] {
        let mut b = vec![e];
        b.extend_from_slice(&pack_nibbles32(&q));
        let mut out = [f32::NAN; 32];
        decode_block(QType::Mxfp4, &b, &mut out);
        for (l, &o) in out.iter().enumerate() {
            let want = (value(q[l]) as f64 * scale) as f32;
            // code 8 is -0 by the spec; ggml (the reference) decodes it as +0, so compare values
            assert_eq!(o, want, "e={e} element {l}");
        }
    }
}

/// NVFP4 by its definition: e4m3 block scales (bias 7; `2^(e - 7) (1 + m / 8)`, subnormal
/// `2^-6 m / 8`), one per 16 weights, e2m1 codes as for MXFP4, then the tensor's fp32 scale;
/// ggml's layout: sub-block j's element l < 8 in the low nibble of byte 4 + 8 j + l, l >= 8 in
/// the high nibble of byte 4 + 8 j + l - 8.
#[test]
fn nvfp4_decodes_hand_packed_blocks_by_the_format() {
    let e2m1 = [0.0f64, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let value = |code: u8| e2m1[(code & 7) as usize] * if code & 8 != 0 { -1.0 } else { 1.0 };
    let e4m3 = |s: u8| {
        let (e, m) = ((s >> 3) as i32, (s & 7) as f64);
        if e == 0 {
            2f64.powi(-6) * m / 8.0
        } else {
            2f64.powi(e - 7) * (1.0 + m / 8.0)
        }
    };
    let q: [u8; 64] = std::array::from_fn(|l| ((l * 5 + l / 16) % 16) as u8);
    // 1.0, 448 (the largest), a subnormal (3 * 2^-9) and 0.40625
    let scales = [0x38u8, 0x7E, 0x03, 0x2A];
    let mut b = scales.to_vec();
    for j in 0..4 {
        b.extend((0..8).map(|l| q[16 * j + l] | (q[16 * j + 8 + l] << 4)));
    }
    let tensor_scale = 0.0123f32;
    b.extend_from_slice(&tensor_scale.to_le_bytes());
    let mut out = [f32::NAN; 64];
    dequantize(QType::Nvfp4, &b, &mut out, 1, 64, 1).unwrap();
    for (l, &o) in out.iter().enumerate() {
        // the block product is exact in fp32; the tensor scale rounds once
        let want = (value(q[l]) * e4m3(scales[l / 16])) as f32 * tensor_scale;
        assert_eq!(o, want, "element {l}");
    }
    let mut short = vec![0f32; 64];
    let err = dequantize(QType::Nvfp4, &b[..36], &mut short, 1, 64, 1).unwrap_err();
    assert!(err.to_string().contains("tensor scale"), "{err}");
}

/// IQ4_XS by its layout: eight 6-bit sub-block scales split into low nibbles (bytes 4..8)
/// and 2-bit high parts (the u16 at bytes 2..4), values from the non-linear table.
#[test]
fn iq4_xs_decodes_hand_packed_block() {
    let ls: [u8; 8] = [0, 63, 32, 37, 16, 48, 1, 40];
    let mut b = vec![0u8; 136];
    b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
    let mut high = 0u16;
    for (s, &l) in ls.iter().enumerate() {
        b[4 + s / 2] |= (l & 15) << (4 * (s % 2));
        high |= ((l >> 4) as u16) << (2 * s);
    }
    b[2..4].copy_from_slice(&high.to_le_bytes());
    for (i, q) in b[8..].iter_mut().enumerate() {
        *q = (i % 16) as u8 | ((15 - (i % 16) as u8) << 4); // low nibble l, high 15 - l
    }
    let mut out = [f32::NAN; 256];
    decode_block(QType::Iq4Xs, &b, &mut out);
    let table = [
        -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
    ];
    for (s, &l) in ls.iter().enumerate() {
        let dl = 0.5 * (l as f32 - 32.0);
        for j in 0..16 {
            assert_eq!(
                out[32 * s + j],
                dl * table[j] as f32,
                "sub-block {s} element {j}"
            );
            assert_eq!(
                out[32 * s + 16 + j],
                dl * table[15 - j] as f32,
                "sub-block {s} high {j}"
            );
        }
    }
}

/// Packs eight 6-bit (scale, min) pairs the way ggml's `get_scale_min_k4` unpacks them.
fn pack_scales_k4(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4);
    }
    s
}

#[test]
fn q4_k_decodes_hand_packed_block() {
    let sc: [u8; 8] = [1, 17, 33, 63, 2, 31, 47, 60];
    let m: [u8; 8] = [0, 5, 62, 13, 63, 20, 1, 44];
    let scales = pack_scales_k4(&sc, &m);
    for j in 0..8 {
        assert_eq!(scale_min_k4(&scales, j), (sc[j], m[j]));
    }
    let q: Vec<u8> = (0..256).map(|e| ((e * 5 + e / 32) % 16) as u8).collect();
    let (d, dmin) = (0.25f32, 0.125f32);
    let mut b = vec![0u8; 144];
    b[0..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    b[2..4].copy_from_slice(&f16::from_f32(dmin).to_le_bytes());
    b[4..16].copy_from_slice(&scales);
    for c in 0..4 {
        for l in 0..32 {
            b[16 + 32 * c + l] = q[64 * c + l] | (q[64 * c + 32 + l] << 4);
        }
    }
    let mut out = [0f32; 256];
    decode_block(QType::Q4K, &b, &mut out);
    for e in 0..256 {
        let sb = e / 32;
        let want = d * sc[sb] as f32 * q[e] as f32 - dmin * m[sb] as f32;
        assert_eq!(out[e], want, "element {e}");
    }
}

#[test]
fn q6_k_decodes_hand_packed_block() {
    let q: Vec<u8> = (0..256).map(|e| ((e * 11 + 3) % 64) as u8).collect();
    let sc: Vec<i8> = (0..16).map(|j| (j as i8 - 8) * 9).collect();
    let d = 0.5f32;
    let mut b = vec![0u8; 210];
    for h in 0..2 {
        for l in 0..32 {
            let e = |s: usize| q[128 * h + 32 * s + l];
            b[64 * h + l] = (e(0) & 15) | ((e(2) & 15) << 4);
            b[64 * h + 32 + l] = (e(1) & 15) | ((e(3) & 15) << 4);
            b[128 + 32 * h + l] =
                (e(0) >> 4) | ((e(1) >> 4) << 2) | ((e(2) >> 4) << 4) | ((e(3) >> 4) << 6);
        }
    }
    for j in 0..16 {
        b[192 + j] = sc[j] as u8;
    }
    b[208..210].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    let mut out = [0f32; 256];
    decode_block(QType::Q6K, &b, &mut out);
    for e in 0..256 {
        let want = d * sc[e / 16] as f32 * (q[e] as i32 - 32) as f32;
        assert_eq!(out[e], want, "element {e}");
    }
}

#[test]
fn q3_k_scales_unpack_six_bits_minus_32() {
    let want: [u8; 16] = std::array::from_fn(|j| ((j * 13 + 5) % 64) as u8);
    let mut s = [0u8; 12];
    for j in 0..16 {
        s[j % 8] |= (want[j] & 15) << (4 * (j / 8));
        s[8 + j % 4] |= (want[j] >> 4) << (2 * (j / 4));
    }
    let got = scales_q3k(&s);
    for j in 0..16 {
        assert_eq!(got[j], want[j] as i8 - 32);
    }
}

#[test]
fn sizes_are_checked_before_any_write() {
    let w = vec![0u8; 144 * 3];
    let x = vec![1f32; 256];
    let mut out = vec![7f32; 3];
    let e = matmul(
        QType::Q4K,
        &w[..143 * 3],
        &x,
        &mut out,
        3,
        256,
        1,
        Isa::Portable,
    );
    assert!(matches!(e, Err(CoreError::Config(m)) if m.contains("expected 432 bytes")));
    let e = matmul(QType::Q4K, &w, &x, &mut out, 3, 250, 1, Isa::Portable);
    assert!(matches!(e, Err(CoreError::Config(m)) if m.contains("multiple of the block size 256")));
    let e = matmul(
        QType::Q4K,
        &w,
        &x[..255],
        &mut out,
        3,
        256,
        1,
        Isa::Portable,
    );
    assert!(matches!(e, Err(CoreError::Config(m)) if m.contains("x has 255 floats")));
    let e = matmul(QType::Q4K, &w, &x, &mut out[..2], 3, 256, 1, Isa::Portable);
    assert!(matches!(e, Err(CoreError::Config(m)) if m.contains("out has 2 floats")));
    assert_eq!(out, vec![7f32; 3]);
    assert!(matches!(QType::parse("TQ2_0"), Err(CoreError::Config(m)) if m.contains("TQ2_0")));
    assert_eq!(QType::parse("q4_k").unwrap(), QType::Q4K);
}

#[test]
fn routed_experts_equal_one_call_per_expert_then_weighted_adds() {
    let mut rng = Rng(21);
    let (hidden, inter, n) = (256, 256, 5); // Q4_K rows are whole 256-blocks
    let types = [QType::Q4K, QType::Q8_0, QType::Q5_1];
    let expert = |rng: &mut Rng, t: QType| {
        (
            random_weights(t, inter, hidden, rng),
            random_weights(t, inter, hidden, rng),
            random_weights(QType::Q8_0, hidden, inter, rng),
        )
    };
    let ws: Vec<_> = types.iter().map(|&t| expert(&mut rng, t)).collect();
    let rows: [Vec<usize>; 3] = [vec![0, 1, 2, 3, 4], vec![1, 4], vec![3]];
    let gates: [Vec<f32>; 3] = [
        (0..5).map(|_| rng.unit()).collect(),
        vec![rng.unit(), rng.unit()],
        vec![rng.unit()],
    ];
    let x: Vec<f32> = (0..n * hidden).map(|_| rng.unit()).collect();
    let isa = Isa::detect();
    let calls: Vec<RoutedExpert<'_>> = (0..3)
        .map(|k| RoutedExpert {
            gate: (types[k], &ws[k].0),
            up: (types[k], &ws[k].1),
            down: (QType::Q8_0, &ws[k].2),
            rows: &rows[k],
            weights: &gates[k],
        })
        .collect();
    let mut got = vec![0f32; n * hidden];
    experts_ffn(&calls, &x, &mut got, hidden, inter, 1, isa).unwrap();
    let mut want = vec![0f32; n * hidden];
    for k in 0..3 {
        let xe: Vec<f32> = rows[k]
            .iter()
            .flat_map(|&r| x[r * hidden..(r + 1) * hidden].to_vec())
            .collect();
        let mut y = vec![0f32; xe.len()];
        let w = &ws[k];
        expert_ffn(
            (types[k], &w.0),
            (types[k], &w.1),
            (QType::Q8_0, &w.2),
            &xe,
            &mut y,
            hidden,
            inter,
            1,
            isa,
        )
        .unwrap();
        for (j, &r) in rows[k].iter().enumerate() {
            for c in 0..hidden {
                want[r * hidden + c] += y[j * hidden + c] * gates[k][j];
            }
        }
    }
    assert_eq!(got, want, "the same products and adds in the same order");
    assert!(got.iter().any(|&v| v != 0.0));

    let bad_rows = [9usize];
    let bad = RoutedExpert {
        rows: &bad_rows,
        weights: &gates[2],
        ..calls[2]
    };
    let mut out = vec![1f32; n * hidden];
    let e = experts_ffn(&[calls[0], bad], &x, &mut out, hidden, inter, 1, isa);
    assert!(
        matches!(e, Err(CoreError::Config(ref m)) if m.contains("row 9")),
        "{e:?}"
    );
    assert!(
        out.iter().all(|&v| v == 1.0),
        "nothing written before the check fails"
    );
}

#[test]
fn group_routes_orders_experts_ascending_with_their_rows_and_weights() {
    // three tokens, top-2: token 0 -> (3, 1), token 1 -> (1, 0), token 2 -> (3, 0)
    let ids = [3i64, 1, 1, 0, 3, 0];
    let weights = [0.6f32, 0.4, 0.7, 0.3, 0.5, 0.5];
    let got = group_routes(&ids, &weights, 2, 4).unwrap();
    let want = vec![
        Route {
            expert: 0,
            rows: vec![1, 2],
            weights: vec![0.3, 0.5],
        },
        Route {
            expert: 1,
            rows: vec![0, 1],
            weights: vec![0.4, 0.7],
        },
        Route {
            expert: 3,
            rows: vec![0, 2],
            weights: vec![0.6, 0.5],
        },
    ];
    assert_eq!(got, want);
    assert!(group_routes(&ids, &weights, 2, 3).is_err(), "expert 3 of 3");
    assert!(group_routes(&[-1], &[1.0], 1, 4).is_err());
    assert!(group_routes(&ids, &weights[..5], 2, 4).is_err());
}

#[test]
fn q5_1_block_pairs_cover_odd_counts_and_several_gathers() {
    // AVX-512 takes Q5_1 two blocks at a time, up to 16 blocks per gather of their scales, and
    // an odd last block alone: 1 block (no pair), 17 (8 pairs and one), 18 (the demo's 576
    // columns: a full gather and a one-pair one), 35 and 48 (several gathers)
    for blocks in [1, 2, 17, 18, 35, 48] {
        for &isa in &Isa::available() {
            for n in [1, 3] {
                check_kernel(QType::Q5_1, isa, 5, 32 * blocks, n, 40 + blocks as u64);
            }
        }
    }
}

#[test]
fn an_iquant_grid_is_checked_when_installed() {
    use super::iq::set_grid;
    super::iq::test_grids::install();
    let e = set_grid(QType::Iq3S, &[1.0; 100]);
    assert!(matches!(e, Err(CoreError::Config(m)) if m.contains("100 values, expected 512 x 4")));
    let e = set_grid(QType::Iq3S, &[1.0; 2048]);
    assert!(matches!(e, Err(CoreError::Config(m)) if m.contains("already installed")));
    let e = set_grid(QType::Q4K, &[]);
    assert!(matches!(e, Err(CoreError::Config(m)) if m.contains("Q4_K has no grid")));
    // the integer kernels hold the grid as bytes: a value that is not one is refused
    let mut grid = vec![8.0; 256 * 8];
    grid[5] = 8.5;
    let e = set_grid(QType::Iq2Xxs, &grid);
    assert!(matches!(e, Err(CoreError::Config(m)) if m.contains("value 8.5 is not an integer")));
    let e = set_grid(QType::Iq1S, &[16.0; 2048 * 8]);
    assert!(matches!(e, Err(CoreError::Config(m)) if m.contains("value 16 is not an integer")));
    assert_eq!(QType::parse("iq1_m").unwrap(), QType::Iq1M);
}
