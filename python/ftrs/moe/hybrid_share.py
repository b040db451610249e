"""The `hybrid` strategy's CPU share of a split layer in one kernel call, on a GPU.

A split layer (`moe.hybrid`) computes the misses the cost model gives the CPU from the host
pool. On a GPU these run in one Rust call over only the share's experts
(`quant.matmul.routed_experts_ffn(only=...)`), as the "cpu" layer mode runs a whole layer: on
the H200 host that mode went from 10-13 to 46-53 tok/s when it stopped running experts one by
one. Each token's CPU experts are summed in ascending id and the sum is added where the token's
lowest CPU expert's part goes (eager: that expert's contribution, `share_parts`; a decode
graph's host step: its pair row, `moe.hybrid_graph`), so eager and graph add the same terms in
the same order. One in `CPU_SAMPLE_EVERY` of the shares whose experts fall in several buckets
of tokens still goes expert by expert, each timed (`one_call`): one call's time cannot be split
between buckets, and each bucket's CPU rate must keep being measured. On a CPU device a split
adds expert by expert, as `resident` does, bit for bit (`HybridStrategy.one_call_share` off).

Tests: tests/moe/test_hybrid.py (the sums, places and sampling), tests/engine/
test_graphs_offload.py (eager and graph against the same split expert by expert).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from ftrs.layers.moe import Contribution, plan_experts
from ftrs.moe.hybrid_cost import bucket
from ftrs.quant.matmul import routed_experts_ffn

if TYPE_CHECKING:
    from ftrs.moe.hybrid import HybridStrategy

#: On a CPU device with empty slots, one MoE layer call in this many times its experts; on a
#: GPU, one CPU share in this many whose experts span several buckets goes expert by expert.
CPU_SAMPLE_EVERY = 16
#: `cpu_share` keeps its bookkeeping in plain Python up to this many rows.
SHARE_PY_ROWS = 64


class CpuShare(NamedTuple):
    """A layer's CPU experts computed in one call (`cpu_share`): for each token
    with a CPU expert (ascending), the place in its routing and the id of its lowest CPU
    expert, and the sum of its CPU experts' weighted outputs (fp32, host; row i is tokens[i])."""

    tokens: list[int]
    places: list[int]
    lowest: list[int]
    sums: torch.Tensor


def one_call(h: HybridStrategy, layer: int, counts: list[int]) -> bool:
    """Whether a split's CPU share (`counts`: tokens routed to each of its experts) runs in
    one kernel call (`cpu_share`): on a GPU, when the layer's experts are one-call kernels,
    except one in `CPU_SAMPLE_EVERY` of the shares whose experts fall in several buckets of
    tokens: that one goes expert by expert, each timed, since one call's time cannot be
    split between buckets and each bucket's rate must keep being measured (a prefill
    chunk's experts: `CostModel.observe_cpu_layer`)."""
    if not (h.one_call_share and layer in h._kernel_args):
        return False
    if len({bucket(n) for n in counts}) <= 1:
        return True
    h._mixed_shares += 1
    return h._mixed_shares % CPU_SAMPLE_EVERY != 0


def cpu_share(h: HybridStrategy, layer: int, x_h: torch.Tensor, ids_h: torch.Tensor,
              w_h: torch.Tensor, experts: list[int]) -> CpuShare | None:
    """`experts` (ascending, a share of the layer's routed ones or all of them) computed
    from the host pool in one kernel call, as `resident` runs a CPU host's layer: host
    fp32 `x_h` and `w_h`, int64 `ids_h`. Each token's CPU experts are summed in ascending
    id, the sum to be added where the token's lowest CPU expert's part would be (eager:
    its contribution; a graph: its pair row), so eager and graph add the same rows in the
    same order. None when the layer's experts are not one-call kernels (float weights with
    biases, another activation): the caller goes expert by expert. The bookkeeping is
    plain Python up to `SHARE_PY_ROWS` rows (a decode step's: torch's per-call overhead,
    not the work, is what a handful of rows costs), torch's vector ops above."""
    args = h._kernel_args.get(layer)
    if args is None:
        return None
    mine = set(experts)
    small = ids_h.shape[0] <= SHARE_PY_ROWS
    rows: list[list[int]] = ids_h.tolist() if small else []
    every = (mine.issuperset(e for row in rows for e in row) if small
             else len(mine) == int(torch.unique(ids_h).numel()))
    out_h = torch.zeros_like(x_h)
    t0 = h.clock()
    routed = routed_experts_ffn(x_h, ids_h, w_h, args, out_h, only=None if every else mine)
    if routed is None:
        return None
    h.cost.observe_cpu_layer(h.formats[layer], [n for _, n in routed], h.clock() - t0)
    tok: list[int] = []
    place: list[int] = []
    lowest: list[int] = []
    if small:
        for t, row in enumerate(rows):
            j = min((j for j, e in enumerate(row) if e in mine), key=row.__getitem__,
                    default=-1)
            if j >= 0:
                tok.append(t)
                place.append(j)
                lowest.append(row[j])
    else:
        ours = torch.isin(ids_h, torch.tensor(experts, dtype=ids_h.dtype))
        at = torch.where(ours, ids_h, h.spec.num_experts).argmin(dim=1)
        rows_t = ours.any(dim=1).nonzero().flatten()
        tok, place = rows_t.tolist(), at.index_select(0, rows_t).tolist()
        lowest = ids_h.index_select(0, rows_t).gather(
            1, at.index_select(0, rows_t)[:, None]).flatten().tolist()
    sums = out_h if len(tok) == x_h.shape[0] else out_h.index_select(0, torch.tensor(tok))
    return CpuShare(tok, place, lowest, sums)


def share_parts(h: HybridStrategy, layer: int, x_h: torch.Tensor, ids_h: torch.Tensor,
                w_h: torch.Tensor, experts: list[int]) -> dict[int, Contribution | None]:
    """`cpu_share` as contributions (any thread): expert `e`'s holds the sums of the tokens
    whose lowest CPU expert is `e`; the other CPU experts' are empty."""
    share = h.cpu_share(layer, x_h, ids_h, w_h, experts)  # (the method: tests wrap it)
    if share is None:  # not one-call kernels after all: expert by expert
        return h._cpu_parts(layer, x_h, plan_experts(ids_h, w_h, h.spec.num_experts), experts)
    parts: dict[int, Contribution | None] = dict.fromkeys(experts)
    by: dict[int, list[int]] = {}
    for i, e in enumerate(share.lowest):
        by.setdefault(e, []).append(i)
    for e, idx in by.items():
        if len(idx) == len(share.tokens):  # one expert is every token's lowest
            parts[e] = (torch.tensor(share.tokens), share.sums)
        else:
            parts[e] = (torch.tensor([share.tokens[i] for i in idx]),
                        share.sums.index_select(0, torch.tensor(idx)))
    return parts
