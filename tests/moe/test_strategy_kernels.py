"""The MoE strategies on the fused Triton kernel (`moe.fused`), layer by layer on tiny models.

Run under Triton's interpreter on the CPU (tests/conftest.py sets it without a GPU), compiled on
a GPU. Oracles:
- `resident` on the torch path (today's per-expert code) for the kernel's numbers: fp32 to
  1e-5 of the largest output (the dot products sum in another order; measured: 4.8e-7);
- `resident` on the kernel for `offload` on the kernel: bit for bit, whatever the cache holds,
  the experts that landed first and the waves;
- for a quantized GGUF, the reference path (`use_kernels(False)`: dequantized in fp32, then
  `F.linear`), and bit-equality with the torch path for the layers the kernel leaves alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ftrs.config import EngineConfig
from ftrs.kernels import Kernels, select_kernels, triton_runs_on
from ftrs.layers.moe import route
from ftrs.models.load import LoadedModel, load_model
from ftrs.moe.base import MoEStrategy, create_strategy, import_strategy
from ftrs.quant.matmul import use_kernels

pytest.importorskip("triton")
MOE_ARCHS = ("mixtral", "qwen3_moe")


@pytest.fixture(scope="module")
def device() -> torch.device:
    if triton_runs_on(torch.device("cpu")):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("the kernels need CUDA or TRITON_INTERPRET=1")
    return torch.device("cuda")


def link(device: torch.device) -> str:
    """A slow simulated link on the interpreter's CPU, the real one on a GPU (the simulated and
    host backends copy into host memory)."""
    return "cuda" if device.type == "cuda" else "simulated:1:300"


@pytest.fixture(scope="module")
def kern(device: torch.device) -> Kernels:
    return select_kernels("triton", device)


def strategy(name: str, loaded: LoadedModel, device: torch.device, **options: Any) -> MoEStrategy:
    import_strategy(name)
    assert loaded.experts is not None
    kernels = options.pop("kernels", None)
    config = EngineConfig(model=str(loaded.path), moe_strategy=name, **options)
    routers = {la: loaded.dense[f"{la}.router"] for la in loaded.spec.moe_layers}
    return create_strategy(name, experts=loaded.experts, device=device, config=config,
                           routers=routers, kernels=kernels)


def steps(loaded: LoadedModel, device: torch.device, widths: tuple[int, ...],
          seed: int = 0) -> Iterator[list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Per forward, the (layer, x, ids, weights) of each MoE layer: random hidden states routed
    by the model's own routers (so a prefetch guess from x is a real guess)."""
    s = loaded.spec
    g = torch.Generator().manual_seed(seed)
    for t in widths:
        assert loaded.experts is not None
        x = torch.randn(t, s.hidden_size, generator=g).to(device, loaded.experts.dtype)
        step = []
        for layer in s.moe_layers:
            router = loaded.dense[f"{layer}.router"]
            assert isinstance(router, torch.Tensor)
            ids, w = route(x, router, s.top_k, s.norm_topk_prob)
            step.append((layer, x, ids, w))
            x = x + 0.5 * torch.randn(x.shape, generator=g).to(device, x.dtype)
        yield step


def outputs(moe: MoEStrategy, forwards: list[list[Any]]) -> list[torch.Tensor]:
    out = []
    try:
        for step in forwards:
            moe.begin_forward(step[0][1].shape[0])
            out += [moe.forward(layer, x, ids, w).cpu() for layer, x, ids, w in step]
            moe.end_forward()
    finally:
        moe.close()
    return out


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_resident_kernel_matches_the_torch_path(tiny_models: dict[str, Path], arch: str,
                                                device: torch.device, kern: Kernels) -> None:
    loaded = load_model(str(tiny_models[arch]), device, torch.float32, progress=False)
    forwards = list(steps(loaded, device, (9, 1)))
    want = outputs(strategy("resident", loaded, device), forwards)
    got_moe = strategy("resident", loaded, device, kernels=kern)
    assert set(got_moe._fused) == set(loaded.spec.moe_layers)  # type: ignore[attr-defined]
    got = outputs(got_moe, forwards)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    # the torch side of the selector is today's path, bit for bit
    torch_side = outputs(strategy("resident", loaded, device,
                                  kernels=select_kernels("torch", device)), forwards)
    assert all(torch.equal(a, b) for a, b in zip(torch_side, want, strict=True))


@pytest.mark.parametrize("arch,rate,prefetch", [
    ("mixtral", 0.25, True), ("qwen3_moe", 0.5, False),
    pytest.param("mixtral", 0.5, False, marks=pytest.mark.slow),
    pytest.param("qwen3_moe", 0.25, True, marks=pytest.mark.slow)])
def test_offload_with_kernels_equals_resident_bit_for_bit(
        tiny_models: dict[str, Path], arch: str, rate: float, prefetch: bool,
        device: torch.device, kern: Kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    from ftrs.kernels import moe as kmoe

    loaded = load_model(str(tiny_models[arch]), device, torch.float32, progress=False)
    forwards = list(steps(loaded, device, (1, 7, 1, 1)))
    want = outputs(strategy("resident", loaded, device, kernels=kern), forwards)
    tables: list[list[int]] = []
    real = kmoe.moe_pairs_triton

    def recording(*a: Any, **kw: Any) -> torch.Tensor:
        tables.append(a[3].tolist())
        return real(*a, **kw)

    monkeypatch.setattr(kmoe, "moe_pairs_triton", recording)
    moe = strategy("offload", loaded, device, kernels=kern, moe_cache_rate=rate,
                   moe_prefetch=prefetch, copy_backend=link(device))
    slots = moe.num_slots  # type: ignore[attr-defined]
    got = outputs(moe, forwards)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"forward {i}: max diff {(a - b).abs().max().item()}"
    # every call named at most a cache's worth of experts; some layers took two calls or more
    # (landed first, then the rest; or waves), and no call named an expert twice
    layers = sum(len(s) for s in forwards)
    assert all(0 < sum(s >= 0 for s in t) <= slots for t in tables)
    assert len(tables) > layers
    assert all(len({s for s in t if s >= 0}) == sum(s >= 0 for s in t) for t in tables)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offload_waves_with_kernels(tiny_models: dict[str, Path], device: torch.device,
                                    kern: Kernels, dtype: torch.dtype) -> None:
    """A cache of top_k slots: a wide forward runs in several waves, still exact."""
    loaded = load_model(str(tiny_models["mixtral"]), device, dtype, progress=False)
    forwards = list(steps(loaded, device, (1, 7), seed=3))  # distinct_per_layer: the last
    want = outputs(strategy("resident", loaded, device, kernels=kern), forwards)
    moe = strategy("offload", loaded, device, kernels=kern, moe_cache_size=loaded.spec.top_k,
                   copy_backend="cuda" if device.type == "cuda" else "host")
    got = outputs(moe, forwards)
    assert max(moe.distinct_per_layer) > loaded.spec.top_k  # type: ignore[attr-defined]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("qtype", ["Q8_0", "MXFP4", "IQ4_XS", "Q3_K", "Q5_K", "IQ2_XXS",
                                   *(pytest.param(q, marks=pytest.mark.slow)
                                     for q in ("Q4_K", "Q2_K", "Q4_0", "Q5_0", "IQ1_M", "IQ3_S"))])
def test_quantized_kernel_matches_the_reference(tmp_path: Path, device: torch.device,
                                                kern: Kernels, qtype: str) -> None:
    """Tiny qwen3moe GGUF (MoE layers 0 and 2): experts in `qtype`, but layer 0's `up` of
    another type (gate and up differ: the torch path) and layer 2's `down` Q6_K (a K-quant
    file's mix: the kernel reads each matrix in its own type)."""
    from quant_models import build

    types = {"layers.0.mlp.experts.0.up": "Q5_K" if qtype != "Q5_K" else "Q4_K",
             "layers.2.mlp.experts.0.down": "Q6_K", "experts": qtype}
    loaded = load_model(str(build("qwen3_moe", types, tmp_path)[0]), device, torch.float32,
                        progress=False)
    forwards = list(steps(loaded, device, (3,), seed=5))
    with use_kernels(False):  # the reference: dequantized in fp32, then F.linear
        want = outputs(strategy("resident", loaded, device), forwards)
        moe = strategy("resident", loaded, device, kernels=kern)
        assert set(moe._fused) == {2}  # type: ignore[attr-defined]  # layer 0: gate != up
        assert moe._fused[2].qtype == qtype  # type: ignore[attr-defined]
        assert moe._fused[2].qtype_of(2) == "Q6_K"  # type: ignore[attr-defined]
        got = outputs(moe, forwards)
        off = outputs(strategy("offload", loaded, device, kernels=kern, moe_cache_rate=0.5,
                               copy_backend=link(device)), forwards)
    (l0, l2), (w0, w2) = got, want
    assert torch.equal(l0, w0)  # the torch path, untouched
    torch.testing.assert_close(l2, w2, rtol=1e-5, atol=1e-5 * float(w2.abs().max()))
    assert all(torch.equal(a, b) for a, b in zip(off, got, strict=True))


@pytest.mark.parametrize("link", ["fast", "by-tokens"])
def test_hybrid_device_part_on_the_kernel(tiny_models: dict[str, Path], device: torch.device,
                                          kern: Kernels, link: str) -> None:
    """Every miss fetched (a free link): hybrid equals resident on the kernel bit for bit. Split
    by tokens (single-token experts on the CPU's torch path): within the kernel's tolerance."""
    from ftrs.moe.hybrid import CostModel, HybridStrategy, LayerModes

    loaded = load_model(str(tiny_models["qwen3_moe"]), device, torch.float32, progress=False)
    forwards = list(steps(loaded, device, (5, 1, 1), seed=7))
    want = outputs(strategy("resident", loaded, device, kernels=kern), forwards)
    moe = strategy("hybrid", loaded, device, kernels=kern, moe_cache_rate=0.5,
                   cpu_expert_threads=1)
    assert isinstance(moe, HybridStrategy)
    moe.cost = (CostModel(1e15, 0.0, cpu_s_per_token=1.0, learn=False) if link == "fast"
                else CostModel(1e12, 2.5e-6, cpu_s_per_token=2e-6, learn=False))
    moe.modes = LayerModes(explore_share=0, learn=False)  # every layer call: the split
    moe.modes.seconds = {(m, 1 << b): t for b in range(8) for m, t in (("split", 0.0), ("cpu", 1.0))}
    got = outputs(moe, forwards)
    assert moe.fetched > 0 and (moe.cpu_computed == 0) == (link == "fast")
    for a, b in zip(got, want, strict=True):
        if link == "fast":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny qwen3_moe whose routed experts are FP8 with fp32 scales per 32x32 tile (the
    experts are 48 wide: partial tiles at the edges)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from ftrs.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("fp8")
    src = make_tiny("qwen3_moe", root / "src", seed=3)
    out = root / "fp8"
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    for name, w in list(tensors.items()):
        if ".experts." in name and name.endswith("_proj.weight"):
            rows, cols = w.shape
            tiles = torch.nn.functional.pad(w.abs(), (0, -cols % 32, 0, -rows % 32))
            scale = tiles.reshape(-(-rows // 32), 32, -(-cols // 32), 32).amax((1, 3)) / 448
            full = scale.repeat_interleave(32, 0)[:rows].repeat_interleave(32, 1)[:, :cols]
            tensors[name] = (w / full).to(torch.float8_e4m3fn)
            tensors[name[:-7] + ".weight_scale_inv"] = scale
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_fp8_block_kernel_matches_the_reference(fp8_model: Path, device: torch.device,
                                                kern: Kernels) -> None:
    every_layer_on_the_kernel_matches_the_reference(fp8_model, "FP8_BLOCK", device, kern)


def test_nvfp4_kernel_matches_the_reference(tmp_path: Path, device: torch.device,
                                            kern: Kernels) -> None:
    """ModelOpt NVFP4 experts: blocks and each matrix's tensor scale read from the slot."""
    from quant_models import write_nvfp4_checkpoint

    every_layer_on_the_kernel_matches_the_reference(write_nvfp4_checkpoint(tmp_path)[0], "NVFP4",
                                                    device, kern)


def every_layer_on_the_kernel_matches_the_reference(path: Path, qtype: str, device: torch.device,
                                                    kern: Kernels) -> None:
    """Every MoE layer of the checkpoint at `path` (experts in `qtype`) on the kernel: the
    reference path's numbers (dequantized in fp32, then F.linear) within the kernel's fp32
    tolerance, and offload on the kernel equal to resident on it bit for bit."""
    loaded = load_model(str(path), device, torch.float32, progress=False)
    forwards = list(steps(loaded, device, (6, 1), seed=9))
    with use_kernels(False):  # the reference: dequantized in fp32, then F.linear
        want = outputs(strategy("resident", loaded, device), forwards)
        moe = strategy("resident", loaded, device, kernels=kern)
        assert {w.qtype for w in moe._fused.values()} == {qtype}  # type: ignore[attr-defined]
        assert set(moe._fused) == set(loaded.spec.moe_layers)  # type: ignore[attr-defined]
        got = outputs(moe, forwards)
        off = outputs(strategy("offload", loaded, device, kernels=kern, moe_cache_rate=0.5,
                               copy_backend=link(device)), forwards)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    assert all(torch.equal(a, b) for a, b in zip(off, got, strict=True))


@pytest.mark.slow
def test_generation_offload_equals_resident_on_the_kernel(
        tiny_models: dict[str, Path], device: torch.device, kern: Kernels,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole engine steps (chunked prefill mixed with batched decode): offload on the kernel
    gives resident-on-the-kernel's logits bit for bit. The strategies get the kernels however
    the runtime builds them."""
    from ftrs.engine import runtime
    from ftrs.llm import LLM
    from ftrs.sampling import SamplingParams

    real = runtime.create_strategy

    def with_kernels(name: str, **kw: Any) -> MoEStrategy:
        return real(name, **(kw | {"kernels": kern}))

    monkeypatch.setattr(runtime, "create_strategy", with_kernels)
    ids = [3, 17, 250, 41, 99, 500, 7, 8, 311, 42]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)

    def run(**options: Any) -> tuple[torch.Tensor, list[list[int]], list[Any]]:
        llm = LLM(str(tiny_models["mixtral"]), kv_tokens=512, dtype="float32",
                  device=device.type, max_prefill_length=4, **options)
        try:
            assert llm.engine.rt.moe._fused  # type: ignore[union-attr]  # the kernel runs
            outs = llm.generate([ids, ids[:3]], greedy)
            return (llm.logits(ids), [o.token_ids for o in outs],
                    [o.logprobs for o in outs])
        finally:
            llm.close()

    want = run(moe_strategy="resident")
    got = run(moe_strategy="offload", moe_cache_rate=0.25, copy_backend=link(device))
    assert torch.equal(got[0], want[0])
    assert got[1:] == want[1:]


@pytest.mark.parametrize("mxfp4", [False, True], ids=["fp32", "mxfp4"])
def test_gpt_oss_experts_on_the_kernel(tmp_path: Path, device: torch.device, kern: Kernels,
                                       mxfp4: bool) -> None:
    """gpt_oss's expert biases and clamped SwiGLU (limit 1.0 in the tiny model: the clamps act)
    in the kernel, its experts plain or MXFP4: resident on the kernel against the torch path
    (fp32, 1e-5 of the largest output; MXFP4's reference dequantizes in fp32), offload on the
    kernel against resident on it, bit for bit."""
    pytest.importorskip("transformers")
    from gpt_oss_models import build, quantize_mxfp4

    path = build(tmp_path / "m", seed=1)
    if mxfp4:
        path = quantize_mxfp4(path, tmp_path / "q", tmp_path / "r")[0]
    loaded = load_model(str(path), device, torch.float32, progress=False)
    forwards = list(steps(loaded, device, (7, 1), seed=9))
    with use_kernels(False):  # MXFP4: dequantized in fp32, not the CPU kernel's int products
        want = outputs(strategy("resident", loaded, device), forwards)
    moe = strategy("resident", loaded, device, kernels=kern)
    fused = moe._fused  # type: ignore[attr-defined]
    assert set(fused) == set(loaded.spec.moe_layers)
    assert all(w.clamp is not None and w.biases is not None for w in fused.values())
    assert all(w.qtype == ("MXFP4" if mxfp4 else "none") for w in fused.values())
    got = outputs(moe, forwards)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(b.abs().max())))
    off = outputs(strategy("offload", loaded, device, kernels=kern, moe_cache_rate=0.5,
                           copy_backend=link(device)), forwards)
    assert all(torch.equal(a, b) for a, b in zip(off, got, strict=True))
