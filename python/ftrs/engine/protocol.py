"""Typed messages between the API process and the engine process (DESIGN.md "How a request flows").

They are plain dataclasses so they pickle across a multiprocessing pipe; nothing here imports torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ftrs.sampling import SamplingParams


@dataclass(slots=True)
class GenerateRequest:
    """One request, already tokenized by the API process."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class AbortRequest:
    """The client went away or a stop string matched: free the request's KV pages now."""

    request_id: str


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of the sampled token and of the `k` most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class TokenEvent:
    """New tokens of one request since the last event; `finish_reason` set on the last one.

    `finish_reason` is "stop" (EOS or stop token), "length" (max_tokens or context), "abort",
    or "error" (then `error` holds `FtrsError.to_dict()` plus "http_status" and "code").
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: dict[str, Any] | None = None


@dataclass(slots=True)
class StepStats:
    """What one engine step did; `server/metrics.py` observes it, the engine never imports prometheus."""

    step: int
    time: float
    duration_s: float
    kind: str  # "prefill" | "decode" | "mixed" | "idle"
    num_running: int
    num_waiting: int
    prefill_tokens: int
    decode_tokens: int
    kv_usage_ratio: float
    prefix_hit_tokens: int = 0
    experts: dict[str, Any] = field(default_factory=dict)
    #: The adaptive guard's live state (`guard.live.LiveGuard.stats()`): prefill_cap_tokens,
    #: pacing, recent events; None when no guard runs (engines without a supervisor).
    guard: dict[str, Any] | None = None
    #: Speculative decoding (`engine/spec.py`): draft tokens this step computed, and accepted.
    draft_tokens: int = 0
    accepted_tokens: int = 0
    #: Requests the scheduler preempted for KV pages since the engine started (cumulative, like
    #: the copy engine's counters in `experts`; `ftrs_preemptions_total` adds the difference).
    preemptions: int = 0
    #: Prompt tokens a step with decodes could take (`engine.chunking`); None: the budget only.
    prefill_with_decodes: int | None = None
    #: The device monitor's latest verdict (`server.supervision.EngineSupervisor`):
    #: {"state": "ok" | "degraded" | "not_applicable", "reason", "bdf"}; None when no monitor runs.
    device: dict[str, Any] | None = None


__all__ = ["AbortRequest", "GenerateRequest", "StepStats", "TokenEvent", "TokenLogprob"]
