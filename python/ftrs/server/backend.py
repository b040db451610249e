"""The default engine backend: `ftrs.engine.core.EngineCore` and the model's own tokenizer.

A backend is a module with two functions; `--engine-backend MODULE` selects another (tests use a
fake one so the HTTP layer is tested without a model):
  `load(config: EngineConfig) -> LoadedEngine`           runs in the engine process
  `load_tokenizer(source: object) -> Tokenizer | None`   runs in the API process
`LoadedEngine.tokenizer_source` crosses the pipe, so it must pickle. Here it is the tokenizer's
JSON and chat-template fields: the API process rebuilds the very tokenizer the engine loaded
(from a directory or a GGUF file) without reading the checkpoint a second time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ftrs.config import EngineConfig
from ftrs.server.engine_process import LoadedEngine

if TYPE_CHECKING:
    from ftrs.models.tokenizer import Tokenizer


def load(config: EngineConfig) -> LoadedEngine:
    from ftrs.engine.core import EngineCore

    engine = EngineCore(config, progress=True)
    engine.warm_grammar()  # structured output's token trie, built before requests come
    tok = engine.tokenizer
    return LoadedEngine(engine, tokenizer_source(tok) if tok is not None else None)


def tokenizer_source(tok: Tokenizer) -> dict[str, Any]:
    """The fields `load_tokenizer` rebuilds `tok` from (they pickle)."""
    return {"json": tok.tk.to_str(), "chat_template": tok.chat_template,
            "named_templates": tok.named_templates,
            "bos_token": tok.bos_token, "eos_token": tok.eos_token,
            "eos_token_ids": sorted(tok.eos_token_ids), "add_bos": tok.add_bos}


def load_tokenizer(source: Any) -> Any:
    if source is None:
        return None
    from tokenizers import Tokenizer as HFTokenizer

    from ftrs.engine import grammar
    from ftrs.models.tokenizer import Tokenizer

    tok = Tokenizer(HFTokenizer.from_str(source["json"]), source["chat_template"],
                    source["bos_token"], source["eos_token"], source["eos_token_ids"],
                    add_bos=source["add_bos"], named_templates=source["named_templates"])
    grammar.warm(tok)  # `grammar.check` compiles against it: build its token trie now
    return tok


__all__ = ["load", "load_tokenizer", "tokenizer_source"]
