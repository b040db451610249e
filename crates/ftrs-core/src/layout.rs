//! Where every expert tensor lives in the host pool.
//!
//! The pool is one region. Each (layer, expert) owns ONE contiguous block (so a single copy
//! moves a whole expert into a device slot); inside a block the tensors (e.g. gate, up, down)
//! sit back to back, each starting at a multiple of `alignment`. Tensor sizes may differ from
//! layer to layer (a `Q4_K_M` GGUF stores some layers' `down` in Q6_K and the others in Q4_K),
//! so each layer has its own tensor offsets and block size: a block is exactly its layer's
//! tensors, aligned, and the pool is the file's expert bytes plus alignment padding.
//!
//! Blocks are laid out layer-major: the blocks of layer `l` start at `layer_start[l]` (the sum of
//! the earlier layers' `num_experts * block_bytes`) and follow each other at that layer's
//! `block_bytes`. Every block size is a multiple of `alignment`, so every block start is aligned.
//! `expert_bytes` is the largest block: the stride of the device slots, any of which may hold
//! an expert of any layer (a copy moves only its block's own bytes).

use crate::error::{CoreError, Result};

/// Rounds `x` up to a multiple of `align` (a power of two).
pub(crate) fn align_up(x: usize, align: usize) -> usize {
    debug_assert!(align.is_power_of_two());
    (x + align - 1) & !(align - 1)
}

/// The tensors of one layer's experts.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LayerLayout {
    /// Byte size of each tensor of an expert of this layer; non-empty, each > 0.
    tensor_bytes: Vec<usize>,
    /// Offset of each tensor inside a block; multiples of `alignment`, increasing, no overlap.
    tensor_offsets: Vec<usize>,
    /// Stride between this layer's blocks; a multiple of `alignment`, = aligned end of the last
    /// tensor.
    block_bytes: usize,
    /// Offset of this layer's first block in the region; a multiple of `alignment`.
    start: usize,
}

/// The offsets of every (layer, expert, tensor) in one host region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertLayout {
    /// Routed experts per layer; > 0.
    num_experts: usize,
    /// One entry per MoE layer; non-empty, every layer with the same number of tensors.
    layers: Vec<LayerLayout>,
    /// Alignment of every tensor start; a power of two.
    alignment: usize,
    /// The largest `block_bytes` of any layer: the device slot stride.
    expert_bytes: usize,
    /// Size of the region: end of the last layer's blocks.
    total_bytes: usize,
}

impl ExpertLayout {
    /// A layout whose layers all hold the same tensor sizes; errors as [`Self::per_layer`].
    pub fn new(
        num_layers: usize,
        num_experts: usize,
        tensor_bytes: &[usize],
        alignment: usize,
    ) -> Result<Self> {
        if num_layers == 0 {
            return Err(CoreError::Config(format!(
                "layout needs at least one layer and one expert, got {num_layers} x {num_experts}"
            )));
        }
        Self::per_layer(
            num_experts,
            &vec![tensor_bytes.to_vec(); num_layers],
            alignment,
        )
    }

    /// A layout with each layer's own tensor sizes (`layers[l][t]`: bytes of tensor `t` of an
    /// expert of layer `l`). Errors on zero counts, empty/zero tensor sizes, layers with
    /// different tensor counts, a non-power-of-two alignment or a total that overflows `usize`.
    pub fn per_layer(num_experts: usize, layers: &[Vec<usize>], alignment: usize) -> Result<Self> {
        if layers.is_empty() || num_experts == 0 {
            return Err(CoreError::Config(format!(
                "layout needs at least one layer and one expert, got {} x {num_experts}",
                layers.len()
            )));
        }
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(CoreError::Config(format!(
                "alignment must be a power of two, got {alignment}"
            )));
        }
        let overflow = || CoreError::Config("pool size overflows".into());
        let mut out = Vec::with_capacity(layers.len());
        let mut start = 0usize;
        for (l, tensor_bytes) in layers.iter().enumerate() {
            if tensor_bytes.is_empty() || tensor_bytes.contains(&0) {
                return Err(CoreError::Config(format!(
                    "tensor sizes must be non-empty and positive, got {tensor_bytes:?} in layer {l}"
                )));
            }
            if tensor_bytes.len() != layers[0].len() {
                return Err(CoreError::Config(format!(
                    "layer {l} has {} tensors per expert, layer 0 has {}",
                    tensor_bytes.len(),
                    layers[0].len()
                )));
            }
            let mut offsets = Vec::with_capacity(tensor_bytes.len());
            let mut end = 0usize;
            for &b in tensor_bytes {
                let at = align_up(end, alignment);
                offsets.push(at);
                end = at.checked_add(b).ok_or_else(overflow)?;
            }
            let block_bytes =
                end.checked_add(alignment - 1).ok_or_else(overflow)? & !(alignment - 1);
            let span = block_bytes.checked_mul(num_experts).ok_or_else(overflow)?;
            out.push(LayerLayout {
                tensor_bytes: tensor_bytes.clone(),
                tensor_offsets: offsets,
                block_bytes,
                start,
            });
            start = start.checked_add(span).ok_or_else(overflow)?;
        }
        let expert_bytes = out.iter().map(|l| l.block_bytes).max().unwrap_or(0);
        Ok(Self {
            num_experts,
            layers: out,
            alignment,
            expert_bytes,
            total_bytes: start,
        })
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }
    /// Experts per layer.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }
    /// Tensors per expert.
    pub fn num_tensors(&self) -> usize {
        self.layers[0].tensor_bytes.len()
    }
    /// Tensor alignment.
    pub fn alignment(&self) -> usize {
        self.alignment
    }
    /// The largest block of any layer: the device slot stride.
    pub fn expert_bytes(&self) -> usize {
        self.expert_bytes
    }
    /// Size of the whole region.
    pub fn total_bytes(&self) -> usize {
        self.total_bytes
    }
    /// Whether every layer has the same tensor sizes.
    pub fn is_uniform(&self) -> bool {
        self.layers
            .iter()
            .all(|l| l.tensor_bytes == self.layers[0].tensor_bytes)
    }

    fn layer(&self, layer: usize) -> Result<&LayerLayout> {
        self.layers.get(layer).ok_or_else(|| {
            CoreError::Config(format!(
                "layer {layer} out of range ({} layers)",
                self.layers.len()
            ))
        })
    }

    /// Checks (layer, expert) is in range.
    pub fn check(&self, layer: usize, expert: usize) -> Result<()> {
        if layer >= self.layers.len() || expert >= self.num_experts {
            return Err(CoreError::Config(format!(
                "(layer {layer}, expert {expert}) out of range ({} layers x {} experts)",
                self.layers.len(),
                self.num_experts
            )));
        }
        Ok(())
    }

    /// Size of one block of `layer` (its tensors, aligned): what a copy of one of its experts
    /// moves.
    pub fn block_bytes(&self, layer: usize) -> Result<usize> {
        Ok(self.layer(layer)?.block_bytes)
    }

    /// Byte size of tensor `t` of an expert of `layer`.
    pub fn tensor_bytes(&self, layer: usize, t: usize) -> Result<usize> {
        self.layer(layer)?
            .tensor_bytes
            .get(t)
            .copied()
            .ok_or_else(|| {
                CoreError::Config(format!(
                    "tensor {t} out of range ({} tensors)",
                    self.num_tensors()
                ))
            })
    }

    /// Offset of tensor `t` inside a block of `layer` (and inside a device slot holding one).
    pub fn tensor_offset(&self, layer: usize, t: usize) -> Result<usize> {
        self.layer(layer)?
            .tensor_offsets
            .get(t)
            .copied()
            .ok_or_else(|| {
                CoreError::Config(format!(
                    "tensor {t} out of range ({} tensors)",
                    self.num_tensors()
                ))
            })
    }

    /// Offset of the block of (layer, expert) in the region.
    pub fn block_offset(&self, layer: usize, expert: usize) -> Result<usize> {
        self.check(layer, expert)?;
        let l = &self.layers[layer];
        Ok(l.start + expert * l.block_bytes)
    }

    /// Offset of (layer, expert, tensor) in the region.
    pub fn offset(&self, layer: usize, expert: usize, tensor: usize) -> Result<usize> {
        Ok(self.block_offset(layer, expert)? + self.tensor_offset(layer, tensor)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn tensors_are_back_to_back_and_aligned() {
        let l = ExpertLayout::new(2, 3, &[100, 300, 256], 256).unwrap();
        assert_eq!(l.tensor_offset(0, 0).unwrap(), 0);
        assert_eq!(l.tensor_offset(1, 1).unwrap(), 256);
        assert_eq!(l.tensor_offset(0, 2).unwrap(), 768);
        assert_eq!(l.expert_bytes(), 1024);
        assert_eq!(l.total_bytes(), 6 * 1024);
        assert_eq!(l.offset(1, 2, 1).unwrap(), 5 * 1024 + 256);
        assert!(l.is_uniform());
    }

    #[test]
    fn each_layer_gets_blocks_of_its_own_size() {
        // layer 0: 100 + 300 -> 256 + 512 = 768; layer 1: 100 + 600 -> 256 + 768 = 1024
        let l = ExpertLayout::per_layer(2, &[vec![100, 300], vec![100, 600]], 256).unwrap();
        assert!(!l.is_uniform());
        assert_eq!(l.block_bytes(0).unwrap(), 768);
        assert_eq!(l.block_bytes(1).unwrap(), 1024);
        assert_eq!(l.expert_bytes(), 1024);
        assert_eq!(l.total_bytes(), 2 * 768 + 2 * 1024);
        assert_eq!(l.block_offset(0, 1).unwrap(), 768);
        assert_eq!(l.block_offset(1, 0).unwrap(), 1536);
        assert_eq!(l.offset(1, 1, 1).unwrap(), 1536 + 1024 + 256);
        assert_eq!(l.tensor_bytes(0, 1).unwrap(), 300);
        assert_eq!(l.tensor_bytes(1, 1).unwrap(), 600);
    }

    #[test]
    fn out_of_range_and_bad_arguments_are_config_errors() {
        let l = ExpertLayout::new(1, 1, &[8], 256).unwrap();
        assert!(matches!(l.offset(1, 0, 0), Err(CoreError::Config(_))));
        assert!(matches!(l.offset(0, 0, 1), Err(CoreError::Config(_))));
        assert!(matches!(l.block_bytes(1), Err(CoreError::Config(_))));
        assert!(ExpertLayout::new(0, 1, &[8], 256).is_err());
        assert!(ExpertLayout::new(1, 1, &[], 256).is_err());
        assert!(ExpertLayout::new(1, 1, &[8], 100).is_err());
        assert!(ExpertLayout::per_layer(1, &[vec![8], vec![8, 8]], 256).is_err());
        assert!(ExpertLayout::per_layer(1, &[], 256).is_err());
        assert!(ExpertLayout::per_layer(0, &[vec![8]], 256).is_err());
    }

    proptest! {
        #[test]
        fn tensors_never_overlap_are_aligned_and_fit(
            experts in 1usize..9,
            layers in proptest::collection::vec(
                proptest::collection::vec(1usize..5000, 3), 1..5),
            align_pow in 0u32..13,
        ) {
            let align = 1usize << align_pow;
            let l = ExpertLayout::per_layer(experts, &layers, align).unwrap();
            let mut spans = Vec::new();
            let mut payload = 0;
            for (layer, sizes) in layers.iter().enumerate() {
                let block_bytes = l.block_bytes(layer).unwrap();
                prop_assert!(block_bytes <= l.expert_bytes());
                prop_assert_eq!(block_bytes % align, 0);
                for e in 0..experts {
                    let block = l.block_offset(layer, e).unwrap();
                    prop_assert_eq!(block % align, 0);
                    for (t, &size) in sizes.iter().enumerate() {
                        let o = l.offset(layer, e, t).unwrap();
                        prop_assert_eq!(o % align, 0);
                        prop_assert!(o >= block && o + size <= block + block_bytes);
                        prop_assert!(o + size <= l.total_bytes());
                        spans.push((o, o + size));
                        payload += size;
                    }
                }
            }
            // exact: the payload plus at most (align - 1) bytes of padding per tensor
            prop_assert!(l.total_bytes() < payload + spans.len() * align);
            spans.sort();
            for w in spans.windows(2) {
                prop_assert!(w[0].1 <= w[1].0, "overlap {:?}", w);
            }
        }
    }
}
