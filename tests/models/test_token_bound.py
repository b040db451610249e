"""`max_chars_per_token` (a prompt that cannot fit is refused untokenized) and `Tokenizer.encode`
(ids as the library's own `encode` gives them, without holding the GIL).

The bound is checked against the real tokenizers: no text has fewer tokens than its length over
the bound, the longest entries repeated included (where it is tight); each pipeline for which it
is refused (None) is shown to break it."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ftrs.models.tiny import tiny_tokenizer
from ftrs.models.token_bound import max_chars_per_token
from ftrs.models.tokenizer import Tokenizer


def _demo() -> Tokenizer:
    from ftrs.models.demo import demo_dir

    if not (demo_dir() / "tokenizer.json").is_file():
        pytest.skip("the demo model is not built (`ftrs models demo`)")
    return Tokenizer.from_dir(demo_dir())


def _tokenizers() -> list[Any]:
    return [pytest.param(_demo, id="demo"),
            pytest.param(lambda: tiny_tokenizer(512, ["<tool_call>", "</tool_call>"]), id="tiny")]


def _texts(tok: Tokenizer) -> list[str]:
    rng = random.Random(0)
    vocab = tok.tk.get_vocab(with_added_tokens=True)
    longest = sorted(vocab, key=len)[-3:]
    decoded = [tok.decode([vocab[t]], skip_special_tokens=False) for t in longest]
    specials = [str(t.content) for t in tok.tk.get_added_tokens_decoder().values()]
    chat = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "héllo wörld 你好 🙂 123456"}])
    return [
        "", "a", " ", "\n\n\n", "hello world", "ab " * 5000, " " * 3000, "\n" * 500, "#" * 4000,
        "1234567890" * 300, "你好世界" * 500, "🙂" * 700, "é\u0301" * 400, "\t \r\n" * 300,
        "".join(chr(rng.randrange(32, 0x3000)) for _ in range(5000)),
        "".join(rng.choice(["<|im_start|>", "<|im_end|>", "x", " ", "\n"]) for _ in range(2000)),
        "".join(specials) * 20, "".join(decoded) * 50, decoded[-1] * 100, chat, chat * 30,
    ]


@pytest.mark.parametrize("make", _tokenizers())
def test_no_text_has_fewer_tokens_than_its_length_over_the_bound(make: Any) -> None:
    tok = make()
    per_token = tok.max_chars_per_token
    assert per_token is not None
    vocab = tok.tk.get_vocab(with_added_tokens=True)
    assert per_token == max(len(t) for t in vocab)  # the longest entry, special tokens included
    for text in _texts(tok):
        ids = tok.encode(text)
        assert len(ids) * per_token >= len(text), (text[:40], len(ids), len(text))


@pytest.mark.parametrize("make", _tokenizers())
def test_encode_gives_the_ids_of_the_librarys_encode(make: Any) -> None:
    tok = make()
    for text in _texts(tok):
        assert tok.encode(text) == tok.tk.encode(text, add_special_tokens=False).ids, text[:40]
    tok.add_bos, tok.bos_token_id = True, 1
    assert tok.encode("hi <|im_end|>", add_special_tokens=True) == [
        1, *tok.tk.encode("hi <|im_end|>", add_special_tokens=False).ids]


def test_encoding_a_long_text_lets_other_threads_run() -> None:
    """The library's `encode` holds the GIL for the whole call: a thread that ticks every 5 ms
    would stop for all of it (the API's event loop did, seconds for a 4 MiB prompt)."""
    tok = tiny_tokenizer(512)
    text = "ab " * 600_000
    gaps: list[float] = []
    done = threading.Event()
    took: list[float] = []

    def encode() -> None:
        start = time.perf_counter()
        tok.encode(text)
        took.append(time.perf_counter() - start)
        done.set()

    worker = threading.Thread(target=encode)
    last = time.perf_counter()
    worker.start()
    while not done.is_set():
        time.sleep(0.005)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    worker.join()
    assert took[0] > 0.2, "the text tokenizes too fast to say anything"
    assert max(gaps) < took[0] / 2, (max(gaps), took[0])


def _bpe(vocab: dict[str, int], **kw: Any) -> HFTokenizer:
    return HFTokenizer(models.BPE(vocab, [], **kw))


_AB = {"a": 0, "b": 1, " ": 2, "<unk>": 3}


def _stripping() -> HFTokenizer:
    tk = _bpe(_AB, unk_token="<unk>")
    tk.add_special_tokens([AddedToken("<m>", lstrip=True, special=True)])
    return tk


def _with(tk: HFTokenizer, **parts: Any) -> HFTokenizer:
    for name, part in parts.items():
        setattr(tk, name, part)
    return tk


# pipelines that give no bound, each with a text that has fewer tokens than len / longest entry
UNBOUNDED = [
    ("whitespace pre-tokenizer", lambda: _with(_bpe(_AB), pre_tokenizer=pre_tokenizers.Whitespace()),
     " " * 50 + "a"),
    ("removed split", lambda: _with(_bpe(_AB), pre_tokenizer=pre_tokenizers.Split(
        Regex(" "), behavior="removed")), " " * 50 + "a"),
    ("strip normalizer", lambda: _with(_bpe(_AB), normalizer=normalizers.Strip()), " " * 50 + "a"),
    ("regex replace", lambda: _with(_bpe(_AB), normalizer=normalizers.Replace(Regex(" +"), " ")),
     "a" + " " * 50 + "b"),
    ("NFC", lambda: _with(_bpe({"é": 0}), normalizer=normalizers.NFC()), "e\u0301" * 20),
    ("fused unk", lambda: _bpe(_AB, unk_token="<unk>", fuse_unk=True), "z" * 50),
    ("fused unk, bytes missing", lambda: _bpe(_AB | {"<0x7A>": 4}, unk_token="<unk>",
                                              fuse_unk=True, byte_fallback=True), "é" * 50),
    ("added token with lstrip", _stripping, " " * 50 + "<m>"),
    ("word level", lambda: HFTokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")),
     "z" * 50),
]


@pytest.mark.parametrize("name,make,text", UNBOUNDED, ids=[u[0] for u in UNBOUNDED])
def test_pipelines_that_can_shorten_a_text_give_no_bound(name: str, make: Any, text: str) -> None:
    tk = make()
    assert max_chars_per_token(tk) is None
    longest = max(len(t) for t in tk.get_vocab(with_added_tokens=True))
    assert len(tk.encode(text, add_special_tokens=False).ids) * longest < len(text)


def test_pipelines_that_keep_every_character_give_the_longest_entry() -> None:
    vocab = {"▁": 0, "a": 1, "▁aa": 2, "<unk>": 3} | {f"<0x{b:02X}>": 4 + b for b in range(256)}
    tk = _with(_bpe(vocab, byte_fallback=True, unk_token="<unk>", fuse_unk=True),
               normalizer=normalizers.Sequence([normalizers.Prepend("▁"),
                                                normalizers.Replace(" ", "▁")]),
               pre_tokenizer=pre_tokenizers.Sequence([
                   pre_tokenizers.Digits(individual_digits=True),
                   pre_tokenizers.Split(Regex("a"), behavior="isolated")]))
    tk.add_special_tokens([AddedToken("<|end|>", special=True, normalized=False)])
    assert max_chars_per_token(tk) == len("<|end|>")
    for text in ("a a a a", " " * 40, "<|end|>" * 9, "z" * 30, "aa aa 12 <|end|>", "你好" * 9):
        assert len(tk.encode(text, add_special_tokens=False).ids) * 7 >= len(text), text
