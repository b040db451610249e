"""The one request → generation → response path of every endpoint.

Protocol adapters (the OpenAI routes in `app.py`, the Anthropic routes) translate their request
into a `ChatCompletionRequest` or `CompletionRequest`, call `start_chat` / `start_completion`,
and encode the `ChoiceEvent`s that `ChatRun.events()` yields in their own wire format. The
engine sees one request type, `GenerateRequest`, one per choice.

`start_*` checks the model, refuses a request whose client already left (before tokenizing it,
which costs seconds of CPU for megabytes), renders and tokenizes in a worker thread
(`prepare.py`; the tokenizer releases the GIL, so the event loop runs meanwhile), then submits
the request's choices to the engine together, so the engine may prefill their shared prompt
once. `Generation` runs one choice: it feeds each `TokenEvent` through the incremental
detokenizer and the stop-string checker and yields `Delta`s; it aborts its engine request when
a stop string matches, when its consumer goes away, or when the client disconnects (the abort
reaches the engine before its next step), and records the request's metrics exactly once: a
request of `n` choices counts once (choice 0's outcome, TTFT and latency), its prompt once, and
the tokens of every choice. `ChatRun` merges its choices' deltas into `ChoiceEvent`s, each tagged with its choice index.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ftrs.engine.protocol import GenerateRequest, TokenLogprob
from ftrs.errors import FtrsError, error_from_dict
from ftrs.server.cli import DEFAULT_MAX_N
from ftrs.server.detokenize import IncrementalDetokenizer, LogprobCut, StopChecker, push_until_stop
from ftrs.server.engine_client import EngineClient
from ftrs.server.errors import ClientDisconnected, renamed
from ftrs.server.metrics import ServerMetrics
from ftrs.server.prepare import (
    Limits,
    Plan,
    check_model,
    prepare_chat,
    prepare_completion,
    render_chat,
)
from ftrs.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Usage,
    new_id,
)
from ftrs.server.reasoning import REASONING_PARSERS, ReasoningParser
from ftrs.server.toolcalls import TOOL_PARSERS, ToolCall, ToolCallDelta, ToolParser

WaitDisconnect = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class ServeContext:
    """What every endpoint shares: the engine client, the metrics and the serve options."""

    client: EngineClient
    metrics: ServerMetrics
    model_names: tuple[str, ...]  # accepted in `model`; the first is the listed one
    default_max_tokens: int  # of a chat request without max_tokens
    max_n: int = DEFAULT_MAX_N
    tool_parser: str | None = None  # `--tool-parser`; None: chosen from the chat template
    reasoning_parser: str | None = None  # `--reasoning-parser`; None: chosen from the template

    def ready(self) -> EngineClient:
        """The engine client, or the typed error (503) of why it does not serve now."""
        if self.client.state != "ready" or self.client.info is None:
            raise self.client.unavailable()
        return self.client

    def limits(self) -> Limits:
        info = self.ready().info
        assert info is not None
        return Limits(info.vocab_size, info.max_model_len, self.default_max_tokens, self.max_n,
                      self.tool_parser, self.reasoning_parser)


class _NoText:
    """Decoder of a model without a tokenizer: token-id prompts work, the text stays empty."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


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
    """One choice of a request: one engine request. `start()` submits it, `run()` reads it."""

    client: EngineClient
    metrics: ServerMetrics
    request_id: str
    prompt_ids: list[int]
    params: Any  # SamplingParams
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_sequence: str | None = None  # the stop string that ended it
    primary: bool = True  # choice 0: counts the request, its prompt, TTFT and latency in metrics
    keep: frozenset[int] = frozenset()  # special tokens the text keeps (a tool parser's tags)
    _queue: asyncio.Queue[Any] | None = None
    _arrival: float = field(default_factory=time.monotonic)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids)

    def start(self) -> None:
        """Submit to the engine (raises the engine's unavailability at once)."""
        self.num_prompt_tokens = len(self.prompt_ids)
        self._queue = self.client.submit(GenerateRequest(self.request_id, self.prompt_ids, self.params))

    def gone(self) -> None:
        """The client went away: abort in the engine now, end `run()` without a finish."""
        self.client.abort(self.request_id)
        if self._queue is not None:
            self._queue.put_nowait(_GONE)

    async def run(self) -> AsyncGenerator[Delta, None]:
        """Yield deltas until the request finishes. Raises the request's `FtrsError`."""
        if self._queue is None:
            self.start()
        queue = self._queue
        assert queue is not None
        detok = IncrementalDetokenizer(self.client.tokenizer or _NoText(), keep=self.keep)
        stop = StopChecker(self.params.stop)
        cut = LogprobCut(detok, stop)  # logprobs of the released text only
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
                        if self.primary:
                            self.metrics.ttft.observe(now - self._arrival)
                    else:
                        gap = (now - last) / len(item.new_token_ids)
                        for _ in item.new_token_ids:
                            self.metrics.itl.observe(gap)
                    last = now
                self.num_prompt_tokens = item.num_prompt_tokens or self.num_prompt_tokens
                self.num_cached_tokens = max(self.num_cached_tokens, item.num_cached_tokens)
                ids, out = push_until_stop(item.new_token_ids, item.finish_reason is not None,
                                           detok, stop)
                self.token_ids.extend(ids)
                if stop.stopped:
                    self.finish_reason, self.stop_sequence = "stop", stop.matched
                    if item.finish_reason is None:
                        self.client.abort(self.request_id)
                elif item.finish_reason is not None:
                    out += stop.flush()
                    self.finish_reason = item.finish_reason
                lps = cut.take(ids, item.logprobs or [], self.finish_reason is not None)
                if self.finish_reason is not None:
                    status = "success"
                    yield Delta(out, ids, lps, self.finish_reason)
                    return
                if out or ids:
                    yield Delta(out, ids, lps)
        except FtrsError:
            status = None  # counted where the error is answered (HTTP error or SSE event)
            raise
        finally:
            if self.finish_reason is None:
                self.client.abort(self.request_id)
            else:
                self.client.release(self.request_id)
            if self.primary:
                self.metrics.request_done(status, self.num_prompt_tokens, len(self.token_ids),
                                          time.monotonic() - self._arrival if status == "success" else None)
            else:  # another choice of the same request: its tokens only
                self.metrics.request_done(None, 0, len(self.token_ids), None)


@dataclass(slots=True)
class ChoiceEvent:
    """What one step adds to one choice, protocol-neutral; `finish_reason` on its last event
    ("stop" | "length" | "tool_calls" | "abort")."""

    index: int  # the choice (n > 1)
    text: str = ""  # content delta
    reasoning: str = ""  # reasoning delta
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(slots=True)
class _Choice:
    """The output parsers of one choice: text → reasoning parser → content → tool parser."""

    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None
    max_calls: int | None = None  # parallel_tool_calls false: 1
    finish_reason: str | None = None

    @classmethod
    def of(cls, plan: Plan) -> _Choice:
        tools = None
        if plan.tools is not None and plan.tool_parser is not None:
            tools = TOOL_PARSERS[plan.tool_parser](plan.tools)
        reasoning = None
        if plan.reasoning_parser is not None:
            reasoning = REASONING_PARSERS[plan.reasoning_parser](plan.starts_in_reasoning)
        return cls(reasoning, tools, None if plan.parallel_tool_calls else 1)

    def calls(self) -> list[ToolCall]:
        calls = list(self.tools.calls) if self.tools is not None else []
        return calls if self.max_calls is None else calls[:self.max_calls]

    def event(self, index: int, d: Delta) -> ChoiceEvent:
        reasoning, content = "", d.text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(d.text)
            if d.finish_reason is not None:
                r, c = self.reasoning.finish()
                reasoning, content = reasoning + r, content + c
        calls: list[ToolCallDelta] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if d.finish_reason is not None:
                c, more = self.tools.finish(cut=d.finish_reason == "length")
                content, calls = content + c, calls + more
            if self.max_calls is not None:
                calls = [c for c in calls if c.index < self.max_calls]
        finish = d.finish_reason
        if finish == "stop" and self.calls():
            finish = "tool_calls"
        self.finish_reason = finish
        return ChoiceEvent(index, content, reasoning, calls, d.token_ids, d.logprobs, finish)


_END = object()  # a choice's generator is done


def kept_special_ids(tokenizer: Any, plan: Plan) -> frozenset[int]:
    """The parsers' tags that the tokenizer holds as special tokens (Mistral's `[TOOL_CALLS]`,
    Llama's `<|python_tag|>`, gpt-oss's harmony tags): the detokenizer keeps them for the
    parsers."""
    if not hasattr(tokenizer, "special_ids"):
        return frozenset()
    tags: tuple[str, ...] = ()
    if plan.tools is not None and plan.tool_parser is not None:
        tags += TOOL_PARSERS[plan.tool_parser].special_tags
    if plan.reasoning_parser is not None:
        tags += REASONING_PARSERS[plan.reasoning_parser].special_tags
    return frozenset(tokenizer.special_ids(tags)) if tags else frozenset()


class ChatRun:
    """One request's `n` choices, running together in the engine.

    `events()` is primed: it returns only once every choice has produced its first delta (or
    finished), so an error the engine raises before the first token (a refused request) is
    raised there, before the caller sends any byte. An error after that is raised from the
    iteration. Leaving the iteration early aborts the choices still running."""

    def __init__(self, ctx: ServeContext, request_id: str, plan: Plan,
                 wait_disconnect: WaitDisconnect | None = None) -> None:
        self.request_id = request_id
        self.created = int(time.time())  # every chunk's and the body's `created`, stamped once
        self.n = len(plan.params)
        self.plan = plan
        keep = kept_special_ids(ctx.client.tokenizer, plan)
        self._gens = [
            Generation(ctx.client, ctx.metrics, request_id if self.n == 1 else f"{request_id}-{i}",
                       plan.prompt_ids, params, primary=i == 0, keep=keep)
            for i, params in enumerate(plan.params)
        ]
        self._choices = [_Choice.of(plan) for _ in range(self.n)]
        self._wait_disconnect = wait_disconnect
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Submit every choice to the engine, back to back (no await between them)."""
        started: list[Generation] = []
        try:
            for g in self._gens:
                g.start()
                started.append(g)
        except BaseException:
            for g in started:
                g.client.abort(g.request_id)
            raise

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(i: int, gen: Generation) -> None:
            try:
                async for d in gen.run():
                    queue.put_nowait((i, d))
            except FtrsError as err:
                queue.put_nowait((i, err))
            finally:
                queue.put_nowait((i, _END))

        self._tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(self._gens)]
        if self._wait_disconnect is not None:
            self._tasks.append(asyncio.ensure_future(self._watch(self._wait_disconnect)))
        primed: list[tuple[int, Any]] = []
        waiting = set(range(self.n))
        try:
            while waiting:
                i, item = await queue.get()
                if isinstance(item, FtrsError):
                    raise item
                primed.append((i, item))
                waiting.discard(i)
        except BaseException:
            await self.close()
            raise
        return self._rest(primed, queue)

    async def _rest(self, primed: list[tuple[int, Any]],
                    queue: asyncio.Queue[tuple[int, Any]]) -> AsyncIterator[ChoiceEvent]:
        open_choices = self.n
        try:
            pending = list(primed)
            while open_choices:
                i, item = pending.pop(0) if pending else await queue.get()
                if item is _END:
                    open_choices -= 1
                elif isinstance(item, FtrsError):
                    raise item
                else:
                    yield self._choices[i].event(i, item)
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop every choice still running (aborting it in the engine) and the watcher."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, FtrsError):
                await t

    async def _watch(self, wait_disconnect: WaitDisconnect) -> None:
        await wait_disconnect()
        for g in self._gens:
            g.gone()  # now, not when the consumer next wakes

    def usage(self) -> Usage:
        """Prompt tokens once, completion tokens of all choices, the prompt's cached tokens."""
        first = self._gens[0]
        return Usage.of(first.num_prompt_tokens, sum(g.num_completion_tokens for g in self._gens),
                        min(g.num_cached_tokens for g in self._gens))

    def token_ids(self, index: int) -> list[int]:
        return self._gens[index].token_ids

    def calls(self, index: int) -> list[ToolCall]:
        """The complete tool calls of choice `index`."""
        return self._choices[index].calls()

    def stop_sequence(self, index: int) -> str | None:
        """The stop string that ended choice `index`, if one did."""
        return self._gens[index].stop_sequence

    def finish_reason(self, index: int) -> str | None:
        return self._choices[index].finish_reason


async def start_chat(ctx: ServeContext, req: ChatCompletionRequest, request: Any,
                     id_prefix: str = "chatcmpl") -> ChatRun:
    """Check, render and submit a chat request; `request` (a Starlette `Request` or None) is
    watched for a disconnect, which aborts the run."""
    check_model(req, ctx.model_names)
    eng = ctx.ready()
    await _refuse_if_gone(request)
    plan = await asyncio.to_thread(prepare_chat, req, eng.tokenizer, ctx.limits())
    run = ChatRun(ctx, new_id(id_prefix), plan, disconnect_waiter(request))
    run.start()
    return run


async def start_adapted(ctx: ServeContext, req: ChatCompletionRequest, request: Any,
                        id_prefix: str, rename: Callable[[str], str]
                        ) -> tuple[ChatRun, AsyncIterator[ChoiceEvent]]:
    """`start_chat` for an adapter's request (Anthropic's, the Responses API's) translated into
    `req`, primed; an error names the field as `rename` maps the chat request's to the adapter's."""
    try:
        run = await start_chat(ctx, req, request, id_prefix=id_prefix)
        return run, await run.events()
    except FtrsError as err:
        raise renamed(err, rename) from None


async def start_completion(ctx: ServeContext, req: CompletionRequest, request: Any,
                           id_prefix: str = "cmpl") -> ChatRun:
    """`start_chat` for /v1/completions: the prompt is used as given, the output is not parsed."""
    check_model(req, ctx.model_names)
    eng = ctx.ready()
    await _refuse_if_gone(request)
    plan = await asyncio.to_thread(prepare_completion, req, eng.tokenizer, ctx.limits())
    run = ChatRun(ctx, new_id(id_prefix), plan, disconnect_waiter(request))
    run.start()
    return run


def render_chat_prompt(ctx: ServeContext, req: ChatCompletionRequest) -> list[int]:
    """The prompt ids `start_chat` would submit (for count_tokens). Tokenizes: call it from a
    worker thread (`asyncio.to_thread`)."""
    return render_chat(req, ctx.ready().tokenizer, ctx.limits())[0]


async def _refuse_if_gone(request: Any) -> None:
    """Raise `ClientDisconnected` when the client of `request` (a Starlette `Request` or None)
    has already left: a look at the connection's next message, no wait."""
    is_disconnected = getattr(request, "is_disconnected", None)
    if is_disconnected is not None and await is_disconnected():
        raise ClientDisconnected("the client disconnected before its request was tokenized")


def disconnect_waiter(request: Any) -> WaitDisconnect | None:
    """A coroutine function that returns once the client of `request` has disconnected.

    The body was read before the handler ran, so the next ASGI message of this connection is
    `http.disconnect`; it arrives the moment the server sees the socket close."""
    if request is None:
        return None

    async def wait() -> None:
        while True:
            message = await request.receive()
            if message.get("type") == "http.disconnect":
                return
            await asyncio.sleep(0.05)  # not expected after the body; do not spin

    return wait


__all__ = [
    "ChatRun",
    "ChoiceEvent",
    "Delta",
    "Generation",
    "ServeContext",
    "disconnect_waiter",
    "kept_special_ids",
    "render_chat_prompt",
    "start_adapted",
    "start_chat",
    "start_completion",
]
