"""Per-request state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ftrs.sampling import SamplingParams

if TYPE_CHECKING:
    from ftrs.engine.spec import NgramIndex


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request. `tokens` = prompt + generated; KV exists for `tokens[:num_computed]`."""

    request_id: str
    tokens: list[int]
    num_prompt: int
    params: SamplingParams
    #: the request's seed: the draw for the token at position t is a function of (seed, t)
    #: alone (`engine.sampler.uniform`); None for a greedy request
    seed: int | None
    arrival: float
    status: Status = Status.WAITING
    num_computed: int = 0
    #: tokens served from the prefix cache at (last) admission; after a preemption the match
    #: may run past the prompt into the request's own generated tokens (`cached_prompt`)
    num_cached: int = 0
    #: prompt tokens the prefix cache served at the request's first admission: usage's
    #: `cached_tokens` (a re-admission after a preemption, served the request's own pages,
    #: keeps it); None before the first admission
    first_cached: int | None = None
    pages: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0
    # cache slots of every page in `pages` (engine.batch.context_slots), and the page list
    # they were expanded from: a new list (preemption, admission) is expanded afresh
    slot_table: torch.Tensor | None = None
    slot_pages: list[int] | None = None
    # the same pages as a host int32 row of the paged attention kernel's block table
    # (engine.batch.block_row): its first `block_filled` entries are `block_pages[:block_filled]`
    block_row: torch.Tensor | None = None
    block_pages: list[int] | None = None
    block_filled: int = 0
    #: `EngineCore.logits`: every prompt position's logits are wanted, so the prompt is
    #: computed in full, never taken from the prefix cache.
    prompt_logits: bool = False
    #: slot of the linear attention state (`kvcache.state`) while running; None otherwise
    state_slot: int | None = None
    #: with a reasoning budget (`ftrs.engine.budget`): reasoning tokens so far (-1: not inside
    #: the block), whether the block has closed, and the tokens to write instead of sampling
    reasoning_used: int = -1
    reasoning_closed: bool = False
    forced: list[int] = field(default_factory=list)
    #: n-gram speculative decoding (`ftrs.engine.spec`): this step's draft, the tokens
    #: expected after `tokens` (set before scheduling, trimmed by the scheduler), and the index
    #: of the request's n-grams it is looked up in
    draft: list[int] = field(default_factory=list)
    ngrams: NgramIndex | None = None

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def cached_prompt(self) -> int:
        """Prompt tokens the prefix cache served at (last) admission (never generated ones):
        what `ftrs_prefix_cache_hit_tokens_total` adds at every admission, re-admissions after
        a preemption included (prefill the cache saved); usage counts `first_cached`."""
        return min(self.num_cached, self.num_prompt)

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed
