"""`bench/hybrid.py` runs end to end on a tiny MoE: the sweep `docs/marginal-host.md` quotes and
`scripts/gpu-check.sh` runs on a lent GPU must not fail on its first strategy (it once built
offload and hybrid with no routers, and died in the prefetch ranker). Figures are not checked:
a tiny model's speed says nothing; the row's shape and the strategies' token counts do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_hybrid_bench_sweeps_every_strategy_on_a_tiny_moe(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    env = dict(os.environ, FTRS_HOME=str(tmp_path))
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "hybrid.py"), "--model", str(tiny_models["mixtral"]),
         "--links", "0.1", "2", "--rounds", "1", "--tokens", "3", "--slow-tokens", "2",
         "--layer-passes", "2"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["device"] == "cpu" and "CPU" in result["note"]
    rows = result["rows"]
    assert [r["link_gbps"] for r in rows] == [0.1, 2.0]
    for row, tokens in zip(rows, (2, 3), strict=True):
        for name in ("all_cpu", "offload", "hybrid"):
            assert row[name]["tok_per_s"] > 0, row
            assert row[name]["decode_tokens"] == tokens - 1, row  # the first from the prefill
        assert row["offload"]["mb_per_token"] > 0, row  # misses crossed the link
