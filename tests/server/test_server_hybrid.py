"""The server serves a tiny qwen3_5_moe (linear attention layers, shared expert) and a tiny
deepseek_v3 (latent attention, grouped routing) through the official `openai` client,
streaming and not, and says what the offline engine says."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from ftrs_server_harness import ServerProcess

pytest.importorskip("ftrs.engine.core")
openai = pytest.importorskip("openai")

MSGS = [{"role": "user", "content": "Hello, hybrid model"}]


@pytest.fixture(scope="module", params=["qwen3_5_moe", "deepseek_v3"])
def model(request: pytest.FixtureRequest) -> Path:
    if request.param == "qwen3_5_moe":
        return request.getfixturevalue("hybrid_models")["qwen3_5_moe"]  # type: ignore[no-any-return]
    return request.getfixturevalue("deepseek_models")["q_lora"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[ServerProcess]:
    s = ServerProcess(["--model", str(model), "--served-model-name",
                       "tiny", "--device", "cpu", "--dtype", "float32"], api_key=None, backend=None)
    try:
        s.wait("ok")
        yield s
    finally:
        s.stop()


def test_openai_client_streaming_and_not(server: ServerProcess, model: Path) -> None:
    from ftrs import LLM
    from ftrs.sampling import SamplingParams

    llm = LLM(str(model), device="cpu", dtype="float32")
    try:
        expected = llm.generate([llm.chat_prompt(MSGS)], SamplingParams(max_tokens=10,
                                                                        temperature=0))[0]
        prompt = [5, 9, 100, 200, 300, 17, 33]
        tokens = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0,
                                                       ignore_eos=True))[0].text
    finally:
        llm.close()
    assert expected.text and tokens  # something to compare
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    full = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=10,
                                          temperature=0)
    assert full.choices[0].message.content == expected.text
    assert full.usage.completion_tokens == len(expected.token_ids)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    # completions, token-id prompt, streamed: the same text as offline
    parts = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in parts if c.choices) == tokens
