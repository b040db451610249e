"""Tiny gpt_oss checkpoints built with transformers, plain and MXFP4, for tests.

The shapes are chosen to catch shortcuts: head_dim (20) differs from hidden/heads (24), 7
experts (not a power of two), top-3, a layer pattern that starts with the minority kind (full,
sliding, sliding), a sliding window (9) far shorter than the test prompts, yarn rope, and a
SwiGLU clamp (1.0) low enough that the clamp changes values. Every parameter is random (biases
and sinks too; transformers would initialise those to zero).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ftrs.models.gguf_write import Quantizer
from ftrs.models.tiny import tiny_tokenizer

VOCAB = 512


#: what a GGUF file can say of gpt-oss (llama.cpp fixes the rest for the architecture): even
#: layers slide, the SwiGLU clamp is 7
GGUF_EXPRESSIBLE = {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                    "swiglu_limit": 7.0}


def config(**changes: object) -> object:
    import transformers

    kwargs: dict[str, object] = dict(
        vocab_size=VOCAB, hidden_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=20, intermediate_size=64, num_local_experts=7,
        num_experts_per_tok=3, sliding_window=9, swiglu_limit=1.0,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 64,
                         "rope_theta": 10000.0},
        eos_token_id=2, bos_token_id=1)
    return transformers.GptOssConfig(**(kwargs | changes))


def build(out: Path, seed: int = 0, **changes: object) -> Path:
    """A random fp32 gpt_oss checkpoint as `save_pretrained` writes it, with a tokenizer;
    `changes` override the config."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config(**changes))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("sinks"):
                p.copy_(noise)
            else:
                p.copy_(0.1 * noise)
    model.save_pretrained(str(out))
    tiny_tokenizer(VOCAB).save(out)
    return out


def _hf_blocks(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml MXFP4 rows (n, G*17) -> the shipped (n, G, 16) blocks and (n, G) scales: byte k of a
    shipped block holds values 2k (low nibble) and 2k+1 (high); ggml's byte j holds j and j+16."""
    n = rows.shape[0]
    b = rows.reshape(n, -1, 17)
    scales, qs = b[..., 0], b[..., 1:]
    vals = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # (n, G, 32) codes in order
    blocks = (vals[..., 0::2] | (vals[..., 1::2] << 4)).astype(np.uint8)
    return blocks, scales


def quantize_mxfp4(src: Path, out: Path, ref: Path) -> tuple[Path, Path]:
    """`out`: `src` with its experts in MXFP4 (quantized by the `gguf` package, written as
    transformers ships them); `ref`: the same weights dequantized to fp32 by transformers' own
    `convert_moe_packed_tensors`, a plain checkpoint for the reference model."""
    import gguf
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(str(src / "model.safetensors"))
    quant: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            quant[name] = deq[name] = w
            continue
        lin = w.transpose(1, 2).contiguous().numpy()  # (E, rows, cols): the Linear layout
        e, r, c = lin.shape
        rows = gguf.quants.quantize(lin.reshape(e * r, c), gguf.GGMLQuantizationType.MXFP4)
        blocks, scales = _hf_blocks(rows)
        tb = torch.from_numpy(blocks.reshape(e, r, c // 32, 16).copy())
        ts = torch.from_numpy(scales.reshape(e, r, c // 32).copy())
        quant[name + "_blocks"], quant[name + "_scales"] = tb, ts
        deq[name] = convert_moe_packed_tensors(tb, ts, dtype=torch.float32)
    for d, t in ((out, quant), (ref, deq)):
        shutil.copytree(src, d)
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn",
                                                             "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out, ref


def to_gguf(src: Path, out: Path, ref: Path, quantize: Quantizer) -> tuple[Path, Path]:
    """`out`: the fp32 checkpoint `src` as a gpt-oss GGUF (`ftrs.models.gguf_write`, laid out as
    llama.cpp's converter lays it out) with `quantize` choosing each tensor's type; `ref`: `src`'s
    config with the weights the file holds (dequantized by the `gguf` package), for transformers."""
    from ftrs.models.gguf_write import write_gguf
    from ftrs.models.tokenizer import Tokenizer

    cfg = json.loads((src / "config.json").read_text())
    held = write_gguf(out, cfg, load_file(str(src / "model.safetensors")), quantize,
                      Tokenizer.from_dir(src))
    shutil.copytree(src, ref)
    save_file(held, str(ref / "model.safetensors"), metadata={"format": "pt"})
    return out, ref
