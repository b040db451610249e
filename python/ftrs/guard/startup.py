"""The link guard at `ftrs serve` start: resolve `--moe-strategy auto`, then cap the prefill.

`resolve_auto_config(config)` is the one resolution of `--moe-strategy auto`: the matching
`ftrs bench strategy` profile's pick, else a stated assumption, logged at INFO either way
(`auto: ...`; `resolve_auto_line` also returns the line, which `ftrs.LLM` keeps as
`auto_line`). `ftrs serve` runs it inside `apply_link_guard`; `ftrs generate` and `ftrs.LLM`
run it before the engine is built, so all three run what the profile picked.

`apply_link_guard(config, ...)` returns the config to run with and the guard's decision; the
server logs the decision, puts `decision.to_dict()` in `/health` and sets
`ftrs_prefill_cap_tokens` from `config.max_prefill_length`. The expert cache's share of all
experts is the rule's hit-rate bound `H` (`cache_hit_bound`; a cache sized from free memory
at load counts no hits, and the guard says so), and a hybrid engine on a CPU
device moves nothing over a link (`guard.policy`, rule 0). Only the model's config.json or
GGUF header is read, with the safetensors headers of a checkpoint whose experts may be
quantized (FP8, NVFP4, gpt_oss' MXFP4: `model_fetch`), no weights; the link is probed through
sysfs/NVML, and on a GPU the H2D bandwidth is measured once through the copy engine. With
`copy_backend=simulated:GBPS` the simulated bandwidth is the link's. Crash reports are aged
at `now` (the wall clock unless given) against `config.guard_loss_max_age_days`: older
DeviceLost reports are listed as expired and cap nothing.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from ftrs.config import EngineConfig, ftrs_home
from ftrs.errors import ModelLoadError
from ftrs.guard.fetch import FetchModel, fetch_model_from_spec
from ftrs.guard.link import LinkState, cuda_index, cuda_pci_address, measure_link, probe_link
from ftrs.guard.policy import (
    DEFAULT_WINDOW_S,
    GuardDecision,
    check_window_s,
    decide_prefill_cap,
)
from ftrs.guard.profile import AutoChoice, profile_key, resolve_auto_strategy
from ftrs.health.crash import CrashReport, list_crash_reports, load_crash_report

if TYPE_CHECKING:
    from ftrs.models.arch import ArchSpec

logger = logging.getLogger(__name__)


def model_spec(model: str) -> ArchSpec:
    """A checkpoint's `ArchSpec` from its config.json or its GGUF header, no weight read."""
    from ftrs.models.arch import arch_from_config, load_arch
    from ftrs.models.load import resolve_model

    path = resolve_model(model)
    if path.is_file() and path.suffix == ".gguf":
        from ftrs.models.gguf_loader import open_gguf

        return arch_from_config(open_gguf(path).config, str(path))
    if not path.is_dir():
        raise ModelLoadError(str(path), "expected a checkpoint directory or a GGUF file")
    return load_arch(path)


def model_fetch(model: str, device: str, dtype: str) -> FetchModel:
    """The fetch model of a checkpoint, its experts sized as the host pool stores them: a GGUF's
    from its header, a directory's from its config.json in the dtype it will run in, or, where
    the files keep them quantized (FP8, NVFP4, MXFP4), in that encoding, read from the
    safetensors headers (no weight data)."""
    from ftrs.models.arch import load_arch
    from ftrs.models.load import resolve_model
    from ftrs.models.safetensors_loader import expert_formats

    path = resolve_model(model)
    if path.is_file() and path.suffix == ".gguf":  # experts in the file's encoding
        from ftrs.models.gguf_loader import gguf_fetch_model

        return gguf_fetch_model(path)
    if not path.is_dir():
        raise ModelLoadError(str(path), "neither a checkpoint directory nor a GGUF file")
    spec = load_arch(path)
    if dtype == "auto":
        dtype = "float32" if device == "cpu" else "bfloat16"
    return fetch_model_from_spec(spec, dtype, model=path.name,
                                 formats=expert_formats(path, spec))


def simulated_link(spec: str) -> LinkState:
    """A LinkState for `simulated:GBPS[:LAT_US]`: the simulated bandwidth, no PCIe figures."""
    gbps = float(spec.split(":")[1])
    return LinkState(device="cpu", measured_h2d_gbps=gbps, measured_backend=spec)


def current_link(config: EngineConfig, *, sysfs_root: str | Path = "/sys",
                 measure: bool = True) -> LinkState:
    if config.copy_backend.startswith("simulated"):
        return simulated_link(config.copy_backend)
    # `cuda:N`: that GPU's link, measured on it; otherwise the first GPU's, measured on the
    # current device
    index = cuda_index(config.device)
    bdf = None if index is None else cuda_pci_address(index)
    link = probe_link(bdf, sysfs_root=sysfs_root, under_load=False)
    if measure and link.device == "cuda" and config.device != "cpu":
        backend = None if index is None else f"cuda:{index}"
        link = measure_link(link, backend, sysfs_root=sysfs_root)
    return link


#: The unreadable crash reports already warned about, as their warnings: once each a process
#: (a restarted engine's guard and the doctor's sections read the same files again).
_SKIPPED: set[str] = set()


def load_reports(home: Path) -> list[CrashReport]:
    """The crash reports under `home`, oldest first; one that does not read (`load_crash_report`)
    is skipped with a warning, given once a process."""
    out = []
    for p in list_crash_reports(home):
        try:
            out.append(load_crash_report(p))
        except ValueError as e:
            if str(e) not in _SKIPPED:
                _SKIPPED.add(str(e))
                logger.warning("skipping %s", e)
    return out


def resolve_auto(config: EngineConfig, fetch: FetchModel, link: LinkState,
                 home: Path) -> AutoChoice:
    from ftrs.guard.bench_strategy import device_name, link_id, model_id

    budget = None
    if link.device == "cuda" and config.device != "cpu":
        import torch

        free, _ = torch.cuda.mem_get_info(cuda_index(config.device))
        budget = int(free * 0.6)
    key = profile_key(device=device_name(config.device), host=socket.gethostname(),
                      model=model_id(config.model), link=link_id(config.copy_backend))
    return resolve_auto_strategy(key, total_expert_bytes=fetch.total_expert_bytes,
                                 device_budget_bytes=budget, home=home)


def expert_fetch(config: EngineConfig) -> FetchModel | None:
    """The fetch model of `config.model` when it is a checkpoint directory or a GGUF file;
    None when it does not resolve (the engine reports the load failure itself) or is neither
    (it moves no experts)."""
    from ftrs.models.load import resolve_model

    try:
        path = resolve_model(config.model)
    except ModelLoadError:
        return None
    if not path.is_dir() and path.suffix != ".gguf":
        return None
    return model_fetch(config.model, config.device, config.dtype)


def resolve_auto_config(config: EngineConfig, *, home: Path | None = None,
                        fetch: FetchModel | None = None, link: LinkState | None = None,
                        sysfs_root: str | Path = "/sys") -> EngineConfig:
    """`config` with `--moe-strategy auto` replaced by what it runs, the choice logged
    (`resolve_auto_line`)."""
    return resolve_auto_line(config, home=home, fetch=fetch, link=link,
                             sysfs_root=sysfs_root)[0]


def resolve_auto_line(config: EngineConfig, *, home: Path | None = None,
                      fetch: FetchModel | None = None, link: LinkState | None = None,
                      sysfs_root: str | Path = "/sys") -> tuple[EngineConfig, str | None]:
    """(`config` with `--moe-strategy auto` replaced by what it runs, the `auto: ...` line
    logged at INFO). It runs the profile's pick and cache rate, else the assumption
    `resolve_auto_strategy` states; a cache size or rate the user gave is kept, and the line
    says so. Any other strategy, a model with no routed experts, or one that does not load:
    (config unchanged, None); the engine runs auto as resident there. `fetch` and `link`: the
    caller's, when it has them (the link needs no bandwidth measurement here: only whether it
    is a GPU's)."""
    if config.moe_strategy != "auto":
        return config, None
    fetch = fetch or expert_fetch(config)
    if fetch is None or not fetch.num_experts:
        return config, None
    link = link or current_link(config, sysfs_root=sysfs_root, measure=False)
    choice = resolve_auto(config, fetch, link, home or ftrs_home())
    given = given_cache_option(config)
    if given is None or choice.cache_rate is None:
        logger.info("%s", choice.message)
        return dataclasses.replace(config, moe_strategy=choice.strategy,
                                   moe_cache_rate=choice.cache_rate
                                   if choice.cache_rate is not None
                                   else config.moe_cache_rate), choice.message
    line = (f"{choice.message}; runs {choice.strategy} with the given {given}, not the cache "
            f"rate {choice.cache_rate:g}")
    logger.info("%s", line)
    return dataclasses.replace(config, moe_strategy=choice.strategy), line


def given_cache_option(config: EngineConfig) -> str | None:
    """The expert cache size the user gave (`--moe-cache-size N` or `--moe-cache-rate R`), as
    they wrote it; None when the cache is left to be sized. A given size or rate is kept under
    `auto`: the profile then picks only the strategy."""
    if config.moe_cache_size is not None:
        return f"--moe-cache-size {config.moe_cache_size}"
    if config.moe_cache_rate is not None:
        return f"--moe-cache-rate {config.moe_cache_rate:g}"
    return None


def cache_hit_bound(config: EngineConfig, fetch: FetchModel) -> float:
    """The policy's `H`: the share of all experts the device cache has slots for, from
    `--moe-cache-size` or `--moe-cache-rate`; 0 when the cache is sized from free memory at
    load (not known here: the guard is told so, `hits_unknown`, and says it counted no hits)."""
    total = fetch.num_moe_layers * fetch.num_experts
    if config.moe_cache_size is not None and total:
        return min(1.0, config.moe_cache_size / total)
    return min(1.0, config.moe_cache_rate or 0.0)


def runs_on_cpu(device: str) -> bool:
    """The engine computes on the CPU: `--device cpu`, or `auto` without a usable GPU."""
    if device != "auto":
        return device == "cpu"
    import torch

    return not torch.cuda.is_available()


def apply_link_guard(
    config: EngineConfig, *, explicit_max_prefill: bool, no_link_guard: bool = False,
    window_s: float = DEFAULT_WINDOW_S, home: Path | None = None,
    sysfs_root: str | Path = "/sys", measure: bool = True, now: dt.datetime | None = None,
) -> tuple[EngineConfig, GuardDecision | None]:
    """(config to serve with, decision). Logs the auto choice and the decision. A window that
    is not a finite number of seconds > 0 is a ConfigError (`--link-guard-window`).

    A checkpoint that is neither a directory nor a GGUF file moves no experts: no decision.
    """
    window_s = check_window_s(window_s)
    home = home or ftrs_home()
    fetch = expert_fetch(config)
    if fetch is None:
        return config, None
    link = current_link(config, sysfs_root=sysfs_root, measure=measure)
    config = resolve_auto_config(config, home=home, fetch=fetch, link=link)
    decision = decide_prefill_cap(
        link, fetch, requested=config.max_prefill_length, crash_reports=load_reports(home),
        window_s=window_s, strategy=config.moe_strategy, explicit_request=explicit_max_prefill,
        no_link_guard=no_link_guard, now=now or dt.datetime.now(dt.timezone.utc),
        max_loss_age_days=config.guard_loss_max_age_days,
        hit_rate=cache_hit_bound(config, fetch), device_is_cpu=runs_on_cpu(config.device),
        hits_unknown=given_cache_option(config) is None)
    decision.log(logger)
    if decision.cap_tokens is not None:
        config = dataclasses.replace(config, max_prefill_length=decision.cap_tokens)
    return config, decision
