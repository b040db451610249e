"""`ftrs_expert_cache_slots` of a live offload server: set when the engine is ready (its ready
message carries the strategy's counters), the same figure the steps report afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest
from ftrs_server_harness import ServerProcess, scrape

pytest.importorskip("ftrs.engine.core")


def test_the_expert_cache_slots_are_on_metrics_before_the_first_request(
        tmp_path: Path) -> None:
    import openai

    from ftrs.models.tiny import make_tiny

    model = make_tiny("qwen3_moe", tmp_path / "moe", seed=3)
    proc = ServerProcess(["--model", str(model), "--served-model-name", "tiny", "--device", "cpu",
                          "--dtype", "float32", "--moe-strategy", "offload",
                          "--moe-cache-rate", "0.5", "--copy-backend", "simulated:50"],
                         api_key=None, backend=None)
    try:
        proc.wait("ok")
        at_ready = scrape(proc.url)["ftrs_expert_cache_slots"]
        assert at_ready > 0
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0)
        client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2)
        assert scrape(proc.url)["ftrs_expert_cache_slots"] == at_ready
    finally:
        proc.stop()
