"""The CUDA-graph half of the `offload` strategy: a captured decode step splits each MoE layer
into a host step (the lookup and the wait, outside the graph) and a device step (the fused
kernel over static buffers, inside it), and `GraphTables` holds those buffers.

`OffloadStrategy.host_step` / `device_step` call the two functions here; `hybrid`'s host step
(`moe.hybrid_graph`) starts as this one does (`begin_host_step`) and shares the device step.
The next layer's prefetch is ranked on the host from the real rows (`moe.rank.rank_on_host`).
docs/kernels.md, item 7, describes the split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ftrs.moe.offload import OffloadStrategy


def host_step(off: OffloadStrategy, layer: int, ids: torch.Tensor, weights: torch.Tensor,
              rows: int, x: torch.Tensor) -> None:
    """The layer's lookup, outside any graph (docs/kernels.md, item 7): release the previous
    layer's slots behind a fence on the current stream (the segment just queued reads
    them), look up the distinct experts of the first `rows` rows only (padding rows fetch
    nothing), wait until every one has landed, and write the expert -> slot table (-1:
    not needed) into the layer's static buffer for `device_step`. No intra-layer overlap
    here: the captured kernel runs once over the whole table, so it waits for all of the
    layer's copies; the prefetch of the next layer still overlaps them with this layer's
    compute. A layer needing more experts than there are slots computes its earlier waves
    here, eagerly, into the static pair buffer the captured call adds to; the last wave's
    slots stay pinned until the next host step or `end_forward`."""
    from ftrs.kernels.moe import moe_pairs_triton
    from ftrs.moe.fused import slot_table

    g, stream, y = begin_host_step(off, ids, x)
    li = off.experts.layer_index[layer]
    num_experts = off.spec.num_experts
    sw = off._fused[layer]
    # the one read-back of the layer: the real rows' distinct experts
    counts = torch.bincount(ids[:rows].reshape(-1), minlength=num_experts).tolist()
    needed = [e for e, c in enumerate(counts) if c]  # ascending
    off.distinct_per_layer.append(len(needed))
    off._score_guess(layer, needed)
    prefetch = off._predict(layer, x[:rows], on_host=True) if rows else []  # `_predict`
    table = [-1] * num_experts
    try:
        for start in range(0, len(needed), off.num_slots):
            wave = needed[start:start + off.num_slots]
            slots, ticket = off._lookup(li, wave, prefetch if start == 0 else [])
            t0 = off.clock()
            off.engine.wait(ticket)
            off._wait_s += off.clock() - t0
            if start + off.num_slots < len(needed):  # an earlier wave: computed here
                early = [-1] * num_experts
                for e, s in zip(wave, slots):
                    early[e] = s
                moe_pairs_triton(x, ids, weights, slot_table(early, x.device), sw, y=y)
                off.engine.release(stream)
            else:
                for e, s in zip(wave, slots):
                    table[e] = s
        g.write(layer, table)
    except BaseException:
        off.engine.release(stream)  # no segment will read them
        raise
    off._t_end = off.clock()


def begin_host_step(off: OffloadStrategy, ids: torch.Tensor,
                    x: torch.Tensor) -> tuple[GraphTables, int | None, torch.Tensor]:
    """What every host step starts with: the graph's buffers, the previous layer's slots
    released behind a fence on the current stream (the segment just queued reads them), and
    the bucket's pair buffer zeroed. Returns (tables, the stream's handle, the pair buffer)."""
    g = off._graph
    if g is None:
        raise ValueError(f"{off.name}: host_step needs every MoE layer on the fused kernel")
    stream = _stream_of(x)
    off.engine.release(stream)
    y = g.pairs(ids.numel(), x)
    y.zero_()  # stream-ordered, after the previous layer's combine read it
    return g, stream, y


def device_step(off: OffloadStrategy, layer: int, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """The captured part of a layer: the fused kernel over the slot buffer through the
    layer's static slot table and into the static pair buffer (`host_step` wrote both),
    then the sum in ascending id. No host read, no shape that depends on the data."""
    from ftrs.kernels.moe import combine_pairs, moe_pairs_triton

    g = off._graph
    if g is None:
        raise ValueError("offload: device_step needs every MoE layer on the fused kernel")
    y = g.pairs(ids.numel(), x, create=False)
    moe_pairs_triton(x, ids, weights, g.tables[layer], off._fused[layer], y=y)
    return combine_pairs(y, ids, torch.zeros_like(x))


def _stream_of(x: torch.Tensor) -> int | None:
    """The raw handle of torch's current stream on `x`'s device (None on the CPU)."""
    return torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else None


class GraphTables:
    """The static buffers a captured offload layer reads (`OffloadStrategy.device_step`), made
    outside any capture and never reallocated, so every replay reads the same addresses:
    per MoE layer its expert -> slot table (int32, -1: no slot), and per bucket width its
    (token, expert) pair rows. On CUDA a table is written from a pinned host buffer of its
    own with a copy ordered on the current stream; the host buffer is rewritten only after
    that copy's event fired."""

    def __init__(self, layers: tuple[int, ...] | list[int], num_experts: int,
                 device: torch.device) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self.tables = {la: torch.full((num_experts,), -1, dtype=torch.int32, device=device)
                       for la in layers}
        self._host = {la: torch.full((num_experts,), -1, dtype=torch.int32, pin_memory=cuda)
                      for la in layers}
        self._copied: dict[int, Any] = {}  # layer -> torch.cuda.Event after its last copy
        self._pairs: dict[tuple[int, torch.dtype, int], torch.Tensor] = {}

    def stream(self) -> int | None:
        if self.device.type != "cuda":
            return None
        return torch.cuda.current_stream(self.device).cuda_stream

    def write(self, layer: int, table: list[int]) -> None:
        """`table` into the layer's static buffer, ordered on the current stream."""
        host = self._host[layer]
        if self.device.type != "cuda":
            host.copy_(torch.tensor(table, dtype=torch.int32))
            self.tables[layer].copy_(host)
            return
        done = self._copied.get(layer)
        if done is not None:
            done.synchronize()  # the last copy out of `host` has been read
        host.copy_(torch.tensor(table, dtype=torch.int32))
        self.tables[layer].copy_(host, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._copied[layer] = ev

    def pairs(self, n: int, x: torch.Tensor, create: bool = True) -> torch.Tensor:
        """The pair buffer (n, hidden) of a bucket's width, in `x`'s dtype. Made by the first
        host step of that width (the warm-up before a capture); a captured step must find it."""
        key = (n, x.dtype, x.shape[1])
        y = self._pairs.get(key)
        if y is None:
            if not create:
                raise ValueError(f"offload: no pair buffer for {n} pairs: a captured layer "
                                 "needs its host step run first (warm-up)")
            y = self._pairs[key] = torch.zeros(n, x.shape[1], dtype=x.dtype, device=x.device)
        return y
