"""What `ftrs doctor` and the guard's reasons say reads true: offload's warnings under a
resident pick are marked as offload's, a dense model has no routed experts, a report with no
message is listed by its classification, and an unbounded loss window reads "at any age"."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from ftrs.doctor import build_report, format_text
from ftrs.guard.policy import decide_prefill_cap
from ftrs.guard.startup import load_reports

from .test_loss_age import DEMO, GEN3_X16, NOW, lost


def test_offload_warnings_under_a_resident_pick_are_marked_as_offloads(
        tiny_models: dict[str, Path], empty_sysfs: Path, tmp_path: Path) -> None:
    r = build_report(str(tiny_models["qwen3_moe"]), sysfs_root=empty_sysfs,
                     home=tmp_path / "home", measure=False)
    assert r["model"]["recommendation"]["strategy"] == "resident"  # no GPU
    text = format_text(r)
    assert "\n  if offload: warning: link bandwidth unknown: the window rule was skipped" in text
    assert "\n  warning: link bandwidth unknown" not in text


def test_a_dense_model_is_said_to_have_no_routed_experts(tiny_models: dict[str, Path],
                                                         empty_sysfs: Path,
                                                         tmp_path: Path) -> None:
    dense = tiny_models["qwen3"]
    r = build_report(str(dense), sysfs_root=empty_sysfs, home=tmp_path / "home", measure=False)
    text = format_text(r)
    assert f"model {dense}: no routed experts (a dense model)" in text
    assert "MoE layers x" not in text and "prefill chunk" not in text
    assert "decode at hit rate" not in text and "KV cache per token" in text
    assert ("recommended strategy: resident — a dense model: no routed experts, so no expert "
            "strategy to choose") in text


def test_a_report_without_a_message_is_listed_by_its_classification(
        empty_sysfs: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "crash").mkdir(parents=True)
    name = "20260601T120000.000Z-DeviceLost.json"
    (home / "crash" / name).write_text(json.dumps({
        "schema_version": 1, "classification": "DeviceLost", "message": None,
        "created_at": "2026-06-01T12:00:00+00:00"}))
    text = format_text(build_report(None, sysfs_root=empty_sysfs, home=home, measure=False,
                                    now=NOW))
    assert f"  {name}: DeviceLost (0 days old)" in text and "DeviceLost: None" not in text


def test_an_unbounded_loss_window_reads_at_any_age(tmp_path: Path) -> None:
    lost(tmp_path, days_ago=400, chunk=4096)
    d = decide_prefill_cap(GEN3_X16, DEMO, requested=8192, crash_reports=load_reports(tmp_path),
                           now=NOW + dt.timedelta(days=1), max_loss_age_days=float("inf"))
    assert d.cap_tokens == 2048
    [reason] = [r for r in d.reasons if "DeviceLost report(s)" in r]
    assert reason.startswith("1 DeviceLost report(s) for this device at any age ("), reason
    assert "inf" not in reason
