"""A checkpoint's `tiktoken.model` (Kimi-K2's, Moonlight's) as a `tokenizers` byte-level BPE.

A tiktoken file lists every token's bytes (base64) with its rank; encoding merges, within each
piece the split pattern cut, the adjacent pair whose join has the lowest rank, until none is a
token. The same tokens as a byte-level BPE: each token's bytes written with GPT-2's byte-to-
character map, and a merge for every way a token splits into two tokens, ordered by the rank
of the token they make (ties by the parts' ranks); `ignore_merges` takes a piece that is a token
whole, as tiktoken does first. The split pattern is not in the file (the checkpoint's remote
code holds it): it is taken from the tokenizer class its `tokenizer_config.json` maps to,
Moonshot's (`tokenization_kimi`, `tokenization_moonshot`) and no other. Special tokens follow
the ranks: `added_tokens_decoder`'s entries at their ids, an id between them that no entry
names, and one past them up to `config.json`'s `vocab_size`, `<|reserved_token_{id}|>`, as
the remote code fills them. `tiktoken` itself is the
oracle in `tests/models/test_tiktoken_tokenizer.py`.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ftrs.errors import ModelLoadError

#: the remote tokenizer modules whose split pattern is known: Kimi-K2's, Moonlight's
MOONSHOT_MODULES = ("tokenization_kimi", "tokenization_moonshot")


def byte_chars() -> dict[int, str]:
    """GPT-2's byte -> character map: printable Latin-1 bytes stand for themselves, the others
    take the code points from 256 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def read_ranks(path: Path) -> dict[bytes, int]:
    """`tiktoken.model`: one `base64-token rank` a line."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise ModelLoadError(str(path), f"line {n} is not `base64-token rank`: {e}") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ModelLoadError(str(path), "ranks are not 0 .. n-1, each once")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise ModelLoadError(str(path), "not every single byte is a token")
    return ranks


def bpe_of_ranks(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a byte-level BPE that encodes as the ranks do."""
    chars = byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    vocab = {text(t): r for t, r in ranks.items()}
    found: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                found.append((rank, ranks[left], ranks[right], left, right))
    found.sort()
    return vocab, [(text(a), text(b)) for *_, a, b in found]


def split_pattern(conf: dict[str, Any], source: str) -> str:
    """The split pattern of the tokenizer class `tokenizer_config.json` maps to."""
    from ftrs.models.tokenizer import split_pattern_named

    auto = (conf.get("auto_map") or {}).get("AutoTokenizer") or []
    mapped = [a for a in (auto if isinstance(auto, list) else [auto]) if isinstance(a, str)]
    if any(a.split(".")[0] in MOONSHOT_MODULES for a in mapped):
        return split_pattern_named("kimi-k2")
    raise ModelLoadError(source, f"tiktoken.model with the tokenizer class {mapped or None}: its "
                         f"split pattern is in remote code ftrs does not run (known: "
                         f"{', '.join(MOONSHOT_MODULES)})")


def tiktoken_tokenizer(model_dir: Path, conf: dict[str, Any]) -> HFTokenizer:
    """The byte-level BPE of `model_dir/tiktoken.model`, its specials from `conf`
    (`tokenizer_config.json`)."""
    path = model_dir / "tiktoken.model"
    pattern = split_pattern(conf, str(path))
    ranks = read_ranks(path)
    vocab, merges = bpe_of_ranks(ranks)
    tk = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False,
                                ignore_merges=True))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    added = {int(i): v.get("content") for i, v in (conf.get("added_tokens_decoder") or {}).items()
             if isinstance(v, dict)}
    if added and min(added) < len(ranks):
        raise ModelLoadError(str(path), f"added token id {min(added)} is inside the ranks "
                             f"(0 .. {len(ranks) - 1})")
    # up to the model's vocabulary (config.json), as the remote code reserves them all
    cfg = model_dir / "config.json"
    vocab_size = int(json.loads(cfg.read_text()).get("vocab_size") or 0) if cfg.is_file() else 0
    ids = range(len(ranks), max(vocab_size, max(added, default=-1) + 1))
    tk.add_special_tokens([AddedToken(added.get(i) or f"<|reserved_token_{i}|>", special=True,
                                      normalized=False) for i in ids])
    for i in ids:  # the tokenizers library numbers them in order after the vocabulary
        if tk.token_to_id(added.get(i) or f"<|reserved_token_{i}|>") != i:
            raise ModelLoadError(str(path), f"special token {added.get(i)!r} is named twice")
    return tk
