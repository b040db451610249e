"""The sampler: batched rows each follow their own parameters and seed; extreme parameters never
raise or produce nan; a row with nothing to draw fails its request alone."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ftrs.engine.protocol import GenerateRequest, TokenEvent
from ftrs.engine.sampler import _draw, sample, uniform
from ftrs.llm import LLM
from ftrs.sampling import SamplingParams
from ftrs.scheduler.sequence import Sequence

PROMPT = [5, 9, 100, 200, 300, 400, 17, 33]
NORMAL = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)


def seq(params: SamplingParams, tokens: list[int] | None = None, seed: int = 0) -> Sequence:
    toks = tokens or [1, 2]
    return Sequence("r", list(toks), len(toks), params, None if params.greedy else seed, 0.0)


# --- the math of one row, against numpy ---------------------------------------------------------


def allowed(logits: np.ndarray, p: SamplingParams) -> set[int]:
    """Tokens of positive probability after temperature, top-k, top-p and min-p (numpy)."""
    x = logits.astype(np.float64) / p.temperature
    if p.top_k > 0:
        x = np.where(x < np.sort(x)[::-1][p.top_k - 1], -np.inf, x)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep, mass = set(), 0.0
    for t in order:
        if mass >= p.top_p or probs[t] == 0:
            break
        keep.add(int(t))
        mass += probs[t]
    return {t for t in keep if probs[t] >= p.min_p * probs.max()}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=0.7, top_p=0.6),
    SamplingParams(temperature=1.3, min_p=0.3),
    SamplingParams(temperature=1.0, top_k=4, top_p=0.8, min_p=0.1),
], ids=["top_k", "top_p", "min_p", "all"])
def test_draws_stay_in_the_allowed_set_and_follow_the_probabilities(
        params: SamplingParams) -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, -3.0, 0.9])
    want = allowed(logits.numpy(), params)
    # rows with the same parameters: each row draws with its own seed
    got: Counter[int] = Counter()
    for i in range(60):
        out = sample(logits.repeat(16, 1), [seq(params, seed=16 * i + s) for s in range(16)])
        assert all(e is None for e in out.errors)
        got.update(t for t in out.tokens if t is not None)
    assert set(got) <= want
    assert len(set(got)) == len(want)  # 960 draws reach every allowed token here


def test_sampled_frequencies_match_the_softmax() -> None:
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    params = SamplingParams(temperature=1.0)
    probs = np.exp(logits.numpy().astype(np.float64))
    probs /= probs.sum()
    n = 40 * 100
    counts = Counter(t for i in range(40) for t in sample(
        logits.repeat(100, 1), [seq(params, seed=100 * i + s) for s in range(100)]).tokens)
    for t, p in enumerate(probs):
        sd = math.sqrt(n * p * (1 - p))
        assert abs(counts[t] - n * p) < 5 * sd, (t, counts[t], n * p)


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    params = [SamplingParams(temperature=0.9, top_k=10), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.1, top_p=0.7, repetition_penalty=1.3),
              SamplingParams(temperature=0.5, min_p=0.05, presence_penalty=0.5),
              SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=2.0)]

    def run(rows: list[int]) -> list[int | None]:
        seqs = [seq(params[r], tokens=[1, 2, 3, r], seed=100 + r) for r in rows]
        out: list[int | None] = []
        for _ in range(5):  # each draw at the next position, after the tokens drawn so far
            toks = sample(logits[rows], seqs).tokens
            for s, t in zip(seqs, toks):
                assert t is not None
                s.tokens.append(t)
            out += toks
        return out

    batched = run(list(range(6)))
    alone = [run([r]) for r in range(6)]
    for r in range(6):
        assert batched[r::6] == alone[r], r
    assert run(list(range(6))) == batched


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, repetition_penalty=3.0),
    SamplingParams(temperature=0.7, presence_penalty=1.5, frequency_penalty=0.5, top_k=4),
], ids=["greedy", "sampled"])
def test_a_drafts_rows_draw_as_the_one_token_steps_after_its_tokens(
        params: SamplingParams) -> None:
    """Consecutive rows of one sequence are its next positions: each sees the draft tokens
    before it (penalties) and draws with its own position's number, as a sequence holding those
    tokens would."""
    logits = torch.tensor([[2.0, 1.9, 1.8, 1.7, 1.6, 0.0]] * 4)
    for seed in range(20):
        s = seq(params, tokens=[5, 5], seed=seed)
        s.draft = [0, 1, 2]
        got = sample(logits, [s] * 4).tokens
        want = []
        for j in range(4):
            one = seq(params, tokens=[5, 5, *s.draft[:j]], seed=seed)
            one.num_prompt = 2
            want += sample(logits[:1], [one]).tokens
        assert got == want, seed
    if params.greedy:  # each row's penalty moved the argmax past the draft tokens before it
        assert want == [0, 1, 2, 3]


def test_a_draw_is_keyed_by_seed_and_position() -> None:
    assert uniform(7, 3) == uniform(7, 3)
    draws = {uniform(seed, t) for seed in (-2, 0, 1, 2**63) for t in range(50)}
    assert len(draws) == 200 and all(0.0 <= u < 1.0 for u in draws)
    assert uniform(-1, 5) == uniform(2**64 - 1, 5)  # seeds are taken mod 2**64


def test_greedy_with_penalties_and_logprobs_follows_the_math() -> None:
    logits = torch.tensor([[3.0, 2.9, -1.0, 0.5], [3.0, 2.9, -1.0, 0.5]])
    plain = seq(SamplingParams(temperature=0.0, logprobs=2), tokens=[3])
    pen = seq(SamplingParams(temperature=0.0, repetition_penalty=2.0), tokens=[0])
    out = sample(logits, [plain, pen])
    assert out.tokens == [0, 1]  # 3.0 / 2 = 1.5 < 2.9
    lp = np.log(np.exp([3.0, 2.9, -1.0, 0.5]) / np.exp([3.0, 2.9, -1.0, 0.5]).sum())
    rec = out.records[0]
    assert rec is not None and out.records[1] is None
    assert rec.logprob == pytest.approx(lp[0], abs=1e-5)
    assert [t for t, _ in rec.top] == [0, 1]


# --- overflow: never raise, never nan ------------------------------------------------------------


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-40), SamplingParams(temperature=1e-300),
    SamplingParams(temperature=5e-324, top_p=0.5, top_k=3, min_p=0.5),
    SamplingParams(temperature=1.0, repetition_penalty=1e-300),
    SamplingParams(temperature=1e-300, repetition_penalty=1e-300),
    SamplingParams(temperature=0.0, repetition_penalty=1e-300),
    SamplingParams(temperature=0.0, repetition_penalty=1e300),
], ids=["t1e-40", "t1e-300", "t-min-filters", "rp1e-300", "both", "greedy-rp1e-300", "rp1e300"])
def test_extreme_parameters_draw_a_real_token(params: SamplingParams) -> None:
    logits = torch.tensor([[3.0e38, 2.0, -1.0, 5.0, -3.0e38, 0.0]])
    s = seq(params, tokens=[0, 1, 2], seed=1)
    out = sample(logits, [s])
    assert out.errors == [None]
    tok = out.tokens[0]
    assert tok is not None and 0 <= tok < 6
    if params.repetition_penalty == 1.0:
        assert tok == 0  # a temperature below every gap is the argmax (the limit of the math)
    elif params.repetition_penalty < 1.0:
        assert tok == 0  # seen positives divided by 1e-300: +inf, capped; the largest stays
    else:
        assert tok == 3  # seen tokens 0..2 divided or multiplied by 1e300: 3 is the best left


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324])
def test_a_tiny_temperature_divides_without_nan(temperature: float) -> None:
    """The draw divides by any positive temperature (the edge makes tiny ones greedy, the
    sampler does not rely on it): the limit of the math is the argmax."""
    x = torch.tensor([[3.0e38, 2.0, 3.0e38 - 3.0e31, 5.0, -3.0e38, 0.0]], dtype=torch.float64)
    s = seq(SamplingParams(temperature=temperature, top_p=0.5, top_k=3, min_p=0.5), seed=1)
    assert _draw(x, [s], [len(s.tokens)]) == [0]


def test_a_row_with_nothing_finite_fails_alone() -> None:
    logits = torch.tensor([[float("nan")] * 4, [0.0, 1.0, 0.5, 0.2], [-float("inf")] * 4,
                           [0.0, 1.0, 0.5, 0.2]])
    seqs = [seq(SamplingParams(temperature=0.0)), seq(SamplingParams(temperature=0.0)),
            seq(SamplingParams(temperature=0.9), seed=2), seq(SamplingParams(temperature=0.9))]
    out = sample(logits, seqs)
    assert out.tokens[0] is None and out.tokens[2] is None
    assert out.errors[0] and out.errors[2]
    assert out.tokens[1] == 1 and out.tokens[3] is not None
    assert out.errors[1] is None and out.errors[3] is None


# --- through the engine --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]) -> LLM:
    return LLM(str(tiny_models["qwen3_moe"]), kv_tokens=2048)


def run(llm: LLM, reqs: dict[str, SamplingParams]) -> dict[str, list[TokenEvent]]:
    eng = llm.engine
    for rid, p in reqs.items():
        eng.add_request(GenerateRequest(rid, PROMPT, p))
    events: dict[str, list[TokenEvent]] = {rid: [] for rid in reqs}
    while eng.has_work():
        for ev in eng.step()[0]:
            events[ev.request_id].append(ev)
    return events


def tokens(evs: list[TokenEvent]) -> list[int]:
    return [t for ev in evs for t in ev.new_token_ids]


def test_overflowing_requests_beside_a_normal_one(llm: LLM,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # the API edge refuses a penalty of 1e-300; the sampler must hold even if one gets through
    monkeypatch.setattr(SamplingParams, "validate", lambda self, vocab_size=None: self)
    alone = tokens(run(llm, {"n0": NORMAL})["n0"])
    greedy = tokens(run(llm, {"g0": SamplingParams(max_tokens=12, temperature=0,
                                                   ignore_eos=True)})["g0"])
    mixed = run(llm, {
        "t40": SamplingParams(max_tokens=12, temperature=1e-40, ignore_eos=True),
        "n1": NORMAL,
        "t300": SamplingParams(max_tokens=12, temperature=1e-300, ignore_eos=True),
        "rp": SamplingParams(max_tokens=12, repetition_penalty=1e-300, ignore_eos=True),
        "rpg": SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1e-300,
                              ignore_eos=True)})
    assert tokens(mixed["n1"]) == alone
    assert tokens(mixed["t40"]) == greedy  # far below every logit gap: the argmax
    assert tokens(mixed["t300"]) == greedy
    for rid in ("rp", "rpg"):
        assert mixed[rid][-1].finish_reason == "length"
        assert len(tokens(mixed[rid])) == 12
    assert not llm.engine.has_work()


def test_a_row_that_cannot_be_sampled_fails_its_request_alone(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    alone = tokens(run(llm, {"n0": NORMAL})["n0"])
    dec = llm.engine.rt.decoder
    real = dec.logits
    victim: dict[str, Any] = {}

    def poisoned(hidden: torch.Tensor) -> torch.Tensor:
        out = real(hidden).clone()
        rows = [i for i, s in enumerate(victim["seqs"]()) if s.request_id == "bad"]
        out[rows] = float("nan")
        return out

    def seqs() -> list[Sequence]:
        return [s for s in llm.engine.scheduler.running]

    victim["seqs"] = seqs
    monkeypatch.setattr(dec, "logits", poisoned)
    events = run(llm, {"bad": SamplingParams(max_tokens=12, temperature=0.7, seed=3),
                       "n1": NORMAL})
    bad = events["bad"]
    assert len(bad) == 1 and bad[0].finish_reason == "error" and bad[0].new_token_ids == []
    assert bad[0].error is not None and bad[0].error["code"] == "invalid_request"
    assert bad[0].error["http_status"] == 400
    assert tokens(events["n1"]) == alone
    assert not llm.engine.has_work() and llm.engine.scheduler.kv_usage() == 0.0
