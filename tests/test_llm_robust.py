"""`LLM.generate` after a call that failed or was interrupted: the engine holds none of that
call's requests, and the next call gives what a fresh LLM gives. A closed LLM says so; prompts
of the wrong shape are refused by a typed error that says what is accepted."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

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


def test_threads_sharing_one_llm_each_get_their_own_results(
        llm: LLM, reference: list[list[int]]) -> None:
    """Two threads' calls run one after the other, so neither steps into the other's events."""
    results: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
        except BaseException as e:  # reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert results == {i: reference for i in range(3)}


def test_bad_sampling_fields_are_refused_before_a_grammar_is_compiled(llm: LLM) -> None:
    bad: Any = {"type": "json_object"}
    with pytest.raises(InvalidRequest, match="structured: must be a StructuredSpec") as e:
        llm.generate("hi", SamplingParams(max_tokens=2, structured=bad))
    assert e.value.evidence["param"] == "structured"
    assert llm.engine.num_requests() == 0


def test_logits_take_a_prompt_as_generate_does(llm: LLM) -> None:
    ids = llm.tokenizer.encode("hello there", add_special_tokens=True)
    assert torch.equal(llm.logits("hello there"), llm.logits(ids))
    bad: Any = ["a"]
    with pytest.raises(InvalidRequest, match="token ids must be integers"):
        llm.logits(bad)


@pytest.mark.parametrize(("messages", "param"), [
    ("hello", "messages"), ([["user", "hi"]], "messages[0]"), ([{"content": "hi"}], "messages[0]"),
    ([{"role": "user", "content": 5}], "messages[0].content")])
def test_chat_prompt_refuses_messages_of_another_shape(llm: LLM, messages: Any,
                                                       param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        llm.chat_prompt(messages)
    assert e.value.evidence["param"] == param


def test_a_template_that_fails_on_a_value_is_a_typed_error() -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from ftrs.models.tokenizer import Tokenizer

    tk = HFTokenizer(models.BPE({"a": 0, "b": 1}, [], fuse_unk=False))
    tok = Tokenizer(tk, "{{ messages[0]['content'] + '!' }}", None, None, [0])
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "a!"
    with pytest.raises(InvalidRequest, match="chat template failed"):
        tok.apply_chat_template([{"role": "user", "content": 5}])
