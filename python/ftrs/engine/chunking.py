"""How many prompt tokens a step that carries decodes may take: a measured bound on the stall.

A step computes every running decode's next token together with the next chunks of prompts
(`Scheduler.schedule`). Unbounded, a long prompt that arrives beside running streams makes each
of them wait for its whole chunk, up to the step budget (`max_prefill_length`, 8192 tokens: a
minute of a CPU). `PrefillChunker` keeps a cost model of the steps that compute prompt tokens,
seconds = a + b * rows (rows: the step's prompt and decode tokens), fitted by exponentially
weighted least squares over recent steps, and gives the scheduler the prompt chunk that keeps a
step with decodes near `EngineConfig.decode_stall_target` seconds: (target - a) / b.

Two floors keep the prefill's throughput: never fewer than `MIN_CHUNK` tokens, and never fewer
than a / b, the chunk whose own compute equals the step's fixed cost. On an offloaded MoE that
fixed cost is the experts a chunk fetches; a smaller chunk would spend most of its time
fetching the same experts again, and the target could not be met anyway. Until two different
step sizes have been measured there is no fixed cost to see: the first estimate is
seconds per row of the steps seen (a = 0, which can only shrink the chunk toward the floors, a
different size, and with it a second point), and before any step, `FIRST_CHUNK`.

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
SPREAD = 0.05  # sizes closer than this fraction of their mean are one size (no slope to fit)


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

    def observe(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        """Record a finished step; steps with fewer than `MIN_CHUNK` prompt tokens are not
        this model's."""
        if prefill_tokens < MIN_CHUNK or seconds <= 0:
            return
        x = float(prefill_tokens + decode_tokens)
        self.w = DECAY * self.w + 1.0
        self.sx = DECAY * self.sx + x
        self.sy = DECAY * self.sy + seconds
        self.sxx = DECAY * self.sxx + x * x
        self.sxy = DECAY * self.sxy + x * seconds

    def model(self) -> tuple[float, float] | None:
        """(a, b): fixed seconds of a step with prompt tokens, seconds per row; None before
        any step was observed."""
        if self.w == 0.0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var > (SPREAD * mx) ** 2:
            b = (self.sxy / self.w - mx * my) / var
            a = my - b * mx
            if b > 0 and a >= 0:
                return a, b
        return 0.0, my / mx  # one size seen (or a noisy fit): all of a step's time per row

    def limit(self, budget: int) -> int | None:
        """Prompt tokens a step with decodes may compute, at most `budget`; None: no bound."""
        if self.target_s <= 0:
            return None
        fit = self.model()
        if fit is None:
            return min(budget, FIRST_CHUNK)
        a, b = fit
        chunk = max((self.target_s - a) / b, a / b, MIN_CHUNK)
        return max(1, min(budget, round(chunk)))

    def stats(self, budget: int) -> dict[str, float]:
        """The model and the chunk it gives now, for `/metrics`."""
        fit = self.model()
        chunk = self.limit(budget)
        return {"chunk_tokens": float(budget if chunk is None else chunk),
                "fixed_s": fit[0] if fit else 0.0, "per_row_s": fit[1] if fit else 0.0}
