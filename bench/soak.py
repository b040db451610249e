"""Soak test: N concurrent streaming clients for T seconds against `ftrs serve`.

Each client sends seeded requests back to back until the deadline. Pass: zero errors, every
request finishes (a finish_reason and `[DONE]`), and the resident memory of the API and engine
processes, sampled at the start (after a warm-up) and at the end, is printed with its growth.
JSON on stdout; exit 1 on any error.

    python bench/soak.py                              # demo model, 64 clients, 60 s
    python bench/soak.py --model DIR --clients 8 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

log = logging.getLogger("bench.soak")
_HERE = os.path.dirname(os.path.abspath(__file__))


def _serve_module() -> Any:
    spec = importlib.util.spec_from_file_location("ftrs_bench_serve", os.path.join(_HERE, "serve.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


serve = _serve_module()


def rss(pids: dict[str, int]) -> dict[str, int]:
    out = {}
    for name, pid in pids.items():
        try:
            out[name] = int(psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            out[name] = -1
    return out


async def soak(url: str, model: str, clients: int, seconds: float, seed: int, vocab: int,
               prompt_range: tuple[int, int], out_range: tuple[int, int]) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    results: list[Any] = []
    errors: list[str] = []
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def worker(i: int) -> None:
            rng = random.Random(seed * 100003 + i)
            while time.monotonic() < deadline:
                req = serve.Req([rng.randrange(10, vocab) for _ in range(rng.randint(*prompt_range))],
                                rng.randint(*out_range))
                res = await serve.stream_request(client, url, model, req)
                results.append(res)
                if not res.ok:
                    errors.append(res.error or f"unfinished (finish_reason={res.finish_reason})")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(clients)))
        wall = time.perf_counter() - t0
    summary = serve.summarize(results, wall)
    summary["error_samples"] = errors[:5]
    return summary


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--url", default=None, help="use a running server (RSS then needs --server-pid)")
    p.add_argument("--server-pid", type=int, default=None)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--prompt-len", default="16,512")
    p.add_argument("--max-tokens", default="16,128")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args, engine_args = p.parse_known_args(argv)
    proc = None
    if args.url is None:
        proc, url = serve.start_server(args.model, engine_args,
                                       Path(os.environ.get("TMPDIR", "/tmp")) / "ftrs-bench-soak.log")
        server_pid: int | None = proc.pid
    else:
        url, server_pid = args.url.rstrip("/"), args.server_pid
    try:
        health = httpx.get(url + "/health", timeout=10).json()
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        pids = {"engine": int(health["engine_pid"])}
        if server_pid is not None:
            pids["api"] = server_pid
        lo, hi = serve.pair(args.prompt_len)
        orange = serve.pair(args.max_tokens)
        prange = (lo, min(hi, int(health["max_model_len"]) - orange[1] - 1))
        vocab = int(health["vocab_size"])
        # warm-up: allocator pools and caches fill before the first sample
        asyncio.run(soak(url, model, min(args.clients, 8), 2.0, args.seed + 1, vocab, prange, orange))
        rss_start = rss(pids)
        log.info("soak: %d clients for %.0f s against %s", args.clients, args.seconds, url)
        summary = asyncio.run(soak(url, model, args.clients, args.seconds, args.seed, vocab, prange, orange))
        rss_end = rss(pids)
    finally:
        if proc is not None:
            serve.stop_server(proc)
    report = {
        "clients": args.clients, "seconds": args.seconds, **summary,
        "rss_bytes": {"start": rss_start, "end": rss_end},
        "rss_growth_ratio": {k: round(rss_end[k] / rss_start[k], 4) for k in pids if rss_start[k] > 0},
    }
    text = json.dumps(report, indent=2)
    sys.stdout.write(text + "\n")
    if args.out:
        Path(args.out).write_text(text)
    log.info("soak: %d requests, %d errors, RSS growth %s", summary["requests"], summary["errors"],
             report["rss_growth_ratio"])
    return 0 if summary["errors"] == 0 and summary["requests"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
