"""Serving benchmark: ftrs over HTTP vs transformers `generate` in static batches, one run.

Workload (seeded): prompts of 16..1024 random token ids, max_tokens 16..256, EOS ignored so
every request produces exactly its max_tokens. For each concurrency C (default 1, 8, 32), C
streaming clients drain a queue of N requests against `ftrs serve`; we report output tokens/s,
TTFT and inter-token latency p50/p90/p99. Then the same requests go through transformers
`generate` in static batches of C (left padding; each batch runs until its longest request),
and the ratio ftrs/transformers of useful output tokens/s is printed per C. JSON on stdout.

The two are not interleaved: every level runs against ftrs first, then the server is stopped
(its KV pool would otherwise hold the device's memory; a `--url` server is left idle) and
every level runs through transformers, one after the other in the same run. The JSON's `note`
says so: a host whose speed drifts during the run favours one side.

`--quick` only changes the defaults (1,4 clients, 8 requests, prompts 16..128, outputs
16..32): `--concurrency`, `--num-requests`, `--prompt-len` and `--max-tokens` given explicitly
win. With `--url` the bench does not guess which checkpoint the server holds (the path it
loaded may be another machine's), so the transformers baseline needs `--model DIR` naming it,
or `--no-hf`; `transformers_model` in the JSON is what transformers loaded. Without `--url`,
`--model` (default: the demo) is what the started server serves and transformers loads.

    python bench/serve.py                      # the demo model, full workload
    python bench/serve.py --model DIR --quick  # a small run (CI, laptops)
    python bench/serve.py --url http://127.0.0.1:8000 --served-model-name demo --no-hf
    python bench/serve.py --url http://127.0.0.1:8000 --model DIR  # DIR: what the server serves
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger("bench.serve")
ROOT = Path(__file__).resolve().parents[1]
# transformers probes for a `kernels` package, and this folder's kernels.py is not it
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


@dataclass
class Req:
    prompt: list[int]
    max_tokens: int


@dataclass
class Result:
    ok: bool
    tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    finish_reason: str | None = None
    error: str | None = None


def make_workload(n: int, seed: int, prompt_range: tuple[int, int], out_range: tuple[int, int],
                  vocab: int) -> list[Req]:
    rng = random.Random(seed)
    hi = max(vocab - 1, 16)
    return [Req([rng.randrange(10, hi) for _ in range(rng.randint(*prompt_range))], rng.randint(*out_range))
            for _ in range(n)]


# ------------------------------------------------------------------------------ the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: str, engine_args: list[str], log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m ftrs serve` on a free loopback port; returns (process, base URL) once healthy."""
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "ftrs", "serve", "--model", model, "--port", str(port), *engine_args]
    proc = subprocess.Popen(cmd, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log_path}")
        try:
            body = httpx.get(url + "/health", timeout=2).json()
            if body.get("status") == "ok":
                return proc, url
            if body.get("status") == "failed":
                raise RuntimeError(f"engine failed: {body.get('reason')}")
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError("server did not become ready")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


async def stream_request(client: httpx.AsyncClient, url: str, model: str, req: Req) -> Result:
    """One streaming completion; token counts from the `token_ids` extension of each chunk."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "return_token_ids": True}
    t0 = time.perf_counter()
    res, last = Result(ok=False), t0
    done = False
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    continue
                for c in chunk.get("choices", []):
                    n = len(c.get("token_ids") or [])
                    now = time.perf_counter()
                    if n:
                        if res.ttft is None:
                            res.ttft = now - t0
                        else:
                            res.itl.extend([(now - last) / n] * n)
                        last = now
                        res.tokens += n
                    res.finish_reason = c.get("finish_reason") or res.finish_reason
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.latency = time.perf_counter() - t0
    res.ok = done and res.error is None and res.finish_reason is not None
    return res


async def run_clients(url: str, model: str, reqs: list[Req], concurrency: int) -> tuple[list[Result], float]:
    queue: asyncio.Queue[Req] = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                results.append(await stream_request(client, url, model, queue.get_nowait()))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - t0


def pair(text: str) -> tuple[int, int]:
    """ "16,1024" -> (16, 1024)."""
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def summarize(results: list[Result], wall: float) -> dict[str, Any]:
    ttft = [r.ttft for r in results if r.ttft is not None]
    itl = [x for r in results for x in r.itl]
    tokens = sum(r.tokens for r in results)
    return {
        "requests": len(results), "errors": sum(not r.ok for r in results), "output_tokens": tokens,
        "wall_s": round(wall, 3), "output_tok_s": round(tokens / wall, 2) if wall else None,
        "ttft_s": {f"p{q}": pct(ttft, q) for q in (50, 90, 99)},
        "itl_s": {f"p{q}": pct(itl, q) for q in (50, 90, 99)},
        "itl_mean_s": statistics.fmean(itl) if itl else None,
    }


# ------------------------------------------------------------------------ transformers side


def hf_static_batches(model_dir: Path, reqs: list[Req], batch: int, device: str, dtype: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        dtype, torch.float32 if device == "cpu" else torch.bfloat16)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    model = model.to(device).eval()
    pad = 0
    with torch.inference_mode():  # warm-up, not timed
        model.generate(input_ids=torch.tensor([reqs[0].prompt[:16]], device=device), max_new_tokens=2,
                       do_sample=False, pad_token_id=pad)
    useful, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(reqs), batch):
            group = reqs[i : i + batch]
            width = max(len(r.prompt) for r in group)
            ids = torch.tensor([[pad] * (width - len(r.prompt)) + r.prompt for r in group], device=device)
            mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in group], device=device)
            longest = max(r.max_tokens for r in group)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad)
            useful += sum(r.max_tokens for r in group)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"batch": batch, "output_tokens": useful, "wall_s": round(wall, 3),
            "output_tok_s": round(useful / wall, 2)}


# ------------------------------------------------------------------------------------ main


# (full, --quick) defaults of the workload options; an option given explicitly wins over both
DEFAULTS = {"concurrency": ("1,8,32", "1,4"), "num_requests": (None, 8),
            "prompt_len": ("16,1024", "16,128"), "max_tokens": ("16,256", "16,32")}


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="checkpoint the started server serves and transformers loads (default: "
                        "the demo); with --url, required unless --no-hf")
    p.add_argument("--url", default=None, help="use a running server instead of starting one")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--concurrency", default=None, help="clients per level (default 1,8,32; --quick 1,4)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="per concurrency (default 4*C, >= 16; --quick 8)")
    p.add_argument("--prompt-len", default=None,
                   help="min,max prompt tokens (default 16,1024; --quick 16,128)")
    p.add_argument("--max-tokens", default=None,
                   help="min,max output tokens (default 16,256; --quick 16,32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="smaller defaults: 1,4 clients, 8 requests, short prompts/outputs; "
                        "the options above given explicitly win")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--device", default="auto", help="for transformers (and passed to the server)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args, rest = p.parse_known_args(argv)  # unknown options go to `ftrs serve`
    for name, (full, quick) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.model is None:
        if args.url is not None and not args.no_hf:
            p.error("--url: which checkpoint the server holds is not assumed; pass --model DIR "
                    "(the checkpoint it serves, for the transformers baseline) or --no-hf")
        args.model = "demo"
    return args, rest


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args, engine_args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    prange, orange = pair(args.prompt_len), pair(args.max_tokens)
    engine_args += ["--device", args.device, "--dtype", args.dtype]
    proc = None
    if args.url is None:
        proc, url = start_server(args.model, engine_args, Path(os.environ.get("TMPDIR", "/tmp")) / "ftrs-bench-serve.log")
    else:
        url = args.url.rstrip("/")
    try:
        model = args.served_model_name or httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        health = httpx.get(url + "/health", timeout=10).json()
        max_len, vocab = int(health["max_model_len"]), int(health["vocab_size"])
        levels_out: list[dict[str, Any]] = []
        report: dict[str, Any] = {"model": model if args.url else args.model, "url": url,
                                  "workload": {"prompt_len": prange, "max_tokens": orange,
                                               "seed": args.seed}, "levels": levels_out}
        # one seeded pool: every level runs a prefix of the same requests, so the levels'
        # tokens/s are measured on the same kind of work (the first 16 are the same requests)
        sizes = {c: args.num_requests or max(16, 4 * c) for c in levels}
        pool = make_workload(max(sizes.values()), args.seed,
                             (prange[0], min(prange[1], max_len - orange[1] - 1)), orange, vocab)
        workloads = {}
        for c in levels:
            n = sizes[c]
            reqs = pool[:n]
            workloads[c] = reqs
            asyncio.run(run_clients(url, model, reqs[: min(2, n)], 1))  # warm-up
            results, wall = asyncio.run(run_clients(url, model, reqs, c))
            level: dict[str, Any] = {"concurrency": c, "ftrs": summarize(results, wall)}
            log.info("ftrs  C=%-3d %8.1f tok/s  TTFT p50 %s  ITL p50 %s", c, level["ftrs"]["output_tok_s"],
                     level["ftrs"]["ttft_s"]["p50"], level["ftrs"]["itl_s"]["p50"])
            levels_out.append(level)
    finally:
        if proc is not None:
            stop_server(proc)
    if not args.no_hf:
        from ftrs.models import resolve_model

        report["transformers_model"] = args.model
        server = "the server at --url idle" if args.url else "the server stopped"
        report["note"] = (f"not interleaved: every level ran against ftrs, then ({server}) "
                          "every level through transformers, one after the other in this run")

        device = args.device if args.device != "auto" else ("cuda" if _has_cuda() else "cpu")
        model_dir = resolve_model(args.model)
        for level in report["levels"]:
            c = level["concurrency"]
            hf = hf_static_batches(model_dir, workloads[c], c, device, args.dtype)
            level["transformers"] = hf
            level["ratio_vs_transformers"] = round(level["ftrs"]["output_tok_s"] / hf["output_tok_s"], 3)
            log.info("hf    C=%-3d %8.1f tok/s  ratio ftrs/hf %.2fx", c, hf["output_tok_s"],
                     level["ratio_vs_transformers"])
    text = json.dumps(report, indent=2, default=_jsonable)
    sys.stdout.write(text + "\n")
    if args.out:
        Path(args.out).write_text(text)
    return 0 if all(lv["ftrs"]["errors"] == 0 for lv in report["levels"]) else 1


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def _jsonable(obj: Any) -> Any:
    return asdict(obj) if hasattr(obj, "__dataclass_fields__") else str(obj)


if __name__ == "__main__":
    sys.exit(main())
