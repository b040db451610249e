"""A checkpoint directory with a `tiktoken.model` (Kimi-K2's, Moonlight's layout) tokenizes as
`tiktoken` itself does, the oracle: the ranks come from a byte-level BPE trained here on the
repository's docs, the split pattern is Kimi-K2's, the special tokens are
`tokenizer_config.json`'s with a reserved one filling a gap. Text in several scripts, numbers,
code and special tokens encodes to the same ids and decodes back; a tokenizer class whose
pattern ftrs does not know, bad ranks and a clashing special are refused."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

tiktoken = pytest.importorskip("tiktoken")

from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from tokenizers import models, pre_tokenizers, trainers  # noqa: E402

from ftrs.errors import ModelLoadError  # noqa: E402
from ftrs.models.tiktoken_bpe import byte_chars  # noqa: E402
from ftrs.models.tokenizer import Tokenizer, split_pattern_named  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 5: "<|im_middle|>"}
TEXTS = [
    "Hello, world! It's the engine's 2nd run: 1234567 tokens, isn't it?",
    "def f(x):\n\treturn x ** 2  # squared\n\n\n    indented   spaces",
    "中文的分词：你好，世界！日本語のテキストも。한국어 텍스트",
    "Ünïcödé façade — “quotes” and emoji 🤖🚀 mixed with ASCII",
    "[BOS]user says<|im_middle|>hi<|im_end|>[EOS] and <|reserved_token_RESERVED|>?",
    "  leading and trailing spaces  \r\n\r\nCRLF lines\n",
]


def ranks_from_bpe(vocab_size: int) -> dict[bytes, int]:
    """tiktoken ranks: the 256 bytes, then each merge of a BPE trained on the docs, in order."""
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))]
    texts.append("中文的分词和日本語のテキスト、한국어 텍스트。" * 20)
    tk.train_from_iterator(texts, trainer)
    merges = json.loads(tk.to_str())["model"]["merges"]
    back = {c: b for b, c in byte_chars().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for m in merges:
        a, b = m if isinstance(m, list) else m.split(" ")
        token = bytes(back[c] for c in a + b)
        ranks.setdefault(token, len(ranks))
    return ranks


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    return ranks_from_bpe(3000)


def write_dir(path: Path, ranks: dict[bytes, int], module: str = "tokenization_kimi",
              specials: dict[int, str] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in ranks.items()]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = len(ranks)
    conf: dict[str, Any] = {
        "added_tokens_decoder": {str(n + i): {"content": c, "special": True}
                                 for i, c in (specials or SPECIALS).items()},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": [f"{module}.TikTokenTokenizer", None]},
        "chat_template": "{% for m in messages %}<|im_user|>{{ m.content }}<|im_end|>"
                         "{% endfor %}"}
    (path / "tokenizer_config.json").write_text(json.dumps(conf))
    return path


def oracle(ranks: dict[bytes, int]) -> Any:
    n = len(ranks)
    specials = {c: n + i for i, c in SPECIALS.items()} | {f"<|reserved_token_{n + 4}|>": n + 4}
    return tiktoken.Encoding("kimi-test", pat_str=split_pattern_named("kimi-k2"),
                             mergeable_ranks=ranks, special_tokens=specials)


@pytest.mark.parametrize("module", ["tokenization_kimi", "tokenization_moonshot"])
def test_encodes_and_decodes_as_tiktoken(tmp_path: Path, ranks: dict[bytes, int],
                                         module: str) -> None:
    model_dir = write_dir(tmp_path / "m", ranks, module)
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": len(ranks) + 12}))
    tok = Tokenizer.from_dir(model_dir)
    enc = oracle(ranks)
    merged = 0
    long = [(ROOT / "README.md").read_text(), (ROOT / "python/ftrs/models/tokenizer.py").read_text()]
    for text in [*(t.replace("RESERVED", str(len(ranks) + 4)) for t in TEXTS), *long]:
        want = enc.encode(text, allowed_special="all")
        got = tok.encode(text)
        assert got == want, text
        assert tok.decode(got, skip_special_tokens=False) == text
        merged += sum(i >= 256 for i in got)
    assert merged > 50  # the trained merges are exercised, not just single bytes
    n = len(ranks)
    assert tok.bos_token_id == n and tok.eos_token == "[EOS]" and n + 1 in tok.eos_token_ids
    # the gap, named by its id as the remote code names it
    assert tok.encode(f"<|reserved_token_{n + 4}|>") == [n + 4]
    assert tok.encode(f"<|reserved_token_{n + 11}|>") == [n + 11]  # up to config's vocab_size
    assert tok.tk.get_vocab_size() == n + 12
    assert tok.decode(tok.encode("[BOS]hi[EOS]")) == "hi"  # specials skipped when decoding
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_user|>hi<|im_end|>"  # tokenizer_config.json's template
    assert tok.encode(rendered) == [n + 3, *enc.encode("hi"), n + 2]


def test_an_unknown_tokenizer_class_and_bad_files_are_refused(tmp_path: Path,
                                                              ranks: dict[bytes, int]) -> None:
    with pytest.raises(ModelLoadError, match="split pattern is in remote code"):
        Tokenizer.from_dir(write_dir(tmp_path / "other", ranks, "tokenization_other"))
    gap = dict(list(ranks.items())[:300])
    del gap[next(t for t, r in gap.items() if r == 299)]
    gap[b"\x00\x00\x00zz"] = 400  # ranks with a hole
    with pytest.raises(ModelLoadError, match="ranks are not 0 "):
        Tokenizer.from_dir(write_dir(tmp_path / "gap", gap))
    no_byte = {t: r - 1 for t, r in ranks.items() if t != b"\x00"}
    with pytest.raises(ModelLoadError, match="single byte"):
        Tokenizer.from_dir(write_dir(tmp_path / "nobyte", no_byte))
    clash = SPECIALS | {7: "[EOS]"}
    with pytest.raises(ModelLoadError, match="named twice"):
        Tokenizer.from_dir(write_dir(tmp_path / "clash", ranks, specials=clash))
    bad = write_dir(tmp_path / "bad", ranks)
    (bad / "tiktoken.model").write_text("not base64!! 0\n")
    with pytest.raises(ModelLoadError, match="line 1"):
        Tokenizer.from_dir(bad)


def test_a_checkpoint_reads_its_tiktoken_model_or_warns_and_serves_token_ids(
        tmp_path: Path, ranks: dict[bytes, int], caplog: pytest.LogCaptureFixture) -> None:
    import torch

    from ftrs.models.load import load_model
    from ftrs.models.tiny import make_tiny

    d = make_tiny("llama", tmp_path / "llama", seed=1)
    (d / "tokenizer.json").unlink()
    write_dir(d, ranks)
    m = load_model(str(d), torch.device("cpu"), torch.float32, progress=False)
    assert m.tokenizer is not None and m.tokenizer.encode("Hello") == oracle(ranks).encode("Hello")
    write_dir(d, ranks, "tokenization_other")
    with caplog.at_level("WARNING"):
        m = load_model(str(d), torch.device("cpu"), torch.float32, progress=False)
    assert m.tokenizer is None and "only token-id prompts will work" in caplog.text
