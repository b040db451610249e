"""What `ftrs serve` does once its engine died: `install_policy(client, server, policy)`.

Of a device error, per `--on-device-lost`: `exit`: stop serving (in-flight clients already
have their typed error) and exit with the error's code (86/87/88). `cpu`: restart the engine on
the CPU (`cpu_fallback`) and keep serving; /health then says `"degraded": true`. `restart`:
restart on the same device only when a fresh probe says the device answers (`_device_answers`:
the PCI config space of the engine's own GPU; in a drill, the fake device as the drill left
it); otherwise behave as `exit`. Both restart through `schedule_restart` like any other
restart: the requests in flight keep the device error they met, and until the new engine is
ready /health says "restarting" (the cause, the restart count) and new requests get 503
`engine_restarted`.

Of a `ConfigError` or `ModelLoadError` of the first engine, before it ever served: exit at
once with its code (2, 3), one `ftrs serve: ...` line: a setting the preflight could not check
without the weights (docs/device-loss.md "Exit codes") fails every start alike, and a process
that can never serve must not look alive to a service manager.
Of anything else, once the engine had served (any exit, kill -9, `--step-fault-limit` failed
steps in a row, a restarted engine that fails to load), or of an exit without a report while
it first loads (the OOM killer): restart it on the same config after a backoff, the requests in
flight told `engine_restarted`. Every restart, of either kind, takes one from `RestartBudget`
(`--engine-restarts` within `--engine-restart-window` s); with none left a device error exits
with its own code and anything else with `EngineRestarted`'s, 89.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from ftrs.config import EngineConfig
from ftrs.errors import (
    ConfigError,
    DeviceError,
    DeviceLost,
    EngineRestarted,
    FtrsError,
    ModelLoadError,
)
from ftrs.server.errors import EngineUnavailable

logger = logging.getLogger(__name__)


BACKOFF_FIRST_S = 0.5  # the first restart's delay; doubled per restart in the window
BACKOFF_MAX_S = 8.0


class RestartBudget:
    """At most `limit` restarts within any `window_s` seconds; `take()` claims one."""

    def __init__(self, limit: int, window_s: float) -> None:
        self.limit = limit
        self.window_s = window_s
        self._times: list[float] = []

    def take(self, now: float | None = None) -> int | None:
        """Claim a restart: its number within the window (1-based), or None when none is left."""
        now = time.monotonic() if now is None else now
        self._times = [t for t in self._times if now - t < self.window_s]
        if len(self._times) >= self.limit:
            return None
        self._times.append(now)
        return len(self._times)


def backoff_s(attempt: int) -> float:
    """Delay before restart number `attempt` of the window: 0.5 s, 1 s, 2 s, ... at most 8 s."""
    return float(min(BACKOFF_FIRST_S * 2 ** (attempt - 1), BACKOFF_MAX_S))


def install_policy(client: Any, server: Any, policy: str, grace_s: float = 1.0) -> None:
    """Chain onto `client.on_failure`: act on a device error per `policy` (exit|restart|cpu),
    restart the engine after any other death of an engine that had served, both within the
    restart budget of `client.config`.

    `server` is the uvicorn.Server; an exit sets `server.should_exit` after `grace_s`, so the
    clients in flight receive their typed errors first.
    """
    previous = client.on_failure
    config = client.config
    budget = RestartBudget(getattr(config, "engine_restarts", 3),
                           getattr(config, "engine_restart_window", 600.0))

    def on_failure(err: FtrsError) -> None:
        if previous is not None:
            previous(err)
        if getattr(client, "state", None) in ("stopping", "stopped"):
            return  # stopped on request: no restart, the exit code stays the stop's
        if not isinstance(err, DeviceError):
            served = getattr(client, "ever_ready", False)
            if (not served and not getattr(client, "restarts", 0)
                    and isinstance(err, (ConfigError, ModelLoadError))):
                # the first engine refused its settings or its model: every start would do
                # the same, so exit with its code (2 or 3) rather than serve nothing
                logger.error("ftrs serve: %s", err.message)
                asyncio.get_running_loop().call_soon(_stop, server)
                return
            # A process that vanished mid-load (the OOM killer) is worth another try.
            if getattr(client, "state", None) == "failed" and (
                    served or isinstance(err, EngineUnavailable)):
                _restart_or_exit(client, server, budget, err, grace_s)
            return
        loop = asyncio.get_running_loop()
        action = policy
        if action == "restart" and not _device_answers(client.config, err):
            logger.error("on-device-lost restart: the device does not answer; exiting")
            action = "exit"
        attempt = budget.take() if action != "exit" else None
        if action != "exit" and attempt is None:
            logger.error("on-device-lost %s: %d restarts within %.0f s already; exiting", action,
                         budget.limit, budget.window_s)
            action = "exit"
        if action == "exit" or attempt is None:
            logger.error("ftrs serve: %s (%s); exiting with code %d", err.message, err.code,
                         err.exit_code)
            loop.call_later(grace_s, _stop, server)
            return
        config = client.config
        if action == "cpu":
            config = cpu_fallback(config)
        else:
            config = dataclasses.replace(config, fault_inject=None)
        delay = backoff_s(attempt)
        told = EngineRestarted(
            f"the device failed ({type(err).__name__}: {err.message}); restarting the engine on "
            f"{config.device} (restart {attempt} of at most {budget.limit} within "
            f"{budget.window_s:g} s)", evidence={"cause": _cause(err), "attempt": attempt,
                                                 "limit": budget.limit, "mode": action})
        logger.warning("on-device-lost %s: restarting the engine on %s in %.1f s", action,
                       config.device, delay)
        client.schedule_restart(told, delay, config=config, degraded={
            "reason": err.message, "code": err.code, "classification": type(err).__name__,
            "mode": action, "device": config.device})

    client.on_failure = on_failure


def cpu_fallback(config: EngineConfig) -> EngineConfig:
    """The config `--on-device-lost cpu` restarts with: the CPU device, no drill, and the
    `resident` strategy for a MoE: every expert is computed where the host pool holds it, in the
    checkpoint's own encoding (a quantized file's experts and projections stay quantized and run
    on the Rust kernels; `models.load`), with no slot cache or copy beside it (offload would copy
    host memory into host memory; hybrid on a CPU device computes as resident does). The expert
    cache and link options go back to their defaults: resident has no use for them, and the
    operator, who set them for the GPU, is not warned that they are ignored. `dtype` stays as
    given ("auto" resolves to float32 on the CPU)."""
    defaults = EngineConfig()
    return dataclasses.replace(
        config, device="cpu", fault_inject=None, moe_strategy="resident",
        **{name: getattr(defaults, name) for name in _LINK_OPTIONS})


#: The expert-cache and link options (`engine.runtime.offload_options_set`): only offload and
#: hybrid use them.
_LINK_OPTIONS = ("moe_cache_size", "moe_cache_rate", "moe_cache_policy", "copy_backend",
                 "pcie_pacing")


def _restart_or_exit(client: Any, server: Any, budget: RestartBudget, err: FtrsError,
                     grace_s: float) -> None:
    """The engine died of something not the device's: restart it after a backoff, or, with
    no restart left, exit 89 (`EngineRestarted`) so a service manager starts a fresh server."""
    cause = _cause(err)
    attempt = budget.take()
    if attempt is None:
        final = EngineRestarted(
            f"the engine failed ({type(err).__name__}: {err.message}) after {budget.limit} "
            f"restart(s) within {budget.window_s:g} s (--engine-restarts); the server exits",
            evidence={"cause": cause, "restarts": budget.limit})
        logger.error("ftrs serve: %s; exiting with code %d", final.message, final.exit_code)
        client.give_up(final)
        asyncio.get_running_loop().call_later(grace_s, _stop, server)
        return
    delay = backoff_s(attempt)
    told = EngineRestarted(
        f"the engine failed ({type(err).__name__}: {err.message}); restarting it "
        f"(restart {attempt} of at most {budget.limit} within {budget.window_s:g} s)",
        evidence={"cause": cause, "attempt": attempt, "limit": budget.limit})
    logger.error("engine failed: %s; restarting it in %.1f s (restart %d of at most %d)",
                 err.message, delay, attempt, budget.limit)
    client.schedule_restart(told, delay)


def _cause(err: FtrsError) -> dict[str, Any]:
    return {"type": type(err).__name__, "message": err.message, "code": err.code}


def _stop(server: Any) -> None:
    server.should_exit = True


def _device_answers(config: EngineConfig, err: DeviceError) -> bool:
    """Restart only when a fresh probe says the engine's device answers again.

    A drill (`--fault-inject`) asks its fake device, as the drill left it and as the
    classification read it from the drill's fake sysfs tree: a `device_lost` drill reads vendor
    0xffff (DeviceLost: gone), a kernel fault or a hang found it answering
    (`evidence.device_answers`). Off CUDA the device is the CPU, which answers. On a GPU: the
    PCI config space of the engine's own device, the `bdf` the classification names (the
    monitor watched the engine's `cuda:N`), else the host's only NVIDIA GPU; with several and no
    `bdf`, which one failed cannot be told: no restart."""
    if config.fault_inject is not None:
        return not isinstance(err, DeviceLost) and bool(err.evidence.get("device_answers"))
    if not config.device.startswith(("cuda", "auto")):
        return True
    from ftrs.health.result import Status
    from ftrs.health.sysfs import discover_nvidia_gpus, probe_pci

    bdf = err.evidence.get("bdf")
    if not isinstance(bdf, str) or not bdf:
        gpus = discover_nvidia_gpus()
        if not gpus and config.device == "auto":
            return True  # no GPU on this host: `auto` ran on the CPU
        if len(gpus) != 1:
            logger.error("on-device-lost restart: cannot tell which of %d GPU(s) the engine "
                         "used", len(gpus))
            return False
        bdf = gpus[0]
    return probe_pci(bdf).status in (Status.OK, Status.DEGRADED)


def exit_code_for(client: Any) -> int | None:
    """The code `ftrs serve` exits with: the failure's, unless the engine was restarted."""
    failure = getattr(client, "failure", None)
    return None if failure is None else int(failure.exit_code)


__all__ = ["RestartBudget", "backoff_s", "cpu_fallback", "exit_code_for", "install_policy"]
