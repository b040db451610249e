"""Checkpoints: ArchSpec, loaders (safetensors, GGUF), tokenizer, and model-making commands.

Imports are lazy so that the API process can load a tokenizer without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ftrs.models.load import LoadedModel, load_model, resolve_model


def __getattr__(name: str) -> Any:
    if name in ("LoadedModel", "load_model", "resolve_model"):
        from ftrs.models import load

        return getattr(load, name)
    raise AttributeError(name)


__all__ = ["LoadedModel", "load_model", "resolve_model"]
