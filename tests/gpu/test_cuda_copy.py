"""The Rust CUDA paths on a real device: the `cuda` copy backend, the timed driver copies of
`_core.cuda_measure_h2d` / `cuda_measure_d2h`, and the link probe built on them.

Bytes are checked against torch's own copies; bandwidth only for being finite and positive
(its size is the bench's business: bench/gpu_check.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from ftrs import _core, errors
from ftrs.guard.link import (
    CopyComparison,
    compare_d2h,
    compare_h2d,
    measure_d2h_gbps,
    measure_link,
    pinned_pool,
    probe_link,
)
from test_core import make_pool, pool_block, slot_bytes, wait_idle

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ODD = (3 << 20) + 123  # not a multiple of any page or DMA granule


def random_bytes(n: int, device: str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(n)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=g)


@pytest.mark.parametrize("sizes", [(96, 40), (1 << 20, 3)], ids=["small", "4MiB"])
def test_cuda_backend_copies_the_exact_pool_bytes_into_device_slots(
        sizes: tuple[int, ...]) -> None:
    pool = make_pool(layers=2, experts=6, sizes=sizes)
    assert pool.pin()
    lay = pool.layout
    dst = torch.zeros(4 * lay.expert_bytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()  # the zeros land before the engine's stream writes the slots
    eng = _core.TransferEngine(pool, 4, dst, backend="cuda")
    assert eng.backend_name == "cuda"
    fetched = 0
    # 3 + 2 + 2 distinct blocks through 4 slots: the later lookups evict earlier blocks
    for layer, experts in [(0, [0, 3, 5]), (1, [2, 3]), (0, [1, 4])]:
        slots, ticket = eng.lookup(layer, experts)
        eng.wait(ticket)
        got = dst.cpu()
        for e, s in zip(experts, slots, strict=True):
            assert torch.equal(slot_bytes(got, lay, s), pool_block(pool, layer, e)), (layer, e)
        eng.release()
        fetched += len(experts)
    # a prefetch lands too, and every resident slot holds its block
    _, ticket = eng.lookup(1, [5], [(0, 2)])
    eng.wait(ticket)
    eng.release()
    wait_idle(eng)
    got = dst.cpu()
    resident = eng.resident()
    assert (0, 2) in {(layer, e) for layer, e, _ in resident}
    for layer, e, s in resident:
        assert torch.equal(slot_bytes(got, lay, s), pool_block(pool, layer, e)), (layer, e, s)
    st = eng.stats()
    assert st["prefetch_issued"] == 1
    assert st["bytes_h2d"] == (fetched + 2) * lay.expert_bytes


@pytest.mark.parametrize("nbytes", [4096, ODD, 64 << 20], ids=["4KiB", "odd", "64MiB"])
def test_d2h_through_rust_returns_the_device_bytes(nbytes: int) -> None:
    src = random_bytes(nbytes, "cuda")
    torch.cuda.synchronize()  # the Rust copy runs on its own stream
    pool = pinned_pool(nbytes)
    secs = _core.cuda_measure_d2h(src.data_ptr(), pool.address, nbytes, repeats=3)
    assert math.isfinite(secs) and secs > 0
    host = torch.frombuffer(pool, dtype=torch.uint8)[:nbytes]
    assert torch.equal(host, src.cpu())


def test_d2h_into_torch_pinned_memory_and_h2d_back() -> None:
    src = random_bytes(ODD, "cuda")
    torch.cuda.synchronize()
    host = torch.zeros(ODD, dtype=torch.uint8, pin_memory=True)
    assert _core.cuda_measure_d2h(src.data_ptr(), host.data_ptr(), ODD, repeats=1) > 0
    assert torch.equal(host, src.cpu())
    back = torch.zeros(ODD, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    assert _core.cuda_measure_h2d(back.data_ptr(), host.data_ptr(), ODD, repeats=1) > 0
    assert torch.equal(back, src)


def test_timed_copies_refuse_pageable_host_memory_and_host_as_device() -> None:
    src = random_bytes(1 << 20, "cuda")
    pageable = torch.zeros(1 << 20, dtype=torch.uint8)
    pinned = torch.zeros(1 << 20, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    with pytest.raises(errors.ConfigError, match="pinned host memory"):
        _core.cuda_measure_d2h(src.data_ptr(), pageable.data_ptr(), 1 << 20)
    with pytest.raises(errors.ConfigError, match="pinned host memory"):
        _core.cuda_measure_h2d(src.data_ptr(), pageable.data_ptr(), 1 << 20)
    with pytest.raises(errors.ConfigError, match="device memory"):
        _core.cuda_measure_d2h(pinned.data_ptr(), pinned.data_ptr(), 1 << 20)
    assert not pageable.any() and not pinned.any()


def test_measured_d2h_is_positive_and_finite() -> None:
    gbps = measure_d2h_gbps(16 << 20, reps=2)
    assert gbps is not None and math.isfinite(gbps) and gbps > 0


def test_link_probe_measures_both_directions_through_the_cuda_backend() -> None:
    state = measure_link(probe_link())
    assert state.measured_backend == "cuda"
    assert state.measured_h2d_gbps is not None and state.measured_h2d_gbps > 0
    assert state.measured_d2h_gbps is not None and state.measured_d2h_gbps > 0
    assert state.host_copy_gbps is not None and state.host_copy_gbps > 0
    gbps, source = state.effective_gbps()
    assert gbps is not None and gbps > 0 and source != "unknown"


@pytest.mark.parametrize("compare", [compare_h2d, compare_d2h], ids=["h2d", "d2h"])
def test_comparisons_with_torch_give_positive_figures(
        compare: Callable[..., CopyComparison]) -> None:
    c = compare(8 << 20, reps=2)
    assert c.nbytes == 8 << 20  # two whole 4 MiB blocks for h2d
    for gbps in (c.ftrs_gbps, c.driver_gbps, c.torch_gbps):
        assert math.isfinite(gbps) and gbps > 0
    assert math.isfinite(c.ratio) and c.ratio > 0


def test_a_copy_into_a_released_slot_waits_for_the_kernels_that_read_it() -> None:
    pool = make_pool(layers=1, experts=2, sizes=(1 << 20,))  # 4 MiB blocks
    assert pool.pin()
    lay = pool.layout
    dst = torch.zeros(lay.expert_bytes, dtype=torch.uint8, device="cuda")  # one slot
    torch.cuda.synchronize()
    eng = _core.TransferEngine(pool, 1, dst, backend="cuda")
    slots, ticket = eng.lookup(0, [0])
    eng.wait(ticket)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the read below
    seen = slot_bytes(dst, lay, slots[0]).clone()  # reads expert 0 once the sleep is over
    eng.release(torch.cuda.current_stream().cuda_stream)
    again, ticket = eng.lookup(0, [1])  # evicts the one slot: the copy waits for the read
    eng.wait(ticket)
    assert again == slots
    torch.cuda.synchronize()
    # without the fence the copy (about a millisecond) lands under the sleeping stream
    assert torch.equal(seen.cpu(), pool_block(pool, 0, 0))
    assert torch.equal(slot_bytes(dst, lay, slots[0]).cpu(), pool_block(pool, 0, 1))
    assert (eng.stats()["fences_recorded"], eng.stats()["fence_waits"]) == (1, 1)
    eng.close()


def test_ordinals_past_the_last_device_are_config_errors() -> None:
    n = torch.cuda.device_count()
    pool = make_pool()
    dst = torch.zeros(2 * pool.layout.expert_bytes, dtype=torch.uint8, device="cuda")
    with pytest.raises(errors.ConfigError, match="does not exist"):
        _core.TransferEngine(pool, 2, dst, backend=f"cuda:{n}")
    with pytest.raises(errors.ConfigError, match="does not exist"):
        pool.pin(n)
    host = torch.zeros(64, dtype=torch.uint8, pin_memory=True)
    with pytest.raises(errors.ConfigError, match="does not exist"):
        _core.cuda_measure_h2d(dst.data_ptr(), host.data_ptr(), 64, 1, n)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_n_copies_into_device_n_and_leaves_torch_s_current_device_alone() -> None:
    pool = make_pool()
    lay = pool.layout
    before = torch.cuda.current_device()
    assert pool.pin(1)
    wrong = torch.zeros(4 * lay.expert_bytes, dtype=torch.uint8, device="cuda:0")
    with pytest.raises(errors.ConfigError, match="cuda:1"):
        _core.TransferEngine(pool, 4, wrong, backend="cuda:1")
    dst = torch.zeros(4 * lay.expert_bytes, dtype=torch.uint8, device="cuda:1")
    torch.cuda.synchronize(1)
    eng = _core.TransferEngine(pool, 4, dst, backend="cuda:1")
    assert eng.backend_name == "cuda:1"
    slots, ticket = eng.lookup(1, [2, 5])
    eng.wait(ticket)
    eng.release(torch.cuda.current_stream(1).cuda_stream)
    assert torch.cuda.current_device() == before
    got = dst.cpu()
    for e, s in zip([2, 5], slots, strict=True):
        assert torch.equal(slot_bytes(got, lay, s), pool_block(pool, 1, e))
    eng.close()
