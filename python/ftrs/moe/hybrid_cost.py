"""The hybrid strategy's estimates: pure, no clock, no threads (`ftrs.moe.hybrid` times and
feeds them).

- `CostModel`: per missed expert, its expected time on the link (latency + bytes / rate, then
  its compute on the device) against the CPU (tokens x seconds per token, per block type and
  per power-of-two bucket of tokens), and the split that minimises the layer's time.
- `LayerModes`: on a GPU, per MoE layer call, whether the split runs at all or every routed
  expert goes to the CPU. A split assumes the device part costs no more than its copies, but
  the device part has its own fixed price per layer (a slot lookup, a sort, kernel launches, a
  fence): measured on an H200 host (bench/hybrid.py --device cuda, a demo-shaped Q4_K_M), a
  decode layer's device part cost about twice the CPU computing the layer's two experts, so
  the split lost to "all experts on the CPU" at every link. The modes are timed by the wall
  clock of the layer call (after routing's host transfer, which both pay), kept as moving
  averages per bucket of tokens (the first call of each left out: it runs cold), and the cheaper
  one runs. The other one runs too, so an estimate made on a cold cache or a busy host does not
  stick, but only as often as it costs at most `EXPLORE_SHARE` of the layers' time (each call
  earns that share of its time; the other mode runs when the earnings cover its extra cost), or
  once in `EXPLORE_MAX_GAP` calls: the bound holds however far apart the two modes are.

Both are built from injected figures in the tests (tests/moe/test_hybrid.py).
"""

from __future__ import annotations

from typing import Any

#: Weight of a new sample in each moving estimate.
EWMA_ALPHA = 0.3
#: Assumed before the first measurement: host memory streamed by the CPU kernels...
SEED_CPU_BYTES_PER_S = 8e9
#: ...and a link of unknown speed (a PCIe 4.0 x16 link's practical rate).
SEED_LINK_BYTES_PER_S = 20e9
#: On a GPU, running the mode the estimates did not pick (so both follow the host) costs at most
#: this share of the layer calls' time, per bucket of tokens...
EXPLORE_SHARE = 1 / 32
#: ...and that mode runs at least once in this many calls, however dear its estimate (an
#: estimate taken in a busy moment is measured again).
EXPLORE_MAX_GAP = 1024
#: Calls of each mode (per bucket) whose time is not kept: the first ones run cold (a kernel
#: compiled, pages touched for the first time).
WARMUP_CALLS = 1


def bucket(tokens: int) -> int:
    """The power of two at or below `tokens` (>= 1): the key of a CPU rate."""
    return 1 << (max(tokens, 1).bit_length() - 1)


class CostModel:
    """Expected seconds of a missed expert on the link and on the CPU, from moving estimates.

    Pure: no clock, no threads. `split` decides; `observe_*` feed measurements back. Every
    estimate may be injected (tests, or a profile's figures) through the constructor.
    """

    def __init__(self, link_bytes_per_s: float, link_latency_s: float,
                 cpu_s_per_token: float, device_s_per_token: float = 0.0,
                 device_is_cpu: bool = False, alpha: float = EWMA_ALPHA,
                 learn: bool = True) -> None:
        if link_bytes_per_s <= 0 or cpu_s_per_token <= 0:
            raise ValueError("cost model: rates must be > 0")
        self.link_bytes_per_s = link_bytes_per_s
        self.link_latency_s = link_latency_s
        self.seed_cpu_s_per_token = cpu_s_per_token  # for (format, bucket)s never measured
        self.device_s_per_token = device_s_per_token  # a fetched expert's compute, per token
        self.device_is_cpu = device_is_cpu  # device compute = CPU compute; the two never overlap
        self.alpha = alpha
        self.learn = learn  # False: the estimates stay as injected
        self.cpu: dict[tuple[str, int], float] = {}  # (block format, bucket) -> s per token

    # ------------------------------------------------------------------ estimates

    def cpu_rate(self, fmt: str, tokens: int) -> float:
        """Seconds per token of one expert on `tokens` rows: the bucket's own estimate, else the
        nearest measured bucket of the same format (below first), else the seed."""
        b = bucket(tokens)
        if (fmt, b) in self.cpu:
            return self.cpu[(fmt, b)]
        known = sorted(k for f, k in self.cpu if f == fmt)
        below = [k for k in known if k < b]
        if below:
            return self.cpu[(fmt, below[-1])]
        return self.cpu[(fmt, known[0])] if known else self.seed_cpu_s_per_token

    def cpu_cost(self, fmt: str, tokens: int) -> float:
        return tokens * self.cpu_rate(fmt, tokens)

    def link_cost(self, fmt: str, nbytes: int, tokens: int) -> float:
        """Copy one expert, then compute it on the device."""
        compute = (self.cpu_cost(fmt, tokens) if self.device_is_cpu
                   else tokens * self.device_s_per_token)
        return self.link_latency_s + nbytes / self.link_bytes_per_s + compute

    # ------------------------------------------------------------------ the split

    def split(self, misses: list[tuple[int, int]], nbytes: int, fmt: str,
              room: int) -> tuple[list[int], list[int]]:
        """`misses`: (expert, tokens routed to it). Returns (CPU experts, experts to fetch), each
        ascending. At most `room` are fetched (free device slots). The CPU takes the experts with
        the fewest tokens first: its cost grows with the tokens, the link's hardly does. Of the
        `k` cheapest-on-CPU prefixes the one with the least expected time wins (ties: the CPU,
        fewer bytes on the link)."""
        order = sorted(misses, key=lambda m: (m[1], m[0]))
        cpu = [self.cpu_cost(fmt, t) for _, t in order]
        link = [self.link_cost(fmt, nbytes, t) for _, t in order]
        n = len(order)
        best_k, best = n, float("inf")
        c_sum, l_rest = 0.0, sum(link)
        for k in range(n + 1):
            if n - k <= room:
                cost = c_sum + l_rest if self.device_is_cpu else max(c_sum, l_rest)
                if cost <= best:
                    best_k, best = k, cost
            if k < n:
                c_sum += cpu[k]
                l_rest -= link[k]
        return (sorted(e for e, _ in order[:best_k]), sorted(e for e, _ in order[best_k:]))

    # ------------------------------------------------------------------ measurements

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def observe_cpu(self, fmt: str, tokens: int, seconds: float) -> None:
        """One expert computed on the CPU on `tokens` rows took `seconds`."""
        if tokens > 0:
            self._observe_rate(fmt, bucket(tokens), seconds / tokens)

    def observe_cpu_layer(self, fmt: str, tokens: list[int], seconds: float) -> None:
        """Experts computed on the CPU in one call, on `tokens[i]` rows each, took `seconds`:
        a sample of their bucket's rate when they share one (a decode step's single rows);
        nothing otherwise (the call's time cannot be split between buckets)."""
        buckets = {bucket(t) for t in tokens}
        if len(buckets) == 1 and sum(tokens) > 0:
            self._observe_rate(fmt, buckets.pop(), seconds / sum(tokens))

    def _observe_rate(self, fmt: str, b: int, seconds_per_token: float) -> None:
        if self.learn and seconds_per_token > 0:
            key = (fmt, b)
            self.cpu[key] = self._avg(self.cpu.get(key), seconds_per_token)

    def observe_link(self, nbytes: int, copies: int, seconds: float) -> None:
        """`copies` experts (`nbytes` in all) were on the link for `seconds` (from the lookup
        to the end of the wait: an upper bound of the copy time)."""
        wire = seconds - copies * self.link_latency_s
        if self.learn and nbytes > 0 and wire > 0:
            self.link_bytes_per_s = self._avg(self.link_bytes_per_s, nbytes / wire)

    def snapshot(self) -> dict[str, Any]:
        return {"link_bytes_per_s": self.link_bytes_per_s,
                "link_latency_s": self.link_latency_s,
                "cpu_s_per_token": {f"{f}/{b}": v for (f, b), v in sorted(self.cpu.items())}}


def seed_link(backend: str) -> tuple[float, float]:
    """(bytes/s, latency s) assumed for a backend before it is measured: a simulated link's own
    figures, else a fast link (so the first misses try it and measure it)."""
    if backend.startswith("simulated:"):
        parts = backend.split(":")
        try:
            gbps = float(parts[1])
            lat_us = float(parts[2]) if len(parts) > 2 else 0.0
            return gbps * 1e9, lat_us * 1e-6
        except ValueError:
            pass
    return SEED_LINK_BYTES_PER_S, 10e-6 if backend.split(":")[0] == "cuda" else 0.0


class LayerModes:
    """"split" or "cpu" per MoE layer call on a GPU, by measured wall time (module doc)."""

    MODES = ("split", "cpu")

    def __init__(self, alpha: float = EWMA_ALPHA, explore_share: float = EXPLORE_SHARE,
                 max_gap: int = EXPLORE_MAX_GAP, warmup: int = WARMUP_CALLS,
                 learn: bool = True) -> None:
        self.alpha = alpha
        self.explore_share = explore_share  # 0: never explore
        self.max_gap = max_gap  # 0: no forced exploration
        self.warmup = warmup
        self.learn = learn  # False: the estimates stay as injected
        self.seconds: dict[tuple[str, int], float] = {}  # (mode, bucket) -> s per layer call
        self.samples: dict[tuple[str, int], int] = {}  # calls observed, warm-up included
        self.earned: dict[int, float] = {}  # bucket -> exploration seconds earned, not spent
        self.since: dict[int, int] = {}  # bucket -> calls since the other mode last ran
        self.chosen = {"split": 0, "cpu": 0}
        self.explored = 0

    def choose(self, tokens: int) -> str:
        """The mode of a layer call on `tokens` rows: each mode until it has a kept sample, then
        the cheaper; the other when the exploration budget covers its extra cost (each call
        earns `explore_share` of the cheaper one's time), or `max_gap` calls after it last ran."""
        b = bucket(tokens)
        split, cpu = self.seconds.get(("split", b)), self.seconds.get(("cpu", b))
        if split is None or cpu is None:
            mode = "split" if split is None else "cpu"
        else:
            mode, other = ("split", "cpu") if split <= cpu else ("cpu", "split")
            t_best, extra = min(split, cpu), abs(split - cpu)
            budget = self.earned.get(b, 0.0) + self.explore_share * t_best
            gap = self.since.get(b, 0) + 1
            if self.explore_share > 0 and (budget >= extra
                                           or (self.max_gap > 0 and gap >= self.max_gap)):
                mode, budget, gap = other, max(0.0, budget - extra), 0
                self.explored += 1
            self.earned[b], self.since[b] = budget, gap
        self.chosen[mode] += 1
        return mode

    def observe(self, mode: str, tokens: int, seconds: float) -> None:
        """A layer call in `mode` on `tokens` rows took `seconds` (the first `warmup` calls of
        each mode and bucket are not kept: they run cold)."""
        if not self.learn or seconds <= 0:
            return
        key = (mode, bucket(tokens))
        n = self.samples.get(key, 0)
        self.samples[key] = n + 1
        if n < self.warmup:
            return
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else (
            (1 - self.alpha) * old + self.alpha * seconds)

    def snapshot(self) -> dict[str, Any]:
        return {"layer_seconds": {f"{m}/{b}": v for (m, b), v in sorted(self.seconds.items())},
                "layers_split": self.chosen["split"], "layers_all_cpu": self.chosen["cpu"],
                "layers_explored": self.explored}
