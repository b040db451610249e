"""A malformed crash report in `$FTRS_HOME/crash` (wrong field types) never stops `ftrs serve`'s
link guard or `ftrs doctor`: it is skipped with one warning, once a process, and the readable
reports beside it still count."""

from __future__ import annotations

import datetime as dt
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from ftrs.cli import main
from ftrs.config import EngineConfig
from ftrs.guard.policy import lost_chunk_tokens, report_bdf
from ftrs.guard.startup import apply_link_guard, load_reports
from ftrs.health.crash import CrashReport

NOW = dt.datetime(2026, 6, 2, 12, 0, tzinfo=dt.timezone.utc)  # the reports are a day old
BAD = {  # name: (the report's changed fields, why it is skipped)
    "evidence_int": ({"evidence": 5}, "evidence is 5, not an object"),
    "recorder_int": ({"flight_recorder": 5}, "flight_recorder is 5, not a list"),
    "chunk_str": ({"flight_recorder": [{"chunk_tokens": "big"}]},
                  'flight_recorder[0].chunk_tokens is "big", not a token count'),
    "chunk_nan": ({"flight_recorder": [{"chunk_tokens": float("nan")}]},
                  "flight_recorder[0].chunk_tokens is NaN, not a token count"),
    "probes_list": ({"probes": [1, 2]}, "probes is [1, 2], not an object"),
    "no_name": ({"classification": None, "message": None}, "classification is null, not a name"),
}


def write_report(home: Path, name: str, **changes: Any) -> Path:
    body = {"schema_version": 1, "classification": "DeviceLost", "message": "GPU fell off the bus",
            "created_at": "2026-06-01T12:00:00+00:00", "evidence": {"xid": 79},
            "flight_recorder": [{"chunk_tokens": 4096}]} | changes
    path = home / "crash" / f"20260601T120000.000Z-{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body))
    return path


def skips(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.getMessage().startswith("skipping ")]


@pytest.mark.parametrize("name", sorted(BAD))
def test_serve_skips_a_malformed_report_with_one_line(name: str, tiny_models: dict[str, Path],
                                                      tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    changes, why = BAD[name]
    home = tmp_path / "home"
    bad = write_report(home, name, **changes)
    config = EngineConfig(model=str(tiny_models["qwen3_moe"]), device="cpu",
                          moe_strategy="offload", moe_cache_rate=0.5, copy_backend="simulated:12")
    with caplog.at_level(logging.WARNING, logger="ftrs"):
        served, decision = apply_link_guard(config, explicit_max_prefill=False, home=home,
                                            measure=False, now=NOW)
    assert skips(caplog) == [f"skipping {bad}: not a readable crash report ({why})"]
    assert decision is not None and served.max_prefill_length == 8192  # it caps nothing


def test_the_readable_reports_beside_it_still_count(tiny_models: dict[str, Path],
                                                    tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_report(home, "BadOne", evidence=5)
    write_report(home, "DeviceLost")  # a loss at 4096: half of it
    config = EngineConfig(model=str(tiny_models["qwen3_moe"]), device="cpu",
                          moe_strategy="offload", moe_cache_rate=0.5, copy_backend="simulated:12")
    served, _ = apply_link_guard(config, explicit_max_prefill=False, home=home, measure=False,
                                 now=NOW)
    assert served.max_prefill_length == 2048


def test_a_malformed_report_is_warned_about_once_a_process(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    bad = write_report(tmp_path, "x", probes=[1, 2])
    with caplog.at_level(logging.WARNING, logger="ftrs"):
        assert load_reports(tmp_path) == [] and load_reports(tmp_path) == []
    assert skips(caplog) == [f"skipping {bad}: not a readable crash report (probes is [1, 2], "
                             "not an object)"]


def test_doctor_skips_it_with_one_line_and_exits_0(tiny_models: dict[str, Path], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("FTRS_HOME", str(home))
    bad = write_report(home, "DeviceLost", flight_recorder=[{"chunk_tokens": "big"}])
    with caplog.at_level(logging.WARNING, logger="ftrs"):
        assert main(["doctor", "--no-measure", "--model", str(tiny_models["qwen3_moe"])]) == 0
    assert skips(caplog) == [f"skipping {bad}: not a readable crash report (flight_recorder[0]"
                             '.chunk_tokens is "big", not a token count)']
    assert "crash reports: 0" in capsys.readouterr().out


def test_the_guard_reads_no_bdf_or_chunk_from_fields_of_the_wrong_type(tmp_path: Path) -> None:
    """`CrashReport` may be built from any dict: the guard's readers take what they can."""
    r = CrashReport(path=tmp_path / "r.json", created_at="", classification="DeviceLost",
                    message="", evidence={"bdf": 12},
                    data={"probes": [1, 2], "flight_recorder": [{"chunk_tokens": "big"},
                                                                {"chunk_tokens": True}, 5]})
    assert report_bdf(r) is None and lost_chunk_tokens(r) is None
    r = CrashReport(path=tmp_path / "r.json", created_at="", classification="DeviceLost",
                    message="", evidence={},
                    data={"probes": {"pci": 5, "nvml": {"bdf": "0000:04:00.0"}},
                          "flight_recorder": 5})
    assert report_bdf(r) == "0000:04:00.0" and lost_chunk_tokens(r) is None
