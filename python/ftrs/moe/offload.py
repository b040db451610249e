"""`offload`: routed experts stream from the host pool into a device slot cache.

Per MoE layer: the router's choice is known before any expert runs, so the strategy makes ONE
call into the Rust transfer engine with the distinct experts the whole batch needs (a prefill
chunk fetches each expert once, not once per token). Resident experts answer with their slot at
once; missing ones are queued as demand transfers, ahead of every prefetch. While layer l
computes, layer l+1's experts are already on the way: its router applied to layer l's hidden
state predicts them, and they are issued as prefetches (never evicting a pinned slot).

A copy on the link cannot be overtaken, so a demand that arrives while prefetches are in flight
waits for them. Narrow forwards (decode-like) therefore copy each prefetch in chunks (a
sixteenth of an expert, at least `MIN_CHUNK_BYTES`) and keep two chunks in flight: the rest
waits in the engine's queue, where a demand goes first, so a demand waits for at most two
chunks, never for a whole expert, and the link does not idle while the transfer worker turns
from one chunk to the next. Wide forwards (each layer needs most experts) keep no limit and
copy whole experts: their predictions are nearly all needed and back-to-back copies keep the
link busy. Prefetches for a layer the forward has reached are dropped by the engine, the
chunks not yet issued with them, so a wrong guess costs at most the link time between the
guess and the layer's lookup.

Prefetch still costs an eviction and link bytes when it guesses wrong. When a forward spent more
than `LINK_BOUND_SHARE` of its time waiting on transfers (link-bound), the next forward of the
same width skips prefetch if that width's predictions have been less than `PRECISE` right.
Measured on the demo (2-core CPU, 50% capacity, prefetch on, 24 decode tokens, median of 3
rounds, variants interleaved in one process):

| link | no prefetch | whole, skip < 0.95 | 8 chunks | 8 chunks, skip < 0.95 | 4 chunks |
|---|---|---|---|---|---|
| 2 GB/s | 6.22 tok/s | 6.21 | 6.36 | 6.29 | 6.55 |
| 0.5 GB/s | 2.12 tok/s | 2.06 | 2.20 | 2.07 | 2.16 |

("whole": whole-expert prefetches, the previous design; "skip < 0.95": skipped on link-bound
forwards unless at least 0.95 precise; these chunked variants keep one chunk in flight.)
Whole experts without the skip: 5.98 tok/s at 2 GB/s (262 MB moved per token against 184 MB
without prefetch): the skip was needed while a wrong guess held the link for a whole expert.
With chunks it no longer pays at the demo's precision (0.7-0.86), so only a predictor worse
than even odds is skipped. Two chunks of a sixteenth in flight against one of an eighth: 6.59
against 6.09 tok/s at 2 GB/s (5 rounds), 2.15 against 2.19 at 0.5 GB/s; a later run at 2 GB/s
on a busier host gave 5.79 against 5.74. The two are within the host's noise on the demo; two
in flight is kept for real links, where a chunk takes tens of microseconds and one in flight
would leave the link idle for each of the worker's turnarounds.

When a layer needs more experts than there are slots, it computes them in waves of at most
`num_slots` experts, in ascending id, so any capacity from `top_k` upward works. Within a wave
the experts already in their slots are computed first, while the missing ones are on the link;
each expert's output is independent of the others, and all are added up in ascending id, as
`resident` adds them (`layers.moe.accumulate`): results are bit-identical. Measured on the demo
(50% capacity, 24 decode tokens, pairs interleaved, median of the per-pair ratios): 1.029x the
tokens/s of waiting first at 2 GB/s without prefetch (6 pairs), 1.031x at 0.5 GB/s (4), 1.04x
at 2 GB/s with prefetch (4).

With the Triton kernels (`kernels.name == "triton"`, `moe.fused`) a layer runs in the same
waves, but each wave is two calls of the fused kernel over views of the slot buffer, one for
the experts that have landed and one after the ticket for the rest, each with a slot table
naming only its experts; the calls fill one buffer of per-(token, expert) rows, added up once
per layer in ascending id: bit-identical to `resident` on the kernel.

Decode CUDA graphs ("layer" mode, `engine/graphs.py`; kernels only): the graph is cut at each
MoE layer. `host_step` runs outside it: the lookup for the real rows' experts (padding rows
fetch nothing), a wait for all of them (no landed-first split inside a layer: the captured
kernel reads one table), and the expert -> slot table written into a static device buffer
(`GraphTables`); the captured `device_step` is the fused kernel over it. Prefetch still
overlaps the next layer's copies with this layer's compute (docs/kernels.md, item 7).

On CUDA the copies run on the engine's own stream, on the model's device (`cuda:N`). A slot
may only be overwritten once the kernels reading it are done: every release hands the engine
torch's current stream, where it records an event after those kernels, and a copy into a
released slot waits for that event on the device, so neither a wave nor a layer synchronizes
the host for it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ftrs import _core
from ftrs.config import EngineConfig
from ftrs.errors import CapacityError, ConfigError
from ftrs.layers.moe import (
    Contribution,
    ExpertPlan,
    ExpertWeights,
    Router,
    accumulate,
    expert_contribution,
    plan_experts,
)
from ftrs.models.experts import HostExperts
from ftrs.moe import offload_graph
from ftrs.moe.base import GraphSupport, MoEStrategy, register
from ftrs.moe.offload_graph import GraphTables
from ftrs.moe.rank import NextLayerRanker

if TYPE_CHECKING:  # the kernel modules import Triton: only when the kernels are chosen
    from ftrs.kernels import Kernels
    from ftrs.kernels.moe import SlotWeights

log = logging.getLogger(__name__)
CPU_SLOT_BUDGET = 4 << 30  # bytes of device slots by default on the CPU device
#: A forward that waited on transfers for more than this share of its time was link-bound.
LINK_BOUND_SHARE = 0.5
#: Predictions at least this precise are prefetched even on a link-bound forward.
PRECISE = 0.5
#: Prefetch copies (chunks) in flight at most in a narrow forward (wide ones: no limit). Two:
#: the next chunk is on the link while the worker learns that the last one ended.
NARROW_PREFETCHES_IN_FLIGHT = 2
#: A narrow forward copies each prefetch in this many chunks (wide ones: whole experts)...
NARROW_PREFETCH_CHUNKS = 16
#: ...of at least this many bytes (about 40-80 us on a PCIe 4.0 or 3.0 x16 link: the worker's
#: turnaround stays well below a chunk's time on the link) ...
MIN_CHUNK_BYTES = 1 << 20
#: ...rounded up to this many bytes (DMA-friendly sizes; a tiny expert is one chunk).
CHUNK_ALIGN = 64 << 10
#: Compute the experts already in their slots before waiting for the rest of the layer's.
COMPUTE_LANDED_FIRST = True
CAPACITY_RETRY_S = 5.0  # how long a lookup may wait for in-flight prefetches to land


def cache_slots(config: EngineConfig, experts: HostExperts, device: torch.device) -> int:
    total = experts.num_experts_total
    if config.moe_cache_size is not None:
        slots = config.moe_cache_size
    elif config.moe_cache_rate is not None:
        slots = math.ceil(config.moe_cache_rate * total)
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        slots = int(free * 0.6) // experts.expert_bytes
    else:
        slots = CPU_SLOT_BUDGET // experts.expert_bytes
    top_k = experts.spec.top_k
    if slots < top_k:
        raise ConfigError(f"moe cache of {slots} slots is below top_k={top_k}: nothing could run")
    if config.moe_cache_size is not None and slots > total:
        log.warning("--moe-cache-size %d is more than the model's %d experts (all layers): "
                    "using %d slots", slots, total, total)
    return min(slots, total)


def cuda_ordinal(device: torch.device) -> int:
    """The CUDA device number of `device` (`cuda` alone: torch's current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def backend_spec(config: EngineConfig, device: torch.device) -> str:
    """The copy backend for `device`: `cuda` (or `auto` on CUDA) copies into the model's
    device (`cuda:N`); an explicit `cuda:N` must name it (the engine checks)."""
    spec = config.copy_backend
    if spec == "auto":
        spec = "cuda" if device.type == "cuda" else "host"
    if spec.split(":")[0] == "cuda" and device.type != "cuda":
        raise ConfigError(f"copy_backend={spec} needs a CUDA device")
    return f"cuda:{cuda_ordinal(device)}" if spec == "cuda" else spec


@register("offload")
class OffloadStrategy(MoEStrategy):
    name = "offload"

    def __init__(self, experts: HostExperts, device: torch.device, config: EngineConfig,
                 routers: Mapping[int, Router | torch.Tensor], kernels: Kernels | None = None,
                 **_: object) -> None:
        self.experts = experts
        self.spec = experts.spec
        self.routers = routers
        self.prefetch = config.moe_prefetch
        self.num_slots = cache_slots(config, experts, device)
        eb = experts.expert_bytes
        # On the CPU, zeros (not empty) commits the slot memory now: untouched pages would be
        # faulted in by the first copies into them, billed to the first requests (measured on
        # the demo: a cold 512-token prefill at 50% capacity took 2.4x its warm time).
        alloc = torch.zeros if device.type == "cpu" else torch.empty
        self.buffer = alloc(self.num_slots * eb, dtype=torch.uint8, device=device)
        backend = backend_spec(config, device)
        if device.type == "cuda":
            experts.pool.pin(cuda_ordinal(device))
        per_chunk = max(-(-eb // NARROW_PREFETCH_CHUNKS), min(MIN_CHUNK_BYTES, eb))
        self.narrow_chunk = -(-per_chunk // CHUNK_ALIGN) * CHUNK_ALIGN
        # the engine holds `self.buffer` itself: it outlives every copy into it
        self.engine = _core.TransferEngine(
            experts.pool, self.num_slots, self.buffer,
            backend=backend, policy=config.moe_cache_policy,
            pacing_bytes_per_s=(config.pcie_pacing or 0.0) * 1e9,
            max_inflight_prefetches=NARROW_PREFETCHES_IN_FLIGHT,
            prefetch_chunk_bytes=self.narrow_chunk)
        self.backend = backend
        # per MoE layer, each slot's views in that layer's formats (a quantized file may store
        # one tensor in different types in different layers)
        self.slot_weights: dict[int, list[ExpertWeights]] = experts.slot_views(
            self.buffer, self.num_slots)
        self._slot_views = self.slot_weights[self.spec.moe_layers[0]]
        self.act = experts.act
        # the fused kernel's views of the slot buffer, per layer it computes (`moe.fused`)
        self._fused: dict[int, SlotWeights] = {}
        if kernels is not None and kernels.name == "triton":
            self._fused = self._fused_views(experts)
        self._graph: GraphTables | None = None
        if self._fused and all(la in self._fused for la in self.spec.moe_layers):
            self._graph = GraphTables(self.spec.moe_layers, self.spec.num_experts, device)
        # Prefetch only into room beyond one token's working set (every MoE layer's top-k): in a
        # smaller cache each prefetch evicts an expert the next token is about to need again
        # (measured on the demo at 25% capacity: 2x the bytes per token and a slower decode).
        self.working_set = len(self.spec.moe_layers) * self.spec.top_k
        self.next_moe = {a: b for a, b in zip(self.spec.moe_layers, self.spec.moe_layers[1:])}
        self._predicted: dict[int, set[int]] = {}
        self._ranker = NextLayerRanker(routers, self.spec)
        self.pred_hits = self.pred_issued = self.pred_needed = 0
        # The link-bound gate (module docstring): this forward's start, transfer waits and end;
        # per width (False: narrow, True: wide), whether its last forward was link-bound and
        # its predictions' precision (exponential average; None until measured).
        self._t_begin = self._t_end = 0.0
        self._wait_s = 0.0
        self._wide = False
        self._link_bound = {False: False, True: False}
        self._precision: dict[bool, float | None] = {False: None, True: None}
        self._gated = False
        self.gated_forwards = 0
        self.clock = time.perf_counter  # replaceable (tests)
        self.distinct_per_layer: list[int] = []  # distinct experts of each MoE layer, this step
        log.info("offload: %d of %d expert slots (%.1f MiB), backend %s, policy %s",
                 self.num_slots, experts.num_experts_total, self.buffer.numel() / 2**20,
                 backend, config.moe_cache_policy)

    def _predict(self, layer: int, x: torch.Tensor, x_host: torch.Tensor | None = None,
                 on_host: bool | None = None) -> list[tuple[int, int]]:
        """The next MoE layer's experts, routed from this layer's input `x`, likeliest first
        (summed router weight over the batch): the engine keeps few prefetches in flight and
        `spare` may cut the list, so the order decides what goes. Where the ranking runs
        (`x_host`, `on_host`): `rank.NextLayerRanker.rank`."""
        nxt = self.next_moe.get(layer)
        spare = self.num_slots - self.working_set
        if nxt is None or not self.prefetch or spare <= 0 or self._gated:
            return []
        guess = self._ranker.rank(nxt, x, x_host, on_host)[:spare]
        self._predicted[nxt] = set(guess)
        li = self.experts.layer_index[nxt]
        return [(li, e) for e in guess]

    def _score_guess(self, layer: int, needed: list[int]) -> None:
        """Precision of the prefetch guess for this layer (the link-bound prefetch gate reads it)."""
        guess = self._predicted.pop(layer, None)
        if guess is None:
            return
        hits = len(guess.intersection(needed))
        self.pred_issued += len(guess)
        self.pred_needed += len(needed)
        self.pred_hits += hits
        if guess:
            p, old = hits / len(guess), self._precision[self._wide]
            self._precision[self._wide] = p if old is None else 0.8 * old + 0.2 * p

    def _lookup(self, li: int, wave: list[int],
                prefetch: list[tuple[int, int]]) -> tuple[list[int], int]:
        deadline = time.monotonic() + CAPACITY_RETRY_S
        while True:
            try:
                slots, ticket = self.engine.lookup(li, wave, prefetch)
                return list(slots), ticket
            except CapacityError:
                # slots held by prefetches already on the wire: they land within microseconds
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.0002)

    def _fused_views(self, experts: HostExperts) -> dict[int, SlotWeights]:
        """The slot buffer seen in each layer's format (layers alike share one view)."""
        from ftrs.moe.fused import fused_layers, slot_weights

        by_format: dict[Any, SlotWeights] = {}

        def views(layer: int) -> SlotWeights:
            fmt = experts.formats[layer]
            if fmt not in by_format:
                by_format[fmt] = slot_weights(experts, layer, self.buffer, self.num_slots,
                                              experts.expert_bytes)
            return by_format[fmt]

        return fused_layers(experts, views, self.name)

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        fused = self._fused.get(layer)
        if fused is not None:
            return self._forward_fused(layer, x, ids, weights, fused)
        li = self.experts.layer_index[layer]
        self._slot_views = self.slot_weights[layer]
        plan = plan_experts(ids, weights, self.spec.num_experts)
        needed = plan.experts  # ascending
        self.distinct_per_layer.append(len(needed))
        self._score_guess(layer, needed)
        prefetch = self._predict(layer, x)
        out = torch.zeros_like(x)
        # the kernels reading the slots run on this stream: copies into them wait for it
        stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else None
        for start in range(0, len(needed), self.num_slots):
            wave = needed[start:start + self.num_slots]
            try:
                slots, ticket = self._lookup(li, wave, prefetch if start == 0 else [])
                self._combine(x, plan, wave, slots, ticket, out)
            finally:
                self.engine.release(stream)  # a failed wave must not leave its slots pinned
        self._t_end = self.clock()
        return out

    def _combine(self, x: torch.Tensor, plan: ExpertPlan, wave: list[int], slots: list[int],
                 ticket: int, out: torch.Tensor) -> None:
        """The wave's experts whose bytes have landed run while the rest are on the link; the
        others after `ticket`; all are added to `out` in ascending id, as `resident` adds."""
        landed = self.engine.ready(slots) if COMPUTE_LANDED_FIRST else [False] * len(slots)
        parts: dict[int, Contribution | None] = {}
        for e, s, now in zip(wave, slots, landed):
            if now:
                parts[e] = expert_contribution(x, plan, e, self._slot_views[s], self.act)
        t0 = self.clock()
        self.engine.wait(ticket)
        self._wait_s += self.clock() - t0
        for e, s, now in zip(wave, slots, landed):
            if not now:
                parts[e] = expert_contribution(x, plan, e, self._slot_views[s], self.act)
        for e in wave:  # ascending
            accumulate(out, parts[e])

    def _forward_fused(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
                       weights: torch.Tensor, sw: SlotWeights) -> torch.Tensor:
        """`forward` through the fused kernel (docs/kernels.md): per wave, one call for the
        experts whose bytes have landed, one after the ticket for the rest, each with a slot
        table naming only its experts (-1 elsewhere). Every pair's row of `y` is written by
        exactly one call, so the sum equals one call over all experts, bit for bit."""
        from ftrs.kernels.moe import combine_pairs

        li = self.experts.layer_index[layer]
        num_experts = self.spec.num_experts
        # the one read-back of the layer: the lookup needs the distinct experts on the host
        counts = torch.bincount(ids.reshape(-1), minlength=num_experts).tolist()
        needed = [e for e, c in enumerate(counts) if c]  # ascending
        self.distinct_per_layer.append(len(needed))
        self._score_guess(layer, needed)
        prefetch = self._predict(layer, x)
        y = torch.zeros(ids.numel(), x.shape[1], dtype=x.dtype, device=x.device)
        # the kernels reading the slots run on this stream: copies into them wait for it
        stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else None
        for start in range(0, len(needed), self.num_slots):
            wave = needed[start:start + self.num_slots]
            try:
                slots, ticket = self._lookup(li, wave, prefetch if start == 0 else [])
                self._fused_wave(x, ids, weights, sw, wave, slots, ticket, y)
            finally:
                self.engine.release(stream)  # a failed wave must not leave its slots pinned
        self._t_end = self.clock()
        return combine_pairs(y, ids, torch.zeros_like(x))

    def _fused_wave(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    sw: SlotWeights, wave: list[int], slots: list[int], ticket: int,
                    y: torch.Tensor) -> None:
        """The pair rows of `wave`'s experts into `y`: those landed, then, after `ticket`, the rest."""
        from ftrs.kernels.moe import moe_pairs_triton
        from ftrs.moe.fused import slot_table

        landed = self.engine.ready(slots) if COMPUTE_LANDED_FIRST else [False] * len(slots)
        first, rest = [-1] * self.spec.num_experts, [-1] * self.spec.num_experts
        for e, s, now in zip(wave, slots, landed):
            (first if now else rest)[e] = s
        if any(landed):
            moe_pairs_triton(x, ids, weights, slot_table(first, x.device), sw, y=y)
        t0 = self.clock()
        self.engine.wait(ticket)
        self._wait_s += self.clock() - t0
        if not all(landed):
            moe_pairs_triton(x, ids, weights, slot_table(rest, x.device), sw, y=y)

    # ------------------------------------------------------------ decode CUDA graphs

    def graph_support(self) -> GraphSupport:
        # the device itself is `engine.graphs.why_off`'s first check (the CPU stand-in of the
        # tests, `EagerGraphs`, runs the same host and device steps)
        if self._graph is None:
            torch_path = [la for la in self.spec.moe_layers if la not in self._fused]
            return GraphSupport("off", f"the offload strategy runs MoE layer(s) {torch_path[:4]} "
                                       "through the per-expert loop, which reads the routing on "
                                       "the host (the fused MoE kernel is not in use there)")
        return GraphSupport("layer")

    def host_step(self, layer: int, ids: torch.Tensor, weights: torch.Tensor, rows: int,
                  x: torch.Tensor) -> None:
        """The layer's lookup, outside any graph (`moe.offload_graph.host_step`)."""
        offload_graph.host_step(self, layer, ids, weights, rows, x)

    def device_step(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
        """The captured part of a layer (`moe.offload_graph.device_step`)."""
        return offload_graph.device_step(self, layer, x, ids, weights)

    def end_forward(self) -> None:
        # after a graph replay the last layer's slots are still pinned (eager forwards release
        # their own: then there is nothing to release and no fence is recorded)
        if self._graph is not None:
            self.engine.release(self._graph.stream())

    def begin_forward(self, num_tokens: int) -> None:
        if self._graph is not None:  # slots a host step left pinned outside a step (warm-up)
            self.engine.release(self._graph.stream())
        self.distinct_per_layer = []
        if self._t_end > self._t_begin:  # the last forward ran MoE layers: was it link-bound?
            took = self._t_end - self._t_begin
            self._link_bound[self._wide] = self._wait_s > LINK_BOUND_SHARE * took
        wide = num_tokens * self.spec.top_k >= self.spec.num_experts
        if wide != self._wide:
            self.engine.set_max_inflight_prefetches(0 if wide else NARROW_PREFETCHES_IN_FLIGHT)
            self.engine.set_prefetch_chunk_bytes(0 if wide else self.narrow_chunk)
        self._wide = wide
        precision = self._precision[self._wide]
        self._gated = (self.prefetch and self._link_bound[self._wide]
                       and (precision is None or precision < PRECISE))
        self.gated_forwards += self._gated
        self._t_begin = self._t_end = self.clock()
        self._wait_s = 0.0

    def stats(self) -> dict[str, Any]:
        s = dict(self.engine.stats())
        s |= {"slots": self.num_slots, "expert_bytes": self.experts.expert_bytes,
              "prefetch_predicted": self.pred_issued, "prefetch_predicted_hits": self.pred_hits,
              "prefetch_needed": self.pred_needed,
              "prefetch_gated_forwards": self.gated_forwards,
              # seconds this step's forward (so far) waited for transfers: what the overlap
              # failed to hide
              "transfer_wait_s": self._wait_s,
              "distinct_experts": list(self.distinct_per_layer)}
        return s

    def close(self) -> None:
        self.engine.close()  # drops prefetches, joins the copy worker (GIL released)
