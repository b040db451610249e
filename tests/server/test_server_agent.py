"""What agents ask of the server: n > 1, logit_bias, tools and tool_choice, response_format,
reasoning_content, over real HTTP with the official `openai` client.

The fake engine (fake_backend.py) checks the HTTP side alone; the tiny model and the demo MoE
check it end to end (`test_server_agent_live` below)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from ftrs.sampling import SEED_MAX
from ftrs.server.prepare import choice_seed

MODEL = "fake"
MSGS = [{"role": "user", "content": "pick a number"}]


def test_choice_seeds_are_distinct_and_stay_in_range() -> None:
    for seed in (0, 7, SEED_MAX - 3, SEED_MAX):
        seeds = [choice_seed(seed, i) for i in range(8)]
        assert seeds[0] == seed and len(set(seeds)) == 8
        assert all(s <= SEED_MAX for s in seeds)
    assert [choice_seed(5, i) for i in range(3)] == [5, 6, 7]


def test_n_choices_are_the_requests_seeded_seed_plus_index(client: Any) -> None:
    many = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=1.0,
                                          seed=40, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    alone = [client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=1.0,
                                            seed=40 + i).choices[0].message.content for i in range(3)]
    assert [c.message.content for c in many.choices] == alone
    assert len(set(alone)) == 3
    assert many.usage.completion_tokens == 3 * 6
    assert many.usage.prompt_tokens == client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=1).usage.prompt_tokens  # counted once


def test_n_choices_stream_with_their_index(client: Any) -> None:
    full = client.completions.create(model=MODEL, prompt="count", max_tokens=5, temperature=1.0,
                                     seed=9, n=4)
    stream = client.completions.create(model=MODEL, prompt="count", max_tokens=5, temperature=1.0,
                                       seed=9, n=4, stream=True, stream_options={"include_usage": True})
    text: dict[int, str] = defaultdict(str)
    finished: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            text[c.index] += c.text
            if c.finish_reason:
                finished[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert [text[i] for i in range(4)] == [c.text for c in full.choices]
    assert finished == {i: "length" for i in range(4)}
    assert usage is not None and usage.completion_tokens == 20 == full.usage.completion_tokens

    chat = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, temperature=1.0,
                                          seed=3, n=2, stream=True)
    roles: set[int] = set()
    content: dict[int, str] = defaultdict(str)
    for chunk in chat:
        for c in chunk.choices:
            if c.delta.role == "assistant":
                roles.add(c.index)
            content[c.index] += c.delta.content or ""
    assert roles == {0, 1}
    assert content[0] != content[1] and all(len(content[i]) > 0 for i in (0, 1))


def test_n_above_max_n_is_a_400_and_the_server_serves_on(client: Any) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, n=9)
    assert e.value.body["param"] == "n" and "--max-n" in e.value.body["message"]
    ok = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, n=8)
    assert len(ok.choices) == 8

