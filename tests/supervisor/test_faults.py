"""Fault-injection specs and the in-process half of the OOM rule (issue 5), no server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ftrs.engine.faults import FaultSpec, StepFaults, make_fake_sysfs, parse_fault_spec
from ftrs.engine.protocol import GenerateRequest
from ftrs.errors import ConfigError, DeviceLost, DeviceOutOfMemory
from ftrs.health.result import Status
from ftrs.health.sysfs import probe_pci
from ftrs.sampling import SamplingParams


@pytest.mark.parametrize(("text", "spec"), [
    ("device_lost@step=4", FaultSpec("device_lost", 4)),
    ("oom@step=3,running=10", FaultSpec("oom", 3, running=10)),
    (" hang @ step = 2 , running = 8 ", FaultSpec("hang", 2, running=8)),
    ("device_lost@after=1.5s", FaultSpec("device_lost", after_s=1.5)),
    ("device_lost@after=2", FaultSpec("device_lost", after_s=2.0)),
])
def test_parse(text: str, spec: FaultSpec) -> None:
    assert parse_fault_spec(text) == spec
    assert parse_fault_spec(str(spec)) == spec


@pytest.mark.parametrize("text", ["device_lost@step=0", "meteor@step=1", "oom@after=1s",
                                  "hang@after=2s", "device_lost", "oom@step=2,running=x"])
def test_parse_rejects(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_fault_spec(text)


class _Engine:
    def __init__(self, n: int) -> None:
        self.n = n

    def num_requests(self) -> int:
        return self.n


def test_running_counts_steps_from_the_first_full_step() -> None:
    faults = StepFaults(parse_fault_spec("oom@step=2,running=3"))
    engine = _Engine(1)
    for step in (1, 2, 3):  # not full yet: never fires
        faults.before_step(step, engine)
    engine.n = 3
    faults.before_step(4, engine)  # the first full step counts 1
    with pytest.raises(DeviceOutOfMemory):
        faults.before_step(5, engine)  # ... and the second fires
    faults.before_step(6, engine)  # once
    assert faults.fired


def test_device_lost_after_turns_the_fake_device_off_the_bus(tmp_path: Path) -> None:
    root = make_fake_sysfs(tmp_path)
    faults = StepFaults(parse_fault_spec("device_lost@after=0.05s"), root)
    faults.before_step(1, _Engine(0))  # a timed fault never fires at a step
    assert probe_pci("0000:01:00.0", root=root).status is Status.OK

    class Monitor:
        def inject(self, kind: str) -> None:
            raise AssertionError(kind)

    faults.attach_monitor(Monitor())
    assert faults._timer is not None
    faults._timer.join(2)
    assert faults.fired
    assert probe_pci("0000:01:00.0", root=root, was_present=True).status is Status.LOST
    faults.close()


def test_oom_fails_only_the_requests_of_the_failed_step(tiny_models: dict[str, Path]) -> None:
    """Two requests, room for one: the OOM at the copy backend fails the running one (named in
    the error's `failed_step`), the waiting one then runs to the end."""
    from ftrs.llm import LLM

    llm = LLM(str(tiny_models["mixtral"]), device="cpu", dtype="float32", moe_strategy="offload",
              moe_cache_size=2, moe_prefetch=False, max_running_requests=1)
    core: Any = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    core.add_request(GenerateRequest("a", [5, 6, 7], params))
    core.add_request(GenerateRequest("b", [8, 9, 10], params))
    core.step()  # a's prefill
    core.transfer_engine().inject_fault("oom", 0)
    with pytest.raises(DeviceOutOfMemory) as info:
        core.step()
    failed = info.value.evidence["failed_step"]
    assert failed["request_ids"] == ["a"] and failed["decode_tokens"] == 1
    events = core.fail_requests(failed["request_ids"], {"code": "device_out_of_memory"})
    assert [(e.request_id, e.finish_reason, e.error) for e in events] == [
        ("a", "error", {"code": "device_out_of_memory"})]
    assert core.num_requests() == 1
    done = []
    while core.has_work():
        done += [e for e in core.step()[0] if e.finish_reason is not None]
    assert [(e.request_id, e.finish_reason) for e in done] == [("b", "length")]
    assert core.fail_requests(["a", "zzz"], {}) == []  # gone or unknown: skipped


def test_device_lost_in_a_copy_names_the_failed_step(tiny_models: dict[str, Path]) -> None:
    from ftrs.llm import LLM

    llm = LLM(str(tiny_models["mixtral"]), device="cpu", dtype="float32", moe_strategy="offload",
              moe_cache_size=2, moe_prefetch=False, max_prefill_length=4)
    core: Any = llm.engine
    core.add_request(GenerateRequest("a", list(range(5, 17)), SamplingParams(max_tokens=4)))
    core.step()
    core.transfer_engine().inject_fault("device_lost", 0)
    with pytest.raises(DeviceLost) as info:
        core.step()  # the second 4-token chunk of a 12-token prompt
    ev = info.value.evidence
    assert ev["source"] == "copy_backend"
    assert ev["failed_step"] == {"step": 2, "request_ids": ["a"], "prefill_tokens": 4,
                                 "decode_tokens": 0}


def test_the_server_monitor_watches_the_engines_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the supervisor's monitor reads that GPU's config space (not only drills)."""
    import types

    import torch

    from ftrs.server.supervision import cuda_bdf

    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=4, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    assert cuda_bdf(gpu) == "0000:04:00.0"  # the field report's RTX 3090
    cpu = types.SimpleNamespace(device=torch.device("cpu"))
    assert cuda_bdf(cpu) is None and cuda_bdf(object()) is None


def test_the_server_monitor_asks_a_fresh_process_about_the_engines_gpu(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """DESIGN's fourth evidence of a lost device: a fresh process that cannot use the engine's
    GPU. The supervisor hands the monitor a child probe of that device (cuda:2 here); a CUDA
    error that the child then cannot reproduce past is a DeviceLost with the child's evidence."""
    import types

    import torch

    from ftrs.health import child
    from ftrs.health.monitor import DeviceMonitor, MonitorConfig
    from ftrs.health.result import Status
    from ftrs.server.device_probes import CHILD_PROBE_TIMEOUT_S, cuda_child_probe

    asked: list[tuple[str, float]] = []

    def fake_probe(device: str, *, timeout_s: float) -> child.ChildResult:
        asked.append((device, timeout_s))
        return child.ChildResult(probe="child", status=Status.LOST, outcome="timeout",
                                 reason=f"a fresh process could not use {device}",
                                 evidence={"child": "timeout"})

    monkeypatch.setattr(child, "probe_child", fake_probe)
    assert cuda_child_probe(types.SimpleNamespace(device=torch.device("cpu"))) is None
    assert cuda_child_probe(object()) is None
    probe = cuda_child_probe(types.SimpleNamespace(device=torch.device("cuda", 2)))
    assert probe is not None
    monitor = DeviceMonitor(MonitorConfig(bdf=None, sysfs_root=str(tmp_path)), child_probe=probe)
    verdict = monitor.diagnose(RuntimeError("CUDA error: unspecified launch failure"))
    assert asked == [("cuda:2", CHILD_PROBE_TIMEOUT_S)]
    assert isinstance(verdict, DeviceLost), verdict
    assert verdict.evidence["child_probe"]["outcome"] == "timeout"
    # and the supervisor wires it (its GPU's PCI address unknown here: only the child speaks)
    from ftrs.config import EngineConfig
    from ftrs.server import supervision

    monkeypatch.setenv("FTRS_HOME", str(tmp_path))
    monkeypatch.setattr(supervision, "cuda_bdf", lambda engine: None)
    engine = _Idle()
    engine.device = torch.device("cuda", 2)  # type: ignore[attr-defined]
    sup = supervision.EngineSupervisor(EngineConfig.from_kwargs(model="x"), engine)
    try:
        asked.clear()
        verdict = sup.monitor.diagnose(RuntimeError("CUDA error: unspecified launch failure"))
    finally:
        sup.close()
    assert asked == [("cuda:2", CHILD_PROBE_TIMEOUT_S)] and isinstance(verdict, DeviceLost)


class _Idle:
    """An engine whose steps do nothing (no copy engine: the drill raises the class)."""

    def step(self) -> tuple[list[Any], Any]:
        from ftrs.engine.protocol import StepStats

        return [], StepStats(1, 0.0, 0.0, "decode", 1, 0, 0, 1, 0.1)

    def num_requests(self) -> int:
        return 1


@pytest.mark.parametrize("kind", ["device_lost", "kernel_fault"])
def test_a_drill_writes_a_drill_report_the_guard_ignores(
        kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The drill's whole path in-process: the supervisor classifies the injected fault and
    writes the crash report; it is strict JSON marked as a drill, with its class's own hint,
    and the link guard caps nothing for it."""
    import json

    from ftrs.config import EngineConfig
    from ftrs.errors import KernelFault
    from ftrs.guard.fetch import FetchModel
    from ftrs.guard.link import LinkState
    from ftrs.guard.policy import decide_prefill_cap
    from ftrs.guard.startup import load_reports
    from ftrs.health.classify import HINT_FAULT, HINT_LOST
    from ftrs.server.supervision import EngineSupervisor

    monkeypatch.setenv("FTRS_HOME", str(tmp_path))
    sup = EngineSupervisor(EngineConfig.from_kwargs(model="x", fault_inject=f"{kind}@step=2"),
                           _Idle())
    try:
        sup.step()  # recorded: no power or temperature sampled
        with pytest.raises(DeviceLost if kind == "device_lost" else KernelFault):
            sup.step()
    finally:
        sup.close()
    assert sup.crash_report is not None

    def refuse(name: str) -> object:
        raise ValueError(name)

    data = json.loads(sup.crash_report.read_text(), parse_constant=refuse)  # no NaN
    assert data["drill"] is True
    assert data["hint"] == (HINT_LOST if kind == "device_lost" else HINT_FAULT)
    assert data["flight_recorder"] and data["flight_recorder"][-1]["power_w"] is None
    link = LinkState(device="cuda", bdf=None, gen_current=3, gen_max=3, width_current=16,
                     width_max=16, link_source="test")
    demo = FetchModel("demo", 3 * 1536 * 576 * 2, 30, 8, 2)
    d = decide_prefill_cap(link, demo, requested=8192, crash_reports=load_reports(tmp_path))
    assert d.cap_tokens is None
