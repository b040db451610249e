"""Rotary position embedding (the "rotate half" layout of HF llama), with llama3 or yarn scaling,
or a GGUF file's per-frequency divisors (`rope_freqs.weight`, llama3's scaling as llama.cpp stores it).

Partial rotary (qwen3_5_moe, qwen3_next): only the leading `dim` channels of each head are
rotated, with frequencies over `dim`; the rest pass through unchanged.

The cos/sin table is built once in fp32 for every position up to the model's limit and indexed
by absolute position, so chunked prefill and decode rotate exactly as one full pass would. A
forward pass looks its positions up once (`table`) and every layer rotates with them (`rotate`).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    if scaling.get("rope_type", scaling.get("type")) == "yarn":
        return yarn(head_dim, theta, scaling)[0]
    if scaling.get("rope_type") == "freq_factors":  # a GGUF's `rope_freqs`: one divisor per pair
        return inv / torch.tensor(scaling["factors"], dtype=torch.float32)
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wl, high_wl = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    mid = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return torch.where(mid, blended, scaled)


def yarn(head_dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: inverse frequencies blended between the original (high frequencies, kept) and the
    ones divided by `factor` (low frequencies, interpolated) over a linear ramp between the
    dimensions that turn `beta_fast` and `beta_slow` times in the original context; and the
    attention factor that scales cos and sin (0.1 ln(factor) + 1 unless the config gives one)."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    fast = float(scaling.get("beta_fast") or 32.0)
    slow = float(scaling.get("beta_slow") or 1.0)
    attn = scaling.get("attention_factor")
    if attn is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")

        def m(s: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * s * math.log(factor) + 1.0

        attn = m(mscale) / m(mscale_all) if mscale and mscale_all else m(1.0)

    def dim_of(turns: float) -> float:  # the dimension that turns `turns` times in old_len
        return head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    half = head_dim // 2
    ramp = ((torch.arange(half, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolate), 0: divided by factor
    base = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    inv = (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep
    return inv, float(attn)


class Rotary:
    """Precomputed cos/sin of shape (max_positions, head_dim) in fp32."""

    def __init__(self, head_dim: int, theta: float, max_positions: int,
                 scaling: dict[str, Any] | None, device: torch.device) -> None:
        inv = inv_frequencies(head_dim, theta, scaling)
        attn = 1.0
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "yarn":
            attn = yarn(head_dim, theta, scaling)[1]
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * attn).to(device)
        self.sin = (emb.sin() * attn).to(device)
        half = head_dim // 2
        # sin with its first half negated: `rotate` multiplies the halves swapped (one roll)
        # by it, which is `cat(-x2, x1) * sin` exactly (negation commutes with rounding)
        self.sin_signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)
        self.max_positions = max_positions

    def table(self, positions: torch.Tensor, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (first half negated) of `positions` (tokens,), as (tokens, 1,
        head_dim) in `dtype`: gathered and cast once per forward, shared by every layer."""
        return (self.cos.index_select(0, positions).to(dtype)[:, None, :],
                self.sin_signed.index_select(0, positions).to(dtype)[:, None, :])

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`x`: (tokens, heads, head_dim); `positions`: (tokens,) int64."""
        return rotate(x, *self.table(positions, x.dtype))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`x`: (tokens, heads, head_dim); `cos`, `sin_signed`: (tokens, 1, rotary_dim) from
    `Rotary.table` (rotary_dim < head_dim: partial rotary, the trailing channels kept). Equals
    the reference's `x * cos + cat(-x2, x1) * sin` bit for bit, in four operations instead of
    seven."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((rotate(x[..., :r], cos, sin_signed), x[..., r:]), dim=-1)
    swapped = torch.roll(x, x.shape[-1] // 2, dims=-1)  # cat(x2, x1)
    return x * cos + swapped * sin_signed
