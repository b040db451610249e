"""The serving layer: an OpenAI-compatible API process that supervises an engine process.

Modules: `app` (FastAPI app and routes), `protocol` (OpenAI pydantic models), `serving` (request
-> tokens -> response), `engine_client` / `engine_process` (the two sides of the pipe),
`detokenize`, `metrics`, `errors`, `backend`, `cli` (`ftrs serve`). Imports here stay light:
the engine process imports this package too.
"""

from __future__ import annotations

from ftrs.server.cli import add_serve_arguments, run_serve

__all__ = ["add_serve_arguments", "run_serve"]
