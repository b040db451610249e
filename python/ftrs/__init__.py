"""ftrs: serve Mixture-of-Experts models bigger than the GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ftrs.errors import FtrsError
from ftrs.sampling import SamplingParams

__version__ = "0.1.0"

if TYPE_CHECKING:
    from ftrs.llm import LLM, Completion


def __getattr__(name: str) -> Any:
    # Lazy: `import ftrs` stays cheap (no torch) for the API process and the CLI's fast paths.
    if name in ("LLM", "Completion"):
        from ftrs import llm

        return getattr(llm, name)
    raise AttributeError(name)


__all__ = ["LLM", "Completion", "FtrsError", "SamplingParams", "__version__"]
