"""`ftrs doctor [--model M] [--bundle PATH]`: what this host is, and how to run ftrs on it.

One report (a dict; `format_text` renders it): device and driver, PCIe link (current and max),
measured copy bandwidth, host RAM, the model's fetch volumes, the recommended strategy, cache
size and prefill ceiling each with its reason, and the recent crash reports (each with its age;
those past the loss age window, `--guard-loss-max-age-days`, are marked "expired, ignored": the
link guard no longer caps for them); the reports of fault drills (`--fault-inject`) are listed
apart, as drills: they are no device faults and the guard ignores them; a report that does
not read is skipped with one warning. Under a recommendation other than offload, the guard's
warnings about offload are marked `if offload:`; a dense model is said to have no routed
experts, with no fetch table. Without a GPU it says so plainly and still reports the CPU-side
figures (host copy bandwidth through the Rust host backend, RAM, fetch volumes). The CPU kernels: the family `auto` runs and, measured, the
`--cpu-kernels` setting that is fastest here (`quant/host.py`). `--bundle` also writes a tar.gz
(see `guard.bundle`) into a directory that must exist; its path ends the text report, or is
the `"bundle"` field of `--json` (stdout is then the JSON alone).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ftrs.config import ftrs_home
from ftrs.errors import ConfigError
from ftrs.guard.link import LinkState, measure_link, probe_link
from ftrs.guard.policy import (
    DEFAULT_LOSS_MAX_AGE_DAYS,
    DEFAULT_WINDOW_S,
    check_loss_max_age_days,
    check_window_s,
    decide_prefill_cap,
    is_expired,
    lost_chunk_tokens,
    report_age_days,
    report_bdf,
)
from ftrs.health.crash import CrashReport, host_info

logger = logging.getLogger(__name__)

CHUNKS = (1, 16, 256, 2048, 8192)
HIT_RATES = (0.0, 0.5, 0.9)
RECENT_CRASHES = 10


def read_meminfo(path: str | Path = "/proc/meminfo") -> dict[str, int]:
    """MemTotal / MemAvailable in bytes (empty where unreadable)."""
    out: dict[str, int] = {}
    try:
        for line in Path(path).read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("MemTotal", "MemAvailable") and rest.split():
                out[name] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def device_section(link: LinkState) -> dict[str, Any]:
    info = host_info()
    gpu = link.device == "cuda"
    d: dict[str, Any] = {"gpu": gpu, "bdf": link.bdf, "driver": info.get("nvidia_driver"),
                         "torch": info.get("torch"), "kernel": info.get("kernel")}
    if not gpu:
        d["message"] = ("no GPU found (no NVIDIA device on the PCI bus): ftrs runs on the CPU; "
                        "the figures below are CPU-side (host copy bandwidth, RAM)")
        return d
    try:
        import torch

        if torch.cuda.is_available():
            index = torch.cuda.current_device()  # one device for the name and the memory
            free, total = torch.cuda.mem_get_info(index)
            d |= {"name": torch.cuda.get_device_name(index), "memory_free_bytes": free,
                  "memory_total_bytes": total}
        else:
            d["message"] = "an NVIDIA GPU is on the bus but CUDA is not usable from torch"
    except Exception as e:  # a broken driver is itself a finding
        d["message"] = f"CUDA query failed: {e}"
    return d


def crash_section(reports: Sequence[CrashReport], now: dt.datetime,
                  max_age_days: float = DEFAULT_LOSS_MAX_AGE_DAYS, *,
                  drills: bool = False) -> list[dict[str, Any]]:
    """The latest real reports (with `drills`: the latest fault-drill reports); `expired`:
    older than the loss age window, ignored by the guard."""
    return [{"file": r.path.name, "created_at": r.created_at, "classification": r.classification,
             "message": r.message, "bdf": report_bdf(r), "largest_chunk_tokens": lost_chunk_tokens(r),
             "age_days": report_age_days(r, now), "expired": is_expired(r, now, max_age_days),
             "drill": r.drill}
            for r in [r for r in reports if r.drill == drills][-RECENT_CRASHES:]]


def recommend(fetch: Any, link: LinkState, device: dict[str, Any]) -> dict[str, Any]:
    """Strategy and cache size, each with its reason (the prefill ceiling is the guard's)."""
    total = fetch.total_expert_bytes
    if is_dense(fetch.to_dict()):
        return {"strategy": "resident", "strategy_reason": (
                    "a dense model: no routed experts, so no expert strategy to choose"),
                "cache_slots": None, "cache_reason": "no routed experts: no expert cache"}
    if not device["gpu"] or "memory_free_bytes" not in device:
        return {"strategy": "resident", "strategy_reason": (
                    "no usable GPU: experts stay in host memory and run on the CPU; nothing "
                    "crosses a link"), "cache_slots": None,
                "cache_reason": "no device cache on the CPU"}
    budget = int(device["memory_free_bytes"] * 0.6)
    if total <= budget:
        return {"strategy": "resident", "strategy_reason": (
                    f"all experts ({total / 1e9:.2f} GB) fit in 60% of free device memory "
                    f"({budget / 1e9:.2f} GB)"), "cache_slots": None,
                "cache_reason": "resident: every expert is on the device"}
    slots = budget // fetch.expert_bytes
    all_slots = fetch.num_moe_layers * fetch.num_experts
    return {"strategy": "offload", "strategy_reason": (
                f"experts ({total / 1e9:.2f} GB) exceed 60% of free device memory "
                f"({budget / 1e9:.2f} GB); run `ftrs bench strategy` to measure the alternatives"),
            "cache_slots": int(slots), "cache_reason": (
                f"{slots} slots of {fetch.expert_bytes / 2**20:.1f} MiB fill 60% of free device "
                f"memory: {slots / all_slots:.0%} of the {all_slots} experts")}


def is_dense(fetch: dict[str, Any]) -> bool:
    """A model with no routed experts (its fetch figures are all zero)."""
    return not fetch["num_moe_layers"] or not fetch["num_experts"]


def model_section(model: str, device: str, window_s: float, link: LinkState,
                  dev: dict[str, Any], reports: Sequence[CrashReport], requested: int,
                  now: dt.datetime,
                  max_age_days: float = DEFAULT_LOSS_MAX_AGE_DAYS) -> dict[str, Any]:
    from ftrs.guard.startup import model_fetch

    fetch = model_fetch(model, device, "auto")
    gbps, source = link.effective_gbps()
    rows = fetch.table(CHUNKS)
    for r in rows:
        r["fetch_s"] = r["chunk_bytes"] / (gbps * 1e9) if gbps else None
    rec = recommend(fetch, link, dev)
    offload = decide_prefill_cap(link, fetch, requested=requested, crash_reports=reports,
                                 window_s=window_s, strategy="offload", now=now,
                                 max_loss_age_days=max_age_days)
    rec |= {"prefill_ceiling": offload.max_prefill_length if rec["strategy"] == "offload"
            else requested,
            "prefill_reason": "; ".join(offload.reasons) if rec["strategy"] == "offload"
            else f"{rec['strategy']}: no experts cross the link; no cap",
            "prefill_ceiling_if_offload": offload.to_dict()}
    return {"fetch": fetch.to_dict(), "link_gbps": gbps, "link_gbps_source": source,
            "kv_cache": kv_section(model, device), "prefill_chunks": rows,
            "decode_bytes_per_token": {str(h): round(fetch.decode_bytes_per_token(h))
                                       for h in HIT_RATES},
            "recommendation": rec}


def kv_section(model: str, device: str) -> dict[str, Any]:
    """What a token and the model's whole context take in the KV cache, in the compute dtype
    (bf16 on a GPU, fp32 on the CPU) and in int8 (`--kv-cache-dtype int8`)."""
    import torch

    from ftrs.guard.startup import model_spec
    from ftrs.kvcache.quant import model_bytes_per_token

    spec = model_spec(model)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    per = {"auto": model_bytes_per_token(spec, dtype, "auto"),
           "int8": model_bytes_per_token(spec, dtype, "int8")}
    ctx = spec.max_position_embeddings
    return {"compute_dtype": str(dtype).removeprefix("torch."), "bytes_per_token": per,
            "context_tokens": ctx, "context_bytes": {k: v * ctx for k, v in per.items()}}


def build_report(model: str | None = None, *, sysfs_root: str | Path = "/sys",
                 home: Path | None = None, measure: bool = True, backend: str | None = None,
                 window_s: float = DEFAULT_WINDOW_S, requested: int = 8192,
                 max_loss_age_days: float = DEFAULT_LOSS_MAX_AGE_DAYS,
                 now: dt.datetime | None = None) -> dict[str, Any]:
    """The doctor report as a JSON-ready dict; crash reports are aged at `now` (default: the
    wall clock). They are read once: one that does not read is one warning."""
    from ftrs.guard.startup import load_reports

    home = home or ftrs_home()
    reports = load_reports(home)
    now = now or dt.datetime.now(dt.timezone.utc)
    link = probe_link(sysfs_root=sysfs_root, under_load=False)
    if measure:
        link = measure_link(link, backend, sysfs_root=sysfs_root)
    dev = device_section(link)
    mem = read_meminfo()
    report: dict[str, Any] = {
        "device": dev, "link": link.to_dict(), "host": host_info(),
        "memory": {"ram_total_bytes": mem.get("MemTotal"),
                   "ram_available_bytes": mem.get("MemAvailable")},
        "bandwidth": {"h2d_gbps": link.measured_h2d_gbps, "h2d_backend": link.measured_backend,
                      "d2h_gbps": link.measured_d2h_gbps, "host_copy_gbps": link.host_copy_gbps},
        "crash_reports": crash_section(reports, now, max_loss_age_days),
        "drill_reports": crash_section(reports, now, max_loss_age_days, drills=True),
        "crash_report_max_age_days": max_loss_age_days}
    report["cpu_kernels"] = cpu_kernels_section(measure)
    if model is not None:
        report["model"] = {"name": model} | model_section(
            model, "cuda" if dev["gpu"] else "cpu", window_s, link, dev, reports, requested,
            now, max_loss_age_days)
    return report


def cpu_kernels_section(measure: bool) -> dict[str, Any]:
    """The family `auto` runs, and with `measure` each family's time on this host and the
    `--cpu-kernels` setting they recommend (`quant/host.py`)."""
    from ftrs import _core

    out: dict[str, Any] = {"auto": _core.quant_kernel(), "families": _core.quant_kernels()}
    if measure:
        from ftrs.quant.host import kernel_timings, recommend_kernels

        out["timings_us"] = kernel_timings()
        out["recommendation"] = recommend_kernels(out["timings_us"], out["auto"])
    return out


def _named(c: dict[str, Any]) -> str:
    """`DeviceLost: message`, or the classification alone for a report with no message."""
    return f"{c['classification']}: {c['message']}" if c["message"] else c["classification"]


def _fmt_bytes(n: float | None) -> str:
    return "?" if n is None else f"{n / 1e9:.2f} GB"


def format_text(r: dict[str, Any]) -> str:
    dev, link, bw = r["device"], r["link"], r["bandwidth"]
    lines = ["ftrs doctor", ""]
    if dev.get("message"):
        lines.append(f"device: {dev['message']}")
    if dev["gpu"]:
        lines.append(f"device: {dev.get('name', '?')} at {dev['bdf']}, driver {dev['driver']}")
        lines.append(f"link: Gen{link['gen_current']} x{link['width_current']} now, max "
                     f"Gen{link['gen_max']} x{link['width_max']} ({link['link_source']})"
                     + ("  BELOW MAX" if link["below_max"] else ""))
    if bw["h2d_gbps"] is None:  # measure_link fills H2D and host copy; --no-measure skips it
        lines.append("bandwidth: not measured (--no-measure)")
    else:
        lines.append(f"bandwidth: H2D {bw['h2d_gbps']} GB/s via {bw['h2d_backend']}; host copy "
                     f"{bw['host_copy_gbps']} GB/s" + (f"; D2H {bw['d2h_gbps']:.2f} GB/s"
                                                      if bw["d2h_gbps"] else ""))
    mem = r["memory"]
    lines.append(f"RAM: {_fmt_bytes(mem['ram_available_bytes'])} available of "
                 f"{_fmt_bytes(mem['ram_total_bytes'])}")
    ck = r.get("cpu_kernels") or {}
    if "recommendation" in ck:
        rec = ck["recommendation"]
        lines.append(f"CPU kernels: auto runs {ck['auto']}; µs a call, one thread, "
                     f"2048x2048, batch 1 and 8:")
        for t, per_batch in ck["timings_us"].items():
            lines.append(f"  {t}: " + "; ".join(
                f"{n}: " + ", ".join(f"{f} {us:g}" for f, us in row.items())
                for n, row in per_batch.items()))
        totals = ", ".join(f"{f} {us:g} µs" for f, us in rec["totals_us"].items())
        lines.append(f"  recommended: --cpu-kernels {rec['setting']} (in all: {totals})")
    elif ck:
        lines.append(f"CPU kernels: auto runs {ck['auto']} (not measured)")
    if "model" in r:
        m, f = r["model"], r["model"]["fetch"]
        lines += ["", f"model {m['name']}: no routed experts (a dense model): nothing to "
                  "offload, no expert crosses a link" if is_dense(f) else
                  f"model {m['name']}: {f['num_moe_layers']} MoE layers x {f['num_experts']} "
                  f"experts, top-{f['top_k']}, {f['expert_bytes'] / 2**20:.2f} MiB per expert "
                  f"({f['dtype']}), {_fmt_bytes(f['total_expert_bytes'])} of experts"]
        kv = m["kv_cache"]
        lines.append(
            f"  KV cache per token: {kv['bytes_per_token']['auto'] / 1024:.1f} KiB "
            f"({kv['compute_dtype']}), {kv['bytes_per_token']['int8'] / 1024:.1f} KiB with "
            f"--kv-cache-dtype int8; a full {kv['context_tokens']}-token context: "
            f"{_fmt_bytes(kv['context_bytes']['auto'])} / {_fmt_bytes(kv['context_bytes']['int8'])}")
        for h, b in ({} if is_dense(f) else m["decode_bytes_per_token"]).items():
            lines.append(f"  decode at hit rate {h}: {b / 1e6:.1f} MB per token")
        for row in [] if is_dense(f) else m["prefill_chunks"]:
            t = f", {row['fetch_s']:.3f} s at {m['link_gbps']:.1f} GB/s" if row["fetch_s"] else ""
            lines.append(f"  prefill chunk {row['chunk_tokens']:>5}: "
                         f"{row['distinct_experts_per_layer']:.2f} experts/layer, "
                         f"{_fmt_bytes(row['chunk_bytes'])}{t}")
        rec = m["recommendation"]
        lines += ["", f"recommended strategy: {rec['strategy']} — {rec['strategy_reason']}",
                  f"recommended cache: {rec['cache_slots'] or '-'} — {rec['cache_reason']}",
                  f"prefill ceiling: {rec['prefill_ceiling']} — {rec['prefill_reason']}"]
        # the guard's warnings are of offload: under another pick they are said to be
        hypothetical = "" if rec["strategy"] == "offload" else "if offload: "
        for w in rec["prefill_ceiling_if_offload"]["warnings"]:
            lines.append(f"  {hypothetical}warning: {w}")
    crashes = r["crash_reports"]
    expired = sum(1 for c in crashes if c.get("expired"))
    lines += ["", f"crash reports: {len(crashes)}" + (
        f" ({expired} older than {r.get('crash_report_max_age_days', 0):g} days: expired, ignored "
        "by the link guard)" if expired else "")]
    for c in crashes:
        age = f" ({c['age_days']:.0f} days old)" if c.get("age_days") is not None else ""
        lines.append(f"  {c['file']}: {_named(c)}{age}"
                     + (" — expired, ignored" if c.get("expired") else ""))
    drills = r.get("drill_reports") or []
    if drills:
        lines += ["", f"fault drills: {len(drills)} (--fault-inject; no device faults, ignored "
                  "by the link guard)"]
        lines += [f"  {c['file']}: {c['classification']} drill" + (
            f": {c['message']}" if c["message"] else "") for c in drills]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory, GGUF file, or 'demo'")
    parser.add_argument("--bundle", default=None, metavar="PATH",
                        help="also write a tar.gz to this file path")
    parser.add_argument("--server-url", default=None,
                        help="with --bundle: snapshot /metrics of this server into the bundle")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--no-measure", action="store_true", help="skip bandwidth measurement")
    parser.add_argument("--link-guard-window", type=float, default=DEFAULT_WINDOW_S,
                        help="seconds of expert fetch one prefill chunk may take, > 0 "
                             f"(default {DEFAULT_WINDOW_S:g})")
    parser.add_argument("--guard-loss-max-age-days", type=float, default=DEFAULT_LOSS_MAX_AGE_DAYS,
                        help="DeviceLost reports older than this no longer cap the prefill, "
                             f"> 0 (default {DEFAULT_LOSS_MAX_AGE_DAYS:g})")


def run_cli(args: argparse.Namespace) -> int:
    """`ftrs doctor`: print the report; write the bundle when asked. Exit 0 once the bundle
    is written, also when the `--server-url` snapshot failed (a warning on stderr says so, and
    the bundle's manifest why): a server that is gone is often why there is a bundle."""
    check_window_s(args.link_guard_window)
    check_loss_max_age_days(args.guard_loss_max_age_days)
    check_bundle_args(args.bundle, args.server_url)
    home = ftrs_home()
    report = build_report(args.model, home=home, measure=not args.no_measure,
                          window_s=args.link_guard_window,
                          max_loss_age_days=args.guard_loss_max_age_days)
    text = format_text(report)
    path = None
    if args.bundle:  # first: a bundle that cannot be written leaves stdout empty
        from ftrs.guard.bundle import write_bundle

        try:
            path = write_bundle(args.bundle, report, text, home=home, server_url=args.server_url)
        except OSError as e:
            raise ConfigError(f"doctor: cannot write --bundle {args.bundle} ({e.strerror or e}): "
                              "give a file path in a directory you can write to") from e
    if args.json:  # stdout is the JSON alone; the bundle's path is its "bundle" (null: none)
        print(json.dumps(report | {"bundle": str(path) if path else None}, indent=2,
                         default=str))
    else:
        print(text + (f"\n\nbundle: {path}" if path else ""))
    return 0


def check_bundle_args(bundle: str | None, server_url: str | None) -> None:
    """ConfigError for `--bundle` / `--server-url` mistakes found before the (slow) report: a
    directory given as the bundle's path, a parent that is a file or does not exist (it is not
    created), a URL with no bundle to go in."""
    if server_url is not None and not bundle:
        raise ConfigError("doctor: --server-url only snapshots /metrics into the bundle: add "
                          "--bundle PATH, or drop --server-url")
    if not bundle:
        return
    path = Path(bundle)
    if path.is_dir():
        raise ConfigError(f"doctor: --bundle {bundle} is a directory: give a file path, such as "
                          f"{path / 'ftrs-doctor.tar.gz'}")
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError(f"doctor: --bundle {bundle}: {parent} is a file, not a directory: give "
                          "a file path in a directory")
    if parent != path.absolute().parent:  # nothing is created on the user's behalf
        raise ConfigError(f"doctor: --bundle {bundle}: the directory {path.parent} does not "
                          "exist: create it first, or give a file path in an existing directory")
