"""N-gram speculative decoding: drafts looked up in the request's own tokens, verified in one step.

A request that repeats itself (code edits, quoting its prompt, JSON over a fixed set of
keys, lists) can be read ahead from its own context: if its last n tokens (n = 4, 3, then 2)
occurred before, the tokens that followed that occurrence are a draft of what comes next. A
decode step then computes the request's last token and its draft of m tokens as m + 1 rows,
each attending up to its own position (`engine.batch`), samples every row, and keeps the last
token's prediction plus each draft token the model itself predicted at its place, then the
prediction after the last accepted one: 1 to m + 1 tokens for one pass over the weights. On an
offloaded MoE the experts a step's rows share are fetched once for all of them; on a
memory-bound GPU the extra rows are nearly free; on a compute-bound CPU each row costs its
FLOPs, so only a high acceptance pays (`bench/speculative.py` measures which it is).

What makes it exact: a draft token is accepted only when it equals the token the sampler drew at
its place, from the model's logits at that position given accepted tokens only. For a greedy
row that is the argmax; for a sampled row it is a draw with the request's parameters (penalties
counting the draft tokens before it) and the uniform number keyed by the request's seed and the
position (`engine.sampler.uniform`), the number the one-token step at that position would use.
So a draft token is accepted with the probability the model gives it, a rejected one is replaced
by a draw from the rest of that distribution (speculative sampling's rule for a draft of one
certain token), and the output is the very one of decoding one token at a time with the same
seed, up to the rounding of a batch of rows against one row. Logprobs are each row's own. Rows
under a grammar (its matcher is at the last kept token), a reasoning budget still counting, or
prompt logits do not draft.
The KV rows written for rejected tokens lie beyond `num_computed` and are overwritten by the
next step. Models with linear attention layers never draft: their recurrent state cannot step
back over a rejected token.

Drafts never cost another request anything: the scheduler gives them only the step budget and
free KV pages left after every decode and prefill (`Scheduler.schedule`), and never preempts or
evicts for them.

How many tokens to draft is measured, not guessed. Each request keeps the odds that a draft
token is accepted given the ones before it were (`NgramIndex.odds`, a geometric estimate over
its recent drafts; a request that does not draft still checks its lookup's first token against
what it samples, for free). The engine keeps what its decode steps cost by their number of
rows (`StepCost`). A request with odds `p` in a step of `B` decodes then drafts the `k` (up to
the limit) that maximizes the step's expected tokens per second,
`(B + p + ... + p^k) / cost(B + k)`, often 0: on a compute-bound CPU an extra row costs nearly
what a token earns, on a memory-bound GPU or behind a slow link it costs little.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftrs.engine.protocol import TokenEvent
from ftrs.scheduler.scheduler import Work
from ftrs.scheduler.sequence import Sequence

MIN_NGRAM, MAX_NGRAM = 2, 4
MAX_DRAFT = 16  # `EngineConfig.speculative_ngram`'s upper bound
DECAY = 0.8  # weight of a request's older draft outcomes at each new one
COST_DECAY = 0.7  # weight of a size's older steps in its cost, at each new one
STALE_STEPS = 32  # a size not seen in this many decode steps is forgotten (measured again)


@dataclass(slots=True)
class NgramIndex:
    """Per request: each n-gram of its tokens (n in [MIN_NGRAM, MAX_NGRAM]) -> the position
    after its latest occurrence, extended by the tokens added since the last lookup."""

    table: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are in `table`
    # recent draft outcomes, decayed: tokens accepted, and drafts cut short by a rejection
    kept: float = 0.0
    missed: float = 0.0
    guess: int | None = None  # the lookup's first token when it did not draft, to check

    def odds(self) -> float:
        """The chance a draft token is accepted when those before it were (Laplace's rule:
        1/2 before any outcome)."""
        return (self.kept + 1.0) / (self.kept + self.missed + 2.0)

    def outcome(self, kept: int, drafted: int) -> None:
        self.kept = DECAY * self.kept + kept
        self.missed = DECAY * self.missed + (kept < drafted)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """`k` tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` found (past the end of `tokens`, the span from that occurrence repeats: a
        loop drafts its next turn); [] when no suffix occurred before."""
        last = len(tokens) - 1  # n-grams ending at `last` have no follower yet
        for end in range(self.indexed, last):
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end + 1 >= n:
                    self.table[tuple(tokens[end + 1 - n:end + 1])] = end + 1
        self.indexed = max(self.indexed, last)
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if len(tokens) >= n:
                at = self.table.get(tuple(tokens[-n:]))
                if at is not None:  # what followed, read on past the end as a repeat
                    out: list[int] = []
                    for j in range(at, at + k):
                        out.append(tokens[j] if j < len(tokens) else out[j - len(tokens)])
                    return out
        return []


def can_draft(seq: Sequence) -> bool:
    """Whether `seq`'s next tokens may be drafted: a request past its first token whose rows
    the sampler computes from the tokens before them alone (no grammar, whose matcher is at the
    last kept token; no reasoning budget still being counted; no prompt logits)."""
    budget = seq.params.reasoning_budget
    return (seq.params.structured is None and not seq.prompt_logits and seq.num_output > 0
            and (budget is None or (seq.reasoning_closed and not seq.forced)))


class StepCost:
    """A decode step's seconds by its number of rows: the recent steps of each size, averaged
    (decayed). A size not seen yet is estimated optimistically, so a better draft length is
    tried once rather than never: between two sizes seen, on the line between them (a step's
    cost grows concavely with its rows: shared weights are read once, routed experts once per
    distinct expert); beyond the largest, as that one (it cannot cost less) up to twice its
    rows, then in proportion to the rows, so larger steps are tried in doublings, each at most
    twice the cost of the largest seen. A size not seen for `STALE_STEPS` decode steps is
    forgotten: costs drift (contexts grow, batches change, the guard paces the link), and a
    stale high cost (one step slowed by another process on a busy host) would stop drafts until
    then; a size that really costs too much is tried once per `STALE_STEPS` steps."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}
        self._seen: dict[int, int] = {}  # size -> the decode step it was last seen at
        self._steps = 0

    def observe(self, rows: int, seconds: float) -> None:
        self._steps += 1
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else old + (1 - COST_DECAY) * (seconds - old)
        self._seen[rows] = self._steps
        if self._steps % 16 == 0:
            for size in [r for r, at in self._seen.items() if self._steps - at > STALE_STEPS]:
                del self.seconds[size], self._seen[size]

    def clear(self) -> None:
        """Forget every cost (the engine's steps changed: another MoE strategy)."""
        self.seconds.clear()
        self._seen.clear()

    def __call__(self, rows: int) -> float | None:
        """The estimate for a step of `rows` rows; None before any step was seen."""
        known = self.seconds.get(rows)
        if known is not None or not self.seconds:
            return known
        lo = max((r for r in self.seconds if r < rows), default=None)
        hi = min((r for r in self.seconds if r > rows), default=None)
        if lo is None:
            assert hi is not None
            return self.seconds[hi]
        if hi is None:
            return self.seconds[lo] * max(1.0, rows / (2 * lo))
        t_lo, t_hi = self.seconds[lo], self.seconds[hi]
        return t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo)


def best_draft(p: float, limit: int, rows: int, tokens: float,
               cost: Callable[[int], float | None]) -> int:
    """The draft length in [0, limit] with the most tokens per second for a step that has
    `rows` rows and `tokens` expected tokens without it, one draft token accepted with chance
    `p` given the ones before it were; 0 while the cost of a step is unknown."""
    base = cost(rows)
    if base is None:
        return 0
    best_k, best = 0, tokens / base
    gain, term = 0.0, 1.0
    for k in range(1, limit + 1):
        term *= p
        gain += term
        t = cost(rows + k)
        assert t is not None
        if t > 0 and (tokens + gain) / t > best:
            best_k, best = k, (tokens + gain) / t
    return best_k


class NgramDrafter:
    """Proposes each step's drafts (`propose`, before `Scheduler.schedule`), settles a step's
    sampled rows into tokens (`commit`) and learns the step cost (`observe`); counts drafted
    and accepted tokens."""

    def __init__(self, max_draft: int, max_model_len: int,
                 cost: Callable[[int], float | None] | None = None) -> None:
        self.max_draft = max_draft
        self.max_model_len = max_model_len
        self.cost = cost if cost is not None else StepCost()
        self.drafted = 0  # draft tokens computed, since the engine started
        self.accepted = 0  # of those, the ones kept

    def propose(self, running: list[Sequence]) -> None:
        """Set `seq.draft` for every running sequence: its draft, or [] when it has none or
        drafting would not pay. Requests are considered in order, each with the rows and the
        expected tokens of the decodes and the drafts before it."""
        decoding = [s for s in running if s.num_computed + 1 == len(s.tokens)]
        rows, tokens = len(decoding), float(len(decoding))
        for seq in running:
            seq.draft = []
        for seq in decoding:
            if not can_draft(seq):
                continue
            p = seq.params
            room = min(p.max_tokens - seq.num_output, self.max_model_len - len(seq.tokens)) - 1
            if room <= 0:
                continue
            index = seq.ngrams
            if index is None:
                index = seq.ngrams = NgramIndex()
            draft = index.lookup(seq.tokens, min(self.max_draft, room))
            if not draft:
                continue
            odds = index.odds()
            k = best_draft(odds, len(draft), rows, tokens, self.cost)
            seq.draft = draft[:k]
            index.guess = None if k else draft[0]
            rows += k
            tokens += sum(odds ** i for i in range(1, k + 1))

    def observe(self, rows: int, seconds: float) -> None:
        """A decode step (no prefill row) of `rows` rows took `seconds`."""
        if isinstance(self.cost, StepCost):
            self.cost.observe(rows, seconds)

    def commit(self, work: list[Work], seqs: list[Sequence], sampled: tuple[list[Any], ...],
               append: Callable[[Sequence, int | None, object, str | None], TokenEvent]
               ) -> tuple[list[TokenEvent], int, int]:
        """`commit_step` with this drafter's draft lengths adapted and its counts kept."""
        events, drafted, accepted = commit_step(work, seqs, sampled, append)
        self.drafted += drafted
        self.accepted += accepted
        return events, drafted, accepted


def commit_step(work: list[Work], seqs: list[Sequence], sampled: tuple[list[Any], ...],
                append: Callable[[Sequence, int | None, object, str | None], TokenEvent]
                ) -> tuple[list[TokenEvent], int, int]:
    """Advance every sequence of a step by what it computed and append its sampled tokens:
    one event per sampled sequence, with 1 + its accepted draft tokens. `seqs` and `sampled`
    are the step's sample rows (`Batch.sample_seqs`, `sampler.sample`), a drafting sequence's
    1 + m rows in a run. Returns the events, draft tokens computed and draft tokens accepted."""
    drafting = set()
    for w in work:
        seq = w.seq
        if seq.num_computed + w.num_tokens > len(seq.tokens):  # its last token and a draft
            drafting.add(id(seq))
            seq.num_computed += 1
        else:
            seq.num_computed += w.num_tokens
    events: list[TokenEvent] = []
    drafted = accepted = 0
    toks, recs, whys = sampled
    r = 0
    while r < len(seqs):
        seq = seqs[r]
        draft = seq.draft if id(seq) in drafting else []
        index = seq.ngrams
        if index is not None and index.guess is not None:  # an undrafted lookup, checked
            index.outcome(int(index.guess == toks[r]), 1)
            index.guess = None
        event = append(seq, toks[r], recs[r], whys[r])
        kept = 0
        for j, d in enumerate(draft):
            if event.finish_reason is not None or d != toks[r + j]:
                break
            seq.num_computed += 1  # the draft token's KV row was computed from kept tokens
            kept += 1
            nxt = append(seq, toks[r + j + 1], recs[r + j + 1], whys[r + j + 1])
            records = (None if event.logprobs is None or nxt.logprobs is None
                       else event.logprobs + nxt.logprobs)
            event = TokenEvent(seq.request_id, event.new_token_ids + nxt.new_token_ids,
                               nxt.finish_reason, records, nxt.num_prompt_tokens,
                               nxt.num_cached_tokens, nxt.error)
        if draft:
            drafted += len(draft)
            accepted += kept
            if index is not None:
                index.outcome(kept, len(draft))
            seq.draft = []
        events.append(event)
        r += 1 + len(draft)
    return events, drafted, accepted


__all__ = ["MAX_DRAFT", "NgramDrafter", "NgramIndex", "StepCost", "best_draft", "can_draft",
           "commit_step"]
