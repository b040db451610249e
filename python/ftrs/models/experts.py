"""Routed-expert weights in the host expert pool (`ftrs._core.ExpertPool`).

The pool holds every (MoE layer, expert) as one contiguous block: gate, up, down back to back,
each aligned, in the layout computed by Rust. Torch reads it without a copy through the buffer
protocol; the resident strategy takes views (or one device copy), the offload strategy hands
the pool to the Rust transfer engine.

A tensor is stored in the compute dtype, or, for a quantized checkpoint, as the file's bytes
(`ftrs.quant`: GGUF blocks, or FP8 weights followed by their scales): the pool is then the size
of the file's experts, the link carries those bytes, and the views are `QuantTensor`s over the
region. A file may quantize one tensor differently in different layers (a `Q4_K_M` GGUF keeps
some layers' `down` in Q6_K): the layout then has per-layer tensor sizes, every block is its
layer's exact bytes (aligned), and each layer's views use that layer's type. Device slots are
sized for the largest block (`expert_bytes`); a transfer moves only its own layer's block.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from ftrs.layers.moe import ExpertAct, ExpertWeights
from ftrs.models.arch import ArchSpec
from ftrs.quant.formats import QuantTensor, tensor_bytes

_DTYPE_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class TensorFormat(NamedTuple):
    """How one expert tensor is stored: `qtype` None is the compute dtype, else a
    `ftrs.quant` type (with its FP8 tile for `FP8_BLOCK`)."""

    qtype: str | None = None
    fp8_block: tuple[int, int] | None = None


ExpertFormat = tuple[TensorFormat, ...]  # gate, up, down (and their biases, always plain)


class HostExperts:
    """All routed experts of a model in one aligned host region."""

    def __init__(self, spec: ArchSpec, dtype: torch.dtype,
                 formats: dict[int, ExpertFormat] | None = None) -> None:
        self.spec = spec
        self.dtype = dtype
        self.shapes = spec.expert_shapes
        self.layer_index = {layer: i for i, layer in enumerate(spec.moe_layers)}
        plain = tuple(TensorFormat() for _ in self.shapes)
        self.formats = {layer: (formats or {}).get(layer, plain) for layer in spec.moe_layers}
        self._elt = torch.tensor([], dtype=dtype).element_size()
        sizes = [[self.exact_bytes(layer, t) for t in range(len(self.shapes))]
                 for layer in spec.moe_layers]
        self.quantized = any(f.qtype is not None for fmt in self.formats.values() for f in fmt)
        from ftrs import _core

        self.layout = _core.ExpertLayout(len(spec.moe_layers), spec.num_experts, sizes)
        self.pool = _core.ExpertPool(self.layout, _DTYPE_NAME[dtype])

    def exact_bytes(self, layer: int, t: int) -> int:
        """Bytes of tensor `t` of one expert of model layer `layer` (no alignment)."""
        fmt = self.formats[layer][t]
        rows, cols = self.shapes[t]
        if fmt.qtype is None:
            return rows * cols * self._elt
        return tensor_bytes(fmt.qtype, rows, cols, fmt.fp8_block)

    @property
    def act(self) -> ExpertAct:
        """The activation every expert of this model applies."""
        s = self.spec
        return ExpertAct(s.expert_act, s.swiglu_alpha, s.swiglu_limit)

    @property
    def expert_bytes(self) -> int:
        """The largest (layer, expert) block, alignment included: the device slot stride, and
        the size of every transfer when all layers store their experts alike."""
        return int(self.layout.expert_bytes)

    def block_bytes(self, layer: int) -> int:
        """Bytes of one expert block of model layer `layer` (what a transfer of it moves)."""
        return int(self.layout.block_bytes(self.layer_index[layer]))

    @property
    def num_experts_total(self) -> int:
        return len(self.spec.moe_layers) * self.spec.num_experts

    def payload_bytes(self) -> int:
        """The experts' own bytes (what the checkpoint file holds), without padding."""
        return self.spec.num_experts * sum(self.exact_bytes(la, t) for la in self.spec.moe_layers
                                           for t in range(len(self.shapes)))

    def write(self, layer: int, expert: int, t: int, data: Any) -> None:
        """Store tensor `t` of (model layer, expert): its bytes in the layer's format (a buffer
        of exactly `exact_bytes(layer, t)` bytes). Only before the pool is handed to an engine."""
        raw = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        want = self.exact_bytes(layer, t)
        if raw.size != want:
            raise ValueError(f"expert tensor ({layer}, {expert}, {t}) is {want} bytes, "
                             f"got {raw.size}")
        self.pool.write(self.layer_index[layer], expert, t, raw)

    def fill_from_file(self, path: Path, entries: list[tuple[int, int, int, int, int]]) -> None:
        """Copies `(file offset, bytes, model layer, expert, t)` ranges of the file at `path` as
        they are (tensors already in the layer's format), in parallel, the GIL released. Only
        before the pool is handed to an engine."""
        for _, n, layer, expert, t in entries:
            if n != self.exact_bytes(layer, t):
                raise ValueError(f"expert tensor ({layer}, {expert}, {t}) is "
                                 f"{self.exact_bytes(layer, t)} bytes, got {n}")
        self.pool.fill_from_file(str(path), [(off, self.layer_index[layer], expert, t)
                                             for off, _, layer, expert, t in entries])

    def host_bytes(self) -> torch.Tensor:
        """The whole pool as a uint8 tensor, without a copy. Valid while `self` lives.

        Read only: while an engine holds the pool its buffer export is read-only, and torch,
        which has no read-only tensors, warns about that on every call; the warning is silenced
        here alone because nothing writes through this view (strategies read experts from it)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable",
                                    category=UserWarning)
            return torch.frombuffer(self.pool, dtype=torch.uint8)

    def block_views(self, region: torch.Tensor, base: int, layer: int | None = None
                    ) -> ExpertWeights:
        """Views of the tensors of the block that starts at byte `base` of `region`, in
        model layer `layer`'s formats (default: the first MoE layer's)."""
        key = self.spec.moe_layers[0] if layer is None else layer
        fmt = self.formats[key]
        out: list[Any] = []
        for t, (rows, cols) in enumerate(self.shapes):
            start = base + int(self.layout.tensor_offset(t, self.layer_index[key]))
            raw = region[start:start + self.exact_bytes(key, t)]
            qtype = fmt[t].qtype
            if qtype is None:
                out.append(raw.view(self.dtype).view(rows, cols))
            else:
                out.append(QuantTensor(qtype, (rows, cols), raw, fmt[t].fp8_block))
        return tuple(out)

    def views(self, region: torch.Tensor) -> dict[int, list[ExpertWeights]]:
        """Per model layer, per expert, the weight views into `region` (the pool or its device copy)."""
        res: dict[int, list[ExpertWeights]] = {}
        for layer, li in self.layer_index.items():
            res[layer] = [self.block_views(region, int(self.layout.offset(li, e, 0)), layer)
                          for e in range(self.spec.num_experts)]
        return res

    def slot_views(self, region: torch.Tensor, num_slots: int) -> dict[int, list[ExpertWeights]]:
        """Per model layer, the views of `num_slots` expert-sized slots of `region` in that
        layer's formats (layers with the same formats share one list)."""
        eb = self.expert_bytes
        by_format: dict[ExpertFormat, list[ExpertWeights]] = {}
        res: dict[int, list[ExpertWeights]] = {}
        for layer, fmt in self.formats.items():
            if fmt not in by_format:
                by_format[fmt] = [self.block_views(region, s * eb, layer) for s in range(num_slots)]
            res[layer] = by_format[fmt]
        return res
