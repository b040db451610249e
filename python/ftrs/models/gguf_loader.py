"""GGUF checkpoints of the llama family, through the `gguf` package.

F32, F16, BF16, Q8_0, Q4_0 and Q4_1 tensors are dequantized to fp32 at load. Tensor names are
mapped to Hugging Face names, undoing the row permutation llama.cpp applies to the q and k
projections, so the rest of ftrs sees an ordinary checkpoint. The config and the tokenizer come
from the file's metadata.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from ftrs.errors import ModelLoadError
from ftrs.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_SUPPORTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")


def _reader(path: Path) -> Any:
    import gguf

    if not path.is_file():
        raise ModelLoadError(str(path), "GGUF file not found")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:
        raise ModelLoadError(str(path), f"cannot read GGUF: {e}") from e


def gguf_metadata(reader: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # a field type the package cannot render: not one we use
            continue
    return out


def gguf_config(meta: dict[str, Any], tensor_names: set[str], source: str) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(source, f"unsupported GGUF architecture {arch!r} (supported: llama)")

    def get(key: str, default: Any = None) -> Any:
        v = meta.get(f"llama.{key}", default)
        if v is None:
            raise ModelLoadError(source, f"missing GGUF metadata llama.{key}")
        return v

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = len(meta.get("tokenizer.ggml.tokens") or []) or int(get("vocab_size"))
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu", "torch_dtype": "float32",
    }


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary halves -> split halves)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: Path, progress: bool = True
              ) -> tuple[dict[str, Any], dict[str, torch.Tensor], Tokenizer]:
    """(HF config, fp32 tensors under HF names, tokenizer) of a llama-family GGUF file."""
    import gguf

    reader = _reader(path)
    meta = gguf_metadata(reader)
    names = {t.name for t in reader.tensors}
    cfg = gguf_config(meta, names, str(path))
    tokenizer = Tokenizer.from_gguf_fields(meta, str(path))
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="dequantizing", unit="tensor", disable=not progress,
                  leave=False):
        qtype = t.tensor_type.name
        if qtype not in _SUPPORTED:
            raise ModelLoadError(str(path), f"tensor {t.name} uses unsupported quantization "
                                 f"{qtype} (supported: {', '.join(_SUPPORTED)})")
        if t.name in _TOP:
            hf = _TOP[t.name]
        else:
            m = _BLK.match(t.name)
            if not m or m.group(2) not in _BLOCK:
                log.debug("skipping GGUF tensor %s", t.name)
                continue
            hf = f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
        arr = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        arr = arr.reshape([int(d) for d in reversed(t.shape.tolist())])
        if hf.endswith("q_proj.weight"):
            arr = _unpermute(arr, cfg["num_attention_heads"])
        elif hf.endswith("k_proj.weight"):
            arr = _unpermute(arr, cfg["num_key_value_heads"])
        tensors[hf] = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))
    return cfg, tensors, tokenizer
