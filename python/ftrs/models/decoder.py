"""The one generic decoder: llama, qwen3, mixtral, qwen3_moe, qwen3_5_moe, qwen3_next, gpt_oss,
deepseek_v2, deepseek_v3, glm4_moe and minimax_m2 differ only in their ArchSpec (the DeepSeek
MLA layers: `models.mla`; GLM-4.5 and MiniMax-M2: `models.sigmoid_moe`).

A forward pass takes the flattened tokens of a whole batch (decode tokens and prefill chunks
mixed), their absolute positions, and the attention metadata that says where each token's
keys go in the paged KV cache (and, for linear attention layers, which state slot each
sequence's rows use). Dense weights live in a dict keyed by `names.map_hf_name`; routed
experts are computed by the MoE strategy, which the decoder never looks inside.

Each layer is `h += mixer(norm(h)); h += mlp(norm(h))`. The token mixer is chosen per layer by
`spec.layer_type(layer)` from `MIXERS`: a new kind of layer is one more entry there, with its
weights named in `names` and its shapes in `safetensors_loader.expected_dense_shapes`.
"full_attention" sees the whole causal context, "sliding_attention" the last `sliding_window`
positions; either may add attention sinks (`spec.attention_sinks`, the layer's `sinks` weight).
Biases are used wherever the checkpoint has them (q, k, v, o, router).

The ops with a kernel go through the `Kernels` the runtime chose (`ftrs.kernels`), decided once
per model in `__init__`, never per step:
- every norm is `kernels.rms_norm` with the residual add fused into it: the layer's output is
  added to `h` by the next norm (`x, h = norm(out, w, eps, residual=h)`), the same `h + out` the
  loop did before, so the torch references give today's numbers bit for bit. The zero-centred
  norms of the Gated DeltaNet hybrids have no kernel: they keep the torch norm (same signature);
- rotary runs in place on q and k through `kernels.rotary_` on the Triton and CPU paths when
  every channel rotates; partial rotary, and the torch path, keep `layers.rotary.rotate` with
  the table gathered once per forward (the reference's math bit for bit);
- on the Triton path, full-attention layers without sinks write K/V at the slot mapping and
  call the paged attention kernel over the block tables of `meta.paged`; sliding-window and
  sink layers, linear attention layers and the other paths keep `layers.attention`, whose
  decode rows the CPU path computes through `kernels.decode_attention` (one Rust call).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ftrs.kernels import Kernels, select_kernels
from ftrs.kvcache import quant as kvquant
from ftrs.kvcache.state import StateCache
from ftrs.layers.attention import AttnMetadata, paged_attention
from ftrs.layers.deltanet import gated_deltanet
from ftrs.layers.linear import embedding, linear, linears
from ftrs.layers.moe import Router, route_by
from ftrs.layers.norm import rms_norm
from ftrs.layers.rotary import Rotary, rotate
from ftrs.models.arch import FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION, ArchSpec
from ftrs.models.mla import mla_attention
from ftrs.moe.base import MoEStrategy
from ftrs.quant.matmul import Weight


@dataclass(slots=True)
class KVCache:
    """Keys and values of the full attention layers: (attention layers, num_slots, kv_heads,
    head_dim), the i-th attention layer of the model at index i; with `--kv-cache-dtype int8`
    int8 rows and their fp32 scales (attention layers, num_slots, kv_heads), else None
    (`kvcache/quant.py`); and the state of the linear attention layers, when the model has any."""

    k: torch.Tensor
    v: torch.Tensor
    state: StateCache | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @classmethod
    def allocate(cls, spec: ArchSpec, num_slots: int, dtype: torch.dtype,
                 device: torch.device, state_slots: int = 0,
                 kv_cache_dtype: str = "auto") -> KVCache:
        shape = (len(spec.kv_layers), num_slots, spec.num_kv_heads, spec.head_dim)
        state = (StateCache.allocate(spec, state_slots, dtype, device)
                 if spec.has_linear_attention else None)
        quantized = kv_cache_dtype == "int8"
        store = torch.int8 if quantized else dtype

        def tensors() -> tuple[torch.Tensor, torch.Tensor | None]:
            return (torch.zeros(shape, dtype=store, device=device),
                    torch.zeros(shape[:-1], dtype=torch.float32, device=device)
                    if quantized else None)

        k, k_scale = tensors()
        # MLA keeps one latent row a token, its keys and its values: one tensor for both
        v, v_scale = (k, k_scale) if spec.mla is not None else tensors()
        return cls(k, v, state, k_scale, v_scale)

    def nbytes(self) -> int:
        """Bytes of keys, values and their scales (MLA's one latent tensor counted once)."""
        parts = {id(t): t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None}
        return sum(t.numel() * t.element_size() for t in parts.values())

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                     torch.Tensor | None]:
        """Attention layer `i`'s (keys, values, key scales, value scales)."""
        ks, vs = self.k_scale, self.v_scale
        return (self.k[i], self.v[i], None if ks is None else ks[i],
                None if vs is None else vs[i])


@dataclass(slots=True)
class Rope:
    """One forward's rotary inputs: positions, and on the torch path the cos and signed sin of
    each token (`Rotary.table`), gathered once for every layer."""

    positions: torch.Tensor  # (tokens,) int64
    table: tuple[torch.Tensor, torch.Tensor] | None  # None: the kernel rotates from positions


Norm = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def rms_norm_plus_one(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The zero-centred norm (scale `1 + w`) in `Kernels.rms_norm`'s signature: no kernel
    covers it, so it stays the torch norm, with the residual add in front as the kernel does."""
    if residual is not None:
        x = residual + x
    return rms_norm(x, weight, eps, plus_one=True), (x if residual is not None else None)


def layer_router(weights: Mapping[str, Any], layer: int) -> Router:
    """MoE layer `layer`'s router in the decoder's `weights`, with the biases it has (what
    `layers.moe.route_by` routes with; the prefetch ranker gets the same)."""
    p = f"{layer}."
    return Router(weights[p + "router"], weights.get(p + "router_bias"),
                  weights.get(p + "router_correction"))


class Decoder:
    """Forward pass of a decoder-only transformer over a paged KV cache."""

    def __init__(self, spec: ArchSpec, weights: Mapping[str, Weight], moe: MoEStrategy | None,
                 device: torch.device, dtype: torch.dtype, kernels: Kernels | None = None) -> None:
        """`kernels`: the ops `select_kernels` chose (the runtime's); None: the torch references."""
        self.spec = spec
        self.w: Mapping[str, Any] = weights  # projections may be QuantTensors
        self.moe = moe
        self.device = device
        self.dtype = dtype
        #: monotonic time the last layer was computed (queued, on a GPU): a long step is alive
        self.progress_at = time.monotonic()
        self.rotary = Rotary(spec.rotary_dim or spec.head_dim, spec.rope_theta,
                             spec.max_position_embeddings, spec.rope_scaling, device)
        self.scale = spec.head_dim ** -0.5
        self.lm_head = weights["embed"] if spec.tie_word_embeddings else weights["lm_head"]
        # per layer: its token mixer and its row in its cache (KV for attention of either
        # window, state for linear attention)
        self.mixers = [mla_attention if spec.mla is not None else MIXERS[spec.layer_type(i)]
                       for i in range(spec.num_layers)]
        self.mla_kv_b: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # `models.mla`
        self.cache_index = [(spec.layers_of(LINEAR_ATTENTION) if spec.layer_type(i) == LINEAR_ATTENTION
                             else spec.kv_layers).index(i) for i in range(spec.num_layers)]
        k = self.kernels = kernels if kernels is not None else select_kernels("torch", device)
        triton = k.name == "triton"
        self.norm: Norm = rms_norm_plus_one if spec.norm_plus_one else k.rms_norm
        # in place on q and k from the fp32 tables; the kernels rotate whole heads only
        full_rotary = spec.rotary_dim in (0, spec.head_dim)
        self.rotary_ = k.rotary_ if k.rotates_in_place and full_rotary else None
        # per layer: attention through the paged kernel (no window, no sinks: it has neither)
        self.paged_kernel = [triton and spec.layer_type(i) == FULL_ATTENTION and spec.mla is None
                             and not spec.attention_sinks for i in range(spec.num_layers)]
        # the norm each layer's MLP output is added in front of: the next layer's input norm
        self.next_norm = [f"{i + 1}.input_norm" for i in range(spec.num_layers - 1)] + ["norm"]
        #: the batches must carry block tables (`AttnMetadata.paged`)
        self.uses_paged_kernel = any(self.paged_kernel)

    def _add_norm(self, out: torch.Tensor, h: torch.Tensor, key: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """`h + out` (the residual add the layer loop did) and its norm under `key`, in one op:
        (normed, new h)."""
        x, total = self.norm(out, self.w[key], self.spec.rms_norm_eps, residual=h)
        assert total is not None  # a norm given a residual returns the sum
        return x, total

    def _attention(self, layer: int, x: torch.Tensor, rope: Rope, meta: AttnMetadata,
                   kv: KVCache) -> torch.Tensor:
        s, w, p = self.spec, self.w, f"{layer}."
        t = x.shape[0]
        q, k, v = linears(x, (w[p + "q"], w[p + "k"], w[p + "v"]),
                          (w.get(p + "q_bias"), w.get(p + "k_bias"), w.get(p + "v_bias")))
        gate = None
        if s.attn_output_gate:  # per head: [query | gate of the output]
            q, gate = q.view(t, s.num_heads, 2 * s.head_dim).split(s.head_dim, dim=-1)
        q = q.view(t, s.num_heads, s.head_dim)
        k = k.view(t, s.num_kv_heads, s.head_dim)
        v = v.view(t, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q = self.norm(q, w[p + "q_norm"], s.rms_norm_eps)[0]
            k = self.norm(k, w[p + "k_norm"], s.rms_norm_eps)[0]
        elif s.qk_norm_full:  # one norm over every head's channels, then the heads again
            q = self.norm(q.reshape(t, -1), w[p + "q_norm"], s.rms_norm_eps)[0].view(q.shape)
            k = self.norm(k.reshape(t, -1), w[p + "k_norm"], s.rms_norm_eps)[0].view(k.shape)
        if rope.table is None:
            assert self.rotary_ is not None
            self.rotary_(q, k, self.rotary.cos, self.rotary.sin, rope.positions)
        else:
            q = rotate(q, *rope.table)
            k = rotate(k, *rope.table)
        k_cache, v_cache, k_scale, v_scale = kv.layer(self.cache_index[layer])
        if self.paged_kernel[layer]:
            assert meta.paged is not None, "the Triton path needs block tables (build_batch paged=True)"
            kvquant.write(k_cache, k_scale, meta.slot_mapping, k)
            kvquant.write(v_cache, v_scale, meta.slot_mapping, v)
            o = self.kernels.paged_attention(q, k_cache, v_cache, meta.paged, self.scale,
                                             k_scale=k_scale, v_scale=v_scale)
        else:
            o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale,
                                sinks=w.get(p + "sinks"), window=s.window(layer),
                                decode=self.kernels.decode_attention, k_scale=k_scale,
                                v_scale=v_scale)
        o = o.reshape(t, s.num_heads * s.head_dim)
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(t, s.num_heads * s.head_dim))
        return linear(o, w[p + "o"], w.get(p + "o_bias"))

    def _linear_attention(self, layer: int, x: torch.Tensor, rope: Rope, meta: AttnMetadata,
                          kv: KVCache) -> torch.Tensor:
        s, i = self.spec, self.cache_index[layer]
        assert s.linear is not None and kv.state is not None and meta.linear is not None
        return gated_deltanet(x, self.w, f"{layer}.", s.linear, s.rms_norm_eps, meta.linear,
                              kv.state.conv[i], kv.state.recurrent[i])

    def router(self, layer: int) -> Router:
        return layer_router(self.w, layer)

    def _mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        s, w, p = self.spec, self.w, f"{layer}."
        if s.is_moe_layer(layer):
            assert self.moe is not None  # invariant: a MoE spec always gets a strategy
            ids, weights = route_by(s, self.router(layer), x)
            out = self.moe.forward(layer, x, ids, weights)
            if s.shared_expert_intermediate_size:  # dense, always resident
                shared = linear(F.silu(linear(x, w[p + "shared_gate"]))
                                * linear(x, w[p + "shared_up"]), w[p + "shared_down"])
                gate = w.get(p + "shared_expert_gate")  # the hybrids' sigmoid gate
                out = out + (shared if gate is None else torch.sigmoid(linear(x, gate)) * shared)
            return out
        return linear(F.silu(linear(x, w[p + "gate"])) * linear(x, w[p + "up"]), w[p + "down"])

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                kv: KVCache) -> torch.Tensor:
        """`input_ids`, `positions`: (tokens,) int64. Returns final hidden states (tokens, hidden)."""
        s, w = self.spec, self.w
        h = embedding(input_ids, w["embed"], self.dtype)
        rope = Rope(positions, None if self.rotary_ is not None
                    else self.rotary.table(positions, h.dtype))  # once for every layer
        if self.moe is not None:
            self.moe.begin_forward(num_tokens=int(input_ids.numel()))
        if kv.state is not None and meta.linear is not None:
            kv.state.reset(meta.linear.fresh_slots)
        x = self.norm(h, w["0.input_norm"], s.rms_norm_eps)[0]
        for layer in range(s.num_layers):
            x, h = self._add_norm(self.mixers[layer](self, layer, x, rope, meta, kv), h,
                                  f"{layer}.post_norm")
            x, h = self._add_norm(self._mlp(layer, x), h, self.next_norm[layer])
            self.progress_at = time.monotonic()  # the hang watchdog's sign of life
        if self.moe is not None:
            self.moe.end_forward()
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, hidden) -> (n, vocab) fp32."""
        return linear(hidden, self.lm_head).float()


Mixer = Callable[[Decoder, int, torch.Tensor, Rope, AttnMetadata, KVCache], torch.Tensor]
#: the token mixer of each layer kind (`ArchSpec.layer_types`)
MIXERS: dict[str, Mixer] = {
    FULL_ATTENTION: Decoder._attention,
    SLIDING_ATTENTION: Decoder._attention,
    LINEAR_ATTENTION: Decoder._linear_attention,
}
