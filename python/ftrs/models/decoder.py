"""The one generic decoder: llama, qwen3, mixtral, qwen3_moe and gpt_oss differ only in their
ArchSpec.

A forward pass takes the flattened tokens of a whole batch (decode tokens and prefill chunks
mixed), their absolute positions, and the attention metadata that says where each token's
keys go in the paged KV cache. Dense weights live in a dict keyed by `names.map_hf_name`;
routed experts are computed by the MoE strategy, which the decoder never looks inside.

Per layer the spec's `layer_type` picks the attention: "full_attention" sees the whole causal
context, "sliding_attention" the last `sliding_window` positions; either may add attention sinks
(`spec.attention_sinks`, the layer's `sinks` weight). Biases are used wherever the checkpoint
has them (q, k, v, o, router).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ftrs.layers.attention import AttnMetadata, paged_attention
from ftrs.layers.linear import embedding, linear
from ftrs.layers.moe import route
from ftrs.layers.norm import rms_norm
from ftrs.layers.rotary import Rotary, rotate
from ftrs.models.arch import ArchSpec
from ftrs.moe.base import MoEStrategy
from ftrs.quant.matmul import Weight


@dataclass(slots=True)
class KVCache:
    """Keys and values of every layer: (layers, num_slots, kv_heads, head_dim)."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, spec: ArchSpec, num_slots: int, dtype: torch.dtype,
                 device: torch.device) -> KVCache:
        shape = (spec.num_layers, num_slots, spec.num_kv_heads, spec.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device))


class Decoder:
    """Forward pass of a decoder-only transformer over a paged KV cache."""

    def __init__(self, spec: ArchSpec, weights: Mapping[str, Weight], moe: MoEStrategy | None,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.spec = spec
        self.w: Mapping[str, Any] = weights  # projections may be QuantTensors
        self.moe = moe
        self.device = device
        self.dtype = dtype
        self.rotary = Rotary(spec.head_dim, spec.rope_theta, spec.max_position_embeddings,
                             spec.rope_scaling, device)
        self.scale = spec.head_dim ** -0.5
        self.lm_head = weights["embed"] if spec.tie_word_embeddings else weights["lm_head"]

    def _attention(self, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   meta: AttnMetadata, kv: KVCache) -> torch.Tensor:
        s, w, p = self.spec, self.w, f"{layer}."
        t = x.shape[0]
        q = linear(x, w[p + "q"], w.get(p + "q_bias")).view(t, s.num_heads, s.head_dim)
        k = linear(x, w[p + "k"], w.get(p + "k_bias")).view(t, s.num_kv_heads, s.head_dim)
        v = linear(x, w[p + "v"], w.get(p + "v_bias")).view(t, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q = rms_norm(q, w[p + "q_norm"], s.rms_norm_eps)
            k = rms_norm(k, w[p + "k_norm"], s.rms_norm_eps)
        q = rotate(q, *rope)
        k = rotate(k, *rope)
        o = paged_attention(q, k, v, kv.k[layer], kv.v[layer], meta, self.scale,
                            sinks=w.get(p + "sinks"), window=s.window(layer))
        return linear(o.reshape(t, s.num_heads * s.head_dim), w[p + "o"], w.get(p + "o_bias"))

    def _mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        s, w, p = self.spec, self.w, f"{layer}."
        if s.is_moe_layer(layer):
            assert self.moe is not None  # invariant: a MoE spec always gets a strategy
            ids, weights = route(x, w[p + "router"], s.top_k, s.norm_topk_prob,
                                 w.get(p + "router_bias"), s.router)
            return self.moe.forward(layer, x, ids, weights)
        return linear(F.silu(linear(x, w[p + "gate"])) * linear(x, w[p + "up"]), w[p + "down"])

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                kv: KVCache) -> torch.Tensor:
        """`input_ids`, `positions`: (tokens,) int64. Returns final hidden states (tokens, hidden)."""
        s, w = self.spec, self.w
        h = embedding(input_ids, w["embed"], self.dtype)
        rope = self.rotary.table(positions, h.dtype)  # once for every layer
        if self.moe is not None:
            self.moe.begin_forward(num_tokens=int(input_ids.numel()))
        for layer in range(s.num_layers):
            p = f"{layer}."
            x = rms_norm(h, w[p + "input_norm"], s.rms_norm_eps)
            h = h + self._attention(layer, x, rope, meta, kv)
            x = rms_norm(h, w[p + "post_norm"], s.rms_norm_eps)
            h = h + self._mlp(layer, x)
        if self.moe is not None:
            self.moe.end_forward()
        return rms_norm(h, w["norm"], s.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, hidden) -> (n, vocab) fp32."""
        return linear(hidden, self.lm_head).float()
