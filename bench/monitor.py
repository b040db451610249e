"""Device monitor cost and false alarms: the engine under steady load with DeviceMonitor on.

Runs an EngineCore in this process (the demo model, or `--model DIR`) with `--clients`
requests always in flight, and two monitors at once, each as the engine process runs it
(fast probe every `--fast-interval` s, rich sample every 2 s, progress watchdog):

- `real`: against this host's /sys and its first NVIDIA GPU; on a host without one the PCI
  probe has nothing to read, so only the watchdog runs ("not_applicable");
- `fake`: against a fake sysfs tree with one healthy NVIDIA GPU (config space, link speed and
  width, AER counters), so the cheap probe really opens and reads a config file.

Printed (JSON on stdout): each monitor's probe seconds as a share of the engine's step time
(target <= 1 %; the probe time is wall time inside the monitor thread, so GIL waits behind the
engine count against the monitor), its samples, and the device state sampled once a second
all run long: any state other than ok / not_applicable, or any fault, is a false alarm and the
script exits 1.

    python bench/monitor.py                      # demo model, 2 minutes
    python bench/monitor.py --minutes 10         # the no-false-alarm run of issue 5
    python bench/monitor.py --model DIR --minutes 2 --device cpu
"""

from __future__ import annotations

import sys

# Never import from the script's folder: a bench script must not shadow a library module.
if sys.path and sys.path[0] == __import__("os").path.dirname(__import__("os").path.abspath(__file__)):
    del sys.path[0]

import argparse
import json
import logging
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ftrs.engine.core import EngineCore
from ftrs.engine.faults import FAKE_BDF, make_fake_sysfs
from ftrs.engine.protocol import GenerateRequest
from ftrs.errors import DeviceError
from ftrs.health.monitor import DeviceMonitor, MonitorConfig
from ftrs.health.sysfs import discover_nvidia_gpus
from ftrs.llm import LLM
from ftrs.sampling import SamplingParams

log = logging.getLogger("bench.monitor")


def fake_gpu_tree(root: Path) -> Path:
    """make_fake_sysfs plus the link and AER files a real GPU's directory has."""
    make_fake_sysfs(root)
    dev = root / "bus" / "pci" / "devices" / FAKE_BDF
    for name, text in {"current_link_speed": "16.0 GT/s PCIe", "max_link_speed": "16.0 GT/s PCIe",
                       "current_link_width": "16", "max_link_width": "16"}.items():
        (dev / name).write_text(text + "\n")
    for name, total in (("aer_dev_correctable", "TOTAL_ERR_COR"),
                        ("aer_dev_nonfatal", "TOTAL_ERR_NONFATAL"),
                        ("aer_dev_fatal", "TOTAL_ERR_FATAL")):
        (dev / name).write_text(f"RxErr 0\nBadTLP 0\n{total} 0\n")
    return root


class Watched:
    """One monitor, with the faults and states it reported."""

    def __init__(self, name: str, config: MonitorConfig, engine: Any) -> None:
        self.name = name
        self.faults: list[str] = []
        self.states: Counter[str] = Counter()
        self.monitor = DeviceMonitor(
            config, on_fault=self._fault,
            has_pending_work=lambda: engine.in_step,
            last_step_finished_at=lambda: engine.last_step_end)

    def _fault(self, err: DeviceError) -> None:
        self.faults.append(f"{type(err).__name__}: {err.message}")

    def sample(self) -> None:
        self.states[self.monitor.state.state] += 1

    def report(self, step_s: float) -> dict[str, Any]:
        m = self.monitor
        share = m.probe_seconds_total / step_s if step_s > 0 else None
        return {"bdf": m.config.bdf, "sysfs_root": m.config.sysfs_root,
                "probe_seconds": round(m.probe_seconds_total, 4),
                "probe_share_of_step_time": None if share is None else round(share, 6),
                "probe_share_percent": None if share is None else round(100 * share, 4),
                "target_percent": 1.0, "within_target": share is not None and share <= 0.01,
                "fast_samples": m.fast_samples, "slow_samples": m.slow_samples,
                "states_seen": dict(self.states), "faults": self.faults,
                "final_state": m.state.to_dict()}


class Driver:
    """Keeps `clients` requests in flight on an EngineCore; times every step."""

    def __init__(self, engine: EngineCore, clients: int, prompt: list[int], max_tokens: int) -> None:
        self.engine = engine
        self.clients = clients
        self.prompt = prompt
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.8, ignore_eos=True)
        self.in_flight: set[str] = set()
        self.next_id = 0
        self.in_step = False
        self.last_step_end = time.monotonic()
        self.steps = 0
        self.step_s = 0.0
        self.tokens = 0
        self.finished = 0

    def fill(self) -> None:
        while len(self.in_flight) < self.clients:
            rid = f"bench-{self.next_id}"
            self.next_id += 1
            self.engine.add_request(GenerateRequest(rid, list(self.prompt), self.params))
            self.in_flight.add(rid)

    def step(self) -> None:
        self.fill()
        self.in_step = True
        t0 = time.perf_counter()
        self.last_step_end = time.monotonic()
        events, _ = self.engine.step()
        self.step_s += time.perf_counter() - t0
        self.last_step_end = time.monotonic()
        self.in_step = False
        self.steps += 1
        for ev in events:
            self.tokens += len(ev.new_token_ids)
            if ev.finish_reason is not None:
                self.in_flight.discard(ev.request_id)
                self.finished += 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--moe-strategy", default="resident")
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--fast-interval", type=float, default=0.2, help="seconds between cheap probes")
    p.add_argument("--hang-timeout", type=float, default=120.0)
    p.add_argument("--progress-every", type=float, default=30.0, help="seconds between log lines")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    with tempfile.TemporaryDirectory(prefix="ftrs-bench-sysfs-") as tmp:  # the fake tree
        return run(args, Path(tmp))


def run(args: argparse.Namespace, tmp: Path) -> int:
    """The measurement; the fake device's sysfs tree is built under `tmp`."""
    llm = LLM(args.model, device=args.device, dtype=args.dtype, moe_strategy=args.moe_strategy)
    engine = llm.engine
    prompt = (llm.tokenizer.encode("Explain how a PCIe link trains, step by step.")
              if engine.tokenizer is not None else [5, 6, 7, 8, 9, 10, 11, 12])
    driver = Driver(engine, args.clients, prompt, args.max_tokens)

    gpus = discover_nvidia_gpus()
    fake_root = fake_gpu_tree(tmp)
    common: dict[str, Any] = {"fast_interval_s": args.fast_interval,
                              "hang_timeout_s": args.hang_timeout}
    watched = [
        Watched("real", MonitorConfig(bdf=gpus[0] if gpus else None, sysfs_root="/sys",
                                      **common), driver),
        Watched("fake", MonitorConfig(bdf=FAKE_BDF, sysfs_root=str(fake_root), kernel_log=None,
                                      use_nvml=False, **common), driver),
    ]
    for _ in range(3):  # warm-up outside the measurement
        driver.step()
    driver.steps = driver.tokens = driver.finished = 0
    driver.step_s = 0.0
    for w in watched:
        w.monitor.start()

    done = threading.Event()

    def sampler() -> None:  # the device state once a second, steps long or short
        while not done.wait(1.0):
            for w in watched:
                w.sample()

    sampling = threading.Thread(target=sampler, name="bench-state-sampler", daemon=True)
    t0 = time.monotonic()
    sampling.start()
    deadline = t0 + args.minutes * 60
    next_log = t0 + args.progress_every
    while (now := time.monotonic()) < deadline:
        driver.step()
        if now >= next_log:
            next_log += args.progress_every
            log.info("%.0f s: %d steps, %.1f tok/s, states %s", now - t0, driver.steps,
                     driver.tokens / (now - t0),
                     {w.name: w.monitor.state.state for w in watched})
    wall = time.monotonic() - t0
    done.set()
    sampling.join(2.0)
    for w in watched:
        w.monitor.stop(2.0)

    monitors = {w.name: w.report(driver.step_s) for w in watched}
    false_alarms = sum(len(w.faults) + sum(n for s, n in w.states.items()
                                           if s not in ("ok", "not_applicable"))
                       for w in watched)
    out = {
        "model": args.model, "device": str(engine.device), "moe_strategy": args.moe_strategy,
        "minutes": round(wall / 60, 2), "clients": args.clients,
        "fast_interval_s": args.fast_interval, "real_nvidia_gpus": gpus,
        "steps": driver.steps, "step_seconds": round(driver.step_s, 3),
        "mean_step_ms": round(1000 * driver.step_s / max(1, driver.steps), 3),
        "tokens_per_s": round(driver.tokens / wall, 1), "requests_finished": driver.finished,
        "monitors": monitors, "false_alarms": false_alarms,
        "device_up_throughout": false_alarms == 0,
    }
    print(json.dumps(out, indent=2))
    llm.engine.close()
    return 0 if false_alarms == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
