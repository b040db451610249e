"""`--moe-strategy auto` runs the `ftrs bench strategy` profile's pick in `ftrs generate` and
`ftrs.LLM` as in `ftrs serve` (one resolution, `guard.startup.resolve_auto_config`), and says
what it picked."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from ftrs.cli import main
from ftrs.config import EngineConfig
from ftrs.guard.bench_strategy import device_name, link_id, model_id
from ftrs.guard.profile import profile_key, write_profile
from ftrs.guard.startup import apply_link_guard, resolve_auto_config, resolve_auto_line

BACKEND = "simulated:0.1"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("FTRS_HOME", str(h))
    return h


def write_hybrid_profile(model: Path, home: Path, backend: str = BACKEND) -> Path:
    """A profile for this host, the CPU device, `model` and `backend` that picked hybrid@0.5."""
    key = profile_key(device=device_name("cpu"), host=socket.gethostname(),
                      model=model_id(str(model)), link=link_id(backend))
    pick = {"label": "hybrid@0.5", "strategy": "hybrid", "cache_rate": 0.5, "total_s": 1.25}
    return write_profile({"pick": pick, "rows": [pick]}, key, home)


def test_llm_runs_the_profile_pick_and_logs_it(tiny_models: dict[str, Path], home: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    from ftrs.llm import LLM

    model = tiny_models["qwen3_moe"]
    path = write_hybrid_profile(model, home)
    with caplog.at_level(logging.INFO, logger="ftrs"):
        llm = LLM(str(model), device="cpu", moe_strategy="auto", copy_backend=BACKEND)
    try:
        assert (llm.config.moe_strategy, llm.config.moe_cache_rate) == ("hybrid", 0.5)
        assert llm.engine.config.moe_strategy == "hybrid"  # the engine built is the pick
        assert f"auto: hybrid@0.5 from profile {path}" in caplog.text
        # without logging at INFO a library user reads the line off the LLM
        assert llm.auto_line is not None
        assert llm.auto_line.startswith(f"auto: hybrid@0.5 from profile {path} (measured 1.250 s")
    finally:
        llm.close()


def test_auto_line_is_none_for_any_other_strategy(tiny_models: dict[str, Path],
                                                  home: Path) -> None:
    config = EngineConfig(model=str(tiny_models["qwen3_moe"]), device="cpu",
                          moe_strategy="offload")
    assert resolve_auto_line(config, home=home) == (config, None)
    auto = EngineConfig(model=str(tiny_models["qwen3_moe"]), device="cpu", moe_strategy="auto",
                        copy_backend=BACKEND)
    resolved, line = resolve_auto_line(auto, home=home)
    assert resolved.moe_strategy == "resident"
    assert line is not None and line.startswith("auto: no profile for ")


def test_generate_says_auto_picked_the_profile(tiny_models: dict[str, Path], home: Path,
                                               caplog: pytest.LogCaptureFixture,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_models["qwen3_moe"]
    path = write_hybrid_profile(model, home)
    with caplog.at_level(logging.INFO, logger="ftrs"):
        assert main(["generate", "--model", str(model), "--device", "cpu", "--moe-strategy",
                     "auto", "--copy-backend", BACKEND, "--raw", "--max-tokens", "2", "Hi"]) == 0
    assert f"auto: hybrid@0.5 from profile {path}" in caplog.text
    assert "tokens in" in capsys.readouterr().err


def test_serve_and_llm_resolve_auto_alike(tiny_models: dict[str, Path], home: Path) -> None:
    model = tiny_models["qwen3_moe"]
    write_hybrid_profile(model, home)
    config = EngineConfig(model=str(model), device="cpu", moe_strategy="auto",
                          copy_backend=BACKEND)
    served, _ = apply_link_guard(config, explicit_max_prefill=False, home=home, measure=False)
    resolved = resolve_auto_config(config, home=home)
    assert (resolved.moe_strategy, resolved.moe_cache_rate) == ("hybrid", 0.5)
    assert (served.moe_strategy, served.moe_cache_rate) == ("hybrid", 0.5)


def test_without_a_profile_auto_states_its_assumption(tiny_models: dict[str, Path], home: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    config = EngineConfig(model=str(tiny_models["qwen3_moe"]), device="cpu",
                          moe_strategy="auto", copy_backend=BACKEND)
    with caplog.at_level(logging.INFO, logger="ftrs"):
        resolved = resolve_auto_config(config, home=home)
    assert resolved.moe_strategy == "resident" and "auto: no profile for" in caplog.text


def test_other_strategies_and_dense_models_are_left_alone(tiny_models: dict[str, Path],
                                                          home: Path) -> None:
    offload = EngineConfig(model=str(tiny_models["qwen3_moe"]), device="cpu",
                           moe_strategy="offload")
    assert resolve_auto_config(offload, home=home) is offload
    dense = EngineConfig(model=str(tiny_models["qwen3"]), device="cpu", moe_strategy="auto")
    assert resolve_auto_config(dense, home=home) is dense  # the engine runs it as resident


@pytest.mark.parametrize(("given", "said"), [({"moe_cache_rate": 0.9}, "--moe-cache-rate 0.9"),
                                             ({"moe_cache_size": 5}, "--moe-cache-size 5")])
def test_a_given_cache_size_wins_over_the_profile(tiny_models: dict[str, Path], home: Path,
                                                  caplog: pytest.LogCaptureFixture,
                                                  given: dict[str, float], said: str) -> None:
    """auto takes only the strategy from the profile when the cache was sized by the user."""
    model = tiny_models["qwen3_moe"]
    path = write_hybrid_profile(model, home)
    config = EngineConfig(model=str(model), device="cpu", moe_strategy="auto",
                          copy_backend=BACKEND, **given)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="ftrs"):
        resolved = resolve_auto_config(config, home=home)
    assert resolved.moe_strategy == "hybrid"
    assert (resolved.moe_cache_rate, resolved.moe_cache_size) == (
        config.moe_cache_rate, config.moe_cache_size)
    assert (f"auto: hybrid@0.5 from profile {path}" in caplog.text
            and f"runs hybrid with the given {said}, not the cache rate 0.5" in caplog.text)
