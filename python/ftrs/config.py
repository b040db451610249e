"""Configuration: frozen dataclasses, and the one place environment variables are read."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from ftrs.errors import ConfigError


def ftrs_home() -> Path:
    """`$FTRS_HOME`, default `~/.cache/ftrs`: the demo checkpoint, profiles and crash reports."""
    return Path(os.environ.get("FTRS_HOME") or Path.home() / ".cache" / "ftrs").expanduser()


def env_flag(name: str) -> str | None:
    """Read one `FTRS_*` variable. All other modules go through here."""
    return os.environ.get(name)


T = TypeVar("T")


def _opt(default: T, help: str) -> T:
    """A field's default and its one-line help (`add_engine_arguments`): one place for both."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to load a model and run it.

    Each field is also a CLI option (`moe_cache_size` <-> `--moe-cache-size`) and a keyword of
    `ftrs.LLM`.
    """

    # Each field's help (`_opt`) is its one-line `--help` text; a field whose default is None
    # says what unset means in it.
    model: str = _opt("demo", "model directory, GGUF file, or 'demo'")
    device: str = _opt("auto", "auto | cpu | cuda | cuda:N; auto: the GPU if there is one, else the CPU")
    dtype: str = _opt("auto", "auto | float32 | bfloat16 | float16; auto: bfloat16 on a GPU, float32 on the CPU")
    kernels: str = _opt("auto", "auto | torch | triton | cpu; auto: Triton on CUDA, the Rust ops on the CPU")
    cuda_graphs: bool = _opt(True, "replay decode steps as CUDA graphs where possible")
    moe_strategy: str = _opt("resident", "resident | offload | hybrid | auto; auto: the `ftrs bench strategy` profile's pick")
    moe_cache_size: int | None = _opt(None, "device expert slots (offload, hybrid); unset: --moe-cache-rate, else sized from free memory")
    moe_cache_rate: float | None = _opt(None, "fraction of all experts the device caches, (0, 1] (offload, hybrid); unset: sized from free memory")
    moe_cache_policy: str = _opt("lrfu", "lrfu | lru | lfru: the expert cache's eviction (ftrs-core cache.rs)")
    moe_prefetch: bool = _opt(True, "prefetch the experts a layer is predicted to route to (offload, hybrid)")
    copy_backend: str = _opt("auto", "auto | host | simulated:GBPS[:LAT_US] | cuda[:N]; auto: cuda on a GPU, else host")
    pcie_pacing: float | None = _opt(None, "GB/s the expert copies are paced to; unset or 0: off")
    cpu_expert_threads: int | None = _opt(None, "threads of the Rust CPU kernels (experts, quantized projections); unset: physical cores - 1")
    cpu_kernels: str = _opt("auto", "auto | portable | avx2 | avx512: the Rust CPU kernels' family (`ftrs doctor` measures)")
    torch_threads: int | None = _opt(None, "torch's CPU threads (process-wide); unset: torch's default")
    max_prefill_length: int = _opt(8192, "token budget of one step")
    decode_stall_target: float = _opt(1.0, "seconds a step with decodes may take: the prompt tokens that fit, measured; 0: the budget")
    max_running_requests: int = _opt(64, "requests running at once")
    page_size: int = _opt(16, "tokens per KV page, a power of two")
    kv_tokens: int | None = _opt(None, "KV pool capacity in tokens, at least --page-size; unset: sized from free memory")
    prefix_cache: bool = _opt(True, "reuse the KV pages of a prompt prefix served before (off always for models with linear attention layers)")
    kv_cache_dtype: str = _opt("auto", "auto | int8; auto: the compute dtype, int8: int8 rows with a scale per token and kv head")
    max_model_len: int | None = _opt(None, "context of one request, at most the model's own; unset: the model's own")
    seed: int = _opt(0, "seeds the engine's generator of seeds, which draws one for each request that brings none (a sampled request uses it); identical unseeded requests still differ")
    speculative_ngram: int = _opt(0, "draft tokens per decode from the request's own n-grams (engine/spec.py), 0..16; 0: off")
    hang_timeout: float = _opt(120.0, "seconds of pending work with no step finished before EngineHang")
    on_device_lost: str = _opt("exit", "exit | restart | cpu: what the server does on a device error")
    step_fault_limit: int = _opt(3, "failed steps in a row (not the device's) that restart the engine")
    engine_restarts: int = _opt(3, "engine restarts within --engine-restart-window; one more: exit 89")
    engine_restart_window: float = _opt(600.0, "seconds within which --engine-restarts are counted")
    fault_inject: str | None = _opt(None, "drill: KIND@step=N or KIND@after=Ts (ftrs.engine.faults); unset: none")
    guard_relax_after: float = _opt(600.0, "seconds of a quiet link before the adaptive guard steps back; 0: never")
    guard_loss_max_age_days: float = _opt(30.0, "days after which a DeviceLost crash report no longer caps the prefill")

    def __post_init__(self) -> None:
        self._check_types()
        if not 0 < self.hang_timeout < math.inf:  # nan too
            raise ConfigError(f"hang_timeout: must be a finite number of seconds > 0, got "
                              f"{self.hang_timeout}")
        if self.on_device_lost not in ("exit", "restart", "cpu"):
            raise ConfigError(f"on_device_lost: expected exit, restart or cpu, got {self.on_device_lost!r}")
        if self.step_fault_limit < 1:
            raise ConfigError(f"step_fault_limit: must be >= 1, got {self.step_fault_limit}")
        if self.engine_restarts < 0:
            raise ConfigError(f"engine_restarts: must be >= 0 (0: exit on the first engine "
                              f"death), got {self.engine_restarts}")
        if not 0 < self.engine_restart_window < math.inf:
            raise ConfigError(f"engine_restart_window: must be a finite number of seconds > 0, "
                              f"got {self.engine_restart_window}")
        if not 0 <= self.guard_relax_after < math.inf:
            raise ConfigError(f"guard_relax_after: must be a finite number of seconds >= 0 (0: "
                              f"never relax), got {self.guard_relax_after}")
        if not self.guard_loss_max_age_days > 0:  # nan too
            raise ConfigError(f"guard_loss_max_age_days: must be > 0, got {self.guard_loss_max_age_days}")
        if self.fault_inject is not None:
            from ftrs.engine.faults import parse_fault_spec

            parse_fault_spec(self.fault_inject)
        if self.cpu_kernels not in ("auto", "portable", "avx2", "avx512"):
            raise ConfigError(f"cpu_kernels: expected auto, portable, avx2 or avx512, got "
                              f"{self.cpu_kernels!r}")
        if self.cpu_expert_threads is not None and self.cpu_expert_threads < 1:
            raise ConfigError(f"cpu_expert_threads: must be >= 1, got {self.cpu_expert_threads}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ConfigError(f"torch_threads: must be >= 1, got {self.torch_threads}")
        if self.moe_strategy not in ("resident", "offload", "hybrid", "auto"):
            raise ConfigError(f"moe_strategy: unknown strategy {self.moe_strategy!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype: unknown dtype {self.dtype!r}")
        if self.kernels not in ("auto", "torch", "triton", "cpu"):
            raise ConfigError(f"kernels: expected auto, torch, triton or cpu, got {self.kernels!r}")
        if self.moe_cache_size is not None and self.moe_cache_size < 1:
            raise ConfigError(f"moe_cache_size: must be >= 1, got {self.moe_cache_size}")
        if self.moe_cache_rate is not None and not 0.0 < self.moe_cache_rate <= 1.0:
            raise ConfigError(f"moe_cache_rate: must be in (0, 1], got {self.moe_cache_rate}")
        if self.max_prefill_length < 1:
            raise ConfigError("max_prefill_length: must be >= 1")
        if not 0 <= self.decode_stall_target < float("inf"):
            raise ConfigError(f"decode_stall_target: must be >= 0 seconds (0: no bound), got "
                              f"{self.decode_stall_target}")
        if self.max_running_requests < 1:
            raise ConfigError("max_running_requests: must be >= 1")
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ConfigError(f"kv_cache_dtype: expected auto or int8, got {self.kv_cache_dtype!r}")
        if not 0 <= self.speculative_ngram <= 16:
            raise ConfigError(f"speculative_ngram: must be in [0, 16] (0: off), got "
                              f"{self.speculative_ngram}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size: must be a power of two, got {self.page_size}")
        if self.kv_tokens is not None and self.kv_tokens < self.page_size:
            raise ConfigError(f"kv_tokens: --kv-tokens {self.kv_tokens} is less than one KV page "
                              f"(--page-size {self.page_size} tokens): the pool needs at least "
                              f"{self.page_size} tokens (unset: sized from free memory)")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len: must be >= 1 (unset: the model's own), got "
                              f"{self.max_model_len}")
        if self.pcie_pacing is not None and not (math.isfinite(self.pcie_pacing)
                                                 and self.pcie_pacing >= 0):
            raise ConfigError(f"pcie_pacing: must be a rate in GB/s >= 0 (0 or unset: off), got "
                              f"{self.pcie_pacing}")
        # checked whatever the strategy: a typo must not wait for the day offload is chosen
        from ftrs._core import check_cache_policy, check_copy_backend

        if self.copy_backend != "auto":
            try:
                check_copy_backend(self.copy_backend)
            except ConfigError as e:
                raise ConfigError(f"copy_backend: {e}") from None
        try:
            check_cache_policy(self.moe_cache_policy)
        except ConfigError as e:  # the core also knows `belady`, an offline oracle only
            why = str(e) if "offline" in str(e) else (
                f"expected lrfu, lru or lfru, got {self.moe_cache_policy!r}")
            raise ConfigError(f"moe_cache_policy: {why}") from None

    def _check_types(self) -> None:
        """Each field holds its annotation's type (an int where a float is expected, not a
        bool where a number is): `LLM(moe_cache_rate="0.5")` is refused here, by name."""
        if isinstance(self.model, os.PathLike):  # LLM(Path("..."))
            object.__setattr__(self, "model", os.fspath(self.model))
        for f in fields(self):
            base, optional = _flag_type(f.type)
            v = getattr(self, f.name)
            if v is None and optional:
                continue
            ok = (isinstance(v, bool) if base is bool else
                  isinstance(v, base) and not isinstance(v, bool) if base is int else
                  isinstance(v, (int, float)) and not isinstance(v, bool) if base is float else
                  isinstance(v, base))
            if not ok:
                want = {int: "an integer", float: "a number", bool: "true or false",
                        str: "a string"}[base]
                raise ConfigError(f"{f.name}: must be {want}{' or None' if optional else ''}, "
                                  f"got {v!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown option(s): {', '.join(unknown)}")
        return cls(**kwargs)





def _flag_type(annotation: object) -> tuple[type, bool]:
    """(base type, optional) from a dataclass annotation string such as "int | None"."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "str")
    parts = [p.strip() for p in text.split("|")]
    names = [p for p in parts if p != "None"]
    base = {"int": int, "float": float, "str": str, "bool": bool}.get(names[0] if names else "", str)
    return base, "None" in parts


def add_engine_arguments(parser: Any, skip: tuple[str, ...] = ("model",)) -> None:
    """One CLI option per EngineConfig field (`moe_cache_size` -> `--moe-cache-size`).

    Options left out stay None on the namespace and keep the dataclass default.
    """
    import argparse

    group = parser.add_argument_group("engine options")
    for f in fields(EngineConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        typ, _ = _flag_type(f.type)
        if typ is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=None, help=option_help(f.name))
        else:
            group.add_argument(flag, dest=f.name, type=typ, default=None,
                               metavar=f.name.upper(), help=option_help(f.name))


def option_help(name: str) -> str:
    """The one-line `--help` of EngineConfig field `name`: its help (`_opt`) and its default,
    `on`/`off` for a switch; a field unset by default says what unset means in its help."""
    f = {f.name: f for f in fields(EngineConfig)}[name]
    text = str(f.metadata.get("help", ""))
    if f.default is None:
        return text.replace("%", "%%")
    default = ("on" if f.default else "off") if isinstance(f.default, bool) else f.default
    return f"{text} (default: {default})".replace("%", "%%")


def engine_config_from_args(args: Any) -> EngineConfig:
    """EngineConfig from parsed args: only options given on the command line override defaults."""
    kwargs: dict[str, Any] = {}
    for f in fields(EngineConfig):
        value = getattr(args, f.name, None)
        if value is not None:
            kwargs[f.name] = value
    return EngineConfig.from_kwargs(**kwargs)


__all__ = ["EngineConfig", "add_engine_arguments", "engine_config_from_args", "env_flag", "ftrs_home",
           "option_help"]
