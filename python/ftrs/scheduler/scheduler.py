"""The scheduler: continuous batching with chunked prefill inside one token budget.

Each step it takes, in order: one decode token for every running request whose prompt is done,
then the next chunk of running prefills, then new requests first-come first-served, while the
step's token budget (`max_prefill_length`), `max_running_requests` and the KV pages allow.
Prefill and decode share a step, so a long prompt never freezes running streams: in a step that
carries decodes, prompt tokens are also held to `prefill_with_decodes` (set each step by the
engine from the measured step cost, `engine.chunking`; None: only the budget).

KV pages come from the free pool, then from evicting unreferenced prefix-cache pages; when both
are exhausted a running request is preempted (newest first): its pages are released and it goes
back to the head of the queue with its generated tokens, to be recomputed later. Never dropped.
`num_preemptions` counts them since the scheduler started (`StepStats.preemptions`,
`ftrs_preemptions_total`).

Models with linear attention layers also hold a state slot per running sequence (`StateSlots`):
taken when the sequence starts running, given back with its pages when it finishes or is
preempted (its state is recomputed with its KV). Such models run without the prefix cache
(`prefix_cache=False`): a cached prefix would need the state at that point too.

Shared prompts (n > 1, or several requests with one system prompt): a running prefill publishes
its prompt's full pages to the prefix cache as they are computed, not only when it finishes; a
waiting request whose prompt shares more full pages with such a prefill than it has published
yet waits (the requests behind it go ahead), then takes those pages from the cache instead of
computing them again.

Drafts (speculative decoding, `ftrs.engine.spec`) come last: a decode is extended by its draft
only with the budget and free pages left after everything above (`_add_drafts`).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import NamedTuple

from ftrs.errors import ContextLengthExceeded
from ftrs.kvcache.pages import PagePool
from ftrs.kvcache.radix import RadixCache
from ftrs.kvcache.state import StateSlots
from ftrs.scheduler.sequence import Sequence, Status

log = logging.getLogger(__name__)


class Work(NamedTuple):
    seq: Sequence
    num_tokens: int  # tokens of `seq` computed in this step, from `seq.num_computed`


class Scheduler:
    def __init__(self, pool: PagePool, max_prefill_length: int, max_running: int,
                 prefix_cache: bool = True, states: StateSlots | None = None) -> None:
        self.pool = pool
        self.radix = RadixCache(pool) if prefix_cache else None
        self.states = states  # linear attention state slots, at least `max_running` of them
        self.budget = max_prefill_length
        self.prefill_with_decodes: int | None = None  # prompt tokens of a step with decodes
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # requests preempted for KV pages since the start
        # running prefills whose prompt pages are not all published, by their first page
        self._prefilling: dict[tuple[int, ...], Sequence] = {}

    # --- queue ------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        pages_needed = -(-(len(seq.tokens) + seq.params.max_tokens) // self.pool.page_size)
        if pages_needed > self.pool.num_pages:
            raise ContextLengthExceeded(
                f"prompt ({len(seq.tokens)} tokens) plus max_tokens ({seq.params.max_tokens}) "
                f"exceeds the KV cache ({self.pool.num_pages * self.pool.page_size} tokens)",
                evidence={"prompt_tokens": len(seq.tokens), "max_tokens": seq.params.max_tokens})
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def kv_usage(self) -> float:
        """Share of pages held by requests (cached prefixes nobody uses do not count)."""
        idle = self.pool.num_free + (self.radix.evictable() if self.radix else 0)
        return 1.0 - idle / self.pool.num_pages

    # --- pages ------------------------------------------------------------------------------

    def _take_pages(self, n: int) -> list[int] | None:
        if n <= 0:
            return []
        short = n - self.pool.num_free
        if short > 0 and self.radix is not None:
            self.radix.evict(short)
        return self.pool.alloc(n)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = -(-(seq.num_computed + num_tokens) // self.pool.page_size) - len(seq.pages)
        pages = self._take_pages(need)
        if pages is None:
            return False
        seq.pages.extend(pages)
        return True

    def _release(self, seq: Sequence, cache: bool) -> None:
        if cache and self.radix is not None:
            full = seq.num_computed // self.pool.page_size
            self.radix.insert(seq.tokens[: full * self.pool.page_size], seq.pages[:full])
        for p in seq.pages:
            self.pool.unref(p)
        seq.pages = []
        seq.slot_table = seq.slot_pages = None
        seq.block_row = seq.block_pages = None
        if seq.state_slot is not None:
            assert self.states is not None
            self.states.free(seq.state_slot)
            seq.state_slot = None

    def _preempt(self, seq: Sequence) -> None:
        log.info("preempting %s (%d tokens) to free KV pages", seq.request_id, len(seq.tokens))
        self.running.remove(seq)
        self._release(seq, cache=True)
        seq.num_computed = 0
        seq.num_cached = 0
        seq.draft = []
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # --- shared prompts ---------------------------------------------------------------------

    def _first_page(self, seq: Sequence) -> tuple[int, ...] | None:
        """The key of `seq` among shared prefills: its first page, when it has a full page that
        the prefix cache could serve (one token is always computed)."""
        ps = self.pool.page_size
        if self.radix is None or seq.prompt_logits or seq.num_prompt - 1 < ps:
            return None
        return tuple(seq.tokens[:ps])

    def _publish(self) -> None:
        """Put the computed full prompt pages of running prefills into the prefix cache."""
        assert self.radix is not None or not self._prefilling
        ps = self.pool.page_size
        for key, seq in list(self._prefilling.items()):
            if seq.status is not Status.RUNNING:  # preempted or finished: it publishes no more
                del self._prefilling[key]
                continue
            full = min(seq.num_computed, seq.num_prompt) // ps
            if self.radix is not None and full:
                self.radix.insert(seq.tokens[: full * ps], seq.pages[:full])
            if seq.num_computed >= seq.num_prompt:
                del self._prefilling[key]

    def _should_wait(self, seq: Sequence) -> bool:
        """Whether `seq` should wait for a running prefill that will publish pages it shares."""
        key = self._first_page(seq)
        other = self._prefilling.get(key) if key is not None else None
        if other is None or other is seq or other.status is not Status.RUNNING:
            return False
        ps = self.pool.page_size
        limit = min((len(seq.tokens) - 1) // ps, other.num_prompt // ps)
        shared = 0
        while shared < limit and (seq.tokens[shared * ps:(shared + 1) * ps]
                                  == other.tokens[shared * ps:(shared + 1) * ps]):
            shared += 1
        return shared > min(other.num_computed, other.num_prompt) // ps

    # --- the step ---------------------------------------------------------------------------

    def schedule(self) -> list[Work]:
        budget = self.budget
        if self._prefilling:
            self._publish()
        prompt = budget  # prompt tokens this step may still take
        if self.prefill_with_decodes is not None and any(
                s.num_uncomputed == 1 for s in self.running):
            prompt = min(budget, self.prefill_with_decodes)
        work: list[Work] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            decode = seq.num_uncomputed == 1
            n = 1 if decode else min(seq.num_uncomputed, budget, prompt)
            if n == 0:  # a prefill with no prompt tokens left this step: the decodes go on
                continue
            while not self._grow(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                work.append(Work(seq, n))
                budget -= n
                if not decode:
                    prompt -= n
        held: list[Sequence] = []  # waiting for a shared prefill; they keep their place
        while self.waiting and min(budget, prompt) > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if self._should_wait(seq):
                held.append(self.waiting.popleft())
                continue
            if self.radix is not None and not seq.prompt_logits:
                max_pages = (len(seq.tokens) - 1) // self.pool.page_size  # compute >= 1 token
                seq.pages = self.radix.match(seq.tokens, max_pages)
                seq.num_computed = len(seq.pages) * self.pool.page_size
                seq.num_cached = seq.num_computed
            n = min(seq.num_uncomputed, budget, prompt)
            if not self._grow(seq, n):
                # a waiting request holds no pages: another may need the ones it matched
                self._release(seq, cache=False)
                seq.num_computed = seq.num_cached = 0
                break
            self.waiting.popleft()
            if seq.first_cached is None:  # usage tells the cache the request first found
                seq.first_cached = seq.cached_prompt
            if self.states is not None:
                seq.state_slot = self.states.alloc()
                assert seq.state_slot is not None, "fewer state slots than running requests"
            seq.status = Status.RUNNING
            self.running.append(seq)
            work.append(Work(seq, n))
            budget -= n
            prompt -= n
            key = self._first_page(seq)
            if key is not None and seq.num_computed < seq.num_prompt and key not in self._prefilling:
                self._prefilling[key] = seq  # it computes prompt pages others may share
        self.waiting.extendleft(reversed(held))
        self._add_drafts(work, budget)
        return work

    def _add_drafts(self, work: list[Work], budget: int) -> None:
        """Extend decodes with their drafts (`Sequence.draft`, `ftrs.engine.spec`) from what is
        left: the step's budget and free pages, never a preemption or a prefix-cache eviction.
        A decode that gets no room for its draft runs without it."""
        ps = self.pool.page_size
        for i, (seq, n) in enumerate(work):
            if not seq.draft:
                continue
            room = (len(seq.pages) + self.pool.num_free) * ps - seq.num_computed - 1
            m = min(len(seq.draft), budget, room) if n == 1 and seq.num_uncomputed == 1 else 0
            seq.draft = seq.draft[:max(m, 0)]
            if m <= 0:
                continue
            grown = self._grow(seq, 1 + m)
            assert grown, "a draft takes free pages only"
            work[i] = Work(seq, 1 + m)
            budget -= m

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a request: cache its computed full pages, free the rest."""
        seq.finish_reason = reason
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq, cache=reason != "error")
        seq.status = Status.FINISHED
