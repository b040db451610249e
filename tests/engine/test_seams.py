"""EngineCore's public seams (`logits`, `set_step_budget`, `transfer_engine`, `expert_stats`,
`expert_pool_bytes`, `device`, `moe_strategy`, `use_moe_strategy`, `moe_parts`, `forward_once`) and the rule that nothing outside `ftrs/engine/` reaches into
the engine's runtime."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from ftrs.engine.protocol import GenerateRequest
from ftrs.errors import ConfigError, InvalidRequest
from ftrs.llm import LLM
from ftrs.moe.base import MoEStrategy
from ftrs.sampling import SamplingParams

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "ftrs"
IDS = [3, 17, 250, 41, 99, 500, 7, 8, 311, 42, 42, 42, 130, 64, 255, 1, 300, 12, 77, 5]
TOL = 1e-4


def hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    m = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_logits_after_generate_match_transformers(tiny_models: dict[str, Path],
                                                  arch: str) -> None:
    """A generate() leaves its pages in the prefix cache; logits() then needs them back, and
    must compute the shared prefix itself rather than take it from the cache. Three pages of
    16 tokens, a 7-token step budget: the prompt runs in one forward, or in chunks."""
    llm = LLM(str(tiny_models[arch]), kv_tokens=48, dtype="float32", max_prefill_length=7)
    llm.generate([IDS], SamplingParams(max_tokens=28, temperature=0, ignore_eos=True))
    assert llm.engine.pool.num_free == 1  # the cache holds the 2 pages logits() needs
    ref = hf_logits(tiny_models[arch], IDS)
    for chunked in (False, True):  # the second time the prompt's own pages are cached
        ours = llm.engine.logits(IDS, chunked=chunked) if chunked else llm.logits(IDS)
        assert ours.shape == ref.shape == (len(IDS), 512) and ours.dtype == torch.float32
        assert (ours - ref).abs().max().item() <= TOL
    assert llm.engine.step_budget() == 7
    out = llm.generate([IDS], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))  # and the engine serves on, with the prefix cached
    assert out[0].num_cached_tokens == 16 and len(out[0].token_ids) == 12


def test_logits_refuses_bad_prompts_and_a_busy_engine(tiny_models: dict[str, Path]) -> None:
    llm = LLM(str(tiny_models["llama"]), kv_tokens=64, dtype="float32")
    with pytest.raises(InvalidRequest):
        llm.logits([])
    with pytest.raises(InvalidRequest):
        llm.logits([512])  # outside the vocabulary
    llm.engine.add_request(GenerateRequest("busy", [1, 2, 3], SamplingParams(max_tokens=2)))
    with pytest.raises(InvalidRequest, match="other requests"):
        llm.logits([1, 2, 3])
    assert llm.engine.num_requests() == 1  # the other request is untouched


def test_step_budget_bounds_the_tokens_of_a_step(tiny_models: dict[str, Path]) -> None:
    llm = LLM(str(tiny_models["llama"]), kv_tokens=256, dtype="float32", max_prefill_length=64)
    eng = llm.engine
    eng.set_step_budget(5)
    assert eng.step_budget() == 5
    eng.add_request(GenerateRequest("a", list(range(1, 13)), SamplingParams(max_tokens=1)))
    _, stats = eng.step()
    assert stats.prefill_tokens == 5  # 12 prompt tokens, 5 a step
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError):
            eng.set_step_budget(bad)  # type: ignore[arg-type]
    assert eng.step_budget() == 5


def test_transfer_engine_and_expert_stats(tiny_models: dict[str, Path]) -> None:
    dense = LLM(str(tiny_models["llama"]), kv_tokens=64, dtype="float32")
    assert dense.engine.transfer_engine() is None and dense.engine.expert_stats() == {}
    assert dense.engine.device == torch.device("cpu")
    moe = LLM(str(tiny_models["mixtral"]), kv_tokens=64, dtype="float32",
              moe_strategy="offload", moe_cache_size=5, moe_prefetch=False)
    copier = moe.engine.transfer_engine()
    assert copier is not None and callable(copier.inject_fault) and callable(copier.set_pacing)
    moe.logits(IDS[:6])
    assert moe.engine.expert_stats()["distinct_experts"]  # the forward routed its tokens


def test_expert_pool_bytes_is_every_expert_in_fp32(tiny_models: dict[str, Path]) -> None:
    dense = LLM(str(tiny_models["llama"]), kv_tokens=64, dtype="float32")
    assert dense.engine.expert_pool_bytes() == 0
    # tiny mixtral: 3 MoE layers x 8 experts x (gate, up, down) of 64 x 96 fp32; each tensor
    # (24,576 bytes) is already a multiple of the pool's tensor alignment
    want = 3 * 8 * 3 * 64 * 96 * 4
    for strategy in ("resident", "offload"):
        moe = LLM(str(tiny_models["mixtral"]), kv_tokens=64, dtype="float32",
                  moe_strategy=strategy, moe_cache_size=2)
        assert moe.engine.expert_pool_bytes() == want
        moe.close()


def _reaches_into_the_engine(tree: ast.AST) -> list[tuple[int, str]]:
    """Attribute reads or writes of `.rt`, `.moe.engine`, or a write of `.budget`: the
    engine's private runtime and the scheduler's budget. Also `getattr(x, "rt", ...)`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr == "rt":
                found.append((node.lineno, ".rt"))
            elif (node.attr == "engine" and isinstance(node.value, ast.Attribute)
                  and node.value.attr == "moe"):
                found.append((node.lineno, ".moe.engine"))
            elif node.attr == "budget" and isinstance(node.ctx, ast.Store):
                found.append((node.lineno, ".budget ="))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in ("rt", "budget")):
            found.append((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
    return found


def test_the_scan_sees_what_it_looks_for() -> None:
    src = ("a = eng.rt.moe\nb = core.rt.moe.engine\neng.scheduler.budget = 5\n"
           "getattr(engine, 'rt', None)\nok = eng.transfer_engine()\nn = s.budget\n")
    assert [w for _, w in sorted(_reaches_into_the_engine(ast.parse(src)))] == [
        ".rt", ".moe.engine", ".rt", ".budget =", "getattr(..., 'rt')"]


def test_nothing_outside_the_engine_reaches_into_it() -> None:
    """Only `ftrs/engine/` (and the scheduler, which owns its budget) may touch the runtime."""
    allowed = {PACKAGE / "engine", PACKAGE / "scheduler"}
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if any(d in path.parents for d in allowed):
            continue
        for line, what in _reaches_into_the_engine(ast.parse(path.read_text(), str(path))):
            offenders.append(f"{path.relative_to(PACKAGE)}:{line}: {what}")
    assert offenders == []


class _Counting(MoEStrategy):
    """Delegates to a strategy and counts the tokens of each forward it sees."""

    name = "counting"

    def __init__(self, inner: MoEStrategy) -> None:
        self.inner = inner
        self.forwards: list[int] = []

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        return self.inner.forward(layer, x, ids, weights)

    def begin_forward(self, num_tokens: int) -> None:
        self.forwards.append(num_tokens)
        self.inner.begin_forward(num_tokens)

    def end_forward(self) -> None:
        self.inner.end_forward()


def test_moe_seams_swap_strategies_and_run_a_bare_forward(tiny_models: dict[str, Path]) -> None:
    """`moe_strategy`/`use_moe_strategy`/`moe_parts`/`forward_once`: what the benches use instead
    of the runtime. An offload strategy built from `moe_parts` must give resident's tokens (it
    is bit-identical to resident on the CPU), so the parts are this model's."""
    llm = LLM(str(tiny_models["qwen3_moe"]), kv_tokens=128, dtype="float32")
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = llm.generate([IDS], greedy)[0].token_ids
    resident = llm.engine.moe_strategy()
    assert resident is not None
    counting = _Counting(resident)
    assert llm.engine.use_moe_strategy(counting) is resident
    free = llm.engine.pool.num_free
    llm.engine.forward_once(IDS[:9])
    assert counting.forwards == [9] and llm.engine.pool.num_free == free  # pages given back
    with pytest.raises(InvalidRequest):
        llm.engine.forward_once([])

    from ftrs.moe.offload import OffloadStrategy

    parts = llm.engine.moe_parts()
    assert sorted(parts.routers) == list(parts.spec.moe_layers)
    assert parts.experts.num_experts_total == len(parts.spec.moe_layers) * parts.spec.num_experts
    config = dataclasses.replace(llm.config, moe_strategy="offload", moe_cache_size=5,
                                 moe_cache_rate=None, copy_backend="host")
    offload = OffloadStrategy(experts=parts.experts, device=parts.device, config=config,
                              routers=parts.routers)
    assert llm.engine.use_moe_strategy(offload) is counting
    assert llm.generate([IDS], greedy)[0].token_ids == want
    assert offload.stats()["misses"] > 0  # the tokens came through the swapped-in strategy
    llm.engine.use_moe_strategy(resident)
    offload.close()

    dense = LLM(str(tiny_models["llama"]), kv_tokens=64, dtype="float32")
    assert dense.engine.moe_strategy() is None
    with pytest.raises(ConfigError):
        dense.engine.moe_parts()
    with pytest.raises(ConfigError):
        dense.engine.use_moe_strategy(counting)
