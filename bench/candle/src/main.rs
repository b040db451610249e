//! candle-core's quantized CPU matmul against ftrs-core's kernels, on the same GGUF blocks.
//!
//! For each of the demo MoE's per-token matmul shapes, random weights are quantized by candle
//! (`QTensor::quantize`), and the same block bytes go to `ftrs_core::quant::matmul`. Each
//! engine multiplies one activation row (a decode token) by every copy of the shape in turn (a
//! working set of about 200 MB, so the weights stream from DRAM as in a decode step), in
//! alternating rounds; the figure is the median microseconds per call. Threads: candle's come
//! from rayon (`RAYON_NUM_THREADS`), ftrs's from the argument; run with both at 1 for one core.
//!
//!     RAYON_NUM_THREADS=1 cargo run --release --manifest-path bench/candle/Cargo.toml -- 1

use std::time::Instant;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use ftrs_core::quant::{matmul, Isa, QType};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let threads: usize = std::env::args().nth(1).map_or(Ok(1), |a| a.parse())?;
    let dev = Device::Cpu;
    let shapes = [
        ("Q5_1", GgmlDType::Q5_1, 1536, 576),
        ("Q4_K", GgmlDType::Q4K, 576, 1536),
        ("Q6_K", GgmlDType::Q6K, 576, 1536),
        ("Q8_0", GgmlDType::Q8_0, 49152, 576),
    ];
    println!(
        "shape, candle us/call, ftrs us/call, candle / ftrs, max |diff| / max |y| (threads {threads}, isa {:?})",
        Isa::detect()
    );
    for (name, dt, rows, cols) in shapes {
        let t = QType::parse(name)?;
        let (be, bb) = t.block_info();
        let bytes = rows * cols / be * bb;
        let copies = (200usize << 20).div_ceil(bytes).clamp(1, 256);
        let mut cands = Vec::new();
        let mut blocks = Vec::new();
        for _ in 0..copies {
            let w = Tensor::randn(0f32, 1f32, (rows, cols), &dev)?;
            let q = QTensor::quantize(&w, dt)?;
            blocks.push(q.data()?.to_vec());
            cands.push(QMatMul::from_qtensor(q)?);
        }
        let x = Tensor::randn(0f32, 1f32, (1, cols), &dev)?;
        let xv: Vec<f32> = x.flatten_all()?.to_vec1()?;
        let mut out = vec![0f32; rows];
        // agreement on copy 0
        let yc: Vec<f32> = cands[0].forward(&x)?.flatten_all()?.to_vec1()?;
        matmul(
            t,
            &blocks[0],
            &xv,
            &mut out,
            rows,
            cols,
            threads,
            Isa::detect(),
        )?;
        let ymax = yc.iter().fold(0f32, |m, v| m.max(v.abs()));
        let dmax = yc
            .iter()
            .zip(&out)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        let (mut tc, mut tf) = (Vec::new(), Vec::new());
        for _ in 0..7 {
            let t0 = Instant::now();
            for c in &cands {
                std::hint::black_box(c.forward(&x)?);
            }
            tc.push(t0.elapsed().as_secs_f64() / copies as f64 * 1e6);
            let t0 = Instant::now();
            for b in &blocks {
                matmul(t, b, &xv, &mut out, rows, cols, threads, Isa::detect())?;
                std::hint::black_box(&out);
            }
            tf.push(t0.elapsed().as_secs_f64() / copies as f64 * 1e6);
        }
        let (c, f) = (median(tc), median(tf));
        println!(
            "{name} {rows}x{cols} ({copies} copies), {c:.1}, {f:.1}, {:.2}, {:.1e}",
            c / f,
            dmax / ymax
        );
    }
    Ok(())
}
