"""Rule 3 of the startup guard (guard.policy) with aged crash reports: reports are written
with hand-set timestamps and aged at a hand-set `now`; expected caps are computed here from
the rule: k losses at the smallest recorded chunk C cap at max(floor, C >> k)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from ftrs.config import EngineConfig
from ftrs.doctor import build_report, format_text
from ftrs.errors import DeviceLost, EngineHang
from ftrs.guard.fetch import FetchModel
from ftrs.guard.link import LinkState
from ftrs.guard.policy import (
    DEFAULT_LOSS_MAX_AGE_DAYS,
    GuardDecision,
    decide_prefill_cap,
    report_time,
)
from ftrs.guard.startup import apply_link_guard, load_reports
from ftrs.health.crash import load_crash_report, write_crash_report
from ftrs.models.tiny import make_tiny

from .conftest import GPU

NOW = dt.datetime(2026, 6, 1, 12, 0, tzinfo=dt.timezone.utc)
DEMO = FetchModel("demo", 3 * 1536 * 576 * 2, 30, 8, 2)  # 1.27 GB a chunk: fits Gen3 x16's window
GEN3_X16 = LinkState(device="cuda", bdf=GPU, gen_current=3, gen_max=3, width_current=16,
                     width_max=16, link_source="test")


def lost(home: Path, days_ago: float, chunk: int | None, bdf: str | None = GPU) -> Path:
    steps = [{"step": 1, "chunk_tokens": 64}, {"step": 2, "chunk_tokens": chunk}] if chunk else []
    return write_crash_report(home, DeviceLost("GPU fell off the bus",
                                               evidence={"bdf": bdf} if bdf else {}),
                              flight_recorder=steps, now=NOW - dt.timedelta(days=days_ago))


def decide(home: Path, now: dt.datetime | None = NOW,
           max_loss_age_days: float = DEFAULT_LOSS_MAX_AGE_DAYS) -> GuardDecision:
    return decide_prefill_cap(GEN3_X16, DEMO, requested=8192, crash_reports=load_reports(home),
                              now=now, max_loss_age_days=max_loss_age_days)


def test_default_window_matches_the_engine_flag() -> None:
    assert EngineConfig().guard_loss_max_age_days == DEFAULT_LOSS_MAX_AGE_DAYS == 30.0


def test_a_recent_loss_caps(tmp_path: Path) -> None:
    lost(tmp_path, days_ago=2, chunk=8192)
    d = decide(tmp_path)
    assert d.cap_tokens == 4096
    assert any("in the last 30 days" in r and "8192 -> 4096" in r for r in d.reasons)


def test_an_expired_loss_is_listed_and_does_not_cap(tmp_path: Path) -> None:
    path = lost(tmp_path, days_ago=365, chunk=8192)
    d = decide(tmp_path)
    assert d.cap_tokens is None
    assert (f"DeviceLost report {path.name} is 365 days old, over the 30-day window: "
            "expired, ignored") in d.reasons
    assert d.numbers["expired_device_lost_reports"] == [str(path)]
    assert "device_lost_reports" not in d.numbers


def test_the_window_edge_and_its_flag(tmp_path: Path) -> None:
    lost(tmp_path, days_ago=30, chunk=8192)  # exactly 30 days: still counts
    assert decide(tmp_path).cap_tokens == 4096
    assert decide(tmp_path, now=NOW + dt.timedelta(seconds=1)).cap_tokens is None
    assert decide(tmp_path, max_loss_age_days=7).cap_tokens is None
    assert decide(tmp_path, now=None).cap_tokens == 4096  # no now: nothing expires


def test_a_mix_counts_only_the_recent_losses(tmp_path: Path) -> None:
    old_small = lost(tmp_path, days_ago=90, chunk=1024)  # would cap at 512 if it counted
    lost(tmp_path, days_ago=40, chunk=None)  # would halve once more if it counted
    recent = lost(tmp_path, days_ago=1, chunk=8192)
    d = decide(tmp_path)
    assert d.cap_tokens == 4096
    assert d.numbers["device_lost_reports"] == [str(recent)]
    assert d.numbers["lost_chunk_tokens"] == 8192
    expired = [r for r in d.reasons if "expired, ignored" in r]
    assert len(expired) == 2 and old_small.name in expired[0]
    # A year on, the recent one has expired too: no cap at all.
    later = decide(tmp_path, now=NOW + dt.timedelta(days=365))
    assert later.cap_tokens is None


@pytest.mark.parametrize(("chunks", "cap"), [
    ([8192], 8192 >> 1),
    ([8192, 8192], 8192 >> 2),  # two losses at one size: stricter than one
    ([8192, 8192, 8192], 8192 >> 3),
    ([8192, 4096], 4096 >> 1),  # died again at the new ceiling: bisect from there
    ([8192, 4096, 4096], 4096 >> 2),
    ([8192, None], 8192 >> 2),  # a loss with no chunk recorded counts at the smallest size
    ([None, None], 8192 >> 2),  # none recorded: the cap halves once per loss
    ([1024, 1024, 1024], 256),  # never below the floor
])
def test_several_recent_losses_are_stricter_than_one(tmp_path: Path, chunks: list[int | None],
                                                     cap: int) -> None:
    for n, chunk in enumerate(chunks):
        lost(tmp_path, days_ago=10 - n, chunk=chunk)
    d = decide(tmp_path)
    assert d.cap_tokens == cap


def test_losses_of_other_devices_and_other_faults_never_count(tmp_path: Path) -> None:
    lost(tmp_path, days_ago=1, chunk=8192, bdf="0000:03:00.0")
    write_crash_report(tmp_path, EngineHang("stuck"), now=NOW)
    assert decide(tmp_path).cap_tokens is None


def test_report_time_falls_back_to_the_file_name(tmp_path: Path) -> None:
    path = lost(tmp_path, days_ago=3, chunk=8192)
    data = json.loads(path.read_text())
    data["created_at"] = "not a time"
    path.write_text(json.dumps(data))
    when = report_time(load_crash_report(path))
    assert when is not None and abs(when - (NOW - dt.timedelta(days=3))) < dt.timedelta(seconds=1)
    # Neither the field nor the name reads: the report counts (the guard errs on the safe side).
    odd = path.with_name("odd-DeviceLost.json")
    path.rename(odd)
    assert report_time(load_crash_report(odd)) is None
    assert decide(tmp_path, now=NOW + dt.timedelta(days=999)).cap_tokens == 4096


# ---------------------------------------------------------------- doctor and the serve start


def test_doctor_marks_expired_reports(empty_sysfs: Path, tmp_path: Path) -> None:
    model = make_tiny("qwen3_moe", tmp_path / "m", seed=0)
    home = tmp_path / "home"
    old = lost(home, days_ago=200, chunk=1024, bdf=None)
    new = lost(home, days_ago=5, chunk=2048, bdf=None)
    r = build_report(str(model), sysfs_root=empty_sysfs, home=home, measure=False, now=NOW)
    by_file = {c["file"]: c for c in r["crash_reports"]}
    assert by_file[old.name]["expired"] is True and by_file[new.name]["expired"] is False
    assert round(by_file[old.name]["age_days"]) == 200
    offload = r["model"]["recommendation"]["prefill_ceiling_if_offload"]
    assert offload["cap_tokens"] == 1024  # half of 2048: the expired 1024-token loss is ignored
    text = format_text(r)
    assert "crash reports: 2 (1 older than 30 days: expired, ignored by the link guard)" in text
    assert f"{old.name}: DeviceLost: GPU fell off the bus (200 days old) — expired, ignored" in text
    assert f"{new.name}: DeviceLost: GPU fell off the bus (5 days old)\n" in text + "\n"
    wide = build_report(None, sysfs_root=empty_sysfs, home=home, measure=False, now=NOW,
                        max_loss_age_days=365)
    assert not any(c["expired"] for c in wide["crash_reports"])


def test_serve_start_ages_reports_with_the_config_window(tmp_path: Path) -> None:
    model = make_tiny("qwen3_moe", tmp_path / "m", seed=0)
    home = tmp_path / "home"
    lost(home, days_ago=20, chunk=2048, bdf=None)
    config = EngineConfig(model=str(model), device="cpu", moe_strategy="offload",
                          copy_backend="simulated:12")
    served, decision = apply_link_guard(config, explicit_max_prefill=False, home=home, now=NOW)
    assert decision is not None and served.max_prefill_length == 1024
    short = EngineConfig(model=str(model), device="cpu", moe_strategy="offload",
                         copy_backend="simulated:12", guard_loss_max_age_days=14)
    served, decision = apply_link_guard(short, explicit_max_prefill=False, home=home, now=NOW)
    assert decision is not None and served.max_prefill_length == 8192
    assert any("20 days old, over the 14-day window: expired, ignored" in r
               for r in decision.reasons)
