"""A row is routed the same whatever rows share its step (`layers.moe.router_logits`).

A CPU GEMM's fp32 sums depend on how many rows it is given, so the router's weights for a
prompt batched with others came out ~1e-7 apart from the same prompt alone; the quantized
kernels round their activations to integers, which made that ~1e-3 in the logits, and a seeded
sample differed alone and batched (a promise of docs/api.md). The oracle for the logits is the
row computed alone; for the model, the request run alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import quant_models
from ftrs.layers.moe import router_logits
from ftrs.llm import LLM
from ftrs.sampling import SamplingParams


@pytest.mark.parametrize(("experts", "hidden"), [(8, 576), (128, 2048), (6, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_router_logits_of_a_row_do_not_depend_on_the_rows_beside_it(experts: int, hidden: int,
                                                                    bias: bool) -> None:
    g = torch.Generator().manual_seed(experts + hidden)
    w = torch.randn(experts, hidden, generator=g) / hidden**0.5
    b = torch.randn(experts, generator=g) if bias else None
    x = torch.randn(300, hidden, generator=g)
    alone = torch.cat([router_logits(x[i:i + 1], w, b) for i in range(x.shape[0])])
    for n in (2, 7, 16, 100, 300):
        assert torch.equal(router_logits(x[:n], w, b), alone[:n]), n
    assert alone.dtype == torch.float32
    torch.testing.assert_close(alone, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_the_float64_router_follows_its_tensor() -> None:
    """The float64 copy is made once per tensor: an in-place change (a reload into the same
    tensor) must not be routed with the old copy, and the copy goes with its tensor."""
    import gc

    from ftrs.layers import moe

    w, x = torch.randn(8, 16), torch.randn(3, 16)
    before = router_logits(x, w)
    w.mul_(2)
    torch.testing.assert_close(router_logits(x, w), 2 * before)
    key = id(w)
    assert key in moe._WIDE
    del w
    gc.collect()
    assert key not in moe._WIDE


@pytest.fixture(scope="module")
def quantized_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # every matrix in blocks the Rust kernels compute from (the dense MLP of layer 1 and the
    # router too): those sums are exact integers per block, the same in any batch
    types = {"experts": "Q4_K", "self_attn": "Q8_0", "mlp": "Q5_1", "embed_tokens": "Q8_0",
             "lm_head": "Q6_K"}
    gguf, _ = quant_models.build("qwen3_moe", types, tmp_path_factory.mktemp("qmoe"))
    return gguf


def test_a_quantized_moe_gives_a_request_the_same_logprobs_alone_and_batched(
        quantized_moe: Path) -> None:
    prompts = [list(range(5, 40)), list(range(100, 113)), [7] * 21]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=5, logprobs=2, ignore_eos=True)
    alone = []
    for p in prompts:  # a fresh engine each: no prefix cache between the runs
        with LLM(str(quantized_moe), kv_tokens=1024) as llm:
            alone.append(llm.generate([p], params)[0])
    with LLM(str(quantized_moe), kv_tokens=1024) as llm:
        batched = llm.generate(prompts, params)
    for a, b in zip(alone, batched):
        assert b.token_ids == a.token_ids
        assert [lp.logprob for lp in b.logprobs or []] == [lp.logprob for lp in a.logprobs or []]
