"""Prometheus metrics of the server (DESIGN.md "Metrics"), in a registry of its own.

The engine never imports prometheus: it sends one `StepStats` per step and `observe_step` reads
it here. Per-request figures (TTFT, inter-token latency, latency, token counts, outcome) are
observed by the request handlers, which see the tokens arrive.

`StepStats.experts` carries the expert/PCIe counters of the Rust core. Counters there are
*cumulative since the engine started*; the registry adds the difference from the last value
(a smaller value means the engine restarted: the new value is added whole). Keys read:
  counters: h2d_bytes, d2h_bytes, hits, misses, prefetch_used, prefetch_wasted,
            fill_issued, fill_used, fill_wasted (ftrs_expert_fill_total{outcome})
            (without h2d_bytes: (demand_fetches + prefetch_issued - prefetch_cancelled
             + fill_issued - fill_dropped) * expert_bytes, the names `ftrs._core`
             TransferEngine.stats() uses: `engine.fetch.h2d_bytes`)
  gauges:   slots, queue_depth, inflight_bytes, prefill_cap_tokens
  per step: prefill_fetch_bytes (histogram ftrs_prefill_chunk_fetch_bytes, observed when the
            step had prefill tokens: the engine's `engine.fetch.note_prefill_fetch`)
  hybrid:   cpu_computed (counter ftrs_expert_cpu_compute_total: experts computed on the CPU);
            the split's estimates as gauges: split_link_bytes_per_s, split_link_latency_s,
            split_cpu_s_per_token ({"FORMAT/TOKENS": s per token}, labels format and tokens)
`StepStats.preemptions` (cumulative, like the counters above) adds to ftrs_preemptions_total.
`StepStats.prefill_with_decodes` (the engine's measured prompt chunk beside decodes,
`engine.chunking`) sets ftrs_prefill_with_decodes_tokens.
`StepStats.guard` (the adaptive guard, `guard.live`) sets ftrs_prefill_cap_tokens to the live
step budget, ftrs_pcie_pacing_bytes_per_second, ftrs_adaptive_guard_events,
ftrs_adaptive_guard_level and ftrs_adaptive_guard_relaxes.

When an engine is ready, `engine_ready(experts)` sets ftrs_expert_cache_slots from its ready
message (`EngineReady.experts`: the strategy's `stats()` at load; absent or empty for a resident
or dense engine, which leaves 0), so the gauge is true before the first step reports it.
When the engine process dies, `engine_gone()` sets every gauge the dead engine reported
(requests running and waiting, KV usage, expert slots, transfer queue and bytes in flight) to
0 until the next engine reports, and forgets its cumulative counters, so the new engine's are
added whole; counters never go down. `ftrs_engine_restarts_total` counts new engine processes.

Device readings (`observe_device`: GPU power and temperature, PCIe replays, link generation and
width) have no sample until one is read: a host without a GPU, or a probe that cannot read a
figure, shows the metric's HELP and TYPE only, never a made-up 0.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from importlib import metadata

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ftrs.engine.fetch import h2d_bytes
from ftrs.engine.protocol import StepStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_BYTE_BUCKETS = tuple(float(2**p) for p in range(20, 36, 2))

# StepStats.experts counter key -> (counter attribute, label value)
_EXPERT_COUNTERS = {
    "h2d_bytes": ("pcie_bytes", "h2d"),
    "d2h_bytes": ("pcie_bytes", "d2h"),
    "hits": ("expert_lookups", "hit"),
    "misses": ("expert_lookups", "miss"),
    "prefetch_used": ("expert_prefetch", "used"),
    "prefetch_wasted": ("expert_prefetch", "wasted"),
    "fill_issued": ("expert_fill", "issued"),
    "fill_used": ("expert_fill", "used"),
    "fill_wasted": ("expert_fill", "wasted"),
}
DEVICE_STATES = ("ok", "degraded", "lost", "unknown")
REQUEST_STATUSES = ("success", "aborted", "rejected", "failed")


def ftrs_version() -> str:
    try:
        return metadata.version("ftrs")
    except metadata.PackageNotFoundError:  # running from a checkout
        import ftrs

        return str(getattr(ftrs, "__version__", "0+unknown"))


class Reading:
    """An unlabelled gauge with no sample until a value is set (prometheus_client's `Gauge`
    starts at 0): a device figure nobody could read is absent, not 0. `clear()` makes it absent
    again."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.value: float | None = None
        registry.register(self)

    def set(self, value: float) -> None:
        self.value = float(value)

    def clear(self) -> None:
        self.value = None

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.name, self.documentation)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.name, self.documentation)
        if self.value is not None:
            family.add_metric([], self.value)
        yield family


class ServerMetrics:
    """All `ftrs_*` metrics; `render()` is the `/metrics` body."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "ftrs_"
        # requests
        self.requests = Counter(p + "requests", "Finished requests by outcome.", ["status"], registry=r)
        for s in REQUEST_STATUSES:
            self.requests.labels(s)
        self.running = Gauge(p + "requests_running", "Requests being decoded or prefilled.", registry=r)
        self.waiting = Gauge(p + "requests_waiting", "Requests admitted to the queue, not yet running.", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests, aborted ones included (whether or not their prefill ran).", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens.", registry=r)
        self.preemptions = Counter(p + "preemptions", "Requests preempted by the scheduler to free KV pages (each recomputed later, never dropped).", registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache at admission (re-admissions and every choice count: prefill saved).", registry=r)
        self.spec_drafted = Counter(p + "spec_draft_tokens", "Draft tokens verified by n-gram speculative decoding.", registry=r)
        self.spec_accepted = Counter(p + "spec_accepted_tokens", "Draft tokens accepted (each one a token generated without a step of its own).", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first token.", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between two tokens of a stream.", buckets=_ITL_BUCKETS, registry=r)
        self.latency = Histogram(p + "request_latency_seconds", "Arrival to last token.", buckets=_LATENCY_BUCKETS, registry=r)
        # memory
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "Fraction of KV pages in use (0 to 1).", registry=r)
        self.expert_slots = Gauge(p + "expert_cache_slots", "Device expert-cache slots.", registry=r)
        # experts and PCIe
        self.pcie_bytes = Counter(p + "pcie_bytes", "Bytes copied over PCIe.", ["direction"], registry=r)
        self.expert_lookups = Counter(p + "expert_lookups", "Expert-cache lookups.", ["result"], registry=r)
        self.expert_prefetch = Counter(p + "expert_prefetch", "Speculative expert prefetches.", ["outcome"], registry=r)
        self.expert_fill = Counter(p + "expert_fill", "Experts computed on the CPU copied in on an idle link (hybrid): started, demanded later, evicted unused.", ["outcome"], registry=r)
        for attr, label in _EXPERT_COUNTERS.values():
            getattr(self, attr).labels(label)
        self.cpu_compute = Counter(p + "expert_cpu_compute", "Routed experts computed on the CPU from the host pool (hybrid).", registry=r)
        self.split_link_rate = Gauge(p + "hybrid_link_bytes_per_second", "Hybrid split: estimated link rate.", registry=r)
        self.split_link_latency = Gauge(p + "hybrid_link_latency_seconds", "Hybrid split: assumed latency of one expert copy.", registry=r)
        self.split_cpu_rate = Gauge(p + "hybrid_cpu_seconds_per_token", "Hybrid split: estimated CPU seconds per token of one expert, by block format and tokens-per-expert bucket.", ["format", "tokens"], registry=r)
        self.queue_depth = Gauge(p + "transfer_queue_depth", "Expert transfers queued.", registry=r)
        self.inflight_bytes = Gauge(p + "transfer_inflight_bytes", "Bytes of expert transfers in flight.", registry=r)
        self.prefill_chunk_tokens = Histogram(p + "prefill_chunk_tokens", "Prefill tokens per step.", buckets=_TOKEN_BUCKETS, registry=r)
        self.prefill_fetch_bytes = Histogram(p + "prefill_chunk_fetch_bytes", "Expert bytes fetched per prefill step.", buckets=_BYTE_BUCKETS, registry=r)
        # device
        self.device_up = Gauge(p + "device_up", "1 while the engine and its device serve.", registry=r)
        self.device_state = Gauge(p + "device_state", "1 for the current device state.", ["state"], registry=r)
        self.device_lost = Counter(p + "device_lost", "Times the device was declared lost.", registry=r)
        self.engine_restarts = Counter(p + "engine_restarts", "Engine processes started after the first (any cause).", registry=r)
        self.gpu_power = Reading(p + "gpu_power_watts", "GPU power draw (no sample: not read).", r)
        self.gpu_temperature = Reading(p + "gpu_temperature_celsius", "GPU temperature (no sample: not read).", r)
        self.link_gen = Gauge(p + "pcie_link_gen", "PCIe link generation.", ["kind"], registry=r)
        self.link_width = Gauge(p + "pcie_link_width", "PCIe link width.", ["kind"], registry=r)
        self.pcie_replays = Reading(p + "pcie_replay_total", "PCIe replay counter of the device (no sample: not read).", r)
        self.prefill_cap = Gauge(p + "prefill_cap_tokens", "Token budget of one step (prefill cap).", registry=r)
        self.prefill_with_decodes = Gauge(p + "prefill_with_decodes_tokens", "Prompt tokens a step that carries decodes may take, from the measured step cost and --decode-stall-target (0: no bound but the step budget, or no step yet).", registry=r)
        self.pcie_pacing = Gauge(p + "pcie_pacing_bytes_per_second", "Expert-copy pacing rate set by the adaptive guard (0: off).", registry=r)
        self.guard_events = Gauge(p + "adaptive_guard_events", "Times the adaptive guard tightened since the engine started.", registry=r)
        self.guard_level = Gauge(p + "adaptive_guard_level", "Adaptive guard level (0: the startup ceiling).", registry=r)
        self.guard_relaxes = Gauge(p + "adaptive_guard_relaxes", "Times the adaptive guard relaxed one level since the engine started.", registry=r)
        self.build_info = Gauge(p + "build_info", "Build of the server.", ["version"], registry=r)
        self.build_info.labels(ftrs_version()).set(1)
        self.set_device_state("unknown", up=False)
        self._last_counters: dict[str, float] = {}

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ------------------------------------------------------------------------- engine side

    def observe_step(self, stats: StepStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        if stats.kv_usage_ratio >= 0:
            self.kv_usage.set(stats.kv_usage_ratio)
        if stats.prefix_hit_tokens > 0:
            self.prefix_hits.inc(stats.prefix_hit_tokens)
        if stats.prefill_tokens > 0:
            self.prefill_chunk_tokens.observe(stats.prefill_tokens)
        self.prefill_with_decodes.set(stats.prefill_with_decodes or 0)
        self._add_cumulative("preemptions", stats.preemptions, self.preemptions)
        if stats.draft_tokens > 0:
            self.spec_drafted.inc(stats.draft_tokens)
            self.spec_accepted.inc(stats.accepted_tokens)
        self.observe_experts(stats.experts, had_prefill=stats.prefill_tokens > 0)
        if stats.guard:
            self.observe_guard(stats.guard)

    def engine_ready(self, experts: Mapping[str, object] | None) -> None:
        """A new engine is ready: its expert-cache slots, before any step reports them."""
        value = _number((experts or {}).get("slots"))
        if value is not None:
            self.expert_slots.set(value)

    def engine_gone(self) -> None:
        """The engine process died: what it reported is no longer true."""
        for gauge in (self.running, self.waiting, self.kv_usage, self.expert_slots,
                      self.queue_depth, self.inflight_bytes):
            gauge.set(0)
        self._last_counters.clear()

    def observe_guard(self, guard: Mapping[str, object]) -> None:
        """The adaptive guard's live state (`StepStats.guard`): the step budget it set, its
        pacing, its level and how often it tightened and relaxed."""
        for key, gauge in (("prefill_cap_tokens", self.prefill_cap),
                           ("pcie_pacing_bytes_per_second", self.pcie_pacing),
                           ("event_count", self.guard_events),
                           ("level", self.guard_level),
                           ("relax_count", self.guard_relaxes)):
            value = _number(guard.get(key))
            if value is not None:
                gauge.set(value)

    def observe_experts(self, experts: Mapping[str, object], had_prefill: bool = False) -> None:
        experts = {**experts, "h2d_bytes": h2d_bytes(experts)}
        for key, (attr, label) in _EXPERT_COUNTERS.items():
            value = _number(experts.get(key))
            if value is None:
                continue
            last = self._last_counters.get(key, 0.0)
            delta = value - last if value >= last else value
            if delta > 0:
                getattr(self, attr).labels(label).inc(delta)
            self._last_counters[key] = value
        for key, gauge in (("slots", self.expert_slots), ("queue_depth", self.queue_depth),
                           ("inflight_bytes", self.inflight_bytes),
                           ("prefill_cap_tokens", self.prefill_cap)):
            value = _number(experts.get(key))
            if value is not None:
                gauge.set(value)
        self._observe_split(experts)
        fetch = _number(experts.get("prefill_fetch_bytes"))
        if had_prefill and fetch is not None:
            self.prefill_fetch_bytes.observe(fetch)

    def _observe_split(self, experts: Mapping[str, object]) -> None:
        """The hybrid strategy's CPU-compute counter and its split's estimates."""
        self._add_cumulative("cpu_computed", experts.get("cpu_computed"), self.cpu_compute)
        for key, gauge in (("split_link_bytes_per_s", self.split_link_rate),
                           ("split_link_latency_s", self.split_link_latency)):
            value = _number(experts.get(key))
            if value is not None:
                gauge.set(value)
        rates = experts.get("split_cpu_s_per_token")
        if isinstance(rates, Mapping):
            for name, rate in rates.items():
                fmt, _, tokens = str(name).rpartition("/")
                value = _number(rate)
                if value is not None:
                    self.split_cpu_rate.labels(fmt, tokens).set(value)

    def _add_cumulative(self, key: str, total: object, counter: Counter) -> None:
        """Add what an engine counter `total` (cumulative since the engine started) grew by
        since its last value; a smaller value means a new engine: added whole."""
        value = _number(total)
        if value is None:
            return
        last = self._last_counters.get(key, 0.0)
        delta = value - last if value >= last else value
        if delta > 0:
            counter.inc(delta)
        self._last_counters[key] = value

    def set_device_state(self, state: str, up: bool) -> None:
        for s in DEVICE_STATES:
            self.device_state.labels(s).set(1 if s == state else 0)
        self.device_up.set(1 if up else 0)

    def observe_device(self, sample: Mapping[str, object]) -> None:
        """A device-probe sample (health monitor): power_watts, temperature_celsius,
        link_gen_current/max, link_width_current/max, replay_total. A missing key leaves its
        metric as it was; a key whose value is not a number (None: the probe could not read
        it) removes the metric's sample."""
        for key, gauge, label in (
            ("power_watts", self.gpu_power, None),
            ("temperature_celsius", self.gpu_temperature, None),
            ("link_gen_current", self.link_gen, "current"),
            ("link_gen_max", self.link_gen, "max"),
            ("link_width_current", self.link_width, "current"),
            ("link_width_max", self.link_width, "max"),
            ("replay_total", self.pcie_replays, None),
        ):
            if key not in sample:
                continue
            value = _number(sample[key])
            if isinstance(gauge, Reading):
                if value is None:
                    gauge.clear()
                else:
                    gauge.set(value)
            elif value is None:
                gauge.remove(label)
            else:
                gauge.labels(label).set(value)

    # ------------------------------------------------------------------------ request side

    def request_done(self, status: str | None, prompt_tokens: int, generation_tokens: int,
                     latency_s: float | None) -> None:
        """Count a request's tokens; and its outcome unless `status` is None (an error, counted
        by `request_failed` where it is answered)."""
        if status is not None:
            self.requests.labels(status).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        if latency_s is not None:
            self.latency.observe(latency_s)


    def request_failed(self, http_status: int) -> None:
        """Count a request answered with an error: 499 (its client left before it ran:
        `ClientDisconnected`) as aborted, like a client that leaves while it runs; any other
        4xx as rejected; 5xx as failed."""
        status = "aborted" if http_status == 499 else "rejected" if http_status < 500 else "failed"
        self.requests.labels(status).inc()


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


__all__ = ["CONTENT_TYPE", "DEVICE_STATES", "REQUEST_STATUSES", "ServerMetrics", "ftrs_version"]
