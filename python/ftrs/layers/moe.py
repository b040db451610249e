"""MoE routing and the expert computation every strategy shares.

Routing follows the reference: router logits, softmax in fp32 over all experts, top-k, then
(when the architecture says so) renormalisation of the k weights to sum to one.

`combine_experts` runs the selected experts in ascending expert id and accumulates with
`index_add_`. Every strategy accumulates in that order, whatever memory the weights come from,
which is why offload equals resident bit for bit. Each expert's contribution depends on no
other expert, so a strategy may compute them in any order (`expert_contribution`) as long as it
adds them in ascending id (`accumulate`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from ftrs.layers.linear import linear
from ftrs.quant.matmul import Weight

SMALL_ROWS = 32  # below this, accumulate by indexing instead of index_add_
ExpertWeights = tuple[Weight, Weight, Weight]  # gate (I,H), up (I,H), down (H,I)


def route(
    x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x`: (tokens, hidden). Returns top-k ids (tokens, k) int64 and weights (tokens, k) x.dtype."""
    logits = F.linear(x, router)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(x.dtype)


def expert_mlp(x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    gate, up, down = w
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)  # quantized or not


Contribution = tuple[torch.Tensor, torch.Tensor]  # (token rows, their weighted expert output)


def expert_contribution(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, e: int,
                        w: ExpertWeights) -> Contribution | None:
    """Expert `e`'s weighted output for the tokens routed to it; None when there are none.
    Independent of every other expert: a strategy may compute these in any order."""
    tok, pos = torch.where(ids == e)
    if tok.numel() == 0:
        return None
    return tok, expert_mlp(x.index_select(0, tok), w) * weights[tok, pos, None]


def accumulate(out: torch.Tensor, part: Contribution | None) -> None:
    """Adds one expert's contribution into `out`; call in ascending expert id."""
    if part is None:
        return
    tok, y = part
    # A token meets each expert at most once, so both forms add exactly once per element;
    # for a handful of rows a read-add-write beats index_add_ on the CPU.
    if tok.numel() <= SMALL_ROWS:
        out.index_copy_(0, tok, out.index_select(0, tok) + y)
    else:
        out.index_add_(0, tok, y)


def combine_experts(
    x: torch.Tensor,  # (tokens, hidden)
    ids: torch.Tensor,  # (tokens, k)
    weights: torch.Tensor,  # (tokens, k)
    experts: Iterable[int],  # ascending expert ids to compute now
    weights_of: Callable[[int], ExpertWeights],
    out: torch.Tensor,  # (tokens, hidden), accumulated in place
) -> None:
    for e in experts:
        accumulate(out, expert_contribution(x, ids, weights, e, weights_of(e)))
