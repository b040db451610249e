"""The MoE strategy interface and its registry.

A strategy computes the routed experts of one MoE layer from the router's choice. The decoder
routes (`layers.moe.route`) and hands over ids and weights; the strategy decides where expert
weights come from (resident on the device, streamed from the host pool, ...).

Invariant every strategy keeps: the result is the selected experts' contributions
(`layers.moe.expert_contribution`, computed in any order) added up in ascending id
(`layers.moe.accumulate`), as `combine_experts` does, so all strategies agree bit for bit with
`resident`.

Factories take keyword arguments: `experts`, `device`, `config`, `routers` (MoE layer ->
`layers.moe.Router`, or a bare router weight for a plain softmax router), and `kernels` (a
`ftrs.kernels.Kernels`; with Triton ones a strategy computes the layers it can through the
fused MoE kernel, `moe.fused`; None or the torch references: the per-expert path).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ftrs.errors import ConfigError


class GraphSupport(NamedTuple):
    """How a strategy's layer goes into a decode CUDA graph (`engine/graphs.py`).

    - "step": `device_step` is pure device work of static shapes with no host read, no host-side
      state that must change per step, no allocation whose size depends on the data; the whole
      decode step is one graph.
    - "layer": the layer needs a host step first (slot lookup, waiting for copies, waves):
      the graph is split at every MoE layer, `host_step` runs between the segments, and the
      captured `device_step` reads what it wrote (e.g. a static device slot table).
    - "off": no graph; `why` says why (logged once at startup).
    """

    mode: str  # "step" | "layer" | "off"
    why: str = ""


class MoEStrategy(ABC):
    """Computes routed experts; one instance serves every MoE layer of a model."""

    name: str = "?"

    @abstractmethod
    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """`x`: (tokens, hidden); `ids`, `weights`: (tokens, k). Returns (tokens, hidden)."""

    def begin_forward(self, num_tokens: int) -> None:
        """Called before the first layer of a forward pass."""

    def end_forward(self) -> None:
        """Called after the last layer of a forward pass."""

    def graph_support(self) -> GraphSupport:
        """Whether decode steps may run as CUDA graphs with this strategy, and how."""
        return GraphSupport("off", f"the {self.name} MoE strategy declares no CUDA graph support")

    def host_step(self, layer: int, ids: torch.Tensor, weights: torch.Tensor, rows: int,
                  x: torch.Tensor) -> None:
        """"layer" mode: the data-dependent part of `forward`, run outside any graph, between the
        segment that routed `layer` and the one that computes it. `x` is the layer's input (the
        tensor `device_step` gets: a prediction of the next layer's experts may read it). Only
        the first `rows` rows of `x`/`ids`/`weights` are real (the rest pad a graph bucket:
        their experts must not be fetched). It may read `ids` on the host and wait for copies;
        it must leave everything `device_step` reads ready on the current stream
        (stream-ordered writes only), and must not let the transfer engine rewrite a slot that
        the previous segment may still read. The runner calls `end_forward` after the last
        segment, outside any graph."""

    def device_step(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
        """The part of `forward` a graph captures ("step" and "layer" modes). Default: `forward`
        (right for a "step" strategy whose forward is already sync-free)."""
        return self.forward(layer, x, ids, weights)

    def stats(self) -> dict[str, Any]:
        """Counters for the step record (empty for strategies that move nothing)."""
        return {}

    def close(self) -> None:
        """Release threads and memory; the strategy is unusable afterwards."""


_REGISTRY: dict[str, Callable[..., MoEStrategy]] = {}


def register(name: str) -> Callable[[Callable[..., MoEStrategy]], Callable[..., MoEStrategy]]:
    def deco(factory: Callable[..., MoEStrategy]) -> Callable[..., MoEStrategy]:
        _REGISTRY[name] = factory
        return factory

    return deco


def import_strategy(name: str) -> None:
    """Import the module of a built-in strategy, which registers it."""
    import importlib

    if name in ("resident", "offload", "hybrid"):
        importlib.import_module(f"ftrs.moe.{name}")


def create_strategy(name: str, **kwargs: Any) -> MoEStrategy:
    if name not in _REGISTRY:
        raise ConfigError(f"moe_strategy: unknown {name!r} (known: {', '.join(sorted(_REGISTRY))})")
    return _REGISTRY[name](**kwargs)
