"""Each Triton kernel of `ftrs.kernels` against its torch reference, side by side in one run.

Cases (bf16 on a GPU, fp32 on the CPU):
- `rms_norm`: (tokens, hidden) with the residual add; `rotary`: q and k in place;
- `fused_moe` at batch 1/8/32 tokens over the demo model's expert shape by default
  (`--hidden/--inter/--experts/--top-k`), experts in scattered slots; the reference is the
  per-expert loop every strategy runs now; on a GPU also Q8_0 weights at batch 1/32 (the
  reference dequantizes each expert per call, the kernel inside its tiles);
- `paged_attention` decode at batch 1/8/32 with `--ctx` tokens each, GQA, scrambled pages;
  beside the reference it also times the decoder's padded gather + SDPA (`layers.attention`).
- `decode_step`: one engine decode step (forward, sampling) of the `--decode-model` (the demo
  on a GPU, a tiny random mixtral on the CPU) at batch 1/8/32, eager (`--no-cuda-graphs`) beside CUDA graphs; `speedup` =
  eager / graphs, or `graphs: "off: why"` where the engine cannot capture them.
Each figure is the median of `--reps` timed calls after warm-up; `speedup` = torch / triton.

    python bench/kernels.py            # JSON on stdout

Without a GPU it says "no GPU" and times the references only (small shapes, fewer reps), and
the eager decode step alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ftrs.kernels import Kernels, select_kernels
from ftrs.kernels.attention import PagedMeta, context_slots
from ftrs.kernels.moe import SlotWeights
from ftrs.models.tiny import make_tiny


def timed(fn: Callable[[], object], reps: int, cuda: bool) -> float:
    """Median milliseconds of `reps` calls after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def compare(name: str, shape: dict[str, Any], ref: Callable[[], object],
            kernel: Callable[[], object] | None, reps: int, cuda: bool,
            extra: dict[str, Callable[[], object]] | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"kernel": name, **shape, "torch_ms": round(timed(ref, reps, cuda), 4)}
    for label, fn in (extra or {}).items():
        row[f"{label}_ms"] = round(timed(fn, reps, cuda), 4)
    if kernel is not None:
        row["triton_ms"] = round(timed(kernel, reps, cuda), 4)
        row["speedup"] = round(row["torch_ms"] / row["triton_ms"], 2)
    return row


def bench_norm(ref: Kernels, tri: Kernels | None, dev: torch.device, dt: torch.dtype,
               tokens: int, hidden: int, reps: int) -> list[dict[str, Any]]:
    x = torch.randn(tokens, hidden, device=dev, dtype=dt)
    r = torch.randn(tokens, hidden, device=dev, dtype=dt)
    w = torch.randn(hidden, device=dev, dtype=dt)
    rows = [compare("rms_norm+residual", {"tokens": tokens, "hidden": hidden},
                    lambda: ref.rms_norm(x, w, 1e-6, r),
                    (lambda: tri.rms_norm(x, w, 1e-6, r)) if tri else None, reps, dev.type == "cuda")]
    heads, kv_heads, d = 32, 8, 128
    q = torch.randn(tokens, heads, d, device=dev, dtype=dt)
    k = torch.randn(tokens, kv_heads, d, device=dev, dtype=dt)
    cos = torch.randn(4096, d, device=dev)
    sin = torch.randn(4096, d, device=dev)
    pos = torch.randint(0, 4096, (tokens,), device=dev)
    rows.append(compare("rotary", {"tokens": tokens, "heads": heads, "kv_heads": kv_heads, "head_dim": d},
                        lambda: ref.rotary_(q, k, cos, sin, pos),
                        (lambda: tri.rotary_(q, k, cos, sin, pos)) if tri else None, reps,
                        dev.type == "cuda"))
    return rows


def q8_0_random(slots: int, rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """(slots, rows, cols/32*34) uint8 Q8_0 blocks: small fp16 scales, random int8 values."""
    nb = cols // 32
    raw = torch.randint(0, 256, (slots, rows, nb, 34), generator=g, dtype=torch.uint8)
    scales = (torch.rand(slots, rows, nb, 1, generator=g) / (64 * cols**0.5)).half()
    raw[..., :2] = scales.view(torch.uint8)
    return raw.view(slots, rows, nb * 34)


def bench_moe(ref: Kernels, tri: Kernels | None, dev: torch.device, dt: torch.dtype,
              args: argparse.Namespace, batch: int, reps: int, qtype: str = "none") -> dict[str, Any]:
    e, h, i, k = args.experts, args.hidden, args.inter, args.top_k
    g = torch.Generator().manual_seed(batch)
    slots = e + 2
    shapes = ((i, h), (i, h), (h, i))
    if qtype == "Q8_0":
        gate, up, down = (q8_0_random(slots, r, c, g).to(dev) for r, c in shapes)
        w = SlotWeights(gate, up, down, "Q8_0")
    else:
        gate, up, down = (torch.randn(slots, r, c, generator=g).div(c**0.5).to(dev, dt)
                          for r, c in shapes)
        w = SlotWeights(gate, up, down)
    slot_of = torch.randperm(slots, generator=g)[:e].to(dev)
    x = torch.randn(batch, h, generator=g).to(dev, dt)
    ids = torch.rand(batch, e, generator=g).topk(k, dim=1).indices.to(dev)
    rw = torch.full((batch, k), 1.0 / k, device=dev, dtype=dt)
    return compare("fused_moe", {"weights": qtype, "batch": batch, "experts": e, "top_k": k,
                                 "hidden": h, "inter": i},
                   lambda: ref.fused_moe(x, ids, rw, slot_of, w),
                   (lambda: tri.fused_moe(x, ids, rw, slot_of, w)) if tri else None, reps,
                   dev.type == "cuda")


def bench_decode_attention(ref: Kernels, tri: Kernels | None, dev: torch.device, dt: torch.dtype,
                           batch: int, ctx: int, reps: int) -> dict[str, Any]:
    from ftrs.layers.attention import AttnMetadata, paged_attention

    page, heads, kv_heads, d = 16, 9, 3, 64  # the demo model's heads, GQA ratio 3
    pages_per = -(-ctx // page)
    num_pages = batch * pages_per
    perm = torch.randperm(num_pages).tolist()
    pages = [perm[b * pages_per:(b + 1) * pages_per] for b in range(batch)]
    lens = [max(1, ctx - b % page) for b in range(batch)]  # last pages partly filled
    meta = PagedMeta.build(pages, list(range(batch)), [1] * batch, lens, page, dev)
    kc = torch.randn(num_pages * page, kv_heads, d, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    q = torch.randn(batch, heads, d, device=dev, dtype=dt)
    # the decoder's current path: every context gathered, padded to the longest, masked
    gather = torch.stack([context_slots(meta, b, ctx) for b in range(batch)])
    mask = torch.tensor([[j < n for j in range(ctx)] for n in lens], device=dev)[:, None, None, :]
    slot_map = torch.stack([context_slots(meta, b, n)[-1] for b, n in enumerate(lens)])
    layer_meta = AttnMetadata(slot_map, torch.arange(batch, device=dev), gather, mask, [])
    k_new, v_new = kc[slot_map], vc[slot_map]
    scale = d**-0.5
    return compare("paged_attention_decode", {"batch": batch, "ctx": ctx, "heads": heads,
                                              "kv_heads": kv_heads, "head_dim": d},
                   lambda: ref.paged_attention(q, kc, vc, meta, scale),
                   (lambda: tri.paged_attention(q, kc, vc, meta, scale)) if tri else None,
                   reps, dev.type == "cuda",
                   {"layer_gather_sdpa": lambda: paged_attention(q, k_new, v_new, kc, vc,
                                                                 layer_meta, scale)})


def decode_step_ms(engine: Any, batch: int, reps: int) -> float:
    """Median milliseconds of one decode step of `batch` sequences of 16 prompt tokens (their
    prefill first, then two steps of warm-up); each step ends with its sampled ids on the host."""
    from ftrs.engine.protocol import GenerateRequest
    from ftrs.sampling import SamplingParams

    params = SamplingParams(max_tokens=reps + 8, temperature=0.0, ignore_eos=True)
    ids = [f"decode-{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(GenerateRequest(rid, [1 + i % 50] * 16, params))
    started: set[str] = set()
    while len(started) < batch:  # prefill until every sequence has its first token
        events, _ = engine.step()
        started |= {e.request_id for e in events if e.new_token_ids}
    times = []
    for i in range(2 + reps):
        t0 = time.perf_counter()
        _, stats = engine.step()
        if stats.kind != "decode":
            raise RuntimeError(f"bench: expected a decode step, got {stats.kind}")
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    for rid in ids:
        engine.abort(rid)
    return statistics.median(times)


def bench_decode_steps(model: str, cuda: bool, reps: int, batches: tuple[int, ...] = (1, 8, 32),
                       label: str | None = None) -> list[dict[str, Any]]:
    """The decode step eager and with CUDA graphs (eager alone without a GPU)."""
    from ftrs.llm import LLM

    rows: dict[int, dict[str, Any]] = {
        b: {"kernel": "decode_step", "model": label or model, "batch": b} for b in batches}
    for graphs in (False, True) if cuda else (False,):
        llm = LLM(model, device="cuda" if cuda else "cpu", kv_tokens=16384,
                  max_running_requests=max(batches), cuda_graphs=graphs)
        try:
            off = llm.engine.cuda_graphs_off()
            if graphs and off is not None:
                for row in rows.values():
                    row["graphs"] = f"off: {off}"
                continue
            for b in batches:
                rows[b]["graphs_ms" if graphs else "eager_ms"] = round(
                    decode_step_ms(llm.engine, b, reps), 4)
        finally:
            llm.close()
    for row in rows.values():
        if not cuda:
            row["graphs"] = "no GPU"
        elif "graphs_ms" in row:
            row["speedup"] = round(row["eager_ms"] / row["graphs_ms"], 2)
    return list(rows.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=576)  # demo model (SmolLM2-135M upcycled 8x top-2)
    p.add_argument("--inter", type=int, default=1536)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--decode-model", default=None,
                   help="model of the decode step rows (default: the demo on a GPU, a tiny "
                        "random mixtral on the CPU, where the demo's steps take seconds)")
    p.add_argument("--no-decode", action="store_true", help="skip the decode step rows")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dt = torch.bfloat16 if cuda else torch.float32
    reps = args.reps or (50 if cuda else 5)
    ref = select_kernels("torch", dev)
    tri = select_kernels("triton", dev) if cuda else None
    with torch.inference_mode():
        rows = bench_norm(ref, tri, dev, dt, 32 if cuda else 8, 4096 if cuda else 576, reps)
        rows += [bench_moe(ref, tri, dev, dt, args, b, reps) for b in (1, 8, 32)]
        if cuda:  # the reference dequantizes every expert per call: slow on the CPU
            rows += [bench_moe(ref, tri, dev, dt, args, b, reps, "Q8_0") for b in (1, 32)]
        ctx = args.ctx if cuda else min(args.ctx, 128)
        rows += [bench_decode_attention(ref, tri, dev, dt, b, ctx, reps) for b in (1, 8, 32)]
    if not args.no_decode:
        with tempfile.TemporaryDirectory() as tmp:
            model = args.decode_model or ("demo" if cuda else
                                          str(make_tiny("mixtral", Path(tmp) / "mixtral")))
            rows += bench_decode_steps(model, cuda, reps, label=args.decode_model or (
                "demo" if cuda else "tiny random mixtral"))
    out = {"device": torch.cuda.get_device_name() if cuda else "no GPU", "dtype": str(dt),
           "reps": reps, "rows": rows}
    if not cuda:
        out["note"] = ("no GPU: references timed alone, the kernels need CUDA; the decode step "
                       "eager alone (CUDA graphs need CUDA)")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
