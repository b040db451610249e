"""The reasoning budget (`thinking_token_budget`, Anthropic's `thinking.budget_tokens`): after
that many tokens inside `<think>`, the engine writes the block's end itself, and the model
answers after it. A tiny llama whose tokenizer holds `<think>` and `</think>` as special tokens;
`logit_bias` keeps its random weights from closing (or makes it open) the block, so the test
knows where the budget, not the model, ended it."""

from __future__ import annotations

from typing import Any

import pytest

from ftrs.llm import LLM
from ftrs.models.tiny import make_tiny, tiny_tokenizer
from ftrs.sampling import ReasoningBudget, SamplingParams

TAGS = ("<think>", "</think>")
PROMPT = [5, 9, 100, 200, 300, 17]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = make_tiny("llama", tmp_path_factory.mktemp("budget") / "llama", seed=0, specials=TAGS)
    engine = LLM(str(model), kv_tokens=512, dtype="float32")
    yield engine
    engine.close()


def ids(llm: Any) -> tuple[int, int, tuple[int, ...]]:
    tok = llm.tokenizer
    end = tuple(tok.encode("\n</think>\n\n"))
    return tok.tk.token_to_id("<think>"), tok.tk.token_to_id("</think>"), end


def run(llm: Any, budget: ReasoningBudget, bias: tuple[tuple[int, float], ...],
        n: int = 14) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=1.0, seed=3, ignore_eos=True,
                            logit_bias=bias, reasoning_budget=budget)
    return list(llm.generate([PROMPT], params)[0].token_ids)


@pytest.mark.parametrize("tokens", [0, 1, 4])
def test_a_block_the_prompt_opened_ends_after_the_budget(llm: Any, tokens: int) -> None:
    open_id, close_id, end = ids(llm)
    assert close_id in end and len(end) > 1  # "\n", "</think>", "\n\n" (byte-level pieces)
    out = run(llm, ReasoningBudget(tokens, open_id, close_id, end, opened=True),
              ((close_id, -100.0),))  # the model itself never closes it
    assert close_id not in out[:tokens]
    assert tuple(out[tokens:tokens + len(end)]) == end
    assert out.count(close_id) == 1  # once closed, nothing more is forced


def test_a_block_the_model_opens_is_counted_from_its_tag(llm: Any) -> None:
    open_id, close_id, end = ids(llm)
    out = run(llm, ReasoningBudget(3, open_id, close_id, end), ((open_id, 100.0),), n=16)
    # <think>, three tokens (more <think>: the bias), the end; then the bias opens no new
    # block: a closed block stays closed
    assert out[:4] == [open_id] * 4
    assert tuple(out[4:4 + len(end)]) == end
    assert out[4 + len(end):] == [open_id] * (16 - 4 - len(end))


def test_a_block_the_model_closes_in_time_is_left_alone(llm: Any) -> None:
    open_id, close_id, end = ids(llm)
    out = run(llm, ReasoningBudget(5, open_id, close_id, end, opened=True),
              ((close_id, 100.0),))
    assert out == [close_id] * 14  # closed at once, by the model: no end written after it


def test_without_a_budget_nothing_is_written(llm: Any) -> None:
    _, close_id, _ = ids(llm)
    params = SamplingParams(max_tokens=14, temperature=1.0, seed=3, ignore_eos=True,
                            logit_bias=((close_id, -100.0),))
    assert close_id not in llm.generate([PROMPT], params)[0].token_ids


# --- the request side ---------------------------------------------------------------------

OPENING = "{{ messages[0].content }}<|im_start|>assistant\n<think>\n"


def plan(body: dict[str, Any], template: str = OPENING, specials: tuple[str, ...] = TAGS,
         parser: str = "qwen3") -> Any:
    from ftrs.models.tokenizer import Tokenizer
    from ftrs.server.prepare import Limits, prepare_chat
    from ftrs.server.protocol import ChatCompletionRequest

    tok = Tokenizer(tiny_tokenizer(512, specials).tk, template, None, "<|im_end|>", [2])
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})
    return tok, prepare_chat(req, tok, Limits(512, 4096, 64, max_n=2, reasoning_parser=parser))


def test_the_request_budget_reaches_every_choice() -> None:
    tok, p = plan({"thinking_token_budget": 7, "n": 2, "seed": 1})
    want = ReasoningBudget(7, tok.tk.token_to_id("<think>"), tok.tk.token_to_id("</think>"),
                           tuple(tok.encode("\n</think>\n\n")), opened=True)
    assert [c.reasoning_budget for c in p.params] == [want, want]
    _, closed = plan({"thinking_token_budget": 7}, template="{{ messages[0].content }}")
    assert closed.params[0].reasoning_budget.opened is False


@pytest.mark.parametrize(("specials", "parser"), [((), "qwen3"), (TAGS, "gpt_oss")])
def test_a_budget_with_nothing_to_enforce_it_on_is_ignored(specials: tuple[str, ...],
                                                           parser: str) -> None:
    # tags that are not single tokens of the vocabulary; harmony channels (`reasoning_effort`)
    _, p = plan({"thinking_token_budget": 7}, specials=specials, parser=parser)
    assert p.params[0].reasoning_budget is None


def test_a_negative_budget_is_a_400() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="thinking_token_budget"):
        plan({"thinking_token_budget": -1})


def test_anthropic_budget_tokens_is_the_budget() -> None:
    from ftrs.server.anthropic_protocol import MessagesRequest, to_chat

    def chat(thinking: dict[str, Any]) -> Any:
        return to_chat(MessagesRequest.model_validate({
            "model": "m", "max_tokens": 64, "thinking": thinking,
            "messages": [{"role": "user", "content": "hi"}]})).chat

    assert chat({"type": "enabled", "budget_tokens": 1024}).thinking_token_budget == 1024
    assert chat({"type": "disabled"}).thinking_token_budget is None


def test_the_budget_module_needs_no_engine() -> None:
    """`forced_token`/`after_token` on a bare sequence: the count, the end, then nothing."""
    from ftrs.engine.budget import after_token, forced_token
    from ftrs.scheduler.sequence import Sequence

    b = ReasoningBudget(2, 10, 11, (12, 11, 13), opened=False)
    s = Sequence("r", [1, 2], 2, SamplingParams(reasoning_budget=b), 0, 0.0)
    written = []
    for sampled in (7, 10, 7, 7, 99, 99, 99, 10, 7, 7, 7):
        tok = forced_token(s)
        tok = sampled if tok is None else tok
        s.tokens.append(tok)
        after_token(s, tok)
        written.append(tok)
    assert written == [7, 10, 7, 7, 12, 11, 13, 10, 7, 7, 7]
