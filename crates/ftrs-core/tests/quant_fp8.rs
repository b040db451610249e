//! FP8 block-scaled matmul (`ftrs_core::quant::fp8`): every e4m3 code against the format's
//! definition written out here, the SIMD decode against the portable one bit for bit, and the
//! matmul of every kernel family against a float64 dot of the dequantized weights on shapes
//! with partial tiles both ways.

use ftrs_core::error::CoreError;
use ftrs_core::quant::{fp8, simd, Isa};

/// e4m3fn by its definition: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
/// subnormal (`m / 8 * 2^-6`); `S.1111.111` is NaN; no infinities.
fn e4m3_by_definition(b: u8) -> f64 {
    let (s, e, m) = (b >> 7, (b >> 3) & 15, b & 7);
    let mag = if e == 15 && m == 7 {
        f64::NAN
    } else if e == 0 {
        m as f64 / 8.0 * 2f64.powi(-6)
    } else {
        2f64.powi(e as i32 - 7) * (1.0 + m as f64 / 8.0)
    };
    if s == 1 {
        -mag
    } else {
        mag
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// A random FP8_BLOCK buffer: finite e4m3 codes (no NaN), scales in [0.001, 0.01).
fn random_fp8(rows: usize, cols: usize, block: (usize, usize), rng: &mut Rng) -> Vec<u8> {
    let mut w: Vec<u8> = (0..rows * cols)
        .map(|_| {
            let b = rng.next() as u8;
            if b & 0x7F == 0x7F {
                b ^ 1
            } else {
                b
            }
        })
        .collect();
    let (gr, gc) = fp8::grid(rows, cols, block);
    for _ in 0..gr * gc {
        let s = 0.001 + 0.009 * (rng.unit() * 0.5 + 0.5);
        w.extend_from_slice(&s.to_le_bytes());
    }
    w
}

#[test]
fn every_e4m3_code_decodes_to_its_definition() {
    for b in 0..=255u8 {
        let (got, want) = (fp8::e4m3(b), e4m3_by_definition(b));
        if want.is_nan() {
            assert!(got.is_nan(), "{b:#04x}: {got}");
        } else {
            assert_eq!(got as f64, want, "{b:#04x}");
            assert_eq!(got.is_sign_negative(), b & 0x80 != 0, "{b:#04x}: sign");
        }
    }
}

#[test]
fn simd_decode_equals_the_portable_decode_bit_for_bit() {
    // every code, NaN included, twice over a row whose tiles (40) end in a partial step of 16
    let w: Vec<u8> = (0..512).map(|i| (i % 256) as u8).collect();
    let scales = [
        0.5f32, 3.0e-3, 1.0, 7.25, -2.0e-2, 1.0e-30, 4.0e3, 0.1, 9.0, 1.0e-5, 0.2, 1.5, 2.0,
    ];
    let bc = 40;
    let mut simd_out = vec![0f32; w.len()];
    let mut portable = vec![0f32; w.len()];
    simd::fp8_decode(&w, &scales, bc, &mut simd_out);
    fp8::decode_row_portable(&w, &scales, bc, &mut portable);
    for (c, (a, b)) in simd_out.iter().zip(&portable).enumerate() {
        assert!(
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            "column {c} (code {:#04x}): {a} vs {b}",
            w[c]
        );
        let want = e4m3_by_definition(w[c]) as f32 * scales[c / bc];
        assert!(
            want.to_bits() == b.to_bits() || (want.is_nan() && b.is_nan()),
            "column {c}: {b} vs {want}"
        );
    }
}

fn check(rows: usize, cols: usize, block: (usize, usize), n: usize, isa: Isa, seed: u64) {
    let mut rng = Rng(seed);
    let w = random_fp8(rows, cols, block, &mut rng);
    let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
    let mut wf = vec![0f32; rows * cols];
    fp8::dequantize(&w, &mut wf, rows, cols, block).unwrap();
    let mut out = vec![f32::NAN; n * rows];
    fp8::matmul(&w, &x, &mut out, rows, cols, block, 2, isa).unwrap();
    let eps = f32::EPSILON as f64;
    for i in 0..n {
        for r in 0..rows {
            let (mut exact, mut mag) = (0f64, 0f64);
            for c in 0..cols {
                let (xv, wv) = (x[i * cols + c] as f64, wf[r * cols + c] as f64);
                exact += xv * wv;
                mag += (xv * wv).abs();
            }
            let got = out[i * rows + r] as f64;
            let tol = (cols as f64 + 4.0) * eps * mag + 1e-30;
            assert!(
                (got - exact).abs() <= tol,
                "{isa:?} {rows}x{cols} {block:?} n={n} [{i},{r}]: {got} vs {exact} (tol {tol})"
            );
        }
    }
}

#[test]
fn matmul_matches_a_float64_dot_of_the_dequantized_weights() {
    for isa in Isa::available() {
        for n in [1, 2, 3, 8, 9] {
            // partial tiles in both directions, tiles not a multiple of 16 wide
            check(37, 200, (16, 24), n, isa, 1 + n as u64);
            // DeepSeek / Qwen FP8's 128 x 128 tiles, the last ones partial
            check(130, 300, (128, 128), n, isa, 20 + n as u64);
        }
    }
}

#[test]
fn the_tile_scale_of_each_row_and_column_is_the_right_one() {
    // weights all 1.0 (0x38), each tile's scale distinct: row r's output is sum over tiles of
    // scale * (columns in the tile), with x all ones
    let (rows, cols, block) = (5, 7, (2, 3));
    let (gr, gc) = fp8::grid(rows, cols, block);
    assert_eq!((gr, gc), (3, 3));
    let mut w = vec![0x38u8; rows * cols];
    let scale = |tr: usize, tc: usize| (1 + tr * gc + tc) as f32;
    for tr in 0..gr {
        for tc in 0..gc {
            w.extend_from_slice(&scale(tr, tc).to_le_bytes());
        }
    }
    let x = vec![1f32; cols];
    for isa in Isa::available() {
        let mut out = vec![0f32; rows];
        fp8::matmul(&w, &x, &mut out, rows, cols, block, 1, isa).unwrap();
        for (r, &o) in out.iter().enumerate() {
            let want: f32 = (0..gc)
                .map(|tc| scale(r / 2, tc) * (3.min(cols - 3 * tc)) as f32)
                .sum();
            assert_eq!(o, want, "{isa:?} row {r}");
        }
    }
}

#[test]
fn threads_split_rows_without_changing_a_bit() {
    let mut rng = Rng(7);
    let (rows, cols, block) = (301, 384, (128, 128));
    let w = random_fp8(rows, cols, block, &mut rng);
    let x: Vec<f32> = (0..3 * cols).map(|_| rng.unit()).collect();
    let (mut one, mut many) = (vec![0f32; 3 * rows], vec![0f32; 3 * rows]);
    fp8::matmul(&w, &x, &mut one, rows, cols, block, 1, Isa::detect()).unwrap();
    fp8::matmul(&w, &x, &mut many, rows, cols, block, 3, Isa::detect()).unwrap();
    assert_eq!(one, many);
}

/// (weight, x, cols, block, what the error says)
type Case<'a> = (&'a [u8], &'a [f32], usize, (usize, usize), &'static str);

#[test]
fn wrong_sizes_are_config_errors_and_nothing_is_written() {
    let mut rng = Rng(3);
    let (rows, cols, block) = (4, 64, (2, 32));
    let w = random_fp8(rows, cols, block, &mut rng);
    let x = vec![1f32; cols];
    let mut out = vec![f32::NAN; rows];
    let cases: [Case<'_>; 5] = [
        (&w[..w.len() - 4], &x, cols, block, "expected 272 bytes"),
        (&w, &x, cols, (2, 64), "expected 264 bytes"), // 2 x 1 scales, not 2 x 2
        (&w, &x[..cols - 1], cols, block, "expected n x 64"),
        (&w, &x, cols, (0, 32), "must be positive"),
        (&w, &x, 0, block, "must be positive"),
    ];
    for (wb, xb, c, b, needle) in cases {
        let err = fp8::matmul(wb, xb, &mut out, rows, c, b, 1, Isa::Portable).unwrap_err();
        match err {
            CoreError::Config(msg) => assert!(msg.contains(needle), "{msg:?} lacks {needle:?}"),
            other => panic!("expected Config, got {other:?}"),
        }
        assert!(out.iter().all(|v| v.is_nan()), "out written on error");
    }
    let mut short = vec![0f32; rows - 1];
    assert!(fp8::matmul(&w, &x, &mut short, rows, cols, block, 1, Isa::Portable).is_err());
}
