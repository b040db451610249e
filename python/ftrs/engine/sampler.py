"""Token sampling with the OpenAI parameters, one row per request.

Order, as in common engines: penalties on the raw logits (repetition over prompt and output,
presence and frequency over the output), then temperature, then top-k, top-p and min-p
filtering, then a draw from the request's own seeded generator — so a seed gives the same
tokens whether the request runs alone or in a batch. Temperature 0 is argmax. Reported
logprobs are those of the model's raw distribution.
"""

from __future__ import annotations

import torch

from ftrs.engine.protocol import TokenLogprob
from ftrs.scheduler.sequence import Sequence


def _penalize(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.tokens)), dtype=torch.long, device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_output:
        out = torch.tensor(seq.output_tokens, dtype=torch.long, device=row.device)
        counts = torch.bincount(out, minlength=row.numel()).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return row


def _filter(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    if p.top_k > 0 and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest set reaching top_p
        row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    if p.min_p > 0.0:
        probs = torch.softmax(row, dim=-1)
        row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return row


def sample(logits: torch.Tensor, seqs: list[Sequence]
           ) -> tuple[list[int], list[TokenLogprob | None]]:
    """`logits`: (len(seqs), vocab) fp32. Returns one token per sequence and its logprob record."""
    tokens: list[int] = []
    records: list[TokenLogprob | None] = []
    for i, seq in enumerate(seqs):
        raw = logits[i]
        p = seq.params
        row = _penalize(raw.clone(), seq)
        if p.greedy:
            tok = int(torch.argmax(row))
        else:
            row = _filter(row / p.temperature, seq)
            probs = torch.softmax(row, dim=-1)
            tok = int(torch.multinomial(probs, 1, generator=seq.generator))
        tokens.append(tok)
        if p.logprobs is not None:
            lp = torch.log_softmax(raw, dim=-1)
            top = torch.topk(lp, p.logprobs) if p.logprobs else None
            alts = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
            records.append(TokenLogprob(tok, float(lp[tok]), alts))
        else:
            records.append(None)
    return tokens, records
