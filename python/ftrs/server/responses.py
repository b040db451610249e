"""The OpenAI answers: a run's `ChoiceEvent`s written as one JSON body or as SSE chunks.

`completion_response` and `chat_response` take a started `ChatRun` (`serving.py`) and write
/v1/completions and /v1/chat/completions answers for its `n` choices: per-choice text, logprobs,
token ids; for chat also `reasoning_content` and `tool_calls` (streamed as `delta.tool_calls`
pieces with a stable index and id). The bodies have OpenAI's keys (`protocol.py`: `content`,
`logprobs` and `finish_reason` null rather than absent; with `include_usage`, every chunk's `usage`
null before the last). An error after the stream started becomes an `error` event, then `[DONE]`.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response, StreamingResponse

from ftrs.engine.protocol import TokenLogprob
from ftrs.server.detokenize import TokenBytes
from ftrs.server.errors import as_ftrs_error, error_body
from ftrs.server.metrics import ServerMetrics
from ftrs.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaToolCall,
    ResponseFunction,
    ResponseToolCall,
    TopLogprob,
)
from ftrs.server.serving import ChatRun, ServeContext
from ftrs.server.toolcalls import ToolCall, ToolCallDelta


def _sse(obj: Any) -> str:
    data = obj.model_dump_json() if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


def _chunk(obj: Any, include_usage: bool) -> str:
    """A streamed chunk; with `include_usage`, `usage: null` on every chunk before the last, as
    OpenAI writes them (the model leaves an unset usage out)."""
    data = obj.model_dump_json()
    if include_usage:
        data = data[:-1] + ',"usage":null}'
    return f"data: {data}\n\n"


def _json(obj: Any) -> Response:
    return Response(obj.model_dump_json(), media_type="application/json")


async def completion_response(ctx: ServeContext, req: CompletionRequest, run: ChatRun) -> Response:
    """A /v1/completions answer from the run's events: one JSON body, or SSE chunks."""
    tokenizer = ctx.client.tokenizer
    events = await run.events()
    model, n = req.model, run.n
    want_ids = bool(req.return_token_ids)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def chunks() -> AsyncIterator[str]:
            offsets = [0] * n
            async for e in events:
                lp = None
                if req.logprobs is not None:
                    lp = completion_logprobs(tokenizer, e.logprobs, offsets[e.index])
                offsets[e.index] += len(e.text)
                choice = CompletionChoice(index=e.index, text=e.text, logprobs=lp,
                                          finish_reason=e.finish_reason,
                                          token_ids=e.token_ids if want_ids else None)
                yield _chunk(CompletionResponse(id=run.request_id, created=run.created, model=model,
                                                choices=[choice]), include_usage)
            if include_usage:
                yield _sse(CompletionResponse(id=run.request_id, created=run.created, model=model,
                                              choices=[], usage=run.usage()))

        return _stream(chunks(), ctx.metrics)
    texts: list[list[str]] = [[] for _ in range(n)]
    lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
    async for e in events:
        texts[e.index].append(e.text)
        lps[e.index].extend(e.logprobs)
    choices = [
        CompletionChoice(index=i, text="".join(texts[i]), finish_reason=run.finish_reason(i),
                         logprobs=completion_logprobs(tokenizer, lps[i], 0) if req.logprobs is not None else None,
                         token_ids=run.token_ids(i) if want_ids else None)
        for i in range(n)
    ]
    return _json(CompletionResponse(id=run.request_id, created=run.created, model=model,
                                    choices=choices, usage=run.usage()))


def _delta_calls(deltas: list[ToolCallDelta]) -> list[DeltaToolCall] | None:
    if not deltas:
        return None
    return [DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None,
                          function=ResponseFunction(name=d.name, arguments=d.arguments))
            for d in deltas]


def _message_calls(calls: list[ToolCall]) -> list[ResponseToolCall] | None:
    if not calls:
        return None
    return [ResponseToolCall(id=c.id, function=ResponseFunction(name=c.name, arguments=c.arguments))
            for c in calls]


async def chat_response(ctx: ServeContext, req: ChatCompletionRequest, run: ChatRun) -> Response:
    """A /v1/chat/completions answer from the run's events: one JSON body, or SSE chunks."""
    tokenizer = ctx.client.tokenizer
    events = await run.events()
    model, n = req.model, run.n
    want_ids = bool(req.return_token_ids)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def chunks() -> AsyncIterator[str]:
            for i in range(n):
                first = ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                yield _chunk(ChatCompletionChunk(id=run.request_id, created=run.created,
                                                 model=model, choices=[first]), include_usage)
            async for e in events:
                lp = chat_logprobs(tokenizer, e.logprobs) if req.logprobs else None
                if not (e.text or e.reasoning or e.tool_calls or e.finish_reason
                        or (lp and lp.content) or (want_ids and e.token_ids)):
                    continue  # held back by a parser: nothing to say yet
                delta = ChatDelta(content=e.text or None, reasoning_content=e.reasoning or None,
                                  tool_calls=_delta_calls(e.tool_calls))
                choice = ChatChunkChoice(index=e.index, delta=delta, logprobs=lp,
                                         finish_reason=e.finish_reason,
                                         token_ids=e.token_ids if want_ids else None)
                yield _chunk(ChatCompletionChunk(id=run.request_id, created=run.created,
                                                 model=model, choices=[choice]), include_usage)
            if include_usage:
                yield _sse(ChatCompletionChunk(id=run.request_id, created=run.created, model=model,
                                               choices=[], usage=run.usage()))

        return _stream(chunks(), ctx.metrics)
    texts: list[list[str]] = [[] for _ in range(n)]
    reasoning: list[list[str]] = [[] for _ in range(n)]
    lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
    async for e in events:
        texts[e.index].append(e.text)
        reasoning[e.index].append(e.reasoning)
        lps[e.index].extend(e.logprobs)
    choices = []
    for i in range(n):
        calls = _message_calls(run.calls(i))
        content = "".join(texts[i])
        message = ChatResponseMessage(content=None if calls and not content else content,
                                      reasoning_content="".join(reasoning[i]) or None,
                                      tool_calls=calls)
        choices.append(ChatChoice(index=i, message=message, finish_reason=run.finish_reason(i),
                                  logprobs=chat_logprobs(tokenizer, lps[i]) if req.logprobs else None,
                                  token_ids=run.token_ids(i) if want_ids else None))
    return _json(ChatCompletionResponse(id=run.request_id, created=run.created, model=model,
                                        choices=choices, usage=run.usage()))


def _stream(events: AsyncIterator[str], metrics: ServerMetrics) -> StreamingResponse:
    """SSE; an error after the response started becomes an `error` event, then `[DONE]`."""

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in events:
                yield chunk
        except Exception as exc:
            err = as_ftrs_error(exc)
            metrics.request_failed(err.http_status)
            yield f"data: {json.dumps(error_body(err))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---------------------------------------------------------------------------------- logprobs


def _token_str(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return str(tokenizer.decode([token_id], skip_special_tokens=False))


_TOKEN_BYTES: dict[int, tuple[Any, TokenBytes]] = {}


def _token_bytes(tokenizer: Any) -> TokenBytes:
    """The tokenizer's `TokenBytes`, built once (it reads the vocabulary's decoder)."""
    held = _TOKEN_BYTES.get(id(tokenizer))
    if held is None or held[0] is not tokenizer:
        held = _TOKEN_BYTES[id(tokenizer)] = (tokenizer, TokenBytes(tokenizer))
    return held[1]


def chat_logprobs(tokenizer: Any, lps: list[TokenLogprob]) -> ChatLogprobs:
    """`bytes` are the token's own: a piece of a multi-byte character is that byte, not U+FFFD's."""
    raw = _token_bytes(tokenizer)
    content = []
    for lp in lps:
        top = [TopLogprob(token=_token_str(tokenizer, tid), logprob=v, bytes=list(raw(tid)))
               for tid, v in lp.top]
        content.append(ChatTokenLogprob(token=_token_str(tokenizer, lp.token_id),
                                        logprob=lp.logprob, bytes=list(raw(lp.token_id)),
                                        top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(tokenizer: Any, lps: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    """`text_offset`: where each token starts in the choice's text, in characters; a special
    token is not in the text, and the pieces of one character start where it does."""
    raw = _token_bytes(tokenizer)
    chars = codecs.getincrementaldecoder("utf-8")("replace")
    out = CompletionLogprobs()
    for lp in lps:
        tok = _token_str(tokenizer, lp.token_id)
        out.tokens.append(tok)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({_token_str(tokenizer, t): v for t, v in lp.top})
        out.text_offset.append(offset)
        if lp.token_id not in raw.special:
            offset += len(chars.decode(raw(lp.token_id)))
    return out


__all__ = ["chat_logprobs", "chat_response", "completion_logprobs", "completion_response"]
