"""The OpenAI endpoints over real HTTP, driven by the official `openai` client (fake engine)."""

from __future__ import annotations

import concurrent.futures as cf
import uuid
from typing import Any

import httpx
import openai
from fake_backend import TEXT, ByteTokenizer
from ftrs_server_harness import ServerProcess

MODEL = "fake"


def _chat(client: Any, content: str, **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def test_models_lists_the_served_model(client: Any) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]


def test_chat_completion_counts_usage(client: Any) -> None:
    prompt = "hello " + uuid.uuid4().hex
    r = _chat(client, prompt, max_tokens=12, temperature=0)
    chat_text = ByteTokenizer().apply_chat_template([{"role": "user", "content": prompt}])
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(chat_text.encode())
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # the fake engine emits a window of TEXT: the reply is 12 bytes of it, decoded
    windows = {ByteTokenizer().decode(list((TEXT * 2)[i : i + 12])) for i in range(len(TEXT))}
    assert r.choices[0].message.content in windows


def test_completion_accepts_text_and_token_prompts(client: Any) -> None:
    ids = list(b"token prompt ") + list(uuid.uuid4().hex.encode())
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0,
                                       extra_body={"return_token_ids": True})
    choice = by_ids.choices[0]
    assert by_ids.usage.prompt_tokens == len(ids)
    assert choice.token_ids is not None and len(choice.token_ids) == 10  # type: ignore[attr-defined]
    assert choice.text == ByteTokenizer().decode(choice.token_ids)  # type: ignore[attr-defined]
    by_text = client.completions.create(model=MODEL, prompt="some text", max_tokens=5)
    assert by_text.usage.prompt_tokens == len(b"some text") + 1  # + BOS
    assert by_text.usage.completion_tokens == 5


def test_streamed_chat_equals_the_non_streamed_reply(client: Any) -> None:
    prompt = "stream me " + uuid.uuid4().hex
    full = _chat(client, prompt, max_tokens=40, temperature=0).choices[0].message.content
    chunks = list(_chat(client, prompt, max_tokens=40, temperature=0, stream=True,
                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == full
    # a piece is released only once its characters are complete (the last may be cut by length)
    assert not any(p.endswith("\ufffd") for p in pieces[:-1])
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40


def test_streamed_completion_without_usage_has_no_usage_chunk(client: Any) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=6, stream=True))
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_truncates_and_finishes_with_stop(client: Any) -> None:
    prompt = "stop test " + uuid.uuid4().hex
    full = _chat(client, prompt, max_tokens=60, temperature=0).choices[0].message.content
    stop = full[20:23]
    expected = full[: full.index(stop)]
    r = _chat(client, prompt, max_tokens=60, temperature=0, stop=[stop])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 60
    chunks = list(_chat(client, prompt, max_tokens=60, temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_eos_finishes_with_stop(client: Any) -> None:
    r = client.completions.create(model=MODEL, prompt="end at EOS", max_tokens=50, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 4


def test_same_seed_same_output(client: Any) -> None:
    def sample(seed: int) -> str:
        return str(_chat(client, "seeded", max_tokens=16, temperature=1.0, seed=seed).choices[0].message.content)

    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(1, 6)}) > 1


def test_repeated_prompt_reports_cached_tokens(client: Any) -> None:
    prompt = "a shared system prompt, long enough for a few pages " * 2 + uuid.uuid4().hex
    first = _chat(client, prompt, max_tokens=2)
    second = _chat(client, prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached <= second.usage.prompt_tokens


def test_logprobs_have_the_openai_shape(client: Any) -> None:
    r = _chat(client, "lp", max_tokens=3, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(c.top_logprobs) == 2 and isinstance(c.logprob, float) for c in content)
    c = client.completions.create(model=MODEL, prompt="lp", max_tokens=3, logprobs=1)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3


def test_logprobs_end_where_a_stop_string_cuts_the_text(client: Any) -> None:
    """The entries of the tokens of the matched stop string (and of those held back as a
    possible one) were returned: 20 entries for 14 characters of content. `usage` still counts
    every token generated."""
    said = "SAY:one two three four five"  # fake engine: these bytes, one token each
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 40, "temperature": 0, "stop": ["four f"]}
    r = _chat(client, said, logprobs=True, **{k: v for k, v in kw.items() if k != "model"})
    assert r.choices[0].message.content == "one two three "
    assert "".join(t.token for t in r.choices[0].logprobs.content) == "one two three "
    assert r.usage.completion_tokens == len("one two three four f")
    chunks = list(_chat(client, said, logprobs=True, stream=True,
                        **{k: v for k, v in kw.items() if k != "model"}))
    streamed = [t.token for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content or []]
    assert "".join(streamed) == "one two three "
    c = client.completions.create(prompt=said, logprobs=1, **kw)
    assert c.choices[0].text == "one two three "
    assert "".join(c.choices[0].logprobs.tokens) == "one two three "
    assert c.choices[0].logprobs.text_offset == list(range(len("one two three ")))
    assert c.usage.completion_tokens == len("one two three four f")
    parts = [p.choices[0] for p in client.completions.create(prompt=said, logprobs=1, stream=True, **kw)]
    assert "".join(t for p in parts if p.logprobs for t in p.logprobs.tokens) == "one two three "


def test_greedy_outputs_are_the_same_alone_and_among_16_concurrent(client: Any) -> None:
    prompts = [f"concurrent {i} {uuid.uuid4().hex}" for i in range(16)]

    def run(p: str) -> str:
        return str(client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0).choices[0].text)

    alone = [run(p) for p in prompts[:4]]
    with cf.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, prompts))
    assert together[:4] == alone


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(fake_server: ServerProcess) -> None:
    url, h = fake_server.url, fake_server.headers
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    cases: list[tuple[str, dict[str, Any], int, str]] = [
        ("invalid json", {"content": b"{not json", "headers": {**h, "content-type": "application/json"}}, 400, "invalid_request"),
        ("missing field", {"json": {"model": MODEL}}, 400, "invalid_request"),
        ("mistyped field", {"json": {**chat, "max_tokens": "many"}}, 400, "invalid_request"),
        ("negative max_tokens", {"json": {**chat, "max_tokens": -1}}, 400, "invalid_request"),
        ("temperature < 0", {"json": {**chat, "temperature": -0.5}}, 400, "invalid_request"),
        ("n above --max-n", {"json": {**chat, "n": 9}}, 400, "invalid_request"),
        ("prompt too long", {"json": {**chat, "messages": [{"role": "user", "content": "x" * 600}]}}, 400, "context_length_exceeded"),
        ("unknown model", {"json": {**chat, "model": "nope"}}, 404, "model_not_found"),
        ("wrong api key", {"json": chat, "headers": {"Authorization": "Bearer wrong"}}, 401, "invalid_api_key"),
        ("no api key", {"json": chat, "headers": {}}, 401, "invalid_api_key"),
    ]
    for name, kw, status, code in cases:
        kw.setdefault("headers", h)
        r = httpx.post(url + "/v1/chat/completions", timeout=10, **kw)
        assert r.status_code == status, (name, r.text)
        err = r.json()["error"]
        assert err["code"] == code, (name, err)
        assert set(err) == {"message", "type", "param", "code"} and err["message"], name
        ok = httpx.post(url + "/v1/chat/completions", json={**chat, "max_tokens": 2}, headers=h, timeout=10)
        assert ok.status_code == 200, (name, ok.text)
    assert httpx.get(url + "/v1/models", timeout=5).status_code == 401


def test_openai_client_raises_typed_errors(client: Any) -> None:
    for kw, exc in (({"temperature": -1}, openai.BadRequestError), ({"model": "nope"}, openai.NotFoundError)):
        args = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **kw}
        try:
            client.chat.completions.create(**args)
        except exc as e:
            assert e.body["code"] in ("invalid_request", "model_not_found")  # type: ignore[index]
        else:
            raise AssertionError(f"{kw} did not fail")


def test_a_request_the_engine_refuses_is_an_http_error_streamed_or_not(client: Any) -> None:
    for stream in (False, True):
        try:
            r = client.completions.create(model=MODEL, prompt="__refuse__", max_tokens=4, stream=stream)
            list(r) if stream else None
        except openai.APIStatusError as e:
            assert e.status_code == 503
            assert e.body["code"] == "overloaded"  # type: ignore[index]
        else:
            raise AssertionError(f"stream={stream}: the refused request succeeded")
    assert client.completions.create(model=MODEL, prompt="fine", max_tokens=2).usage.completion_tokens == 2
