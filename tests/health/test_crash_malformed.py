"""A crash report whose fields have the wrong types (hand-edited, corrupted, another version's)
is refused by `load_crash_report` with a ValueError that names the file and the field, the
one error its readers catch; what a real report may hold still loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ftrs.errors import DeviceLost
from ftrs.health.crash import load_crash_report, write_crash_report


def report(**changes: Any) -> dict[str, Any]:
    body = {"schema_version": 1, "classification": "DeviceLost", "message": "GPU fell off the bus",
            "created_at": "2026-06-01T12:00:00+00:00", "evidence": {"xid": 79},
            "flight_recorder": [{"chunk_tokens": 8192}]}
    return body | changes


def write(tmp_path: Path, body: Any) -> Path:
    path = tmp_path / "20260601T120000.000Z-DeviceLost.json"
    path.write_text(json.dumps(body))
    return path


@pytest.mark.parametrize(("body", "why"), [
    (report(evidence=5), "evidence is 5, not an object"),
    (report(evidence="xid79"), 'evidence is "xid79", not an object'),
    (report(flight_recorder=5), "flight_recorder is 5, not a list"),
    (report(flight_recorder={"chunk_tokens": 8192}), "flight_recorder is {"),
    (report(flight_recorder=[[1, 2]]), "flight_recorder[0] is [1, 2], not an object"),
    (report(flight_recorder=[{"chunk_tokens": "big"}]),
     'flight_recorder[0].chunk_tokens is "big", not a token count'),
    (report(flight_recorder=[{"chunk_tokens": float("nan")}]),
     "flight_recorder[0].chunk_tokens is NaN, not a token count"),
    (report(flight_recorder=[{"chunk_tokens": 4096.7}]),
     "flight_recorder[0].chunk_tokens is 4096.7, not a token count"),
    (report(flight_recorder=[{"chunk_tokens": -8}]),
     "flight_recorder[0].chunk_tokens is -8, not a token count"),
    (report(flight_recorder=[{"chunk_tokens": True}]),
     "flight_recorder[0].chunk_tokens is true, not a token count"),
    (report(probes=[1, 2]), "probes is [1, 2], not an object"),
    (report(probes={"pci": 5}), "probes.pci is 5, not an object"),
    (report(classification=None, message=None), "classification is null, not a name"),
    (report(classification=7), "classification is 7, not a name"),
    (report(message=["x"]), 'message is ["x"], not a string'),
    ([1, 2, 3], "[1, 2, 3] is not a JSON object"),
])
def test_a_field_of_the_wrong_type_is_a_value_error_naming_it(tmp_path: Path, body: Any,
                                                              why: str) -> None:
    path = write(tmp_path, body)
    with pytest.raises(ValueError) as e:
        load_crash_report(path)
    assert str(e.value).startswith(f"{path}: not a readable crash report ({why}"), str(e.value)


def test_a_file_that_is_not_utf8_json_is_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match=r"not a readable crash report \(not UTF-8 text"):
        load_crash_report(path)
    path.write_text(json.dumps(report())[:40])
    with pytest.raises(ValueError, match=r"not a readable crash report \(not valid JSON"):
        load_crash_report(path)


def test_what_a_real_report_may_hold_still_loads(tmp_path: Path) -> None:
    # the recorder's -1 ("not known"), null message, evidence and probes, a time that is no
    # string (the guard then reads the file name's)
    r = load_crash_report(write(tmp_path, report(
        message=None, evidence=None, probes=None, created_at=12345,
        flight_recorder=[{"chunk_tokens": -1}, {"chunk_tokens": None}, {"step": 3}])))
    assert (r.classification, r.message, r.evidence, r.created_at) == ("DeviceLost", "", {}, "")
    written = write_crash_report(tmp_path / "home", DeviceLost("lost", evidence={"bdf": "x"}),
                                 flight_recorder=[{"chunk_tokens": 512}])
    assert load_crash_report(written).message == "lost"
