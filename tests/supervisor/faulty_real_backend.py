"""The real engine backend (`ftrs.server.backend`: EngineCore, its supervisor in the engine
process) with one fault: a step whose batch holds token id `POISON` raises ValueError from
the decoder, as an engine bug on one request's input would."""

from __future__ import annotations

from typing import Any

from ftrs.config import EngineConfig
from ftrs.server import backend
from ftrs.server.engine_process import LoadedEngine

POISON = 509
load_tokenizer = backend.load_tokenizer


def load(config: EngineConfig) -> LoadedEngine:
    loaded = backend.load(config)
    decoder: Any = loaded.engine.rt.decoder  # type: ignore[attr-defined]
    forward = decoder.forward

    def poisoned(input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        if bool((input_ids == POISON).any()):
            raise ValueError(f"token {POISON} is poison")
        return forward(input_ids, *args, **kwargs)

    decoder.forward = poisoned
    return loaded


__all__ = ["POISON", "load", "load_tokenizer"]
