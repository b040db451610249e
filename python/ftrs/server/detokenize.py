"""Incremental detokenization and stop-string matching, in the API process.

Detokenizer: a token can end in the middle of a multi-byte UTF-8 character (byte-level BPE), and
SentencePiece decoders render a leading space from the previous token. So each push decodes a
short window `ids[prefix_offset:]` and emits only the part past `ids[prefix_offset:read_offset]`;
while the window ends in U+FFFD (an incomplete character) it emits only the text before it and
does not advance. The concatenation of what
`push` and `flush` return equals `decode(all ids)` for tokenizers whose decode is local.

Stop strings: matched on the detokenized text; the text is cut *before* the stop string, and the
tail that could still become a stop string is held back, so a client never sees part of one.
"""

from __future__ import annotations

from typing import Protocol, cast


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class KeepingDecoder(Protocol):
    """A decoder that can keep chosen special tokens as text (`models.tokenizer.Tokenizer`)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               keep: frozenset[int] = frozenset()) -> str: ...


_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that are stable once emitted."""

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True,
                 keep: frozenset[int] = frozenset()) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._keep = keep  # special tokens shown as text all the same (a tool parser's tags)
        self.ids: list[int] = []
        self._prefix_offset = 0  # start of the context window decoded with each push
        self._read_offset = 0  # ids before this index are already emitted as text
        self._partial = 0  # chars emitted past `read_offset` while a character was incomplete
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        if self._keep:
            keeping = cast(KeepingDecoder, self._tok)
            return keeping.decode(ids, skip_special_tokens=self._skip, keep=self._keep)
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the newly stable text (possibly "")."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        start = len(prefix) + self._partial
        if full.endswith(_REPLACEMENT):
            # An incomplete character at the end: emit what precedes it, keep the window.
            stable = full.rstrip(_REPLACEMENT)
            delta = stable[start:] if len(stable) > start else ""
            self._partial += len(delta)
        else:
            delta = full[start:] if len(full) > start else ""
            if len(full) > len(prefix):
                self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
                self._partial = 0
        self.text += delta
        return delta

    def flush(self) -> str:
        """The request finished: emit whatever is left, incomplete characters included."""
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        start = len(prefix) + self._partial
        delta = full[start:] if len(full) > start else ""
        self._prefix_offset = self._read_offset = len(self.ids)
        self._partial = 0
        self.text += delta
        return delta


class StopChecker:
    """Cuts the output at the first stop string; holds back a possible partial match."""

    def __init__(self, stop: tuple[str, ...] | list[str]) -> None:
        self._stop = tuple(s for s in stop if s)
        self._buf = ""  # text received but not yet released
        self.stopped = False
        self.matched: str | None = None

    @property
    def active(self) -> bool:
        """Whether there is any stop string to look for."""
        return bool(self._stop)

    def feed(self, delta: str) -> str:
        """Add text; return what may be released now. After a match, returns the text before it."""
        if self.stopped:
            return ""
        if not self._stop:
            return delta
        self._buf += delta
        hit = -1
        for s in self._stop:
            i = self._buf.find(s)
            if i != -1 and (hit == -1 or i < hit):
                hit, self.matched = i, s
        if hit != -1:
            self.stopped = True
            out, self._buf = self._buf[:hit], ""
            return out
        keep = self._held_back()
        out = self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep :]
        return out

    def flush(self) -> str:
        """No more text will come: release what was held back."""
        out, self._buf = ("" if self.stopped else self._buf), ""
        return out

    def _held_back(self) -> int:
        """Length of the longest suffix of the buffer that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._buf)), best, -1):
                if self._buf.endswith(s[:n]):
                    best = n
                    break
        return best


def push_until_stop(ids: list[int], last: bool, detok: IncrementalDetokenizer,
                    stop: StopChecker) -> tuple[list[int], str]:
    """Push one event's tokens through `detok` and `stop`: the tokens kept and the text that
    may be released. With stop strings, an event of several tokens (a step that accepted
    drafts, `engine/spec.py`) is pushed one token at a time and cut after the token that
    completes a match, as if each token had come alone. `last`: no tokens follow the event."""
    if len(ids) <= 1 or not stop.active:
        text = detok.push(ids) + (detok.flush() if last else "")
        return ids, stop.feed(text)
    out = ""
    for j, tok in enumerate(ids):
        text = detok.push([tok]) + (detok.flush() if last and j == len(ids) - 1 else "")
        out += stop.feed(text)
        if stop.stopped:
            return ids[:j + 1], out
    return ids, out


__all__ = ["Decoder", "IncrementalDetokenizer", "KeepingDecoder", "StopChecker", "push_until_stop"]
