"""ArchSpec: everything the generic decoder needs to know about an architecture.

One decoder serves llama, qwen3, mixtral, qwen3_moe, qwen3_5_moe, qwen3_next and gpt_oss. The
differences are data, read here from the Hugging Face `config.json`, accepting both spellings
seen in real files (`num_experts` / `num_local_experts`, top-level `rope_theta` /
`rope_parameters`, a multimodal config's `text_config`).

`layer_types` says what each layer's token mixer is, in HF's own words (`config.layer_types`):
"full_attention" (softmax attention over the paged KV cache), "sliding_attention" (causal, and
only the last `sliding_window` positions, the query's own included) or "linear_attention" (a
Gated DeltaNet with a per-sequence recurrent state). The MLP kind of a layer is `is_moe_layer`.
gpt_oss adds attention sinks (one learned logit per head that joins every softmax and is
dropped after it), a router with a bias that takes the softmax of the top-k logits only
(`router="topk_softmax"`), and experts with biases whose activation is a clamped SwiGLU
(`expert_act="swiglu_clamp"`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftrs.errors import ModelLoadError

if TYPE_CHECKING:  # models.mla imports the layers, which import this module
    from ftrs.models.mla import MlaSpec

SUPPORTED = ("llama", "qwen3", "mixtral", "qwen3_moe", "qwen3_5_moe", "qwen3_next", "gpt_oss",
             "deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "minimax_m2")
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)  # the hybrids' kinds
WINDOWED_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)  # the other architectures' kinds
QUANT_METHODS = ("fp8", "mxfp4", "modelopt", "compressed-tensors")
#: The one compressed-tensors scheme read: NVFP4 weights (llm-compressor's `NVFP4` presets)
CT_NVFP4 = "nvfp4-pack-quantized"
_HYBRID = ("qwen3_5_moe", "qwen3_next")  # Gated DeltaNet + gated attention + shared expert


@dataclass(frozen=True)
class LinearAttnSpec:
    """Shapes of a Gated DeltaNet layer (`linear_*` fields of the HF config)."""

    num_k_heads: int
    num_v_heads: int  # a multiple of num_k_heads: each q/k head serves a group of value heads
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int  # causal depthwise conv width; the conv state keeps the last kernel-1 inputs
    #: value heads in llama.cpp's tiled order (head j reads key head j mod num_k_heads), as its
    #: converter stores a Qwen3.5 GGUF; HF's order is grouped (head j reads key head j // group).
    #: Set by the GGUF reader through the config key `_v_heads_tiled`.
    v_heads_tiled: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class ArchSpec:
    """Shapes and per-architecture switches of one checkpoint."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # qwen3: RMSNorm on each head of q and k before RoPE
    qk_norm_full: bool = False  # minimax_m2: one RMSNorm over all heads' channels of q, of k
    attention_bias: bool = False  # q/k/v biases
    o_bias: bool = False  # and one on the output projection (all of them but GLM-4.5's)
    num_experts: int = 0  # 0: dense model
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to one
    moe_layers: tuple[int, ...] = ()  # indices of layers whose MLP is routed
    rope_scaling: dict[str, Any] | None = None
    fp8_block: tuple[int, int] | None = None  # FP8 checkpoint: the weight_scale_inv tile
    # NVFP4 checkpoint: "modelopt" (weight, weight_scale, weight_scale_2) or "compressed-tensors"
    # (weight_packed, weight_scale, weight_global_scale: its inverse); "" for none
    nvfp4: str = ""
    #: token mixer of each layer (HF's `config.layer_types` strings); () means all full attention
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0  # keys a "sliding_attention" query sees, its own included
    attention_sinks: bool = False  # gpt_oss: one learned logit per head in every softmax
    router: str = "softmax"  # "softmax" over all experts, or "topk_softmax" over the top-k logits
    expert_act: str = "silu"  # "silu": silu(gate)*up; "swiglu_clamp": gpt_oss (with biases)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    linear: LinearAttnSpec | None = None  # set when some layer is linear attention
    rotary_dim: int = 0  # partial rotary: the leading dims of each head rotated; 0: all of them
    attn_output_gate: bool = False  # q_proj also yields a per-channel sigmoid gate of the output
    norm_plus_one: bool = False  # RMSNorm weights stored centred on zero: scale by (1 + w)
    shared_expert_intermediate_size: int = 0  # >0: a dense expert beside the routed ones
    mla: MlaSpec | None = None  # deepseek_v3: multi-head latent attention (models.mla)
    router_groups: tuple[int, int] = (1, 1)  # grouped routing: (groups, groups kept)
    routed_scaling_factor: float = 1.0  # grouped routing: the routed experts' weights times it
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL_ATTENTION

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Indices of the layers whose token mixer is `kind`, ascending."""
        return tuple(i for i in range(self.num_layers) if self.layer_type(i) == kind)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep keys and values in the paged KV cache (full or sliding window)."""
        return tuple(i for i in range(self.num_layers) if self.layer_type(i) != LINEAR_ATTENTION)

    @property
    def has_linear_attention(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types

    def window(self, layer: int) -> int:
        """Keys a query of `layer` sees (0: the whole causal context)."""
        return self.sliding_window if self.layer_type(layer) == SLIDING_ATTENTION else 0

    @property
    def expert_bias(self) -> bool:
        return self.expert_act == "swiglu_clamp"

    @property
    def expert_shapes(self) -> list[tuple[int, int]]:
        """Shapes of the tensors of one routed expert: gate (I,H), up (I,H), down (H,I), and
        with expert biases their bias rows (1,I), (1,I), (1,H)."""
        i, h = self.moe_intermediate_size, self.hidden_size
        shapes = [(i, h), (i, h), (h, i)]
        return [*shapes, (1, i), (1, i), (1, h)] if self.expert_bias else shapes


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in (None, "default"):
            scaling = params
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return float(theta if theta is not None else 10000.0), scaling


def _check_compressed_tensors(qc: dict[str, Any], source: str) -> None:
    """A compressed-tensors `quantization_config` must be NVFP4 weights, packed, unsparse:
    every config group's weights 4-bit floats in groups of 16 with a global scale."""
    def refuse(what: str) -> ModelLoadError:
        return ModelLoadError(source, f"unsupported compressed-tensors checkpoint: {what} "
                              f"(supported: {CT_NVFP4}, NVFP4 weights in groups of 16)")

    if qc.get("sparsity_config"):
        raise refuse("a sparsity_config")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise refuse(f"quantization_status {status!r}")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise refuse("no config_groups")
    for name, group in groups.items():
        w = group.get("weights") if isinstance(group, dict) else None
        fmt = (group.get("format") if isinstance(group, dict) else None) or qc.get("format")
        if fmt != CT_NVFP4:
            raise refuse(f"format {fmt!r} in {name}")
        if not isinstance(w, dict):
            raise refuse(f"no weights scheme in {name}")
        scheme = {k: w.get(k) for k in ("num_bits", "type", "strategy", "group_size")}
        if scheme != {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                      "group_size": 16}:
            raise refuse(f"{name} weights " + " ".join(f"{k}={v!r}" for k, v in scheme.items()))


def _fp8_block(qc: Any, source: str) -> tuple[int, int] | None:
    """The FP8 scale tile of a `quantization_config`, None without one; other methods refused."""
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in QUANT_METHODS:
        raise ModelLoadError(source, f"unsupported quantization method {method!r} "
                             "(supported: fp8 with block scales, mxfp4, modelopt NVFP4, "
                             f"compressed-tensors {CT_NVFP4})")
    if method == "compressed-tensors":
        _check_compressed_tensors(qc, source)
        return None
    if method == "mxfp4":  # the tensors say which weights are MXFP4 (`*_blocks`, `*_scales`)
        return None
    if method == "modelopt":  # the tensors say which weights are NVFP4 (uint8 + weight_scale)
        algo, group = qc.get("quant_algo"), qc.get("group_size", 16)
        if not isinstance(algo, str) or algo.upper() != "NVFP4" or group != 16:
            raise ModelLoadError(source, f"unsupported modelopt quantization quant_algo={algo!r} "
                                 f"group_size={group!r} (supported: NVFP4, groups of 16)")
        return None
    block = qc.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(source, f"fp8 quantization_config needs weight_block_size "
                             f"[rows, cols], got {block!r}")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ModelLoadError(source, f"unsupported fp8 format {qc.get('fmt')!r} (supported: e4m3)")
    return int(block[0]), int(block[1])


def _nvfp4_layout(qc: Any) -> str:
    """ArchSpec.nvfp4 of an accepted `quantization_config`."""
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    return method if method in ("modelopt", "compressed-tensors") else ""


def arch_from_config(cfg: dict[str, Any], source: str = "config.json") -> ArchSpec:
    """Build the spec from a parsed HF config; raise ModelLoadError naming what is wrong."""
    arch = cfg.get("model_type")
    if arch in ("qwen3_5_moe", "qwen3_5_moe_text"):
        # the multimodal checkpoint nests the language model's fields; ids may sit at the top
        text = cfg.get("text_config")
        if arch == "qwen3_5_moe" and not isinstance(text, dict):
            raise ModelLoadError(source, "qwen3_5_moe config without a text_config")
        top: dict[str, Any] = {k: cfg[k] for k in ("bos_token_id", "eos_token_id",
                                                   "tie_word_embeddings") if k in cfg}
        cfg = {**top, **(text or cfg), "model_type": "qwen3_5_moe"}
        arch = "qwen3_5_moe"
    if arch == "kimi_k2" and "DeepseekV3ForCausalLM" in (cfg.get("architectures") or []):
        arch = "deepseek_v3"  # Kimi-K2 (and K2-Thinking): DeepSeek-V3's model, its own name
        cfg = {**cfg, "model_type": arch}
    if arch not in SUPPORTED:
        raise ModelLoadError(
            source, f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED)})"
        )

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ModelLoadError(source, f"missing field {key!r} for {arch}")
        return cfg[key]

    def count(key: str, value: Any) -> int:
        """`value` of `key` as an integer of at least 1 (`config_file` checks a config.json
        first; this holds for the configs built from GGUF metadata and by callers)."""
        n = int(value)
        if n < 1:
            raise ModelLoadError(source, f"field {key!r} must be >= 1, got {n}")
        return n

    hidden = count("hidden_size", need("hidden_size"))
    heads = count("num_attention_heads", need("num_attention_heads"))
    layers = count("num_hidden_layers", need("num_hidden_layers"))
    kv_heads = count("num_key_value_heads", cfg.get("num_key_value_heads") or heads)
    head_dim = count("head_dim", cfg.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ModelLoadError(source, f"num_attention_heads {heads} not a multiple of kv heads {kv_heads}")
    theta, scaling = _rope(cfg)
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if scaling is not None and kind not in ("llama3", "yarn", "freq_factors"):
        raise ModelLoadError(source, f"unsupported rope scaling {scaling!r}")
    factors = (scaling or {}).get("factors", []) if kind == "freq_factors" else []
    if kind == "freq_factors" and len(factors) != head_dim // 2:
        raise ModelLoadError(source, f"{len(factors)} rope frequency factors for head_dim "
                             f"{head_dim} (one per pair of dimensions)")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())

    fp8_block = _fp8_block(cfg.get("quantization_config"), source)
    num_experts = 0
    top_k = 0
    moe_inter = 0
    moe_layers: tuple[int, ...] = ()
    norm_topk = True
    if arch in ("mixtral", "qwen3_moe", "gpt_oss", "minimax_m2", *_HYBRID):
        spelled = [k for k in ("num_local_experts", "num_experts") if cfg.get(k) is not None]
        num_experts = int(cfg[spelled[0]] if spelled else need(
            "num_local_experts" if arch in ("mixtral", "gpt_oss", "minimax_m2") else "num_experts"))
        top_k = int(need("num_experts_per_tok"))
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ModelLoadError(source, f"bad MoE shape: {num_experts} experts, top-{top_k}")
        if arch in ("mixtral", "gpt_oss", "minimax_m2"):
            moe_inter = int(need("intermediate_size"))
            moe_layers = tuple(range(layers))
        elif arch == "qwen3_5_moe":  # every layer routed, weights always renormalised
            moe_inter = int(need("moe_intermediate_size"))
            moe_layers = tuple(range(layers))
        else:
            moe_inter = int(cfg.get("moe_intermediate_size") or need("intermediate_size"))
            norm_topk = bool(cfg.get("norm_topk_prob", arch == "qwen3_next"))
            step = int(cfg.get("decoder_sparse_step", 1) or 1)
            only = set(cfg.get("mlp_only_layers") or [])
            moe_layers = tuple(i for i in range(layers) if i not in only and (i + 1) % step == 0)

    gpt_oss = arch == "gpt_oss"
    if gpt_oss:  # transformers' defaults for configs that leave these out
        cfg = {"sliding_window": 128, "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]} | cfg
    layer_types, window = ((), 0) if arch in _HYBRID else _layer_types(cfg, layers, source)
    spec = ArchSpec(
        arch=arch,
        vocab_size=count("vocab_size", need("vocab_size")),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=0 if gpt_oss else int(cfg.get("intermediate_size") or 0),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=count("max_position_embeddings", 4096 if cfg.get(
            "max_position_embeddings") is None else cfg["max_position_embeddings"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe", *_HYBRID),
        attention_bias=bool(cfg.get("attention_bias", gpt_oss)),
        o_bias=bool(cfg.get("attention_bias", gpt_oss)),
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=moe_inter,
        norm_topk_prob=norm_topk,
        moe_layers=moe_layers,
        rope_scaling=scaling,
        fp8_block=fp8_block,
        nvfp4=_nvfp4_layout(cfg.get("quantization_config")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        sliding_window=window,
        attention_sinks=gpt_oss,
        router="topk_softmax" if gpt_oss else "softmax",
        expert_act="swiglu_clamp" if gpt_oss else "silu",
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        **_hybrid_fields(cfg, arch, layers, head_dim, source, layer_types),
    )
    if arch in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite"):  # GLM-4.7-Flash: V3's design
        from ftrs.models.mla import deepseek_fields

        spec = replace(spec, **deepseek_fields(cfg, arch, layers, scaling, source))
    elif arch == "glm4_moe":
        from ftrs.models.sigmoid_moe import glm4_moe_fields

        spec = replace(spec, **glm4_moe_fields(cfg, layers, head_dim, source))
    elif arch == "minimax_m2":
        from ftrs.models.sigmoid_moe import minimax_m2_fields

        spec = replace(spec, **minimax_m2_fields(cfg, head_dim, source))
    return spec


def _layer_types(cfg: dict[str, Any], layers: int, source: str) -> tuple[tuple[str, ...], int]:
    """`config.layer_types` (every layer "full_attention" without one) and the sliding window
    (0 unless a layer slides)."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        return ("full_attention",) * layers, 0
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise ModelLoadError(source, f"layer_types must list {layers} layer kinds, got {kinds!r}")
    bad = sorted({k for k in kinds if k not in WINDOWED_TYPES}, key=str)
    if bad:
        raise ModelLoadError(source, f"unsupported layer type {bad[0]!r} "
                             f"(supported: {', '.join(WINDOWED_TYPES)})")
    if "sliding_attention" not in kinds:
        return tuple(kinds), 0
    window = cfg.get("sliding_window")
    if not isinstance(window, int) or window < 1:
        raise ModelLoadError(source, f"sliding_attention layers need sliding_window >= 1, "
                             f"got {window!r}")
    return tuple(kinds), window


def _hybrid_fields(cfg: dict[str, Any], arch: str, layers: int, head_dim: int,
                   source: str, layer_types: tuple[str, ...]) -> dict[str, Any]:
    """The ArchSpec fields of the Gated DeltaNet hybrids (qwen3_5_moe, qwen3_next)."""
    if arch not in _HYBRID:
        return {"layer_types": layer_types}
    types = cfg.get("layer_types")
    if types is None:  # the older spelling: one full attention layer every N
        every = int(cfg.get("full_attention_interval", 4))
        types = [FULL_ATTENTION if (i + 1) % every == 0 else LINEAR_ATTENTION
                 for i in range(layers)]
    if (not isinstance(types, list) or len(types) != layers
            or any(t not in LAYER_TYPES for t in types)):
        raise ModelLoadError(source, f"layer_types must list {layers} of {', '.join(LAYER_TYPES)}, "
                             f"got {types!r}")
    try:
        lin = LinearAttnSpec(int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"]),
                             int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"]),
                             int(cfg.get("linear_conv_kernel_dim", 4)),
                             bool(cfg.get("_v_heads_tiled", False)))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(source, f"bad or missing linear attention field: {e}") from e
    if min(lin.num_k_heads, lin.k_head_dim, lin.v_head_dim) < 1 or lin.conv_kernel < 2 \
            or lin.num_v_heads % lin.num_k_heads:
        raise ModelLoadError(source, f"bad linear attention shape: {lin}")
    rope = cfg.get("rope_parameters")
    params: dict[str, Any] = rope if isinstance(rope, dict) else {}
    factor = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    rotary = int(head_dim * factor)  # frequencies over this many dims, as the reference does
    if not 1 < rotary <= head_dim:
        raise ModelLoadError(source, f"partial_rotary_factor {factor} gives no rotary dims")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return {"layer_types": tuple(types), "linear": lin, "rotary_dim": rotary,
            "attn_output_gate": True, "norm_plus_one": True,
            "shared_expert_intermediate_size": shared}


def load_arch(model_dir: Path) -> ArchSpec:
    """The spec of a checkpoint directory's config.json (`models.config_file` reads it)."""
    from ftrs.models.config_file import read_config

    return arch_from_config(read_config(model_dir), str(model_dir / "config.json"))
