"""From an OpenAI request to engine tokens and back.

`prepare_*` turn a validated request into prompt ids and `SamplingParams` (raising typed errors
for what the protocol allows but ftrs refuses, each naming its field as `messages[0].content`).
They tokenize and render the chat template, so the app runs them in a worker thread, never on
the event loop. `Generation` runs one request: it submits it, feeds each `TokenEvent` through
the incremental detokenizer and the stop-string checker, and yields `Delta`s; it aborts the
request in the engine when a stop string matches, when its consumer goes away, or as soon as
`wait_disconnect` returns (the client closed the connection: the abort reaches the engine
before its next step), and records the request's metrics exactly once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ftrs.engine.protocol import GenerateRequest, TokenLogprob
from ftrs.errors import ContextLengthExceeded, FtrsError, InvalidRequest
from ftrs.sampling import SamplingParams
from ftrs.server.detokenize import IncrementalDetokenizer, StopChecker
from ftrs.server.engine_client import EngineClient
from ftrs.server.errors import ModelNotFound, error_from_dict
from ftrs.server.metrics import ServerMetrics
from ftrs.server.protocol import (
    ChatCompletionRequest,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    CompletionRequest,
    TopLogprob,
    _SamplingFields,
)


def _bad(param: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {why}", evidence={"param": param})


class _NoText:
    """Decoder of a model without a tokenizer: token-id prompts work, the text stays empty."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def _require_tokenizer(tokenizer: Any, param: str) -> Any:
    if tokenizer is None:
        raise _bad(param, "this model has no tokenizer: send token ids to /v1/completions")
    return tokenizer


@dataclass(frozen=True)
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams


def check_model(req: _SamplingFields, served: tuple[str, ...]) -> None:
    if req.model not in served:
        raise ModelNotFound(
            f"The model `{req.model}` does not exist; this server serves {', '.join(served)}",
            evidence={"param": "model"},
        )


def _common_checks(req: _SamplingFields) -> None:
    if req.n not in (None, 1):
        raise _bad("n", f"only n=1 is supported, got {req.n}")
    if req.stream_options is not None and not req.stream:
        raise _bad("stream_options", "only allowed when stream is true")
    if req.logit_bias:
        raise _bad("logit_bias", "logit_bias is not supported")


def _unsupported_chat_fields(req: ChatCompletionRequest) -> None:
    """Fields that would change the output but are not served yet: a 400 naming the field."""
    if req.tools:
        raise _bad("tools", "tool calling is not supported")
    if req.tool_choice not in (None, "none"):
        raise _bad("tool_choice", 'only "none" is supported')
    if req.functions:
        raise _bad("functions", "function calling is not supported")
    if req.function_call not in (None, "none"):
        raise _bad("function_call", 'only "none" is supported')
    if req.response_format is not None and req.response_format != {"type": "text"}:
        raise _bad("response_format", 'only {"type": "text"} is supported')
    if req.audio is not None:
        raise _bad("audio", "audio output is not supported")
    if req.modalities not in (None, [], ["text"]):
        raise _bad("modalities", 'only ["text"] is supported')
    for i, m in enumerate(req.messages):
        if m.tool_calls:
            raise _bad(f"messages[{i}].tool_calls", "tool calls are not supported")


def _params(req: _SamplingFields, max_tokens: int, logprobs: int | None, vocab: int) -> SamplingParams:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=bool(req.ignore_eos),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logprobs=logprobs,
    ).validate(vocab)


def _check_context(prompt_len: int, max_tokens: int, max_model_len: int, prompt_param: str) -> None:
    if prompt_len == 0:
        raise _bad("prompt", "the prompt is empty")
    if prompt_len >= max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} tokens",
            evidence={"param": prompt_param,
                      "prompt_tokens": prompt_len, "max_model_len": max_model_len},
        )
    if prompt_len + max_tokens > max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} tokens and max_tokens is {max_tokens}",
            evidence={"param": "max_tokens", "prompt_tokens": prompt_len,
                      "max_model_len": max_model_len},
        )


def prepare_completion(req: CompletionRequest, tokenizer: Any, vocab: int, max_model_len: int) -> Prepared:
    """Prompt ids and params of a /v1/completions request; `max_tokens` defaults to 16 (OpenAI)."""
    _common_checks(req)
    if req.echo:
        raise _bad("echo", "echo is not supported")
    if req.suffix:
        raise _bad("suffix", "suffix is not supported")
    if req.best_of not in (None, 1):
        raise _bad("best_of", "only best_of=1 is supported")
    prompt: Any = req.prompt
    param = "prompt"
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise _bad("prompt", f"one prompt per request is supported, got {len(prompt)}")
        prompt, param = prompt[0], "prompt[0]"
    if isinstance(prompt, str):
        ids = list(_require_tokenizer(tokenizer, param).encode(prompt, add_special_tokens=True))
    else:
        ids = [int(t) for t in prompt]
        if any(not 0 <= t < vocab for t in ids):
            raise _bad(param, f"token ids must be in [0, {vocab})")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise _bad("logprobs", f"must be in [0, 20], got {req.logprobs}")
    params = _params(req, max_tokens, req.logprobs, vocab)
    _check_context(len(ids), max_tokens, max_model_len, "prompt")
    return Prepared(ids, params)


def prepare_chat(req: ChatCompletionRequest, tokenizer: Any, vocab: int, max_model_len: int,
                 default_max_tokens: int) -> Prepared:
    """Prompt ids and params of a chat request. Without `max_tokens`/`max_completion_tokens`
    the request may generate `default_max_tokens`, or what is left of the context if less."""
    _common_checks(req)
    _unsupported_chat_fields(req)
    _require_tokenizer(tokenizer, "messages")
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        if m.has_non_text_parts():
            raise _bad(f"messages[{i}].content", "only text content parts are supported")
        # `developer` is OpenAI's newer name for `system`; chat templates know only the latter.
        role = "system" if m.role == "developer" else m.role
        messages.append({"role": role, "content": m.text()})
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except FtrsError:
        raise
    except Exception as exc:  # a template error is the request's fault (roles, order)
        raise _bad("messages", f"chat template failed: {exc}") from exc
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if req.top_logprobs is not None and not req.logprobs:
        raise _bad("top_logprobs", "requires logprobs to be true")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise _bad("top_logprobs", f"must be in [0, 20], got {req.top_logprobs}")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if requested is None:
        max_tokens = max(min(default_max_tokens, max_model_len - len(ids)), 1)
    else:
        max_tokens = requested
    params = _params(req, max_tokens, logprobs, vocab)
    _check_context(len(ids), max_tokens, max_model_len, "messages")
    return Prepared(ids, params)


# ------------------------------------------------------------------------------------ running


_GONE = object()  # put on a request's queue when its client disconnects


@dataclass(slots=True)
class Delta:
    """What one engine event adds to a choice; `finish_reason` set on the last one."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None


@dataclass(slots=True)
class Generation:
    client: EngineClient
    metrics: ServerMetrics
    request_id: str
    prepared: Prepared
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    _arrival: float = field(default_factory=time.monotonic)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids)

    async def run(self, wait_disconnect: Callable[[], Awaitable[None]] | None = None) -> AsyncGenerator[Delta, None]:
        """Yield deltas until the request finishes. Raises the request's `FtrsError`.

        `wait_disconnect` returns when the client has gone; the request is then aborted at once
        (the engine drops it before its next step) and the generator ends without a finish."""
        params = self.prepared.params
        detok = IncrementalDetokenizer(self.client.tokenizer or _NoText())
        stop = StopChecker(params.stop)
        self.num_prompt_tokens = len(self.prepared.prompt_ids)
        queue = self.client.submit(GenerateRequest(self.request_id, self.prepared.prompt_ids, params))
        watcher = None if wait_disconnect is None else asyncio.ensure_future(
            self._watch(wait_disconnect, queue))
        status: str | None = "aborted"
        last = self._arrival
        try:
            while True:
                item = await queue.get()
                if item is _GONE:  # the client went away
                    return
                if isinstance(item, FtrsError):
                    raise item
                if item.error is not None:
                    raise error_from_dict(item.error)
                now = time.monotonic()
                if item.new_token_ids:
                    if not self.token_ids:
                        self.metrics.ttft.observe(now - self._arrival)
                    else:
                        gap = (now - last) / len(item.new_token_ids)
                        for _ in item.new_token_ids:
                            self.metrics.itl.observe(gap)
                    last = now
                self.num_prompt_tokens = item.num_prompt_tokens or self.num_prompt_tokens
                self.num_cached_tokens = max(self.num_cached_tokens, item.num_cached_tokens)
                self.token_ids.extend(item.new_token_ids)
                text = detok.push(item.new_token_ids)
                if item.finish_reason is not None:
                    text += detok.flush()
                out = stop.feed(text)
                if stop.stopped:
                    self.finish_reason = "stop"
                    if item.finish_reason is None:
                        self.client.abort(self.request_id)
                elif item.finish_reason is not None:
                    out += stop.flush()
                    self.finish_reason = item.finish_reason
                if self.finish_reason is not None:
                    status = "success"
                    yield Delta(out, item.new_token_ids, item.logprobs or [], self.finish_reason)
                    return
                if out or item.new_token_ids:
                    yield Delta(out, item.new_token_ids, item.logprobs or [])
        except FtrsError:
            status = None  # counted where the error is answered (HTTP error or SSE event)
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
            if self.finish_reason is None:
                self.client.abort(self.request_id)
            else:
                self.client.release(self.request_id)
            self.metrics.request_done(status, self.num_prompt_tokens, len(self.token_ids),
                                      time.monotonic() - self._arrival if status == "success" else None)

    async def _watch(self, wait_disconnect: Callable[[], Awaitable[None]], queue: asyncio.Queue[Any]) -> None:
        await wait_disconnect()
        self.client.abort(self.request_id)  # now, not when the consumer next wakes
        queue.put_nowait(_GONE)


# ---------------------------------------------------------------------------------- logprobs


def _token_str(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return str(tokenizer.decode([token_id], skip_special_tokens=False))


def chat_logprobs(tokenizer: Any, lps: list[TokenLogprob]) -> ChatLogprobs:
    content = []
    for lp in lps:
        tok = _token_str(tokenizer, lp.token_id)
        top = [
            TopLogprob(token=(t := _token_str(tokenizer, tid)), logprob=v, bytes=list(t.encode()))
            for tid, v in lp.top
        ]
        content.append(ChatTokenLogprob(token=tok, logprob=lp.logprob, bytes=list(tok.encode()),
                                        top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(tokenizer: Any, lps: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for lp in lps:
        tok = _token_str(tokenizer, lp.token_id)
        out.tokens.append(tok)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({_token_str(tokenizer, t): v for t, v in lp.top})
        out.text_offset.append(offset)
        offset += len(tok)
    return out


__all__ = [
    "Delta",
    "Generation",
    "Prepared",
    "chat_logprobs",
    "check_model",
    "completion_logprobs",
    "prepare_chat",
    "prepare_completion",
]
