"""The prefetch ranker routes as the model does (`moe.rank.NextLayerRanker`).

DeepSeek-V3's correction bias and expert groups, V2's groups and gpt-oss's logit bias decide
which experts a layer's rows go to; a ranker reading the router weight alone (a plain softmax,
what `rank_on_host` computes) prefetches others. The oracle is the decoder's own routing
(`layers.moe.route_by`, checked against transformers in `tests/models/test_deepseek.py` and
`test_gpt_oss.py`): the ranked experts are exactly the ones it chooses, heaviest summed weight
first, on the host and with torch alike; each case is one where the plain ranking differs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import deepseek_models
from ftrs.layers.moe import Router, route_by
from ftrs.models.arch import ArchSpec, arch_from_config
from ftrs.moe.rank import NextLayerRanker, rank_on_host


def _spec(**changes: object) -> ArchSpec:
    cfg = deepseek_models.CONFIG | {"model_type": "deepseek_v3"}
    return arch_from_config(cfg | changes, "test")


def _oracle(spec: ArchSpec, router: Router, x: torch.Tensor) -> list[int]:
    ids, w = route_by(spec, router, x)
    score: dict[int, float] = {}
    for e, v in zip(ids.flatten().tolist(), w.flatten().tolist()):
        score[e] = score.get(e, 0.0) + v
    return sorted(score, key=lambda e: (-score[e], e))


def _cases() -> dict[str, tuple[ArchSpec, Router]]:
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(6, 48, generator=g)
    v3 = _spec()
    # +1 on experts 4 and 5 (one group of two) outweighs any sigmoid score gap: they are chosen
    correction = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    v2 = _spec(model_type="deepseek_v2", **{k: v for k, v in deepseek_models.V2_GROUPED.items()
                                            if k != "arch"})
    gpt_oss = replace(v3, router="topk_softmax", router_groups=(1, 1), norm_topk_prob=False)
    return {"v3_correction": (v3, Router(weight, correction=correction)),
            "v2_groups": (v2, Router(weight)),
            "gpt_oss_bias": (gpt_oss, Router(weight, bias=torch.tensor([0, 0, 0, 6.0, 0, 0])))}


@pytest.mark.parametrize("case", ["v3_correction", "v2_groups", "gpt_oss_bias"])
def test_the_ranking_is_the_models_routing(case: str) -> None:
    spec, router = _cases()[case]
    ranker = NextLayerRanker({1: router}, spec)
    g = torch.Generator().manual_seed(11)
    differs = 0
    for _ in range(10):
        x = torch.randn(5, 48, generator=g)
        want = _oracle(spec, router, x)
        assert ranker.rank(1, x) == want  # torch where the rows are
        assert ranker.rank(1, x, x_host=x) == want  # rows already on the host
        assert ranker.rank(1, x, on_host=True) == want
        differs += rank_on_host(x, router.weight.numpy(), spec.top_k) != want
    assert differs > 0  # the case tells a weight-only ranker apart
    if case == "v3_correction":
        assert {4, 5} <= set(ranker.rank(1, x))


def test_a_plain_softmax_router_still_ranks_on_the_host_fast_path() -> None:
    spec = _spec(model_type="deepseek_v2", **{k: v for k, v in deepseek_models.V2_LITE.items()
                                              if k != "arch"})
    spec = replace(spec, router="softmax")
    g = torch.Generator().manual_seed(3)
    router = Router(torch.randn(6, 48, generator=g))
    ranker = NextLayerRanker({2: router.weight}, spec)  # a bare weight is a plain router
    x = torch.randn(4, 48, generator=g)
    assert ranker.rank(2, x, x_host=x) == rank_on_host(x, router.weight.numpy(), spec.top_k)
    assert ranker.rank(2, x) == _oracle(replace(spec, norm_topk_prob=False), router, x)
