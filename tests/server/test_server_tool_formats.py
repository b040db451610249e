"""Every tool-call family end to end: a named `tool_choice` on the tiny model, served with
`--tool-parser` set to the family, over real HTTP with the official `openai` client. The grammar
forces the family's format (its tags as the special tokens they are in the family's
tokenizers), the parser reads it back from the streamed text, and the call's
arguments follow the tool's schema, whole and streamed (`live_agent.check_forced_call`). Hermes,
the default, runs in `test_server_agent.py`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from live_agent import check_forced_call, openai_client, tiny_server

from ftrs.server.toolcalls import TOOL_PARSERS


@pytest.fixture(scope="module", params=["mistral", "llama3_json", "deepseek_v3", "deepseek_v31",
                                               "kimi_k2", "glm45", "qwen3_coder", "minimax_m2",
                                               "gpt_oss"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Any]:
    pytest.importorskip("ftrs.engine.core")
    # the family's tags are special tokens of the tokenizer, as in the models that write them
    with tiny_server(tmp_path_factory.mktemp("tiny"), "--tool-parser", request.param,
                     specials=TOOL_PARSERS[request.param].special_tags) as proc:
        yield proc


def test_the_server_says_which_format_it_reads(server: Any, request: pytest.FixtureRequest) -> None:
    family = request.node.callspec.params["server"]
    assert f"chat: tool calls read as {family}, reasoning as none" in server.log.read_text()


def test_a_forced_call_in_the_familys_format_is_read_back(server: Any) -> None:
    # one call (parallel off): the tiny model's random text would fill max_tokens with calls
    check_forced_call(openai_client(server), "tiny", parallel=False)
