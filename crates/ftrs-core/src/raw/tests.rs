//! Unit tests of [`super`]: the host region and the parallel copies.

use super::*;

#[test]
fn region_is_zeroed_aligned_and_bounds_checked() {
    let mut r = HostRegion::zeroed(3 * 4096, 4096).unwrap();
    assert_eq!(r.addr() % 4096, 0);
    let mut out = vec![1u8; 3 * 4096];
    r.read(0, &mut out).unwrap();
    assert!(out.iter().all(|&b| b == 0));
    r.write(4090, &[7; 6]).unwrap();
    assert!(r.write(4096 * 3 - 2, &[1; 3]).is_err());
    let mut six = [0u8; 6];
    r.read(4090, &mut six).unwrap();
    assert_eq!(six, [7; 6]);
}

/// A region large enough for its own huge-page mapping (on Linux), of a size that is not a
/// whole number of pages: zero, its last byte writable, freed cleanly (twice over).
#[test]
fn large_region_is_zeroed_and_writable_to_its_last_byte() {
    for _ in 0..2 {
        let n = (5 << 20) + 123;
        let mut r = HostRegion::zeroed(n, 4096).unwrap();
        assert_eq!(r.addr() % 4096, 0);
        assert!(r.as_mut_slice().iter().all(|&b| b == 0));
        r.write(n - 3, &[9; 3]).unwrap();
        assert!(r.write(n - 2, &[1; 3]).is_err());
        let mut tail = [0u8; 4];
        r.read(n - 4, &mut tail).unwrap();
        assert_eq!(tail, [0, 9, 9, 9]);
    }
}

#[test]
fn parallel_copy_matches_source_for_odd_sizes() {
    let n = 3 * MIN_BYTES_PER_THREAD + 12345;
    let src: Vec<u8> = (0..n).map(|i| (i * 31 % 251) as u8).collect();
    let mut dst = vec![0u8; n];
    // SAFETY: both vectors are live for the call, distinct, and n bytes long.
    unsafe { copy_parallel(dst.as_mut_ptr() as usize, src.as_ptr() as usize, n, 4) };
    assert!(src == dst);
}

#[test]
fn copies_are_whole_whether_helpers_poll_or_sleep() {
    // Gaps shorter and longer than HELPER_SPIN: the job reaches a polling helper through
    // its counter and a parked one through the condition variable.
    let n = 4 * MIN_BYTES_PER_THREAD + 4097;
    let src: Vec<u8> = (0..n).map(|i| (i * 7 % 253) as u8).collect();
    for gap_us in [0u64, 50, 1000, 5000, 0, 300] {
        std::thread::sleep(Duration::from_micros(gap_us));
        let mut dst = vec![0u8; n];
        // SAFETY: both vectors are live for the call, distinct, and n bytes long.
        unsafe { copy_parallel(dst.as_mut_ptr() as usize, src.as_ptr() as usize, n, 0) };
        assert!(src == dst, "copy after a {gap_us} us gap differs");
    }
}

#[test]
fn concurrent_parallel_copies_each_get_their_own_bytes() {
    let n = 5 * MIN_BYTES_PER_THREAD + 777;
    std::thread::scope(|s| {
        for t in 0..4u8 {
            s.spawn(move || {
                let src: Vec<u8> = (0..n).map(|i| (i as u8).wrapping_mul(t + 3)).collect();
                for _ in 0..20 {
                    let mut dst = vec![0u8; n];
                    // SAFETY: both vectors are live for the call, distinct, n bytes long.
                    unsafe {
                        copy_parallel(dst.as_mut_ptr() as usize, src.as_ptr() as usize, n, 0)
                    };
                    assert!(src == dst);
                }
            });
        }
    });
}
