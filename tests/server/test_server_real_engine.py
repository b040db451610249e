"""The server on the real engine (a tiny llama checkpoint, fp32 on the CPU).

Greedy tokens from the server equal `ftrs.LLM.generate`'s, for a request alone and among 16
concurrent ones; a repeated prompt is served from the prefix cache; a client that disconnects
mid-stream gives its KV pages back.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ftrs_server_harness import ServerProcess, scrape

pytest.importorskip("ftrs.engine.core")
pytest.importorskip("ftrs.llm")

OPTIONS = ["--device", "cpu", "--dtype", "float32"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ftrs.models.tiny import make_tiny

    return make_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama", seed=0)


@pytest.fixture(scope="module")
def real_server(tiny_model: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(["--model", str(tiny_model), "--served-model-name", "tiny", *OPTIONS],
                           api_key=None, backend=None)
    try:
        server.wait("ok")
        yield server
    finally:
        server.stop()


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


def _complete(server: ServerProcess, prompt: list[int], **kw: Any) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "return_token_ids": True, **kw}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_greedy_tokens_equal_llm_generate_alone_and_among_16(real_server: ServerProcess, tiny_model: Path) -> None:
    from ftrs import LLM
    from ftrs.sampling import SamplingParams

    prompts = _prompts(16)
    llm = LLM(str(tiny_model), device="cpu", dtype="float32")
    try:
        expected = [c.token_ids for c in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))]
    finally:
        llm.close()
    alone = [_complete(real_server, p)["choices"][0]["token_ids"] for p in prompts[:3]]
    assert alone == expected[:3]
    with cf.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: _complete(real_server, p)["choices"][0]["token_ids"], prompts))
    assert together == expected


def test_openai_client_chat_stream_and_seed(real_server: ServerProcess) -> None:
    import openai

    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "Hello, tiny model"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    streamed = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    seeded = [client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=1.0,
                                             seed=1234).choices[0].message.content for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_repeated_prompt_is_served_from_the_prefix_cache(real_server: ServerProcess) -> None:
    prompt = _prompts(1, seed=99)[0] * 4  # > 2 pages of 16 tokens
    first = _complete(real_server, prompt, max_tokens=2)
    second = _complete(real_server, prompt, max_tokens=2)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


def test_disconnect_mid_stream_returns_kv_usage_to_idle(real_server: ServerProcess) -> None:
    url = real_server.url
    idle = scrape(url)["ftrs_kv_cache_usage_ratio"]
    body = {"model": "tiny", "prompt": _prompts(1, seed=5)[0], "max_tokens": 1500, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(8):
            next(lines)
        assert scrape(url)["ftrs_requests_running"] >= 1
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = scrape(url)
        if m["ftrs_requests_running"] == 0 and m["ftrs_kv_cache_usage_ratio"] <= idle:
            break
        time.sleep(0.1)
    m = scrape(url)
    assert m["ftrs_requests_running"] == 0
    assert m["ftrs_kv_cache_usage_ratio"] <= idle


def test_out_of_range_sampling_is_a_400_and_the_engine_serves_on(real_server: ServerProcess) -> None:
    import openai

    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": "Hello"}]
    bad: list[dict[str, Any]] = [
        {"seed": -(2**63) - 1}, {"seed": 2**64},  # torch.Generator.manual_seed's range
        {"repetition_penalty": 1e-300}, {"repetition_penalty": 1e300},  # logits * p overflows
        {"temperature": 1e308}, {"temperature": 3.0},
    ]
    for kw in bad:
        args = {k: v for k, v in kw.items() if k in ("seed", "temperature")}
        extra = {k: v for k, v in kw.items() if k not in args}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4,  # type: ignore[call-overload]
                                           **({"temperature": 1.0} | args), extra_body=extra)
        assert e.value.body["param"] == next(iter(kw)), kw  # type: ignore[index]
        ok = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=1.0,
                                            seed=2**64 - 1)  # the top of the seed range is fine
        assert ok.usage is not None and ok.usage.completion_tokens == 4, kw


def test_a_tiny_temperature_samples_the_argmax(real_server: ServerProcess) -> None:
    prompt = _prompts(1, seed=11)[0]
    greedy = _complete(real_server, prompt, temperature=0)["choices"][0]["token_ids"]
    for t in (1e-40, 1e-300, 5e-324):  # logits / T would overflow float32 to inf, then NaN
        tiny = _complete(real_server, prompt, temperature=t, seed=3)["choices"][0]["token_ids"]
        assert tiny == greedy, t  # softmax(logits / T) tends to the argmax as T -> 0


def test_max_model_len_is_capped_by_the_kv_pool(tiny_model: Path) -> None:
    from ftrs.config import EngineConfig
    from ftrs.engine.core import EngineCore
    from ftrs.engine.protocol import GenerateRequest
    from ftrs.errors import ContextLengthExceeded
    from ftrs.sampling import SamplingParams

    engine = EngineCore(EngineConfig(model=str(tiny_model), device="cpu", dtype="float32",
                                     kv_tokens=64, page_size=16), progress=False)
    try:
        assert engine.max_model_len == 64  # 4 pages of 16 tokens; the model's context is longer
        engine.add_request(GenerateRequest("fits", [5] * 60, SamplingParams(max_tokens=4)))
        with pytest.raises(ContextLengthExceeded):
            engine.add_request(GenerateRequest("over", [5] * 61, SamplingParams(max_tokens=4)))
    finally:
        close = getattr(engine, "close", None)
        if callable(close):
            close()


def test_an_int8_kv_server_tells_its_cache_and_serves_llm_generates_tokens(
        real_server: ServerProcess, tiny_model: Path) -> None:
    """`--kv-cache-dtype int8` end to end: `/health` says what the cache holds (the plain
    server's too), and greedy tokens over HTTP equal `LLM.generate`'s over the same int8 cache."""
    from ftrs import LLM
    from ftrs.sampling import SamplingParams

    plain = httpx.get(real_server.url + "/health", timeout=30).json()["kv_cache"]
    assert plain["dtype"] == "float32" and plain["tokens"] > 0 and plain["bytes"] > 0
    server = ServerProcess(["--model", str(tiny_model), "--served-model-name", "tiny", *OPTIONS,
                            "--kv-cache-dtype", "int8", "--kv-tokens", str(plain["tokens"])],
                           api_key=None, backend=None)
    try:
        server.wait("ok")
        kv = httpx.get(server.url + "/health", timeout=30).json()["kv_cache"]
        assert kv["dtype"] == "int8" and kv["tokens"] == plain["tokens"]
        assert kv["bytes"] < plain["bytes"] / 2
        prompts = _prompts(3, seed=5)
        got = [_complete(server, p)["choices"][0]["token_ids"] for p in prompts]
    finally:
        server.stop()
    llm = LLM(str(tiny_model), device="cpu", dtype="float32", kv_cache_dtype="int8",
              kv_tokens=plain["tokens"])
    try:
        want = [o.token_ids for o in llm.generate(
            prompts, SamplingParams(max_tokens=12, temperature=0))]
    finally:
        llm.close()
    assert got == want
