"""A GGUF file's `tokenizer.ggml.pre` picks the split its model's tokenizer makes.

The expected splits are worked out by hand from each tokenizer's published pattern (GPT-2's,
Llama 3's, Qwen2's, o200k's), on a text where all four differ: camel case, a run of digits, a
contraction, a blank line, a slash.
"""

from __future__ import annotations

import pytest

from ftrs.errors import ModelLoadError
from ftrs.models.tokenizer import Tokenizer, gguf_pre_tokenizer

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
