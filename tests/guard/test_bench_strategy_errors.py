"""`ftrs bench strategy` on bad input and on failing candidates: every flag and the model are
checked before any candidate runs (one `ftrs: error:` line, no profile); a candidate refused
for bad input at run time stops the bench; one that fails for other reasons is a recorded row,
and when every one fails the bench says so in one line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cli_checks import one_error_line
from ftrs.cli import main
from ftrs.errors import ConfigError, DeviceOutOfMemory, FtrsError, ModelLoadError
from ftrs.guard import bench_strategy
from ftrs.guard.bench_strategy import BenchRow, Candidate, run_strategy_bench
from ftrs.guard.profile import load_profile, resolve_auto_strategy

SMALL = ("--prompt-tokens", "8", "--decode-tokens", "2")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("FTRS_HOME", str(h))
    return h


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The labels of the candidates the CLI ran: the engine runner replaced by one that records
    each candidate and measures nothing."""
    labels: list[str] = []

    def runner(model: str, **_: Any) -> Callable[[Candidate], BenchRow]:
        def run(c: Candidate) -> BenchRow:
            labels.append(c.label)
            return BenchRow(c.label, c.strategy, c.cache_rate, 0.1, 0.1, 0.2)
        return run

    monkeypatch.setattr(bench_strategy, "engine_runner", runner)
    return labels


@pytest.fixture(scope="module")
def truncated_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    quant_models = pytest.importorskip("quant_models")
    root = tmp_path_factory.mktemp("gguf")
    whole = quant_models.build("qwen3_moe", quant_models.QWEN3MOE_TYPES, root)[0]
    data = whole.read_bytes()
    cut = root / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])  # header whole, tensor data cut short
    return cut



BAD_FLAGS = [
    (("--device", "bogus"), "device: unsupported 'bogus'"),
    (("--dtype", "bogus"), "dtype: unknown dtype 'bogus'"),
    (("--prompt-tokens", "0"), "--prompt-tokens must be an integer >= 1, got 0"),
    (("--prompt-tokens", "-5"), "--prompt-tokens must be an integer >= 1, got -5"),
    (("--decode-tokens", "0"), "--decode-tokens must be an integer >= 2, got 0"),
    (("--decode-tokens", "-1"), "--decode-tokens must be an integer >= 2, got -1"),
    # the prefill makes the first token: one decode token would time no decode at all
    (("--decode-tokens", "1"), "--decode-tokens must be an integer >= 2, got 1 (the prefill "
                               "makes the first token"),
    (("--prompt-tokens", "100000"), "exceed the model's context of 2048 tokens"),
    (("--copy-backend", "bogus"), "unknown backend \"bogus\""),
    (("--copy-backend", "simulated:0"), "simulated link needs bandwidth > 0"),
    (("--copy-backend", "simulated:1:2:3"), "trailing fields"),
    (("--cache-rates", "1.5"), "--cache-rates must each be in (0, 1]"),
    (("--cache-rates", "0.5", "0"), "--cache-rates must each be in (0, 1]"),
    (("--cache-rates", "-0.5"), "--cache-rates must each be in (0, 1]"),
]


@pytest.mark.parametrize(("flags", "says"), BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_a_bad_flag_is_one_line_before_any_candidate_runs(
        flags: tuple[str, ...], says: str, tiny_models: dict[str, Path], home: Path,
        ran: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "strategy", "--model", str(tiny_models["qwen3_moe"]), "--device", "cpu",
            "--cache-rates", "0.5", *SMALL, *flags]  # a later flag overrides an earlier one
    assert main(argv) == ConfigError.exit_code
    one_error_line(capsys, says)
    assert ran == [] and not home.exists()


def test_a_missing_or_truncated_model_is_one_line_before_any_candidate_runs(
        truncated_gguf: Path, tmp_path: Path, home: Path, ran: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    for model, says in ((tmp_path / "nonexist", "no such file or directory"),
                        (truncated_gguf, "runs past the end of the file")):
        assert main(["bench", "strategy", "--model", str(model), "--device", "cpu", *SMALL]) == \
            ModelLoadError.exit_code
        one_error_line(capsys, str(model), says)
    assert ran == [] and not home.exists()


def test_a_dense_model_is_refused(tiny_models: dict[str, Path], home: Path, ran: list[str],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "strategy", "--model", str(tiny_models["qwen3"]), "--device", "cpu",
                 *SMALL]) == ConfigError.exit_code
    one_error_line(capsys, "dense model (qwen3, no routed experts)",
                    "no expert strategy to measure or pick")
    assert ran == [] and not home.exists()


def test_good_flags_run_every_candidate(tiny_models: dict[str, Path], home: Path,
                                        ran: list[str], capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    """The checks refuse what they should only: the same command, flags in range, runs."""
    assert main(["bench", "strategy", "--model", str(tiny_models["qwen3_moe"]), "--device",
                 "cpu", "--copy-backend", "simulated:2:5", "--cache-rates", "0.5", "1",
                 *SMALL]) == 0
    assert ran == ["resident", "offload@0.5", "hybrid@0.5", "offload@1", "hybrid@1"]
    assert "pick: " in capsys.readouterr().out
    assert len(list((home / "profiles").iterdir())) == 1


def test_bad_input_found_at_run_time_stops_the_bench_without_a_profile(tmp_path: Path) -> None:
    ran: list[str] = []

    def run(c: Candidate) -> BenchRow:
        ran.append(c.label)
        if c.strategy == "offload":
            raise ConfigError("copy_backend: refused by the engine")
        return BenchRow(c.label, c.strategy, c.cache_rate, 1.0, 1.0, 2.0)

    with pytest.raises(ConfigError, match="refused by the engine"):
        run_strategy_bench("m", cache_rates=(0.5, 1.0), copy_backend="simulated:1",
                           device="cpu", home=tmp_path, runner=run)
    assert ran == ["resident", "offload@0.5"]  # nothing after the refusal
    assert not (tmp_path / "profiles").exists()


def test_every_candidate_failing_is_one_line(tiny_models: dict[str, Path], home: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    def runner(model: str, **_: Any) -> Callable[[Candidate], BenchRow]:
        def run(c: Candidate) -> BenchRow:
            if c.strategy == "hybrid":
                raise RuntimeError("kernel\n  bug")  # said on one line all the same
            raise DeviceOutOfMemory("out of memory")
        return run

    monkeypatch.setattr(bench_strategy, "engine_runner", runner)
    rc = main(["bench", "strategy", "--model", str(tiny_models["qwen3_moe"]), "--device", "cpu",
               "--cache-rates", "0.5", *SMALL])
    assert rc == FtrsError.exit_code and rc != 0
    one_error_line(capsys, "every candidate failed, no profile written",
                    "resident, offload@0.5: DeviceOutOfMemory: out of memory",
                    "hybrid@0.5: RuntimeError: kernel bug")
    assert not home.exists()


def test_some_failing_are_recorded_in_the_profile(tmp_path: Path) -> None:
    def run(c: Candidate) -> BenchRow:
        if c.strategy == "resident":
            raise DeviceOutOfMemory("out of memory")
        return BenchRow(c.label, c.strategy, c.cache_rate, 1.0, 1.0, 2.0 + (c.cache_rate or 0))

    b = run_strategy_bench("m", cache_rates=(0.5, 1.0), copy_backend="simulated:1",
                           device="cpu", home=tmp_path, runner=run, strategies=("offload",))
    assert b.pick.label == "offload@0.5"
    prof = load_profile(b.key, tmp_path)
    assert prof is not None
    assert prof["failed"] == {"resident": "DeviceOutOfMemory: out of memory"}
    assert any(n.startswith("failed: resident: DeviceOutOfMemory: out of memory; the pick is "
                            "the fastest of the 2 candidate(s) that ran") for n in prof["notes"])
    assert "resident" in b.format_table() and "failed: DeviceOutOfMemory" in b.format_table()
    # strict JSON (no Infinity for the failed row's times), and auto counts what ran
    assert b.profile_path is not None
    json.loads(b.profile_path.read_text(), parse_constant=lambda c: pytest.fail(c))
    assert {r["label"]: r["total_s"] for r in prof["rows"]}["resident"] is None
    msg = resolve_auto_strategy(b.key, total_expert_bytes=1, device_budget_bytes=None,
                                home=tmp_path).message
    assert "fastest of 2 that ran" in msg, msg


def test_nothing_to_measure_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nothing to measure"):
        run_strategy_bench("m", cache_rates=(), resident=False, home=tmp_path,
                           runner=lambda c: BenchRow(c.label, c.strategy, c.cache_rate, 1, 1, 2))
