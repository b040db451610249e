"""Checkpoints: ArchSpec, loaders (safetensors, GGUF), tokenizer, and model-making commands."""

from ftrs.models.load import LoadedModel, load_model, resolve_model

__all__ = ["LoadedModel", "load_model", "resolve_model"]
