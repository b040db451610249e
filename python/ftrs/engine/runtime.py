"""Runtime: resolve device and dtype, choose the kernels, load the model, pick the MoE strategy,
size the KV cache."""

from __future__ import annotations

import logging

import torch

from ftrs.config import EngineConfig
from ftrs.engine.graphs import DecodeGraphs, build_graphs, why_off
from ftrs.errors import ConfigError
from ftrs.kernels import Kernels, select_kernels
from ftrs.kvcache import quant as kvquant
from ftrs.kvcache.state import state_bytes
from ftrs.layers.moe import Router
from ftrs.models.decoder import Decoder, KVCache, layer_router
from ftrs.models.load import load_model
from ftrs.moe.base import MoEStrategy, create_strategy, import_strategy

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_KV_TOKENS_CPU = 65536


def resolve_device(name: str) -> torch.device:
    """The compute device; a CUDA device always with its index ("cuda" and "auto": the current
    device), so every allocation, stream and probe can name it explicitly."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"device: unsupported {name!r} (cpu, cuda, cuda:N, auto)") from e
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device: unsupported {name!r} (cpu, cuda, cuda:N, auto)")
    if dev.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < count:
        raise ConfigError(f"device {name!r}: this machine has {count} CUDA device(s), "
                          f"cuda:0..cuda:{count - 1}")
    return torch.device("cuda", index)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]



def offload_options_set(config: EngineConfig) -> list[str]:
    """The expert-cache and link flags set away from their defaults (they act only when
    experts move: offload, hybrid)."""
    defaults = EngineConfig()
    return [f"--{name.replace('_', '-')}" for name in
            ("moe_cache_size", "moe_cache_rate", "moe_cache_policy", "copy_backend", "pcie_pacing")
            if getattr(config, name) != getattr(defaults, name)]

class Runtime:
    """Everything one forward pass needs, built once."""

    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.device = resolve_device(config.device)
        self.use_device()
        from ftrs import _core

        if config.cpu_expert_threads is not None:  # the Rust CPU kernels, whatever the strategy
            _core.quant_set_threads(config.cpu_expert_threads)
        # their family (process-wide, as the threads): a family this CPU lacks is a ConfigError
        _core.quant_set_kernel(config.cpu_kernels)
        self.dtype = resolve_dtype(config.dtype, self.device)
        # before the model loads, so `--kernels triton` where it cannot run fails at once;
        # `kernels.name` ("triton" | "cpu" | "torch") says which side runs
        self.kernels: Kernels = select_kernels(config.kernels, self.device)
        self.loaded = load_model(config.model, self.device, self.dtype, progress=progress)
        self.spec = self.loaded.spec
        self.moe: MoEStrategy | None = None
        if not self.spec.is_moe and config.moe_strategy == "offload":
            log.warning("%s is a dense model: --moe-strategy offload has no experts to move, "
                        "so everything stays on %s", config.model, self.device)
        if self.spec.is_moe:
            assert self.loaded.experts is not None
            strategy = "resident" if config.moe_strategy == "auto" else config.moe_strategy
            unused = offload_options_set(config) if strategy == "resident" else []
            if unused:
                log.warning("%s: for --moe-strategy offload or hybrid; resident keeps every "
                            "expert on %s and ignores them", ", ".join(unused), self.device)
            import_strategy(strategy)
            self.moe = create_strategy(strategy, experts=self.loaded.experts, device=self.device,
                                       config=config, routers=self._routers(),
                                       kernels=self.kernels)
        self.decoder = Decoder(self.spec, self.loaded.dense, self.moe, self.device, self.dtype,
                               kernels=self.kernels)
        self.max_model_len = min(config.max_model_len or self.spec.max_position_embeddings,
                                 self.spec.max_position_embeddings)
        if config.max_model_len is not None and config.max_model_len > self.max_model_len:
            log.warning("--max-model-len %d is more than the model's context: using %d tokens",
                        config.max_model_len, self.max_model_len)
        self.state_slots = config.max_running_requests  # one per running sequence
        kv_tokens = config.kv_tokens or self._kv_budget_tokens(config.kv_cache_dtype)
        self.num_pages = max(1, kv_tokens // config.page_size)
        if self.num_pages * config.page_size < self.max_model_len:  # what Engine allows a request
            log.info("context: %d tokens per request, limited by the KV pool (%s), not %d",
                     self.num_pages * config.page_size, f"--kv-tokens {config.kv_tokens}"
                     if config.kv_tokens else "sized from free memory", self.max_model_len)
        self.config = config
        self.kernels_name = self.kernels.name  # graphs need the Triton side (and CUDA)
        self.graphs_off = why_off(config, self.device, self.kernels_name, self.spec, self.moe)
        # with graphs, one page past the pool: where a bucket's padding rows write their keys
        self.has_scratch_page = self.graphs_off is None
        self.kv = KVCache.allocate(
            self.spec, (self.num_pages + self.has_scratch_page) * config.page_size, self.dtype,
            self.device, state_slots=self.state_slots, kv_cache_dtype=config.kv_cache_dtype)
        log.info("model %s: %s, %d layers, %s on %s, %s kernels; KV cache %d tokens (%s)",
                 config.model, self.spec.arch, self.spec.num_layers,
                 str(self.dtype).removeprefix("torch."), self.device, self.kernels.name,
                 self.num_pages * config.page_size,
                 "int8" if config.kv_cache_dtype == "int8" else "compute dtype")
        self.graphs: DecodeGraphs | None = self._capture_graphs()

    def _capture_graphs(self) -> DecodeGraphs | None:
        c = self.config
        return build_graphs(self.graphs_off, self.decoder, self.kv, c.max_running_requests,
                            c.page_size, min(self.max_model_len, self.num_pages * c.page_size),
                            scratch_page=self.num_pages)

    def replace_moe(self, strategy: MoEStrategy) -> MoEStrategy | None:
        """Route experts through `strategy` from the next forward on; returns the previous
        strategy. Decode graphs hold the old one's kernels: they are captured again for the
        new one (or turned off, with the reason)."""
        old = self.decoder.moe
        self.decoder.moe = self.moe = strategy
        if self.has_scratch_page:  # graphs were possible at startup
            self.graphs = None  # the old graphs' memory goes before the new capture
            self.graphs_off = why_off(self.config, self.device, self.kernels_name, self.spec,
                                      strategy)
            self.graphs = self._capture_graphs()
        return old

    def use_device(self) -> None:
        """Make the compute device current for the calling thread (CUDA's current device is
        per thread; kernels launched without a device argument, Triton's among them, go there)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _routers(self) -> dict[int, Router]:
        out: dict[int, Router] = {}
        for layer in self.spec.moe_layers:
            router = layer_router(self.loaded.dense, layer)
            assert isinstance(router.weight, torch.Tensor)  # invariant: never kept quantized
            out[layer] = router
        return out

    def _kv_budget_tokens(self, kv_cache_dtype: str) -> int:
        s = self.spec
        per_token = kvquant.model_bytes_per_token(s, self.dtype, kv_cache_dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            free -= state_bytes(s, self.state_slots, self.dtype)  # allocated beside the KV
            return max(1024, int(free * 0.5) // per_token)
        budget = 2 * 2**30  # 2 GiB of host memory for KV on the CPU device
        return max(1024, min(DEFAULT_KV_TOKENS_CPU, budget // per_token))

    def close(self) -> None:
        if self.moe is not None:
            self.moe.close()
