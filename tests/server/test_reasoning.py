"""Reasoning parser: hand-written outputs of thinking models, fed whole and in every piece size
(so tags split across pieces); expected reasoning and content written out."""

from __future__ import annotations

import pytest

from ftrs.errors import ConfigError
from ftrs.server.reasoning import (
    REASONING_PARSERS,
    choose_reasoning_parser,
    opens_reasoning,
)

CHUNKS = (1, 2, 3, 5, 10_000)


def run(parser: str, text: str, chunk: int, **kw: bool) -> tuple[str, str]:
    p = REASONING_PARSERS[parser](**kw)
    reasoning = content = ""
    for i in range(0, len(text), chunk):
        r, c = p.feed(text[i:i + chunk])
        reasoning += r
        content += c
    r, c = p.finish()
    return reasoning + r, content + c


CASES = [  # (parser, starts_in_reasoning, output, reasoning, content)
    ("qwen3", None, "<think>\nThe user greets me.\n</think>\n\nHello!", "The user greets me.",
     "Hello!"),
    ("qwen3", None, "<think>\n\n</think>\n\nNo thinking today.", "", "No thinking today."),
    ("qwen3", None, "Just an answer with a <think> tag inside.",
     "", "Just an answer with a <think> tag inside."),
    ("qwen3", None, "  <thi", "", "  <thi"),
    ("qwen3", None, "<think>\nCut off while thinking </thi", "Cut off while thinking </thi", ""),
    ("qwen3", None, "<think>a < b </ think> still</think>yes", "a < b </ think> still", "yes"),
    ("deepseek_r1", None, "Two and two.\n</think>\n\n4", "Two and two.", "4"),
    ("deepseek_r1", None, "<think>\nRepeated tag.</think>4", "Repeated tag.", "4"),
    ("qwen3", True, "Opened by the template.</think>Answer.", "Opened by the template.", "Answer."),
    ("deepseek_r1", False, "No reasoning here.", "", "No reasoning here."),
]


@pytest.mark.parametrize(("parser", "starts", "output", "reasoning", "content"), CASES)
def test_reasoning_is_split_from_content(parser: str, starts: bool | None, output: str,
                                         reasoning: str, content: str) -> None:
    kw = {} if starts is None else {"starts_in_reasoning": starts}
    for chunk in CHUNKS:
        assert run(parser, output, chunk, **kw) == (reasoning, content), chunk


def test_reasoning_streams_before_the_close_tag() -> None:
    p = REASONING_PARSERS["qwen3"]()
    assert p.feed("<think>\nStep one") == ("Step one", "")
    assert p.feed(". </th") == (".", "")
    assert p.feed("ink>\n\nDone") == ("", "Done")
    assert p.finish() == ("", "")


def test_opens_reasoning_reads_the_rendered_prompt() -> None:
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_reasoning("<|im_start|>assistant\n")


def test_choose_reasoning_parser() -> None:
    assert choose_reasoning_parser("deepseek_r1", None) == "deepseek_r1"
    with pytest.raises(ConfigError) as e:
        choose_reasoning_parser("r2", "<think>")
    assert "qwen3" in str(e.value) and "deepseek_r1" in str(e.value)
    assert choose_reasoning_parser(None, "{{ '<think>\\n\\n</think>' }}") == "qwen3"
    assert choose_reasoning_parser(None, "<｜Assistant｜><think>\\n") == "deepseek_r1"
    assert choose_reasoning_parser(None, "<|im_start|>assistant") is None
    assert choose_reasoning_parser(None, None) is None


# --- grammars that let a thinking model think first ----------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("opened", [False, True])
def test_a_structured_answer_may_follow_a_think_block(special: bool, opened: bool) -> None:
    """response_format on a `<think>` model: the grammar lets it think first (the block closed
    before the answer; required to close when the prompt opened it), whether its tokenizer holds
    the tags as special tokens or as text; the reasoning parser stays on and splits it out."""
    import llguidance

    from ftrs.engine import grammar
    from ftrs.models.tiny import tiny_tokenizer
    from ftrs.models.tokenizer import Tokenizer
    from ftrs.server.prepare import Limits, prepare_chat
    from ftrs.server.protocol import ChatCompletionRequest

    tk = tiny_tokenizer(512, ("<think>", "</think>") if special else ()).tk
    template = "{{ messages[0].content }}|" + ("<think>\n" if opened else "")
    tok = Tokenizer(tk, template, None, "<|im_end|>", [2])
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "a?"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}})
    plan = prepare_chat(req, tok, Limits(512, 4096, 64, reasoning_parser="qwen3"))
    spec = plan.params[0].structured
    assert plan.reasoning_parser == "qwen3" and spec is not None and spec.lead
    assert plan.starts_in_reasoning is (True if opened else None)

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(grammar.ll_tokenizer(tok), grammar.grammar_text(spec),
                                 log_level=0)
        return bool(m.consume_tokens(tok.encode(text))) and m.is_accepting()

    thought = "Is a < b? </thin k> not yet.\n</think>\n\n"
    answer = '{"a": 1}'
    if opened:
        assert accepts(thought + answer)
        assert not accepts(answer)  # the prompt opened the thinking: it must close first
    else:
        assert accepts("<think>\n" + thought + answer)
        assert accepts(answer)
    assert not accepts("<think>\nNo end " + answer)
    assert not accepts('Sure: {"a": 1}')
    r, c = run("qwen3", ("" if opened else "<think>\n") + thought + answer, 3,
               **({"starts_in_reasoning": True} if opened else {}))
    assert (r, c) == ("Is a < b? </thin k> not yet.", answer)
