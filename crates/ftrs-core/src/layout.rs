//! Where every expert tensor lives in the host pool.
//!
//! The pool is one region. Each (layer, expert) owns ONE contiguous block of `expert_bytes`
//! (so a single copy moves a whole expert into a device slot of the same stride); inside a block
//! the tensors (e.g. gate, up, down) sit back to back, each starting at a multiple of
//! `alignment`. Blocks are laid out layer-major: block index = layer * num_experts + expert,
//! offset = index * expert_bytes. `expert_bytes` is the aligned end of the last tensor, so every
//! block start is aligned too.

use crate::error::{CoreError, Result};

/// Rounds `x` up to a multiple of `align` (a power of two).
pub(crate) fn align_up(x: usize, align: usize) -> usize {
    debug_assert!(align.is_power_of_two());
    (x + align - 1) & !(align - 1)
}

/// The offsets of every (layer, expert, tensor) in one host region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertLayout {
    /// Number of MoE layers; > 0.
    num_layers: usize,
    /// Routed experts per layer; > 0.
    num_experts: usize,
    /// Byte size of each tensor of an expert; non-empty, each > 0.
    tensor_bytes: Vec<usize>,
    /// Offset of each tensor inside a block; multiples of `alignment`, increasing, no overlap.
    tensor_offsets: Vec<usize>,
    /// Alignment of every tensor start; a power of two.
    alignment: usize,
    /// Stride between blocks; a multiple of `alignment`, >= end of the last tensor.
    expert_bytes: usize,
}

impl ExpertLayout {
    /// Builds the layout; errors on zero counts, empty/zero tensor sizes, a non-power-of-two
    /// alignment or a total that overflows `usize`.
    pub fn new(
        num_layers: usize,
        num_experts: usize,
        tensor_bytes: &[usize],
        alignment: usize,
    ) -> Result<Self> {
        if num_layers == 0 || num_experts == 0 {
            return Err(CoreError::Config(format!(
                "layout needs at least one layer and one expert, got {num_layers} x {num_experts}"
            )));
        }
        if tensor_bytes.is_empty() || tensor_bytes.contains(&0) {
            return Err(CoreError::Config(format!(
                "tensor sizes must be non-empty and positive, got {tensor_bytes:?}"
            )));
        }
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(CoreError::Config(format!(
                "alignment must be a power of two, got {alignment}"
            )));
        }
        let mut offsets = Vec::with_capacity(tensor_bytes.len());
        let mut end = 0usize;
        for &b in tensor_bytes {
            let start = align_up(end, alignment);
            offsets.push(start);
            end = start
                .checked_add(b)
                .ok_or_else(|| CoreError::Config("expert block size overflows".into()))?;
        }
        let expert_bytes = align_up(end, alignment);
        num_layers
            .checked_mul(num_experts)
            .and_then(|n| n.checked_mul(expert_bytes))
            .ok_or_else(|| CoreError::Config("pool size overflows".into()))?;
        Ok(Self {
            num_layers,
            num_experts,
            tensor_bytes: tensor_bytes.to_vec(),
            tensor_offsets: offsets,
            alignment,
            expert_bytes,
        })
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.num_layers
    }
    /// Experts per layer.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }
    /// Tensors per expert.
    pub fn num_tensors(&self) -> usize {
        self.tensor_bytes.len()
    }
    /// Byte size of tensor `t` of any expert.
    pub fn tensor_bytes(&self, t: usize) -> usize {
        self.tensor_bytes[t]
    }
    /// Tensor alignment.
    pub fn alignment(&self) -> usize {
        self.alignment
    }
    /// Block stride (also the device slot stride).
    pub fn expert_bytes(&self) -> usize {
        self.expert_bytes
    }
    /// Size of the whole region.
    pub fn total_bytes(&self) -> usize {
        self.num_layers * self.num_experts * self.expert_bytes
    }

    /// Checks (layer, expert) is in range.
    pub fn check(&self, layer: usize, expert: usize) -> Result<()> {
        if layer >= self.num_layers || expert >= self.num_experts {
            return Err(CoreError::Config(format!(
                "(layer {layer}, expert {expert}) out of range ({} layers x {} experts)",
                self.num_layers, self.num_experts
            )));
        }
        Ok(())
    }

    /// Offset of tensor `t` inside a block; errors when `t` is out of range.
    pub fn tensor_offset(&self, t: usize) -> Result<usize> {
        self.tensor_offsets.get(t).copied().ok_or_else(|| {
            CoreError::Config(format!(
                "tensor {t} out of range ({} tensors)",
                self.num_tensors()
            ))
        })
    }

    /// Offset of the block of (layer, expert) in the region.
    pub fn block_offset(&self, layer: usize, expert: usize) -> Result<usize> {
        self.check(layer, expert)?;
        Ok((layer * self.num_experts + expert) * self.expert_bytes)
    }

    /// Offset of (layer, expert, tensor) in the region.
    pub fn offset(&self, layer: usize, expert: usize, tensor: usize) -> Result<usize> {
        Ok(self.block_offset(layer, expert)? + self.tensor_offset(tensor)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn tensors_are_back_to_back_and_aligned() {
        let l = ExpertLayout::new(2, 3, &[100, 300, 256], 256).unwrap();
        assert_eq!(l.tensor_offset(0).unwrap(), 0);
        assert_eq!(l.tensor_offset(1).unwrap(), 256);
        assert_eq!(l.tensor_offset(2).unwrap(), 768);
        assert_eq!(l.expert_bytes(), 1024);
        assert_eq!(l.total_bytes(), 6 * 1024);
        assert_eq!(l.offset(1, 2, 1).unwrap(), 5 * 1024 + 256);
    }

    #[test]
    fn out_of_range_and_bad_arguments_are_config_errors() {
        let l = ExpertLayout::new(1, 1, &[8], 256).unwrap();
        assert!(matches!(l.offset(1, 0, 0), Err(CoreError::Config(_))));
        assert!(matches!(l.offset(0, 0, 1), Err(CoreError::Config(_))));
        assert!(ExpertLayout::new(0, 1, &[8], 256).is_err());
        assert!(ExpertLayout::new(1, 1, &[], 256).is_err());
        assert!(ExpertLayout::new(1, 1, &[8], 100).is_err());
    }

    proptest! {
        #[test]
        fn tensors_never_overlap_are_aligned_and_fit(
            layers in 1usize..5, experts in 1usize..9,
            sizes in proptest::collection::vec(1usize..5000, 1..5),
            align_pow in 0u32..13,
        ) {
            let align = 1usize << align_pow;
            let l = ExpertLayout::new(layers, experts, &sizes, align).unwrap();
            let mut spans = Vec::new();
            for layer in 0..layers {
                for e in 0..experts {
                    let block = l.block_offset(layer, e).unwrap();
                    prop_assert_eq!(block % align, 0);
                    for (t, &size) in sizes.iter().enumerate() {
                        let o = l.offset(layer, e, t).unwrap();
                        prop_assert_eq!(o % align, 0);
                        prop_assert!(o >= block && o + size <= block + l.expert_bytes());
                        prop_assert!(o + size <= l.total_bytes());
                        spans.push((o, o + size));
                    }
                }
            }
            spans.sort();
            for w in spans.windows(2) {
                prop_assert!(w[0].1 <= w[1].0, "overlap {:?}", w);
            }
        }
    }
}
