"""Flatten one step's work into decoder inputs: token ids, positions and attention metadata.

Each sequence keeps its context's cache slots as a tensor that grows with its page table
(`context_slots`), so a step costs O(new pages), not O(context), per sequence: a decode row's
slots are a view of that tensor, its new token's slot one element of it. The causal masks of
prefill chunks and the decode padding mask are built here, once per step, for every layer.

A decode with a draft (`engine.spec`) is m + 1 query rows of one sequence: each goes with the
decode rows, attending to the context up to its own position (the keys of the rows before it
are written first), so a draft is checked by the same attention as one-token decoding, not a
prefill chunk's; on the Triton path the paged kernel takes it as one causal span.

On the Triton path (`paged=True`) the step also carries `PagedMeta`: each sequence's block
table row (page ids) and where its query rows and context end. The rows are kept on the
sequence as host int32 tensors extended by the new pages only (`block_row`); a step copies
them into one table, in pinned memory on CUDA, and sends it with the per-sequence ints by two
non-blocking copies (torch's pinned allocator reuses a buffer only once its copy is done). On
the CPU they are plain tensors and nothing is copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ftrs.layers.attention import AttnMetadata, PrefillSpan, prefill_mask
from ftrs.layers.deltanet import LinearMeta
from ftrs.scheduler.scheduler import Work
from ftrs.scheduler.sequence import Sequence

if TYPE_CHECKING:  # imports Triton: loaded only on the Triton path
    from ftrs.kernels.attention import PagedMeta


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
    sample_all: bool = False  # sample_rows is every row, in order
    num_draft_tokens: int = 0  # draft tokens verified beside the decodes (`engine.spec`)


def context_slots(seq: Sequence, end: int, page_size: int, device: torch.device) -> torch.Tensor:
    """Cache slots of token positions [0, end) of `seq`, (end,) int64 on `device`.

    The slots of all of `seq.pages` are kept on the sequence (`slot_table`) and extended by
    the pages added since the last step; a page table replaced by the scheduler (preemption,
    a prefix-cache match at admission) is expanded afresh."""
    table, have = seq.slot_table, 0
    if table is not None and seq.slot_pages is seq.pages:
        have = table.numel() // page_size
        if have > len(seq.pages):  # pages were dropped in place: start over
            table, have = None, 0
    if table is None or have < len(seq.pages):
        new = torch.tensor(seq.pages[have:], dtype=torch.long)
        add = (new[:, None] * page_size + torch.arange(page_size)).reshape(-1).to(device)
        table = add if table is None or have == 0 else torch.cat((table, add))
        seq.slot_table, seq.slot_pages = table, seq.pages
    assert table.numel() >= end, "KV pages do not cover the context"
    return table[:end]


def block_row(seq: Sequence, num_pages: int) -> torch.Tensor:
    """The first `num_pages` page ids of `seq`, (num_pages,) int32 on the host.

    Kept on the sequence and extended by the pages added since it was last filled (its
    capacity doubles, so growth costs O(new pages) amortised); a page table replaced by the
    scheduler (preemption, a prefix-cache match at admission) is listed afresh."""
    row, have = seq.block_row, seq.block_filled
    if row is None or seq.block_pages is not seq.pages or have > len(seq.pages):
        row, have = None, 0
    if have < num_pages:
        want = len(seq.pages)
        if row is None or row.numel() < want:
            grown = torch.empty(max(want, 2 * (0 if row is None else row.numel())), dtype=torch.int32)
            if row is not None:
                grown[:have] = row[:have]
            row = grown
        row[have:want] = torch.tensor(seq.pages[have:want], dtype=torch.int32)
        seq.block_row, seq.block_pages, seq.block_filled = row, seq.pages, want
        have = want
    assert row is not None and have >= num_pages, "KV pages do not cover the context"
    return row[:num_pages]


def paged_meta(work: list[Work], page_size: int, device: torch.device) -> PagedMeta:
    """The block tables and per-sequence extents of one step, for `kernels.paged_attention`."""
    from ftrs.kernels.attention import PagedMeta

    pin = device.type == "cuda"
    ends = [seq.num_computed + n for seq, n in work]
    pages = [-(-end // page_size) for end in ends]
    table = torch.zeros(len(work), max(pages, default=1), dtype=torch.int32, pin_memory=pin)
    starts, row = [], 0
    for i, ((seq, n), k) in enumerate(zip(work, pages)):
        table[i, :k] = block_row(seq, k)
        starts.append(row)
        row += n
    lens = [n for _, n in work]
    ints = torch.tensor([starts, lens, ends], dtype=torch.int32, pin_memory=pin)
    ints = ints.to(device, non_blocking=True)
    return PagedMeta(table.to(device, non_blocking=True), ints[0], ints[1], ints[2],
                     max(lens, default=0), page_size)


def build_batch(work: list[Work], page_size: int, device: torch.device,
                states: bool = False, paged: bool = False) -> Batch:
    """`states`: the model has linear attention layers; every sequence holds a state slot.
    `paged`: the decoder runs the paged attention kernel (`Decoder.uses_paged_kernel`); the
    step carries block tables (`AttnMetadata.paged`)."""
    ids: list[int] = []
    slot_parts: list[torch.Tensor] = []
    pos_parts: list[torch.Tensor] = []
    decode_rows: list[int] = []
    decode_ctx: list[torch.Tensor] = []
    prefills: list[PrefillSpan] = []
    sample_rows: list[int] = []
    sample_seqs: list[Sequence] = []
    n_prefill = n_decode = n_draft = hit = 0
    for seq, n in work:
        start, end = seq.num_computed, seq.num_computed + n
        row = len(ids)
        ids.extend(seq.tokens[start:end])
        drafted = max(end - len(seq.tokens), 0)  # a decode with its draft (`engine.spec`)
        if drafted:
            ids.extend(seq.draft[:drafted])
        ctx = context_slots(seq, end, page_size, device)
        pos_parts.append(torch.arange(start, end, dtype=torch.long))
        slot_parts.append(ctx[start:end])
        if start == seq.num_cached and seq.num_cached:
            hit += seq.cached_prompt  # first chunk after admission: the cache served the rest
        if seq.num_output > 0 and start == len(seq.tokens) - 1:
            n_decode += 1
            n_draft += drafted
        else:
            n_prefill += n
        if n == 1 or drafted:  # query rows attended with the other single rows, padded and
            for i in range(n):  # masked; a draft's rows each up to its own position
                decode_rows.append(row + i)
                decode_ctx.append(ctx[:start + i + 1])
        else:
            prefills.append(PrefillSpan(row, n, ctx, prefill_mask(n, end, device)))
        if end >= len(seq.tokens):  # every row of a draft: each is checked against its argmax
            sample_rows.extend(range(row + n - 1 - drafted, row + n))
            sample_seqs.extend([seq] * (1 + drafted))
    gather, mask = _decode_gather(decode_ctx, device)
    decode_only = len(decode_rows) == len(ids)
    rows_t = torch.tensor(decode_rows, dtype=torch.long, device=device)
    meta = AttnMetadata(
        slot_mapping=torch.cat(slot_parts),
        decode_rows=rows_t,
        decode_gather=gather, decode_mask=mask, prefills=prefills, decode_only=decode_only,
        linear=_linear_meta(work, rows_t, device) if states else None,
        paged=paged_meta(work, page_size, device) if paged else None)
    return Batch(torch.tensor(ids, dtype=torch.long, device=device),
                 torch.cat(pos_parts).to(device), meta,
                 torch.tensor(sample_rows, dtype=torch.long, device=device), sample_seqs,
                 n_prefill, n_decode, hit, sample_all=len(sample_rows) == len(ids),
                 num_draft_tokens=n_draft)


def _decode_gather(ctx: list[torch.Tensor], device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode rows' context slots (rows, longest) padded with slot 0, and the mask of real keys
    ((rows, 1, 1, longest) bool; None when no row is padded)."""
    if not ctx:
        return torch.zeros(0, 1, dtype=torch.long, device=device), None
    lens = [c.numel() for c in ctx]
    width = max(lens)
    if min(lens) == width:
        return torch.stack(ctx), None
    gather = torch.zeros(len(ctx), width, dtype=torch.long, device=device)
    for i, c in enumerate(ctx):
        gather[i, : c.numel()] = c
    real = torch.arange(width, device=device) < torch.tensor(lens, device=device)[:, None]
    return gather, real[:, None, None, :]


def _linear_meta(work: list[Work], decode_rows: torch.Tensor, device: torch.device) -> LinearMeta:
    """State slots of the step's rows: one-token rows (the decode rows, same order) take the
    recurrent step, longer chunks the chunked form; sequences at token 0 start from zero."""
    slots, spans, fresh = [], [], []
    row = 0
    for seq, n in work:
        assert seq.state_slot is not None, "a running sequence holds a state slot"
        if n == 1:
            slots.append(seq.state_slot)
        else:
            spans.append((row, n, seq.state_slot))
        if seq.num_computed == 0:
            fresh.append(seq.state_slot)
        row += n
    return LinearMeta(decode_rows, torch.tensor(slots, dtype=torch.long, device=device), spans,
                      torch.tensor(fresh, dtype=torch.long, device=device))
