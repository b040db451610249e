"""Structured output: grammars compiled by llguidance, one matcher per request, masks per step.

A request's `StructuredSpec` becomes an llguidance grammar: "json_object" is the JSON Schema
`{"type": "object"}`, "json_schema" the request's schema, "lark" a Lark grammar in llguidance's
dialect (which may embed schemas with `%json`). JSON is generated compact-but-readable and
without free whitespace (`", "` and `": "` separators): a sampled model cannot loop on blank
lines, and the grammar ends at the closing brace.

Two places compile a spec:
- the API process calls `check(spec, tokenizer)` before queueing the request, so a schema the
  engine cannot compile is a 400 naming `spec.param` (results cached by `spec.key`);
- the engine process calls `new_matcher` when the request is added: compiled grammars are
  cached by `spec.key` as matchers in their start state, and each request gets a copy. An
  error there is an `InvalidRequest` for that request alone.

Per step (`MaskFiller`): the bitmasks of the step's constrained rows are filled by llguidance's
parallel executor (native threads, GIL released) on a worker thread started *before* the
forward, since a mask depends only on the tokens consumed so far; the step joins it before
sampling. After sampling, each matcher consumes its token (`advance`); a grammar that accepts
nothing more finishes its request with "stop", and EOS is allowed by the mask only where the
grammar is complete.

Compilation in the engine runs on a worker thread (`EngineCore`'s compile worker; llguidance
releases the GIL), not on the loop: a few milliseconds for a typical schema (bench/structured.py),
a few hundred for a large one, once per distinct spec thanks to the cache. The running streams
keep stepping meanwhile; the request waits for its matcher, then is scheduled (or fails alone).
A spec already in the cache gets its matcher (a copy) at once.

The llguidance tokenizer (its token trie, ~1-2 s to build for 50k tokens, holding the GIL) is
built once per tokenizer object and vocabulary size; `warm` builds it ahead (the server does at
start, in both processes), so the first structured request stalls nothing.

This module imports torch only where masks are made: the API process uses `check` alone.
"""

from __future__ import annotations

import json
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np

from ftrs.errors import InvalidRequest
from ftrs.sampling import StructuredSpec

if TYPE_CHECKING:  # the API process calls `check` and never imports torch
    import torch

#: How JSON is laid out: json.dumps' separators, no other whitespace (see the module doc).
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ",
                                "key_separator": ": "}
_CACHE_SIZE = 256

_lock = threading.Lock()
_tokenizers: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]],
                                                 llguidance.LLTokenizer]] = (
    weakref.WeakKeyDictionary())
_checked: OrderedDict[tuple[str, str, str], str] = OrderedDict()  # spec.key -> error or ""


MAX_REASON = 400  # characters of an llguidance error a client is told


def brief(error: str) -> str:
    """An llguidance error as a client should read it: without the parser's state dump that
    may follow it (`<state>`: token rows, internal counters), and at most `MAX_REASON` chars."""
    text = error.split("<state>", 1)[0].strip()
    return text if len(text) <= MAX_REASON else text[:MAX_REASON - 3].rstrip() + "..."


def _bad(spec: StructuredSpec, why: str) -> InvalidRequest:
    what = {"json_object": "JSON object", "json_schema": "JSON schema", "lark": "grammar"}
    return InvalidRequest(f"{spec.param}: the {what.get(spec.kind, spec.kind)} cannot be used "
                          f"for structured output: {brief(why)}", evidence={"param": spec.param})


def grammar_text(spec: StructuredSpec) -> str:
    """The llguidance grammar (its JSON form) of `spec`; InvalidRequest naming `spec.param` when
    it is not even well-formed (a schema that is not JSON). Compilation errors come later."""
    try:
        return _grammar_text(spec)
    except ValueError as e:
        raise _bad(spec, str(e)) from None


def _grammar_text(spec: StructuredSpec) -> str:
    if spec.lead:
        return llguidance.LLMatcher.grammar_from_lark(_with_lead(spec))
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                             defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if spec.kind == "json_schema":
        schema = _schema(spec.value)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        except TypeError as e:
            raise ValueError(str(e)) from None
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.value)
    raise ValueError(f"unknown kind {spec.kind!r}")


def _schema(text: str) -> dict[str, Any]:
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if isinstance(schema, bool):  # true: anything; false: nothing
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise ValueError("a schema must be a JSON object")
    return schema


def _with_lead(spec: StructuredSpec) -> str:
    """`spec` as one Lark grammar whose text may follow what `spec.lead` allows."""
    if spec.kind == "lark":
        body = re.sub(r"^start:", "structured:", spec.value, count=1, flags=re.M)
    elif spec.kind in ("json_object", "json_schema"):
        schema = {"type": "object"} if spec.kind == "json_object" else _schema(spec.value)
        body = f"structured: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}\n"
    else:
        raise ValueError(f"unknown kind {spec.kind!r}")
    return f"start: lead structured\n{body}\n{spec.lead}"


def ll_tokenizer(tokenizer: Any, vocab_size: int | None = None,
                 eos_token_ids: Iterable[int] | None = None) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer` (an `ftrs.models.tokenizer.Tokenizer`), built once per
    (tokenizer, vocabulary size, EOS ids). `vocab_size` is the model's: mask rows have that many
    entries (ids the tokenizer lacks are never allowed); default the tokenizer's own size."""
    n_tok = int(tokenizer.tk.get_vocab_size(with_added_tokens=True))
    n_vocab = max(vocab_size or 0, n_tok)
    eos = tuple(sorted(eos_token_ids if eos_token_ids is not None else tokenizer.eos_token_ids))
    key = (n_vocab, eos)
    with _lock:
        per = _tokenizers.setdefault(tokenizer, {})
        if key not in per:
            per[key] = llguidance.LLTokenizer(tokenizer.tk.to_str(), n_vocab=n_vocab,
                                              eos_token=list(eos) or None)
        return per[key]


def warm(tokenizer: Any, vocab_size: int | None = None,
         eos_token_ids: Iterable[int] | None = None) -> None:
    """Build `ll_tokenizer`'s view now (nothing without a tokenizer)."""
    if tokenizer is not None:
        ll_tokenizer(tokenizer, vocab_size, eos_token_ids)


def check(spec: StructuredSpec, tokenizer: Any | None) -> None:
    """Compile `spec` as the engine will; InvalidRequest naming `spec.param` when it cannot be.
    For the API process, before the request is queued. Results are cached by `spec.key`."""
    key = spec.key
    with _lock:
        err = _checked.get(key)
        if err is not None:
            _checked.move_to_end(key)
    if err is None:
        try:
            text = _grammar_text(spec)
            lltok = ll_tokenizer(tokenizer) if tokenizer is not None else None
            err = llguidance.LLMatcher.validate_grammar(text, lltok)
        except ValueError as e:
            err = str(e) or "invalid"
        with _lock:
            _checked[key] = err
            while len(_checked) > _CACHE_SIZE:
                _checked.popitem(last=False)
    if err and not err.startswith("WARNING"):
        raise _bad(spec, err.strip())


class GrammarCache:
    """Compiled grammars of one engine, as matchers in their start state, by `spec.key`."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int],
                 size: int = 64) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.size = size
        self._templates: OrderedDict[tuple[str, str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the engine loop and its compile worker share the cache

    def cached(self, spec: StructuredSpec) -> bool:
        """Whether `spec`'s grammar is compiled already (a matcher is then a copy away)."""
        with self._lock:
            return spec.key in self._templates

    def warm(self) -> None:
        """Build the tokenizer view now rather than at the first structured request."""
        warm(self.tokenizer, self.vocab_size, self.eos_token_ids)

    def new_matcher(self, spec: StructuredSpec) -> llguidance.LLMatcher:
        """A fresh matcher for one request; InvalidRequest naming `spec.param` when `spec` does
        not compile (or the model has no tokenizer)."""
        if self.tokenizer is None:
            raise InvalidRequest(f"{spec.param}: structured output needs the model's tokenizer, "
                                 "and this model has none", evidence={"param": spec.param})
        key = spec.key
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
        if template is None:  # compiled outside the lock (llguidance releases the GIL)
            lltok = ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
            template = llguidance.LLMatcher(lltok, grammar_text(spec), log_level=0)
            if template.is_error():
                raise _bad(spec, template.get_error().strip())
            with self._lock:
                self._templates[key] = template
                while len(self._templates) > self.size:
                    self._templates.popitem(last=False)
        return template.deep_copy()


def advance(matcher: llguidance.LLMatcher, token: int) -> str | None:
    """Consume the sampled token. Returns None to go on, "stop" when the grammar is complete
    (it accepts nothing more), or an error message (a token outside the mask)."""
    if not matcher.consume_token(token):
        return f"the grammar refused token {token}: {brief(matcher.get_error())}"
    return "stop" if matcher.is_stopped() else None


class MaskFiller:
    """Fills the allowed-token bitmasks of a step's constrained rows on a worker thread.

    `start(matchers)` returns a future of the (rows, vocab) bool mask on the host; `wait` takes
    it to `device` on the calling thread (the worker never touches the device, so it never
    queues behind the forward's kernels). The matchers must not consume tokens until the fill is
    done. `stats()`: fills, seconds spent filling, seconds the steps waited for a fill."""

    def __init__(self, vocab_size: int, device: torch.device, threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.device = device
        self._executor = llguidance.LLExecutor(threads)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftrs-grammar")
        self.fills = 0
        self.fill_s = 0.0
        self.wait_s = 0.0

    def start(self, matchers: Sequence[llguidance.LLMatcher]) -> Future[torch.Tensor]:
        """Fill the masks of `matchers` on the worker thread."""
        return self._thread.submit(self.fill, list(matchers))

    def wait(self, masks: Future[torch.Tensor]) -> torch.Tensor:
        """The result of `start` on `device`, timing how long the caller waited for the fill."""
        t0 = time.perf_counter()
        out = masks.result()
        self.wait_s += time.perf_counter() - t0
        return out if self.device.type == "cpu" else out.to(self.device)

    def fill(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """The masks now, on the calling thread: (len(matchers), vocab) bool on the host."""
        t0 = time.perf_counter()
        bits = np.full((len(matchers), self.words), -1, dtype=np.int32)  # (rows, words)
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                               bits.ctypes.data, self.words * 4, len(matchers))
        out = unpack(bits, self.vocab_size)
        self.fills += 1
        self.fill_s += time.perf_counter() - t0
        return out

    def stats(self) -> dict[str, float]:
        return {"fills": self.fills, "fill_s": self.fill_s, "wait_s": self.wait_s}

    def close(self) -> None:
        self._thread.shutdown(wait=True)


def unpack(bits: np.ndarray, vocab_size: int) -> torch.Tensor:
    """(rows, words) int32 bitmask, bit j of word w = token 32w + j -> (rows, vocab) bool on
    the host (read as little-endian words whatever the host's order)."""
    import torch

    flat = np.unpackbits(bits.astype("<i4", copy=False).view(np.uint8), axis=1,
                         bitorder="little")
    return torch.from_numpy(flat[:, :vocab_size]).bool()


__all__ = ["GrammarCache", "MaskFiller", "advance", "check", "grammar_text", "ll_tokenizer",
           "unpack", "warm"]
