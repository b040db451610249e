"""`LLM.generate` after a call that failed or was interrupted: the engine holds none of that
call's requests, and the next call gives what a fresh LLM gives. A closed LLM says so; prompts
of the wrong shape are refused by a typed error that says what is accepted."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import ftrs.engine.core
from ftrs.engine.protocol import GenerateRequest
from ftrs.errors import ContextLengthExceeded, InvalidRequest
from ftrs.llm import LLM
from ftrs.sampling import SamplingParams

PROMPTS = ["hello there", "the cat sat"]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tiny_models: dict[str, Path]) -> str:
    return str(tiny_models["qwen3_moe"])


@pytest.fixture(scope="module")
def reference(path: str) -> list[list[int]]:
    llm = LLM(path, kv_tokens=512)
    try:
        return [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.close()


@pytest.fixture
def llm(path: str) -> Iterator[LLM]:
    llm = LLM(path, kv_tokens=512)
    yield llm
    llm.close()


def serves_on(llm: LLM, reference: list[list[int]]) -> None:
    """The engine holds nothing of the failed call, and serves on as a fresh LLM does."""
    assert llm.engine.num_requests() == 0 and not llm.engine.has_work()
    for _ in range(2):
        assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == reference
    assert llm.generate("hello there", GREEDY)[0].token_ids == reference[0]


def test_a_bad_prompt_in_a_batch_adds_nothing(llm: LLM, reference: list[list[int]],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    added: list[str] = []
    add = llm.engine.add_request

    def spy(req: GenerateRequest) -> None:
        added.append(req.request_id)
        add(req)
    bad: Any = ["hello", 5]
    with monkeypatch.context() as m:
        m.setattr(llm.engine, "add_request", spy)
        with pytest.raises(InvalidRequest):
            llm.generate(bad, SamplingParams(max_tokens=2, temperature=0))
    assert added == []  # every prompt is checked before the first is added
    serves_on(llm, reference)


def test_a_too_long_prompt_aborts_the_ones_before_it(llm: LLM,
                                                     reference: list[list[int]]) -> None:
    with pytest.raises(ContextLengthExceeded):
        llm.generate(["hello", "x" * 600], SamplingParams(max_tokens=2, temperature=0))
    serves_on(llm, reference)


def interrupt_on_call(n: int, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, but its `n`-th call raises KeyboardInterrupt (Ctrl-C) before it runs."""
    calls = 0

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == n:
            raise KeyboardInterrupt
        return fn(*args, **kwargs)
    return wrapped


def test_ctrl_c_while_adding_aborts_the_ones_added(llm: LLM, reference: list[list[int]],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:
        m.setattr(llm.engine, "add_request", interrupt_on_call(2, llm.engine.add_request))
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, GREEDY)
    serves_on(llm, reference)


@pytest.mark.parametrize("where", ["between-steps", "mid-step"])
def test_ctrl_c_while_stepping_aborts_the_call(llm: LLM, reference: list[list[int]],
                                               monkeypatch: pytest.MonkeyPatch,
                                               where: str) -> None:
    """Ctrl-C on the third step: the requests have run a prefill and a decode, hold KV pages;
    mid-step it lands after the forward wrote the step's KV, before the tokens are taken."""
    with monkeypatch.context() as m:
        if where == "mid-step":
            m.setattr(ftrs.engine.core, "sample", interrupt_on_call(3, ftrs.engine.core.sample))
        else:
            m.setattr(llm.engine, "step", interrupt_on_call(3, llm.engine.step))
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, GREEDY)
    serves_on(llm, reference)


def test_a_closed_llm_says_so(path: str) -> None:
    llm = LLM(path, kv_tokens=64)
    llm.close()
    with pytest.raises(InvalidRequest, match="closed") as e:
        llm.generate(["hello"], SamplingParams(max_tokens=2))
    assert e.value.evidence["closed"] is True
    with pytest.raises(InvalidRequest, match="closed"):
        llm.logits([1, 2, 3])
    llm.close()  # again: nothing happens


def test_with_closes_the_llm_even_on_error(path: str) -> None:
    with LLM(path, kv_tokens=64) as llm:
        assert len(llm.generate("hi", SamplingParams(max_tokens=2))[0].token_ids) <= 2
    with pytest.raises(InvalidRequest, match="closed"):
        llm.generate("hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="boom"), LLM(path, kv_tokens=64) as other:
        raise ValueError("boom")
    with pytest.raises(InvalidRequest, match="closed"):
        other.generate("hi")
    other.close()  # after `with`: still idempotent


@pytest.mark.parametrize("prompts", [5, None, 1.5, object()],
                         ids=["int", "none", "float", "object"])
def test_prompts_that_are_not_a_list_are_refused_by_name(llm: LLM, prompts: Any) -> None:
    with pytest.raises(InvalidRequest, match="a str, a list of str, or a list of token-id "
                                             "lists") as e:
        llm.generate(prompts, SamplingParams(max_tokens=2))
    assert e.value.evidence["param"] == "prompt"
    assert llm.engine.num_requests() == 0
