"""CUDA graphs for decode steps: one graph (or one per MoE segment) per batch-size bucket.

A decode step of a few sequences launches hundreds of small kernels; replayed as a CUDA graph
they cost one launch. A graph replays fixed kernels on fixed addresses, hence:
- Every input lives in a static buffer of its bucket (`StaticDecode`): token ids, positions,
  the KV slot of each new token, a block table and a context length per row. A step copies its
  rows in (`StaticDecode.fill`) and pads the rest of the bucket with inert rows: token 0 at
  position 0, whose key goes to a scratch page no sequence owns (one page past the page pool,
  allocated with the KV cache) and which attends to that page alone. Their outputs are
  dropped; they never write or read a real sequence's KV. Buckets: `graph_buckets`.
- The forward must be shape-static and sync-free: the Triton kernels on CUDA (paged attention
  through the block table), full attention layers only, and a MoE strategy that says how it
  fits (`MoEStrategy.graph_support`). Otherwise graphs are off with one log line saying why
  (`why_off`), and every step runs eagerly.
- A strategy in "layer" mode (its slot lookup and waves read the routing on the host) splits
  each bucket's graph at its MoE layers: segment 0 runs up to the first MoE layer's routing;
  then `host_step` runs outside the graph and writes what the next segment's captured
  `device_step` reads (a static device slot table); and so on. In "step" mode the whole step
  is one graph. The decoder is not changed for this: while a graph's forward runs or is
  captured, `decoder.moe` is a `_Seam` that cuts (or calls the host step) there.
- Segments of every bucket share one memory pool (`torch.cuda.graph_pool_handle`): only one
  runs at a time, in the order captured within a step, and each bucket's outputs stay
  referenced, so no segment can reuse memory another still has to read.

`CudaGraphs` captures each bucket, largest first, after warm-up runs on a side stream (JIT
compiles, lazy allocations), with `CUDAGraph.capture_begin(pool=...)`/`capture_end()` on that
stream. `EagerGraphs` is its CPU stand-in: the same static buffers, fill, padding, seam, host
steps and copy-out, with the captured function simply run (tests check the padding with it).
Anything the graph path does not take (prefill, mixed steps, batches past the largest bucket)
runs `Decoder.forward` as before.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ftrs.config import EngineConfig
from ftrs.engine.batch import Batch
from ftrs.kernels.attention import PagedMeta
from ftrs.layers.attention import AttnMetadata
from ftrs.models.arch import FULL_ATTENTION, ArchSpec
from ftrs.models.decoder import Decoder, KVCache
from ftrs.moe.base import GraphSupport, MoEStrategy
from ftrs.scheduler.scheduler import Work

log = logging.getLogger(__name__)

#: batch sizes a graph is captured for (capped by `max_running_requests`)
BUCKETS = (1, 2, 4, 8, 16, 32)
#: eager runs of each bucket's forward before its capture
WARMUP_RUNS = 2
#: other threads (grammar masks, the transfer engine's copies) keep using CUDA during capture
CAPTURE_ERROR_MODE = "thread_local"


def graph_buckets(max_running: int, sizes: Sequence[int] = BUCKETS) -> tuple[int, ...]:
    """The sizes below `max_running` and the cap itself (`max_running`, or the largest size):
    no bucket is bigger than the batch that can occur."""
    cap = min(max_running, max(sizes))
    return tuple(sorted({s for s in sizes if s < cap} | {cap}))


def pick_bucket(rows: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `rows` rows; None past the largest (or for no rows)."""
    if rows < 1:
        return None
    return next((b for b in sorted(buckets) if b >= rows), None)


NOT_CUDA = "the device is not CUDA"


def why_off(config: EngineConfig, device: torch.device, kernels: str, spec: ArchSpec,
            moe: MoEStrategy | None) -> str | None:
    """Why decode steps cannot run as CUDA graphs here; None when they can."""
    if not config.cuda_graphs:
        return "--no-cuda-graphs"
    if device.type != "cuda":
        return NOT_CUDA
    if kernels != "triton":
        return (f"the torch reference kernels are in use (--kernels {config.kernels}): their "
                "decode attention pads to the longest context, so shapes change every step")
    if any(spec.layer_type(i) != FULL_ATTENTION for i in range(spec.num_layers)):
        return "the model has sliding-window or linear attention layers (torch paths, not captured)"
    if spec.attention_sinks:
        return "the model's attention sinks run the torch path, not captured"
    if spec.mla is not None:
        return "the model's latent attention (MLA) runs the torch path, not captured"
    if moe is not None:
        support = moe.graph_support()
        if support.mode not in ("step", "layer"):
            return support.why or f"the {moe.name} MoE strategy does not support CUDA graphs"
    return None


class DecodeRows(NamedTuple):
    """What a decode-only step puts into a bucket: one row per sequence, in batch order."""

    input_ids: torch.Tensor  # (n,) int64 on the device
    positions: torch.Tensor  # (n,) int64 on the device
    slot_mapping: torch.Tensor  # (n,) int64 KV slot of each row's new token
    pages: list[list[int]]  # each row's pages covering its context
    ctx_len: list[int]  # keys each row attends to, its new token's included

    @property
    def num_rows(self) -> int:
        return len(self.pages)


def decode_rows(work: Sequence[Work], batch: Batch, page_size: int) -> DecodeRows | None:
    """The rows of `batch` when every row is one token of its own sequence (decode steps, and
    one-token chunks); None for steps with a longer chunk or with linear attention state."""
    meta = batch.meta
    if not meta.decode_only or meta.linear is not None or len(work) != batch.input_ids.numel():
        return None
    ctx = [seq.num_computed + 1 for seq, _ in work]
    pages = [seq.pages[: -(-c // page_size)] for (seq, _), c in zip(work, ctx)]
    return DecodeRows(batch.input_ids, batch.positions, meta.slot_mapping, pages, ctx)


class Split(NamedTuple):
    """A cut of a bucket's graph at a MoE layer: the host step between two segments reads
    these tensors, which the earlier segment writes on every replay."""

    layer: int
    ids: torch.Tensor  # (bucket, k) routing of the layer
    weights: torch.Tensor  # (bucket, k)
    x: torch.Tensor  # (bucket, hidden) the layer's input


@dataclass(slots=True)
class StaticDecode:
    """The static inputs and outputs of one bucket: the addresses its graph reads and writes."""

    rows: int
    page_size: int
    scratch_page: int  # a KV page no sequence owns: the padding rows' keys go there
    input_ids: torch.Tensor  # (rows,) int64
    positions: torch.Tensor  # (rows,) int64
    slot_mapping: torch.Tensor  # (rows,) int64
    block_table: torch.Tensor  # (rows, max_pages) int32
    ctx_len: torch.Tensor  # (rows,) int32
    paged: PagedMeta  # views of the buffers above, for the paged attention kernel
    out: torch.Tensor | None = None  # (rows, hidden): the captured forward's result
    splits: list[Split] = field(default_factory=list)
    segments: list[Any] = field(default_factory=list)  # captured graphs, in step order

    @classmethod
    def allocate(cls, rows: int, max_pages: int, page_size: int, scratch_page: int,
                 device: torch.device) -> StaticDecode:
        def longs() -> torch.Tensor:
            return torch.zeros(rows, dtype=torch.long, device=device)

        table = torch.zeros(rows, max_pages, dtype=torch.int32, device=device)
        ctx = torch.ones(rows, dtype=torch.int32, device=device)
        paged = PagedMeta(table, torch.arange(rows, dtype=torch.int32, device=device),
                          torch.ones(rows, dtype=torch.int32, device=device), ctx, 1, page_size)
        st = cls(rows, page_size, scratch_page, longs(), longs(), longs(), table, ctx, paged)
        st.fill(None)
        return st

    @property
    def max_pages(self) -> int:
        return self.block_table.shape[1]

    def fill(self, rows: DecodeRows | None) -> None:
        """Copy `rows` into the first rows of the buffers (stream-ordered copies) and make the
        others inert padding; None: padding only (warm-up and capture)."""
        n = 0 if rows is None else rows.num_rows
        if n > self.rows:
            raise ValueError(f"cuda graphs: {n} rows do not fit a bucket of {self.rows}")
        if rows is not None and n:
            width = max(len(p) for p in rows.pages)
            if width > self.max_pages:
                raise ValueError(f"cuda graphs: a context of {width} pages exceeds the "
                                 f"block table's {self.max_pages}")
            table = torch.zeros(n, width, dtype=torch.int32)
            for i, p in enumerate(rows.pages):
                table[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
            self.input_ids[:n].copy_(rows.input_ids)
            self.positions[:n].copy_(rows.positions)
            self.slot_mapping[:n].copy_(rows.slot_mapping)
            self.block_table[:n, :width].copy_(table)
            self.ctx_len[:n].copy_(torch.tensor(rows.ctx_len, dtype=torch.int32))
        if n < self.rows:  # token 0 at position 0, alone on the scratch page
            self.input_ids[n:].zero_()
            self.positions[n:].zero_()
            self.slot_mapping[n:].fill_(self.scratch_page * self.page_size)
            self.block_table[n:, 0].fill_(self.scratch_page)
            self.ctx_len[n:].fill_(1)

    def meta(self) -> AttnMetadata:
        """The step's attention metadata computed from the buffers with device ops of static
        shapes (so it is part of the captured work): the paged view for the kernel, and for the
        torch path every row's context slots over the full block table width, masked past its
        length (columns past a context may name stale pages: valid indices, masked out)."""
        ps = self.page_size
        col = torch.arange(self.max_pages * ps, device=self.block_table.device)
        gather = self.block_table.long()[:, col // ps] * ps + col % ps  # (rows, width) slots
        real = col < self.ctx_len.long()[:, None]
        return AttnMetadata(self.slot_mapping, self.paged.q_start.long(), gather,
                            real[:, None, None, :], decode_only=True, paged=self.paged)


#: what a seam calls at each MoE layer: (layer, ids, weights, x)
AtLayer = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


class _Seam(MoEStrategy):
    """Stands in for the decoder's strategy while a bucket's forward runs or is captured: at
    each MoE layer it calls `at_layer(layer, ids, weights, x)` ("layer" mode: cut the graph, or
    run the host step), then the strategy's capturable `device_step`. Its begin/end of forward
    do nothing: the runner calls the strategy's around each step, outside any graph."""

    def __init__(self, inner: MoEStrategy, at_layer: AtLayer | None) -> None:
        self.inner = inner
        self.name = inner.name
        self.at_layer = at_layer

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        if self.at_layer is not None:
            self.at_layer(layer, ids, weights, x)
        return self.inner.device_step(layer, x, ids, weights)


class DecodeGraphs(ABC):
    """Decode steps through per-bucket static buffers. The fill, padding, seam, host-step
    order and copy-out are here, shared by the CUDA graphs and the eager stand-in."""

    def __init__(self, decoder: Decoder, kv: KVCache, buckets: Sequence[int], page_size: int,
                 max_pages: int, scratch_page: int) -> None:
        self.decoder = decoder
        self.kv = kv
        self.moe = decoder.moe
        self.support = self.moe.graph_support() if self.moe is not None else GraphSupport("step")
        if self.support.mode not in ("step", "layer"):
            raise ValueError(f"cuda graphs: strategy mode {self.support.mode!r}")
        self.buckets = tuple(sorted(buckets))
        self.page_size = page_size
        self.device = decoder.device
        self.static = {b: StaticDecode.allocate(b, max_pages, page_size, scratch_page,
                                                self.device) for b in self.buckets}
        self.replays = 0  # steps run through a bucket

    @property
    def split(self) -> bool:
        """Whether each bucket's graph is cut at its MoE layers."""
        return self.moe is not None and self.support.mode == "layer"

    @contextmanager
    def _seam(self, at_layer: AtLayer | None) -> Iterator[None]:
        if self.moe is None:
            yield
            return
        self.decoder.moe = _Seam(self.moe, at_layer if self.split else None)
        try:
            yield
        finally:
            self.decoder.moe = self.moe

    def _host_steps(self, rows: int) -> AtLayer:
        moe = self.moe
        assert moe is not None

        def at_layer(layer: int, ids: torch.Tensor, weights: torch.Tensor,
                     x: torch.Tensor) -> None:
            moe.host_step(layer, ids, weights, rows, x)

        return at_layer

    def _forward(self, st: StaticDecode) -> torch.Tensor:
        """The function a bucket's graph holds: the decoder over the static buffers."""
        return self.decoder.forward(st.input_ids, st.positions, st.meta(), self.kv)

    def _eager(self, st: StaticDecode, rows: int) -> torch.Tensor:
        """`_forward` run, not captured: each host step runs in place, over `rows` real rows."""
        with self._seam(self._host_steps(rows) if self.moe is not None else None):
            return self._forward(st)

    def bucket_for(self, work: Sequence[Work], batch: Batch) -> int | None:
        """The bucket this step runs in; None: it runs eagerly."""
        if (not batch.meta.decode_only or batch.meta.linear is not None
                or batch.num_draft_tokens):  # a graph holds one row per sequence
            return None
        return pick_bucket(len(work), self.buckets)

    @torch.inference_mode()
    def run(self, work: Sequence[Work], batch: Batch) -> torch.Tensor:
        """The step's final hidden states (n, hidden), as `Decoder.forward` returns them, for a
        step `bucket_for` accepted."""
        rows = decode_rows(work, batch, self.page_size)
        bucket = pick_bucket(len(work), self.buckets)
        if rows is None or bucket is None:
            raise ValueError("cuda graphs: this step does not fit a graph bucket")
        st = self.static[bucket]
        n = rows.num_rows
        with self._on_device():
            st.fill(rows)
            if self.moe is not None:
                self.moe.begin_forward(num_tokens=n)
            self._replay(st, n)
            if self.moe is not None:
                self.moe.end_forward()
            assert st.out is not None  # invariant: every bucket was captured
            self.replays += 1
            return st.out[:n].clone()  # the buffer is rewritten by the next replay

    def capture(self) -> float:
        """Capture every bucket, largest first; returns the seconds it took."""
        t0 = time.perf_counter()
        with self._on_device(), torch.inference_mode():
            for b in sorted(self.buckets, reverse=True):
                st = self.static[b]
                st.fill(None)
                self._capture(st)
        return time.perf_counter() - t0

    def _replay(self, st: StaticDecode, rows: int) -> None:
        """Segment 0, then per split its host step and the next segment."""
        self._replay_segment(st.segments[0])
        for cut, seg in zip(st.splits, st.segments[1:], strict=True):
            assert self.moe is not None
            self.moe.host_step(cut.layer, cut.ids, cut.weights, rows, cut.x)
            self._replay_segment(seg)

    def _capture(self, st: StaticDecode) -> None:
        """Warm up, then capture `st`'s forward as segments cut at the MoE host steps."""
        self._warm_up(st)
        segments: list[Any] = []
        splits: list[Split] = []

        def cut(layer: int, ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor) -> None:
            self._end_segment(segments[-1])
            splits.append(Split(layer, ids, weights, x))
            segments.append(self._begin_segment())

        with self._capture_stream():  # every segment begins and ends on the capture stream
            segments.append(self._begin_segment())
            try:
                with self._seam(cut):
                    out = self._forward(st)
            except BaseException:
                self._abort_segment(segments[-1])
                raise
            self._end_segment(segments[-1])
        st.out, st.splits, st.segments = out, splits, segments

    @contextmanager
    def _on_device(self) -> Iterator[None]:
        yield

    @contextmanager
    def _capture_stream(self) -> Iterator[None]:
        yield

    def _warm_up(self, st: StaticDecode) -> None:
        for _ in range(WARMUP_RUNS):
            self._eager(st, 0)

    @abstractmethod
    def _begin_segment(self) -> Any:
        """Start capturing a new segment; returns its handle."""

    @abstractmethod
    def _end_segment(self, seg: Any) -> None:
        """Finish capturing `seg`."""

    def _abort_segment(self, seg: Any) -> None:
        """Leave capture after a failure inside it (errors here are secondary)."""
        try:
            self._end_segment(seg)
        except Exception:  # the capture was already invalidated: the first error is the one
            log.debug("cuda graphs: ending a failed capture raised", exc_info=True)

    @abstractmethod
    def _replay_segment(self, seg: Any) -> None:
        """Run a captured segment on the current stream."""


class CudaGraphs(DecodeGraphs):
    """Buckets captured as `torch.cuda.CUDAGraph`s sharing one memory pool."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        with torch.cuda.device(self.device):
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(self.device)

    @contextmanager
    def _on_device(self) -> Iterator[None]:
        with torch.cuda.device(self.device):
            yield

    def _warm_up(self, st: StaticDecode) -> None:
        # on a side stream, as capture will run (torch's documented pattern)
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            super()._warm_up(st)
        current.wait_stream(self.stream)
        torch.cuda.synchronize(self.device)

    @contextmanager
    def _capture_stream(self) -> Iterator[None]:
        # capture runs on a side stream; the fill before it ran on the current one
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)

    def _begin_segment(self) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self.pool, capture_error_mode=CAPTURE_ERROR_MODE)
        return g

    def _end_segment(self, seg: Any) -> None:
        seg.capture_end()

    def _replay_segment(self, seg: Any) -> None:
        seg.replay()


class EagerGraphs(DecodeGraphs):
    """The CPU stand-in: the static-buffer path of `CudaGraphs` with the forward run, not
    captured (the host steps run in place, in the order a replay runs them)."""

    def _capture(self, st: StaticDecode) -> None:
        self._warm_up(st)
        st.out, st.splits, st.segments = self._eager(st, 0), [], [None]

    def _replay(self, st: StaticDecode, rows: int) -> None:
        assert st.out is not None
        st.out.copy_(self._eager(st, rows))

    def _begin_segment(self) -> Any:  # pragma: no cover - never captures
        raise NotImplementedError

    def _end_segment(self, seg: Any) -> None:  # pragma: no cover
        raise NotImplementedError

    def _replay_segment(self, seg: Any) -> None:  # pragma: no cover
        raise NotImplementedError


def build_graphs(why: str | None, decoder: Decoder, kv: KVCache, max_running: int,
                 page_size: int, max_model_len: int, scratch_page: int,
                 kind: type[DecodeGraphs] = CudaGraphs) -> DecodeGraphs | None:
    """Capture the decode graphs when `why` (from `why_off`) is None; log why not otherwise,
    or when capture fails (the engine then runs every step eagerly). `kind`: tests pass the
    CPU stand-in."""
    if why is not None:  # off on a CPU goes without saying
        (log.debug if why == NOT_CUDA else log.info)("cuda graphs: off: %s", why)
        return None
    buckets = graph_buckets(max_running)
    graphs = kind(decoder, kv, buckets, page_size, -(-max_model_len // page_size), scratch_page)
    try:
        took = graphs.capture()
    except Exception as e:  # a kernel that cannot be captured must not stop the engine
        log.warning("cuda graphs: off: capture failed (%s: %s); decode runs eagerly",
                    type(e).__name__, e)
        return None
    segments = len(graphs.static[buckets[0]].segments)
    log.info("cuda graphs: captured decode buckets %s (%d segment%s each, %s) in %.2f s",
             ",".join(map(str, buckets)), segments, "" if segments == 1 else "s",
             graphs.support.mode, took)
    return graphs


__all__ = ["BUCKETS", "CudaGraphs", "DecodeGraphs", "DecodeRows", "EagerGraphs", "StaticDecode",
           "build_graphs", "decode_rows", "graph_buckets", "pick_bucket", "why_off"]
