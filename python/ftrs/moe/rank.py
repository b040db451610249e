"""Ranking a MoE layer's likeliest experts on the host, for prefetch.

`rank_on_host` routes rows already in host memory through a softmax router and ranks the
experts by their summed weight: what `OffloadStrategy._predict` does on the device with torch,
without a device round trip. Hybrid's decode-graph host step reads the real rows back once (its
CPU share needs them) and predicts the next layer's experts from them here; offload's, and a
GPU's decode-sized eager layers, copy the rows back for it (`OffloadStrategy._predict`): the
device path costs its launches and two read-backs a layer. For a decode step's few rows and
experts the top-k and softmax run in plain Python, the logits in numpy.

Tests: tests/moe/test_offload.py (against torch's `route` and the device ranking).
"""

from __future__ import annotations

import heapq
import math

import numpy as np
import torch

#: `rank_on_host` ranks in plain Python up to this many logits (rows x experts), numpy above.
RANK_PY_LOGITS = 256


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
