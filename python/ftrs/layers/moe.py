"""MoE routing and the expert computation every strategy shares.

Routing follows the reference: router logits (`router_logits`: on the CPU rounded from float64,
so a row routes the same whatever rows share its step), softmax in fp32 over all experts, top-k, then
(when the architecture says so) renormalisation of the k weights to sum to one. gpt_oss routes
otherwise (`topk_softmax`): router logits with a bias, top-k of the logits, softmax over those k;
deepseek_v3 too (`route_grouped`): sigmoid scores, biased choice within the best expert groups.
`route_by` is the one place a layer's routing is chosen from the spec, for the decoder and the
prefetch ranker alike (`moe.rank`), from a `Router` (the weight and the biases the layer has).

`plan_experts` sorts the (token, slot) pairs of a layer by expert once (one stable argsort and
one bincount), so each expert's tokens are a slice of that order, in ascending token, the order
`torch.where(ids == e)` would give, and the host learns the experts in use with one transfer.
`combine_experts` runs the selected experts in ascending expert id and accumulates with
`index_add_`. Every strategy accumulates in that order, whatever memory the weights come from,
which is why offload equals resident bit for bit. Each expert's contribution depends on no
other expert, so a strategy may compute them in any order (`expert_contribution`) as long as it
adds them in ascending id (`accumulate`).

`expert_mlp` is the one place an expert's FFN is computed: gate, up, the activation
(`ExpertAct`: SiLU times up, or gpt_oss's clamped SwiGLU), down; with biases when the expert's
weights carry them (tensors 3..5 of its pool block).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from ftrs.layers.linear import linear
from ftrs.quant.matmul import Weight, expert_ffn

if TYPE_CHECKING:
    from ftrs.models.arch import ArchSpec

GROUPED_SIGMOID = "grouped_sigmoid"  # `ArchSpec.router` of deepseek_v3 (`noaux_tc`)
GROUPED_SOFTMAX = "grouped_softmax"  # of deepseek_v2 (`greedy`, `group_limited_greedy`)
GROUPED = (GROUPED_SIGMOID, GROUPED_SOFTMAX)

SMALL_ROWS = 32  # below this, accumulate by indexing instead of index_add_
#: gate (I,H), up (I,H), down (H,I); with expert biases also gate (1,I), up (1,I), down (1,H) rows
ExpertWeights = tuple[Weight, ...]


class ExpertAct(NamedTuple):
    """An expert's activation: "silu" (silu(gate) * up) or "swiglu_clamp" (gpt_oss: gate
    clamped above and up on both sides at `limit`, then (up + 1) * gate * sigmoid(alpha gate))."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0


SILU = ExpertAct()


def router_logits(x: torch.Tensor, router: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ router.T (+ bias)` rounded to `x`'s dtype (as the reference's GEMM in that dtype),
    returned in fp32. On the CPU it is computed in float64 and rounded: a
    GEMM's fp32 sums change with the number of rows it is given (its blocking), so a prompt
    batched with others was routed with weights ~1e-7 apart from the same prompt alone, and
    the quantized experts' rounded activations made that 1e-3 in the logits, enough to change a
    seeded sample. Rounded from float64 a row's logits do not depend on the rows beside it
    (unless a sum lands within float64's error of an fp32 rounding boundary: about one value
    in 10^8). On a GPU: the fp32 (or model dtype) GEMM, unchanged."""
    if x.device.type != "cpu":
        return F.linear(x, router, bias).float()
    wide = F.linear(x.double(), _wide(router), None if bias is None else _wide(bias))
    return wide.to(x.dtype).float()


_WIDE: dict[int, tuple[int, torch.Tensor]] = {}


def _wide(t: torch.Tensor) -> torch.Tensor:
    """`t` in float64, converted once per tensor and version (a decode step would otherwise
    convert every router: 0.33 ms a layer at 128 x 2048, against 0.07 ms for the float64
    product), dropped with the tensor; an in-place change of `t` converts it again."""
    version = -1 if t.is_inference() else t._version  # inference tensors keep none
    got = _WIDE.get(id(t))
    if got is None or got[0] != version:
        if got is None:
            weakref.finalize(t, _WIDE.pop, id(t), None)
        got = _WIDE[id(t)] = (version, t.double())
    return got[1]


def route(
    x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool,
    bias: torch.Tensor | None = None, kind: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x`: (tokens, hidden). Returns top-k ids (tokens, k) int64 and weights (tokens, k) x.dtype."""
    logits = router_logits(x, router, bias)
    if kind == "topk_softmax":
        top, ids = torch.topk(logits, top_k, dim=-1)
        return ids, torch.softmax(top, dim=-1).to(x.dtype)
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(x.dtype)


def route_grouped(x: torch.Tensor, router: torch.Tensor, correction: torch.Tensor | None,
                  top_k: int, groups: tuple[int, int], renormalize: bool, scaling: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing, in fp32 as the reference. With a `correction` (deepseek_v3's
    "noaux_tc"): sigmoid scores; the choice made on the scores plus the correction, within the
    `groups[1]` of `groups[0]` expert groups whose two best choice scores sum highest. Without
    (deepseek_v2): softmax scores, the choice on them, within the groups whose best score is
    highest ("group_limited_greedy"; one group: "greedy"). The weights are the chosen experts'
    scores, renormalised (+1e-20) when asked, times `scaling`."""
    n_group, topk_group = groups
    logits = router_logits(x.float(), router.float())
    if correction is None:
        scores = choice = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        choice = scores + correction.float()
    t, e = choice.shape
    per_group = choice.view(t, n_group, e // n_group)
    group_scores = (per_group.amax(dim=-1) if correction is None
                    else per_group.topk(2, dim=-1)[0].sum(dim=-1))
    kept = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, kept, 1.0).bool()
    mask = mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
    ids = torch.topk(choice.masked_fill(~mask, float("-inf")), top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, (weights * scaling).to(x.dtype)


class Router(NamedTuple):
    """A MoE layer's router: its weight (experts x hidden), gpt_oss's logit bias, deepseek_v3's
    correction bias (added to the scores for the choice only)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    correction: torch.Tensor | None = None


def route_by(spec: ArchSpec, router: Router, x: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's routing as its architecture does it: grouped (DeepSeek) or `route`'s."""
    if spec.router in GROUPED:
        return route_grouped(x, router.weight, router.correction, spec.top_k,
                             spec.router_groups, spec.norm_topk_prob, spec.routed_scaling_factor)
    return route(x, router.weight, spec.top_k, spec.norm_topk_prob, router.bias, spec.router)


class ExpertPlan(NamedTuple):
    """One layer's routing sorted by expert. Expert `e`'s pairs are `[starts[e], starts[e] +
    counts[e])` of `tokens` and `weights`, tokens ascending."""

    experts: list[int]  # ascending ids with at least one token
    starts: list[int]  # (num_experts,) offset of each expert's slice
    counts: list[int]  # (num_experts,) tokens routed to each expert
    tokens: torch.Tensor  # (tokens * k,) int64 token rows, grouped by expert
    weights: torch.Tensor  # (tokens * k, 1) router weight of each pair, same order


def plan_experts(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> ExpertPlan:
    """`ids`, `weights`: (tokens, k). One sort and one host transfer for the whole layer."""
    flat = ids.reshape(-1)
    k = ids.shape[1] if ids.dim() == 2 else 1
    order = torch.argsort(flat, stable=True)
    count = torch.bincount(flat, minlength=num_experts).tolist()
    start, acc = [], 0
    for c in count:
        start.append(acc)
        acc += c
    experts = [e for e, c in enumerate(count) if c]
    return ExpertPlan(experts, start, count, order // k,
                      weights.reshape(-1).index_select(0, order).unsqueeze(1))


def _bias(w: ExpertWeights, t: int) -> torch.Tensor | None:
    if len(w) <= t:
        return None
    b = w[t]
    assert isinstance(b, torch.Tensor)  # invariant: biases are stored in the compute dtype
    return b.reshape(-1)


def gate_up_matrix(gate: Weight, up: Weight) -> torch.Tensor | None:
    """`gate` and `up` as one (2I, H) matrix when `up`'s bytes follow `gate`'s in one storage
    (the host pool and its slots lay every expert out so); else None.

    One matmul then streams both, which halves the calls per expert (at batch 1 a decode step
    makes ~2 per layer fewer), and each output row is the same dot product as before."""
    if not (isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor)):
        return None
    if (gate.shape != up.shape or gate.dtype != up.dtype or gate.dim() != 2
            or not gate.is_contiguous() or not up.is_contiguous()
            or up.data_ptr() != gate.data_ptr() + gate.nbytes):
        return None
    store = gate.untyped_storage()
    if store.data_ptr() != up.untyped_storage().data_ptr():
        return None
    rows, cols = gate.shape
    if (gate.storage_offset() + 2 * rows * cols) * gate.element_size() > store.nbytes():
        return None
    return gate.as_strided((2 * rows, cols), (cols, 1))


def expert_mlp(x: torch.Tensor, w: ExpertWeights, act: ExpertAct = SILU) -> torch.Tensor:
    """The FFN of one expert on its rows: `down(act(gate x, up x))`, quantized or not; gate and
    up as one matmul when they lie side by side and carry no biases; quantized CPU experts in one
    kernel call (`quant.matmul.expert_ffn`)."""
    gate, up, down = w[0], w[1], w[2]
    if act.kind == "silu" and len(w) == 3:
        fused = expert_ffn(x, gate, up, down)
        if fused is not None:
            return fused
    gate_b, up_b = _bias(w, 3), _bias(w, 4)
    gu = gate_up_matrix(gate, up) if gate_b is None and up_b is None else None
    if gu is None:
        g, u = linear(x, gate, gate_b), linear(x, up, up_b)
    else:
        both = linear(x, gu)  # (rows, 2I): gate's outputs, then up's
        inter = gu.shape[0] // 2
        g, u = both[..., :inter], both[..., inter:]
    if act.kind == "swiglu_clamp":
        g = g.clamp(max=act.limit)
        u = u.clamp(min=-act.limit, max=act.limit)
        h = (u + 1) * (g * torch.sigmoid(g * act.alpha))
    else:
        h = F.silu(g) * u
    return linear(h, down, _bias(w, 5))


Contribution = tuple[torch.Tensor, torch.Tensor]  # (token rows, their weighted expert output)


def expert_contribution(x: torch.Tensor, plan: ExpertPlan, e: int,
                        w: ExpertWeights, act: ExpertAct = SILU) -> Contribution | None:
    """Expert `e`'s weighted output for the tokens routed to it; None when there are none.
    Independent of every other expert: a strategy may compute these in any order."""
    n = plan.counts[e]
    if n == 0:
        return None
    s = plan.starts[e]
    tok = plan.tokens[s:s + n]
    rows = x if n == x.shape[0] else x.index_select(0, tok)  # all rows: tok is 0..n-1
    return tok, expert_mlp(rows, w, act) * plan.weights[s:s + n]


def accumulate(out: torch.Tensor, part: Contribution | None) -> None:
    """Adds one expert's contribution into `out`; call in ascending expert id."""
    if part is None:
        return
    tok, y = part
    # A token meets each expert at most once, so every form adds exactly once per element;
    # an expert that has every row has them in order (tok = 0..n-1: one in-place add, the
    # common case at batch 1); for a handful of rows a read-add-write beats index_add_ on the CPU.
    if tok.numel() == out.shape[0]:
        out.add_(y)
    elif tok.numel() <= SMALL_ROWS:
        out.index_copy_(0, tok, out.index_select(0, tok) + y)
    else:
        out.index_add_(0, tok, y)


def combine_experts(
    x: torch.Tensor,  # (tokens, hidden)
    ids: torch.Tensor | ExpertPlan,  # (tokens, k), or the plan made from it
    weights: torch.Tensor | None,  # (tokens, k); None with a plan
    experts: Iterable[int],  # ascending expert ids to compute now
    weights_of: Callable[[int], ExpertWeights],
    out: torch.Tensor,  # (tokens, hidden), accumulated in place
    act: ExpertAct = SILU,
) -> None:
    if isinstance(ids, ExpertPlan):
        plan = ids
    else:
        assert weights is not None
        plan = plan_experts(ids, weights, int(ids.max()) + 1 if ids.numel() else 1)
    for e in experts:
        accumulate(out, expert_contribution(x, plan, e, weights_of(e), act))
