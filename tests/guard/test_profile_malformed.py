"""A profile file that `--moe-strategy auto` cannot use (cut short, not JSON, not UTF-8, another
run's key, a pick or rows of the wrong shape) is ignored with one warning naming the file and
what is wrong, never a traceback and never silence; auto then states what it assumed."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from ftrs.cli import main
from ftrs.config import EngineConfig
from ftrs.guard.startup import resolve_auto_config

from .test_auto_everywhere import BACKEND, write_hybrid_profile


def edit(profile: dict[str, Any], variant: str) -> str:
    """The profile's text, changed as `variant` says."""
    pick = profile["pick"]
    changes: dict[str, Any] = {
        "list": [1, 2], "no_key": {k: v for k, v in profile.items() if k != "key"},
        "pick_empty": profile | {"pick": {}},
        "pick_str": profile | {"pick": "resident"}, "pick_null": profile | {"pick": None},
        "no_label": profile | {"pick": {k: v for k, v in pick.items() if k != "label"}},
        "total_str": profile | {"pick": pick | {"total_s": "fast"}},
        "turbo": profile | {"pick": pick | {"strategy": "turbo"}},
        "auto": profile | {"pick": pick | {"strategy": "auto"}},
        "rate_7": profile | {"pick": pick | {"cache_rate": 7}},
        "rate_0": profile | {"pick": pick | {"cache_rate": 0}},
        "no_rows": {k: v for k, v in profile.items() if k != "rows"},
        "rows_ints": profile | {"rows": [1, 2]},
        "other_model": profile | {"key": profile["key"] | {"model": "other:1"}},
    }
    return json.dumps(changes[variant])


VARIANTS = {
    "list": "[1, 2] is not a JSON object",
    "no_key": "key is missing",
    "pick_empty": "pick.strategy is missing",
    "pick_str": 'pick is "resident", not an object',
    "pick_null": "pick is null, not an object",
    "no_label": "pick.label is missing",
    "total_str": 'pick.total_s is "fast", not a time in seconds',
    "turbo": 'pick.strategy is "turbo", not one of resident, offload, hybrid',
    "auto": 'pick.strategy is "auto", not one of resident, offload, hybrid',
    "rate_7": "pick.cache_rate is 7, not in (0, 1] or null",
    "rate_0": "pick.cache_rate is 0, not in (0, 1] or null",
    "no_rows": "rows is missing",
    "rows_ints": "rows is [1, 2], not a list of objects",
}


def resolve(model: Path, home: Path, caplog: pytest.LogCaptureFixture) -> EngineConfig:
    config = EngineConfig(model=str(model), device="cpu", moe_strategy="auto",
                          copy_backend=BACKEND)
    with caplog.at_level(logging.INFO, logger="ftrs"):
        return resolve_auto_config(config, home=home)


def warned(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_malformed_profile_is_one_warning_and_the_stated_assumption(
        variant: str, tiny_models: dict[str, Path], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_models["qwen3_moe"]
    path = write_hybrid_profile(model, tmp_path)
    path.write_text(edit(json.loads(path.read_text()), variant))
    resolved = resolve(model, tmp_path, caplog)
    assert warned(caplog) == [f"ignoring profile {path}: {VARIANTS[variant]}"]
    assert resolved.moe_strategy == "resident"  # the assumption on the CPU, said as such
    assert "auto: no usable profile for " in caplog.text and "assumed resident" in caplog.text


@pytest.mark.parametrize(("content", "why"), [
    (None, "not valid JSON (Unterminated string"), (b"", "not valid JSON (Expecting value"),
    (b"\xff\xfe\x00garbage", "not UTF-8 text (invalid start byte at byte 0)")])
def test_a_profile_that_does_not_parse_is_not_taken_for_none(
        content: bytes | None, why: str, tiny_models: dict[str, Path], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_models["qwen3_moe"]
    path = write_hybrid_profile(model, tmp_path)
    text = path.read_bytes()
    path.write_bytes(text[:text.index(b'"strategy"') + 5] if content is None else content)
    resolve(model, tmp_path, caplog)
    [line] = warned(caplog)
    assert line.startswith(f"ignoring profile {path}: {why}"), line


def test_another_runs_key_is_named_exactly(tiny_models: dict[str, Path], tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_models["qwen3_moe"]
    path = write_hybrid_profile(model, tmp_path)
    profile = json.loads(path.read_text())
    path.write_text(edit(profile, "other_model"))
    resolve(model, tmp_path, caplog)
    assert warned(caplog) == [f"ignoring profile {path}: its key is another run's: model other:1 "
                              f"(this run: {profile['key']['model']})"]


def test_generate_with_a_malformed_profile_runs_and_says_why(
        tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_models["qwen3_moe"]
    monkeypatch.setenv("FTRS_HOME", str(tmp_path))
    path = write_hybrid_profile(model, tmp_path)
    path.write_text(edit(json.loads(path.read_text()), "pick_empty"))
    with caplog.at_level(logging.INFO, logger="ftrs"):
        assert main(["generate", "--model", str(model), "--device", "cpu", "--moe-strategy",
                     "auto", "--copy-backend", BACKEND, "--raw", "--max-tokens", "2", "Hi"]) == 0
    assert [w for w in warned(caplog) if "profile" in w] == [
        f"ignoring profile {path}: pick.strategy is missing"]
