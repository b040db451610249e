"""How many prompt tokens a step that carries decodes may take: a measured bound on the stall.

A step computes every running decode's next token together with the next chunks of prompts
(`Scheduler.schedule`). Unbounded, a long prompt that arrives beside running streams makes each
of them wait for its whole chunk, up to the step budget (`max_prefill_length`, 8192 tokens: a
minute of a CPU). `PrefillChunker` keeps a cost model of the steps that compute prompt tokens,
seconds = a + b * rows (rows: the step's prompt and decode tokens), fitted by exponentially
weighted least squares over recent steps, and gives the scheduler the prompt chunk that keeps a
step with decodes near `EngineConfig.decode_stall_target` seconds: (target - a) / b.

The fixed cost `a` is what a chunk pays whatever its size: on the CPU, reading every expert's
weights once (a chunk routes to all of them); on an offloaded MoE, fetching them. Two floors
keep the prefill's throughput: never fewer than `MIN_CHUNK` tokens, and never so few that the
fixed cost is more than `FIXED_SHARE` of the step (2a / b tokens at a third): the prompt's
time to first token is then at most 1.5 times what one unbounded chunk would take, and where
the target asks for less, the target yields (the stall is then 3a, as short as that allows).

Seeing `a` needs steps of different sizes (their coefficient of variation at least `SPREAD`).
Before any step the chunk is `FIRST_CHUNK`; while one size only is known, the next step with
decodes tries half of it (`RAMP`; twice it at the `MIN_CHUNK` floor), which gives a second size
at a shorter stall; and a chunk never more than doubles from one step with decodes to the next
(the first one: at most twice `FIRST_CHUNK`, whatever prompts alone measured before it), so a
noisy fit costs one step of twice the chunk at most, which then corrects it. (Prompts alone
are the noisiest points: one after a long prefix-cache hit pays attention over the whole
context, which rows alone do not count.) Without a step
with decodes yet (prompts alone) the model charges a step's whole time per row (a = 0) until
sizes spread.

Steps without decodes are not bounded (no stream waits on them) and are measured all the same.
Steps with fewer than `MIN_CHUNK` prompt tokens are not measured: a few rows touch a few of an
MoE layer's experts, a chunk touches them all, so short prompts and decodes cost less than the
line through the chunks' costs says, and would pull its fixed cost down.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_CHUNK = 64  # tokens: the smallest prompt chunk of a step with decodes
FIRST_CHUNK = 256  # tokens: the chunk before any step with prompt tokens was measured
DECAY = 0.8  # weight of the older steps at each new one
SPREAD = 0.25  # sizes whose spread is less than this fraction of their mean: no slope to fit
RAMP = 2.0  # the chunk at most doubles from one step with decodes to the next
FIXED_SHARE = 1 / 3  # the most of a chunk's step its fixed cost may take


@dataclass
class PrefillChunker:
    """The measured cost of steps with prompt tokens, and the chunk it allows beside decodes.
    `target_s` 0 means no bound (`limit` returns None)."""

    target_s: float
    w: float = 0.0  # decayed sums of weights, x, y, x*x, x*y over observed steps
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    last: int | None = None  # prompt tokens of the last measured step with decodes

    def observe(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        """Record a finished step; steps with fewer than `MIN_CHUNK` prompt tokens are not
        this model's."""
        if prefill_tokens < MIN_CHUNK or seconds <= 0:
            return
        if decode_tokens > 0:
            self.last = prefill_tokens
        x = float(prefill_tokens + decode_tokens)
        self.w = DECAY * self.w + 1.0
        self.sx = DECAY * self.sx + x
        self.sy = DECAY * self.sy + seconds
        self.sxx = DECAY * self.sxx + x * x
        self.sxy = DECAY * self.sxy + x * seconds

    def model(self) -> tuple[float, float, bool] | None:
        """(a, b, fitted): fixed seconds of a step with prompt tokens, seconds per row, and
        whether sizes spread enough to fit both (else a = 0 and b is the seconds per row of
        the steps seen); None before any step was observed."""
        if self.w == 0.0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var > (SPREAD * mx) ** 2:
            b = (self.sxy / self.w - mx * my) / var
            if b > 0:  # a negative intercept: a cost that grows faster than the rows, no fixed part
                return max(0.0, my - b * mx), b, True
        return 0.0, my / mx, False

    def limit(self, budget: int) -> int | None:
        """Prompt tokens a step with decodes may compute, at most `budget`; None: no bound."""
        if self.target_s <= 0:
            return None
        fit = self.model()
        if fit is None:
            return min(budget, FIRST_CHUNK)
        a, b, fitted = fit
        if not fitted and self.last is not None:  # one size seen beside decodes: try another
            chunk = self.last / RAMP if self.last >= RAMP * MIN_CHUNK else RAMP * self.last
        else:
            floor = a / b * (1 - FIXED_SHARE) / FIXED_SHARE
            chunk = min(max((self.target_s - a) / b, floor, MIN_CHUNK),
                        RAMP * (self.last or FIRST_CHUNK))
        return max(1, min(budget, round(chunk)))
