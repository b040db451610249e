"""Incremental detokenization of multi-byte text, stop-string matching, and the bytes and text
offsets of logprobs."""

from __future__ import annotations

import pytest
from fake_backend import ByteTokenizer

from ftrs.engine.protocol import TokenLogprob
from ftrs.models.tiny import tiny_tokenizer
from ftrs.server.detokenize import IncrementalDetokenizer, StopChecker, push_until_stop
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
