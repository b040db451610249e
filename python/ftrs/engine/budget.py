"""The reasoning budget: at most `ReasoningBudget.tokens` tokens inside a reasoning block.

A sequence counts the tokens it generates after the block opens (its open tag sampled, or
from its first token when the prompt opened it) until the close tag. Once the count reaches the
budget, its next tokens are not sampled but written: the budget's `end_ids` (a newline, the
close tag, the blank line templates put after it), one a step, through the sampler's mask
(`forced_token` before sampling, `after_token` after). The model then answers as after any
reasoning it closed itself. A block the model closes within the budget is left alone.
"""

from __future__ import annotations

from ftrs.scheduler.sequence import Sequence


def forced_token(seq: Sequence) -> int | None:
    """The token `seq` must take next instead of sampling, if its budget is spent."""
    b = seq.params.reasoning_budget
    if b is None:
        return None
    if b.opened and seq.num_output == 0 and seq.reasoning_used < 0 and not seq.reasoning_closed:
        seq.reasoning_used = 0  # the prompt opened the block
    if not seq.forced and seq.reasoning_used >= b.tokens:
        seq.forced = list(b.end_ids)
    return seq.forced[0] if seq.forced else None


def after_token(seq: Sequence, tok: int) -> None:
    """Counts `tok`, just appended to `seq`, against the budget."""
    b = seq.params.reasoning_budget
    if b is None:
        return
    if seq.forced and tok == seq.forced[0]:
        seq.forced.pop(0)
    if tok == b.close_id:
        seq.reasoning_used, seq.reasoning_closed = -1, True
    elif seq.reasoning_used >= 0:
        seq.reasoning_used += 1
    elif tok == b.open_id and not seq.reasoning_closed:
        seq.reasoning_used = 0


__all__ = ["after_token", "forced_token"]
