"""The default engine backend: `ftrs.engine.core.EngineCore` and the model's own tokenizer.

A backend is a module with two functions; `--engine-backend MODULE` selects another (tests use a
fake one so the HTTP layer is tested without a model):
  `load(config: EngineConfig) -> LoadedEngine`      runs in the engine process
  `load_tokenizer(model_path: str) -> Tokenizer`   runs in the API process
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ftrs.config import EngineConfig
from ftrs.server.engine_process import LoadedEngine


def load(config: EngineConfig) -> LoadedEngine:
    from ftrs.engine.core import EngineCore
    from ftrs.models import resolve_model

    path = str(resolve_model(config.model))
    engine = EngineCore(replace(config, model=path))
    return LoadedEngine(engine, path)


def load_tokenizer(model_path: str) -> Any:
    from ftrs.models.tokenizer import load_tokenizer as _load

    return _load(model_path)


__all__ = ["load", "load_tokenizer"]
