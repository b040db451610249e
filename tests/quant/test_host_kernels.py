"""The `--cpu-kernels` setting: `recommend_kernels` picks by the summed measured time and keeps
`auto` within its margin; the engine applies the setting to the process's kernels; a bad or
missing family is a `ConfigError`."""

from __future__ import annotations

from pathlib import Path

import pytest

core = pytest.importorskip("ftrs._core")

from ftrs.config import EngineConfig  # noqa: E402
from ftrs.errors import ConfigError  # noqa: E402
from ftrs.quant.host import recommend_kernels  # noqa: E402


def timings(avx2: tuple[float, float], avx512: tuple[float, float]) -> dict:
    return {"Q4_K": {"n1": {"avx2": avx2[0], "avx512": avx512[0]},
                     "n8": {"avx2": avx2[1], "avx512": avx512[1]}}}


def test_the_least_summed_time_wins_and_auto_is_kept_within_the_margin() -> None:
    r = recommend_kernels(timings((100, 800), (80, 900)), auto="avx512")
    assert r["totals_us"] == {"avx2": 900, "avx512": 980} and r["fastest"] == "avx2"
    assert r["setting"] == "avx2"  # auto's family 8.9 % slower: the other one is named
    r = recommend_kernels(timings((100, 800), (80, 840)), auto="avx512")
    assert r["fastest"] == "avx2" and r["setting"] == "auto"  # 2.2 % slower: within 3 %
    r = recommend_kernels(timings((100, 800), (80, 700)), auto="avx512")
    assert r["fastest"] == "avx512" and r["setting"] == "auto"
    only = {"Q8_0": {"n1": {"portable": 5.0}}}
    assert recommend_kernels(only, auto="portable")["setting"] == "auto"


def test_the_engine_applies_the_setting_and_refuses_a_bad_one(tmp_path: Path) -> None:
    from ftrs.llm import LLM
    from ftrs.models.tiny import make_tiny

    with pytest.raises(ConfigError, match="cpu_kernels"):
        EngineConfig(cpu_kernels="sse9")
    model = make_tiny("llama", tmp_path / "m", seed=0)
    pick = core.quant_kernels()[0]  # portable: every CPU runs it, and it is never auto's pick
    llm = LLM(str(model), kv_tokens=256, dtype="float32", device="cpu", cpu_kernels=pick)
    try:
        assert core.quant_kernel() == pick
    finally:
        llm.close()
        core.quant_set_kernel("auto")
    assert core.quant_kernel() == core.quant_kernels()[-1]
    missing = [k for k in ("avx2", "avx512") if k not in core.quant_kernels()]
    if missing:  # where this CPU lacks one, asking for it fails the start, saying so
        with pytest.raises(ConfigError, match="lacks"):
            LLM(str(model), kv_tokens=256, dtype="float32", device="cpu", cpu_kernels=missing[0])
