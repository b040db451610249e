"""A fake engine backend: deterministic tokens, no model, so the HTTP layer is tested alone.

Tokenizer: byte level. Ids 0..255 are bytes, 256 is BOS, 257 is EOS; `decode` of a cut
multi-byte character yields U+FFFD, exactly the case the incremental detokenizer must handle.

Engine: each request emits one token per step (its whole prompt is "prefilled" in the first
step). The output is a fixed text with multi-byte characters, read from an offset derived from
the prompt (greedy), from the seed, or at random (temperature > 0 without a seed). Prompts
that end in "EOS" emit EOS after 3 tokens; a prompt holding `SAY:<text>` emits the bytes of
<text> (up to the line's end), then EOS, whatever the sampling; "__refuse__" makes `add_request` raise
CapacityError (503); a prompt containing "__die__" makes the engine
process exit with code 86 (as a lost device would) after its first token; a text containing
"__slow_tokenize__" makes the tokenizer (in the API process) take `SLOW_TOKENIZE_S` seconds. KV usage is the
token count of running requests over a 4096-token pool; page-aligned prompt prefixes seen
before are reported as cached tokens.
"""

from __future__ import annotations

import json
import os
import random
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from ftrs.config import EngineConfig
from ftrs.engine.protocol import GenerateRequest, StepStats, TokenEvent, TokenLogprob
from ftrs.errors import CapacityError, ConfigError, ContextLengthExceeded, ModelLoadError
from ftrs.server.engine_process import LoadedEngine

BOS, EOS = 256, 257
VOCAB = 258
MAX_MODEL_LEN = 512
KV_TOKENS = 4096
PAGE = 16
TEXT = "Hello wörld, ünïcödé 你好世界 🙂 the quick brown fox jumps. ".encode()
STEP_SLEEP_S = 0.002
SLOW_TOKENIZE_S = 3.0


class ByteTokenizer:
    eos_token_ids = frozenset({EOS})
    vocab_size = VOCAB

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if "__slow_tokenize__" in text:
            time.sleep(SLOW_TOKENIZE_S)  # holds whatever thread tokenizes, as a 10 MB prompt would
        ids = list(text.encode())
        return [BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for t in ids:
            if t < 256:
                out.append(t)
            elif not skip_special_tokens:
                out += b"<s>" if t == BOS else b"</s>"
        return out.decode("utf-8", errors="replace")

    chat_template: str | None = None  # the parsers are chosen from flags, else the defaults

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        for m in messages:
            if m["role"] not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"unknown role {m['role']!r}")
        text = f"<|tools|>{json.dumps(tools)}\n" if tools else ""
        text += f"<|kwargs|>{json.dumps(kwargs, sort_keys=True)}\n" if kwargs else ""
        for m in messages:
            extra = {k: m[k] for k in ("tool_calls", "tool_call_id", "name") if k in m}
            text += f"<|{m['role']}|>{m['content']}{json.dumps(extra) if extra else ''}\n"
        return text + ("<|assistant|>" if add_generation_prompt else "")


@dataclass
class _Req:
    req: GenerateRequest
    offset: int
    out: list[int] = field(default_factory=list)
    prefilled: bool = False
    cached: int = 0
    script: bytes | None = None  # the output, when the prompt says `SAY:<text>`


class FakeEngine:
    model_name = "fake"
    max_model_len = MAX_MODEL_LEN
    vocab_size = VOCAB

    def __init__(self) -> None:
        self.tokenizer = ByteTokenizer()
        self.running: dict[str, _Req] = {}
        self.seen_pages: set[int] = set()
        self.steps = 0

    def add_request(self, req: GenerateRequest) -> None:
        if len(req.prompt_token_ids) + req.params.max_tokens > MAX_MODEL_LEN:
            raise ContextLengthExceeded("too long for the fake engine", evidence={"param": "max_tokens"})
        if b"__refuse__" in bytes(t % 256 for t in req.prompt_token_ids):
            raise CapacityError("the fake KV pool cannot hold this request")
        p = req.params
        if p.temperature == 0:
            offset = zlib.crc32(bytes(t % 256 for t in req.prompt_token_ids))
        elif p.seed is not None:
            offset = random.Random(p.seed).randrange(1 << 30)
        else:
            offset = random.randrange(1 << 30)
        prompt = bytes(t % 256 for t in req.prompt_token_ids)
        script = prompt.split(b"SAY:", 1)[1].split(b"\n", 1)[0] if b"SAY:" in prompt else None
        self.running[req.request_id] = _Req(req, offset % len(TEXT), script=script)

    def abort(self, request_id: str) -> None:
        self.running.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.running)

    def _cached(self, prompt: list[int]) -> int:
        hit = 0
        for end in range(PAGE, len(prompt) + 1, PAGE):
            h = hash(tuple(prompt[:end]))
            if h in self.seen_pages and hit == end - PAGE:
                hit = end
            self.seen_pages.add(h)
        return hit

    def step(self) -> tuple[list[TokenEvent], StepStats]:
        t0 = time.monotonic()
        time.sleep(STEP_SLEEP_S)
        self.steps += 1
        events, prefill, decode, hits = [], 0, 0, 0
        for rid, r in list(self.running.items()):
            prompt = r.req.prompt_token_ids
            if not r.prefilled:
                r.prefilled, r.cached = True, self._cached(prompt)
                prefill += len(prompt)
                hits += r.cached
            else:
                decode += 1
            tok = TEXT[(r.offset + len(r.out)) % len(TEXT)]
            if r.script is not None:
                tok = r.script[len(r.out)] if len(r.out) < len(r.script) else EOS
            if prompt[-3:] == list(b"EOS") and len(r.out) == 3:
                tok = EOS
            r.out.append(tok)
            finish = None
            if tok == EOS and not r.req.params.ignore_eos:
                finish = "stop"
            elif tok in r.req.params.stop_token_ids:
                finish = "stop"
            elif len(r.out) >= r.req.params.max_tokens:
                finish = "length"
            lps = None
            if r.req.params.logprobs is not None:
                k = r.req.params.logprobs
                lps = [TokenLogprob(tok, -0.25, [((tok + i) % 256, -0.25 - i) for i in range(k)])]
            events.append(TokenEvent(rid, [tok], finish, lps, len(prompt), r.cached))
            if finish is not None:
                del self.running[rid]
            if b"__die__" in bytes(t % 256 for t in prompt):
                os._exit(86)
        used = sum(len(r.req.prompt_token_ids) + len(r.out) for r in self.running.values())
        stats = StepStats(
            step=self.steps, time=time.monotonic(), duration_s=time.monotonic() - t0,
            kind="mixed" if prefill and decode else "prefill" if prefill else "decode",
            num_running=len(self.running), num_waiting=0, prefill_tokens=prefill,
            decode_tokens=decode, kv_usage_ratio=used / KV_TOKENS, prefix_hit_tokens=hits,
            experts={"h2d_bytes": 1000 * self.steps, "hits": 3 * self.steps, "misses": self.steps,
                     "slots": 8},
        )
        return events, stats


def load(config: EngineConfig) -> LoadedEngine:
    if config.model == "fail-load":
        raise ModelLoadError(config.model, "fake load failure for tests")
    if config.model == "bad-config":  # a setting only the load can judge (as a cache < top_k)
        raise ConfigError("fake setting refused by the engine at load")
    if config.model == "slow-load":
        time.sleep(3.0)
    return LoadedEngine(FakeEngine(), config.model)


def load_tokenizer(source: object) -> ByteTokenizer:
    return ByteTokenizer()
