"""Incremental detokenization of multi-byte text and stop-string matching."""

from __future__ import annotations

import pytest
from fake_backend import ByteTokenizer

from ftrs.server.detokenize import IncrementalDetokenizer, StopChecker, push_until_stop

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
