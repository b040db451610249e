//! Filling the pool from safetensors files written here, including every error case.

use std::collections::HashMap;
use std::path::Path;

use ftrs_core::{CoreError, ExpertLayout, ExpertPool, FillEntry, PoolDtype};
use half::{bf16, f16};
use safetensors::tensor::TensorView;
use safetensors::Dtype;

fn write_file(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: HashMap<String, TensorView<'_>> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(&views, None, path).unwrap();
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn entry(path: &Path, name: &str, layer: usize, expert: usize, t: usize) -> FillEntry {
    FillEntry {
        path: path.display().to_string(),
        tensor: name.into(),
        layer,
        expert,
        tensor_index: t,
    }
}

fn read(pool: &ExpertPool, off: usize, n: usize) -> Vec<u8> {
    let mut v = vec![0; n];
    pool.read(off, &mut v).unwrap();
    v
}

#[test]
fn fill_converts_every_disk_dtype_to_the_pool_dtype() {
    let dir = std::env::temp_dir().join(format!("ftrs-fill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let vals: Vec<f32> = (0..6).map(|i| i as f32 * 0.5 - 1.0).collect();
    let f16b: Vec<u8> = vals
        .iter()
        .flat_map(|&x| f16::from_f32(x).to_le_bytes())
        .collect();
    let bf16b: Vec<u8> = vals
        .iter()
        .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
        .collect();
    let a = dir.join("a.safetensors");
    let b = dir.join("b.safetensors");
    write_file(
        &a,
        &[
            ("w32", Dtype::F32, vec![2, 3], f32_bytes(&vals)),
            ("w16", Dtype::F16, vec![6], f16b.clone()),
        ],
    );
    write_file(&b, &[("wbf", Dtype::BF16, vec![3, 2], bf16b.clone())]);
    for dtype in [PoolDtype::BF16, PoolDtype::F16, PoolDtype::F32] {
        let lay = ExpertLayout::new(1, 3, &[6 * dtype.size()], 256).unwrap();
        let mut pool = ExpertPool::new(lay.clone(), dtype).unwrap();
        let entries = vec![
            entry(&a, "w32", 0, 0, 0),
            entry(&a, "w16", 0, 1, 0),
            entry(&b, "wbf", 0, 2, 0),
        ];
        let n = pool.fill_from_safetensors(&entries, 2).unwrap();
        assert_eq!(n, 3 * 6 * dtype.size());
        let expect: Vec<u8> = match dtype {
            PoolDtype::F32 => f32_bytes(&vals),
            PoolDtype::F16 => f16b.clone(),
            PoolDtype::BF16 => bf16b.clone(),
        };
        for e in 0..3 {
            assert_eq!(
                read(&pool, lay.offset(0, e, 0).unwrap(), 6 * dtype.size()),
                expect,
                "{dtype:?} {e}"
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn fill_errors_name_the_file_and_tensor() {
    let dir = std::env::temp_dir().join(format!("ftrs-fill-err-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good.safetensors");
    write_file(
        &good,
        &[
            ("w", Dtype::F32, vec![4], f32_bytes(&[1.0, 2.0, 3.0, 4.0])),
            ("big", Dtype::F32, vec![5], f32_bytes(&[0.0; 5])),
            ("ints", Dtype::I32, vec![4], vec![0; 16]),
        ],
    );
    let bytes = std::fs::read(&good).unwrap();
    let truncated = dir.join("trunc.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() - 10]).unwrap();
    let lay = ExpertLayout::new(1, 2, &[16], 256).unwrap();
    let mut pool = ExpertPool::new(lay, PoolDtype::F32).unwrap();
    let missing = dir.join("nope.safetensors");
    let cases = [
        (
            entry(&missing, "w", 0, 0, 0),
            "nope.safetensors",
            "cannot open",
        ),
        (
            entry(&good, "absent", 0, 0, 0),
            "good.safetensors",
            "\"absent\" not found",
        ),
        (
            entry(&good, "big", 0, 0, 0),
            "good.safetensors",
            "\"big\" has shape [5]",
        ),
        (
            entry(&good, "ints", 0, 0, 0),
            "good.safetensors",
            "dtype I32",
        ),
        (
            entry(&truncated, "w", 0, 0, 0),
            "trunc.safetensors",
            "not a readable safetensors",
        ),
    ];
    for (e, file, problem_part) in cases {
        match pool.fill_from_safetensors(&[e], 1) {
            Err(CoreError::ModelLoad { path, problem }) => {
                assert!(path.ends_with(file), "{path}");
                assert!(problem.contains(problem_part), "{problem}");
            }
            other => panic!("expected ModelLoad for {file}/{problem_part}, got {other:?}"),
        }
    }
    let dup = [entry(&good, "w", 0, 1, 0), entry(&good, "w", 0, 1, 0)];
    assert!(matches!(
        pool.fill_from_safetensors(&dup, 0),
        Err(CoreError::Config(_))
    ));
    let out_of_range = [entry(&good, "w", 0, 2, 0)];
    assert!(matches!(
        pool.fill_from_safetensors(&out_of_range, 0),
        Err(CoreError::Config(_))
    ));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn write_checks_the_tensor_size() {
    let lay = ExpertLayout::new(2, 2, &[8, 4], 256).unwrap();
    let mut pool = ExpertPool::new(lay.clone(), PoolDtype::F32).unwrap();
    assert_eq!(pool.address() % 4096, 0);
    pool.write(1, 1, 1, &[9; 4]).unwrap();
    assert_eq!(read(&pool, lay.offset(1, 1, 1).unwrap(), 4), vec![9; 4]);
    assert!(matches!(
        pool.write(1, 1, 1, &[9; 5]),
        Err(CoreError::Config(_))
    ));
    assert!(!pool.pin(0).unwrap() || ftrs_core::cuda::available());
    assert!(matches!(pool.pin(-1), Err(CoreError::Config(_))));
    assert!(!pool.is_pinned() || ftrs_core::cuda::available());
}
