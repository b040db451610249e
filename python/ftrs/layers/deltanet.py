"""Gated DeltaNet: the linear attention layers of qwen3_5_moe and qwen3_next, over a state cache.

Per value head, a sequence carries a recurrent state S (k_dim, v_dim). Each token decays it,
writes the part of its value that S does not predict yet, and reads it with its query:

    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

with q, k L2-normalised per head (q then scaled by k_dim^-1/2), g_t = -exp(A_log) softplus(a_t +
dt_bias) <= 0 and beta_t = sigmoid(b_t). Before that, q, k and v pass a causal depthwise conv
of width K and a SiLU; its state is the last K-1 inputs. The output is RMS-normed per head,
times SiLU(z), and projected out. Each q/k head serves a group of consecutive value heads.

Decode rows (one token of a sequence) take the recurrent step above, batched over sequences.
A prefill chunk takes the chunked form: within a block of C tokens starting from state S0, with
G_t = exp(g_1 + ... + g_t), the updates u of all C tokens solve one unit lower-triangular system

    (I + A) u = beta v - beta G K S0,        A_ti = beta_t (G_t / G_i) k_t.k_i   for i < t

after which o_t = G_t q_t S0 + sum_{i<=t} (G_t / G_i)(q_t.k_i) u_i and the block ends in
S_C = G_C S0 + sum_i (G_C / G_i) k_i u_i^T: a few matmuls per block instead of C steps. The
delta rule runs in fp32, the conv in the model dtype, as the reference does.

Both states live in `kvcache.state.StateCache`, one slot per running sequence; a sequence that
starts at token 0 (new, or recomputed after preemption) has its slot zeroed first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ftrs.layers.linear import linear
from ftrs.layers.norm import gated_rms_norm
from ftrs.models.arch import LinearAttnSpec

CHUNK = 64  # tokens per block of the chunked form
L2_EPS = 1e-6


@dataclass(slots=True)
class LinearMeta:
    """Which rows of a step belong to which sequence's state (built once per step)."""

    decode_rows: torch.Tensor  # (B,) int64 rows that are a sequence's only token this step
    decode_slots: torch.Tensor  # (B,) int64 their state slots
    spans: list[tuple[int, int, int]]  # (first row, tokens, state slot) of longer chunks
    fresh_slots: torch.Tensor  # (F,) int64 slots of sequences starting at token 0


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, state: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row. `q`, `k`: (B, H, dk); `v`: (B, H, dv); `g`, `beta`: (B, H); `state`:
    (B, H, dk, dv). All fp32, q already scaled. Returns o (B, H, dv) and the new state."""
    state = state * g.exp()[..., None, None]
    predicted = (k.unsqueeze(-2) @ state).squeeze(-2)  # (B, H, dv): S^T k
    u = (v - predicted) * beta[..., None]
    state = state + k.unsqueeze(-1) * u.unsqueeze(-2)
    return (q.unsqueeze(-2) @ state).squeeze(-2), state


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, state: torch.Tensor, chunk: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of one sequence in order. `q`, `k`: (n, H, dk); `v`: (n, H, dv); `g`, `beta`:
    (n, H); `state`: (H, dk, dv). All fp32, q already scaled. Returns o (n, H, dv), new state.
    `chunk`: tokens per block (default `CHUNK`)."""
    chunk = chunk or CHUNK
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # (H, n, d)
    g, beta = g.t(), beta.t()  # (H, n)
    n = q.shape[1]
    out = torch.empty_like(v)
    for c0 in range(0, n, chunk):
        sl = slice(c0, min(c0 + chunk, n))
        qc, kc, vc, bc = q[:, sl], k[:, sl], v[:, sl], beta[:, sl]
        size = qc.shape[1]
        logg = g[:, sl].cumsum(-1)  # (H, C): log G_t
        causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        # (H, C, C): G_t / G_i for i <= t, else 0 (g <= 0: no overflow on the kept side)
        decay = (logg[:, :, None] - logg[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        a = ((kc @ kc.transpose(-1, -2)) * decay * bc[:, :, None]).tril(-1)
        system = a + torch.eye(size, dtype=a.dtype, device=a.device)
        rhs = torch.cat((vc * bc[..., None], kc * (bc * logg.exp())[..., None]), dim=-1)
        sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        dv = vc.shape[-1]
        u = sol[..., :dv] - sol[..., dv:] @ state  # (H, C, dv)
        scores = (qc @ kc.transpose(-1, -2)) * decay  # (H, C, C)
        out[:, sl] = (qc * logg.exp()[..., None]) @ state + scores @ u
        last = logg[:, -1:]  # (H, 1)
        state = (state * last.exp()[..., None]
                 + (kc * (last - logg).exp()[..., None]).transpose(-1, -2) @ u)
    return out.transpose(0, 1), state


def _conv(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv of (B, C, K-1+n) inputs with (C, 1, K) weights -> (B, C, n), SiLU."""
    return F.silu(F.conv1d(window, weight, groups=weight.shape[0]))


def gated_deltanet(x: torch.Tensor, w: Mapping[str, Any], p: str, lin: LinearAttnSpec,
                   eps: float, meta: LinearMeta, conv_state: torch.Tensor,
                   rec_state: torch.Tensor) -> torch.Tensor:
    """One layer on a step's rows. `x`: (tokens, hidden) normed input; `conv_state`: (slots,
    conv_dim, K-1) model dtype; `rec_state`: (slots, v_heads, dk, dv) fp32, both updated in
    place. Returns (tokens, hidden)."""
    t = x.shape[0]
    qkv = linear(x, w[p + "lin_qkv"])  # (t, conv_dim)
    z = linear(x, w[p + "lin_z"])  # (t, value_dim)
    beta = torch.sigmoid(linear(x, w[p + "lin_b"])).float()  # (t, v_heads)
    g = -w[p + "lin_a_log"].float().exp() * F.softplus(
        linear(x, w[p + "lin_a"]).float() + w[p + "lin_dt_bias"])  # (t, v_heads) log decay
    weight = w[p + "lin_conv"]  # (conv_dim, 1, K)
    mixed = torch.empty_like(qkv)
    rows, slots = meta.decode_rows, meta.decode_slots
    if rows.numel():
        window = torch.cat((conv_state.index_select(0, slots),
                            qkv.index_select(0, rows)[:, :, None]), dim=-1)  # (B, C, K)
        mixed.index_copy_(0, rows, _conv(window, weight)[:, :, 0])
        conv_state.index_copy_(0, slots, window[:, :, 1:])
    for start, n, slot in meta.spans:
        window = torch.cat((conv_state[slot], qkv[start:start + n].t()), dim=-1)  # (C, K-1+n)
        mixed[start:start + n] = _conv(window[None], weight)[0].t()
        conv_state[slot] = window[:, window.shape[1] - conv_state.shape[2]:]

    kd, vd = lin.key_dim, lin.value_dim
    group = lin.num_v_heads // lin.num_k_heads
    q = mixed[:, :kd].float().view(t, lin.num_k_heads, lin.k_head_dim)
    k = mixed[:, kd:2 * kd].float().view(t, lin.num_k_heads, lin.k_head_dim)
    v = mixed[:, 2 * kd:].float().view(t, lin.num_v_heads, lin.v_head_dim)
    q = l2_normalize(q) * lin.k_head_dim ** -0.5
    k = l2_normalize(k)
    if group > 1 and lin.v_heads_tiled:
        q, k = q.repeat(1, group, 1), k.repeat(1, group, 1)
    elif group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    out = torch.empty_like(v)  # (t, v_heads, dv) fp32
    if rows.numel():
        o, s = recurrent_step(q.index_select(0, rows), k.index_select(0, rows),
                              v.index_select(0, rows), g.index_select(0, rows),
                              beta.index_select(0, rows), rec_state.index_select(0, slots))
        out.index_copy_(0, rows, o)
        rec_state.index_copy_(0, slots, s)
    for start, n, slot in meta.spans:
        r = slice(start, start + n)
        o, rec_state[slot] = chunked(q[r], k[r], v[r], g[r], beta[r], rec_state[slot])
        out[r] = o
    o = gated_rms_norm(out.to(x.dtype), w[p + "lin_norm"], z.view(t, lin.num_v_heads, -1), eps)
    return linear(o.reshape(t, vd), w[p + "lin_out"])
