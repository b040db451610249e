"""Ranking the next MoE layer's likeliest experts, for prefetch (`OffloadStrategy._predict`).

`NextLayerRanker.rank` routes this layer's rows through the next layer's router, as the model
routes (its biases and groups included), and ranks the experts by their summed weight, with
torch where the rows are or on the host. `rank_on_host`
is the host side: no device round trip. Hybrid's decode-graph host step reads the real rows
back once (its CPU share needs them) and ranks them here; offload's graph host step, and a
GPU's decode-sized eager layers, copy the rows back for it: the device path costs its launches
and two read-backs a layer. For a decode step's few rows and experts the top-k and softmax run
in plain Python, the logits in numpy.

Tests: tests/moe/test_offload.py (against torch's `route` and the device ranking).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from ftrs.layers.moe import Router, route, route_by

if TYPE_CHECKING:
    from ftrs.models.arch import ArchSpec

#: `rank_on_host` ranks in plain Python up to this many logits (rows x experts), numpy above.
RANK_PY_LOGITS = 256
#: A GPU batch of at most this many rows (the decode graphs' largest bucket) is ranked on the
#: host by default (`NextLayerRanker.rank`): <= 32 x hidden fp32 rows read back once.
HOST_RANK_ROWS = 32


def rank_on_host(x: torch.Tensor, router: np.ndarray, top_k: int) -> list[int]:
    """The experts a softmax router (`router`: experts x hidden, fp32) sends the rows of host
    fp32 `x` to, top `top_k` per row, ranked by their summed weight, heaviest first (ties:
    lower id first): `route` followed by the ranking `_predict` makes on the device, on the
    host. The logits by numpy; the rest, for a decode step's few rows and experts
    (`RANK_PY_LOGITS`), in plain Python: there a device's round trip, torch's and numpy's
    per-call overheads cost more than the work (measured inside hybrid's host step, between
    the CPU experts' kernel calls, which leave the caches cold)."""
    logits = x.numpy() @ router.T
    score: dict[int, float] = {}
    if logits.size <= RANK_PY_LOGITS:
        for row in logits.tolist():
            top = heapq.nlargest(top_k, range(len(row)), key=row.__getitem__)
            peak = row[top[0]]
            total = math.fsum(math.exp(v - peak) for v in row)
            for e in top:
                score[e] = score.get(e, 0.0) + math.exp(row[e] - peak) / total
    else:
        picked = np.argpartition(logits, -top_k, axis=1)[:, -top_k:]  # softmax keeps order
        high = logits.max(axis=1, keepdims=True)
        weight = (np.exp(np.take_along_axis(logits, picked, axis=1) - high)
                  / np.exp(logits - high).sum(axis=1, keepdims=True))
        for e, w in zip(picked.ravel().tolist(), weight.ravel().tolist()):
            score[e] = score.get(e, 0.0) + w
    return sorted((e for e, w in score.items() if w > 0), key=lambda e: (-score[e], e))


class NextLayerRanker:
    """Ranks a MoE layer's experts from the previous layer's rows through its router, for
    `OffloadStrategy._predict`: on the host (the routers copied there once, fp32) or with torch
    where the rows are. A plain softmax router ranks by `rank_on_host` on the host; one with a
    bias (gpt_oss) or grouped routing (DeepSeek: the correction bias and the groups decide the
    choice) by the model's own routing, `layers.moe.route_by`."""

    def __init__(self, routers: Mapping[int, Router | torch.Tensor], spec: ArchSpec) -> None:
        self.routers = {la: r if isinstance(r, Router) else Router(r) for la, r in routers.items()}
        self.spec = spec
        self.top_k = spec.top_k
        self.num_experts = spec.num_experts
        self._plain = spec.router == "softmax" and all(
            r.bias is None and r.correction is None for r in self.routers.values())
        self._host: dict[int, Router] = {}  # fp32 host copies of the routers

    def rank(self, layer: int, x: torch.Tensor, x_host: torch.Tensor | None = None,
             on_host: bool | None = None) -> list[int]:
        """`layer`'s experts for the rows `x`, heaviest summed weight first (ties: lower id).
        `x_host`: the same rows already in host memory (fp32), ranked there. Otherwise
        `on_host` says where: True copies `x` to the host (one read-back) and ranks there; None
        (the default) does so for a GPU's decode-sized batch (`HOST_RANK_ROWS`), where the
        device path's launches and its two read-backs cost more than copying the few rows;
        False, or a CPU device, ranks with torch where `x` is."""
        if on_host is None:
            on_host = x.is_cuda and x.shape[0] <= HOST_RANK_ROWS
        if x_host is None and on_host:
            x_host = x.to("cpu", torch.float32).contiguous()
        if x_host is not None:
            router = self._host.get(layer)
            if router is None:
                w, b, c = (None if t is None else t.detach().to("cpu", torch.float32)
                           for t in self.routers[layer])
                assert w is not None  # invariant: a router has a weight
                router = self._host[layer] = Router(w, b, c)
            if self._plain:
                return rank_on_host(x_host, router.weight.numpy(), self.top_k)
            x, chosen = x_host, router
        else:
            chosen = self.routers[layer]
        if self._plain:
            ids, w = route(x, chosen.weight, self.top_k, False)
        else:
            ids, w = route_by(self.spec, chosen, x)
        score = torch.zeros(self.num_experts, dtype=torch.float32, device=ids.device)
        score.index_add_(0, ids.flatten(), w.flatten().float())
        ranked = torch.argsort(score, descending=True, stable=True)
        return ranked[: int((score > 0).sum())].tolist()
