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

gpt-oss writes no `<think>`: its output is a run of harmony messages, each a header and a body
(every tag one special token of its vocabulary):

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{..}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

(the prompt ends with `<|start|>assistant`, so the first header follows at once; a recipient
`to=..` may also stand before `<|channel|>`; `<|return|>` and `<|call|>` end the generation and
never reach the text). `HarmonyParser` (`gpt_oss`) reads the messages: the analysis channel is
reasoning; the final channel and commentary addressed to no one (a preamble) are content; a
message to `functions.NAME` is passed on as content in one canonical form,
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{..}<|call|>`, which the
`gpt_oss` tool parser reads (`toolcalls_harmony`); a message to another recipient (the built-in
browser and python tools, which this server does not run) is reasoning. Messages of one kind
are joined by a blank line. Output that does not open with a header is content as written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import ClassVar

from ftrs.errors import ConfigError

OPEN, CLOSE = "<think>", "</think>"


def partial(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
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
    #: tags that tokenizers may hold as special tokens; the detokenizer keeps them for the parser
    special_tags: ClassVar[tuple[str, ...]] = (OPEN, CLOSE)

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

    @classmethod
    def grammar_lead(cls, special: Mapping[str, int], answer: bool, opened: bool = False) -> str:
        """Lark rules of a rule `lead`: the reasoning a grammar lets the model write before the
        text it constrains (`answer`: an answer, else a tool call), `special` the tags the
        tokenizer holds as special tokens, `opened`: the prompt opened the reasoning. Here a
        `<think>` block (closed, when the prompt opened it), then whitespace."""
        if (OPEN in special) != (CLOSE in special):
            return ""  # one tag a token, the other text: not offered
        if OPEN in special:
            start = f"<[{special[OPEN]}]>"
            body = f"thought: THOUGHT <[{special[CLOSE]}]>\nTHOUGHT: /(.|\\n)*/\n"
        else:
            start = json.dumps(OPEN)
            body = f"thought[suffix={json.dumps(CLOSE)}]: /(.|\\n)*/\n"
        lead = "thought /[ \\n]*/" if opened else f"({start} thought /[ \\n]*/)?"
        return f"lead: {lead}\n{body}"

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
                keep = 0 if final else partial(self._buf, CLOSE)
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


START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
FUNCTIONS = "functions."  # the namespace of the request's tools
_BODY_ENDS = (END, CALL, RETURN, START)  # (a <|start|> ends a body whose <|end|> was left out)
_OPENINGS = (CHANNEL, START, "to=")  # how the first header may begin
LONGEST_HEADER = 512  # no header is longer: a longer one is not harmony
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


def harmony_header(header: str) -> tuple[str, str]:
    """(channel, recipient) of a message header ("" where it names none)."""
    channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
    return (channel.group(1) if channel else "", recipient.group(1) if recipient else "")


def harmony_call_header(recipient: str) -> str:
    """The canonical header of a call to `recipient` (`functions.NAME`), as the tool parser
    reads it."""
    return f"{CHANNEL}commentary to={recipient} {CONSTRAIN}json{MESSAGE}"


class HarmonyParser(ReasoningParser):
    """gpt-oss's messages split into reasoning, content and calls passed on (module doc)."""

    name = "gpt_oss"
    special_tags = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)

    def __init__(self, starts_in_reasoning: bool | None = None) -> None:
        super().__init__(False)
        self._state = "first"  # "first" before any header; "header"; "body"; "plain" (no harmony)
        self._kind = ""  # the body's: "reasoning", "content" or "call"
        self._shown = {"reasoning": False, "content": False}  # a message of the kind had text
        self._trail = {"reasoning": "", "content": ""}  # whitespace held at a body's end

    def _advance(self, final: bool) -> tuple[str, str]:
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        while self._buf:
            if self._state == "first":
                stripped = self._buf.lstrip()
                if stripped.startswith(_OPENINGS):
                    self._state = "header"
                elif final or not any(o.startswith(stripped) for o in _OPENINGS):
                    self._state = "plain"
                else:
                    break
            elif self._state == "plain":
                out["content"].append(self._buf)
                self._buf = ""
            elif self._state == "header":
                i = self._buf.find(MESSAGE)
                if i < 0:
                    if len(self._buf) > LONGEST_HEADER:
                        self._state = "plain"  # not harmony after all: shown as written
                        continue
                    if final:  # cut off inside a header: nothing of the message was said
                        self._buf = ""
                    break
                channel, recipient = harmony_header(self._buf[:i])
                self._buf, self._state, self._lead = self._buf[i + len(MESSAGE):], "body", True
                if recipient.startswith(FUNCTIONS):
                    self._kind = "call"
                    out["content"].append(harmony_call_header(recipient))
                elif recipient or channel == "analysis":
                    self._kind = "reasoning"
                else:
                    self._kind = "content"
            else:
                found = [(j, tag) for tag in _BODY_ENDS if (j := self._buf.find(tag)) >= 0]
                if found:
                    j, tag = min(found)
                    self._body(out, self._buf[:j], close=True)
                    self._buf = self._buf[j + (0 if tag == START else len(tag)):]
                    self._state = "header"
                    continue
                keep = 0 if final else max(partial(self._buf, t) for t in _BODY_ENDS)
                self._body(out, self._buf[: len(self._buf) - keep], close=final)
                self._buf = self._buf[len(self._buf) - keep:]
                break
        return "".join(out["reasoning"]), "".join(out["content"])

    @classmethod
    def grammar_lead(cls, special: Mapping[str, int], answer: bool, opened: bool = False) -> str:
        """One analysis message, then the final channel's header before an answer (a tool
        call's header is the tool grammar's); "" unless the harmony tags are special tokens."""
        if not all(t in special for t in (CHANNEL, MESSAGE, END, START)):
            return ""
        c, m, e, s = (f"<[{special[t]}]>" for t in (CHANNEL, MESSAGE, END, START))
        final = f' {c} "final" {m}' if answer else ""
        return (f"lead: analysis?{final}\n"
                f'analysis: {c} "analysis" {m} THOUGHT {e} {s} "assistant"\n'
                "THOUGHT: /(.|\\n)*/\n")

    def _body(self, out: dict[str, list[str]], text: str, close: bool) -> None:
        """A piece of the current body, routed by its kind: a call's text as it is; reasoning
        and content without the whitespace around it, a blank line after an earlier message."""
        kind = self._kind
        if kind == "call":
            out["content"].append(text + (CALL if close else ""))
            return
        if self._lead:
            text = text.lstrip()
            if not text:
                return
            self._lead = False
            if self._shown[kind]:
                text = "\n\n" + text
        text = self._trail[kind] + text
        kept = text.rstrip()
        self._trail[kind] = "" if close else text[len(kept):]
        if kept:
            out[kind].append(kept)
            self._shown[kind] = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "gpt_oss": HarmonyParser,
}


def choose_reasoning_parser(flag: str | None, chat_template: str | None) -> str | None:
    """The `--reasoning-parser` flag if given; else `gpt_oss` when the chat template writes
    harmony channels, one when it knows `<think>` (`deepseek_r1` for DeepSeek's own markers,
    `qwen3` otherwise); else None."""
    if flag is not None:
        if flag not in REASONING_PARSERS:
            raise ConfigError(f"--reasoning-parser: unknown parser {flag!r}; "
                              f"known: {', '.join(sorted(REASONING_PARSERS))}")
        return flag
    template = chat_template or ""
    if CHANNEL in template:  # gpt-oss's harmony channels
        return "gpt_oss"
    if OPEN not in template:
        return None
    return "deepseek_r1" if "<｜Assistant｜>" in template else "qwen3"


__all__ = ["REASONING_PARSERS", "HarmonyParser", "ReasoningParser", "choose_reasoning_parser",
           "harmony_call_header", "harmony_header", "opens_reasoning"]
