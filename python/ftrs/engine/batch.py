"""Flatten one step's work into decoder inputs: token ids, positions and attention metadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ftrs.layers.attention import AttnMetadata, PrefillSpan
from ftrs.scheduler.scheduler import Work
from ftrs.scheduler.sequence import Sequence


@dataclass(slots=True)
class Batch:
    input_ids: torch.Tensor  # (tokens,) int64
    positions: torch.Tensor  # (tokens,) int64
    meta: AttnMetadata
    sample_rows: torch.Tensor  # (num_sample,) rows whose logits are sampled
    sample_seqs: list[Sequence]  # aligned with sample_rows
    num_prefill_tokens: int
    num_decode_tokens: int
    prefix_hit_tokens: int


def _slots(pages: list[int], page_size: int, start: int, end: int) -> torch.Tensor:
    """Cache slots of token positions [start, end) of a sequence with page table `pages`."""
    pos = torch.arange(start, end, dtype=torch.long)
    table = torch.tensor(pages, dtype=torch.long)
    return table[pos // page_size] * page_size + pos % page_size


def build_batch(work: list[Work], page_size: int, device: torch.device) -> Batch:
    ids: list[int] = []
    slot_parts: list[torch.Tensor] = []
    pos_parts: list[torch.Tensor] = []
    decode_rows: list[int] = []
    decode_ctx: list[torch.Tensor] = []
    prefills: list[PrefillSpan] = []
    sample_rows: list[int] = []
    sample_seqs: list[Sequence] = []
    n_prefill = n_decode = hit = 0
    for seq, n in work:
        start, end = seq.num_computed, seq.num_computed + n
        row = len(ids)
        ids.extend(seq.tokens[start:end])
        pos_parts.append(torch.arange(start, end, dtype=torch.long))
        slot_parts.append(_slots(seq.pages, page_size, start, end))
        ctx = _slots(seq.pages, page_size, 0, end)
        if start == seq.num_cached and seq.num_cached:
            hit += seq.num_cached  # first chunk after admission: the prefix cache served the rest
        if seq.num_output > 0 and start == len(seq.tokens) - 1:
            n_decode += 1
        else:
            n_prefill += n
        if n == 1:  # one query row: attended with the other single rows, padded and masked
            decode_rows.append(row)
            decode_ctx.append(ctx)
        else:
            prefills.append(PrefillSpan(row, n, ctx.to(device)))
        if end == len(seq.tokens):
            sample_rows.append(row + n - 1)
            sample_seqs.append(seq)
    if decode_ctx:
        width = max(c.numel() for c in decode_ctx)
        gather = torch.zeros(len(decode_ctx), width, dtype=torch.long)
        mask = torch.zeros(len(decode_ctx), 1, 1, width, dtype=torch.bool)
        for i, c in enumerate(decode_ctx):
            gather[i, : c.numel()] = c
            mask[i, 0, 0, : c.numel()] = True
    else:
        gather = torch.zeros(0, 1, dtype=torch.long)
        mask = torch.zeros(0, 1, 1, 1, dtype=torch.bool)
    meta = AttnMetadata(
        slot_mapping=torch.cat(slot_parts).to(device),
        decode_rows=torch.tensor(decode_rows, dtype=torch.long, device=device),
        decode_gather=gather.to(device), decode_mask=mask.to(device), prefills=prefills)
    return Batch(torch.tensor(ids, dtype=torch.long, device=device),
                 torch.cat(pos_parts).to(device), meta,
                 torch.tensor(sample_rows, dtype=torch.long, device=device), sample_seqs,
                 n_prefill, n_decode, hit)
