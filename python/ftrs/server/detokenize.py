"""Incremental detokenization and stop-string matching, in the API process.

Detokenizer: a token can end in the middle of a multi-byte UTF-8 character (byte-level BPE), and
SentencePiece decoders render a leading space from the previous token. So each push decodes a
short window `ids[prefix_offset:]` and emits only the part past `ids[prefix_offset:read_offset]`;
while the window ends in U+FFFD (an incomplete character) it emits only the text before it and
does not advance. The concatenation of what
`push` and `flush` return equals `decode(all ids)` for tokenizers whose decode is local.

Stop strings: matched on the detokenized text; the text is cut *before* the stop string, and the
tail that could still become a stop string is held back, so a client never sees part of one.
Logprobs follow the text (`LogprobCut`): a token's entry waits while its text starts in held-back
text, and a stop string drops the entries of the tokens that start at or past the cut.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol, cast

from ftrs.engine.protocol import TokenLogprob


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class KeepingDecoder(Protocol):
    """A decoder that can keep chosen special tokens as text (`models.tokenizer.Tokenizer`)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               keep: frozenset[int] = frozenset()) -> str: ...


_REPLACEMENT = "\ufffd"


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: each of the 256 bytes is written as one printable
    character (printable Latin-1 as itself, the others as U+0100 upwards, in byte order)."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in kept]
    table = {chr(b): b for b in kept}
    table.update({chr(0x100 + i): b for i, b in enumerate(moved)})
    return table


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """A token's own bytes, for logprobs' `bytes`: a byte-level token that is part of a
    character is that byte (its decoded text is U+FFFD); a SentencePiece byte-fallback token
    `<0xE2>` is the byte; any other token is its decoded text in UTF-8."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        tk = getattr(tokenizer, "tk", None)
        self._tk = tk
        decoder = json.dumps(json.loads(tk.to_str()).get("decoder")) if tk is not None else ""
        self._byte_level = _byte_level_chars() if '"ByteLevel"' in decoder else None
        self._fallback = '"ByteFallback"' in decoder
        self._metaspace = '"Metaspace"' in decoder or '"\\u2581"' in decoder  # "▁" is a space
        added = tk.get_added_tokens_decoder() if tk is not None else {}
        self._added = {i: t.content for i, t in added.items()}
        #: special tokens, left out of the text a client reads
        self.special = frozenset(i for i, t in added.items() if t.special)

    def __call__(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tk.id_to_token(token_id) if self._tk is not None else None
        if piece is not None:
            if self._byte_level is not None and all(c in self._byte_level for c in piece):
                return bytes(self._byte_level[c] for c in piece)
            m = _BYTE_TOKEN.fullmatch(piece)
            if self._fallback and m:
                return bytes([int(m.group(1), 16)])
            if self._metaspace:
                return piece.replace("\u2581", " ").encode()
        return str(self._tok.decode([token_id], skip_special_tokens=False)).encode()


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
        #: per id of `ids`: where its text starts in `text` (len(text) before the push that added it)
        self.starts: list[int] = []

    def _decode(self, ids: list[int]) -> str:
        if self._keep:
            keeping = cast(KeepingDecoder, self._tok)
            return keeping.decode(ids, skip_special_tokens=self._skip, keep=self._keep)
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the newly stable text (possibly "")."""
        self.ids.extend(new_ids)
        self.starts.extend([len(self.text)] * len(new_ids))
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
        self.released = 0  # chars released so far; after a match, where the text was cut
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
            self.released += len(delta)
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
            self.released += len(out)
            return out
        keep = self._held_back()
        out = self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep :]
        self.released += len(out)
        return out

    def flush(self) -> str:
        """No more text will come: release what was held back."""
        out, self._buf = ("" if self.stopped else self._buf), ""
        self.released += len(out)
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


class LogprobCut:
    """The logprob entries of released text only, so that they describe the text a client gets.

    With stop strings, a token's entry waits while its text starts at or past what `stop` has
    released (text held back as a possible stop string, or not yet emitted by `detok`). When a
    stop string matches, the waiting entries are dropped: their tokens lie wholly in the stop
    string or after it. A token that straddles the cut (part of its text returned) started
    before it, so its entry was released. Without stop strings, entries pass at once."""

    def __init__(self, detok: IncrementalDetokenizer, stop: StopChecker) -> None:
        self._detok = detok
        self._stop = stop
        self._held: list[tuple[int, TokenLogprob]] = []  # (start of the token's text, entry)

    def take(self, ids: list[int], lps: list[TokenLogprob], finished: bool) -> list[TokenLogprob]:
        """The entries that go out now: `ids` are the tokens `push_until_stop` just kept (the
        last ones pushed to `detok`), `lps` their entries (the event's; [] without logprobs);
        call it after the event's text went through `stop`. `finished`: no tokens follow."""
        if not self._stop.active:
            return lps[:len(ids)]
        starts = self._detok.starts[len(self._detok.starts) - len(ids):]
        self._held.extend(zip(starts, lps[:len(ids)], strict=False))
        if finished and not self._stop.stopped:
            out, self._held = [lp for _, lp in self._held], []
            return out
        cut = self._stop.released
        out = [lp for s, lp in self._held if s < cut]
        self._held = [] if self._stop.stopped else [(s, lp) for s, lp in self._held if s >= cut]
        return out


__all__ = ["Decoder", "IncrementalDetokenizer", "KeepingDecoder", "LogprobCut", "StopChecker",
           "push_until_stop"]
