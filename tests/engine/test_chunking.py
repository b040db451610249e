"""The prompt chunk beside decodes (`engine.chunking`): a measured step-cost model, the
scheduler holding a step with decodes to it, and the engine's results unchanged by it."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftrs.config import EngineConfig
from ftrs.engine.chunking import FIRST_CHUNK, MIN_CHUNK, PrefillChunker
from ftrs.engine.protocol import GenerateRequest
from ftrs.errors import ConfigError
from ftrs.kvcache.pages import PagePool
from ftrs.llm import LLM
from ftrs.sampling import SamplingParams
from ftrs.scheduler.scheduler import Scheduler, Work
from ftrs.scheduler.sequence import Sequence, Status

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def feed(chunker: PrefillChunker, fixed: float, per_row: float, sizes: list[int]) -> None:
    for rows in sizes:
        chunker.observe(rows - 2, 2, fixed + per_row * rows)


def test_the_chunk_fits_the_target_on_a_linear_cost() -> None:
    c = PrefillChunker(target_s=1.0)
    assert c.limit(8192) == FIRST_CHUNK  # nothing measured yet
    assert c.limit(100) == 100  # never above the step budget
    feed(c, 0.05, 0.001, [300, 700, 256, 1000, 512])
    a, b, fitted = c.model() or (0.0, 0.0, False)
    assert fitted and a == pytest.approx(0.05) and b == pytest.approx(0.001)
    assert c.limit(8192) == 950  # (1.0 - 0.05) / 0.001
    assert c.limit(600) == 600
    assert PrefillChunker(target_s=0.0).limit(8192) is None  # 0: no bound


def test_the_chunk_follows_a_slower_host() -> None:
    c = PrefillChunker(target_s=1.0)
    feed(c, 0.05, 0.001, [300, 700, 256, 1000, 512])
    before = c.limit(8192)
    feed(c, 0.05, 0.004, [200, 500, 250, 350] * 6)  # four times the cost per row
    after = c.limit(8192)
    assert before is not None and after is not None
    assert after < before / 3
    assert after == pytest.approx(0.95 / 0.004, rel=0.05)


def test_prompts_alone_never_set_the_first_chunk_beside_decodes_above_twice_the_first() -> None:
    # a long prompt, then one after a prefix-cache hit whose attention over the whole context
    # makes its few rows slow: the line through them has a large fixed cost and a small slope
    c = PrefillChunker(target_s=1.0)
    c.observe(2726, 0, 11.0)
    c.observe(295, 0, 6.0)
    a, b, fitted = c.model() or (0.0, 0.0, False)
    assert fitted and 2 * a / b > 2 * FIRST_CHUNK
    assert c.limit(8192) == 2 * FIRST_CHUNK  # the first step with decodes: at most twice it
    c.observe(2 * FIRST_CHUNK, 2, 2.1)  # measured beside decodes, the fit corrects itself
    assert (c.limit(8192) or 0) <= 4 * FIRST_CHUNK


def test_a_fixed_cost_larger_than_the_target_keeps_the_chunk_whole() -> None:
    # an offloaded MoE: each chunk fetches every expert (2 s) whatever its size; cutting it
    # would refetch them per smaller chunk and could not meet the target anyway
    c = PrefillChunker(target_s=1.0)
    feed(c, 2.0, 0.0001, [256, 1024, 512, 2048])
    assert c.limit(8192) == 2 * 2046  # at most twice the last chunk beside decodes
    feed(c, 2.0, 0.0001, [4098])  # 4096 prompt tokens and 2 decodes
    assert c.limit(8192) == 8192
    # the target asks for 1000 tokens, where half the step is its fixed cost; at most a third
    # may be: 2 a / b = 2000 tokens, a stall of 1.5 s
    c = PrefillChunker(target_s=1.0)
    feed(c, 0.5, 0.0005, [256, 1024, 512, 2048])
    assert c.limit(8192) == 2000


def test_one_size_seen_is_charged_per_row_or_tried_at_half_and_floors_hold() -> None:
    c = PrefillChunker(target_s=1.0)
    c.observe(512, 0, 2.56)  # a prompt alone, 512 rows in 2.56 s: no fixed cost to see
    assert c.model() == (0.0, pytest.approx(0.005), False)
    assert c.limit(8192) == 200  # 1 s at 0.005 s per row
    c.observe(200, 2, 1.2)  # beside decodes: a second size, a fixed cost of 0.32 s
    assert c.limit(8192) == 156  # (1 - 0.315) / 0.00439
    c = PrefillChunker(target_s=1.0)
    c.observe(200, 2, 1.2)  # one size beside decodes: the next one tries half of it
    assert c.limit(8192) == 100
    c.observe(100, 2, 0.7)
    a, b, fitted = c.model() or (0.0, 0.0, False)
    assert fitted and a > 0.1
    c = PrefillChunker(target_s=1.0)
    c.observe(MIN_CHUNK, 2, 1.0)  # at the floor, the second size is twice it
    assert c.limit(8192) == 2 * MIN_CHUNK
    c = PrefillChunker(target_s=1.0)
    feed(c, 0.5, 0.001, [300, 330, 310])  # sizes too close together to see the fixed cost
    a, b, fitted = c.model() or (1.0, 1.0, True)
    assert not fitted and a == 0.0
    assert b == pytest.approx((0.5 + 0.001 * 313) / 313, rel=0.02)
    c = PrefillChunker(target_s=0.01)
    feed(c, 0.0, 0.01, [300, 600])
    assert c.limit(8192) == MIN_CHUNK
    c.observe(0, 4, 5.0)  # decode-only steps are not this model's, nor short prompts
    c.observe(MIN_CHUNK - 1, 4, 5.0)
    assert c.model() == (pytest.approx(0.0), pytest.approx(0.01), True)


def test_the_option_is_validated() -> None:
    assert EngineConfig().decode_stall_target == 1.0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="decode_stall_target"):
            EngineConfig(decode_stall_target=bad)


# --- the scheduler ---------------------------------------------------------------------------

def decoding(pool: PagePool, sched: Scheduler, rid: str) -> Sequence:
    seq = Sequence(rid, [1, 2, 3, 4, 5], 4, GREEDY, None, 0.0)
    seq.num_computed = 4
    pages = pool.alloc(1)
    assert pages is not None
    seq.pages, seq.status = pages, Status.RUNNING
    sched.running.append(seq)
    return seq


def prompt(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(100, 100 + n)), n, GREEDY, None, 0.0)


def advance(work: list[Work]) -> None:
    """The engine's part of a step: the tokens computed, a token sampled at a prompt's end."""
    for seq, n in work:
        seq.num_computed += n
        if seq.num_computed == len(seq.tokens):
            seq.tokens.append(0)


def test_a_step_with_decodes_takes_at_most_the_chunk_of_prompt_tokens() -> None:
    pool = PagePool(64, 16)
    sched = Scheduler(pool, max_prefill_length=512, max_running=8, prefix_cache=False)
    sched.prefill_with_decodes = 40
    d = decoding(pool, sched, "d")
    sched.add(prompt("p", 100))
    sched.add(prompt("q", 30))
    work = sched.schedule()
    assert [(w.seq.request_id, w.num_tokens) for w in work] == [("d", 1), ("p", 40)]
    advance(work)
    work = sched.schedule()  # the running prefill goes on by the chunk; q waits for room
    assert [(w.seq.request_id, w.num_tokens) for w in work] == [("d", 1), ("p", 40)]
    advance(work)
    sched.running.remove(d)  # d finished
    work = sched.schedule()  # no decode in the step: the budget alone bounds the prompts
    assert [(w.seq.request_id, w.num_tokens) for w in work] == [("p", 20), ("q", 30)]


def test_prompt_tokens_are_shared_out_in_order_and_decodes_never_wait() -> None:
    pool = PagePool(64, 16)
    sched = Scheduler(pool, max_prefill_length=512, max_running=8, prefix_cache=False)
    sched.prefill_with_decodes = 50
    decoding(pool, sched, "d1")
    sched.add(prompt("p", 30))
    sched.add(prompt("q", 30))
    decoding(pool, sched, "d2")
    work = sched.schedule()
    assert [(w.seq.request_id, w.num_tokens) for w in work] == [
        ("d1", 1), ("d2", 1), ("p", 30), ("q", 20)]


# --- the engine ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_path(tiny_models: dict[str, Path]) -> str:
    return str(tiny_models["qwen3_moe"])


def test_a_long_prompt_beside_a_stream_is_chunked_and_changes_no_result(moe_path: str) -> None:
    long_prompt = [(7 * i) % 200 + 3 for i in range(600)]
    unbounded = LLM(moe_path, kv_tokens=2048, decode_stall_target=0.0)
    ref = [c.token_ids for c in unbounded.generate([[5, 6, 7], long_prompt], GREEDY)]

    llm = LLM(moe_path, kv_tokens=2048, decode_stall_target=1e-6)  # the floors decide
    eng = llm.engine
    eng.add_request(GenerateRequest("s", [5, 6, 7], GREEDY))
    events, _ = eng.step()  # s's prompt: s decodes from now on
    out: dict[str, list[int]] = {"s": events[0].new_token_ids, "p": []}
    eng.add_request(GenerateRequest("p", long_prompt, GREEDY))
    mixed = []
    while eng.has_work():
        events, stats = eng.step()
        for ev in events:
            out[ev.request_id] += ev.new_token_ids
        if stats.kind == "mixed":
            mixed.append((stats.prefill_tokens, stats.prefill_with_decodes))
    assert mixed, "the long prompt never shared a step with the stream"
    for prefill, limit in mixed:
        assert limit is not None and prefill <= limit
    assert [out["s"], out["p"]] == ref
