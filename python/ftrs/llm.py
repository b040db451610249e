"""The offline API: `LLM(model).generate(prompts, SamplingParams)` and `LLM.logits(ids)`.

It drives the same EngineCore as the server, in-process: same scheduler, same KV cache, same
sampling — so what the server returns for a greedy request equals what `generate` returns.
One LLM may be shared by threads: their calls run one at a time (a lock), each over the engine
alone, so each gets its own requests' results.
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
import threading
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from ftrs.config import EngineConfig
from ftrs.engine.core import EngineCore
from ftrs.engine.protocol import GenerateRequest, TokenLogprob
from ftrs.errors import InvalidRequest, error_from_dict
from ftrs.models.tokenizer import Tokenizer
from ftrs.sampling import SamplingParams


@dataclass
class Completion:
    """One finished request."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0


class LLM:
    """`LLM(model="demo", device="auto", dtype="auto", moe_strategy="resident", **options)`.

    Every engine option (`EngineConfig` field, i.e. every CLI flag of `ftrs serve`) is a keyword.
    `moe_strategy="auto"` runs what `ftrs serve` runs: the `ftrs bench strategy` profile's pick
    for this device, host, model and link, else the stated assumption. `self.config` holds the
    resolved strategy and cache rate, and `self.auto_line` the line that says why (`auto: ...`;
    None for any other strategy). The line is also logged at INFO on `ftrs.guard.startup`,
    which Python's default logging (WARNING and up) does not show; a profile that is there but
    unusable is a WARNING, which it does.
    """

    def __init__(self, model: str = "demo", progress: bool = False, **options: Any) -> None:
        from ftrs.guard.startup import resolve_auto_line

        self.config, self.auto_line = resolve_auto_line(
            EngineConfig.from_kwargs(model=model, **options))
        self.engine = EngineCore(self.config, progress=progress)
        self._ids = itertools.count()
        self._closed = False
        self._lock = threading.Lock()  # one call steps the engine at a time

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidRequest("this LLM is closed: make a new LLM(...) to generate",
                                 evidence={"closed": True})

    @property
    def tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer; pass token ids")
        return self.engine.tokenizer

    def _encode(self, prompt: str | Seq[int]) -> list[int]:
        """A prompt's token ids: a str is tokenized, a list of token ids taken as it is.
        Anything else is refused by `InvalidRequest`, as the server refuses it with a 400."""
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidRequest(f"prompt: not valid Unicode text ({e.reason} at "
                                     f"{e.start})", evidence={"param": "prompt"}) from None
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Iterable):
            raise InvalidRequest("prompt: each prompt must be a str or a list of token ids "
                                 f"(one prompt of ids: [[1, 2, 3]]), got {type(prompt).__name__}",
                                 evidence={"param": "prompt"})
        ids = list(prompt)
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
            raise InvalidRequest("prompt: token ids must be integers", evidence={"param": "prompt"})
        return [int(t) for t in ids]

    def chat_prompt(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text of OpenAI-shaped chat `messages` through the model's chat template,
        ready for `generate`. Messages of another shape are an `InvalidRequest`."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Iterable):
            raise InvalidRequest("messages: must be a list of {\"role\": ..., \"content\": ...} "
                                 f"dicts, got {type(messages).__name__}",
                                 evidence={"param": "messages"})
        messages = list(messages)
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise InvalidRequest(f"messages[{i}]: must be a dict with a str \"role\"",
                                     evidence={"param": f"messages[{i}]"})
            content = m.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise InvalidRequest(f"messages[{i}].content: must be a str or a list of "
                                     f"content parts, got {type(content).__name__}",
                                     evidence={"param": f"messages[{i}].content"})
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]],
                 params: SamplingParams | None = None) -> list[Completion]:
        """Complete every prompt. Every prompt is checked and encoded before any is added; if
        anything fails or interrupts the call (KeyboardInterrupt included), the requests it
        added are aborted, so the engine is left as it was and the next call runs clean.
        Calls from several threads run one after another."""
        with self._lock:
            return self._generate(prompts, params)

    def _generate(self, prompts: str | Seq[str] | Seq[Seq[int]],
                  params: SamplingParams | None) -> list[Completion]:
        self._check_open()
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params: must be a SamplingParams, got {type(params).__name__}",
                                 evidence={"param": "params"})
        params.validate(self.engine.vocab_size)  # every field, before a grammar is compiled
        encoded = [self._encode(p) for p in self._prompt_list(prompts)]
        if params.structured is not None:  # a grammar that does not compile: refused here
            from ftrs.engine.grammar import check

            check(params.structured, self.engine.tokenizer)
        out: dict[str, Completion] = {}
        try:
            for ids in encoded:
                rid = f"llm-{next(self._ids)}"
                out[rid] = Completion(ids, logprobs=[] if params.logprobs is not None else None)
                self.engine.add_request(GenerateRequest(rid, ids, params))
            self._run(out, params)
        except BaseException:
            for rid in out:  # finished or never added: a no-op
                with contextlib.suppress(Exception):  # the first error is the one to raise
                    self.engine.abort(rid)
            raise
        tok = self.engine.tokenizer
        for c in out.values():
            if tok is not None:
                c.text = tok.decode(c.token_ids)
                for s in params.stop:
                    if s in c.text:
                        c.text = c.text[: c.text.index(s)]
                        c.finish_reason = "stop"
        return list(out.values())

    @staticmethod
    def _prompt_list(prompts: object) -> list[Any]:
        """`generate`'s prompts as a list: one str is one prompt; otherwise a list of prompts."""
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
            raise InvalidRequest("prompts: must be a str, a list of str, or a list of token-id "
                                 f"lists (one prompt of ids: [[1, 2, 3]]), got "
                                 f"{type(prompts).__name__}", evidence={"param": "prompt"})
        return list(prompts)

    def _run(self, out: dict[str, Completion], params: SamplingParams) -> None:
        """Step the engine until every request of `out` is finished."""
        pending = set(out)
        while pending:
            events, _ = self.engine.step()
            for ev in events:
                c = out[ev.request_id]
                before = len(c.token_ids)
                c.token_ids.extend(ev.new_token_ids)
                c.num_cached_tokens = ev.num_cached_tokens
                if ev.logprobs and c.logprobs is not None:
                    c.logprobs.extend(ev.logprobs)
                if params.stop and ev.error is None and self._hit_stop(c.token_ids, params):
                    # several tokens in one event (accepted drafts): keep them up to the one
                    # that completes the stop string, as if they had come one at a time, even
                    # when the event also finished the request (max_tokens, EOS)
                    while (len(c.token_ids) > before + 1
                           and self._hit_stop(c.token_ids[:-1], params)):
                        c.token_ids.pop()
                    if c.logprobs is not None:  # one record per token kept
                        del c.logprobs[len(c.token_ids):]
                    if ev.finish_reason is None:
                        self.engine.abort(ev.request_id)
                    c.finish_reason = "stop"
                    pending.discard(ev.request_id)
                elif ev.finish_reason is not None:
                    c.finish_reason = ev.finish_reason
                    pending.discard(ev.request_id)
                    if ev.error is not None:  # one failed: the call fails, and `generate`
                        raise error_from_dict(ev.error)  # aborts the others

    def _hit_stop(self, token_ids: list[int], params: SamplingParams) -> bool:
        tok = self.engine.tokenizer
        if tok is None:
            return False
        text = tok.decode(token_ids)
        return any(s in text for s in params.stop)

    def logits(self, prompt: str | Seq[int]) -> torch.Tensor:
        """Logits of every position of one prompt (a str, tokenized as `generate` does, or a
        list of token ids): (len, vocab) fp32, on the CPU. The prompt runs through the
        scheduler like any request (`EngineCore.logits`)."""
        with self._lock:
            self._check_open()
            return self.engine.logits(self._encode(prompt))

    def close(self) -> None:
        """Free the engine (after a call in progress on another thread); idempotent.
        `generate`/`logits` then raise `InvalidRequest`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.engine.close()
