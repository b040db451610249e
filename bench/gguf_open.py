"""Opening a GGUF: `gguf.GGUFReader` against `ftrs.models.gguf_file.read_gguf_file`, side by
side in one run, and the whole load of the Q4_K_M demo (`LLM(...)`, resident, CPU).

Files: the SmolLM2-135M GGUF the demo is built from (49,152 tokens, 48,900 merges) and a
synthetic file with a Qwen3-sized vocabulary (151,936 tokens and as many merges, token types
and scores; one small tensor), written once into `--dir`. Each reader opens each file
`--rounds` times, alternating; figures are medians, `ratio` is gguf's time over ftrs's.

    .venv/bin/python bench/gguf_open.py
    .venv/bin/python bench/gguf_open.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def big_vocab(path: Path, n: int) -> Path:
    import gguf

    if path.exists():
        return path
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok_{i}_" + "x" * (i % 13) for i in range(n)])
    w.add_token_types([1] * n)
    w.add_token_scores([0.0] * n)
    w.add_token_merges([f"t{i} o{i}" for i in range(n)])
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def time_open(path: Path, which: str) -> float:
    import gguf

    from ftrs.models.gguf_file import read_gguf_file

    t = time.perf_counter()
    if which == "gguf":
        gguf.GGUFReader(str(path))
    else:
        read_gguf_file(path)
    return time.perf_counter() - t


def expert_fill(path: Path, rounds: int) -> dict[str, float]:
    """The Q4_K_M demo's expert pool filled two ways, alternating: one `HostExperts.write` per
    expert tensor from the mapped file (a copy each, one thread: how GGUF experts were loaded
    before) and one `fill_from_file` call (Rust threads copying from their own map)."""
    import torch

    from ftrs.models.arch import arch_from_config
    from ftrs.models.experts import HostExperts
    from ftrs.models.gguf_loader import open_gguf
    from ftrs.models.load import _gguf_experts

    ck = open_gguf(path)
    spec = arch_from_config(ck.config, str(path))
    probe = _gguf_experts(ck, spec, torch.float32)
    assert probe is not None
    formats, mb = probe.formats, probe.pool.nbytes / 1e6
    del probe
    runs: dict[str, list[float]] = {"write_per_tensor": [], "fill_from_file": []}
    for _ in range(rounds):
        t = time.perf_counter()
        experts = HostExperts(spec, torch.float32, formats)
        for layer in spec.moe_layers:
            for ti, gt in ck.experts[layer].items():
                for e in range(spec.num_experts):
                    experts.write(layer, e, ti, np.ascontiguousarray(gt.data[e]).reshape(-1))
        runs["write_per_tensor"].append(time.perf_counter() - t)
        del experts
        t = time.perf_counter()
        filled = _gguf_experts(ck, spec, torch.float32)  # the loader's own path
        runs["fill_from_file"].append(time.perf_counter() - t)
        del filled
    w, f = statistics.median(runs["write_per_tensor"]), statistics.median(runs["fill_from_file"])
    return {"pool_mb": round(mb, 1), "write_per_tensor_s": round(w, 3),
            "fill_from_file_s": round(f, 3), "ratio": round(w / f, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args()
    from ftrs.models.demo import demo_gguf, ensure_demo_quant

    files = {"smollm2-135m": demo_gguf(), f"synthetic-{args.vocab}-vocab":
             big_vocab(args.dir / f"ftrs-bench-vocab-{args.vocab}.gguf", args.vocab)}
    out: dict[str, dict[str, float]] = {}
    for name, path in files.items():
        runs: dict[str, list[float]] = {"gguf": [], "ftrs": []}
        for _ in range(args.rounds):
            for which in runs:
                runs[which].append(time_open(path, which))
        g, f = statistics.median(runs["gguf"]), statistics.median(runs["ftrs"])
        out[name] = {"gguf_reader_s": round(g, 4), "ftrs_reader_s": round(f, 4),
                     "ratio": round(g / f, 1), "file_mb": round(path.stat().st_size / 1e6, 1)}
    path = ensure_demo_quant("q4_k_m")
    out["demo_q4_k_m_expert_fill"] = expert_fill(path, args.rounds)
    from ftrs.llm import LLM

    loads = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        llm = LLM(str(path), device="cpu", dtype="float32", moe_strategy="resident",
                  kv_tokens=1024)
        loads.append(time.perf_counter() - t)
        llm.close()
    out["demo_q4_k_m_load"] = {"llm_init_s": round(statistics.median(loads), 3)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
