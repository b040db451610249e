"""Fetch-volume model: how many expert bytes a model moves over the link per step.

For a model with `L` MoE layers of `E` routed experts, top-`k` routing, and `B` bytes per
(layer, expert) block (the unit of every transfer, alignment included, as `ftrs._core`'s
ExpertLayout computes it):

- decode, one token: `M = L · k · (1 − hit) · B` (DESIGN.md "Performance method");
- prefill chunk of `C` tokens: the offload strategy fetches each distinct expert of a layer
  once per chunk, so the chunk moves `L · D(C) · (1 − hit) · B`, where `D(C)` is the mean number
  of distinct experts per MoE layer for a chunk of `C` tokens.

`D(C)` comes from the router when measured (`OffloadStrategy.stats()["distinct_experts"]`
after a forward of `C` tokens; `measure_distinct_experts`), interpolated linearly between
measured chunk sizes and anchored at `D(1) = k`. Past the largest measured size, or with no
measurement, it is the uniform-routing formula `E · (1 − (1 − k/E)^C)`, never below the
largest measured value. `D` saturates at `E`: past a few dozen tokens (8 experts top-2: 16
tokens reach 99 %) a chunk moves every expert of every layer once, whatever its size.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ftrs.llm import LLM
    from ftrs.models.arch import ArchSpec
    from ftrs.models.experts import ExpertFormat

logger = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}


def uniform_distinct(num_experts: int, top_k: int, chunk_tokens: int) -> float:
    """Expected distinct experts per layer for `chunk_tokens` uniformly routed tokens."""
    if chunk_tokens <= 0 or num_experts <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** chunk_tokens)


@dataclass(frozen=True)
class FetchModel:
    """Fetch volumes of one model in one encoding. Pure arithmetic; no tensors."""

    model: str
    #: Bytes of one (layer, expert) block, alignment included.
    expert_bytes: int
    num_moe_layers: int
    num_experts: int
    top_k: int
    #: How the pool stores the experts: the compute dtype, or the file's encoding ("Q4_K+Q6_K",
    #: "FP8_BLOCK", "MXFP4+float32" where biases stay plain).
    dtype: str = "bfloat16"
    #: (chunk tokens, mean distinct experts per MoE layer), ascending in chunk tokens.
    measured: tuple[tuple[int, float], ...] = field(default=())

    @property
    def total_expert_bytes(self) -> int:
        """Every routed expert of every MoE layer: the most any one chunk can move."""
        return self.expert_bytes * self.num_moe_layers * self.num_experts

    def distinct_experts(self, chunk_tokens: int) -> float:
        """Mean distinct experts per MoE layer for one chunk (see the module doc)."""
        c = int(chunk_tokens)
        if c <= 0:
            return 0.0
        uniform = uniform_distinct(self.num_experts, self.top_k, c)
        if not self.measured:
            return uniform
        points = [(1, float(self.top_k)), *[(n, d) for n, d in self.measured if n > 1]]
        xs = [n for n, _ in points]
        if c >= xs[-1]:
            return min(float(self.num_experts), max(points[-1][1], uniform))
        i = bisect.bisect_right(xs, c)
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        return y0 + (y1 - y0) * (c - x0) / (x1 - x0)

    def prefill_chunk_bytes(self, chunk_tokens: int, hit_rate: float = 0.0) -> float:
        """Bytes one prefill chunk moves: `L · D(C) · (1 − hit) · B`."""
        return (self.num_moe_layers * self.distinct_experts(chunk_tokens) * (1.0 - hit_rate)
                * self.expert_bytes)

    def decode_bytes_per_token(self, hit_rate: float) -> float:
        """Missed bytes per decoded token: `L · k · (1 − hit) · B`."""
        return self.num_moe_layers * self.top_k * (1.0 - hit_rate) * self.expert_bytes

    def largest_chunk_within(self, budget_bytes: float, limit: int,
                             hit_rate: float = 0.0) -> int:
        """The largest `C` in [0, limit] whose chunk moves at most `budget_bytes` (0: none)."""
        lo, hi = 0, int(limit)
        if self.prefill_chunk_bytes(hi, hit_rate) <= budget_bytes:
            return hi
        while hi - lo > 1:  # invariant: bytes(lo) <= budget < bytes(hi); bytes is monotone
            mid = (lo + hi) // 2
            if self.prefill_chunk_bytes(mid, hit_rate) <= budget_bytes:
                lo = mid
            else:
                hi = mid
        return lo

    def with_measured(self, points: Iterable[tuple[int, float]]) -> FetchModel:
        ordered = tuple(sorted((int(n), float(d)) for n, d in points))
        return FetchModel(self.model, self.expert_bytes, self.num_moe_layers, self.num_experts,
                          self.top_k, self.dtype, ordered)

    def table(self, chunks: Sequence[int], hit_rate: float = 0.0) -> list[dict[str, Any]]:
        """Rows of (chunk tokens, distinct experts per layer, chunk bytes) for reports."""
        return [{"chunk_tokens": c, "distinct_experts_per_layer": round(self.distinct_experts(c), 3),
                 "chunk_bytes": self.prefill_chunk_bytes(c, hit_rate)} for c in chunks]

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "expert_bytes": self.expert_bytes,
                "num_moe_layers": self.num_moe_layers, "num_experts": self.num_experts,
                "top_k": self.top_k, "total_expert_bytes": self.total_expert_bytes,
                "measured_distinct": [list(p) for p in self.measured],
                "distinct_source": "router" if self.measured else "uniform formula"}


def expert_block_bytes(spec: ArchSpec, dtype: str,
                       formats: dict[int, ExpertFormat] | None = None) -> int:
    """Bytes of one expert block in the pool layout `ftrs._core` uses (alignment included):
    every tensor in `dtype`, or, where `formats` (per MoE layer, as the loader stores them:
    `safetensors_loader.expert_formats`) names a quantized type, in that encoding, its scales
    included; the mean over layers when layers store their experts differently."""
    from ftrs import _core
    from ftrs.quant.formats import tensor_bytes

    elt = DTYPE_BYTES[dtype]
    if formats is None:
        plain = [r * c * elt for r, c in spec.expert_shapes]
        layout = _core.ExpertLayout(max(1, len(spec.moe_layers)), max(1, spec.num_experts),
                                    plain)
        return int(layout.expert_bytes)
    sizes = [[r * c * elt if f.qtype is None else tensor_bytes(f.qtype, r, c, f.fp8_block)
              for (r, c), f in zip(spec.expert_shapes, formats[la], strict=True)]
             for la in spec.moe_layers]
    layout = _core.ExpertLayout(len(spec.moe_layers), spec.num_experts, sizes)
    return -(-int(layout.total_bytes) // (len(spec.moe_layers) * spec.num_experts))


def encoding_name(dtype: str, formats: dict[int, ExpertFormat] | None) -> str:
    """How the pool stores the experts, for reports: `dtype`, or the quantized types
    (`ftrs.quant`'s names: `FP8_BLOCK` is e4m3 with fp32 scales) and `dtype` for the tensors
    kept plain, joined by `+` as a GGUF's types are."""
    kinds = {f.qtype or dtype for fmt in (formats or {}).values() for f in fmt}
    quant = sorted(kinds - {dtype})
    return "+".join([*quant, dtype] if dtype in kinds else quant) or dtype


def fetch_model_from_spec(spec: ArchSpec, dtype: str = "bfloat16", model: str = "",
                          measured: Iterable[tuple[int, float]] = (),
                          formats: dict[int, ExpertFormat] | None = None) -> FetchModel:
    """The fetch model of a checkpoint's shapes (no weights needed); `formats`: the experts'
    encodings where the checkpoint keeps them quantized (`expert_block_bytes`)."""
    if not spec.is_moe:
        return FetchModel(model or spec.arch, 0, 0, 0, 0, dtype)
    fm = FetchModel(model or spec.arch, expert_block_bytes(spec, dtype, formats),
                    len(spec.moe_layers), spec.num_experts, spec.top_k,
                    encoding_name(dtype, formats))
    return fm.with_measured(measured)


def measure_distinct_experts(llm: LLM, chunks: Sequence[int], seed: int = 0
                             ) -> list[tuple[int, float]]:
    """Run one forward of each chunk size (random prompt tokens) through an offload `LLM` and
    read the router's distinct-expert counts per MoE layer from the strategy's stats."""
    import torch

    if "distinct_experts" not in llm.engine.expert_stats():
        raise ValueError("measure_distinct_experts needs an LLM with moe_strategy='offload'")
    gen = torch.Generator().manual_seed(seed)
    out: list[tuple[int, float]] = []
    for c in chunks:
        ids = torch.randint(0, llm.engine.vocab_size, (int(c),), generator=gen).tolist()
        llm.logits(ids)  # one forward of the whole chunk, whatever the step budget
        counts = llm.engine.expert_stats()["distinct_experts"]
        if counts:
            out.append((int(c), sum(counts) / len(counts)))
            logger.debug("chunk %d: %.2f distinct experts per MoE layer", c, out[-1][1])
    return out
