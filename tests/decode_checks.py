"""Helpers the architecture tests share."""

from __future__ import annotations

from typing import Any

import torch


def record_logits(llm: Any, monkeypatch: Any) -> list[torch.Tensor]:
    """From now on, a copy of every logits tensor `llm`'s decoder computes, in order
    (`monkeypatch`: pytest's fixture)."""
    decoder = llm.engine.rt.decoder
    seen: list[torch.Tensor] = []
    logits = decoder.logits

    def record(hidden: torch.Tensor) -> torch.Tensor:
        out = logits(hidden)
        seen.append(out.clone())
        return out

    monkeypatch.setattr(decoder, "logits", record)
    return seen
