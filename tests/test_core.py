"""ftrs._core for real, on the CPU: pool, safetensors fill, transfer engine, cache simulator,
flight recorder, and the error mapping to ftrs.errors."""

from __future__ import annotations

import gc
import itertools
import random
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ftrs import _core, errors


def make_pool(
    layers: int = 2, experts: int = 6, sizes: tuple[int, ...] = (96, 40)
) -> _core.ExpertPool:
    """A float32 pool whose block (layer, e) holds distinct values, written through `write`."""
    lay = _core.ExpertLayout(layers, experts, [s * 4 for s in sizes], alignment=64)
    pool = _core.ExpertPool(lay, "float32")
    for layer in range(layers):
        for e in range(experts):
            for t, n in enumerate(sizes):
                data = torch.arange(n, dtype=torch.float32) + 1000 * layer + 10 * e + t
                pool.write(layer, e, t, data.numpy())
    return pool


def pool_block(pool: _core.ExpertPool, layer: int, expert: int) -> torch.Tensor:
    """A copy of block (layer, expert) of the pool (a view could be read-only: engine in use)."""
    lay = pool.layout
    off = lay.offset(layer, expert, 0)
    return torch.frombuffer(bytearray(memoryview(pool)[off : off + lay.expert_bytes]),
                            dtype=torch.uint8)


def slot_bytes(dst: torch.Tensor, lay: _core.ExpertLayout, slot: int) -> torch.Tensor:
    return dst[slot * lay.expert_bytes : (slot + 1) * lay.expert_bytes]


def wait_idle(eng: _core.TransferEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = eng.stats()
        if s["queue_depth"] == 0 and s["inflight_bytes"] == 0:
            return
        time.sleep(0.005)
    raise AssertionError("engine never went idle")


def test_layout_tensors_are_aligned_disjoint_and_inside_the_pool() -> None:
    lay = _core.ExpertLayout(3, 4, [100, 300, 7], alignment=256)
    spans = []
    for layer in range(3):
        for e in range(4):
            for t, n in enumerate([100, 300, 7]):
                off = lay.offset(layer, e, t)
                assert off % 256 == 0
                assert off == lay.offset(layer, e, 0) + lay.tensor_offset(t)
                spans.append((off, off + n))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert spans[-1][1] <= lay.total_bytes == 12 * lay.expert_bytes
    with pytest.raises(errors.ConfigError):
        lay.offset(3, 0, 0)


def test_pool_is_zeroed_page_aligned_and_writable_through_the_buffer_protocol() -> None:
    pool = _core.ExpertPool(_core.ExpertLayout(1, 2, [512]), "bfloat16")
    assert pool.address % 4096 == 0
    view = torch.frombuffer(pool, dtype=torch.uint8)
    assert view.numel() == pool.nbytes and int(view.sum()) == 0
    view[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert bytes(memoryview(pool)[:4]) == b"\x01\x02\x03\x04"
    with pytest.raises(errors.ConfigError):
        pool.write(0, 0, 0, b"\x00" * 3)
    assert pool.pin() is _core.cuda_available()


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fill_from_safetensors_converts_to_the_pool_dtype(
    tmp_path: Path, pool_dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    tensors = {
        f"layers.{layer}.experts.{e}.{name}": torch.randn(shape).to(disk)
        for layer in range(2)
        for e in range(3)
        for name, shape, disk in [("w1", (8, 4), torch.bfloat16), ("w2", (4, 8), torch.float32)]
    }
    half = len(tensors) // 2
    names = list(tensors)
    save_file({k: tensors[k] for k in names[:half]}, str(tmp_path / "a.safetensors"))
    save_file({k: tensors[k] for k in names[half:]}, str(tmp_path / "b.safetensors"))
    esize = torch.empty((), dtype=pool_dtype).element_size()
    lay = _core.ExpertLayout(2, 3, [32 * esize, 32 * esize])
    pool = _core.ExpertPool(lay, str(pool_dtype).removeprefix("torch."))
    entries = []
    for i, name in enumerate(names):
        _, layer, _, e, w = name.split(".")
        path = tmp_path / ("a.safetensors" if i < half else "b.safetensors")
        entries.append((str(path), name, int(layer), int(e), int(w[1]) - 1))
    assert pool.fill_from_safetensors(entries, threads=2) == 12 * 32 * esize
    view = torch.frombuffer(pool, dtype=torch.uint8)
    for _path, name, layer, e, t in entries:
        off = lay.offset(layer, e, t)
        got = view[off : off + 32 * esize].view(pool_dtype)
        want = tensors[name].to(torch.float32).to(pool_dtype).flatten()
        assert torch.equal(got, want), name


def test_fill_problems_raise_model_load_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    save_file(
        {"w": torch.zeros(4, dtype=torch.float32), "i": torch.zeros(4, dtype=torch.int32)},
        str(path),
    )
    pool = _core.ExpertPool(_core.ExpertLayout(1, 1, [16]), "float32")
    for entry, problem in [
        ((str(tmp_path / "missing.safetensors"), "w", 0, 0, 0), "cannot open"),
        ((str(path), "nope", 0, 0, 0), "not found"),
        ((str(path), "i", 0, 0, 0), "dtype"),
    ]:
        with pytest.raises(errors.ModelLoadError) as info:
            pool.fill_from_safetensors([entry])
        assert info.value.path == entry[0]
        assert problem in info.value.problem
    small = _core.ExpertPool(_core.ExpertLayout(1, 1, [8]), "float32")
    with pytest.raises(errors.ModelLoadError, match="shape"):
        small.fill_from_safetensors([(str(path), "w", 0, 0, 0)])


def test_lookup_copies_pool_blocks_into_the_returned_slots_and_hits_next_time() -> None:
    pool = make_pool()
    lay = pool.layout
    dst = torch.zeros(4 * lay.expert_bytes, dtype=torch.uint8)
    eng = _core.TransferEngine(pool, 4, dst)
    assert (eng.num_slots, eng.backend_name) == (4, "host")
    slots, ticket = eng.lookup(1, [2, 5], [(0, 1)])
    eng.wait(ticket)
    for e, s in zip([2, 5], slots, strict=False):
        assert torch.equal(slot_bytes(dst, lay, s), pool_block(pool, 1, e))
    eng.release()
    wait_idle(eng)
    again, ticket = eng.lookup(1, [5, 2], [])
    eng.wait(ticket)
    assert again == [slots[1], slots[0]]
    slots0, ticket = eng.lookup(0, [1])
    eng.wait(ticket)
    assert torch.equal(slot_bytes(dst, lay, slots0[0]), pool_block(pool, 0, 1))
    s = eng.stats()
    assert (s["lookups"], s["hits"], s["misses"], s["demand_fetches"]) == (5, 3, 2, 2)
    assert (s["prefetch_issued"], s["prefetch_used"]) == (1, 1)
    assert s["layer_hits"] == [1, 2] and s["layer_misses"] == [0, 2]
    assert s["bytes_h2d"] == 3 * lay.expert_bytes
    assert sorted(eng.resident()) == sorted([(1, 2, slots[0]), (1, 5, slots[1]), (0, 1, slots0[0])])
    assert (eng.resident_in(1), eng.resident_in(0), eng.resident_in(2)) == ([2, 5], [1], [])
    eng.reset_stats()
    assert eng.stats()["lookups"] == 0


def test_cancelled_prefetches_never_land() -> None:
    pool = make_pool()
    lay = pool.layout
    dst = torch.zeros(6 * lay.expert_bytes, dtype=torch.uint8)
    # A 1 kB/s link: each copy holds the link for ~0.5 s, so nothing finishes before the cancel.
    eng = _core.TransferEngine(pool, 6, dst, backend="simulated:0.000001")
    _, ticket = eng.lookup(0, [], [(1, 0), (1, 1), (1, 2)])
    eng.wait(ticket)
    assert eng.cancel_prefetches() == 3
    wait_idle(eng)
    assert eng.resident() == [] and eng.resident_in(1) == []  # never landed: not resident
    s = eng.stats()
    assert (s["prefetch_issued"], s["prefetch_cancelled"], s["prefetch_wasted"]) == (3, 3, 3)


def test_injected_device_lost_surfaces_in_wait_as_ftrs_errors_device_lost() -> None:
    pool = make_pool()
    dst = torch.zeros(4 * pool.layout.expert_bytes, dtype=torch.uint8)
    eng = _core.TransferEngine(pool, 4, dst)
    eng.inject_fault("device_lost", after_copies=1)
    _, t = eng.lookup(0, [0])
    eng.wait(t)
    _, t = eng.lookup(0, [1])
    with pytest.raises(errors.DeviceLost) as info:
        eng.wait(t)
    assert info.value.evidence["source"] == "copy_backend"
    assert info.value.evidence["injected"] is True
    eng.release()
    eng.inject_fault("oom")
    _, t = eng.lookup(0, [2])
    with pytest.raises(errors.DeviceOutOfMemory):
        eng.wait(t)
    with pytest.raises(errors.ConfigError):
        eng.inject_fault("meteor")


def test_bad_arguments_raise_config_or_capacity_errors() -> None:
    pool = make_pool()
    dst = torch.zeros(2 * pool.layout.expert_bytes, dtype=torch.uint8)
    for kwargs in [{"backend": "warp"}, {"policy": "random"}, {"policy": "belady"}]:
        with pytest.raises(errors.ConfigError):
            _core.TransferEngine(pool, 2, dst, **kwargs)
    with pytest.raises(errors.ConfigError):
        _core.TransferEngine(pool, 0, dst)
    with pytest.raises(errors.ConfigError):
        _core.TransferEngine(pool, 3, dst)
    for bad in [dst.data_ptr(), dst[::2], torch.zeros(0, dtype=torch.uint8),
                torch.frombuffer(pool, dtype=torch.uint8)]:
        with pytest.raises(errors.ConfigError):  # not a tensor / strided / null / the pool
            _core.TransferEngine(pool, 1, bad)
    eng = _core.TransferEngine(pool, 2, dst, policy="lfru")
    with pytest.raises(errors.CapacityError):
        eng.lookup(0, [0, 1, 2])
    with pytest.raises(errors.ConfigError):
        eng.lookup(0, [99])
    if not _core.cuda_available():
        with pytest.raises(errors.DeviceError, match="CUDA driver"):
            _core.TransferEngine(pool, 2, dst.cuda() if torch.cuda.is_available() else dst,
                                 backend="cuda")


def test_release_after_a_stream_fences_its_slots_and_only_copies_into_them_wait() -> None:
    pool = make_pool()
    lay = pool.layout
    dst = torch.zeros(2 * lay.expert_bytes, dtype=torch.uint8)
    eng = _core.TransferEngine(pool, 2, dst)  # host: a fence is a marker, counted

    def fetch(e: int) -> int:
        slots, t = eng.lookup(0, [e])
        eng.wait(t)
        return slots[0]

    first = [fetch(0), fetch(1)]
    eng.release(stream=0)  # both slots behind one fence
    eng.release(stream=0)  # nothing pinned: no fence
    assert (eng.stats()["fences_recorded"], eng.stats()["fence_waits"]) == (1, 0)
    waits = []
    for e in (2, 3, 4):  # evicts (0,0), then (0,1), then (0,2) whose fence was waited on
        fetch(e)
        eng.release()
        wait_idle(eng)
        waits.append(eng.stats()["fence_waits"])
    assert waits == [1, 2, 2]
    assert sorted(s for _, _, s in eng.resident()) == sorted(first)
    for layer, e, s in eng.resident():
        assert torch.equal(slot_bytes(dst, lay, s), pool_block(pool, layer, e))
    eng.close()


def test_cuda_ordinals_are_parsed_and_refused_cleanly() -> None:
    pool = make_pool()
    dst = torch.zeros(2 * pool.layout.expert_bytes, dtype=torch.uint8)
    for spec in ["cuda:", "cuda:x", "cuda:-1", "cuda:1:2", "cuda:99999999999"]:
        with pytest.raises(errors.ConfigError):
            _core.TransferEngine(pool, 2, dst, backend=spec)
    for device in (-1, 1 << 40):
        with pytest.raises(errors.ConfigError, match="ordinal"):
            pool.pin(device)
        for measure in (_core.cuda_measure_h2d, _core.cuda_measure_d2h):
            with pytest.raises(errors.ConfigError, match="ordinal"):
                measure(1 << 40, dst.data_ptr(), 64, 1, device)
    if _core.cuda_available():
        return  # a GPU host: tests/gpu uses real devices
    with pytest.raises(errors.DeviceError, match="CUDA driver"):
        _core.TransferEngine(pool, 2, dst, backend="cuda:3")
    assert pool.pin(3) is False and not pool.pinned


def test_pool_is_read_only_while_an_engine_holds_it_and_writable_after_close() -> None:
    pool = make_pool()
    data = torch.ones(96, dtype=torch.float32).numpy()
    assert memoryview(pool).readonly is False
    dst = torch.zeros(4 * pool.layout.expert_bytes, dtype=torch.uint8)
    eng = _core.TransferEngine(pool, 4, dst)
    with pytest.raises(errors.ConfigError, match="read-only"):
        pool.write(0, 0, 0, data)
    with pytest.raises(errors.ConfigError, match="read-only"):
        pool.fill_from_safetensors([])
    assert memoryview(pool).readonly is True  # no new writable view while copies may run
    _, t = eng.lookup(0, [0])
    eng.wait(t)
    eng.close()
    del eng
    pool.write(0, 0, 0, data)
    assert memoryview(pool).readonly is False
    assert torch.equal(pool_block(pool, 0, 0)[:384].view(torch.float32), torch.ones(96))


def test_engine_holds_its_destination_so_deleting_the_tensor_first_is_safe() -> None:
    pool = make_pool()
    lay = pool.layout
    dst = torch.full((4 * lay.expert_bytes,), 7, dtype=torch.uint8)
    ref = weakref.ref(dst)
    eng = _core.TransferEngine(pool, 4, dst)
    del dst
    gc.collect()
    assert ref() is not None  # the engine keeps the buffer it copies into
    slots, t = eng.lookup(1, [3, 4])
    eng.wait(t)
    held = eng.destination
    for e, s in zip([3, 4], slots, strict=True):
        assert torch.equal(slot_bytes(held, lay, s), pool_block(pool, 1, e))
    del held
    del eng  # not closed: closed off the GIL, and the buffer released once the worker stopped
    deadline = time.monotonic() + 10
    while ref() is not None and time.monotonic() < deadline:
        _core.cuda_available()  # a call into the extension also applies deferred releases
        gc.collect()
        time.sleep(0.01)
    assert ref() is None


def test_dropping_an_open_engine_leaves_the_join_and_the_buffer_to_another_thread() -> None:
    pool = make_pool()
    dst = torch.zeros(4 * pool.layout.expert_bytes, dtype=torch.uint8)
    ref = weakref.ref(dst)
    # ~1 kB/s: the demand copy is on the link for about half a second after the lookup
    eng = _core.TransferEngine(pool, 4, dst, backend="simulated:0.000001")
    eng.lookup(0, [1])
    del dst
    del eng  # a join here (GIL held) would wait for the copy, then free the buffer at once
    assert ref() is not None, "the engine's drop joined the worker with the GIL held"
    deadline = time.monotonic() + 10
    while ref() is not None and time.monotonic() < deadline:
        _core.cuda_available()
        gc.collect()
        time.sleep(0.01)
    assert ref() is None  # released once the worker stopped


def test_close_releases_the_gil_is_idempotent_and_later_calls_raise_config_error() -> None:
    pool = make_pool()
    dst = torch.zeros(4 * pool.layout.expert_bytes, dtype=torch.uint8)
    # ~1 kB/s: the demand copy below holds close() for about half a second
    eng = _core.TransferEngine(pool, 4, dst, backend="simulated:0.000001")
    slots, t = eng.lookup(0, [2], [(1, 0)])
    closer = threading.Thread(target=eng.close)
    closer.start()
    seen_while_closing = False
    while closer.is_alive():
        seen_while_closing |= eng.closed and closer.is_alive()
        time.sleep(0.001)
    closer.join()
    assert seen_while_closing, "close() held the GIL while it joined the worker"
    eng.close()  # idempotent
    assert eng.closed
    assert torch.equal(slot_bytes(dst, pool.layout, slots[0]), pool_block(pool, 0, 2))
    for call in [lambda: eng.lookup(0, [1]), lambda: eng.wait(t), eng.release,
                 eng.cancel_prefetches, lambda: eng.set_pacing(1e9),
                 lambda: eng.inject_fault("oom")]:
        with pytest.raises(errors.ConfigError, match="closed"):
            call()
    assert eng.stats()["demand_fetches"] == 1  # counters stay readable


def test_worker_panic_reaches_every_waiter_as_kernel_fault() -> None:
    pool = make_pool()
    dst = torch.zeros(4 * pool.layout.expert_bytes, dtype=torch.uint8)
    eng = _core.TransferEngine(pool, 4, dst)
    eng.inject_fault("worker_panic", after_copies=0)
    faults: list[errors.KernelFault] = []

    def demand(expert: int) -> None:
        try:
            _, t = eng.lookup(0, [expert])
            eng.wait(t)
        except errors.KernelFault as e:
            faults.append(e)

    threads = [threading.Thread(target=demand, args=(e,)) for e in (0, 1, 2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=10)
    assert not any(th.is_alive() for th in threads), "a waiter is still blocked"
    assert len(faults) == 3
    assert {f.evidence["source"] for f in faults} == {"transfer_worker"}
    assert all(f.evidence["injected"] is True for f in faults)
    with pytest.raises(errors.KernelFault, match="panicked"):
        eng.lookup(1, [0])
    eng.close()


@pytest.mark.parametrize("measure", [_core.cuda_measure_d2h, _core.cuda_measure_h2d],
                         ids=["d2h", "h2d"])
def test_timed_cuda_copies_check_arguments_then_need_the_driver(
        measure: Callable[..., float]) -> None:
    host = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(errors.ConfigError, match="bytes > 0"):
        measure(1 << 40, host.data_ptr(), 0)
    with pytest.raises(errors.ConfigError, match="non-null"):
        measure(0, host.data_ptr(), 4096)
    if _core.cuda_available():
        return  # a GPU host: tests/gpu times real copies
    with pytest.raises(errors.DeviceError, match="CUDA driver") as info:
        measure(1 << 40, host.data_ptr(), 4096, repeats=2)
    assert type(info.value) is errors.DeviceError  # not a fault of a device: there is none
    assert info.value.evidence["source"] == "cuda_driver"
    assert not host.any()


def test_simulate_cache_belady_is_never_worse_than_an_online_policy() -> None:
    rng = random.Random(7)
    for _ in range(20):
        trace = [
            [(rng.randrange(4), min(int(rng.expovariate(0.3)), 15)) for _ in range(3)]
            for _ in range(200)
        ]
        cap = rng.randrange(4, 24)
        best = _core.simulate_cache(trace, cap, "belady")
        for policy in ("lru", "lfru", "lrfu"):
            hits, misses = _core.simulate_cache(trace, cap, policy)
            assert hits + misses == sum(best)
            assert best[0] >= hits
    with pytest.raises(errors.ConfigError):
        _core.simulate_cache([[(0, 0)]], 1, "fifo")


def test_host_copy_matches_numpy() -> None:
    src = np.random.default_rng(0).integers(0, 256, 9 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    _core.host_copy(dst.ctypes.data, src.ctypes.data, src.nbytes, threads=2)
    assert np.array_equal(dst, src)


def test_flight_recorder_keeps_the_last_records_oldest_first() -> None:
    rec = _core.FlightRecorder(capacity=4)
    for step in range(10):
        rec.record(step=step, time=1.5 * step, kind="decode", tokens=step * 2, power_w=300.0)
    assert len(rec) == 4
    dump = rec.dump()
    assert [r["step"] for r in dump] == [6, 7, 8, 9]
    assert dump[0]["kind"] == "decode" and dump[0]["tokens"] == 12 and dump[0]["time"] == 9.0
    assert dump[0]["chunk_tokens"] == -1 and np.isnan(dump[0]["temperature_c"])
