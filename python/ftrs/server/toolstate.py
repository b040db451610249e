"""`StateToolParser`: the tag-driven tool-call families' state machine (Mistral, harmony,
DeepSeek, the XML-member formats), over the `ToolParser` base of `toolbase`."""

from __future__ import annotations

from typing import Any

from ftrs.server.toolbase import CallStream, ToolParser, split_at_tag


class StateToolParser(ToolParser):
    """A family read by a state machine: `_st_<state>` methods consume the buffer and say
    whether they progressed; `_raw` is the current call section's text, shown as content if it
    turns out malformed; the "bad" state keeps it to the end."""

    SECTION = ""  # the tag a call section opens with (`_st_out`)
    FIRST = ""  # the state after it

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        self._state = "out"
        self._raw: list[str] = []
        self._call: CallStream | None = None  # the call being read

    def _stream_args(self) -> bool | None:
        """Feed the buffer to the current call's arguments object: None while it goes on, True
        once it is complete, False when it is malformed (the state is then "bad")."""
        assert self._call is not None
        self._take(self._stream(self._call, self._buf))
        if self._call.error:
            self._state = "bad"
            return False
        return True if self._call.done else None

    def _st_out(self) -> bool:
        """Content up to the section's tag, then its first state."""
        before, after, held = split_at_tag(self._buf, self.SECTION)
        self._show(before)
        if after is None:
            self._buf = held
            return False
        self._enter_call()
        self._raw, self._buf, self._state = [self.SECTION], after, self.FIRST
        return True

    def _advance(self) -> None:
        while self._buf or self._state == "bad":
            if self._state == "bad":
                self._raw.append(self._buf)
                self._buf = ""
                return
            if not getattr(self, "_st_" + self._state)():
                return

    def _take(self, n: int) -> str:
        """The next `n` characters, consumed into the section's text."""
        taken, self._buf = self._buf[:n], self._buf[n:]
        self._raw.append(taken)
        return taken

    def _bad(self) -> bool:
        self._state = "bad"
        return True

    def _after_space(self, *tags: str) -> str | None:
        """The tag of `tags` the buffer starts with after whitespace (both consumed); "" while
        it may still become one; None when it cannot."""
        stripped = self._buf.lstrip()
        for tag in tags:
            if stripped.startswith(tag):
                self._take(len(self._buf) - len(stripped) + len(tag))
                return tag
        return "" if any(tag.startswith(stripped) for tag in tags) else None


__all__ = ["StateToolParser"]
