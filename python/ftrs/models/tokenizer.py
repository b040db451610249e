"""Tokenizer and chat template, from `tokenizer.json`/`tokenizer_config.json` or GGUF metadata.

Built on `tokenizers` and `jinja2` only; transformers is never needed at run time. GGUF files
carry a byte-level BPE vocabulary and merges; the pre-tokenizer follows llama.cpp's `pre` name
(for `smollm`: single digits, then the GPT-2 byte-level split, as the original tokenizer does).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ftrs.errors import InvalidRequest, ModelLoadError

_CONTROL = 3  # llama.cpp token type of special tokens such as <|im_start|>


def _raise(message: str) -> None:
    raise InvalidRequest(f"chat template: {message}")


class Tokenizer:
    """Encode, decode, and render chat messages into a prompt."""

    def __init__(self, tk: HFTokenizer, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None, eos_token_ids: Sequence[int], add_bos: bool = False) -> None:
        self.tk = tk
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self.add_bos = add_bos
        self.bos_token_id = tk.token_to_id(bos_token) if bos_token else None
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(chat_template) if chat_template else None

    @property
    def vocab_size(self) -> int:
        return int(self.tk.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self.tk.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return list(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise InvalidRequest("this model has no chat template; use /v1/completions")
        try:
            return str(self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or ""))
        except jinja2.TemplateError as e:
            raise InvalidRequest(f"chat template failed: {e}") from e

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def from_dir(cls, model_dir: Path) -> Tokenizer:
        tj = model_dir / "tokenizer.json"
        if not tj.is_file():
            raise ModelLoadError(str(tj), "tokenizer.json not found")
        try:
            tk = HFTokenizer.from_file(str(tj))
        except Exception as e:
            raise ModelLoadError(str(tj), f"cannot parse tokenizer: {e}") from e
        conf: dict[str, Any] = {}
        tc = model_dir / "tokenizer_config.json"
        if tc.is_file():
            conf = json.loads(tc.read_text())

        def tok(v: Any) -> str | None:
            return v.get("content") if isinstance(v, dict) else v

        bos, eos = tok(conf.get("bos_token")), tok(conf.get("eos_token"))
        eos_ids: set[int] = set()
        eos_id = tk.token_to_id(eos) if eos else None
        if eos_id is not None:
            eos_ids.add(int(eos_id))
        for name in ("generation_config.json", "config.json"):
            p = model_dir / name
            if p.is_file():
                found = json.loads(p.read_text()).get("eos_token_id")
                if isinstance(found, list):
                    eos_ids |= {int(i) for i in found}
                elif isinstance(found, int):
                    eos_ids.add(found)
        template = conf.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja = model_dir / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text()
        return cls(tk, template, bos, eos, sorted(eos_ids), bool(conf.get("add_bos_token", False)))

    @classmethod
    def from_gguf_fields(cls, meta: dict[str, Any], source: str) -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(source, f"unsupported GGUF tokenizer {kind!r} (supported: gpt2)")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        vocab = {t: i for i, t in enumerate(tokens)}
        tk = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if meta.get("tokenizer.ggml.pre") == "smollm":
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tk.pre_tokenizer = byte_level
        tk.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type") or []
        tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                               for t, ty in zip(tokens, types) if ty == _CONTROL])

        def name(key: str) -> str | None:
            i = meta.get(key)
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        return cls(tk, meta.get("tokenizer.chat_template"), name("tokenizer.ggml.bos_token_id"),
                   name("tokenizer.ggml.eos_token_id"), [eos_id] if eos_id is not None else [],
                   bool(meta.get("tokenizer.ggml.add_bos_token", False)))

    def save(self, out_dir: Path) -> None:
        """Write tokenizer.json and tokenizer_config.json, readable by `from_dir` and by HF."""
        self.tk.save(str(out_dir / "tokenizer.json"))
        conf = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos_token,
                "eos_token": self.eos_token, "add_bos_token": self.add_bos,
                "chat_template": self.chat_template}
        (out_dir / "tokenizer_config.json").write_text(json.dumps(conf, indent=2))
