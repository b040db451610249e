"""Structured output and logit_bias in the engine, on a tiny random model.

Oracles: `jsonschema` validates outputs against their schema; the allowed token sets of small
Lark grammars follow from the tiny tokenizer (one token per byte, no merges); the greedy choice
under a bias is argmax(raw logits + bias), computed here from the engine's prompt logits (held to
transformers elsewhere)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from ftrs.engine import grammar
from ftrs.engine.core import EngineCore
from ftrs.engine.protocol import GenerateRequest, TokenEvent
from ftrs.engine.sampler import sample
from ftrs.errors import InvalidRequest
from ftrs.llm import LLM
from ftrs.sampling import SamplingParams, StructuredSpec
from ftrs.scheduler.sequence import Sequence
from ftrs.server.engine_process import StepRunner

PROMPT = [5, 9, 100, 200, 300, 17]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["red", "green", "blue"]},
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
               "maxItems": 3},
    },
    "required": ["name", "ok", "n", "tag", "xs"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]) -> LLM:
    return LLM(str(tiny_models["llama"]), kv_tokens=4096)


def run(engine: EngineCore, reqs: dict[str, SamplingParams],
        prompt: list[int] = PROMPT) -> dict[str, list[TokenEvent]]:
    """Add every request, step until all are done; the events of each."""
    for rid, params in reqs.items():
        engine.add_request(GenerateRequest(rid, list(prompt), params))
    out: dict[str, list[TokenEvent]] = {rid: [] for rid in reqs}
    for _ in range(10_000):
        if not engine.has_work():
            break
        events, _ = engine.step()
        for ev in events:
            out.setdefault(ev.request_id, []).append(ev)
    return out


def tokens(events: list[TokenEvent]) -> list[int]:
    return [t for ev in events for t in ev.new_token_ids]


def byte_id(llm: LLM, ch: str) -> int:
    (tok,) = llm.tokenizer.encode(ch)
    return tok


# --- json_schema ----------------------------------------------------------------------------


def test_json_schema_output_parses_and_validates_for_every_seed(llm: LLM) -> None:
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA))
    reqs = {f"s{seed}": SamplingParams(max_tokens=160, temperature=1.0, seed=seed,
                                       structured=spec) for seed in range(5)}
    out = run(llm.engine, reqs)
    texts = set()
    for rid, events in out.items():
        assert events[-1].finish_reason == "stop", rid
        assert events[-1].error is None
        text = llm.tokenizer.decode(tokens(events))
        jsonschema.validate(json.loads(text), SCHEMA)  # raises when it does not validate
        texts.add(text)
    assert len(texts) > 1  # temperature 1.0 really sampled


def test_json_object_output_is_an_object(llm: LLM) -> None:
    # A random model fills strings for ever; a bias toward '"' and '}' (allowed by the grammar
    # only where they are valid JSON) makes it close them, and exercises bias + mask together.
    bias = ((byte_id(llm, '"'), 5.0), (byte_id(llm, "}"), 5.0))
    reqs = {f"o{seed}": SamplingParams(max_tokens=60, temperature=1.0, seed=seed, logit_bias=bias,
                                       structured=StructuredSpec("json_object"))
            for seed in range(3)}
    out = run(llm.engine, reqs)
    objs = [json.loads(llm.tokenizer.decode(tokens(events))) for events in out.values()]
    assert all(isinstance(o, dict) for o in objs)
    assert any(objs)  # not only "{}"
    assert all(events[-1].finish_reason == "stop" for events in out.values())


def test_a_complete_grammar_stops_without_eos_and_max_tokens_still_cuts(llm: LLM) -> None:
    spec = StructuredSpec("lark", 'start: "yes" | "no"', param="tool_choice")
    eng = llm.engine
    out = run(eng, {f"g{s}": SamplingParams(max_tokens=10, temperature=1.0, seed=s,
                                            structured=spec) for s in range(4)})
    for events in out.values():
        ids = tokens(events)
        assert llm.tokenizer.decode(ids) in ("yes", "no")
        assert events[-1].finish_reason == "stop"
        assert not set(ids) & eng.eos_token_ids
    cut = run(eng, {"short": SamplingParams(max_tokens=2, temperature=0.0, structured=spec)})
    assert cut["short"][-1].finish_reason == "length"
    assert llm.tokenizer.decode(tokens(cut["short"])) in ("ye", "no")
    assert not eng._matchers  # every matcher is released with its request


def test_eos_is_allowed_only_where_the_grammar_is_complete(llm: LLM) -> None:
    eng = llm.engine
    eos = min(eng.eos_token_ids)
    a = byte_id(llm, "a")
    spec = StructuredSpec("lark", 'start: "a"+')  # complete after one "a", may go on
    params = SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((eos, 100.0),),
                            structured=spec)
    out = run(eng, {"e": params})
    assert tokens(out["e"]) == [a, eos]  # EOS, however favoured, waited for the first "a"
    assert out["e"][-1].finish_reason == "stop"


def test_greedy_and_logprobs_follow_the_masked_distribution(llm: LLM) -> None:
    a, b = byte_id(llm, "a"), byte_id(llm, "b")
    spec = StructuredSpec("lark", 'start: ("a" | "b") "c"')
    raw = llm.logits(PROMPT)[-1].double()  # (vocab,)
    lsm = torch.log_softmax(raw[[a, b]], dim=0)  # the model restricted to {a, b}
    want = a if raw[a] > raw[b] else b
    out = run(llm.engine, {"g": SamplingParams(max_tokens=5, temperature=0.0, logprobs=5,
                                               structured=spec)})
    first = out["g"][0]
    assert first.new_token_ids == [want]
    assert first.logprobs is not None
    rec = first.logprobs[0]
    assert rec.logprob == pytest.approx(float(lsm[0 if want == a else 1]), abs=1e-5)
    assert {t for t, _ in rec.top} == {a, b}  # forbidden tokens are no alternatives
    assert all(math.isfinite(v) for _, v in rec.top)
    assert llm.tokenizer.decode(tokens(out["g"])) in ("ac", "bc")


# --- bad grammars ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [
    StructuredSpec("lark", "start: undefined_rule", param="tool_choice"),
    StructuredSpec("json_schema", '{"type": "strng"}'),
    StructuredSpec("json_schema", "{not json"),
])
def test_a_bad_grammar_fails_only_its_request(llm: LLM, spec: StructuredSpec) -> None:
    with pytest.raises(InvalidRequest) as api:  # the API process: a 400 before queueing
        grammar.check(spec, llm.tokenizer)
    assert api.value.evidence["param"] == spec.param
    eng = llm.engine
    good = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eng.add_request(GenerateRequest("good", PROMPT, good))
    first, _ = eng.step()
    runner = StepRunner(eng, eng.step)  # the engine process: it compiles off the loop...
    assert runner.add(GenerateRequest("bad", PROMPT, SamplingParams(structured=spec))) is None
    out = run(eng, {})
    (refused,) = out["bad"]  # ...and a later step carries one error event, nothing more
    assert refused.finish_reason == "error" and not refused.new_token_ids
    assert refused.error is not None and refused.error["evidence"]["param"] == spec.param
    assert refused.error["http_status"] == 400
    assert eng.num_requests() == 0
    with pytest.raises(InvalidRequest) as offline:  # the offline API refuses it before adding
        llm.generate([PROMPT], SamplingParams(structured=spec))
    assert offline.value.evidence["param"] == spec.param and eng.num_requests() == 0
    done = first + out["good"]  # the good request ran to its end beside the refusal
    assert len(tokens(done)) == 6 and done[-1].finish_reason == "length"


def test_a_new_grammar_compiles_off_the_loop_while_others_decode(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile that takes 0.6 s (held on an event here) stalls no step: the running request
    decodes meanwhile, the constrained one starts once its matcher is ready, and its output
    follows the schema. A second request with the same schema takes the cached grammar at once."""
    import threading

    eng = llm.engine
    release = threading.Event()
    slow_compile = grammar.GrammarCache.new_matcher

    def held(self: grammar.GrammarCache, spec: StructuredSpec) -> object:
        if not self.cached(spec):
            release.wait(10)
        return slow_compile(self, spec)

    monkeypatch.setattr(grammar.GrammarCache, "new_matcher", held)
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "fresh": {"type": "null"}}}
    spec = StructuredSpec("json_schema", json.dumps(schema))
    eng.add_request(GenerateRequest("free", PROMPT, SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True)))
    eng.add_request(GenerateRequest("json", PROMPT, SamplingParams(
        max_tokens=200, temperature=0.0, structured=spec)))
    assert eng.num_requests() == 2
    before: list[TokenEvent] = []
    for _ in range(5):  # the grammar is held: only "free" steps
        events, stats = eng.step()
        assert stats.kind != "idle"
        before += events
    assert {ev.request_id for ev in before} == {"free"}
    release.set()
    out = run(eng, {"again": SamplingParams(max_tokens=200, temperature=0.0, structured=spec)})
    assert len(tokens(before + out["free"])) == 12
    for rid in ("json", "again"):
        text = llm.tokenizer.decode(tokens(out[rid]))
        jsonschema.validate(json.loads(text), schema)
        assert out[rid][-1].finish_reason == "stop"
    assert eng.num_requests() == 0


def test_abort_and_fail_reach_a_request_whose_grammar_compiles(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    eng = llm.engine
    release = threading.Event()
    compile_ = grammar.GrammarCache.new_matcher

    def held(self: grammar.GrammarCache, spec: StructuredSpec) -> object:
        release.wait(10)
        return compile_(self, spec)

    monkeypatch.setattr(grammar.GrammarCache, "new_matcher", held)
    for i in range(2):
        spec = StructuredSpec("lark", f'start: "a"{{{i + 3}}}')
        eng.add_request(GenerateRequest(f"g{i}", PROMPT, SamplingParams(structured=spec)))
    with pytest.raises(InvalidRequest, match="duplicate"):
        eng.add_request(GenerateRequest("g0", PROMPT, SamplingParams()))
    eng.abort("g0")
    failed = eng.fail_requests(None, {"message": "drill"})
    assert [(ev.request_id, ev.finish_reason) for ev in failed] == [("g1", "error")]
    release.set()
    assert eng.num_requests() == 0 and not eng.has_work()


def test_a_good_grammar_passes_check(llm: LLM) -> None:
    grammar.check(StructuredSpec("json_schema", json.dumps(SCHEMA)), llm.tokenizer)
    grammar.check(StructuredSpec("json_object"), None)
    grammar.check(StructuredSpec("lark", 'start: "x"+'), llm.tokenizer)


# --- logit_bias -----------------------------------------------------------------------------


def test_logit_bias_changes_the_greedy_choice_as_computed_by_hand(llm: LLM) -> None:
    raw = llm.logits(PROMPT)[-1].numpy().astype(np.float64)
    order = np.argsort(-raw)
    top, fifth = int(order[0]), int(order[4])
    gap = raw[top] - raw[fifth]
    cases = {
        "none": (),
        "lift": ((fifth, gap + 0.5),),           # the fifth overtakes the top
        "short": ((fifth, max(gap - 0.5, 0.0)),),  # not enough: the top stays
        "ban": ((top, -100.0),),                   # the second wins
        "both": ((top, -1.0), (fifth, gap - 0.5)),  # together they flip it
    }
    for name, bias in cases.items():
        expect = raw.copy()
        for t, v in bias:
            expect[t] += v
        want = int(np.argmax(expect))
        got = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0,
                                                    logit_bias=bias))[0].token_ids
        assert got == [want], name
    assert int(np.argmax(raw)) == top != fifth


def test_logit_bias_shifts_sampled_frequencies() -> None:
    logits = torch.zeros(1, 4)
    params = SamplingParams(temperature=1.0, logit_bias=((2, math.log(7.0)),))  # p = 7/10
    seqs = [Sequence(f"r{i}", [1], 1, params, i, 0.0) for i in range(2000)]
    draws = sample(logits.expand(len(seqs), 4), seqs).tokens
    share = draws.count(2) / len(draws)
    assert abs(share - 0.7) < 0.04  # 4 sigma of a binomial(2000, 0.7)


@pytest.mark.parametrize("bias", [((5, 100.5),), ((5, math.nan),), ((-1, 1.0),), ((512, 1.0),),
                                  ((5, 1.0), (5, 2.0)), ((True, 1.0),)])
def test_bad_logit_bias_is_refused_naming_the_field(bias: tuple[tuple[int, float], ...]) -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(logit_bias=bias).validate(512)
    assert e.value.evidence["param"] == "logit_bias"


def test_bad_structured_spec_is_refused_naming_its_param() -> None:
    for spec in (StructuredSpec("regex", "a+", "response_format"),
                 StructuredSpec("json_schema", "  ", "tool_choice")):
        with pytest.raises(InvalidRequest) as e:
            SamplingParams(structured=spec).validate()
        assert e.value.evidence["param"] == spec.param


# --- masks ----------------------------------------------------------------------------------


def test_unpack_reads_bit_j_of_word_w_as_token_32w_plus_j() -> None:
    rng = np.random.default_rng(0)
    bits = rng.integers(-2**31, 2**31, size=(3, 4), dtype=np.int64).astype(np.int32)
    got = grammar.unpack(bits, 100)
    want = [[bool((int(bits[r, t // 32]) >> (t % 32)) & 1) for t in range(100)] for r in range(3)]
    assert got.tolist() == want


def test_masked_rows_draw_only_allowed_tokens_and_others_are_untouched() -> None:
    vocab = 50
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, [3, 7]] = 0.0  # the two allowed tokens of row 0 equally likely
    allowed = torch.zeros(2, vocab, dtype=torch.bool)
    allowed[0, [3, 7]] = True
    allowed[1, [11]] = True
    seen: list[set[int]] = [set(), set(), set()]
    for k in range(60):
        seqs = [Sequence(f"r{i}", [1], 1, SamplingParams(temperature=1.0), 3 * k + i, 0.0)
                for i in range(3)]
        out = sample(logits, seqs, allowed, [0, 2])
        for i, t in enumerate(out.tokens):
            assert t is not None
            seen[i].add(t)
    assert seen[0] == {3, 7} and seen[2] == {11}
    assert len(seen[1]) > 5  # the unconstrained row still draws from everything
