"""What a crash report keeps of the steps (issue 5): the flight recorder's figures are each
step's own, a hang's report holds the step in progress, and a drill's device error names the
step it stopped like a real one (`failed_step`).

In process: tiny real `EngineCore`s behind the device supervisor. Oracles: the copy engine's
own cumulative counters (the rows must add up to them), the requests the test sent, and the
`failed_step` evidence `EngineCore.step` gives a real device error.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from ftrs.config import EngineConfig
from ftrs.engine.protocol import GenerateRequest
from ftrs.errors import DeviceLost, EngineHang, FtrsError
from ftrs.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _supervised(config: EngineConfig, **kw: Any) -> tuple[Any, Any]:
    from ftrs.engine.core import EngineCore
    from ftrs.server.supervision import EngineSupervisor

    core = EngineCore(config, progress=False)
    return core, EngineSupervisor(config, core, **kw)


def test_flight_recorder_rows_hold_each_steps_copies(tiny_models: dict[str, Path],
                                                      tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTRS_HOME", str(tmp_path))
    config = EngineConfig(model=str(tiny_models["mixtral"]), device="cpu", dtype="float32",
                          moe_strategy="offload", moe_cache_size=2, moe_prefetch=False,
                          kv_tokens=256)
    core, sup = _supervised(config)
    try:
        core.add_request(GenerateRequest("a", list(range(5, 17)), GREEDY))
        while core.has_work():
            sup.step()
        totals = core.transfer_engine().stats()
        rows = sup.recorder.dump()
    finally:
        sup.close()
        core.close()
    issued = [r["bytes_issued"] for r in rows]
    fetched = [r["experts_fetched"] for r in rows]
    assert all(b >= 0 for b in issued) and all(f >= 0 for f in fetched), rows
    assert totals["bytes_h2d"] > 0 and sum(issued) == totals["bytes_h2d"]  # per step: they add up
    assert sum(fetched) == totals["misses"] and fetched[-1] < totals["misses"]


def test_a_hang_report_holds_the_step_in_progress(tiny_models: dict[str, Path], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill that stops computing: the report's last row is that step, timed at its start,
    and its evidence says what the step carried."""
    monkeypatch.setenv("FTRS_HOME", str(tmp_path))
    config = EngineConfig(model=str(tiny_models["llama"]), device="cpu", dtype="float32",
                          kv_tokens=256, hang_timeout=1.0)
    fatal: list[FtrsError] = []
    core, sup = _supervised(config, on_fatal=fatal.append)
    mlp = core.rt.decoder._mlp

    def stuck(layer: int, x: Any) -> Any:
        time.sleep(3.0 if layer == 1 else 0.0)
        return mlp(layer, x)

    try:
        core.add_request(GenerateRequest("warm", [5, 6, 7], SamplingParams(max_tokens=1)))
        sup.step()  # one step done, then the hang
        core.add_request(GenerateRequest("long", list(range(5, 45)), GREEDY))
        core.rt.decoder._mlp = stuck
        started = time.time()
        sup.step()
        deadline = time.monotonic() + 5.0
        while not fatal and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        sup.close()
        core.close()
    assert len(fatal) == 1 and isinstance(fatal[0], EngineHang), fatal
    assert sup.crash_report is not None
    report = json.loads(sup.crash_report.read_text())
    rows = report["flight_recorder"]
    assert [r["step"] for r in rows] == [1, 2], rows
    assert rows[-1]["kind"] == "prefill" and abs(rows[-1]["time"] - started) < 0.5
    step = report["evidence"]["step_in_progress"]
    assert step["request_ids"] == ["long"] and step["prompt_tokens_pending"] == 40
    assert step["step"] == 2 and step["running_s"] >= 1.0
    assert "bytes_issued" in report["flight_recorder_fields"]


def test_a_resident_drill_names_the_failed_step(tiny_models: dict[str, Path], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """No copy to fail (resident experts): the drill raises after the step; its evidence names
    the step's requests and tokens as EngineCore does for a real device error."""
    monkeypatch.setenv("FTRS_HOME", str(tmp_path))
    config = EngineConfig(model=str(tiny_models["mixtral"]), device="cpu", dtype="float32",
                          moe_strategy="resident", kv_tokens=256,
                          fault_inject="device_lost@step=3")
    core, sup = _supervised(config)
    try:
        core.add_request(GenerateRequest("a", [5, 6, 7], GREEDY))
        core.add_request(GenerateRequest("b", [8, 9], GREEDY))
        sup.step()
        sup.step()
        with pytest.raises(DeviceLost) as info:
            sup.step()
    finally:
        sup.close()
        core.close()
    failed = info.value.evidence["failed_step"]
    assert sorted(failed["request_ids"]) == ["a", "b"]
    assert (failed["prefill_tokens"], failed["decode_tokens"]) == (0, 2)
    assert failed["step"] == 3
    report = json.loads(Path(info.value.evidence["crash_report"]).read_text())
    assert report["evidence"]["failed_step"] == failed
    assert report["flight_recorder"][-1]["kind"] == "decode"
