"""Sampling parameters of one request, validated once at the edge.

The OpenAI fields map one to one; `validate()` raises `InvalidRequest` with the field name,
never an assert, so the server can answer 400 and keep serving. The ranges are chosen so that
the sampler's arithmetic stays finite for any finite fp32 logit:

- `seed` in [-2**63, 2**64 - 1] (the draws take it mod 2**64, `ftrs.engine.sampler.uniform`).
- `stop`: one string or a list of them (None: none); `stop_token_ids` a list of ids. Other
  types, bools as numbers, an empty stop string are refused by name.
- `temperature` in [0, 2] (OpenAI's range). Below `GREEDY_TEMPERATURE` the request is greedy:
  `logits / T` would overflow fp32 for T near 1e-38, and for T < 1e-5 the softmax already puts
  all but exp(-gap / T) of the mass on the argmax for any logit gap above 1e-3.
- `repetition_penalty` in [0.01, 100]: a seen token's logit is scaled by at most 100 either
  way, which keeps it finite for any logit below 3.4e36 and is far past the point where the
  penalty decides the draw.
- `presence_penalty`, `frequency_penalty` in [-2, 2] (OpenAI's range).
- `logit_bias`: (token id, bias) pairs (or a dict id -> bias, ids as ints or OpenAI's digit
  strings), bias in [-100, 100] (OpenAI's range), added to the raw
  logits before anything else; -100 bans a token in practice, +100 all but forces it.
- `reasoning_budget`: at most so many tokens of reasoning (`ReasoningBudget`); then the
  engine writes the end of the reasoning block itself (`ftrs.engine.budget`).
- `structured`: a grammar the output must follow (`StructuredSpec`); the engine masks every
  token the grammar forbids (`ftrs.engine.grammar`). Its compilation is checked by the grammar
  engine, not here: `validate()` checks only the shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftrs.errors import InvalidRequest

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
TEMPERATURE_MAX = 2.0
GREEDY_TEMPERATURE = 1e-5  # temperatures below this are sampled as argmax
REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 0.01, 100.0
LOGIT_BIAS_MAX = 100.0
STRUCTURED_KINDS = ("json_object", "json_schema", "lark")


@dataclass(frozen=True)
class ReasoningBudget:
    """At most `tokens` tokens inside the reasoning block, which `open_id` opens (or the prompt,
    with `opened`) and `close_id` closes; when they are spent the engine writes `end_ids` (the
    block's end, `close_id` among them) token by token instead of sampling."""

    tokens: int
    open_id: int
    close_id: int
    end_ids: tuple[int, ...]
    opened: bool = False


@dataclass(frozen=True)
class StructuredSpec:
    """A constraint on the whole output, enforced token by token by the grammar engine.

    `kind` "json_object" (any JSON object; `value` unused, ""), "json_schema" (`value` is the
    JSON Schema text) or "lark" (`value` is a Lark grammar in llguidance's dialect). `param`
    is the request field a 400 names when the grammar does not compile ("response_format",
    "tool_choice", ...). `lead`: Lark rules defining a rule `lead`, what may come before the
    constrained text (a reasoning model's thinking); "" for nothing."""

    kind: str
    value: str = ""
    param: str = "response_format"
    lead: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        """What the compiled grammar depends on (a cache key)."""
        return (self.kind, self.value, self.lead)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. `temperature < GREEDY_TEMPERATURE` means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top logprobs to return with each token; None = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); ids < vocab
    structured: StructuredSpec | None = None
    reasoning_budget: ReasoningBudget | None = None
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        # the forms people write: one stop string, None for none, lists for tuples
        stop: Any = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, list):
            stop = tuple(stop)
        object.__setattr__(self, "stop", stop)
        ids: Any = self.stop_token_ids
        if ids is None:
            ids = ()
        elif isinstance(ids, list):
            ids = tuple(ids)
        object.__setattr__(self, "stop_token_ids", ids)
        bias: Any = self.logit_bias  # OpenAI's {"id": bias} (ids as JSON keys), pair lists
        if isinstance(bias, dict):
            bias = tuple((int(k) if isinstance(k, str) and k.isdigit() else k, v)
                         for k, v in bias.items())
        elif isinstance(bias, list):
            bias = tuple(tuple(p) if isinstance(p, list) else p for p in bias)
        object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise `InvalidRequest` naming the first bad field; return self when all are good."""

        def bad(name: str, why: str) -> InvalidRequest:
            return InvalidRequest(f"{name}: {why}", evidence={"param": name})

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(name, f"must be a finite number, got {v!r}")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", f"must be true or false, got {self.ignore_eos!r}")
        if not 0.0 <= self.temperature <= TEMPERATURE_MAX:
            raise bad("temperature", f"must be in [0, {TEMPERATURE_MAX:g}], got {self.temperature}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", f"must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not REPETITION_PENALTY_MIN <= self.repetition_penalty <= REPETITION_PENALTY_MAX:
            raise bad("repetition_penalty", f"must be in [{REPETITION_PENALTY_MIN:g}, "
                      f"{REPETITION_PENALTY_MAX:g}], got {self.repetition_penalty}")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s
                                                   for s in self.stop):
            raise bad("stop", f"must be a non-empty string or a list of them, got {self.stop!r}")
        if len(self.stop) > 16:
            raise bad("stop", f"at most 16 stop strings, got {len(self.stop)}")
        if not isinstance(self.stop_token_ids, tuple) or any(
                not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        if vocab_size is not None and any(t >= vocab_size for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"every id must be in [0, {vocab_size})")
        self._validate_logit_bias(vocab_size, bad)
        self._validate_structured(bad)
        b = self.reasoning_budget
        if b is not None and (not isinstance(b.tokens, int) or b.tokens < 0
                              or b.close_id not in b.end_ids):
            raise bad("thinking_token_budget", "must be an integer >= 0 with an end that closes "
                      f"the reasoning, got {b!r}")
        return self

    def _validate_logit_bias(self, vocab_size: int | None,
                             bad: Callable[[str, str], InvalidRequest]) -> None:
        if not isinstance(self.logit_bias, tuple):
            raise bad("logit_bias", "must be a tuple of (token id, bias) pairs")
        seen: set[int] = set()
        for pair in self.logit_bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise bad("logit_bias", f"each entry must be a (token id, bias) pair, got {pair!r}")
            tok, bias = pair
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise bad("logit_bias", f"token ids must be integers >= 0, got {tok!r}")
            if vocab_size is not None and tok >= vocab_size:
                raise bad("logit_bias", f"token id {tok} is not in [0, {vocab_size})")
            if tok in seen:
                raise bad("logit_bias", f"token id {tok} appears twice")
            seen.add(tok)
            if (isinstance(bias, bool) or not isinstance(bias, (int, float))
                    or not math.isfinite(bias) or not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX):
                raise bad("logit_bias", f"bias of token {tok} must be a number in "
                          f"[-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}], got {bias!r}")

    def _validate_structured(self, bad: Callable[[str, str], InvalidRequest]) -> None:
        spec = self.structured
        if spec is None:
            return
        if not isinstance(spec, StructuredSpec):
            raise bad("structured", f"must be a StructuredSpec, got {type(spec).__name__}")
        param = spec.param if isinstance(spec.param, str) and spec.param else "structured"
        if spec.kind not in STRUCTURED_KINDS:
            raise bad(param, f"unknown structured output kind {spec.kind!r} "
                      f"(one of {', '.join(STRUCTURED_KINDS)})")
        if not isinstance(spec.value, str):
            raise bad(param, "the schema or grammar must be text")
        if spec.kind != "json_object" and not spec.value.strip():
            raise bad(param, f"{spec.kind}: the schema or grammar is empty")


__all__ = ["GREEDY_TEMPERATURE", "LOGIT_BIAS_MAX", "SamplingParams", "StructuredSpec"]
