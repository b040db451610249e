"""A GGUF file's tokenizer fields beyond the split (`test_gguf_pre_tokenizer`): its user-defined
tokens (below), and which tokens end a generation of its model: the file's EOS, end-of-turn and
end-of-message ids, and for gpt-oss's harmony vocabulary the stops its checkpoint's generation
config lists (`<|return|>`, `<|call|>`, `<|endoftext|>`; ids 200002, 200012 and 199999 there),
not `<|end|>`, which ends a message inside the answer."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftrs.models.gguf_loader import gguf_metadata
from ftrs.models.tokenizer import Tokenizer
from gguf_files import rewrite

HARMONY = ["<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
           "<|message|>", "<|call|>"]


def _meta(tokens: list[str], **ids: int) -> dict[str, object]:
    words = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": words + tokens,
            "tokenizer.ggml.token_type": [1] * len(words) + [3] * len(tokens),
            "tokenizer.ggml.merges": [], "tokenizer.ggml.pre": "gpt-4o",
            **{f"tokenizer.ggml.{k}_token_id": v for k, v in ids.items()}}


def test_eos_end_of_turn_and_end_of_message_all_stop() -> None:
    tok = Tokenizer.from_gguf_fields(_meta(["<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"],
                                           eos=26, eot=27, eom=28), "t.gguf")
    assert tok.eos_token_ids == {26, 27, 28}
    assert tok.eos_token == "<|end_of_text|>"
    assert Tokenizer.from_gguf_fields(_meta(["<|im_end|>"], eos=26), "t.gguf").eos_token_ids == {26}


def test_harmony_stops_at_return_call_and_endoftext_not_at_end() -> None:
    ids = {t: 26 + i for i, t in enumerate(HARMONY)}
    # the file names <|return|> as EOS (and a converter may name <|end|> the end of turn)
    tok = Tokenizer.from_gguf_fields(_meta(HARMONY, eos=ids["<|return|>"], eot=ids["<|end|>"]),
                                     "t.gguf")
    assert tok.eos_token_ids == {ids["<|return|>"], ids["<|call|>"], ids["<|endoftext|>"]}


def test_user_defined_tokens_are_one_token_each_and_text() -> None:
    """A GGUF's user-defined tokens (Qwen3's `<think>`, `<tool_call>`: added, not special, in
    the checkpoint's tokenizer.json) are matched whole in a text and decoded as text."""
    meta = _meta(["<|im_end|>"], eos=26)
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "<think>"]  # type: ignore[misc]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 4]  # type: ignore[misc]
    tok = Tokenizer.from_gguf_fields(meta, "t.gguf")
    assert tok.encode("<think>ab") == [27, 0, 1]
    assert tok.decode([27, 0, 26]) == "<think>a"  # <|im_end|> (control) skipped, <think> kept
    assert tok.special_ids(["<think>"]) == frozenset()


def test_user_defined_tokens_split_a_text_as_llama_cpp_does(smollm_gguf: Path, tmp_path: Path) -> None:
    """The demo's real vocabulary with Qwen3's `<think>` and `</think>` appended as user-defined
    tokens: ftrs splits a text holding them as llama.cpp does (its vocabulary alone loaded)."""
    import gguf

    llama_cpp = pytest.importorskip("llama_cpp")
    fields = gguf.GGUFReader(str(smollm_gguf)).fields
    tokens = [*fields["tokenizer.ggml.tokens"].contents(), "<think>", "</think>"]
    types = [*fields["tokenizer.ggml.token_type"].contents(), 4, 4]
    path = rewrite(smollm_gguf, tmp_path / "think.gguf", fields={
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})
    ours = Tokenizer.from_gguf_fields(gguf_metadata(gguf.GGUFReader(str(path))), str(path))
    peer = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    text = "Hi <think>\nIs 12 > 7?</think>\n\nYes, think<think>again</think>."
    theirs = peer.tokenize(text.encode(), add_bos=False, special=False)
    assert ours.encode(text) == theirs
    assert len(tokens) - 2 in theirs and len(tokens) - 1 in theirs  # one token each
    assert ours.decode(theirs) == text
