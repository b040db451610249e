"""Incremental detokenization of multi-byte text, stop-string matching, and the bytes and text
offsets of logprobs."""

from __future__ import annotations

import pytest
from fake_backend import ByteTokenizer

from ftrs.engine.protocol import TokenLogprob
from ftrs.models.tiny import tiny_tokenizer
from ftrs.server.detokenize import (
    IncrementalDetokenizer,
    LogprobCut,
    StopChecker,
    push_until_stop,
)
from ftrs.server.responses import chat_logprobs, completion_logprobs

TEXT = "héllo wörld 你好 🙂!"


def test_byte_by_byte_deltas_reassemble_the_text_without_replacement_chars() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([b]) for b in TEXT.encode()]
    deltas.append(detok.flush())
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    # the 4-byte emoji is emitted once, whole, on its last byte
    assert "🙂" in deltas


def test_flush_emits_an_incomplete_character_at_the_end() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer())
    assert detok.push(list(b"a") + list("你".encode())[:2]) == "a"
    assert detok.flush() == "\ufffd"


def test_special_tokens_are_skipped() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer())
    assert detok.push([104, 105, 257]) + detok.flush() == "hi"


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_stop_string_cuts_the_text_before_it_whatever_the_chunking(chunk: int) -> None:
    text = "one two STOP three"
    checker = StopChecker(["STOP"])
    out = ""
    for i in range(0, len(text), chunk):
        out += checker.feed(text[i : i + chunk])
        if checker.stopped:
            break
    assert checker.stopped and checker.matched == "STOP"
    assert out == "one two "


def test_partial_stop_string_is_held_back_then_released() -> None:
    checker = StopChecker(["<end>"])
    assert checker.feed("abc<e") == "abc"
    assert checker.feed("x") == "<ex"
    assert checker.feed("<en") == ""
    assert checker.flush() == "<en"
    assert not checker.stopped


def test_earliest_of_several_stop_strings_wins() -> None:
    checker = StopChecker(["world", "lo"])
    assert checker.feed("hello world") == "hel"
    assert checker.matched == "lo"
    assert checker.feed("more") == ""


def test_no_stop_strings_passes_text_through() -> None:
    checker = StopChecker([])
    assert checker.feed("abc") == "abc"
    assert checker.flush() == ""


@pytest.mark.parametrize("chunk", [1, 2, 5, 40])
def test_an_event_of_several_tokens_is_cut_after_the_token_that_completes_a_stop(chunk: int) -> None:
    ids = list(b"say ST then STOP, and more")
    detok, stop = IncrementalDetokenizer(ByteTokenizer()), StopChecker(["STOP"])
    kept: list[int] = []
    out = ""
    for i in range(0, len(ids), chunk):
        part, text = push_until_stop(ids[i:i + chunk], i + chunk >= len(ids), detok, stop)
        kept += part
        out += text
        if stop.stopped:
            break
    assert out == "say ST then "
    assert bytes(kept).decode() == "say ST then STOP"  # the tokens one at a time would give
    detok, stop = IncrementalDetokenizer(ByteTokenizer()), StopChecker([])
    assert push_until_stop(ids, True, detok, stop) == (ids, "say ST then STOP, and more")


class _Words:
    """A tokenizer whose tokens are several characters long: id i is WORDS[i]."""

    WORDS = ("ab", "cd", "ef", "c", "d", "e", "x")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.WORDS[i] for i in ids)


@pytest.mark.parametrize(("ids", "stop", "text", "kept"), [
    ([0, 1, 2, 6], "de", "abc", [0, 1]),  # "cd" straddles the cut: "c" is returned
    ([0, 3, 4, 5, 6], "cde", "ab", [0]),  # "c", "d" were held back, "e" completed the match
    ([0, 3, 4, 6], "cde", "abcdx", [0, 3, 4, 6]),  # no match: the held entries go out
    ([3, 0], "cab", "", []),  # the stop string from the first character
])
@pytest.mark.parametrize("chunk", [1, 3])
def test_logprobs_describe_only_the_text_before_a_stop_string(
        ids: list[int], stop: str, text: str, kept: list[int], chunk: int) -> None:
    """The entries of the tokens that lie wholly after the cut are dropped (streamed too: an
    entry waits while its token's text is held back); a token that straddles it keeps its."""
    detok, checker = IncrementalDetokenizer(_Words()), StopChecker([stop])
    cut = LogprobCut(detok, checker)
    out, lps = "", []
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        part, delta = push_until_stop(ids[i:i + chunk], last, detok, checker)
        out += delta + (checker.flush() if last else "")  # as `Generation.run` does
        lps += cut.take(part, _lps(ids[i:i + chunk]), last or checker.stopped)
        if checker.stopped:
            break
    assert (out, [lp.token_id for lp in lps]) == (text, kept)


def test_without_stop_strings_logprobs_pass_at_once() -> None:
    detok, checker = IncrementalDetokenizer(ByteTokenizer()), StopChecker([])
    cut = LogprobCut(detok, checker)
    ids = list("é".encode())  # the first byte alone is no text yet
    part, _ = push_until_stop(ids[:1], False, detok, checker)
    assert [lp.token_id for lp in cut.take(part, _lps(ids[:1]), False)] == ids[:1]


# ------------------------------------------------------------- logprobs: a token's own bytes


def _lps(ids: list[int]) -> list[TokenLogprob]:
    return [TokenLogprob(token_id=i, logprob=-0.5, top=[(i, -0.5)]) for i in ids]


def test_logprob_bytes_are_the_tokens_own_and_rebuild_the_text() -> None:
    """A byte-level token inside a character decodes to U+FFFD; its `bytes` were U+FFFD's
    (239, 191, 189), so a client could not rebuild the character from them."""
    tok = tiny_tokenizer(512)
    ids = tok.encode("Hi é😀 ok")  # 'é' is two tokens, '😀' four
    content = chat_logprobs(tok, _lps(ids)).content
    assert [c.bytes for c in content[3:5]] == [[0xC3], [0xA9]]
    assert [c.bytes for c in content[5:9]] == [[0xF0], [0x9F], [0x98], [0x80]]
    assert bytes(b for c in content for b in c.bytes).decode() == "Hi é😀 ok"
    assert [c.top_logprobs[0].bytes for c in content] == [c.bytes for c in content]
    assert content[3].token == "\ufffd"  # the token string is still its decoded text


def test_text_offsets_count_characters_of_the_text_only() -> None:
    """`text_offset` counted the decoded length of each token: special tokens (not in the text)
    and each piece of a multi-byte character moved it on."""
    tok = tiny_tokenizer(512)
    eos = tok.encode("<|im_end|>")
    ids = tok.encode("Hi é") + eos + tok.encode("😀 ok")
    lp = completion_logprobs(tok, _lps(ids), 10)
    #          H   i  ' '  é.. é.. EOS 😀.. (4)          ' '  o   k
    assert lp.text_offset == [10, 11, 12, 13, 13, 14, 14, 14, 14, 14, 15, 16, 17]
