"""`thinking_token_budget` over real HTTP with the official `openai` client, on the tiny model
served with the `qwen3` reasoning parser and `<think>`/`</think>` as special tokens. A
`logit_bias` makes every sampled token `<think>`: the first opens the block, the rest are
reasoning, and only the budget can close it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from live_agent import openai_client, tiny_server

from ftrs.models.tiny import tiny_tokenizer

TAGS = ("<think>", "</think>")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("ftrs.engine.core")
    with tiny_server(tmp_path_factory.mktemp("tiny"), "--reasoning-parser", "qwen3",
                     specials=TAGS) as proc:
        yield proc


def answer(server: Any, **extra: Any) -> tuple[str | None, str | None, int]:
    open_id = tiny_tokenizer(512, TAGS).tk.token_to_id("<think>")
    r = openai_client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
        temperature=1.0, seed=3, logit_bias={str(open_id): 100}, extra_body=extra)
    m = r.choices[0].message
    assert r.usage is not None
    return m.content, (m.model_extra or {}).get("reasoning_content"), r.usage.completion_tokens


def test_the_budget_closes_the_block_and_the_model_answers(server: Any) -> None:
    content, reasoning, used = answer(server, thinking_token_budget=3)
    # 12 tokens: <think>, 3 of reasoning, the written end ("\n", "</think>", "\n\n": 4 tokens
    # of the tiny byte-level vocabulary), then 4 of answer
    assert (reasoning, content, used) == ("<think>" * 3, "<think>" * 4, 12)


def test_without_a_budget_the_block_takes_every_token(server: Any) -> None:
    content, reasoning, used = answer(server)
    assert (reasoning, content or "", used) == ("<think>" * 11, "", 12)
