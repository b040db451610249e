"""The FastAPI app: OpenAI-compatible endpoints, /health and /metrics.

`create_app(settings)` builds the app; its lifespan spawns the engine process (`EngineClient`)
without waiting for it, so `/health` answers 503 "loading" while the model loads. Every error,
including FastAPI's own validation errors and unknown routes, leaves in the OpenAI error shape
`{"error": {"message", "type", "param", "code"}}` with the status of its `FtrsError` class.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ftrs.config import EngineConfig
from ftrs.engine.protocol import StepStats
from ftrs.errors import DeviceLost, DeviceUnhealthy, FtrsError, InvalidRequest
from ftrs.server.engine_client import (
    DEFAULT_BACKEND,
    Classifier,
    EngineClient,
    classify_engine_exit,
)
from ftrs.server.engine_process import EngineReady
from ftrs.server.errors import Unauthorized, error_body, error_response
from ftrs.server.metrics import CONTENT_TYPE, ServerMetrics
from ftrs.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
    new_id,
)
from ftrs.server.serving import (
    Delta,
    Generation,
    chat_logprobs,
    check_model,
    completion_logprobs,
    prepare_chat,
    prepare_completion,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeSettings:
    """Everything `ftrs serve` needs beyond the engine's own options."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    backend: str = DEFAULT_BACKEND  # module with load() and load_tokenizer(); see backend.py
    link_guard: dict[str, Any] | None = None  # the startup guard's decision, shown on /health

    @property
    def model_names(self) -> tuple[str, ...]:
        """The first is listed by /v1/models; all are accepted in `model`."""
        names = [self.served_model_name or self.engine.model]
        if self.engine.model not in names:
            names.append(self.engine.model)
        return tuple(names)


def _sse(obj: Any) -> str:
    data = obj.model_dump_json(exclude_none=True) if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


def create_app(settings: ServeSettings, classifier: Classifier = classify_engine_exit) -> FastAPI:
    metrics = ServerMetrics()
    metrics.prefill_cap.set(settings.engine.max_prefill_length)

    def on_failure(err: FtrsError) -> None:
        if isinstance(err, DeviceLost):
            metrics.device_lost.inc()
        state = "lost" if isinstance(err, DeviceLost) else "degraded" if isinstance(err, DeviceUnhealthy) else "unknown"
        metrics.set_device_state(state, up=False)

    def on_ready(_: EngineReady) -> None:
        degraded = client.degraded is not None  # restarted on the CPU after a device error
        metrics.set_device_state("degraded" if degraded else "ok", up=not degraded)
        logger.info("ftrs ready: serving %s at http://%s:%d/v1", settings.model_names[0],
                    settings.host, settings.port)

    adaptive_guard: dict[str, Any] = {}  # the engine's latest `StepStats.guard`

    def on_stats(stats: StepStats) -> None:
        metrics.observe_step(stats)
        if stats.guard:
            adaptive_guard.clear()
            adaptive_guard.update(stats.guard)

    client = EngineClient(settings.engine, settings.backend, classifier, on_stats=on_stats,
                          on_failure=on_failure, on_ready=on_ready)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        client.start()
        try:
            yield
        finally:
            await asyncio.to_thread(client.shutdown)

    app = FastAPI(title="ftrs", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = client
    app.state.metrics = metrics
    app.state.settings = settings
    _install_error_handlers(app, metrics)

    async def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise Unauthorized("Incorrect or missing API key: send `Authorization: Bearer <key>`")

    def ready_engine() -> EngineClient:
        if client.state != "ready":
            raise client.unavailable()
        return client

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = client.health()
        if settings.link_guard is not None:
            body = {**body, "link_guard": settings.link_guard}
        if adaptive_guard:
            body = {**body, "adaptive_guard": dict(adaptive_guard)}
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> ModelList:
        max_len = client.info.max_model_len if client.info else None
        return ModelList(data=[ModelCard(id=settings.model_names[0], max_model_len=max_len)])

    @app.post("/v1/completions", dependencies=[Depends(authorize)], response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Response:
        check_model(req, settings.model_names)
        eng = ready_engine()
        assert eng.info is not None
        prepared = prepare_completion(req, eng.tokenizer, eng.info.vocab_size, eng.info.max_model_len)
        gen = Generation(eng, metrics, new_id("cmpl"), prepared)
        model = req.model
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            deltas = await _primed(gen.run())

            async def events() -> AsyncIterator[str]:
                offset = 0
                async for d in deltas:
                    lp = None
                    if req.logprobs is not None:
                        lp = completion_logprobs(eng.tokenizer, d.logprobs, offset)
                    offset += len(d.text)
                    choice = CompletionChoice(text=d.text, logprobs=lp, finish_reason=d.finish_reason,
                                              token_ids=d.token_ids if req.return_token_ids else None)
                    yield _sse(CompletionResponse(id=gen.request_id, model=model, choices=[choice]))
                if include_usage:
                    yield _sse(CompletionResponse(id=gen.request_id, model=model, choices=[], usage=_usage(gen)))

            return _stream(events(), metrics)
        text, lps = [], []
        async for d in gen.run(request.is_disconnected):
            text.append(d.text)
            lps.extend(d.logprobs)
        lp = completion_logprobs(eng.tokenizer, lps, 0) if req.logprobs is not None else None
        choice = CompletionChoice(text="".join(text), logprobs=lp, finish_reason=gen.finish_reason,
                                  token_ids=gen.token_ids if req.return_token_ids else None)
        return _json(CompletionResponse(id=gen.request_id, model=model, choices=[choice], usage=_usage(gen)))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)], response_model=None)
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        check_model(req, settings.model_names)
        eng = ready_engine()
        assert eng.info is not None
        prepared = prepare_chat(req, eng.tokenizer, eng.info.vocab_size, eng.info.max_model_len)
        gen = Generation(eng, metrics, new_id("chatcmpl"), prepared)
        model = req.model
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            deltas = await _primed(gen.run())

            async def events() -> AsyncIterator[str]:
                first = ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))
                yield _sse(ChatCompletionChunk(id=gen.request_id, model=model, choices=[first]))
                async for d in deltas:
                    lp = chat_logprobs(eng.tokenizer, d.logprobs) if req.logprobs else None
                    choice = ChatChunkChoice(delta=ChatDelta(content=d.text), logprobs=lp,
                                             finish_reason=d.finish_reason,
                                             token_ids=d.token_ids if req.return_token_ids else None)
                    yield _sse(ChatCompletionChunk(id=gen.request_id, model=model, choices=[choice]))
                if include_usage:
                    yield _sse(ChatCompletionChunk(id=gen.request_id, model=model, choices=[], usage=_usage(gen)))

            return _stream(events(), metrics)
        text, lps = [], []
        async for d in gen.run(request.is_disconnected):
            text.append(d.text)
            lps.extend(d.logprobs)
        choice = ChatChoice(
            message=ChatResponseMessage(content="".join(text)),
            logprobs=chat_logprobs(eng.tokenizer, lps) if req.logprobs else None,
            finish_reason=gen.finish_reason,
            token_ids=gen.token_ids if req.return_token_ids else None,
        )
        return _json(ChatCompletionResponse(id=gen.request_id, model=model, choices=[choice], usage=_usage(gen)))

    return app


def _usage(gen: Generation) -> Usage:
    return Usage.of(gen.num_prompt_tokens, gen.num_completion_tokens, gen.num_cached_tokens)


def _json(obj: Any) -> Response:
    return Response(obj.model_dump_json(exclude_none=True), media_type="application/json")


async def _primed(deltas: AsyncGenerator[Delta, None]) -> AsyncIterator[Delta]:
    """Wait for the first delta before the response starts, so that an error the engine raises
    before the first token (a refused request) is answered with its HTTP status, not as SSE."""
    try:
        first = await anext(deltas)
    except StopAsyncIteration:
        first = None

    async def rest() -> AsyncIterator[Delta]:
        try:
            if first is not None:
                yield first
            async for d in deltas:
                yield d
        finally:
            await deltas.aclose()

    return rest()


def _stream(events: AsyncIterator[str], metrics: ServerMetrics) -> StreamingResponse:
    """SSE; an error after the response started becomes an `error` event, then `[DONE]`."""

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in events:
                yield chunk
        except FtrsError as err:
            metrics.request_failed(err.http_status)
            yield f"data: {json.dumps(error_body(err))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def answer(request: Request, err: FtrsError) -> JSONResponse:
        if request.method == "POST" and request.url.path.startswith("/v1/"):
            metrics.request_failed(err.http_status)
        return error_response(err)

    @app.exception_handler(FtrsError)
    async def ftrs_error(request: Request, exc: FtrsError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return answer(request, InvalidRequest(f"invalid JSON body: {first.get('msg', '')}"))
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        if first.get("type") == "missing":
            msg = "field required"
        return answer(request, InvalidRequest(f"{param}: {msg}" if param else str(msg),
                                              evidence={"param": param} if param else None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = FtrsError(str(exc.detail))
        err.http_status = exc.status_code
        err.code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(err)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error: %s", exc)
        return answer(request, FtrsError(f"internal server error: {type(exc).__name__}"))


__all__ = ["ServeSettings", "create_app"]
