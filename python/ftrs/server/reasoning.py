"""Reasoning text (`<think>...</think>`) split from the answer, incrementally.

A `ReasoningParser` sees one generation's text in pieces and returns (reasoning delta, content
delta) per piece. The reasoning is what lies between `<think>` and `</think>`; the content is
what follows. A `<think>` counts only at the very start of the output (after whitespace): Qwen3
writes it there itself. Templates that open the thinking in the prompt (DeepSeek-R1, the Qwen3
thinking-only models) leave the model inside it: then the parser starts in reasoning
(`starts_in_reasoning`, see `opens_reasoning`), and a `<think>` the model repeats is dropped.

Whitespace around the reasoning and at the start of the content is dropped (the template's
newlines after `<think>` and after `</think>`); a tag split across pieces is held back until it
is decided. If the output ends inside the reasoning, all of it was reasoning.
"""

from __future__ import annotations

from typing import ClassVar

from ftrs.errors import ConfigError

OPEN, CLOSE = "<think>", "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt leaves the model inside `<think>` (the template opened it)."""
    tail = prompt.rstrip()
    return tail.endswith(OPEN)


class ReasoningParser:
    """Splits `<think>` reasoning from content; one instance per generation."""

    name: ClassVar[str] = ""
    default_starts_in_reasoning: ClassVar[bool] = False

    def __init__(self, starts_in_reasoning: bool | None = None) -> None:
        if starts_in_reasoning is None:
            starts_in_reasoning = self.default_starts_in_reasoning
        # "start": before any text (a <think> may come); "think": in reasoning; "content".
        self._state = "think" if starts_in_reasoning else "start"
        self._opened = starts_in_reasoning  # a leading <think> is dropped
        self._buf = ""  # text not yet decided
        self._ws = ""  # whitespace held at the end of the reasoning
        self._lead = True  # at the start of the reasoning or of the content: drop whitespace

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        reasoning, content = self._advance(final=True)
        self._ws = ""
        return reasoning, content

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith(OPEN):
                    self._buf, self._state = stripped[len(OPEN):], "think"
                elif final or (stripped and not OPEN.startswith(stripped)):
                    # no reasoning: the text is the answer as written
                    self._state, self._lead = "content", False
                else:
                    break
            elif self._state == "think":
                if self._lead:
                    self._buf = self._buf.lstrip()
                    if self._opened and self._buf.startswith(OPEN):
                        self._buf = self._buf[len(OPEN):]
                        continue
                    if not self._buf or (self._opened and OPEN.startswith(self._buf)
                                         and not final):
                        break
                    self._lead = False
                i = self._buf.find(CLOSE)
                if i >= 0:
                    reasoning.append(self._held(self._buf[:i], close=True))
                    self._buf, self._state, self._lead = self._buf[i + len(CLOSE):], "content", True
                    continue
                keep = 0 if final else _partial_suffix(self._buf, CLOSE)
                reasoning.append(self._held(self._buf[: len(self._buf) - keep], close=final))
                self._buf = self._buf[len(self._buf) - keep:]
                break
            else:
                if self._lead:
                    self._buf = self._buf.lstrip()
                    if not self._buf:
                        break
                    self._lead = False
                content.append(self._buf)
                self._buf = ""
        return "".join(reasoning), "".join(content)

    def _held(self, text: str, close: bool) -> str:
        """Reasoning text with its trailing whitespace held back (dropped at the close)."""
        text = self._ws + text
        if close:
            self._ws = ""
            return text.rstrip()
        kept = text.rstrip()
        self._ws = text[len(kept):]
        return kept


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: the model opens `<think>` itself (none when `enable_thinking` is false)."""

    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: the template ends the prompt with `<think>`; the output starts in it."""

    name = "deepseek_r1"
    default_starts_in_reasoning = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}


def choose_reasoning_parser(flag: str | None, chat_template: str | None) -> str | None:
    """The `--reasoning-parser` flag if given; else one when the chat template knows `<think>`
    (`deepseek_r1` for DeepSeek's own markers, `qwen3` otherwise); else None."""
    if flag is not None:
        if flag not in REASONING_PARSERS:
            raise ConfigError(f"--reasoning-parser: unknown parser {flag!r}; "
                              f"known: {', '.join(sorted(REASONING_PARSERS))}")
        return flag
    template = chat_template or ""
    if OPEN not in template:
        return None
    return "deepseek_r1" if "<｜Assistant｜>" in template else "qwen3"


__all__ = ["REASONING_PARSERS", "ReasoningParser", "choose_reasoning_parser", "opens_reasoning"]
