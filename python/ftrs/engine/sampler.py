"""Token sampling with the OpenAI parameters, batched over the rows of a step.

Order, as in common engines: penalties on the raw logits (repetition over prompt and output,
presence and frequency over the output), then temperature, then top-k, top-p and min-p
filtering, then a draw keyed by the request's seed and the token's position. Every operation
acts on each row alone, so a seed gives the same tokens whether the request runs alone or in a
batch.
Temperature 0 is argmax.

Constraints come first, on the logits' device: `logit_bias` is added to the raw logits, then
the grammar's mask (`ftrs.engine.grammar`) sets every forbidden token to -inf, then a row whose
reasoning budget is spent keeps only the token it must write (`ftrs.engine.budget`). Everything after
(penalties, the draw, greedy argmax) sees only allowed tokens. Reported logprobs are those of the
model's distribution after bias and mask, before penalties and temperature: the sampled token
always has a finite logprob, and the top alternatives are only tokens that could have been drawn
(a forbidden token, logprob -inf, is never listed).

Rows split three ways, so the common case costs the least:
- plain greedy rows (no penalty, no logprobs): argmax on the logits' device, only the ids
  cross to the host;
- every other row is copied to the host once and computed in float64, batched: penalties,
  temperature, filters, softmax;
- the draw: one uniform number per sampled row, then one batched inverse-CDF lookup
  (`searchsorted` over the cumulative probabilities).

The uniform number of a draw is a function of the request's seed and the position of the token
drawn, nothing else (`uniform`: SplitMix64 over both). A seed thus gives the same tokens alone or
in a batch, after a preemption that recomputes the sequence, and with speculative decoding: a
draft row at position t computed from accepted tokens sees the distribution and the number the
one-token step at t would see, so it draws the same token (`ftrs.engine.spec`), and the rows of
rejected drafts consume nothing.

Overflow. `temperature` and `repetition_penalty` are any positive finite number (1e-300
included), so the math must not overflow into nan. In float64 (range 1e308, where the fp32
logits are at most 3.4e38) penalties stay finite or become +-inf, never nan; +inf (a seen token
divided by a tiny penalty) is capped to the largest double, -inf kept. Temperature divides the
row minus its maximum: the numerator is in [-inf, 0], the maximum itself gives exactly 0, so the
scaled row is never nan and its softmax has at least one exp(0) = 1. A temperature far below a
logit gap thus gives that gap -inf, which is the limit of the math (argmax), not an error. A
row that still has no finite probability (the model produced nan or -inf everywhere) is reported
in `SampleOutput.errors`: that request fails alone, the others in the step go on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Sequence_
from typing import NamedTuple

import torch

from ftrs.engine.budget import forced_token
from ftrs.engine.protocol import TokenLogprob
from ftrs.scheduler.sequence import Sequence

_MAX = torch.finfo(torch.float64).max
_M64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit words whose outputs pass BigCrush."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _M64
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) of the draw of the token at `position` (its index in the
    sequence, prompt included) of a request seeded with `seed` (any integer; taken mod 2**64).
    Distinct positions of one seed, and distinct seeds, give independent-looking numbers."""
    z = _mix64((seed + 0x9E3779B97F4A7C15) & _M64)
    z = _mix64((z + (position + 1) * 0x9E3779B97F4A7C15) & _M64)
    return (z >> 11) * 2.0 ** -53


class SampleOutput(NamedTuple):
    """Per row: the token (None when the row failed), its logprob record, and why it failed."""

    tokens: list[int | None]
    records: list[TokenLogprob | None]
    errors: list[str | None]


def _plain_greedy(seq: Sequence) -> bool:
    p = seq.params
    return (p.greedy and p.logprobs is None and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty)


def sample(logits: torch.Tensor, seqs: list[Sequence], allowed: torch.Tensor | None = None,
           allowed_rows: Sequence_[int] = ()) -> SampleOutput:
    """`logits`: (len(seqs), vocab) fp32, on any device. One token per row. `allowed`:
    (len(allowed_rows), vocab) bool on the same device, the grammar's mask of those rows.
    Consecutive rows of one sequence are its next positions (a speculative draft's rows): the
    first draws the token after `seq.tokens`, each next one the token after that."""
    logits = constrain(logits, seqs, allowed, allowed_rows)
    n = len(seqs)
    positions: list[int] = []
    for i, s in enumerate(seqs):
        positions.append(positions[-1] + 1 if i and seqs[i - 1] is s else len(s.tokens))
    tokens: list[int | None] = [None] * n
    records: list[TokenLogprob | None] = [None] * n
    errors: list[str | None] = [None] * n
    fast = [i for i, s in enumerate(seqs) if _plain_greedy(s)]
    if fast:
        rows = logits if len(fast) == n else logits[torch.tensor(fast, device=logits.device)]
        best, arg = rows.max(dim=-1)
        ok = torch.isfinite(best)  # a nan or all -inf row has nothing to pick
        for i, tok, good in zip(fast, arg.tolist(), ok.tolist()):
            if good:
                tokens[i] = tok
            else:
                errors[i] = "the model's logits have no finite value"
    slow = [i for i in range(n) if not _plain_greedy(seqs[i])]
    if slow:
        raw = (logits if len(slow) == n else
               logits[torch.tensor(slow, device=logits.device)]).to("cpu", torch.float32)
        _sample_rows(raw, [seqs[i] for i in slow], [positions[i] for i in slow], slow, tokens,
                     records, errors)
    return SampleOutput(tokens, records, errors)


def constrain(logits: torch.Tensor, seqs: list[Sequence], allowed: torch.Tensor | None = None,
              allowed_rows: Sequence_[int] = ()) -> torch.Tensor:
    """`logits` with each row's `logit_bias` added and the grammar masks applied (a copy when
    anything changes; the input is never written)."""
    biased = [i for i, s in enumerate(seqs) if s.params.logit_bias]
    forced = [(i, t) for i, s in enumerate(seqs) if (t := forced_token(s)) is not None]
    if not biased and allowed is None and not forced:
        return logits
    x = logits.clone()
    if biased:
        rows = [i for i in biased for _ in seqs[i].params.logit_bias]
        cols = [t for i in biased for t, _ in seqs[i].params.logit_bias]
        vals = [float(b) for i in biased for _, b in seqs[i].params.logit_bias]
        dev = x.device
        x.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                     torch.tensor(vals, dtype=x.dtype, device=dev), accumulate=True)
    if allowed is not None and len(allowed_rows):
        idx = torch.tensor(list(allowed_rows), dtype=torch.long, device=x.device)
        x[idx] = x[idx].masked_fill(~allowed, -float("inf"))
    if forced:  # a spent reasoning budget: the block's end is written, not drawn
        rows_f = torch.tensor([i for i, _ in forced], device=x.device)
        x[rows_f] = -float("inf")
        x[rows_f, torch.tensor([t for _, t in forced], device=x.device)] = 0.0
    return x


def _sample_rows(raw: torch.Tensor, seqs: list[Sequence], positions: list[int], where: list[int],
                 tokens: list[int | None], records: list[TokenLogprob | None],
                 errors: list[str | None]) -> None:
    """The rows that need more than an argmax; `raw`: (rows, vocab) fp32 on the host."""
    x = _penalize(raw.double(), seqs, positions)
    greedy = [s.params.greedy for s in seqs]
    picked: list[int | None] = [None] * len(seqs)
    if any(greedy):
        best, arg = x.max(dim=-1)
        for r, (g, tok, b) in enumerate(zip(greedy, arg.tolist(), best.tolist())):
            if g:
                picked[r] = tok if b > -float("inf") else None
    drawn = [r for r, g in enumerate(greedy) if not g]
    if drawn:
        for r, tok in zip(drawn, _draw(x[drawn], [seqs[r] for r in drawn],
                                       [positions[r] for r in drawn])):
            picked[r] = tok
    lp_rows = [r for r, s in enumerate(seqs) if s.params.logprobs is not None]
    lp = top = None
    if lp_rows:
        lp = torch.log_softmax(raw[lp_rows], dim=-1)  # the model's own distribution
        k = max(seqs[r].params.logprobs or 0 for r in lp_rows)
        top = torch.topk(lp, k) if k else None
    for r, tok in enumerate(picked):
        i = where[r]
        if tok is None:
            errors[i] = "no token has a finite probability after the sampling parameters"
            continue
        tokens[i] = tok
        if lp is not None and r in lp_rows:
            j = lp_rows.index(r)
            want = seqs[r].params.logprobs or 0
            alts: list[tuple[int, float]] = []
            if top is not None and want:  # a forbidden token (-inf) is no alternative
                alts = [(t, v) for t, v in zip(top.indices[j, :want].tolist(),
                                               top.values[j, :want].tolist()) if v > -math.inf]
            records[i] = TokenLogprob(tok, float(lp[j, tok]), alts)


def _penalize(x: torch.Tensor, seqs: list[Sequence], positions: list[int]) -> torch.Tensor:
    """Repetition, presence and frequency penalties, each row by its own request's values and
    the tokens before its position: a draft row's include the draft tokens before it."""
    n, vocab = x.shape

    def before(r: int) -> list[int]:
        s = seqs[r]
        return s.tokens + s.draft[:positions[r] - len(s.tokens)]

    rep = torch.tensor([s.params.repetition_penalty for s in seqs], dtype=torch.float64)
    if bool((rep != 1.0).any()):
        seen = torch.zeros(n, vocab, dtype=torch.bool)
        for r, s in enumerate(seqs):
            if s.params.repetition_penalty != 1.0:
                seen[r, torch.tensor(before(r), dtype=torch.long)] = True
        pen = rep[:, None]
        x = torch.where(seen, torch.where(x > 0, x / pen, x * pen), x)
    pres = [s.params.presence_penalty for s in seqs]
    freq = [s.params.frequency_penalty for s in seqs]
    if any(pres) or any(freq):
        counts = torch.zeros(n, vocab, dtype=torch.float64)
        for r, s in enumerate(seqs):
            if (pres[r] or freq[r]) and positions[r] > s.num_prompt:
                out = torch.tensor(before(r)[s.num_prompt:], dtype=torch.long)
                counts[r].index_add_(0, out, torch.ones(out.numel(), dtype=torch.float64))
        f = torch.tensor(freq, dtype=torch.float64)[:, None]
        p = torch.tensor(pres, dtype=torch.float64)[:, None]
        x = x - (f * counts + p * (counts > 0).double())
    return x.nan_to_num(nan=-float("inf"), posinf=_MAX, neginf=-float("inf"))  # see above


def _draw(x: torch.Tensor, seqs: list[Sequence], positions: list[int]) -> list[int | None]:
    """Temperature, top-k, top-p, min-p, then one draw per row, keyed by its sequence's seed
    and the row's token position. `x`: (rows, vocab) float64 penalised logits. None for a row
    with no finite probability."""
    n, vocab = x.shape
    temp = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float64)[:, None]
    top = x.max(dim=-1, keepdim=True).values
    # (x - max) <= 0 and finite or -inf; max - max = 0: no nan whatever the temperature;
    # a row whose max is -inf has nothing finite: (-inf) - (-inf) = nan, caught below
    x = (x - top) / temp
    ks = [s.params.top_k if 0 < s.params.top_k < vocab else 0 for s in seqs]
    if any(ks):
        kth = torch.topk(x, max(ks), dim=-1).values  # (rows, max k) descending
        idx = torch.tensor([max(k, 1) - 1 for k in ks])[:, None]
        cut = kth.gather(1, idx)
        cut[torch.tensor(ks) == 0] = -float("inf")
        x = x.masked_fill(x < cut, -float("inf"))
    top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float64)[:, None]
    if bool((top_p < 1.0).any()):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = (probs.cumsum(-1) - probs > top_p) & (top_p < 1.0)  # keep the smallest set
        x = x.scatter(1, order, sorted_x.masked_fill(drop, -float("inf")))
    min_p = torch.tensor([s.params.min_p for s in seqs], dtype=torch.float64)[:, None]
    if bool((min_p > 0).any()):
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, -float("inf"))
    probs = torch.softmax(x, dim=-1)
    cdf = probs.cumsum(dim=-1)  # (rows, vocab), non-decreasing
    total = cdf[:, -1:]
    good = torch.isfinite(total) & (total > 0)  # (rows, 1)
    cdf = torch.where(good, cdf, 0.0)
    u = torch.tensor([[uniform(s.seed or 0, t)] for s, t in zip(seqs, positions)],
                     dtype=torch.float64).reshape(n, 1)
    # the first token whose cumulative probability exceeds u * total: never one of probability
    # 0; `last` (the last token of positive probability) catches u * total rounding to total
    picked = torch.searchsorted(cdf, u * torch.where(good, total, 0.0), right=True)
    last = (probs > 0).cumsum(dim=-1).argmax(dim=-1, keepdim=True)
    picked = torch.minimum(picked, last).squeeze(1)
    return [int(t) if g else None for t, g in zip(picked.tolist(), good.squeeze(1).tolist())]
