//! The host expert pool: every routed expert's weights in one page-aligned region.
//!
//! The region follows an [`ExpertLayout`]. It is filled through `&mut self`, before it is
//! shared: either by the caller, one tensor at a time ([`ExpertPool::write`], for weights it
//! dequantized itself), or from safetensors files ([`ExpertPool::fill_from_safetensors`]):
//! every distinct file is memory-mapped once and its header parsed once; the region is split
//! into one disjoint `&mut [u8]` per entry; then `threads` scoped threads take entries from a
//! shared atomic index and convert F32/F16/BF16 on disk to the pool dtype straight into their
//! part. [`ExpertPool::fill_from_file`] copies byte ranges of one file as they are (a GGUF's
//! quantized experts) the same way. Entries are validated up front (range, duplicates), and each failure names the file
//! and tensor; when several fail, the first entry's error is returned. Once a transfer engine
//! holds the pool (behind an `Arc`) it is read-only: only `&self` methods remain.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::fs::File;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::error::{CoreError, Result};
use crate::layout::ExpertLayout;
use crate::raw::{effective_threads, map_readonly, HostRegion};

/// Alignment of the pool allocation: one page, as `cuMemHostRegister` wants.
pub const POOL_ALIGN: usize = 4096;

/// Element type of the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolDtype {
    /// IEEE f32.
    F32,
    /// IEEE f16.
    F16,
    /// bfloat16.
    BF16,
}

impl PoolDtype {
    /// Parses the torch spellings `float32|float16|bfloat16` (and `f32|f16|bf16`).
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "float32" | "f32" | "F32" => Ok(Self::F32),
            "float16" | "f16" | "half" | "F16" => Ok(Self::F16),
            "bfloat16" | "bf16" | "BF16" => Ok(Self::BF16),
            _ => Err(CoreError::Config(format!(
                "unknown pool dtype {s:?}: expected float32, float16 or bfloat16"
            ))),
        }
    }
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
        }
    }
    /// The torch spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::F16 => "float16",
            Self::BF16 => "bfloat16",
        }
    }
}

/// One tensor to load: from `tensor` in file `path` into (layer, expert, tensor_index).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FillEntry {
    /// The safetensors file.
    pub path: String,
    /// Tensor name inside the file.
    pub tensor: String,
    /// Destination layer.
    pub layer: usize,
    /// Destination expert.
    pub expert: usize,
    /// Destination tensor index in the layout.
    pub tensor_index: usize,
}

/// One expert tensor to copy as it is from a file: its layout tensor's bytes at `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawFillEntry {
    /// Byte offset of the tensor's data in the file.
    pub offset: usize,
    /// Destination layer.
    pub layer: usize,
    /// Destination expert.
    pub expert: usize,
    /// Destination tensor index in the layout.
    pub tensor_index: usize,
}

/// All routed-expert weights in host memory.
///
/// Filled through `&mut self`; once shared (an engine holds an `Arc` of it) it cannot be
/// written, so a copy never races a write:
///
/// ```compile_fail,E0596
/// use std::sync::Arc;
/// use ftrs_core::{ExpertLayout, ExpertPool, PoolDtype};
/// let layout = ExpertLayout::new(1, 1, &[4], 64).unwrap();
/// let pool = Arc::new(ExpertPool::new(layout, PoolDtype::F32).unwrap());
/// pool.write(0, 0, 0, &[1; 4]).unwrap(); // error[E0596]: cannot borrow data in an `Arc` as mutable
/// ```
///
/// ```
/// use std::sync::Arc;
/// use ftrs_core::{ExpertLayout, ExpertPool, PoolDtype};
/// let layout = ExpertLayout::new(1, 1, &[4], 64).unwrap();
/// let mut pool = ExpertPool::new(layout, PoolDtype::F32).unwrap();
/// pool.write(0, 0, 0, &[1; 4]).unwrap(); // before it is shared
/// let pool = Arc::new(pool);
/// let mut back = [0u8; 4];
/// pool.read(0, &mut back).unwrap();
/// assert_eq!(back, [1; 4]);
/// ```
#[derive(Debug)]
pub struct ExpertPool {
    /// Where each tensor lives; `region.len() == layout.total_bytes()`.
    layout: ExpertLayout,
    /// Element type; every layout tensor size is a multiple of its size for safetensors fills.
    dtype: PoolDtype,
    /// The zeroed, page-aligned memory (pinned through it; unpinned when it drops).
    region: HostRegion,
}

impl ExpertPool {
    /// Allocates a zeroed pool for `layout`.
    pub fn new(layout: ExpertLayout, dtype: PoolDtype) -> Result<Self> {
        let region = HostRegion::zeroed(layout.total_bytes(), POOL_ALIGN)?;
        Ok(Self {
            layout,
            dtype,
            region,
        })
    }
    /// The layout.
    pub fn layout(&self) -> &ExpertLayout {
        &self.layout
    }
    /// The element type.
    pub fn dtype(&self) -> PoolDtype {
        self.dtype
    }
    /// Address of byte 0.
    pub fn address(&self) -> usize {
        self.region.addr()
    }
    /// Size in bytes.
    pub fn nbytes(&self) -> usize {
        self.region.len()
    }
    /// The memory (for building copy jobs).
    pub fn region(&self) -> &HostRegion {
        &self.region
    }
    /// Whether `pin` succeeded.
    pub fn is_pinned(&self) -> bool {
        self.region.is_pinned()
    }

    /// Page-locks the region through the CUDA driver, in device `ordinal`'s context (the
    /// pinning is portable: every device sees it). `Ok(false)` when there is no driver;
    /// `Config` for a negative ordinal or a device the driver does not see.
    pub fn pin(&self, ordinal: i32) -> Result<bool> {
        self.region.pin(ordinal)
    }

    /// Writes raw bytes of tensor `tensor` of (layer, expert); the length must equal the
    /// layout's size for that tensor.
    pub fn write(&mut self, layer: usize, expert: usize, tensor: usize, data: &[u8]) -> Result<()> {
        let off = self.layout.offset(layer, expert, tensor)?;
        let want = self.layout.tensor_bytes(layer, tensor)?;
        if data.len() != want {
            return Err(CoreError::Config(format!(
                "tensor {tensor} of (layer {layer}, expert {expert}) is {want} bytes, got {}",
                data.len()
            )));
        }
        self.region.write(off, data)
    }

    /// Reads `dst.len()` bytes at pool offset `offset` (tests and debugging).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.region.read(offset, dst)
    }

    /// Loads `entries` from safetensors files with `threads` threads (0 = all cores).
    /// Returns the number of bytes written.
    pub fn fill_from_safetensors(
        &mut self,
        entries: &[FillEntry],
        threads: usize,
    ) -> Result<usize> {
        let spans = self.spans(entries.iter().map(|e| (e.layer, e.expert, e.tensor_index)))?;
        let mut file_index: HashMap<&str, usize> = HashMap::new();
        let mut maps = Vec::new();
        for e in entries {
            if !file_index.contains_key(e.path.as_str()) {
                file_index.insert(&e.path, maps.len());
                maps.push(map_file(&e.path)?);
            }
        }
        let mut parsed = Vec::with_capacity(maps.len());
        for (path, map) in file_index_order(&file_index).into_iter().zip(&maps) {
            let st = SafeTensors::deserialize(map).map_err(|err| CoreError::ModelLoad {
                path: path.to_string(),
                problem: format!("not a readable safetensors file: {err}"),
            })?;
            parsed.push(st);
        }
        let (layout, dtype) = (&self.layout, self.dtype);
        let parts = split_disjoint(self.region.as_mut_slice(), spans)?;
        run_parallel(entries.len(), threads, |i| {
            let e = &entries[i];
            let st = &parsed[file_index[e.path.as_str()]];
            let mut part = parts[i].lock().unwrap_or_else(|p| p.into_inner());
            fill_one(layout, dtype, st, e, &mut part)
        })
    }

    /// Copies `entries` from the file at `path` as they are (a GGUF's quantized experts: the
    /// pool holds the file's encoding), with `threads` threads (0 = all cores); an entry's
    /// length is its layout tensor's bytes. Every entry is checked against the file's length
    /// before anything is copied. Returns the number of bytes written.
    pub fn fill_from_file(
        &mut self,
        path: &str,
        entries: &[RawFillEntry],
        threads: usize,
    ) -> Result<usize> {
        let spans = self.spans(entries.iter().map(|e| (e.layer, e.expert, e.tensor_index)))?;
        let map = map_file(path)?;
        for (e, &(_, len, _)) in entries.iter().zip(&spans) {
            if e.offset.checked_add(len).is_none_or(|end| end > map.len()) {
                return Err(CoreError::ModelLoad {
                    path: path.to_string(),
                    problem: format!(
                        "expert tensor (layer {}, expert {}, tensor {}): {len} bytes at offset {} \
                         run past the end of the file ({} bytes)",
                        e.layer,
                        e.expert,
                        e.tensor_index,
                        e.offset,
                        map.len()
                    ),
                });
            }
        }
        let parts = split_disjoint(self.region.as_mut_slice(), spans)?;
        run_parallel(entries.len(), threads, |i| {
            let mut part = parts[i].lock().unwrap_or_else(|p| p.into_inner());
            let (at, len) = (entries[i].offset, part.len());
            part.copy_from_slice(&map[at..at + len]);
            Ok(len)
        })
    }

    /// The `(pool offset, bytes, entry)` of each `(layer, expert, tensor)` destination, in
    /// entry order; a destination out of the layout or named twice is a `Config` error.
    fn spans(
        &self,
        dests: impl Iterator<Item = (usize, usize, usize)>,
    ) -> Result<Vec<(usize, usize, usize)>> {
        let mut seen = HashMap::new();
        let mut spans = Vec::new();
        for (i, (layer, expert, tensor)) in dests.enumerate() {
            let off = self.layout.offset(layer, expert, tensor)?;
            if let Some(j) = seen.insert((layer, expert, tensor), i) {
                return Err(CoreError::Config(format!(
                    "entries {j} and {i} both fill (layer {layer}, expert {expert}, tensor \
                     {tensor})"
                )));
            }
            spans.push((off, self.layout.tensor_bytes(layer, tensor)?, i));
        }
        Ok(spans)
    }
}

/// Runs `fill(i)` for every entry `i < n` on `threads` scoped threads (0 = all cores) taking
/// entries from one atomic index; returns the bytes written, or the first entry's error when
/// several fail.
fn run_parallel<F>(n: usize, threads: usize, fill: F) -> Result<usize>
where
    F: Fn(usize) -> Result<usize> + Sync,
{
    let next = AtomicUsize::new(0);
    let written = AtomicUsize::new(0);
    let errors: Mutex<Vec<(usize, CoreError)>> = Mutex::new(Vec::new());
    let workers = effective_threads(threads).min(n).max(1);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                match fill(i) {
                    Ok(k) => {
                        written.fetch_add(k, Ordering::Relaxed);
                    }
                    Err(err) => errors
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push((i, err)),
                }
            });
        }
    });
    let mut errors = errors.into_inner().unwrap_or_else(|p| p.into_inner());
    errors.sort_by_key(|(i, _)| *i);
    match errors.into_iter().next() {
        Some((_, e)) => Err(e),
        None => Ok(written.into_inner()),
    }
}

/// Cuts `region` into the `(offset, len, entry)` spans, one exclusive part per entry, indexed
/// by entry. The spans must not overlap (distinct layout tensors never do).
fn split_disjoint(
    region: &mut [u8],
    mut spans: Vec<(usize, usize, usize)>,
) -> Result<Vec<Mutex<&mut [u8]>>> {
    let mut parts: Vec<Option<&mut [u8]>> = (0..spans.len()).map(|_| None).collect();
    spans.sort_unstable();
    let mut rest = region;
    let mut at = 0;
    for (off, len, i) in spans {
        let fits = rest.len();
        let Some(skip) = off.checked_sub(at).filter(|&k| k + len <= fits) else {
            return Err(CoreError::Config(format!(
                "pool range [{off}, +{len}) overlaps another entry or leaves the pool"
            )));
        };
        let (mine, tail) = std::mem::take(&mut rest)[skip..].split_at_mut(len);
        parts[i] = Some(mine);
        rest = tail;
        at = off + len;
    }
    Ok(parts
        .into_iter()
        .map(|p| Mutex::new(p.expect("every entry has a span")))
        .collect())
}

/// Converts one entry's tensor into `out`, its part of the pool; returns the bytes written.
fn fill_one(
    layout: &ExpertLayout,
    dtype: PoolDtype,
    st: &SafeTensors<'_>,
    e: &FillEntry,
    out: &mut [u8],
) -> Result<usize> {
    let fail = |problem: String| CoreError::ModelLoad {
        path: e.path.clone(),
        problem,
    };
    let view = st
        .tensor(&e.tensor)
        .map_err(|_| fail(format!("tensor {:?} not found", e.tensor)))?;
    let src_size = match view.dtype() {
        Dtype::F32 => 4,
        Dtype::F16 | Dtype::BF16 => 2,
        other => {
            return Err(fail(format!(
                "tensor {:?} has dtype {other:?}; only F32, F16 and BF16 are supported",
                e.tensor
            )))
        }
    };
    let numel: usize = view.shape().iter().product();
    let want = layout.tensor_bytes(e.layer, e.tensor_index)?;
    if numel * dtype.size() != want {
        return Err(fail(format!(
            "tensor {:?} has shape {:?} ({numel} elements = {} bytes as {}) but layout tensor {} \
             is {want} bytes",
            e.tensor,
            view.shape(),
            numel * dtype.size(),
            dtype.name(),
            e.tensor_index
        )));
    }
    let data = view.data();
    debug_assert_eq!(data.len(), numel * src_size);
    debug_assert_eq!(out.len(), want);
    if same_dtype(view.dtype(), dtype) {
        out.copy_from_slice(data);
    } else {
        convert(data, view.dtype(), out, dtype);
    }
    Ok(want)
}

fn file_index_order<'a>(index: &HashMap<&'a str, usize>) -> Vec<&'a str> {
    let mut v: Vec<(&str, usize)> = index.iter().map(|(k, v)| (*k, *v)).collect();
    v.sort_by_key(|(_, i)| *i);
    v.into_iter().map(|(k, _)| k).collect()
}

fn map_file(path: &str) -> Result<Mmap> {
    let fail = |problem: String| CoreError::ModelLoad {
        path: path.to_string(),
        problem,
    };
    let file = File::open(path).map_err(|e| fail(format!("cannot open: {e}")))?;
    map_readonly(&file).map_err(|e| fail(format!("cannot mmap: {e}")))
}

fn same_dtype(disk: Dtype, pool: PoolDtype) -> bool {
    matches!(
        (disk, pool),
        (Dtype::F32, PoolDtype::F32)
            | (Dtype::F16, PoolDtype::F16)
            | (Dtype::BF16, PoolDtype::BF16)
    )
}

/// Converts little-endian elements of `from` in `src` to `to` in `dst` (sizes must agree).
fn convert(src: &[u8], from: Dtype, dst: &mut [u8], to: PoolDtype) {
    let read = |c: &[u8]| -> f32 {
        match from {
            Dtype::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            Dtype::F16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
            _ => bf16::from_le_bytes([c[0], c[1]]).to_f32(),
        }
    };
    let in_size = if from == Dtype::F32 { 4 } else { 2 };
    for (s, d) in src
        .chunks_exact(in_size)
        .zip(dst.chunks_exact_mut(to.size()))
    {
        let x = read(s);
        match to {
            PoolDtype::F32 => d.copy_from_slice(&x.to_le_bytes()),
            PoolDtype::F16 => d.copy_from_slice(&f16::from_f32(x).to_le_bytes()),
            PoolDtype::BF16 => d.copy_from_slice(&bf16::from_f32(x).to_le_bytes()),
        }
    }
}
