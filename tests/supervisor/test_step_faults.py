"""A step that raises fails only its own requests and the engine goes on (issue 13, item 1).

In process, without pipes: `StepRunner` (what the engine process's loop steps through) over a
tiny real `EngineCore` wrapped by the device supervisor, its decoder made to raise. The step's
requests are the oracle's ids: the scheduler admits one request at a time here, so the
request still waiting is, by construction, not in the failed step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ftrs.config import EngineConfig
from ftrs.engine.protocol import GenerateRequest, StepStats, TokenEvent
from ftrs.errors import EngineStepError, KernelFault
from ftrs.sampling import SamplingParams
from ftrs.server.engine_process import StepRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ftrs.models.tiny import make_tiny

    return make_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama", seed=0)


@pytest.fixture
def engine(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A tiny EngineCore behind the device supervisor; one running request at a time."""
    from ftrs.engine.core import EngineCore
    from ftrs.server.supervision import EngineSupervisor

    monkeypatch.setenv("FTRS_HOME", str(tmp_path))  # crash reports of the CUDA-error case
    config = EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32",
                          max_running_requests=1, kv_tokens=256)
    core = EngineCore(config, progress=False)
    sup = EngineSupervisor(config, core)
    core.supervised_step = sup.step
    try:
        yield core
    finally:
        sup.close()
        core.close()


def _raise_once(core: Any, exc: BaseException) -> None:
    """The decoder's next forward raises `exc`; later ones run."""
    forward = core.rt.decoder.forward
    calls = {"n": 0}

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise exc
        return forward(*args, **kwargs)

    core.rt.decoder.forward = broken


def _drain(runner: StepRunner, core: Any, limit: int = 50) -> dict[str, list[TokenEvent]]:
    out: dict[str, list[TokenEvent]] = {}
    for _ in range(limit):
        if not core.has_work():
            break
        events, _ = runner.step()
        for ev in events:
            out.setdefault(ev.request_id, []).append(ev)
    return out


def _two_requests(runner: StepRunner) -> None:
    for rid, prompt in (("a", [5, 6, 7, 8, 9] * 4), ("b", [11, 12, 13])):
        assert runner.add(GenerateRequest(rid, prompt, GREEDY)) is None


def test_a_step_that_raises_fails_only_its_requests_and_frees_their_kv(engine: Any) -> None:
    runner = StepRunner(engine, engine.supervised_step, fault_limit=3)
    _two_requests(runner)
    _raise_once(engine, ValueError("bad row 3"))
    events, stats = runner.step()  # carries "a" only: "b" waits for the one running slot
    assert stats is None
    (ev,) = events
    assert ev.request_id == "a" and ev.finish_reason == "error" and ev.error is not None
    assert ev.error["code"] == "engine_fault" and ev.error["http_status"] == 500
    assert ev.error["message"] == "engine step failed: ValueError: bad row 3"
    assert "Traceback" not in str(ev.error)
    assert runner.failed_in_a_row == 1 and runner.live == {"b"}
    rest = _drain(runner, engine)
    assert set(rest) == {"b"}  # the engine went on: "b" ran to max_tokens
    assert [len(e.new_token_ids) for e in rest["b"]] == [1, 1, 1, 1]
    assert rest["b"][-1].finish_reason == "length" and rest["b"][-1].error is None
    assert runner.failed_in_a_row == 0 and runner.live == set()
    assert engine.scheduler.kv_usage() == 0.0  # "a"'s pages were freed, and "b"'s


def test_a_cuda_out_of_memory_fails_its_step_as_device_out_of_memory(engine: Any) -> None:
    runner = StepRunner(engine, engine.supervised_step, fault_limit=3)
    _two_requests(runner)
    _raise_once(engine, RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    events, _ = runner.step()
    (ev,) = events
    assert ev.request_id == "a" and ev.error is not None
    assert ev.error["code"] == "device_out_of_memory" and ev.error["http_status"] == 503
    assert set(_drain(runner, engine)) == {"b"}


def test_a_cuda_error_is_the_device_policys(engine: Any) -> None:
    runner = StepRunner(engine, engine.supervised_step, fault_limit=3)
    _two_requests(runner)
    _raise_once(engine, RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(KernelFault):
        runner.step()


class _Stub:
    """An engine whose step raises while `broken`; one request per step."""

    def __init__(self) -> None:
        self.broken = True
        self.reqs: list[str] = []

    def add_request(self, req: GenerateRequest) -> None:
        if req.prompt_token_ids == [666]:  # as a gap in the API's validation would let through
            raise OverflowError("Python int too large to convert to C long")
        self.reqs.append(req.request_id)

    def abort(self, request_id: str) -> None:
        self.reqs.remove(request_id)

    def has_work(self) -> bool:
        return bool(self.reqs)

    def step(self) -> tuple[list[TokenEvent], StepStats]:
        if self.broken:
            raise RuntimeError("engine state is corrupt")
        rid = self.reqs.pop(0)
        return [TokenEvent(rid, [1], "length")], StepStats(1, 0.0, 0.0, "decode", 0, 0, 0, 1, 0.0)


def _submit(runner: StepRunner, rid: str) -> Callable[[], tuple[list[TokenEvent], Any]]:
    assert runner.add(GenerateRequest(rid, [1], GREEDY)) is None
    return runner.step


def test_steps_failing_in_a_row_end_the_engine_and_a_success_resets_the_count() -> None:
    stub = _Stub()
    runner = StepRunner(stub, stub.step, fault_limit=2)
    events, _ = _submit(runner, "a")()
    assert [(e.request_id, e.finish_reason) for e in events] == [("a", "error")]
    stub.broken = False
    events, _ = _submit(runner, "b")()
    assert [(e.request_id, e.finish_reason) for e in events] == [("b", "length")]
    stub.broken = True
    events, _ = _submit(runner, "c")()  # one failure after a success: not yet in a row
    assert [(e.request_id, e.finish_reason) for e in events] == [("c", "error")]
    with pytest.raises(EngineStepError) as info:
        _submit(runner, "d")()
    assert info.value.evidence["failed_in_a_row"] == 2
    assert "engine state is corrupt" in info.value.message


def test_an_untyped_error_in_add_request_refuses_that_request_only() -> None:
    stub = _Stub()
    stub.broken = False
    runner = StepRunner(stub, stub.step)
    refused = runner.add(GenerateRequest("x", [666], GREEDY))
    assert refused is not None and refused.finish_reason == "error" and refused.error is not None
    assert refused.error["code"] == "engine_fault" and "OverflowError" in refused.error["message"]
    events, _ = _submit(runner, "y")()
    assert [(e.request_id, e.finish_reason) for e in events] == [("y", "length")]
