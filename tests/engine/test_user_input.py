"""What a user writes wrong, in `LLM(...)`, `SamplingParams(...)`, `generate(...)` or a CLI flag, is
refused by a typed error that names it, before any work; the forms people write for the right
thing (one stop string, None for none, lists) mean what they say."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ftrs.cli import main
from ftrs.config import EngineConfig
from ftrs.errors import ConfigError, InvalidRequest
from ftrs.llm import LLM
from ftrs.sampling import SamplingParams


@pytest.mark.parametrize(("options", "field"), [
    ({"moe_cache_rate": "0.5"}, "moe_cache_rate"),
    ({"model": None}, "model"),
    ({"kv_tokens": 1.5}, "kv_tokens"),
    ({"kv_tokens": True}, "kv_tokens"),
    ({"cuda_graphs": "yes"}, "cuda_graphs"),
    ({"kv_tokens": 0}, "kv_tokens"),
    ({"kv_tokens": -1}, "kv_tokens"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"max_model_len": -5}, "max_model_len"),
    ({"pcie_pacing": -1.0}, "pcie_pacing"),
    ({"pcie_pacing": float("nan")}, "pcie_pacing"),
    # checked whatever the strategy (resident here): not on the day offload is picked
    ({"copy_backend": "bogus"}, "copy_backend"),
    ({"copy_backend": "simulated:-1"}, "copy_backend"),
    ({"copy_backend": "simulated:abc"}, "copy_backend"),
    ({"copy_backend": "cuda:-1"}, "copy_backend"),
    ({"moe_cache_policy": "bogus"}, "moe_cache_policy"),
    ({"moe_cache_policy": "belady"}, "moe_cache_policy"),  # needs the future: offline only
])
def test_bad_engine_options_are_refused_by_name(options: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_kwargs(**options)
    assert str(e.value).startswith(f"{field}:") or f"{field}:" in str(e.value), str(e.value)


def test_good_engine_options_stay_accepted() -> None:
    assert EngineConfig.from_kwargs(model=Path("/some/dir")).model == "/some/dir"
    cfg = EngineConfig.from_kwargs(moe_cache_rate=1, pcie_pacing=0.0, kv_tokens=16,
                                   copy_backend="simulated:0.5:20", moe_cache_policy="lru")
    assert cfg.moe_cache_rate == 1 and cfg.copy_backend == "simulated:0.5:20"
    for spec in ("host", "cuda", "cuda:1", "auto"):  # a missing GPU is the engine's to say
        EngineConfig.from_kwargs(copy_backend=spec)


def test_stop_forms_mean_what_they_say() -> None:
    assert SamplingParams(stop="answer").stop == ("answer",)  # one string, not its letters
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")  # type: ignore[arg-type]
    assert SamplingParams(stop=None).stop == ()  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)  # type: ignore[arg-type]


def test_logit_bias_forms_mean_what_they_say() -> None:
    pairs = ((3, -100.0), (7, 2.5))
    for form in ({3: -100.0, 7: 2.5}, {"3": -100.0, "7": 2.5}, [[3, -100.0], [7, 2.5]],
                 [(3, -100.0), (7, 2.5)], pairs):
        assert SamplingParams(logit_bias=form).validate(100).logit_bias == pairs  # type: ignore[arg-type]


@pytest.mark.parametrize(("params", "field"), [
    ({"stop": ""}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop": [5]}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"temperature": True}, "temperature"),
    ({"logprobs": 1.5}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"seed": True}, "seed"),
    ({"top_k": 2.0}, "top_k"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {3: 101.0}}, "logit_bias"),
    ({"logit_bias": {100: 1.0}}, "logit_bias"),
    ({"logit_bias": [[3]]}, "logit_bias"),
])
def test_bad_sampling_params_are_refused_by_name(params: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**params).validate(100)
    assert e.value.evidence["param"] == field


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]) -> LLM:
    return LLM(str(tiny_models["qwen3_moe"]), kv_tokens=512)


def test_a_stop_string_is_one_string_in_generate(llm: LLM) -> None:
    free = llm.generate(["hello there"], SamplingParams(max_tokens=12, temperature=0,
                                                        ignore_eos=True))[0]
    assert len(free.text) > 3
    stop = free.text[2:4]  # two characters from the middle: stop there, not at any letter
    one = llm.generate(["hello there"], SamplingParams(max_tokens=12, temperature=0,
                                                       ignore_eos=True, stop=stop))[0]
    listed = llm.generate(["hello there"], SamplingParams(max_tokens=12, temperature=0,
                                                          ignore_eos=True, stop=[stop]))[0]
    assert (one.text, one.finish_reason) == (listed.text, listed.finish_reason)
    assert one.text == free.text[:free.text.index(stop)] and one.finish_reason == "stop"


@pytest.mark.parametrize("prompts", [
    [5], [None], [[[1]]], [[1.5, 2]], [[True, 2]], [b"hi"], b"hi", ["a\udc80b"],
], ids=["bare-id", "none", "nested", "float-ids", "bool-ids", "bytes-in-list", "bytes",
        "lone-surrogate"])
def test_bad_prompts_are_refused_by_name(llm: LLM, prompts: Any) -> None:
    with pytest.raises(InvalidRequest) as e:
        llm.generate(prompts, SamplingParams(max_tokens=2))
    assert e.value.evidence["param"] == "prompt"


def test_token_ids_of_any_integer_type_are_a_prompt(llm: LLM) -> None:
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    plain = llm.generate([[5, 6, 7]], params)[0].token_ids
    assert llm.generate([np.array([5, 6, 7])], params)[0].token_ids == plain
    assert llm.generate([(5, 6, 7)], params)[0].token_ids == plain


def test_params_of_another_type_are_refused(llm: LLM) -> None:
    with pytest.raises(InvalidRequest) as e:
        llm.generate(["hi"], {"max_tokens": 4})  # type: ignore[arg-type]
    assert e.value.evidence["param"] == "params"


def test_generate_refuses_bad_sampling_flags_before_loading(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A nonexistent model would be the first error if the flags waited for the load."""
    for flags, field in ((["--max-tokens", "0"], "max_tokens"),
                         (["--temperature", "-1"], "temperature")):
        rc = main(["generate", "--model", "/nonexistent/model", *flags, "hi"])
        err = capsys.readouterr().err
        assert rc != 0 and f"ftrs: error: {field}:" in err, err


def test_expert_cache_flags_with_resident_are_said_to_do_nothing(
        tiny_models: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    path = str(tiny_models["qwen3_moe"])
    with caplog.at_level("WARNING", logger="ftrs"):
        LLM(path, kv_tokens=64).close()
        assert "resident keeps every expert" not in caplog.text
        LLM(path, kv_tokens=64, moe_cache_rate=0.5, pcie_pacing=2.0).close()
    assert "--moe-cache-rate, --pcie-pacing: for --moe-strategy offload or hybrid" in caplog.text
