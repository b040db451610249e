"""Block tables for the paged attention kernel (`engine.batch.block_row`, `paged_meta`): grown
per sequence by the new pages only, and naming the same cache slots as the slot tables the
torch path gathers through."""

from __future__ import annotations

import torch

from ftrs.engine.batch import block_row, build_batch, context_slots
from ftrs.kernels import attention
from ftrs.sampling import SamplingParams
from ftrs.scheduler.scheduler import Work
from ftrs.scheduler.sequence import Sequence

CPU = torch.device("cpu")
PAGE = 4


def _seq(tokens: int, pages: list[int]) -> Sequence:
    return Sequence("r", list(range(3, 3 + tokens)), tokens, SamplingParams(), None, 0.0,
                    pages=pages)


def test_a_row_grows_by_the_new_pages_only() -> None:
    seq = _seq(20, [5, 2])
    assert block_row(seq, 2).tolist() == [5, 2]
    first = seq.block_row
    assert first is not None
    seq.pages.append(9)  # the scheduler extends the list in place
    assert block_row(seq, 3).tolist() == [5, 2, 9]
    grown = seq.block_row
    assert grown is not None and grown.numel() >= 4  # capacity doubled: room for the next page
    seq.pages.append(1)
    assert block_row(seq, 4).tolist() == [5, 2, 9, 1]
    assert seq.block_row is grown  # filled in place, nothing re-listed
    seq.block_row[:4] = -1  # what is filled is never listed again from `pages`
    seq.pages.append(8)
    assert block_row(seq, 5).tolist() == [-1, -1, -1, -1, 8]
    assert block_row(seq, 2).tolist() == [-1, -1]


def test_a_replaced_or_shrunk_page_list_is_listed_afresh() -> None:
    seq = _seq(20, [5, 2, 9])
    block_row(seq, 3)
    seq.pages = [7, 1]  # preemption or a prefix-cache match: a new list
    assert block_row(seq, 2).tolist() == [7, 1]
    seq.pages.pop()  # dropped in place
    assert block_row(seq, 1).tolist() == [7]


def test_paged_meta_of_a_mixed_step() -> None:
    a = _seq(10, [9, 2, 14])  # prefill chunk [6, 10) over 6 cached tokens
    a.num_computed = 6
    b = _seq(6, [7, 11])  # decode of its 6th token
    b.num_computed = 5
    c = _seq(3, [4])  # a whole prompt
    work = [Work(a, 4), Work(b, 1), Work(c, 3)]
    batch = build_batch(work, PAGE, CPU, paged=True)
    meta = batch.meta.paged
    assert meta is not None
    assert meta.block_table.dtype == torch.int32 and meta.block_table.shape == (3, 3)
    assert meta.block_table[0].tolist() == [9, 2, 14]
    assert meta.block_table[1, :2].tolist() == [7, 11]
    assert meta.block_table[2, :1].tolist() == [4]
    assert meta.q_start.tolist() == [0, 4, 5] and meta.q_len.tolist() == [4, 1, 3]
    assert meta.ctx_len.tolist() == [10, 6, 3] and meta.max_q_len == 4 and meta.page_size == PAGE
    # the kernel's slots of each context are the torch path's
    for i, (seq, n) in enumerate(work):
        end = seq.num_computed + n
        assert torch.equal(attention.context_slots(meta, i, end),
                           context_slots(seq, end, PAGE, CPU))
    assert build_batch(work, PAGE, CPU).meta.paged is None  # the torch path builds none
