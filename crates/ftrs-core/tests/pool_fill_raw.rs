//! Filling the pool with byte ranges of one file as they are (a GGUF's quantized experts):
//! every byte lands where the layout says, on any thread count; bad ranges and destinations
//! are refused before anything is copied.

use ftrs_core::{CoreError, ExpertLayout, ExpertPool, PoolDtype, RawFillEntry};

fn file_of(name: &str, bytes: &[u8]) -> String {
    let dir = std::env::temp_dir().join(format!("ftrs-raw-fill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path.display().to_string()
}

fn entry(offset: usize, layer: usize, expert: usize, tensor_index: usize) -> RawFillEntry {
    RawFillEntry {
        offset,
        layer,
        expert,
        tensor_index,
    }
}

fn read(pool: &ExpertPool, off: usize, n: usize) -> Vec<u8> {
    let mut v = vec![0; n];
    pool.read(off, &mut v).unwrap();
    v
}

#[test]
fn every_range_lands_at_its_layout_tensor_on_any_thread_count() {
    // two layers of 3 experts, tensors of 40 and 24 bytes (odd sizes, as quantized rows are)
    let bytes: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
    let path = file_of("every.bin", &bytes);
    let sizes = [40usize, 24];
    let mut entries = Vec::new();
    let mut at = 13; // an odd start: GGUF tensors need no alignment in the file
    for layer in 0..2 {
        for expert in 0..3 {
            for (t, &n) in sizes.iter().enumerate() {
                entries.push((entry(at, layer, expert, t), n));
                at += n;
            }
        }
    }
    for threads in [1, 2, 5] {
        let layout = ExpertLayout::new(2, 3, &sizes, 64).unwrap();
        let mut pool = ExpertPool::new(layout.clone(), PoolDtype::F32).unwrap();
        let only: Vec<RawFillEntry> = entries.iter().map(|(e, _)| *e).collect();
        let written = pool.fill_from_file(&path, &only, threads).unwrap();
        assert_eq!(written, 6 * 64);
        for (e, n) in &entries {
            let off = layout.offset(e.layer, e.expert, e.tensor_index).unwrap();
            assert_eq!(read(&pool, off, *n), bytes[e.offset..e.offset + n], "{e:?}");
        }
    }
}

#[test]
fn a_range_past_the_end_fails_naming_it_and_copies_nothing() {
    let path = file_of("short.bin", &[9u8; 100]);
    let layout = ExpertLayout::new(1, 2, &[40], 64).unwrap();
    let mut pool = ExpertPool::new(layout.clone(), PoolDtype::F32).unwrap();
    let err = pool
        .fill_from_file(&path, &[entry(0, 0, 0, 0), entry(61, 0, 1, 0)], 2)
        .unwrap_err();
    match err {
        CoreError::ModelLoad { path: p, problem } => {
            assert_eq!(p, path);
            assert!(
                problem.contains("expert 1") && problem.contains("past the end"),
                "{problem}"
            );
        }
        other => panic!("expected ModelLoad, got {other:?}"),
    }
    assert_eq!(read(&pool, 0, 40), vec![0; 40]); // the first, good entry was not copied either
    let err = pool
        .fill_from_file(&path, &[entry(usize::MAX - 3, 0, 0, 0)], 1)
        .unwrap_err();
    assert!(matches!(err, CoreError::ModelLoad { .. }), "{err:?}");
}

#[test]
fn bad_destinations_and_a_missing_file_are_refused() {
    let path = file_of("dest.bin", &[1u8; 200]);
    let layout = ExpertLayout::new(1, 2, &[40], 64).unwrap();
    let mut pool = ExpertPool::new(layout, PoolDtype::F32).unwrap();
    let twice = pool.fill_from_file(&path, &[entry(0, 0, 1, 0), entry(40, 0, 1, 0)], 1);
    assert!(matches!(twice, Err(CoreError::Config(m)) if m.contains("both fill")));
    let outside = pool.fill_from_file(&path, &[entry(0, 0, 2, 0)], 1);
    assert!(outside.is_err());
    let missing = pool.fill_from_file("/nonexistent/ftrs.gguf", &[entry(0, 0, 0, 0)], 1);
    assert!(
        matches!(missing, Err(CoreError::ModelLoad { problem, .. }) if problem.contains("cannot open"))
    );
}
