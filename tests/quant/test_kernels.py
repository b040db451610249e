"""The Rust quantized CPU kernels (`ftrs._core.quant_*`) against the `gguf` reference.

Oracle: `gguf.quants.dequantize` (gguf-py's numpy decoder), then a float64 matmul.

Tolerance, from the block math. The kernel computes each weight as the reference does
(`q * (d * sc)` in fp32, bit-equal), but adds the K-quant mins separately, as
`dmin * m * sum(x over the sub-block)`, and accumulates in fp32 (8 lanes, fused multiply-add).
Every term `x_c * w_c` (or its scaled-quant and min halves) passes through at most `cols` fp32
roundings, each of relative size <= eps, so

    |kernel - exact| <= (cols + 4) * eps32 * sum_c |x_c| * (|w_c| + 2 |off_c|)

where `off_c` is the weight's min term (0 for types without one), obtained by decoding the
block with its quant bits zeroed. A layout or indexing error moves the result by O(|x| |w|)
per wrong element, orders of magnitude above this bound.
"""

from __future__ import annotations

import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
core = pytest.importorskip("ftrs._core")

from gguf import GGMLQuantizationType as GT  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

from ftrs.errors import ConfigError  # noqa: E402
from ftrs.quant.fixtures import random_blocks  # noqa: E402
from ftrs.quant.iquant import IQ_TYPES, install_grids  # noqa: E402

install_grids(core)  # the i-quants' tables (the `gguf` package's), as `ftrs.quant` installs them
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "IQ4_NL", "IQ4_XS", *IQ_TYPES]
QUANTIZED_BY_GGUF = {"BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"}
# Byte offsets of a K-quant block's fp16 super-scales (d, dmin), from ggml's block structs.
K_SCALE_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                  "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}  # (and IQ4's fp16 d)
# Byte ranges holding scales and mins; zeroing every other byte leaves only the min term.
OFFSET_KEEP = {"Q4_1": [(0, 4)], "Q5_1": [(0, 4)], "Q4_K": [(0, 16)], "Q5_K": [(0, 16)],
               "Q2_K": [(0, 16), (80, 84)]}
KERNELS = ["auto", *core.quant_kernels()]  # every family this CPU runs


def _cols(qtype: str) -> int:
    block, _ = core.quant_block_info(qtype)
    return {1: 77, 32: 96, 256: 512}[block]


def make_weights(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes per row) uint8 of valid blocks of `qtype`."""
    floats = rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype == "F32":
        return floats.view(np.uint8)
    if qtype == "F16":
        return floats.astype(np.float16).view(np.uint8)
    if qtype in QUANTIZED_BY_GGUF:
        return gguf.quants.quantize(floats, GT[qtype])
    if qtype in IQ_TYPES:  # random grid indices, signs and scales under a finite fp16 d
        return random_blocks(qtype, rows, cols, rng)
    block, nbytes = core.quant_block_info(qtype)
    blocks = rng.integers(0, 256, (rows * cols // block, nbytes), dtype=np.uint8)
    for off in K_SCALE_FIELDS[qtype]:
        scale = (rng.standard_normal(len(blocks)) * 0.05).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def reference(qtype: str, w: np.ndarray) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(w, GT[qtype]), dtype=np.float32)


def offsets(qtype: str, w: np.ndarray) -> np.ndarray:
    if qtype not in OFFSET_KEEP:
        return np.zeros(reference(qtype, w).shape, np.float32)
    _, nbytes = core.quant_block_info(qtype)
    blocks = w.reshape(-1, nbytes)
    zeroed = np.zeros_like(blocks)
    for a, b in OFFSET_KEEP[qtype]:
        zeroed[:, a:b] = blocks[:, a:b]
    return reference(qtype, zeroed.reshape(w.shape))


def tolerance(x: np.ndarray, wf: np.ndarray, off: np.ndarray, x8: bool = False,
              min_rounded: bool = False) -> np.ndarray:
    """fp32 accumulation over `cols` products; with `x8` (the kernel takes x as two int8 digits
    per 32-block, `core.quant_rounds_activations`) also half a step of the low digit,
    max|x over the block| / (127 * 508), per element (1 % more for the fp32 rounding of x / d),
    times the weight without its min (the min meets the exact block sum), or the whole weight
    with `min_rounded` (Q2_K: its mins meet the rounded activations of their 16 values)."""
    cols = x.shape[1]
    mag = np.abs(x.astype(np.float64)) @ (np.abs(wf) + 2 * np.abs(off)).astype(np.float64).T
    tol = (cols + 4) * np.finfo(np.float32).eps * mag
    if x8:
        amax = np.abs(x.astype(np.float64)).reshape(x.shape[0], -1, 32).max(axis=2)
        step = np.repeat(amax / 64516 * 1.01, 32, axis=1)  # (n, cols)
        tol = tol + step @ np.abs(wf.astype(np.float64) - (0 if min_rounded else off)).T
    return tol


@pytest.mark.parametrize("qtype", TYPES)
def test_block_info_matches_gguf(qtype: str) -> None:
    assert core.quant_block_info(qtype) == GGML_QUANT_SIZES[GT[qtype]]


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_equals_gguf_bit_for_bit(qtype: str) -> None:
    rng = np.random.default_rng(1)
    rows, cols = 5, _cols(qtype)
    w = make_weights(qtype, rows, cols, rng)
    out = np.empty((rows, cols), np.float32)
    core.quant_dequantize(qtype, w, out, rows, cols)
    np.testing.assert_array_equal(out, reference(qtype, w))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("qtype", TYPES)
def test_matmul_equals_dequantize_then_float64_matmul(qtype: str, kernel: str) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{qtype}/{kernel}".encode()))
    cols = _cols(qtype)
    for rows, n in [(7, 1), (13, 3), (9, 8), (5, 11)]:
        w = make_weights(qtype, rows, cols, rng)
        x = rng.standard_normal((n, cols)).astype(np.float32)
        out = np.full((n, rows), np.nan, np.float32)
        core.quant_matmul(qtype, w, x, out, rows, cols, 2, kernel)
        wf = reference(qtype, w)
        exact = x.astype(np.float64) @ wf.astype(np.float64).T
        err = np.abs(out - exact)
        tol = tolerance(x, wf, offsets(qtype, w), core.quant_rounds_activations(qtype, kernel),
                        min_rounded=qtype == "Q2_K")
        assert (err <= tol).all(), (
            f"{qtype} {kernel} rows={rows} n={n}: max err {err.max():.3g}, "
            f"worst err/tol {(err / tol).max():.3g}")


def test_threads_split_rows_without_changing_a_bit() -> None:
    rng = np.random.default_rng(3)
    rows, cols = 1001, 1024
    w = make_weights("Q4_K", rows, cols, rng)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    one, two = np.empty((3, rows), np.float32), np.empty((3, rows), np.float32)
    core.quant_matmul("Q4_K", w, x, one, rows, cols, 1)
    core.quant_matmul("Q4_K", w, x, two, rows, cols, 2)
    np.testing.assert_array_equal(one, two)


def test_torch_tensors_and_pool_views_are_read_in_place() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    rows, cols = 6, 256
    w = make_weights("Q6_K", rows, cols, rng)
    pool = bytearray(7 + w.nbytes + 9)  # an expert at an odd offset of a bigger region
    pool[7:7 + w.nbytes] = w.tobytes()
    view = memoryview(pool)[7:7 + w.nbytes]
    x = torch.randn(2, cols)
    out = torch.zeros(2, rows)
    core.quant_matmul("Q6_K", view, x.numpy(), out.numpy(), rows, cols)
    wf = reference("Q6_K", w)
    want = torch.from_numpy(wf).double() @ x.double().T
    tol = tolerance(x.numpy(), wf, offsets("Q6_K", w), core.quant_rounds_activations("Q6_K"))
    assert ((out.double() - want.T).abs().numpy() <= tol).all()
    assert out.abs().sum() > 0  # written through the shared memory
    wt = torch.from_numpy(w.copy())
    out2 = torch.zeros(2, rows)
    core.quant_matmul("Q6_K", wt.numpy(), x.numpy(), out2.numpy(), rows, cols)
    assert torch.equal(out, out2)


def _call(**kw: Any) -> None:
    args: dict[str, Any] = dict(qtype="Q4_K", weight=np.zeros(144 * 3, np.uint8),
                                x=np.ones(256, np.float32), out=np.zeros(3, np.float32),
                                rows=3, cols=256)
    args.update(kw)
    core.quant_matmul(args["qtype"], args["weight"], args["x"], args["out"], args["rows"],
                      args["cols"])


@pytest.mark.parametrize(("kw", "needle"), [
    (dict(weight=np.zeros(144 * 3 - 1, np.uint8)), "expected 432 bytes"),
    (dict(cols=250, x=np.ones(250, np.float32)), "multiple of the block size 256"),
    (dict(x=np.ones(255, np.float32)), "x has 255 floats"),
    (dict(out=np.zeros(4, np.float32)), "out has 4 floats"),
    (dict(qtype="IQ2_XXS"), "IQ2_XXS"),
    (dict(x=np.ones(256, np.float64)), "float32"),
    (dict(x=np.ones(512, np.float32)[::2]), "C-contiguous"),
    (dict(out="read-only"), "writable"),
], ids=["weight-size", "cols", "x-size", "out-size", "qtype", "x-dtype", "x-strided",
        "out-readonly"])
def test_bad_input_is_a_config_error_naming_what_was_expected(kw: dict[str, Any],
                                                              needle: str) -> None:
    if isinstance(kw.get("out"), str):
        ro = np.zeros(3, np.float32)
        ro.setflags(write=False)
        kw = {"out": ro}
    with pytest.raises(ConfigError, match=needle):
        _call(**kw)


def test_out_overlapping_an_input_is_refused() -> None:
    buf = np.zeros(256 + 3, np.float32)
    with pytest.raises(ConfigError, match="overlaps x"):
        _call(x=buf[:256], out=buf[253:256])


def test_thread_setting_round_trips() -> None:
    before = core.quant_threads()
    assert before >= 1
    try:
        core.quant_set_threads(3)
        assert core.quant_threads() == 3
        with pytest.raises(ConfigError):
            core.quant_set_threads(0)
    finally:
        core.quant_set_threads(before)


def test_the_auto_family_is_a_process_setting_that_changes_the_kernel_run() -> None:
    best = core.quant_kernels()[-1]
    assert core.quant_kernel() == best  # nothing set: the best this CPU runs
    rng = np.random.default_rng(5)
    w = make_weights("Q6_K", 64, 512, rng)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    by_family = {}
    for name in core.quant_kernels():
        by_family[name] = np.empty((1, 64), np.float32)
        core.quant_matmul("Q6_K", w, x, by_family[name], 64, 512, 1, name)
    try:
        for name in core.quant_kernels():
            core.quant_set_kernel(name)
            assert core.quant_kernel() == name
            out = np.empty((1, 64), np.float32)
            core.quant_matmul("Q6_K", w, x, out, 64, 512, 1)  # kernel="auto"
            np.testing.assert_array_equal(out, by_family[name])  # that family's bits
        with pytest.raises(ConfigError, match="unknown kernel"):
            core.quant_set_kernel("sse9")
        missing = [k for k in ("avx2", "avx512") if k not in core.quant_kernels()]
        for name in missing:  # a family this CPU lacks is refused, the setting kept
            with pytest.raises(ConfigError, match="lacks"):
                core.quant_set_kernel(name)
    finally:
        core.quant_set_kernel("auto")
    assert core.quant_kernel() == best


def _quant_worker_ticks() -> dict[str, int]:
    """utime + stime (clock ticks) of this process's kernel worker threads, by thread id."""
    ticks = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            if not (task / "comm").read_text().startswith("ftrs-quant"):
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks[task.name] = int(fields[11]) + int(fields[12])
    return ticks


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_idle_workers_sleep_instead_of_spinning() -> None:
    rng = np.random.default_rng(5)
    rows, cols = 1024, 1024
    w = make_weights("Q4_K", rows, cols, rng)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    out = np.empty((1, rows), np.float32)
    core.quant_matmul("Q4_K", w, x, out, rows, cols, 2)
    time.sleep(0.05)  # past the few yield rounds a worker takes after its last job
    before = _quant_worker_ticks()
    assert before, "the call above ran on the worker pool"
    time.sleep(0.5)
    after = _quant_worker_ticks()
    busy = sum(after.get(t, 0) - v for t, v in before.items())
    # A spinning worker would burn ~50 ticks (100 Hz) in 0.5 s; a sleeping one none.
    assert busy <= 2, f"idle kernel workers used {busy} clock ticks in 0.5 s"
