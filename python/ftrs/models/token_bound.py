"""The most characters of a text one token can stand for, so a prompt that cannot fit the
context is refused before it is tokenized (megabytes take seconds of CPU to tokenize).

The bound holds when every character of the text ends up inside some token's span and no span is
longer than the longest entry of the vocabulary:
- the normalizer never shortens the text: none, `Prepend`, or `Replace` of a literal by a text at
  least as long (NFC, `Strip`, `StripAccents`, regex replacements can shorten it: no bound);
- the pre-tokenizer drops nothing: `ByteLevel`, `Digits`, `Metaspace`, and `Split`/`Punctuation`
  that keep their delimiters (`Whitespace`, `BertPreTokenizer`, `removed` splits drop: no bound);
- the model spells every piece with vocabulary entries: BPE, whose entry of k characters covers
  at most k characters of the (normalized) text: k bytes in a byte-level vocabulary, where a
  character is one or more bytes; an unknown character is one `unk` token unless `fuse_unk` joins
  a run of them into one (no bound then, unless `byte_fallback` spells every byte as a token);
- added tokens, special ones included, are matched whole in the text and so cover exactly their
  content: they count among the entries (their length is what they cover); one that strips the
  whitespace beside it (`lstrip`/`rstrip`) covers any run of it: no bound.
Then a text of more than `n * L` characters (L the longest entry) is more than `n` tokens.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

# pre-tokenizers that keep every character of their input in some piece
_KEEPING_PRE = frozenset({"ByteLevel", "Digits", "Metaspace", "Split", "Punctuation", "Sequence"})


def _state(component: Any) -> dict[str, Any] | None:
    return None if component is None else dict(json.loads(component.__getstate__()))


def _keeps_length(normalizer: dict[str, Any] | None) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_keeps_length(n) for n in normalizer.get("normalizers", []))
    if kind == "Replace":
        literal = normalizer.get("pattern", {}).get("String")
        return isinstance(literal, str) and len(normalizer.get("content", "")) >= len(literal)
    return kind == "Prepend"


def _keeps_text(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind not in _KEEPING_PRE or pre.get("behavior") == "Removed":
        return False
    return all(_keeps_text(p) for p in pre.get("pretokenizers", []))


def max_chars_per_token(tk: HFTokenizer) -> int | None:
    """The most characters of a text that one token of `tk` stands for, or None when this
    tokenizer's pipeline gives no such bound (see the module's docstring)."""
    model = tk.model
    if type(model).__name__ != "BPE":
        return None
    if not _keeps_length(_state(tk.normalizer)) or not _keeps_text(_state(tk.pre_tokenizer)):
        return None
    if any(t.lstrip or t.rstrip for t in tk.get_added_tokens_decoder().values()):
        return None
    vocab = tk.get_vocab(with_added_tokens=True)
    if model.unk_token and model.fuse_unk and not (
            model.byte_fallback and all(f"<0x{b:02X}>" in vocab for b in range(256))):
        return None  # a run of unknown characters may be one `unk`
    return max((len(t) for t in vocab), default=0) or None


__all__ = ["max_chars_per_token"]
