"""A GGUF file's `tokenizer.ggml.pre` picks the split its model's tokenizer makes.

The expected splits are worked out by hand from each tokenizer's published pattern (GPT-2's,
Llama 3's, Qwen2's, o200k's), on a text where all four differ: camel case, a run of digits, a
contraction, a blank line, a slash.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ftrs.errors import ModelLoadError
from ftrs.models.gguf_loader import gguf_metadata
from ftrs.models.tokenizer import Tokenizer, gguf_pre_tokenizer
from gguf_files import rewrite

TEXT = "helloWorld 12345 it's HTTPServer\n\n  x/y"
SPLITS = {
    # GPT-2: letters with their leading space, digits as one run, whitespace up to the last
    None: ["helloWorld", " 12345", " it", "'s", " HTTPServer", "\n\n ", " x", "/", "y"],
    # Llama 3: digits in threes, a non-letter joins the letters after it, newlines apart
    "llama-bpe": ["helloWorld", " ", "123", "45", " it", "'s", " HTTPServer", "\n\n", " ",
                  " x", "/y"],
    # Qwen2: Llama 3's pattern with single digits
    "qwen2": ["helloWorld", " ", "1", "2", "3", "4", "5", " it", "'s", " HTTPServer", "\n\n",
              " ", " x", "/y"],
    # Qwen3.5: Qwen2's split here (no combining marks in TEXT; see below)
    "qwen35": ["helloWorld", " ", "1", "2", "3", "4", "5", " it", "'s", " HTTPServer", "\n\n",
               " ", " x", "/y"],
    # o200k (gpt-oss): a lower-case run ends a word (camel case splits), the contraction stays
    "gpt-4o": ["hello", "World", " ", "123", "45", " it's", " HTTPServer", "\n\n", " ", " x",
               "/y"],
    # GLM-4.5 (`glm4`): Llama 3's pattern
    "glm4": ["helloWorld", " ", "123", "45", " it", "'s", " HTTPServer", "\n\n", " ", " x", "/y"],
    # DeepSeek-V3: digits in threes split first; here the same as Llama 3's (see below)
    "deepseek-v3": ["helloWorld", " ", "123", "45", " it", "'s", " HTTPServer", "\n\n", " ",
                    " x", "/y"],
    # MiniMax-M2: o200k's pattern
    "minimax-m2": ["hello", "World", " ", "123", "45", " it's", " HTTPServer", "\n\n", " ",
                   " x", "/y"],
    # DeepSeek-LLM: newlines alone, words of letters (a space before), punctuation runs, digit
    # runs; what no split takes (the spaces before digits, an extra space) stands alone
    "deepseek-llm": ["helloWorld", " ", "12345", " it", "'", "s", " HTTPServer", "\n", "\n",
                     " ", " x", "/", "y"],
    # Kimi-K2 / Moonlight: o200k's split here (no Han ideographs in TEXT; see below)
    "kimi-k2": ["hello", "World", " ", "123", "45", " it's", " HTTPServer", "\n\n", " ", " x",
                "/y"],
    # SmolLM: single digits, then GPT-2's split
    "smollm": ["helloWorld", " ", "1", "2", "3", "4", "5", " it", "'s", " HTTPServer", "\n\n ",
               " x", "/", "y"],
}


@pytest.mark.parametrize("pre", list(SPLITS))
def test_the_split_is_the_named_tokenizers(pre: str | None) -> None:
    pieces = gguf_pre_tokenizer(pre, "test.gguf").pre_tokenize_str(TEXT)
    assert [TEXT[a:b] for _, (a, b) in pieces] == SPLITS[pre]


def test_qwen35_keeps_combining_marks_in_words() -> None:
    # "e" + U+0301 (a combining mark, not a letter) + "x": Qwen2's split ends the word at the
    # mark, which then leads the next piece as a non-letter; Qwen3.5's letters include marks
    text = "ne\u0301x"
    for pre, want in (("qwen2", ["ne", "\u0301x"]), ("qwen35", ["ne\u0301x"])):
        pieces = gguf_pre_tokenizer(pre, "t.gguf").pre_tokenize_str(text)
        assert [text[a:b] for _, (a, b) in pieces] == want, pre


def _meta(pre: str) -> dict[str, object]:
    tokens = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "he", "ll"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": ["h e", "l l"], "tokenizer.ggml.pre": pre}


def test_the_file_tokenizer_uses_it() -> None:
    # "hiThere" is one piece under GPT-2's split and two under o200k's
    o200k = Tokenizer.from_gguf_fields(_meta("gpt-4o"), "t.gguf")
    assert [p for p, _ in o200k.tk.pre_tokenizer.pre_tokenize_str("hiThere")] == ["hi", "There"]
    gpt2 = Tokenizer.from_gguf_fields(_meta("default"), "t.gguf")
    assert [p for p, _ in gpt2.tk.pre_tokenizer.pre_tokenize_str("hiThere")] == ["hiThere"]
    he, ll = 27, 28  # after a..z (0..25) and "Ġ"
    assert o200k.encode("hello") == [he, ll, ord("o") - ord("a")]


def test_an_unknown_pre_tokenizer_is_refused() -> None:
    with pytest.raises(ModelLoadError, match=r"unsupported GGUF pre-tokenizer 'tekken'.*gpt-4o"):
        Tokenizer.from_gguf_fields(_meta("tekken"), "t.gguf")


def test_deepseek_v3_splits_cjk_runs_and_non_ascii_punctuation_apart() -> None:
    # Llama 3's word may start with any non-letter ("«hi") and runs through every letter, kana
    # and ideographs included; DeepSeek-V3 isolates the CJK run first, and only an ASCII mark
    # may lead a word, so "«" and "»" stand alone; a combining mark stays inside its word
    text = "«hi» 日本語abc ne\u0301x"
    for pre, want in (("llama-bpe", ["«hi", "»", " 日本語abc", " ne", "\u0301x"]),
                      ("deepseek-v3", ["«", "hi", "»", " ", "日本語", "abc", " ne\u0301x"])):
        pieces = gguf_pre_tokenizer(pre, "t.gguf").pre_tokenize_str(text)
        assert [text[a:b] for _, (a, b) in pieces] == want, pre


def _with_llama_cpp(llama_cpp: Any, path: Path, text: str) -> tuple[Tokenizer, list[int]]:
    """ftrs' tokenizer of the GGUF file `path`, and llama.cpp's ids of `text` (its vocabulary
    alone loaded)."""
    import gguf

    ours = Tokenizer.from_gguf_fields(gguf_metadata(gguf.GGUFReader(str(path))), str(path))
    peer = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return ours, peer.tokenize(text.encode(), add_bos=False, special=False)


def test_deepseek_llm_splits_as_llama_cpp_does(smollm_gguf: Path, tmp_path: Path) -> None:
    """The demo's real vocabulary and merges under DeepSeek-LLM's splits: ftrs tokenizes a
    text of many scripts as llama.cpp does (its vocabulary alone loaded): Latin, Greek (with
    oxia), the Kelvin and ohm signs, CJK, kana and Hangul runs, full-width punctuation, digits,
    trailing spaces. (Its fifth split isolates every run of U+0800..U+9FA5, so the letters of
    its word class in that range, where its list differs from the NFC forms, end up alone.)"""
    import gguf

    llama_cpp = pytest.importorskip("llama_cpp")
    fields = gguf.GGUFReader(str(smollm_gguf)).fields
    # digits merge into one token here (the demo's own split keeps them apart: it has none)
    runs = ["12", "123", "1234", "12345"]
    path = rewrite(smollm_gguf, tmp_path / "dsllm.gguf", fields={
        "tokenizer.ggml.pre": "deepseek-llm",
        "tokenizer.ggml.tokens": [*fields["tokenizer.ggml.tokens"].contents(), *runs],
        "tokenizer.ggml.token_type": [*fields["tokenizer.ggml.token_type"].contents(), 1, 1, 1, 1],
        "tokenizer.ggml.merges": [*fields["tokenizer.ggml.merges"].contents(),
                                  *(f"{r[:-1]} {r[-1]}" for r in runs)]})
    text = ("helloWorld 12345 it's HTTPServer\n\n  x/y\r\n\u1f7d\u03ce \u1fbe \u212aelvin "
            "\u2126 7km！你好，世界。カタカナ 세계 Ⓐ ﬁ ǅ ʔ \U0001e900x ａｂ  ok  \n\t end   ")
    ours, theirs = _with_llama_cpp(llama_cpp, path, text)
    assert ours.encode(text) == theirs
    assert ours.tk.token_to_id("12345") in theirs
    gpt2 = Tokenizer.from_gguf_fields(gguf_metadata(gguf.GGUFReader(str(smollm_gguf))), "s")
    assert gpt2.encode(text) != theirs  # the split decides the tokens of this text


def test_kimi_k2_splits_han_runs_apart_from_other_letters() -> None:
    # o200k's letters include the Han ideographs; Kimi's split takes a run of them first, and
    # its words are o200k's with them taken out (kana stay letters of a word)
    text = "日本語abcカタカナ 你好World"
    for pre, want in (("gpt-4o", ["日本語abcカタカナ", " 你好World"]),
                      ("kimi-k2", ["日本語", "abcカタカナ", " ", "你好", "World"])):
        pieces = gguf_pre_tokenizer(pre, "t.gguf").pre_tokenize_str(text)
        assert [text[a:b] for _, (a, b) in pieces] == want, pre


def test_kimi_k2_splits_as_llama_cpp_does(smollm_gguf: Path, tmp_path: Path) -> None:
    """The demo's real vocabulary under Kimi-K2's split (`kimi-k2`, which llama.cpp computes by
    its own code, not a regex): ftrs tokenizes a text of many scripts as llama.cpp does."""
    import gguf

    llama_cpp = pytest.importorskip("llama_cpp")
    path = rewrite(smollm_gguf, tmp_path / "kimi.gguf", fields={"tokenizer.ggml.pre": "kimi-k2"})
    text = ("helloWorld 12345 it's HTTPServer IT'S Don'T\n\n  x/y\r\n 日本語abcカタカナ 你好World "
            "中文。混合English文字 ÀÉÎõü ne\u0301x 세계 Ⓐ ﬁ ǅ ʔ ａｂ 7km！ \U00020000x  ok  \n\t end   ")
    ours, theirs = _with_llama_cpp(llama_cpp, path, text)
    assert ours.encode(text) == theirs
    o200k = Tokenizer.from_gguf_fields(_meta("gpt-4o") | {
        k: v for k, v in gguf_metadata(gguf.GGUFReader(str(smollm_gguf))).items()
        if k.startswith("tokenizer.ggml.") and k != "tokenizer.ggml.pre"}, "o")
    assert o200k.encode(text) != theirs  # the Han split decides the tokens of this text
