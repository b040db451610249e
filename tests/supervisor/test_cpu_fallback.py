"""`--on-device-lost cpu` on a quantized model: the restarted engine computes from the file's
bytes on the Rust kernels, not from dequantized copies, and says what a CPU run says.

Oracles: the restart config handed to the client (`install_policy`), the host pool's memory
(the experts' weights must be views into it), a spy on the Rust kernel entry point, and a CPU
run of the same file started on purpose with the strategy the user had asked for (hybrid,
bit-identical to resident on the CPU: tests/moe/test_hybrid.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ftrs.config import EngineConfig
from ftrs.errors import DeviceLost
from ftrs.quant.formats import QuantTensor
from ftrs.server.restart_policy import install_policy

from .fakes import FakeClient

IDS = [3, 17, 250, 41, 99, 500, 7, 8, 311, 42]


def _restart_config(config: EngineConfig) -> EngineConfig:
    client, server = FakeClient(config), SimpleNamespace(should_exit=False)
    install_policy(client, server, "cpu", grace_s=0.01)

    async def fail() -> None:
        client.on_failure(DeviceLost("gone", evidence={"pci_vendor": "0xffff"}))
        await asyncio.sleep(0.05)

    asyncio.run(fail())
    assert not server.should_exit
    (restarted, degraded), = client.restarts
    assert degraded["mode"] == "cpu" and degraded["device"] == "cpu"
    return restarted


def _llm(config: EngineConfig) -> Any:
    from ftrs.llm import LLM

    return LLM(**dataclasses.asdict(config))


def test_cpu_fallback_keeps_a_quantized_model_quantized(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    quant_models = pytest.importorskip("quant_models")
    gguf = quant_models.build("qwen3_moe", quant_models.QWEN3MOE_TYPES, tmp_path)[0]
    # what a GPU server with the hybrid strategy on the CUDA copy engine was running
    served = EngineConfig(model=str(gguf), device="cuda", dtype="auto", moe_strategy="hybrid",
                          moe_cache_rate=0.5, copy_backend="cuda",
                          fault_inject="device_lost@step=3", kv_tokens=1024)
    config = _restart_config(served)
    assert (config.device, config.fault_inject) == ("cpu", None)
    assert (config.moe_strategy, config.copy_backend) == ("resident", "auto")

    qmm = importlib.import_module("ftrs.quant.matmul")  # the module (the package exports the
    # function `matmul` under the same name)
    calls: list[tuple[str, int]] = []  # (block type, address of the weight's bytes)
    core = qmm._core_module()
    matmul = qmm._quant_matmul()

    def spy_matmul(qtype: str, w: Any, *rest: Any) -> None:
        calls.append((qtype, int(w.ctypes.data)))
        matmul(qtype, w, *rest)

    class Core:  # the extension, with the fused expert FFN calls recorded too
        def __getattr__(self, name: str) -> Any:
            return getattr(core, name)

        def quant_expert_ffn(self, gq: str, g: Any, uq: str, u: Any, dq: str, d: Any,
                             *rest: Any) -> None:
            calls.extend((q, int(w.ctypes.data)) for q, w in ((gq, g), (uq, u), (dq, d)))
            core.quant_expert_ffn(gq, g, uq, u, dq, d, *rest)

        def quant_experts_ffn(self, experts: list[tuple[Any, ...]], *rest: Any) -> None:
            for gq, g, uq, u, dq, d, *_ in experts:  # a layer's routed experts in one call
                calls.extend((q, int(w.ctypes.data)) for q, w in ((gq, g), (uq, u), (dq, d)))
            core.quant_experts_ffn(experts, *rest)

        def QuantExperts(self, experts: list[tuple[Any, ...]], *rest: Any) -> Any:
            handle = core.QuantExperts(experts, *rest)  # a layer's experts, exported once

            class Spy:
                def __len__(self) -> int:
                    return len(handle)

                def forward(self, *args: Any) -> list[tuple[int, int]]:
                    routed: list[tuple[int, int]] = handle.forward(*args)
                    for e, _ in routed:  # the experts that ran, read where they were handed
                        gq, g, uq, u, dq, d = experts[e]
                        calls.extend((q, int(w.ctypes.data))
                                     for q, w in ((gq, g), (uq, u), (dq, d)))
                    return routed

            return Spy()

    monkeypatch.setattr(qmm, "_quant_matmul", lambda: spy_matmul)
    monkeypatch.setattr(qmm, "_core_module", lambda: Core())
    llm = _llm(config)
    try:
        rt = llm.engine.rt
        experts = rt.loaded.experts
        assert rt.device.type == "cpu" and experts is not None and rt.moe is not None
        pool = experts.host_bytes()
        lo, hi = pool.data_ptr(), pool.data_ptr() + pool.numel()
        spec = rt.spec
        for layer in spec.moe_layers:
            for w in rt.moe._weights[layer]:  # type: ignore[attr-defined]
                for m in w[:3]:  # gate, up, down: the file's blocks, in place in the pool
                    assert isinstance(m, QuantTensor)
                    assert lo <= m.data.data_ptr() < hi
        for layer in range(spec.num_layers):  # the attention projections stay quantized too
            for p in ("q", "k", "v", "o"):
                assert isinstance(rt.loaded.dense[f"{layer}.{p}"], QuantTensor)
        got = llm.logits(IDS)
    finally:
        llm.close()
    from_pool = {q for q, ptr in calls if lo <= ptr < hi}  # kernels reading the pool itself
    assert from_pool == {"Q4_K", "Q5_K", "Q6_K"}  # the experts' types in QWEN3MOE_TYPES
    monkeypatch.undo()
    normal = _llm(dataclasses.replace(served, device="cpu", fault_inject=None,
                                      copy_backend="simulated:8"))
    try:
        want = normal.logits(IDS)
    finally:
        normal.close()
    assert torch.equal(got, want)
