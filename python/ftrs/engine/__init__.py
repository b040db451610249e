"""The engine: one forward step over a scheduled batch, and sampling."""
