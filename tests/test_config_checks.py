"""EngineConfig refuses what cannot run (nan seconds, a KV pool under one page), the engine says
what it clamps, and the engine options' `--help` comes from the fields themselves."""

from __future__ import annotations

import logging
import math
from dataclasses import fields
from pathlib import Path

import pytest

from ftrs import __version__
from ftrs.cli import main
from ftrs.config import EngineConfig, _flag_type, option_help
from ftrs.errors import ConfigError

FLOAT_FIELDS = [f.name for f in fields(EngineConfig) if _flag_type(f.type)[0] is float]


@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_no_float_option_takes_nan(name: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name}:"):
        EngineConfig(**{name: math.nan})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["hang_timeout", "engine_restart_window", "guard_relax_after",
                                  "decode_stall_target", "pcie_pacing"])
def test_seconds_and_rates_are_finite(name: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name}:"):
        EngineConfig(**{name: math.inf})  # type: ignore[arg-type]


def test_inf_keeps_its_documented_meaning() -> None:
    assert EngineConfig(guard_loss_max_age_days=math.inf).guard_loss_max_age_days == math.inf
    assert EngineConfig(guard_relax_after=0.0).guard_relax_after == 0.0  # 0: never relax


@pytest.mark.parametrize("flag", ["--hang-timeout", "--engine-restart-window",
                                  "--guard-relax-after"])
def test_nan_seconds_are_refused_before_loading(flag: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", flag, "nan", "hi"]) == ConfigError.exit_code
    assert flag.removeprefix("--").replace("-", "_") + ":" in capsys.readouterr().err


def test_a_kv_pool_under_one_page_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--kv-tokens", "1", "hi"]) == ConfigError.exit_code
    err = capsys.readouterr().err
    assert "--kv-tokens 1 is less than one KV page (--page-size 16 tokens)" in err, err
    for kv, page in ((15, 16), (16, 32)):
        with pytest.raises(ConfigError, match=r"^kv_tokens:"):
            EngineConfig(kv_tokens=kv, page_size=page)
    assert EngineConfig(kv_tokens=16).kv_tokens == 16
    assert EngineConfig(kv_tokens=8, page_size=8).kv_tokens == 8


@pytest.mark.parametrize(("argv", "said"), [
    (["--max-tokens", "0", "hi"], "max_tokens:"), (["--temperature", "nan", "hi"], "temperature:"),
    (["--raw", ""], "prompt: empty"),
])
def test_generate_refuses_bad_sampling_flags_as_usage_errors(
        argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    # exit 2 like every other bad flag (was 1), and before the model: it does not exist here
    assert main(["generate", "--model", "/nonexistent/model", *argv]) == ConfigError.exit_code
    err = capsys.readouterr().err
    assert said in err and "nonexistent" not in err, err


def test_clamps_are_said(tiny_models: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    from ftrs.llm import LLM

    with caplog.at_level(logging.INFO, logger="ftrs"):
        LLM(str(tiny_models["llama"]), device="cpu", dtype="float32", kv_tokens=64,
            max_model_len=100_000_000, progress=False).close()
        LLM(str(tiny_models["mixtral"]), device="cpu", dtype="float32", kv_tokens=64,
            moe_strategy="offload", moe_cache_size=100_000, progress=False).close()
    text = caplog.text
    assert "--max-model-len 100000000 is more than the model's context: using 2048 tokens" in text
    assert ("context: 64 tokens per request, limited by the KV pool (--kv-tokens 64), not 2048"
            in text)
    assert ("--moe-cache-size 100000 is more than the model's 24 experts (all layers): using 24 "
            "slots" in text)


def help_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse's wrapping undone


@pytest.mark.parametrize("cmd", ["serve", "generate"])
def test_engine_options_say_what_they_take(cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = help_text([cmd, "--help"], capsys)
    assert "(default: None)" not in out
    assert "--moe-strategy MOE_STRATEGY resident | offload | hybrid | auto" in out
    assert "host | simulated:GBPS[:LAT_US] | cuda[:N]" in out
    assert "--kv-tokens KV_TOKENS KV pool capacity in tokens" in out
    assert "unset: sized from free memory" in out
    for f in fields(EngineConfig):
        text = option_help(f.name)
        assert text and "(default:" not in str(f.metadata["help"]), f.name
        assert "unset" in text if f.default is None else "(default: " in text, f.name


def test_version_and_command_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert help_text(["--version"], capsys) == f"ftrs {__version__}"
    gen = help_text(["generate", "--help"], capsys)
    assert "--max-tokens MAX_TOKENS tokens to generate at most (default: 64)" in gen
    assert "--temperature TEMPERATURE sampling temperature; 0: greedy (default: 0.0)" in gen
    assert "prompt the prompt" in gen
    bench = help_text(["bench", "strategy", "--help"], capsys)
    assert "--model MODEL model directory, GGUF file, or 'demo'" in bench
    assert "(default: 256)" in bench and "(default: 0.25 0.5 1)" in bench
    assert "--device DEVICE auto | cpu | cuda | cuda:N" in bench
