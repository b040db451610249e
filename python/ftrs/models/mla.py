"""deepseek_v3 (DeepSeek-V3/R1) and deepseek_v2 (DeepSeek-V2, V2-Lite,
Coder-V2-Lite) as data for the one decoder: multi-head latent attention (MLA), grouped routing
(v3: sigmoid scores with a correction bias; v2: softmax scores, greedy or within the best
groups), shared experts, and the first `first_k_dense_replace` layers dense.

MLA. Keys and values of every head come from one compressed latent per token: `c` (kv_lora_rank
channels, normed) and a rotary part `k_pe` shared by the heads. The paged KV cache keeps only
`[c | k_pe]` per token (one kv head of `kv_lora_rank + qk_rope_head_dim` channels), not the
expanded heads: the attention is computed in the latent space ("absorbed"). For head h with
`kv_b` rows `W_k[h]` (nope keys) and `W_v[h]` (values):
    q_nope·(W_k[h] c) + q_pe·k_pe = (W_k[h]^T q_nope)·c + q_pe·k_pe
    sum_j p_j W_v[h] c_j = W_v[h] (sum_j p_j c_j)
so each head's query is `[W_k[h]^T q_nope | q_pe]` against the cached rows as keys, the same
rows are the values, and the first kv_lora_rank channels of the result go through `W_v[h]`.
This is one multi-query attention over the paged cache (`layers.attention.paged_attention`,
kv_heads = 1), exact in chunked prefill and decode; the sums run in another order than the
expanded form's, so it agrees with transformers to fp32 rounding, not bit for bit.

DeepSeek's rotary channels come in interleaved pairs (v3's `rope_interleave`, the default; v2
rotates them as complex numbers): they are de-interleaved (evens, then odds) before the
rotate-half rotation, as transformers does for v3, on q and k alike, so their dot products are
those of the reference (v2's complex product keeps the pairs in place: the same products).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ftrs.errors import ModelLoadError
from ftrs.layers.attention import AttnMetadata, paged_attention
from ftrs.layers.linear import linear
from ftrs.layers.moe import GROUPED_SIGMOID, GROUPED_SOFTMAX
from ftrs.layers.rotary import rotate
from ftrs.quant.formats import QuantTensor

if TYPE_CHECKING:
    from ftrs.models.arch import ArchSpec
    from ftrs.models.decoder import Decoder, KVCache, Rope



@dataclass(frozen=True)
class MlaSpec:
    """Shapes of an MLA layer (the HF config's fields) and its softmax scale."""

    q_lora_rank: int  # 0: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Channels a token keeps in the KV cache: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def _mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def deepseek_fields(cfg: dict[str, Any], arch: str, layers: int,
                    scaling: dict[str, Any] | None, source: str) -> dict[str, Any]:
    """The `ArchSpec` fields of a deepseek_v2, deepseek_v3 or glm4_moe_lite config (shapes
    checked, names in the error)."""
    def need(key: str) -> int:
        v = cfg.get(key)
        if not isinstance(v, int) or v < 1:
            raise ModelLoadError(source, f"{arch} needs a positive {key!r}, got {v!r}")
        return v

    kv_rank, nope, rope, vdim = (need(k) for k in ("kv_lora_rank", "qk_nope_head_dim",
                                                    "qk_rope_head_dim", "v_head_dim"))
    q_rank = cfg.get("q_lora_rank") or 0
    if rope % 2:
        raise ModelLoadError(source, f"qk_rope_head_dim {rope} is odd")
    scale = (nope + rope) ** -0.5
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind == "yarn" and scaling is not None and scaling.get("mscale_all_dim"):
        m = _mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale = scale * m * m  # the softmax scale of every channel, as the reference
    experts, top_k = need("n_routed_experts"), need("num_experts_per_tok")
    router = _router(cfg, arch, source)
    grouped = router == GROUPED_SIGMOID or cfg.get("topk_method") == "group_limited_greedy"
    n_group = int(cfg.get("n_group") or 1) if grouped else 1
    topk_group = int(cfg.get("topk_group") or 1) if grouped else 1
    if experts % n_group or not 1 <= topk_group <= n_group or top_k > experts:
        raise ModelLoadError(source, f"bad {arch} routing: {experts} experts in {n_group} "
                             f"groups, top-{topk_group} groups, top-{top_k} experts")
    if router == GROUPED_SIGMOID and experts // n_group < 2:
        raise ModelLoadError(source, f"{arch} groups need two experts each (a group's score "
                             "is its top two)")
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    moe_layers = tuple(i for i in range(first_dense, layers) if i % freq == 0)
    kinds = cfg.get("mlp_layer_types")  # glm4_moe_lite's spelling: "dense" / "sparse" a layer
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != layers or set(kinds) - {"dense", "sparse"}:
            raise ModelLoadError(source, f"mlp_layer_types must list {layers} of 'dense' or "
                                 f"'sparse', got {kinds!r}")
        moe_layers = tuple(i for i, k in enumerate(kinds) if k == "sparse")
    moe_inter = need("moe_intermediate_size")
    return {
        "mla": MlaSpec(int(q_rank), kv_rank, nope, rope, vdim, scale,
                       bool(cfg.get("rope_interleave", True))),
        "num_kv_heads": 1, "head_dim": kv_rank + rope, "rotary_dim": rope,
        "num_experts": experts, "top_k": top_k, "moe_intermediate_size": moe_inter,
        "moe_layers": moe_layers,
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", arch != "deepseek_v2")),
        "router": router, "router_groups": (n_group, topk_group),
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
        "shared_expert_intermediate_size": moe_inter * int(cfg.get("n_shared_experts") or 0),
        "qk_norm": False,
    }


def _router(cfg: dict[str, Any], arch: str, source: str) -> str:
    """deepseek_v3 routes by sigmoid scores (`noaux_tc`), deepseek_v2 by softmax (`greedy`, or
    `group_limited_greedy` within the best groups); anything else is named."""
    v3 = arch != "deepseek_v2"  # deepseek_v3, and glm4_moe_lite (GLM-4.7-Flash) built as it
    method = cfg.get("topk_method", "noaux_tc" if v3 else "greedy")
    scoring = cfg.get("scoring_func", "sigmoid" if v3 else "softmax")
    if v3 and (method, scoring) == ("noaux_tc", "sigmoid"):
        return GROUPED_SIGMOID
    if arch == "deepseek_v2" and method in ("greedy", "group_limited_greedy") and scoring == "softmax":
        return GROUPED_SOFTMAX
    raise ModelLoadError(source, f"unsupported {arch} routing topk_method={method!r} "
                         f"scoring_func={scoring!r}")


def mla_shapes(s: ArchSpec, p: str) -> dict[str, tuple[int, ...]]:
    """The dense tensors of one MLA layer by decoder key."""
    m, h = s.mla, s.hidden_size
    assert m is not None
    heads = s.num_heads
    out = {p + "kv_a": (m.cache_dim, h), p + "kv_a_norm": (m.kv_lora_rank,),
           p + "kv_b": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
           p + "o": (h, heads * m.v_head_dim)}
    if m.q_lora_rank:
        return out | {p + "q_a": (m.q_lora_rank, h), p + "q_a_norm": (m.q_lora_rank,),
                      p + "q_b": (heads * m.qk_head_dim, m.q_lora_rank)}
    return out | {p + "q": (heads * m.qk_head_dim, h)}


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary pairs (x0, x1), (x2, x3), ... -> evens then odds (rotate-half's layout)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _kv_b(dec: Decoder, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s kv_b split per head into (W_k (H, nope, rank), W_v (H, v, rank)) in the
    compute dtype, made once (a quantized kv_b is dequantized here, once)."""
    got = dec.mla_kv_b.get(layer)
    if got is None:
        m = dec.spec.mla
        assert m is not None
        w = dec.w[f"{layer}.kv_b"]
        if isinstance(w, QuantTensor):
            from ftrs.quant.dequant import dequantize

            w = dequantize(w, dec.dtype)
        w = w.to(dec.dtype).view(dec.spec.num_heads, m.qk_nope_head_dim + m.v_head_dim,
                                 m.kv_lora_rank)
        got = dec.mla_kv_b[layer] = (w[:, :m.qk_nope_head_dim].contiguous(),
                                     w[:, m.qk_nope_head_dim:].contiguous())
    return got


def mla_attention(dec: Decoder, layer: int, x: torch.Tensor, rope: Rope, meta: AttnMetadata,
                  kv: KVCache) -> torch.Tensor:
    """One MLA layer's output for the step's rows (see the module doc)."""
    s, w, p = dec.spec, dec.w, f"{layer}."
    m = s.mla
    assert m is not None and rope.table is not None
    t, heads = x.shape[0], s.num_heads
    if m.q_lora_rank:
        qa = dec.norm(linear(x, w[p + "q_a"]), w[p + "q_a_norm"], s.rms_norm_eps)[0]
        q = linear(qa, w[p + "q_b"])
    else:
        q = linear(x, w[p + "q"])
    q_nope, q_pe = q.view(t, heads, m.qk_head_dim).split([m.qk_nope_head_dim,
                                                          m.qk_rope_head_dim], dim=-1)
    c, k_pe = linear(x, w[p + "kv_a"]).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
    c = dec.norm(c.contiguous(), w[p + "kv_a_norm"], s.rms_norm_eps)[0]
    k_pe = k_pe.reshape(t, 1, m.qk_rope_head_dim)
    if m.rope_interleave:
        q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
    q_pe, k_pe = rotate(q_pe, *rope.table), rotate(k_pe, *rope.table)
    w_k, w_v = _kv_b(dec, layer)
    q_lat = torch.einsum("thn,hnc->thc", q_nope, w_k)  # (t, H, rank)
    query = torch.cat((q_lat, q_pe), dim=-1)
    key = torch.cat((c.view(t, 1, m.kv_lora_rank), k_pe), dim=-1)  # (t, 1, cache_dim)
    i = dec.cache_index[layer]
    latent, _, scale, _ = kv.layer(i)  # keys and values: one tensor
    o = paged_attention(query, key, key, latent, latent, meta, m.softmax_scale,
                        decode=dec.kernels.decode_attention, k_scale=scale, v_scale=scale)
    out = torch.einsum("thc,hvc->thv", o[..., :m.kv_lora_rank], w_v)  # (t, H, v)
    return linear(out.reshape(t, heads * m.v_head_dim), w[p + "o"], w.get(p + "o_bias"))
