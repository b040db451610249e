"""N-gram speculative decoding (engine/spec.py): drafts change no token (greedy, or sampled with a
seed), stop exactly where decoding one token at a time stops, take only what is left of a step,
and are sized by cost."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ftrs.config import EngineConfig
from ftrs.engine.protocol import GenerateRequest
from ftrs.engine.spec import (
    MAX_NGRAM,
    MIN_NGRAM,
    STALE_STEPS,
    NgramIndex,
    StepCost,
    best_draft,
    can_draft,
)
from ftrs.errors import ConfigError
from ftrs.kvcache.pages import PagePool
from ftrs.llm import LLM
from ftrs.sampling import ReasoningBudget, SamplingParams, StructuredSpec
from ftrs.scheduler.scheduler import Scheduler, Work
from ftrs.scheduler.sequence import Sequence, Status

PROMPTS = [[5, 9, 100, 200, 300, 400, 17, 33, 64, 128, 256, 7, 8, 9, 10, 11, 12, 13],
           [40, 41, 42], list(range(100, 140)), [7] * 25,
           [3, 4, 5, 6, 50, 51, 3, 4, 5, 6, 50, 51, 3, 4]]
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def flat(rows: int) -> float:
    """A step costs the same whatever its rows: every draft pays, so every lookup drafts."""
    return 1.0


def drafting(path: str, **opts: object) -> LLM:
    llm = LLM(path, speculative_ngram=8, **opts)
    llm.engine.set_speculative_ngram(8, step_cost=flat)
    return llm


# --- the lookup -------------------------------------------------------------------------------

def lookup_by_scan(tokens: list[int], k: int) -> list[int]:
    """The latest earlier occurrence of the longest suffix, by scanning; read on as a repeat."""
    for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
        if len(tokens) < n:
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                ext = list(tokens)
                while len(ext) < end + 1 + k:
                    ext.append(ext[len(ext) - (len(tokens) - end - 1)])
                return ext[end + 1:end + 1 + k]
    return []


def test_lookup_matches_a_scan_as_tokens_arrive() -> None:
    rng = random.Random(7)
    for _ in range(200):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        index = NgramIndex()
        for _ in range(rng.randrange(1, 10)):  # the index is extended, never rebuilt
            k = rng.randrange(1, 6)
            assert index.lookup(tokens, k) == lookup_by_scan(tokens, k), tokens
            tokens = tokens + [rng.randrange(4) for _ in range(rng.randrange(1, 4))]


def test_lookup_prefers_the_longest_then_the_latest_occurrence() -> None:
    #            a  b  c  d  X  c  d  Y  b  c  d
    tokens = [1, 2, 3, 4, 9, 3, 4, 8, 2, 3, 4]
    assert NgramIndex().lookup(tokens, 2) == [9, 3]  # (2, 3, 4) beats the later (3, 4)
    assert NgramIndex().lookup([1, 2, 5, 1, 2, 6, 1, 2], 1) == [6]  # the latest (1, 2)
    assert NgramIndex().lookup([1, 2, 3], 4) == []
    assert NgramIndex().lookup([7, 7, 7], 3) == [7, 7, 7]  # a loop drafts its next turns


# --- how much to draft -----------------------------------------------------------------------

def test_step_cost_is_estimated_optimistically_where_unseen() -> None:
    cost = StepCost()
    assert cost(3) is None
    cost.observe(1, 1.0)
    cost.observe(5, 2.0)
    assert cost(1) == 1.0 and cost(5) == 2.0
    assert cost(3) == pytest.approx(1.5)  # on the line between two sizes seen
    assert cost(9) == 2.0  # beyond the largest: as the largest up to twice its rows,
    assert cost(20) == pytest.approx(4.0)  # then in proportion
    assert cost(0) == 1.0  # below the smallest: as the smallest
    cost.observe(5, 3.0)  # recent steps weigh more
    assert 2.0 < (cost(5) or 0) < 3.0
    for _ in range(STALE_STEPS + 16):  # a size not seen for long is forgotten
        cost.observe(1, 1.0)
    assert cost.seconds == {1: 1.0} and cost(2) == 1.0 and cost(5) == 2.5
    cost.clear()
    assert cost(1) is None


def test_one_slow_step_stops_drafts_only_until_its_size_is_forgotten() -> None:
    """A 2-row step slowed tenfold by another process on the host makes every draft look
    unprofitable; drafts resume once that size is forgotten: within 48 one-row steps
    (docs/speculative.md), not hundreds."""
    cost = StepCost()
    cost.observe(1, 1.0)
    cost.observe(2, 10.0)  # the spike
    assert best_draft(0.95, 4, 1, 1.0, cost) == 0
    resumed = None
    for step in range(1, 1000):
        cost.observe(1, 1.0)  # one-row steps only: no draft ran, size 2 is not measured again
        if best_draft(0.95, 4, 1, 1.0, cost) > 0:
            resumed = step
            break
    assert resumed is not None and resumed <= 48


def test_best_draft_weighs_the_tokens_expected_against_the_step_cost() -> None:
    def linear(rows: int) -> float:
        return float(rows)

    assert best_draft(0.9, 8, 1, 1.0, flat) == 8
    assert best_draft(0.0, 8, 1, 1.0, flat) == 0  # nothing to gain
    assert best_draft(0.99, 8, 1, 1.0, linear) == 0  # a row costs what a token earns
    # one row 1.0 s, two 1.5 s, three 1.8 s: at p = 0.5, k = 1 gives 1.5 / 1.5 = 1.0 token/s
    # (no gain over 1 / 1.0), k = 2 gives 1.75 / 1.8; at p = 0.8, k = 1 gives 1.8 / 1.5 = 1.2,
    # k = 2 gives 2.44 / 1.8 = 1.36
    def concave(rows: int) -> float:
        return {1: 1.0, 2: 1.5, 3: 1.8}[rows]

    assert best_draft(0.5, 2, 1, 1.0, concave) == 0
    assert best_draft(0.8, 2, 1, 1.0, concave) == 2
    assert best_draft(0.5, 4, 1, 1.0, lambda rows: None) == 0  # nothing measured yet


def test_the_option_is_validated() -> None:
    with pytest.raises(ConfigError, match="speculative_ngram"):
        EngineConfig(speculative_ngram=17)
    with pytest.raises(ConfigError, match="speculative_ngram"):
        EngineConfig(speculative_ngram=-1)


# --- the scheduler ---------------------------------------------------------------------------

def running(pool: PagePool, sched: Scheduler, rid: str, n_tokens: int) -> Sequence:
    """A running sequence of `n_tokens` tokens whose last one is not computed yet."""
    seq = Sequence(rid, list(range(n_tokens)), n_tokens - 1, GREEDY, None, 0.0)
    seq.num_computed = n_tokens - 1
    pages = pool.alloc(-(-seq.num_computed // pool.page_size))
    assert pages is not None
    seq.pages = pages
    seq.status = Status.RUNNING
    sched.running.append(seq)
    return seq


def test_drafts_take_only_free_pages_and_the_budget_left() -> None:
    pool = PagePool(3, 4)  # 12 token slots
    sched = Scheduler(pool, max_prefill_length=64, max_running=4, prefix_cache=False)
    a = running(pool, sched, "a", 4)  # 3 computed: one page, the decode fits in it
    b = running(pool, sched, "b", 5)  # 4 computed: one page, its decode needs the last page
    a.draft = [1, 2, 3, 4, 5, 6]
    b.draft = [7, 8]
    work = sched.schedule()
    # the decodes first: b's takes the free page; a's fills a's own page, so its draft would
    # need a page that is not free: dropped; b's fits in the page its decode took
    assert [(w.seq.request_id, w.num_tokens) for w in work] == [("a", 1), ("b", 3)]
    assert a.draft == [] and b.draft == [7, 8]
    assert pool.num_free == 0 and a.num_preemptions == b.num_preemptions == 0

    pool = PagePool(8, 4)
    sched = Scheduler(pool, max_prefill_length=4, max_running=4, prefix_cache=False)
    a = running(pool, sched, "a", 4)
    b = running(pool, sched, "b", 5)
    a.draft, b.draft = [1, 2, 3, 4], [7, 8]
    work = sched.schedule()
    # a budget of 4 tokens: both decodes, then a's draft gets the 2 left, b's none
    assert [(w.seq.request_id, w.num_tokens) for w in work] == [("a", 3), ("b", 1)]
    assert a.draft == [1, 2] and b.draft == []
    assert work == [Work(a, 3), Work(b, 1)]


def test_a_draft_is_built_as_decode_rows_each_up_to_its_own_position() -> None:
    import torch

    from ftrs.engine.batch import build_batch

    pool = PagePool(8, 4)
    sched = Scheduler(pool, max_prefill_length=64, max_running=4, prefix_cache=False)
    a = running(pool, sched, "a", 6)  # 5 computed, token 5 to decode
    b = running(pool, sched, "b", 3)
    a.draft = [11, 12, 13]
    work = sched.schedule()
    assert [w.num_tokens for w in work] == [4, 1]
    batch = build_batch(work, 4, torch.device("cpu"))
    assert batch.input_ids.tolist() == [5, 11, 12, 13, 2]
    assert batch.positions.tolist() == [5, 6, 7, 8, 2]
    meta = batch.meta
    assert meta.prefills == [] and meta.decode_only
    assert meta.decode_rows.tolist() == [0, 1, 2, 3, 4]
    assert meta.decode_mask is not None
    assert meta.decode_mask.view(5, -1).sum(1).tolist() == [6, 7, 8, 9, 3]  # keys each row sees
    assert batch.sample_rows.tolist() == [0, 1, 2, 3, 4]
    assert batch.sample_seqs == [a, a, a, a, b]
    assert (batch.num_decode_tokens, batch.num_draft_tokens, batch.num_prefill_tokens) == (2, 3, 0)


# --- the engine ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_path(tiny_models: dict[str, Path]) -> str:
    return str(tiny_models["qwen3_moe"])


def one_by_one(path: str, prompts: list[list[int]], params: SamplingParams, **opts: object
               ) -> list[list[int]]:
    llm = LLM(path, **opts)
    return [c.token_ids for c in llm.generate(prompts, params)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "llama", "mixtral"])
def test_greedy_tokens_are_the_same_with_drafts(tiny_models: dict[str, Path], arch: str) -> None:
    path = str(tiny_models[arch])
    ref = one_by_one(path, PROMPTS, GREEDY, kv_tokens=2048)
    drafted = accepted = 0
    for opts in ({"kv_tokens": 2048}, {"kv_tokens": 2048, "page_size": 4},
                 {"kv_tokens": 2048, "max_prefill_length": 7}):  # prefill chunks beside drafts
        llm = drafting(path, **opts)
        out = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
        assert out == ref, (arch, opts)
        stats = llm.engine.speculative_stats()
        assert stats["accepted_tokens"] > 0, (opts, stats)  # drafts were made, some kept
        drafted += stats["draft_tokens"]
        accepted += stats["accepted_tokens"]
        assert llm.engine.scheduler.kv_usage() == 0.0
    assert drafted > accepted  # and some rejected: their KV rows were overwritten


def test_greedy_tokens_are_the_same_with_drafts_on_mla(deepseek_models: dict[str, Path]) -> None:
    path = str(deepseek_models["q_lora"])
    ref = one_by_one(path, PROMPTS, GREEDY, kv_tokens=2048)
    for kv in ("auto", "int8"):
        if kv == "int8":
            ref = one_by_one(path, PROMPTS, GREEDY, kv_tokens=2048, kv_cache_dtype="int8")
        llm = drafting(path, kv_tokens=2048, kv_cache_dtype=kv)
        assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == ref, kv
        assert llm.engine.speculative_stats()["accepted_tokens"] > 0


def test_greedy_tokens_are_the_same_with_drafts_on_sliding_windows_and_sinks(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    pytest.importorskip("transformers.models.gpt_oss")
    import gpt_oss_models  # a window of 9 keys: drafts cross its edge

    path = str(gpt_oss_models.build(tmp_path_factory.mktemp("gpt_oss") / "m", seed=1))
    ref = one_by_one(path, PROMPTS, GREEDY, kv_tokens=2048)
    llm = drafting(path, kv_tokens=2048)
    assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == ref
    assert llm.engine.speculative_stats()["accepted_tokens"] > 0


def test_decode_graphs_replay_the_steps_without_drafts_only(tiny_models: dict[str, Path]) -> None:
    from engine.test_graphs import attach

    path = str(tiny_models["llama"])
    ref = one_by_one(path, PROMPTS, GREEDY, kv_tokens=2048)
    llm = drafting(path, kv_tokens=2048, max_running_requests=8)
    graphs = attach(llm, (1, 2, 4, 8))  # the eager stand-in of the CUDA graphs' code path
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(GenerateRequest(str(i), p, GREEDY))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    plain = drafted = 0
    while eng.has_work():
        replays = graphs.replays
        events, st = eng.step()
        for e in events:
            out[e.request_id] += e.new_token_ids
        if st.kind == "decode":
            ran_graph = graphs.replays > replays
            assert ran_graph == (st.draft_tokens == 0)  # a graph holds one row per sequence
            plain += ran_graph
            drafted += not ran_graph
    assert [out[str(i)] for i in range(len(PROMPTS))] == ref
    assert plain and drafted


def test_preemption_with_drafts_keeps_results(moe_path: str) -> None:
    ref = one_by_one(moe_path, PROMPTS, GREEDY, kv_tokens=2048)
    llm = drafting(moe_path, kv_tokens=96, page_size=8)  # the five cannot all run at once
    outs = llm.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in outs] == ref
    assert llm.engine.speculative_stats()["accepted_tokens"] > 0
    assert llm.engine.scheduler.kv_usage() == 0.0


def test_a_draft_stops_where_one_token_at_a_time_stops(moe_path: str) -> None:
    prompt = PROMPTS[3]
    free = one_by_one(moe_path, [prompt], GREEDY, kv_tokens=2048)[0]
    llm = drafting(moe_path, kv_tokens=2048)
    for max_tokens in (1, 2, 5, 13):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        c = llm.generate([prompt], params)[0]
        assert c.token_ids == free[:max_tokens] and c.finish_reason == "length"
    stop = free[6]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    c = llm.generate([prompt], params)[0]
    assert c.token_ids == free[:free.index(stop) + 1] and c.finish_reason == "stop"
    assert llm.engine.speculative_stats()["accepted_tokens"] > 0


def test_a_stop_string_mid_draft_keeps_the_tokens_one_at_a_time_keeps(demo_model: Path) -> None:
    prompt = "Repeat this line five times: the cat sat on the mat, the cat sat on the mat,"
    params = SamplingParams(max_tokens=40, temperature=0, logprobs=1,
                            stop=["cat sat on the mat, the cat sat on the mat, the cat"])
    ref = LLM(str(demo_model), kv_tokens=1024).generate([prompt], params)[0]
    assert ref.finish_reason == "stop" and ref.text == " the "  # the model repeats the line
    llm = drafting(str(demo_model), kv_tokens=1024)
    c = llm.generate([prompt], params)[0]
    assert (c.token_ids, c.text, c.finish_reason) == (ref.token_ids, ref.text, "stop")
    assert c.logprobs is not None and ref.logprobs is not None  # a record per token kept
    assert [r.token_id for r in c.logprobs] == [r.token_id for r in ref.logprobs] == c.token_ids
    assert llm.engine.speculative_stats()["accepted_tokens"] > 0
    # a step that completes the stop string and also reaches max_tokens: the stop still cuts
    for extra in range(4):
        cut = SamplingParams(max_tokens=len(ref.token_ids) + extra, temperature=0, logprobs=1,
                             stop=params.stop)
        c = llm.generate([prompt], cut)[0]
        assert (c.token_ids, c.text, c.finish_reason) == (ref.token_ids, ref.text, "stop"), extra
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)


def test_the_context_limit_is_kept_mid_draft(moe_path: str) -> None:
    prompt = PROMPTS[3]
    free = one_by_one(moe_path, [prompt], GREEDY, kv_tokens=2048)[0]
    llm = drafting(moe_path, kv_tokens=2048, max_model_len=len(prompt) + 7)
    c = llm.generate([prompt], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0]
    assert c.token_ids == free[:7] and c.finish_reason == "length"


SAMPLED = [
    SamplingParams(max_tokens=40, temperature=0.3, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.6, top_k=5, top_p=0.9, min_p=0.05, seed=11,
                   ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.3, seed=5, repetition_penalty=1.02,
                   presence_penalty=0.02, frequency_penalty=0.01, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.05, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.3, seed=9, logprobs=3, ignore_eos=True),
]


@pytest.mark.parametrize("params", SAMPLED, ids=["sampled", "filtered", "penalized",
                                                   "greedy-penalized", "logprobs"])
def test_a_seed_gives_the_same_tokens_with_drafts(moe_path: str, params: SamplingParams) -> None:
    """Sampled rows draw with the number keyed by seed and position, penalties count the draft
    tokens before each row, logprobs are each row's: drafts change nothing a request returns."""
    ref = LLM(moe_path, kv_tokens=2048).generate(PROMPTS, params)
    llm = drafting(moe_path, kv_tokens=2048)
    out = llm.generate(PROMPTS, params)
    assert [c.token_ids for c in out] == [c.token_ids for c in ref]
    for c, r in zip(out, ref):
        if params.logprobs is None:
            continue
        assert c.logprobs is not None and r.logprobs is not None
        assert len(c.logprobs) == len(r.logprobs) == len(c.token_ids)
        for a, b in zip(c.logprobs, r.logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    stats = llm.engine.speculative_stats()
    assert stats["accepted_tokens"] > 0, stats  # drafts were made and kept
    assert stats["draft_tokens"] > stats["accepted_tokens"]  # and some were drawn otherwise


def test_what_may_draft() -> None:
    """A grammar's matcher, a reasoning budget still counting and prompt logits are states of
    the last kept token: those requests do not draft; every sampling parameter may."""
    def seq(params: SamplingParams, **state: object) -> Sequence:
        s = Sequence("r", [1, 2, 3, 4], 3, params, 0, 0.0)
        for k, v in state.items():
            setattr(s, k, v)
        return s

    assert all(can_draft(seq(p)) for p in SAMPLED)
    assert not can_draft(seq(SAMPLED[0], tokens=[1, 2, 3]))  # its first token comes from prefill
    assert not can_draft(seq(SamplingParams(structured=StructuredSpec("json_object"))))
    assert not can_draft(seq(GREEDY, prompt_logits=True))
    budget = ReasoningBudget(8, 10, 11, (12, 11), opened=True)
    assert not can_draft(seq(SamplingParams(reasoning_budget=budget)))
    assert can_draft(seq(SamplingParams(reasoning_budget=budget), reasoning_closed=True))


def test_step_stats_count_drafted_and_accepted_tokens(moe_path: str) -> None:
    llm = drafting(moe_path, kv_tokens=2048)
    eng = llm.engine
    eng.add_request(GenerateRequest("r", PROMPTS[3], GREEDY))
    drafted = accepted = produced = 0
    while eng.has_work():
        events, st = eng.step()
        # after the prompt every step is a decode: accepted tokens are never computed again
        assert st.kind == ("prefill" if produced == 0 else "decode")
        produced += sum(len(e.new_token_ids) for e in events)
        drafted += st.draft_tokens
        accepted += st.accepted_tokens
        if st.draft_tokens:
            assert st.kind == "decode" and st.decode_tokens == 1
            assert sum(len(e.new_token_ids) for e in events) == 1 + st.accepted_tokens
    assert produced == GREEDY.max_tokens
    assert eng.speculative_stats() == {"draft_tokens": drafted, "accepted_tokens": accepted}
    assert accepted > 0


def test_linear_attention_models_do_not_draft(hybrid_models: dict[str, Path]) -> None:
    path = str(hybrid_models["qwen3_5_moe"])
    ref = one_by_one(path, PROMPTS[:2], GREEDY, kv_tokens=1024)
    llm = drafting(path, kv_tokens=1024)
    assert [c.token_ids for c in llm.generate(PROMPTS[:2], GREEDY)] == ref
    assert llm.engine.speculative_stats() == {}
