"""`ftrs serve` options: one per EngineConfig field, typed, defaults untouched when absent."""

from __future__ import annotations

import argparse
import logging
from dataclasses import fields

import pytest

from ftrs.cli import main
from ftrs.config import EngineConfig
from ftrs.errors import ConfigError
from ftrs.server.cli import add_serve_arguments, engine_config_from_args, port_number


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_every_engine_config_field_has_an_option() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    options = {o for a in parser._actions for o in a.option_strings}
    for f in fields(EngineConfig):
        assert "--" + f.name.replace("_", "-") in options, f.name


def test_defaults_match_engine_config_and_server_defaults() -> None:
    args = _parse()
    assert engine_config_from_args(args) == EngineConfig()
    assert (args.model, args.host, args.port, args.api_key) == ("demo", "127.0.0.1", 8000, None)


def test_options_are_typed() -> None:
    args = _parse("--model", "m", "--moe-cache-size", "8", "--no-moe-prefetch", "--pcie-pacing", "2.5",
                  "--moe-strategy", "offload", "--max-prefill-length", "1024")
    config = engine_config_from_args(args)
    assert config.model == "m"
    assert config.moe_cache_size == 8
    assert config.moe_prefetch is False
    assert config.pcie_pacing == 2.5
    assert config.moe_strategy == "offload"
    assert config.max_prefill_length == 1024


def test_bad_values_raise_typed_config_errors() -> None:
    with pytest.raises(ConfigError, match="page_size"):
        engine_config_from_args(_parse("--page-size", "3"))
    with pytest.raises(SystemExit):
        _parse("--moe-cache-size", "many")


@pytest.mark.parametrize("port", ["99999", "65536", "0", "-1", "abc"])
def test_a_bad_port_is_a_config_error_before_any_load(port: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match="--port"):
        port_number(port)
    assert main(["serve", "--port", port]) == 2  # before any model is loaded
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(said) == 1 and said[0].startswith("ftrs serve: --port: "), said
    assert "1-65535" in said[0] and "\n" not in said[0]


def test_ports_in_range_are_accepted() -> None:
    assert port_number("1") == 1 and port_number("65535") == 65535 and port_number(8000) == 8000


def test_help_names_the_host_default_and_every_parser(capsys: pytest.CaptureFixture[str]) -> None:
    from ftrs.server.reasoning import REASONING_PARSERS
    from ftrs.server.toolcalls import TOOL_PARSERS

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help's lines
    assert "--host HOST address to listen on (default 127.0.0.1)" in text
    # each option's help: after its last mention (the first is in the usage line)
    tools = text.rsplit("--tool-parser TOOL_PARSER", 1)[1].split("--reasoning-parser", 1)[0]
    reasoning = text.rsplit("--reasoning-parser REASONING_PARSER", 1)[1].split("--served", 1)[0]
    assert len(TOOL_PARSERS) == 10 and all(name in tools for name in TOOL_PARSERS), tools
    assert all(name in reasoning for name in REASONING_PARSERS), reasoning
    # `--seed` seeds the generator the engine draws unseeded requests' seeds from
    # (engine/core.py); it read as if every such request got that seed
    seed = text.rsplit("--seed SEED", 1)[1].split(" --", 1)[0]
    assert "generator of seeds" in seed and "identical unseeded requests still differ" in seed, seed
