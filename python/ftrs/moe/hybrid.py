"""`hybrid`: missed experts computed on the CPU where the link would cost more.

Per MoE layer and step, the experts the routed tokens need are split three ways:

- **hits**: already in a device slot: computed on the device, as `offload` does;
- **fetched**: missing, copied over the link through the same transfer engine as `offload`
  (this class extends `OffloadStrategy`: slots, lookup, prefetch and stats are its);
- **CPU**: missing, computed from the host pool where the bytes already live, on the tokens
  routed to them, in a worker thread while the device part runs (the Rust kernels release the
  GIL; torch's CPU matmuls do too).

On a GPU each layer call first picks a mode (`hybrid_cost.LayerModes`): that split, or every
routed expert on the CPU (no lookup, no prefetch: the layer's input copied to the host once, its
experts in one kernel call as `resident` runs them on a CPU host, the sum copied back once),
whichever the wall time of past calls says is cheaper; the other runs as often as costs at most
1/32 of the layers' time, so its estimate follows the host.

The split comes from `CostModel`: a miss on the link costs `latency + bytes / link rate` plus
its compute on the device; on the CPU it costs `tokens x seconds per token`, measured per block
type and per power-of-two bucket of tokens per expert (a decode token reads the whole expert
for one row; a prefill expert with 64 rows reuses each weight 64 times, so the two regimes get
their own rates). All estimates are exponential moving averages of this strategy's own timings,
so a link slowed by the adaptive guard or a busy CPU moves the split within a few steps. When
the CPU and the device work at the same time (a GPU), the split minimises the longer of the two;
when the device *is* the CPU it minimises their sum, which on a CPU-only host sends every miss
to the CPU: copying bytes from host memory into "device" memory that is host memory only costs.
There the layer runs exactly as `resident` runs over the host pool, plus three counters; one
call in `CPU_SAMPLE_EVERY` feeds the estimates (`/metrics`): a decode token's quantized
experts by the time of their one kernel call (they share the bucket of one row), float experts
and a layer of several tokens (whose experts may fall in several buckets) by timing each
expert. Measured by `bench/hybrid.py` (MoE layers alone, hybrid and resident alternating).

Results are added in ascending expert id, whatever computed them (`layers.moe.accumulate`), so
hybrid equals `resident` bit for bit whenever both sides compute in the same dtype with the same
kernels. On a CPU device the CPU share runs through `layers.moe.expert_mlp` on views of the host
pool, the very code `resident` runs (torch for float weights, the Rust kernels for quantized
ones): bit-identical. The Rust F32 kernel does not reproduce torch's fp32 sums bit for bit, so
on a CPU device float weights stay with torch. With a GPU as the device, float host weights are
handed to the Rust kernels as F32/F16/BF16 rows and the CPU share computes in fp32, in one
kernel call (`moe.hybrid_share`: each token's CPU experts summed, added as one term where its
lowest CPU expert's part goes).

Prefetch (the next layer's predicted experts) runs only when the device is not the CPU: a hit
computed on a CPU "device" is no faster than the same expert computed from the host pool. So
does the fill: the experts a layer computed on the CPU (a split's CPU share, or every expert in
the "cpu" mode) are queued with `TransferEngine.fill`, copied in only while the link has
nothing else to do, so the cache warms on a link too slow for the split to fetch and later
steps hit.

Decode CUDA graphs: offload's "layer" mode (every MoE layer on the fused kernel), the split and
the CPU share in the host step between the captured segments (`moe.hybrid_graph`), which writes
the CPU experts' rows into the pair buffer the captured kernel fills for the device's. The host
step picks the layer mode too, timed by its own wall clock (the captured kernels are not in it).
`--cpu-expert-threads` sets the Rust kernels' thread count.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from ftrs import _core
from ftrs.config import EngineConfig
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
from ftrs.moe import hybrid_graph, hybrid_share
from ftrs.moe.base import GraphSupport, register
from ftrs.moe.hybrid_cost import (
    SEED_CPU_BYTES_PER_S,
    CostModel,
    LayerModes,
    bucket,
    seed_link,
)
from ftrs.moe.hybrid_share import CPU_SAMPLE_EVERY, CpuShare
from ftrs.moe.offload import OffloadStrategy
from ftrs.quant.formats import QuantTensor
from ftrs.quant.matmul import layer_kernel_args, routed_experts_ffn

if TYPE_CHECKING:
    from ftrs.kernels.moe import SlotWeights

__all__ = ["CostModel", "CpuShare", "HybridStrategy", "LayerModes", "bucket", "layer_format"]

log = logging.getLogger(__name__)
_FLOAT_QTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def layer_format(experts: HostExperts, layer: int) -> str:
    """The block types of a layer's gate/up/down, e.g. "Q4_K/Q4_K/Q6_K" or "float32"."""
    fmt = experts.formats[layer]
    if all(f.qtype is None for f in fmt):
        return str(experts.dtype).removeprefix("torch.")
    return "/".join(f.qtype or "plain" for f in fmt[:3])  # the matrices (biases are plain)


def _kernel_weight(w: Any) -> Any:
    """A float host view as rows for the Rust kernels (quantized views are already)."""
    if isinstance(w, torch.Tensor) and w.dtype in _FLOAT_QTYPE:
        return QuantTensor(_FLOAT_QTYPE[w.dtype], (w.shape[0], w.shape[1]),
                           w.reshape(-1).view(torch.uint8))
    return w


@register("hybrid")
class HybridStrategy(OffloadStrategy):
    name = "hybrid"

    def __init__(self, experts: HostExperts, device: torch.device, config: EngineConfig,
                 routers: Mapping[int, Router | torch.Tensor], **kw: Any) -> None:
        super().__init__(experts, device, config, routers, **kw)
        self.device = device
        self.threads = config.cpu_expert_threads or int(_core.quant_threads())
        _core.quant_set_threads(self.threads)  # the kernels' pool for every call passing 0
        on_cpu = device.type == "cpu"
        self.prefetch = self.prefetch and not on_cpu  # module docstring
        views = experts.views(experts.host_bytes())
        self.host_weights: dict[int, list[ExpertWeights]] = views if on_cpu else {
            layer: [(*(_kernel_weight(m) for m in w[:3]), *w[3:])  # biases stay tensors
                    for w in ws] for layer, ws in views.items()}
        self.formats = {layer: layer_format(experts, layer) for layer in self.spec.moe_layers}
        # layers whose experts the Rust kernels read in one call (`_in_place`, `_all_on_cpu`)
        self._kernel_args = {layer: a for layer, ws in self.host_weights.items()
                             if self.act.kind == "silu"
                             and (a := layer_kernel_args(ws)) is not None}
        rate, latency = seed_link(self.backend)
        if config.pcie_pacing:  # the engine never copies faster than its pace: start there
            rate = min(rate, config.pcie_pacing * 1e9)
        self.cost = CostModel(rate, latency,
                              cpu_s_per_token=experts.expert_bytes / SEED_CPU_BYTES_PER_S,
                              device_is_cpu=on_cpu)
        self.modes = LayerModes()  # a GPU's layer calls: the split, or every expert on the CPU
        # a split's CPU share in one kernel call (`cpu_share`) on a GPU; on a CPU device it
        # adds expert by expert, as `resident` does, bit for bit
        self.one_call_share = not on_cpu
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftrs-cpu-experts")
        self.device_computed = self.fetched = self.cpu_computed = 0
        self.step_counts = [0, 0, 0]  # this step: device (hits), fetched, CPU
        self._calls = 0  # MoE layer calls served in place (`_in_place`)
        self._mixed_shares = 0  # CPU shares whose experts fell in several buckets (`one_call`)
        log.info("hybrid: CPU experts on %d kernel thread%s; link seed %.2f GB/s",
                 self.threads, "" if self.threads == 1 else "s", rate / 1e9)

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        if self.cost.device_is_cpu and not self.fetched:
            return self._in_place(layer, x, ids, weights)
        mode = "split" if self.cost.device_is_cpu else self.modes.choose(x.shape[0])
        if mode == "cpu":
            return self._all_on_cpu(layer, x, ids, weights)
        li = self.experts.layer_index[layer]
        self._slot_views = self.slot_weights[layer]
        plan = plan_experts(ids, weights, self.spec.num_experts)
        needed = plan.experts  # ascending
        self.distinct_per_layer.append(len(needed))
        self._score_guess(layer, needed)
        t_layer = self.clock()
        prefetch = self._predict(layer, x)
        # the slots hold experts only once something was fetched or prefetched
        resident = (set(self.engine.resident_in(li))
                    if self.fetched or self.prefetch else set())
        hits = [e for e in needed if e in resident]
        misses = [(e, plan.counts[e]) for e in needed if e not in resident]
        fmt = self.formats[layer]
        fetch: list[int] = []
        if self.cost.device_is_cpu:  # a CPU device: link = CPU + copy
            on_cpu = [e for e, _ in misses]
        else:
            on_cpu, fetch = self.cost.split(misses, self.experts.expert_bytes, fmt,
                                            room=self.num_slots - len(hits))
        parts: dict[int, Contribution | None] = {}
        job: Future[dict[int, Contribution | None]] | None = None
        x_host, plan_host = x, plan
        if on_cpu and self.one_call(layer, [plan.counts[e] for e in on_cpu]):
            # a GPU's CPU share in one kernel call (`cpu_share`); the worker gets host copies
            host = (x.to("cpu", torch.float32).contiguous(), ids.cpu().contiguous(),
                    weights.to("cpu", torch.float32).contiguous())
            job = self._pool.submit(hybrid_share.share_parts, self, layer, *host, on_cpu)
        elif on_cpu and x.device.type != "cpu":  # the worker touches host tensors only
            x_host = x.cpu()
            plan_host = plan._replace(tokens=plan.tokens.cpu(), weights=plan.weights.cpu())
        if job is None and on_cpu and (fetch or x.device.type != "cpu"):
            job = self._pool.submit(self._cpu_parts, layer, x_host, plan_host, on_cpu)
        device = sorted(hits + fetch)
        if device or prefetch:
            t0 = self.clock()
            try:
                slots, ticket = self._lookup(li, device, prefetch)
                fused = self._fused.get(layer)
                parts.update(self._device_parts(x, plan, device, slots, ticket) if fused is None
                             else self._fused_parts(x, ids, weights, plan, device, slots,
                                                    ticket, fused))
            finally:  # copies into these slots wait for the kernels that read them (stream fence)
                self.engine.release(torch.cuda.current_stream(x.device).cuda_stream
                                    if x.is_cuda else None)
            if fetch:
                self.cost.observe_link(len(fetch) * self.experts.expert_bytes, len(fetch),
                                       self.clock() - t0)
        if on_cpu:
            done = job.result() if job is not None else self._cpu_parts(layer, x, plan, on_cpu)
            if x.device.type != "cpu" or any(p is not None and p[1].dtype != x.dtype
                                             for p in done.values()):  # a share's fp32 sums
                done = {e: None if p is None else (p[0].to(x.device), p[1].to(x.device, x.dtype))
                        for e, p in done.items()}
            parts.update(done)
        self.fill(li, on_cpu)
        out = torch.zeros_like(x)
        for e in needed:  # ascending, as every strategy adds
            accumulate(out, parts[e])
        self.count(len(hits), len(fetch), len(on_cpu))
        self._t_end = self.clock()
        if not self.cost.device_is_cpu:
            self.modes.observe("split", x.shape[0], self._t_end - t_layer)
        return out

    def _all_on_cpu(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
        """A GPU's "cpu" layer mode: every routed expert from the host pool, on host copies of
        the layer's input, in one kernel call when the layer's experts allow it (as `resident`
        runs on a CPU host), summed in fp32 and sent back once. No slot lookup, no prefetch;
        the experts are queued as fills (`fill`), so the split finds them later."""
        ids_h = ids.cpu()  # the layer's wait for the device (routing), as the split's plan
        t0 = self.clock()
        x_h = x.to("cpu", torch.float32).contiguous()
        w_h = weights.to("cpu", torch.float32).contiguous()
        out_h = torch.zeros_like(x_h)
        args = self._kernel_args.get(layer)
        fmt = self.formats[layer]
        routed = None if args is None else routed_experts_ffn(x_h, ids_h, w_h, args, out_h)
        if routed is not None:
            self.cost.observe_cpu_layer(fmt, [n for _, n in routed], self.clock() - t0)
            needed = [e for e, _ in routed]
        else:  # per expert (float weights, biases, another activation)
            plan = plan_experts(ids_h, w_h, self.spec.num_experts)
            needed = plan.experts
            parts = self._cpu_parts(layer, x_h, plan, needed)
            for e in needed:
                accumulate(out_h, parts[e])
        out = out_h.to(x.device, x.dtype)
        self.fill(self.experts.layer_index[layer], needed)
        self._score_guess(layer, needed)
        self._count_in_place(len(needed))
        self._t_end = self.clock()
        self.modes.observe("cpu", x.shape[0], self._t_end - t0)
        return out

    def fill(self, li: int, experts: list[int]) -> None:
        """Experts this layer computed on the CPU, copied into the slots when the link is idle
        (`TransferEngine.fill`), so a later step finds them on the device: on a slow link the
        split fetches nothing, and the cache would otherwise hold only what prefetch guessed.
        With prefetch (speculative copies both; off on a CPU device, where a slot is no
        faster than the pool). The engine counts each as a use in its eviction policy."""
        if self.prefetch and experts:
            self.engine.fill([(li, e) for e in experts])

    def count(self, hits: int, fetched: int, on_cpu: int) -> None:
        """A layer's experts: computed on the device from the cache, fetched, on the CPU."""
        for i, n in enumerate((hits, fetched, on_cpu)):
            self.step_counts[i] += n
        self.device_computed += hits
        self.fetched += fetched
        self.cpu_computed += on_cpu

    def _in_place(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
        """A CPU device with empty slots: the split's answer is every expert from the host
        pool, by construction, so the layer is `resident`'s over the pool, plus the counts and
        the estimates (module doc)."""
        self._calls += 1
        out = torch.zeros_like(x)
        args = self._kernel_args.get(layer)
        sample = self._calls % CPU_SAMPLE_EVERY == 0  # this call feeds the estimates
        # one token: its experts share the bucket of one row, and the call's time is theirs
        if args is not None and (ids.shape[0] == 1 or not sample):
            # the hot path of a CPU host's decode: resident's one call plus three counters
            # (the clock read only for a sampled call)
            t0 = time.perf_counter() if sample else 0.0
            routed = routed_experts_ffn(x, ids, weights, args, out)
            if routed is not None:
                if sample:
                    self.cost.observe_cpu_layer(self.formats[layer], [n for _, n in routed],
                                                time.perf_counter() - t0)
                n = len(routed)
                self.distinct_per_layer.append(n)
                self.step_counts[2] += n
                self.cpu_computed += n
                return out
        plan = plan_experts(ids, weights, self.spec.num_experts)
        needed = plan.experts  # ascending
        host = self.host_weights[layer]
        if not sample:
            for e in needed:
                accumulate(out, expert_contribution(x, plan, e, host[e], self.act))
        else:
            parts = self._cpu_parts(layer, x, plan, needed)
            for e in needed:
                accumulate(out, parts[e])
        self._count_in_place(len(needed))
        return out

    def _count_in_place(self, computed: int) -> None:
        """A layer whose every routed expert was computed from the host pool."""
        self.distinct_per_layer.append(computed)
        self.step_counts[2] += computed
        self.cpu_computed += computed

    def _device_parts(self, x: torch.Tensor, plan: ExpertPlan, device: list[int],
                      slots: list[int], ticket: int) -> dict[int, Contribution | None]:
        """The slots' experts: those landed first, the rest after the ticket's copies."""
        landed = self.engine.ready(slots)
        parts = {e: expert_contribution(x, plan, e, self._slot_views[s], self.act)
                 for e, s, now in zip(device, slots, landed) if now}
        t0 = self.clock()
        self.engine.wait(ticket)
        self._wait_s += self.clock() - t0
        for e, s, now in zip(device, slots, landed):
            if not now:
                parts[e] = expert_contribution(x, plan, e, self._slot_views[s], self.act)
        return parts

    def _fused_parts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     plan: ExpertPlan, device: list[int], slots: list[int], ticket: int,
                     sw: SlotWeights) -> dict[int, Contribution | None]:
        """`_device_parts` through the fused kernel (`OffloadStrategy._fused_wave`): each
        expert's pair rows, taken from the pair buffer as its contribution (device ops only)."""
        y = torch.zeros(ids.numel(), x.shape[1], dtype=x.dtype, device=x.device)
        self._fused_wave(x, ids, weights, sw, device, slots, ticket, y)
        parts: dict[int, Contribution | None] = {}
        for e in device:
            tok = plan.tokens[plan.starts[e]:plan.starts[e] + plan.counts[e]]
            pos = (ids.index_select(0, tok) == e).int().argmax(dim=1)  # e's place in each row
            parts[e] = (tok, y.index_select(0, tok * ids.shape[1] + pos))
        return parts

    def one_call(self, layer: int, counts: list[int]) -> bool:
        """Whether a split's CPU share runs in one kernel call (`hybrid_share.one_call`)."""
        return hybrid_share.one_call(self, layer, counts)

    def cpu_share(self, layer: int, x_h: torch.Tensor, ids_h: torch.Tensor, w_h: torch.Tensor,
                  experts: list[int]) -> CpuShare | None:
        """A split's CPU share in one kernel call (`hybrid_share.cpu_share`)."""
        return hybrid_share.cpu_share(self, layer, x_h, ids_h, w_h, experts)

    def _cpu_parts(self, layer: int, x: torch.Tensor, plan: ExpertPlan,
                   experts: list[int]) -> dict[int, Contribution | None]:
        """`experts` computed from the host pool on host tensors `x`, `plan` (any thread)."""
        host, fmt = self.host_weights[layer], self.formats[layer]
        parts: dict[int, Contribution | None] = {}
        for e in experts:
            t0 = time.perf_counter()
            part = expert_contribution(x, plan, e, host[e], self.act)
            self.cost.observe_cpu(fmt, plan.counts[e], time.perf_counter() - t0)
            parts[e] = part
        return parts

    def begin_forward(self, num_tokens: int) -> None:
        super().begin_forward(num_tokens)
        self.step_counts = [0, 0, 0]

    def graph_support(self) -> GraphSupport:
        # offload's "layer" mode, the CPU share computed in the host step (`moe.hybrid_graph`)
        if self._graph is None:
            return GraphSupport("off", "the hybrid strategy has MoE layers off the fused "
                                       "kernel: its CPU share has no pair rows to go into")
        return GraphSupport("layer")

    def host_step(self, layer: int, ids: torch.Tensor, weights: torch.Tensor, rows: int,
                  x: torch.Tensor) -> None:
        """The layer's split, fetches and CPU share, outside any graph (`moe.hybrid_graph`);
        the captured `device_step` is offload's."""
        hybrid_graph.host_step(self, layer, ids, weights, rows, x)

    def stats(self) -> dict[str, Any]:
        s = super().stats()
        split = self.cost.snapshot()
        s |= {"device_computed": self.device_computed, "fetched": self.fetched,
              "cpu_computed": self.cpu_computed,
              "step_device_computed": self.step_counts[0], "step_fetched": self.step_counts[1],
              "step_cpu_computed": self.step_counts[2],
              "split_link_bytes_per_s": split["link_bytes_per_s"],
              "split_link_latency_s": split["link_latency_s"],
              "split_cpu_s_per_token": split["cpu_s_per_token"],
              "cpu_expert_threads": self.threads}
        modes = self.modes.snapshot()  # a GPU's per-layer choice (`hybrid_cost.LayerModes`)
        s |= {"split_layer_seconds": modes["layer_seconds"],
              "layers_split": modes["layers_split"], "layers_all_cpu": modes["layers_all_cpu"],
              "layers_explored": modes["layers_explored"]}
        return s

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        super().close()
