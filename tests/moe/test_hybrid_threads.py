"""`--cpu-expert-threads`: physical cores minus one by default (at least one), and an idle
server's kernel threads never spin.

Run in a fresh interpreter: the kernels' thread count is process-wide, and other tests set it.
Oracles: the cores listed in /proc/cpuinfo (not the sysfs topology the kernels read), and the
process's CPU time over a second of idling (a spinning thread would use about that second).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import json, sys, time
from ftrs.llm import LLM
from ftrs.moe.hybrid import CostModel
from ftrs.sampling import SamplingParams

path = sys.argv[1]
opts = dict(device="cpu", dtype="float32", kv_tokens=512, moe_strategy="hybrid",
            moe_cache_rate=0.5)
greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
prompt = list(range(3, 40))  # 37 rows: the projections' kernels split across the pool
llm = LLM(path, **opts)
default = llm.engine.rt.moe.threads
llm.generate([prompt], greedy)
llm.close()
llm = LLM(path, cpu_expert_threads=2, **opts)
moe = llm.engine.rt.moe
moe.cost = CostModel(1e12, 2.5e-6, cpu_s_per_token=2e-6, learn=False)  # copies and CPU experts
llm.generate([prompt], greedy)
s = moe.stats()
time.sleep(0.3)  # past the few polling rounds a worker takes after its last job
t0 = time.process_time()
time.sleep(1.0)
idle = time.process_time() - t0
print(json.dumps({"default": default, "set": s["cpu_expert_threads"], "idle_cpu_s": idle,
                  "fetched": s["fetched"], "cpu_computed": s["cpu_computed"]}))
llm.close()
"""


def physical_cores() -> int | None:
    """Distinct (package, core) pairs of the CPUs this process may run on, from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    allowed = os.sched_getaffinity(0)
    cores = set()
    for block in text.strip().split("\n\n"):
        f = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in block.splitlines())}
        if "processor" in f and "core id" in f and int(f["processor"]) in allowed:
            cores.add((f.get("physical id", "0"), f["core id"]))
    return len(cores) or None


def test_default_threads_and_idle_threads_sleep(tmp_path: Path) -> None:
    cores = physical_cores()
    if cores is None:
        pytest.skip("no core ids in /proc/cpuinfo")
    quant_models = pytest.importorskip("quant_models")
    gguf = quant_models.build("qwen3_moe", quant_models.QWEN3MOE_TYPES, tmp_path)[0]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(gguf)], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["default"] == max(1, cores - 1)
    assert got["set"] == 2
    assert got["fetched"] > 0 and got["cpu_computed"] > 0  # both the link and the CPU ran
    # a thread spinning through the idle second would add about 1 s
    assert got["idle_cpu_s"] < 0.1, got
