"""The server with `--speculative-ngram`: a tiny llama on the CPU, over real HTTP with the
official client. Streamed greedy text equals `LLM.generate`'s (a step may bring several tokens),
and `/metrics` counts drafted and accepted tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from ftrs_server_harness import ServerProcess, scrape

pytest.importorskip("ftrs.engine.core")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ftrs.models.tiny import make_tiny

    return make_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama", seed=1)


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(["--model", str(tiny_model), "--served-model-name", "tiny", "--device",
                          "cpu", "--dtype", "float32", "--speculative-ngram", "8"],
                         api_key=None, backend=None)
    try:
        proc.wait("ok")
        yield proc
    finally:
        proc.stop()


def test_streamed_greedy_tokens_equal_llm_generate(server: ServerProcess, tiny_model: Path) -> None:
    import openai

    from ftrs import LLM
    from ftrs.sampling import SamplingParams

    prompts = [[7] * 25, [76, 462, 252, 462, 252, 40, 41], list(range(100, 140))]
    llm = LLM(str(tiny_model), device="cpu", dtype="float32")
    try:
        params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
        expected = [llm.tokenizer.decode(c.token_ids) for c in llm.generate(prompts, params)]
    finally:
        llm.close()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    for prompt, want in zip(prompts, expected):
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=48,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
    m = scrape(server.url)
    drafted, accepted = m["ftrs_spec_draft_tokens_total"], m["ftrs_spec_accepted_tokens_total"]
    assert 0 <= accepted <= drafted
    assert m["ftrs_generation_tokens_total"] == 3 * 48


def test_seeded_sampled_stream_with_logprobs_equals_llm_generate(server: ServerProcess,
                                                                 tiny_model: Path) -> None:
    """Sampled rows draft too (`engine/spec.py`): with a seed the streamed text is the one
    `LLM.generate` draws without drafts, and every token has its logprob record."""
    import openai

    from ftrs import LLM
    from ftrs.sampling import SamplingParams

    prompt = [76, 462, 252, 462, 252, 40, 41] * 3
    llm = LLM(str(tiny_model), device="cpu", dtype="float32")
    try:
        params = SamplingParams(max_tokens=40, temperature=0.5, seed=11, ignore_eos=True)
        want = llm.tokenizer.decode(llm.generate([prompt], params)[0].token_ids)
    finally:
        llm.close()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0.5,
                                       seed=11, logprobs=2, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == want
    records = [t for c in chunks if c.logprobs for t in c.logprobs.token_logprobs or []]
    assert len(records) == 40
