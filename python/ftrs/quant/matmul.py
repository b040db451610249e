"""`matmul(x, w)`: y = x @ w.T for a plain or a quantized weight, on the CPU or a GPU.

- `torch.Tensor` weight: `F.linear`.
- `QuantTensor` on the CPU: the Rust kernel (`ftrs._core.quant_matmul`, computing from the
  blocks, GIL released; `quant_fp8_matmul` for FP8_BLOCK) when the extension has one for the
  type; otherwise the reference path:
  dequantize to fp32 with the torch dequantizers, then `F.linear`.
- `QuantTensor` on a GPU: dequantize into a temporary of the compute dtype on the device (the
  caching allocator hands the same memory back layer after layer: a scratch buffer), then
  `F.linear`. The link and the device slots still hold the quantized bytes.

`expert_ffn`: an expert's SiLU FFN (gate, up, SiLU times up, down) as one GIL-free Rust call when
its three weights are CPU `QuantTensor`s with kernels (`ftrs._core.quant_expert_ffn`); None
otherwise, and the caller takes the matmul path.

`layer_kernel_args` / `routed_experts_ffn`: a MoE layer whose experts are all such
`QuantTensor`s runs every routed expert in one call, grouped from the router's ids in Rust
(`ftrs._core.QuantExperts`, the layer's weights exported once at load): no sort, no
per-expert Python. Each expert's output times its
router weight is added to `out` in ascending expert id, as `layers.moe` adds them, so the result
is the same, bit for bit (`tests/moe/test_offload_quant.py` holds offload's per-expert path to it).

`use_kernels(False)` forces the reference path (tests compare the two).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Collection, Iterator, Sequence
from typing import Any, NamedTuple, Union

import numpy as np
import torch
import torch.nn.functional as F

from ftrs.quant.dequant import dequantize
from ftrs.quant.formats import FP8_BLOCK, TAIL_BYTES, QuantTensor

Weight = Union[torch.Tensor, QuantTensor]  # noqa: UP007 (a runtime alias, used in isinstance)
_state = {"kernels": True}


def _core_module() -> Any:
    """The extension, typed loosely: its quantized kernels may postdate the stub."""
    from ftrs import _core

    return _core


@functools.cache
def block_kernel_types() -> frozenset[str]:
    """The GGUF-style block types the Rust extension has CPU kernels for, matmul and the one-call
    expert FFNs alike (empty without any)."""
    core = _core_module()
    if not hasattr(core, "quant_matmul") or not hasattr(core, "quant_block_info"):
        return frozenset()
    from ftrs.quant.formats import GGUF_FORMATS
    from ftrs.quant.iquant import install_grids

    install_grids(core)  # the i-quants' tables, which the extension does not carry
    out = set()
    for name in GGUF_FORMATS:
        try:
            core.quant_block_info(name)
        except Exception:  # the extension says which types it knows by refusing the others
            continue
        out.add(name)
    return frozenset(out)


@functools.cache
def kernel_types() -> frozenset[str]:
    """The quantization types `matmul` computes from their bytes on the CPU with the Rust
    kernels: the block types, and FP8_BLOCK (its own matmul, `quant_fp8_matmul`)."""
    fp8 = {FP8_BLOCK} if hasattr(_core_module(), "quant_fp8_matmul") else set()
    return block_kernel_types() | fp8


@contextlib.contextmanager
def use_kernels(enabled: bool) -> Iterator[None]:
    """Within the block, quantized CPU matmuls use the Rust kernels (True) or the reference."""
    old = _state["kernels"]
    _state["kernels"] = enabled
    try:
        yield
    finally:
        _state["kernels"] = old


def _fp32_array(x: torch.Tensor) -> np.ndarray:
    """`x` as a contiguous fp32 numpy array, copied only when it has to be."""
    fp32 = x.dtype is torch.float32
    return (x if fp32 and x.is_contiguous() else x.to(torch.float32).contiguous()).numpy()


def _kernel_matmul(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    # The hot path of a quantized decode (ten calls per layer): no copy or cast that is not
    # needed, the weight's numpy view made once (`QuantTensor.host_array`), the output a numpy
    # array viewed as a tensor (one conversion, where `torch.empty` and `.numpy()` made two).
    rows, cols = w.shape
    xa = _fp32_array(x)
    out = np.empty((*xa.shape[:-1], rows), dtype=np.float32)
    if w.qtype == FP8_BLOCK:
        assert w.fp8_block is not None  # QuantTensor checks it
        _core_module().quant_fp8_matmul(w.host_array, xa, out, rows, cols, w.fp8_block)
    else:
        _quant_matmul()(w.qtype, w.host_array, xa, out, rows, cols)
    y = torch.from_numpy(out)
    return y if x.dtype is torch.float32 else y.to(x.dtype)


@functools.cache
def _quant_matmul() -> Any:
    return _core_module().quant_matmul


def expert_ffn(x: torch.Tensor, gate: Weight, up: Weight, down: Weight) -> torch.Tensor | None:
    """`down(silu(gate x) * up x)` for `x`: (n, hidden) fp32 on the CPU, in one kernel call; None
    when a weight is not a CPU `QuantTensor` the kernels read (or kernels are off)."""
    if not (isinstance(gate, QuantTensor) and isinstance(up, QuantTensor)
            and isinstance(down, QuantTensor) and _state["kernels"]):
        return None
    types = block_kernel_types()
    if (gate.qtype not in types or up.qtype not in types or down.qtype not in types
            or gate.device.type != "cpu" or up.device.type != "cpu" or down.device.type != "cpu"
            or x.dtype != torch.float32 or x.dim() != 2 or x.shape[0] == 0
            or not hasattr(_core_module(), "quant_expert_ffn")):
        return None
    inter, hidden = gate.shape
    if up.shape != gate.shape or down.shape != (hidden, inter) or x.shape[1] != hidden:
        raise ValueError(f"expert_ffn: x {list(x.shape)}, gate {list(gate.shape)}, up "
                         f"{list(up.shape)}, down {list(down.shape)} do not chain")
    x32 = x if x.is_contiguous() else x.contiguous()
    out = torch.empty_like(x32)
    _core_module().quant_expert_ffn(gate.qtype, gate.host_array, up.qtype, up.host_array,
                                    down.qtype, down.host_array, x32.numpy(), out.numpy(),
                                    hidden, inter)
    return out


class LayerKernelArgs(NamedTuple):
    """A MoE layer's experts as `quant_experts_ffn` reads them: per expert id, `(gate type,
    gate bytes, up type, up bytes, down type, down bytes)`; `inter` is the FFN's width;
    `handle`: the same, exported once (`_core.QuantExperts`; None in an older build)."""

    experts: list[tuple[str, Any, str, Any, str, Any]]
    inter: int
    handle: Any = None


def layer_kernel_args(experts: Sequence[Sequence[Weight]]) -> LayerKernelArgs | None:
    """The kernel arguments of a layer's experts (each `(gate, up, down)`, no biases) when every
    one is a CPU `QuantTensor` of a type the kernels read, with chaining shapes; else None."""
    types = block_kernel_types()
    if not types or not hasattr(_core_module(), "quant_experts_ffn"):
        return None
    args = []
    shape = None
    for w in experts:
        if len(w) != 3:
            return None
        for q in w:
            if not (isinstance(q, QuantTensor) and q.qtype in types and q.device.type == "cpu"):
                return None
        gate, up, down = w
        assert isinstance(gate, QuantTensor) and isinstance(up, QuantTensor) \
            and isinstance(down, QuantTensor)  # checked just above
        inter, hidden = gate.shape
        if up.shape != gate.shape or down.shape != (hidden, inter) \
                or shape not in (None, gate.shape):
            return None
        shape = gate.shape
        args.append((gate.qtype, gate.host_array, up.qtype, up.host_array, down.qtype,
                     down.host_array))
    if shape is None:
        return None
    core = _core_module()
    handle = (core.QuantExperts(args, shape[1], shape[0]) if hasattr(core, "QuantExperts")
              else None)
    return LayerKernelArgs(args, shape[0], handle)


def routed_experts_ffn(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       layer: LayerKernelArgs, out: torch.Tensor,
                       only: Collection[int] | None = None) -> list[tuple[int, int]] | None:
    """Adds every expert `ids` routes `x`'s rows to (SiLU FFN times the router weight) into
    `out`, in ascending id, in one kernel call; returns `(expert id, rows routed to it)` in
    that order. `only`: just these experts (a share of the layer's, the rest computed
    elsewhere). None (and `out` untouched) when the call does not apply: kernels off, or `x`,
    `weights`, `out` not contiguous fp32 CPU tensors."""
    if not (_state["kernels"] and x.dtype == weights.dtype == out.dtype == torch.float32
            and x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous()
            and out.is_contiguous() and out.shape == x.shape):
        return None
    if layer.handle is not None and only is None and ids.dtype == torch.int64 \
            and ids.is_contiguous() and weights.is_contiguous():
        got: list[tuple[int, int]] = layer.handle.forward(ids.numpy(), weights.numpy(), x.numpy(),
                                                          out.numpy())
        return got
    routed: dict[int, tuple[list[int], list[float]]] = {}
    for t, (es, ws) in enumerate(zip(ids.tolist(), weights.tolist())):
        for e, w in zip(es, ws):
            if only is not None and e not in only:
                continue
            r = routed.get(e)
            if r is None:
                routed[e] = r = ([], [])
            r[0].append(t)
            r[1].append(w)
    order = sorted(routed)
    if not order:
        return []
    _core_module().quant_experts_ffn([(*layer.experts[e], *routed[e]) for e in order],
                                     x.numpy(), out.numpy(), x.shape[1], layer.inter)
    return [(e, len(routed[e][0])) for e in order]


def embedding(ids: torch.Tensor, w: Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` of the (vocab, hidden) table `w`, in `dtype` (plain: `w`'s dtype). A quantized
    table (a tied embedding that the LM head reads in its file's format) decodes only the rows
    asked for: the gathered blocks are a small `QuantTensor` of their own."""
    if isinstance(w, torch.Tensor):
        return F.embedding(ids, w)
    if w.qtype == FP8_BLOCK:
        raise ValueError("embedding: an FP8 block-scaled table cannot be read by rows")
    flat = ids.reshape(-1)
    rows = w.rows_view().index_select(0, flat).reshape(-1)  # (n * row_bytes,) uint8
    if w.qtype in TAIL_BYTES:  # the tensor scale travels with the rows
        rows = torch.cat([rows, w.data[-TAIL_BYTES[w.qtype]:]])
    part = QuantTensor(w.qtype, (int(flat.numel()), w.shape[1]), rows)
    if part.shape[0] and part.device.type == "cpu" and _state["kernels"] \
            and w.qtype in block_kernel_types():
        out = torch.empty(part.shape, dtype=torch.float32)
        _core_module().quant_dequantize(w.qtype, rows.numpy(), out.numpy(), *part.shape, 1)
    else:
        out = dequantize(part, torch.float32)
    return out.to(dtype).view(*ids.shape, w.shape[1])


def matmul(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x`: (..., cols); `w`: (rows, cols). Returns (..., rows) in x's dtype."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    if w.shape[1] != x.shape[-1]:
        raise ValueError(f"matmul: x has {x.shape[-1]} columns, weight is {list(w.shape)}")
    if w.is_cpu and _state["kernels"] and w.qtype in kernel_types() and x.numel() > 0:
        y = _kernel_matmul(x, w)
        return y if bias is None else y + bias
    return F.linear(x, dequantize(w, x.dtype), bias)


def matmuls(x: torch.Tensor, ws: Sequence[Weight],
            biases: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """`[matmul(x, w, b) for w, b in zip(ws, biases)]`, the same values; when every `w` is a CPU
    block-type `QuantTensor` (a quantized layer's q, k and v), one kernel call computes them
    all: the binding is crossed once instead of once per weight."""
    types = block_kernel_types() if _state["kernels"] else frozenset()
    if not (x.numel() > 0 and len(ws) > 1 and all(
            isinstance(w, QuantTensor) and w.is_cpu and w.qtype in types
            and w.shape[1] == x.shape[-1] for w in ws)):
        return [matmul(x, w, b) for w, b in zip(ws, biases, strict=True)]
    xa = _fp32_array(x)
    outs = [np.empty((*xa.shape[:-1], w.shape[0]), dtype=np.float32) for w in ws]
    _core_module().quant_matmuls(xa, [(w.qtype, w.host_array, o, w.shape[0])  # type: ignore[union-attr]
                                      for w, o in zip(ws, outs, strict=True)], xa.shape[-1])
    ys = [torch.from_numpy(o) for o in outs]
    if x.dtype is not torch.float32:
        ys = [y.to(x.dtype) for y in ys]
    return [y if b is None else y + b for y, b in zip(ys, biases, strict=True)]
