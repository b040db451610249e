"""The CUDA-graph half of the `hybrid` strategy: offload's split of a decode MoE layer into a
host step (outside the graph) and a captured device step (`moe.offload_graph`), with the CPU
share computed in the host step.

The host step reads the layer's routing once, splits the experts as the eager layer does (hits
on the device, misses on the link or the CPU by `CostModel.split`), issues the fetches, computes
the CPU experts on host copies of the real rows while those copies are on the link, writes each
CPU expert's weighted rows into their (token, expert) rows of the static pair buffer, waits for
the fetches and writes the slot table of the device experts. The captured device step is
offload's: the fused kernel fills the device experts' pair rows through the table (a CPU
expert has no slot, so the kernel leaves its rows as written) and `combine_pairs` adds each
token's rows in ascending expert id, the order of every strategy, so the graph adds the same
parts in the same order as the eager layer (`HybridStrategy._fused_parts` and `_cpu_parts`).

Each host step first picks the layer's mode (`hybrid_cost.LayerModes`, the strategy's one
instance, as eager calls do): the split above, or every routed expert on the CPU in one kernel
call (no slot lookup, no prefetch, an empty slot table, so the captured kernel computes
nothing). Either way the experts computed on the CPU are queued as fills
(`HybridStrategy.fill`): copied in while the link idles, they are hits for later steps. The mode is timed by the host step's wall clock after the routing's read-back (which
both pay); the device part of a split's hits runs in the next captured segment and is not in
that time: a hit's kernel is microseconds, where the host work the split adds (the next layer's
predicted routing read back for the prefetch, the lookup; then, the CPU experts one by one) is
what the modes differ by. Since then the split reads the real rows back once, predicts the next
layer's experts from them on the host (`moe.rank.rank_on_host`: no device round trip) and
computes its CPU share from them in one kernel call (`moe.hybrid_share.cpu_share`). Measured
on an H200 host before that (bench/hybrid.py --device cuda, the demo-shaped Q4_K_M, 16
cores): graph decode with every expert on the CPU ran 46-53 tok/s, offload 1.5-41 and the
split alone 25-37 at 0.1-8 GB/s and unpaced: the host work of a split layer cost more than the
CPU computing its two experts, at every link.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ftrs.layers.moe import plan_experts
from ftrs.moe.offload_graph import begin_host_step

if TYPE_CHECKING:
    from ftrs.moe.hybrid import HybridStrategy

def host_step(h: HybridStrategy, layer: int, ids: torch.Tensor, weights: torch.Tensor,
              rows: int, x: torch.Tensor) -> None:
    """The layer's split, fetches and CPU share, outside any graph (module doc). Only the first
    `rows` rows are real: padding rows fetch and compute nothing (their pair rows stay zero)."""
    g, stream, y = begin_host_step(h, ids, x)
    li = h.experts.layer_index[layer]
    num_experts = h.spec.num_experts
    ids_h = ids[:rows].cpu()  # the one read-back of the layer: the real rows' routing
    t_layer = h.clock()
    counts = torch.bincount(ids_h.reshape(-1), minlength=num_experts).tolist()
    needed = [e for e, c in enumerate(counts) if c]  # ascending
    h.distinct_per_layer.append(len(needed))
    h._score_guess(layer, needed)
    timed = rows > 0 and not h.cost.device_is_cpu  # a GPU's layer modes (module doc)
    if timed and h.modes.choose(rows) == "cpu":
        _cpu_rows(h, layer, x[:rows], ids_h, weights[:rows], needed, y)  # nothing pinned
        g.write(layer, [-1] * num_experts)  # no slot: the captured kernel computes nothing
        h.fill(li, needed)
        h.count(0, 0, len(needed))
        h._t_end = h.clock()
        h.modes.observe("cpu", rows, h._t_end - t_layer)
        return
    # the real rows on the host once: the next layer's routing is predicted there (no device
    # round trip) and the CPU share reads them
    x_h = x[:rows].to("cpu", torch.float32).contiguous()
    prefetch = h._predict(layer, x[:rows], x_h) if rows else []
    resident = set(h.engine.resident_in(li))
    hits = [e for e in needed if e in resident]
    misses = [(e, counts[e]) for e in needed if e not in resident]
    fetch: list[int] = []
    if h.cost.device_is_cpu:  # a CPU device (the tests' stand-in): link = CPU + copy
        on_cpu = [e for e, _ in misses]
    else:
        on_cpu, fetch = h.cost.split(misses, h.experts.expert_bytes, h.formats[layer],
                                     room=h.num_slots - len(hits))
    device = sorted(hits + fetch)
    table = [-1] * num_experts
    try:
        t0 = h.clock()
        slots, ticket = h._lookup(li, device, prefetch) if device or prefetch else ([], None)
        if on_cpu:  # on the host while the fetches are on the link
            _cpu_rows(h, layer, x_h, ids_h, weights[:rows], on_cpu, y)
        landed_first = False  # every copy done before the wait: it had nothing to wait for
        if ticket is not None:
            landed_first = bool(on_cpu) and all(h.engine.ready(slots))
            t1 = h.clock()
            h.engine.wait(ticket)
            h._wait_s += h.clock() - t1
        # the copies ran from the lookup on: their time is the elapsed time when the wait
        # blocked, but only a bound above it when the CPU share outlasted them (asked of the
        # engine, not read from the wait's own time, which a thread switch can stretch)
        if fetch and not landed_first:
            h.cost.observe_link(len(fetch) * h.experts.expert_bytes, len(fetch), h.clock() - t0)
        for e, s in zip(device, slots, strict=True):
            table[e] = s
        g.write(layer, table)
    except BaseException:
        h.engine.release(stream)  # no segment will read them
        raise
    h.fill(li, on_cpu)  # copied in while the link is idle, for a later step to hit
    h.count(len(hits), len(fetch), len(on_cpu))
    h._t_end = h.clock()
    if timed:
        h.modes.observe("split", rows, h._t_end - t_layer)


def _cpu_rows(h: HybridStrategy, layer: int, x: torch.Tensor, ids_h: torch.Tensor,
              weights: torch.Tensor, experts: list[int], y: torch.Tensor) -> None:
    """`experts` computed from the host pool on the real rows, each (token, expert) pair's
    weighted output written into row `token * k + j` of the pair buffer `y` (j: the expert's
    place in the token's routing), as the fused kernel writes the device experts' rows."""
    k = ids_h.shape[1]
    flat = ids_h.reshape(-1).tolist()
    every = len(experts) == len(set(flat))
    if (h._kernel_args.get(layer) is not None if every
            else h.one_call(layer, [flat.count(e) for e in experts])):
        # the layer's CPU share in one kernel call (`moe.hybrid_share.cpu_share`): each token's
        # sum goes into the pair row of its lowest CPU expert (that expert's other rows and the
        # token's other CPU experts' stay zero; adding zeros changes nothing), which is where
        # the eager split adds it. A share of the layer's experts: only where `one_call` says
        # (a GPU; not the sampled calls that time each expert).
        share = h.cpu_share(layer, x.to("cpu", torch.float32).contiguous(),
                            ids_h.contiguous(), weights.to("cpu", torch.float32).contiguous(),
                            experts)
        if share is not None:
            rows = torch.tensor([t * k + j for t, j in zip(share.tokens, share.places)])
            y.index_copy_(0, rows.to(y.device), share.sums.to(y.device, y.dtype))
            return
    x_h = x.cpu()
    plan = plan_experts(ids_h, weights.cpu(), h.spec.num_experts)
    parts = h._cpu_parts(layer, x_h, plan, experts)
    index, values = [], []
    for e in experts:
        part = parts[e]
        if part is None:
            continue
        tok, out = part
        place = (ids_h.index_select(0, tok) == e).int().argmax(dim=1)
        index.append(tok * k + place)
        values.append(out)
    if index:
        y.index_copy_(0, torch.cat(index).to(y.device),
                      torch.cat(values).to(y.device, y.dtype))
