"""Write GGUF files as llama.cpp lays them out, from Hugging Face-named fp32 tensors.

Used to build quantized test checkpoints and the quantized demo (`ftrs models demo --quant`).
Architectures: `llama` (dense, or Mixtral-style with `llama.expert_count`), `qwen3`, `qwen3moe`,
`gpt-oss`, `qwen3next`, `qwen35moe`, `deepseek2`, `glm4moe` and `minimax-m2` (the converter's changes to those in
`models/gguf_archs.py` and `models/gguf_deepseek.py`). Routed experts are stacked into 3-D `blk.N.ffn_{gate,up,down}_exps.weight`; the llama
q and k projections get llama.cpp's row permutation. gpt-oss follows llama.cpp's converter: its
names from the `gguf` package's own name map, gate and up taken out of the interleaved
`gate_up_proj` (and its bias) and every expert matrix transposed to the `Linear` layout; YaRN
and the sliding window in the metadata. `write_gguf` returns the tensors as the file holds them
(dequantized, permutation undone, gpt-oss's parts packed again): the weights a reference model
must be given.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ftrs.errors import ConfigError
from ftrs.models.gguf_archs import (
    gpt_oss_packed,
    gpt_oss_tensors,
    llama3_rope_factors,
    qwen3next_tensors,
)
from ftrs.models.gguf_deepseek import (
    converter_tensors,
    deepseek2_metadata,
    glm4moe_metadata,
    minimax_m2_metadata,
)
from ftrs.models.tokenizer import Tokenizer

#: (HF name, fp32 values (rows, cols) or (E, rows, cols)) -> (GGUF type, raw bytes (..., row_bytes))
Quantizer = Callable[[str, np.ndarray], tuple[str, np.ndarray]]
_ARCH = {"llama": "llama", "mixtral": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
         "gpt_oss": "gpt-oss", "qwen3_next": "qwen3next", "qwen3_5_moe": "qwen35moe",
         "deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2", "glm4_moe": "glm4moe",
         "glm4_moe_lite": "deepseek2", "minimax_m2": "minimax-m2"}
_LAYER = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
          "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
          "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
          "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
          "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
          "mlp.down_proj.weight": "ffn_down", "mlp.gate.weight": "ffn_gate_inp",
          "block_sparse_moe.gate.weight": "ffn_gate_inp"}
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_EXPERT_NAME = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}
#: the architectures written through `gguf_deepseek.converter_tensors`, and their metadata
_CONVERTED = {"deepseek2": deepseek2_metadata, "glm4moe": glm4moe_metadata,
              "minimax-m2": minimax_m2_metadata}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (split rotary halves -> interleaved)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def keep_f32(name: str, w: np.ndarray) -> tuple[str, np.ndarray]:
    return "F32", np.ascontiguousarray(w, dtype=np.float32)


def gguf_quantizer(qtype: str, min_dims: int = 2) -> Quantizer:
    """Quantize every tensor of at least `min_dims` dims to `qtype` with the `gguf` package
    (types it can write: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1); the rest, and rows that are not a
    whole number of blocks, stay F32."""
    import gguf

    from ftrs.quant.formats import block_format

    qt = gguf.GGMLQuantizationType[qtype]
    elems = block_format(qtype).block_elems

    def q(name: str, w: np.ndarray) -> tuple[str, np.ndarray]:
        if w.ndim < min_dims or w.shape[-1] % elems:
            return keep_f32(name, w)
        return qtype, gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), qt)
    return q


def _q4_k_m_type(name: str, cols: int, num_layers: int, tied: bool) -> str:
    """llama.cpp's Q4_K_M choice for one matrix: Q6_K for the output (the token embedding when
    it is tied to the output) and for `down` (and `v`) of the layers `use_more_bits` picks, Q4_K
    elsewhere; rows that are not a whole number of 256-value blocks fall back to Q8_0 (for
    Q6_K), as llama.cpp does, and to Q5_1 (for Q4_K) where llama.cpp takes Q5_0: the demo's
    source is a Q4_1 file, whose values Q5_1 (with its step search) holds exactly, while Q5_0
    adds a second rounding that SmolLM2-135M does not survive (it stops answering "Paris")."""
    m = re.search(r"layers\.(\d+)\.", name)
    i, n = (int(m.group(1)) if m else -1), num_layers
    more_bits = i >= 0 and (i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2)
    output = "lm_head.weight" if not tied else "model.embed_tokens.weight"
    six = name == output or (more_bits and (
        "down_proj" in name or ".w2." in name or "v_proj" in name))
    if cols % 256:
        return "Q8_0" if six else "Q5_1"
    return "Q6_K" if six else "Q4_K"


def q4_k_m_quantizer(num_layers: int, tied: bool) -> Quantizer:
    """A `Quantizer` writing Q4_K_M as llama.cpp lays it out (`_q4_k_m_type`); vectors stay F32.
    A stack of identical experts (an upcycled model) is quantized once and repeated."""
    from ftrs.quant.kquant import quantize_q4_k, quantize_q5_1, quantize_q6_k

    def one(qtype: str, w: np.ndarray) -> np.ndarray:
        if qtype == "Q4_K":
            return quantize_q4_k(w)
        if qtype == "Q6_K":
            return quantize_q6_k(w)
        if qtype == "Q5_1":
            return quantize_q5_1(w)
        return gguf_quantizer(qtype)("", w)[1]

    def q(name: str, w: np.ndarray) -> tuple[str, np.ndarray]:
        if w.ndim < 2:
            return keep_f32(name, w)
        qtype = _q4_k_m_type(name, w.shape[-1], num_layers, tied)
        if w.ndim == 3 and all(np.array_equal(w[0], w[e]) for e in range(1, w.shape[0])):
            first = one(qtype, w[0])
            return qtype, np.ascontiguousarray(np.broadcast_to(first, (w.shape[0], *first.shape)))
        return qtype, one(qtype, w)
    return q


def _tokenizer_fields(tok: Tokenizer) -> dict[str, Any]:
    vocab = tok.tk.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t.content for t in tok.tk.get_added_tokens_decoder().values() if t.special}
    merges = json.loads(tok.tk.to_str())["model"].get("merges", [])
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    out: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in special else 1 for t in tokens],
        "tokenizer.ggml.merges": merges, "tokenizer.ggml.add_bos_token": tok.add_bos,
    }
    if tok.chat_template:
        out["tokenizer.chat_template"] = tok.chat_template
    if tok.named_templates:  # as llama.cpp's converter writes them
        out["tokenizer.chat_templates"] = list(tok.named_templates)
        out |= {f"tokenizer.chat_template.{n}": t for n, t in tok.named_templates.items()}
    for key, name in (("bos", tok.bos_token), ("eos", tok.eos_token)):
        if name is not None and name in vocab:
            out[f"tokenizer.ggml.{key}_token_id"] = vocab[name]
    return out


def add_field(w: Any, key: str, value: Any) -> None:
    """One metadata field, its GGUF type from the value's: bool, uint32, float32, string, array."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, list):
        w.add_array(key, value)
    else:
        raise TypeError(f"GGUF field {key}: cannot write {type(value).__name__}")


def _metadata(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    m: dict[str, Any] = {
        "context_length": int(cfg.get("max_position_embeddings", 2048)),
        "embedding_length": int(cfg["hidden_size"]), "block_count": int(cfg["num_hidden_layers"]),
        "feed_forward_length": int(cfg.get("intermediate_size") or 0),
        "attention.head_count": heads,
        "attention.head_count_kv": int(cfg.get("num_key_value_heads") or heads),
        "attention.layer_norm_rms_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope.freq_base": float(rope), "rope.dimension_count": head_dim,
        "attention.key_length": head_dim, "attention.value_length": head_dim,
        "vocab_size": int(cfg["vocab_size"]),
    }
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if experts:
        m |= {"expert_count": experts, "expert_used_count": int(cfg["num_experts_per_tok"])}
        if cfg["model_type"] == "qwen3_moe":
            m["expert_feed_forward_length"] = int(cfg["moe_intermediate_size"])
    if cfg["model_type"] in ("qwen3_next", "qwen3_5_moe"):
        params = cfg.get("rope_parameters") or {}
        factor = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
        types = cfg["layer_types"]
        every = types.index("full_attention") + 1
        if any((t == "full_attention") != ((i + 1) % every == 0) for i, t in enumerate(types)):
            raise ConfigError("write_gguf: qwen3next needs one full attention layer every N")
        v_heads = int(cfg["linear_num_value_heads"])
        m |= {"expert_feed_forward_length": int(cfg["moe_intermediate_size"]),
              "expert_shared_feed_forward_length": int(cfg["shared_expert_intermediate_size"]),
              "ssm.conv_kernel": int(cfg["linear_conv_kernel_dim"]),
              "ssm.state_size": int(cfg["linear_key_head_dim"]),
              "ssm.group_count": int(cfg["linear_num_key_heads"]),
              "ssm.time_step_rank": v_heads,
              "ssm.inner_size": v_heads * int(cfg["linear_value_head_dim"]),
              "full_attention_interval": every, "rope.dimension_count": int(head_dim * factor)}
        if cfg["model_type"] == "qwen3_5_moe":  # MRoPE sections over the rotary pairs (text:
            pairs = int(head_dim * factor) // 2  # every section at the same position)
            m["rope.dimension_sections"] = [pairs - 2 * (pairs // 3), pairs // 3, pairs // 3, 0]
    if cfg["model_type"] == "gpt_oss":
        m |= {"expert_feed_forward_length": int(cfg["intermediate_size"]),
              "attention.sliding_window": int(cfg["sliding_window"])}
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if scaling.get("rope_type", scaling.get("type")) == "yarn":
        m |= {"rope.scaling.type": "yarn", "rope.scaling.factor": float(scaling["factor"]),
              "rope.scaling.original_context_length":
                  int(scaling["original_max_position_embeddings"])}
        for name, key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                          ("attention_factor", "yarn_attn_factor")):
            if scaling.get(name) is not None:
                m[f"rope.scaling.{key}"] = float(scaling[name])
    return {f"{arch}.{k}": v for k, v in m.items()}


def write_gguf(path: Path, cfg: dict[str, Any], tensors: dict[str, torch.Tensor],
               quantize: Quantizer, tokenizer: Tokenizer | None = None,
               tokenizer_fields: dict[str, Any] | None = None,
               dequantized: bool = True, fuse_gate_up: bool = False,
               split_max_tensors: int = 0) -> dict[str, torch.Tensor]:
    """Write `tensors` (HF names, fp32) as a GGUF file; returns them as the file holds them
    (with `dequantized`; otherwise an empty dict). `fuse_gate_up`: the routed experts' gate and
    up in one `ffn_gate_up_exps` (gate rows first), as the converter's `--fuse-gate-up-exps`.
    `split_max_tensors`: a split GGUF of at most that many tensors a shard, named as
    `gguf-split` names them (`<stem>-00001-of-0000N.gguf`, ...; `path` itself is not written)."""
    import gguf

    from ftrs.models.gguf_loader import GGUFTensor, unpermute_rows

    if cfg.get("model_type") == "qwen3_5_moe_text":  # Qwen3.5's text model on its own
        cfg = cfg | {"model_type": "qwen3_5_moe"}
    model_type = cfg.get("model_type")
    if model_type not in _ARCH:
        raise ConfigError(f"write_gguf: unsupported model_type {model_type!r}")
    arch = _ARCH[model_type]
    heads = {"q": int(cfg["num_attention_heads"]),
             "k": int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])}
    # group experts: (layer, gguf name) -> {expert: array}
    plain: dict[str, tuple[str, np.ndarray]] = {}
    stacks: dict[str, dict[int, tuple[str, np.ndarray]]] = {}
    source = tensors
    if arch == "gpt-oss":
        plain = gpt_oss_tensors(tensors, int(cfg["num_hidden_layers"]))
        tensors = {}
    elif arch in ("qwen3next", "qwen35moe"):
        plain, tensors = qwen3next_tensors(tensors, cfg)
    elif arch in _CONVERTED:
        plain, tensors = converter_tensors(tensors, cfg, arch)
    for name, t in tensors.items():
        arr = t.detach().float().numpy()
        if name in _TOP:
            plain[_TOP[name]] = (name, arr)
            continue
        m = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
        if not m:
            raise ConfigError(f"write_gguf: unexpected tensor {name}")
        layer, rest = m.group(1), m.group(2)
        e = _EXPERT.match(rest)
        if e:
            key = f"blk.{layer}.{_EXPERT_NAME[e.group(2)]}.weight"
            stacks.setdefault(key, {})[int(e.group(1))] = (name, arr)
            continue
        if rest not in _LAYER:
            raise ConfigError(f"write_gguf: unexpected tensor {name}")
        if arch == "llama" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            arr = permute_rows(arr, heads[rest[10]])
        plain[f"blk.{layer}.{_LAYER[rest]}.weight"] = (name, arr)

    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    meta = _metadata(cfg, arch)
    if arch in _CONVERTED:
        meta |= {f"{arch}.{k}": v for k, v in _CONVERTED[arch](cfg).items()}
    for k, v in meta.items():
        add_field(writer, k, v)
    fields = tokenizer_fields if tokenizer_fields is not None else (
        _tokenizer_fields(tokenizer) if tokenizer is not None else {})
    for k, v in fields.items():
        add_field(writer, k, v)
    held: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}

    def add(gname: str, hf: str, arr: np.ndarray) -> None:
        qtype, raw = quantize(hf, arr)
        types[gname] = qtype
        raw = np.ascontiguousarray(raw)
        raw = raw.view(np.uint8).reshape(*raw.shape[:-1], -1)  # bytes: gguf's "byte shape"
        writer.add_tensor(gname, raw, raw_shape=raw.shape,
                          raw_dtype=gguf.GGMLQuantizationType[qtype])
        if dequantized:
            held[gname] = GGUFTensor(gname, qtype, tuple(arr.shape), raw).to_float()

    for gname, (hf, arr) in plain.items():
        add(gname, hf, arr)
    factors = llama3_rope_factors(cfg)
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors)
    def stack(gname: str) -> np.ndarray:
        return np.stack([stacks[gname][i][1] for i in range(len(stacks[gname]))])

    for gname, group in stacks.items():
        if fuse_gate_up and "ffn_gate_exps" in gname:  # the converter's --fuse-gate-up-exps
            fused = np.concatenate([stack(gname), stack(gname.replace("gate", "up"))], axis=1)
            add(gname.replace("ffn_gate_exps", "ffn_gate_up_exps"), group[0][0], fused)
        elif not (fuse_gate_up and "ffn_up_exps" in gname):
            add(gname, group[0][0], stack(gname))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    out: dict[str, torch.Tensor] = {}
    if not dequantized:
        return out
    if arch == "gpt-oss":
        return gpt_oss_packed({hf: held[gname] for gname, (hf, _) in plain.items()})
    if arch in ("qwen3next", "qwen35moe", *_CONVERTED):  # F32: the source's values
        if any(types[gname] != "F32" for gname in plain):
            raise ConfigError(f"write_gguf: {arch}'s values are returned for files whose "
                              "tensors other than the routed experts are F32")
        layers = int(cfg["num_hidden_layers"])
        out = {name: t.detach().float() for name, t in source.items()
               if ".experts." not in name
               and not (name.startswith("model.layers.") and int(name.split(".")[2]) >= layers)}
        plain = {}
    for gname, (hf, _) in plain.items():
        t = held[gname]
        if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            t = unpermute_rows(t, heads[hf.rsplit(".", 2)[1][0]])
        out[hf] = t
    for gname, group in stacks.items():
        joint = gname.replace("ffn_gate_exps", "ffn_gate_up_exps").replace("ffn_up_exps",
                                                                           "ffn_gate_up_exps")
        for i, (hf, _) in group.items():
            if fuse_gate_up and joint != gname:
                rows = held[joint].shape[1] // 2
                part = slice(0, rows) if "ffn_gate_exps" in gname else slice(rows, None)
                out[hf] = held[joint][i, part].clone()
            else:
                out[hf] = held[gname][i].clone()
    return out
