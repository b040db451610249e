"""The FastAPI app: OpenAI-compatible endpoints, /health and /metrics.

`create_app(settings)` builds the app; its lifespan spawns the engine process (`EngineClient`)
without waiting for it, so `/health` answers 503 "loading" while the model loads. Every error,
including FastAPI's own validation errors and unknown routes, leaves in the OpenAI error shape
`{"error": {"message", "type", "param", "code"}}` with the status of its `FtrsError` class;
the OpenAPI document says so (400, not FastAPI's 422). `limits.BodyLimit` answers before the
body is parsed: 401 without the API key (before a byte of the body is read), 413 for a body
over `max_request_bytes`, 408 for one not whole within `request_body_timeout_s`. Chat-template
rendering and tokenization run in a worker thread, and the tokenizer releases the GIL, so a
large prompt does not stall `/health` or another stream (a prompt longer than the context's
worth of the vocabulary's longest tokens is refused untokenized, `prepare.check_fits`); a
request whose client has left is refused before it is tokenized, and aborted in the engine at
once when it leaves later, streamed or not.
With an API key set, everything but `/health` and `/metrics` needs it, `/openapi.json`, `/docs`
and unknown paths included; `/health` shows a failure's class and message and a short evidence
summary (`health.classify.evidence_summary`: decided_by, PCI address, Xid, hint), never the rest.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from ftrs.config import EngineConfig
from ftrs.engine.protocol import StepStats
from ftrs.errors import DeviceLost, DeviceUnhealthy, FtrsError
from ftrs.server.anthropic import install_anthropic
from ftrs.server.cli import (
    DEFAULT_MAX_N,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_TOKENS,
    DEFAULT_REQUEST_BODY_TIMEOUT_S,
)
from ftrs.server.engine_client import (
    DEFAULT_BACKEND,
    Classifier,
    EngineClient,
    classify_engine_exit,
)
from ftrs.server.engine_process import EngineReady
from ftrs.server.errors import (
    ModelNotFound,
    error_response,
    http_error,
    public_error,
    scrub_paths,
    validation_error,
)
from ftrs.server.limits import BodyLimit, require_key
from ftrs.server.metrics import CONTENT_TYPE, ServerMetrics
from ftrs.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from ftrs.server.reasoning import choose_reasoning_parser
from ftrs.server.responses import chat_response, completion_response
from ftrs.server.responses_api import install_responses
from ftrs.server.serving import (
    ServeContext,
    start_chat,
    start_completion,
)
from ftrs.server.toolcalls import choose_tool_parser

logger = logging.getLogger(__name__)


# Documented answers of the /v1 endpoints besides 200, all in the OpenAI error shape.
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request (the `param` names the field)"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    408: {"model": ErrorResponse, "description": "Body not whole within --request-body-timeout"},
    413: {"model": ErrorResponse, "description": "Request body over --max-request-bytes"},
    503: {"model": ErrorResponse, "description": "Engine loading, failed or overloaded"},
}

# /health's 503 is its own body (not an error shape): `status` says which, `reason` why.
_HEALTH_503: dict[int | str, dict[str, Any]] = {503: {
    "description": "Loading, restarting, failed or stopping (`status`; after a failure also "
                   "`code`, `classification`, `error`, `evidence`)",
    "content": {"application/json": {"schema": {
        "type": "object", "required": ["status"],
        "properties": {"status": {"type": "string"}, "reason": {"type": "string"}}}}},
}}


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
    link_guard_window: float = 0.5  # its `--link-guard-window`, to re-run it on a CPU fallback
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get 413
    request_body_timeout_s: float = DEFAULT_REQUEST_BODY_TIMEOUT_S  # a body not whole by then: 408
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # chat requests without max_tokens
    max_n: int = DEFAULT_MAX_N  # largest `n` accepted
    tool_parser: str | None = None  # None: chosen from the chat template
    reasoning_parser: str | None = None  # None: chosen from the chat template

    @property
    def model_names(self) -> tuple[str, ...]:
        """The first is listed by /v1/models; all are accepted in `model`."""
        names = [self.served_model_name or self.engine.model]
        if self.engine.model not in names:
            names.append(self.engine.model)
        return tuple(names)


def create_app(settings: ServeSettings, classifier: Classifier = classify_engine_exit) -> FastAPI:
    metrics = ServerMetrics()
    metrics.prefill_cap.set(settings.engine.max_prefill_length)

    def on_failure(err: FtrsError) -> None:
        metrics.engine_gone()  # its gauges read 0 until the next engine reports
        if isinstance(err, DeviceLost):
            metrics.device_lost.inc()
        state = "lost" if isinstance(err, DeviceLost) else "degraded" if isinstance(err, DeviceUnhealthy) else "unknown"
        metrics.set_device_state(state, up=False)

    def on_cpu_fallback() -> bool:
        """The engine runs on the CPU since a device error (`--on-device-lost cpu`)."""
        return (client.degraded or {}).get("mode") == "cpu"

    link_guard: dict[str, Any] = {"decision": settings.link_guard}

    def on_ready(ready: EngineReady) -> None:
        # the expert cache's slots from the ready message (a field only engines with an
        # expert cache send), so /metrics has them before the first step
        metrics.engine_ready(getattr(ready, "experts", None))
        if on_cpu_fallback():  # the device stays as its error left it: lost, or unknown
            assert client.degraded is not None
            lost = client.degraded.get("classification") == "DeviceLost"
            metrics.set_device_state("lost" if lost else "unknown", up=False)
            if settings.link_guard is not None:  # the startup guard, re-run for the new engine
                link_guard["decision"] = _guard_for(client.config, settings.link_guard_window)
        else:
            metrics.set_device_state("ok", up=True)
        logger.info("ftrs ready: serving %s at http://%s:%d/v1", settings.model_names[0],
                    settings.host, settings.port)
        tok = client.tokenizer
        template = getattr(tok, "chat_template", None)
        if template is not None:  # the chat format, as flags or the template(s) choose it
            named = sorted(getattr(tok, "named_templates", {}))
            pick = getattr(tok, "template_for", None)
            logger.info("chat: tool calls read as %s, reasoning as %s%s",
                        choose_tool_parser(settings.tool_parser, pick(True) if pick else template),
                        choose_reasoning_parser(settings.reasoning_parser, template) or "none",
                        f"; named templates: {', '.join(named)}" if named else "")

    adaptive_guard: dict[str, Any] = {}  # the engine's latest `StepStats.guard`

    def on_stats(stats: StepStats) -> None:
        metrics.observe_step(stats)
        device = stats.device or {}
        # the engine's device monitor: degraded while it finds the device unhealthy, ok again
        # when it no longer does (an engine restarted on the CPU watches no device: on_ready)
        if device.get("state") in ("ok", "degraded") and not on_cpu_fallback():
            metrics.set_device_state(str(device["state"]), up=True)
        if stats.guard:
            adaptive_guard.clear()
            adaptive_guard.update(stats.guard)

    client = EngineClient(settings.engine, settings.backend, classifier, on_stats=on_stats,
                          on_failure=on_failure, on_ready=on_ready,
                          on_restart=metrics.engine_restarts.inc)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        client.start()
        try:
            yield
        finally:
            await asyncio.to_thread(client.shutdown)

    app = FastAPI(title="ftrs", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = client
    app.state.metrics = metrics
    app.state.settings = settings
    ctx = ServeContext(client, metrics, settings.model_names, settings.default_max_tokens,
                       settings.max_n, settings.tool_parser, settings.reasoning_parser)
    app.state.ctx = ctx
    install_anthropic(app, ctx, settings.api_key)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes,
                       timeout_s=settings.request_body_timeout_s, api_key=settings.api_key)
    _install_error_handlers(app, metrics)

    async def authorize(request: Request) -> None:  # BodyLimit checked it first; kept per route
        require_key(settings.api_key, request.url.path, request.headers)

    @app.get("/openapi.json", dependencies=[Depends(authorize)], include_in_schema=False)
    async def openapi_document() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", dependencies=[Depends(authorize)], include_in_schema=False)
    async def docs() -> HTMLResponse:
        return HTMLResponse(_swagger_page(app.openapi()))

    @app.get("/health", responses=_HEALTH_503)
    async def health() -> JSONResponse:
        status, body = client.health()
        if client.failure is not None:  # class and message only: evidence may hold a traceback
            body = {**body, "reason": scrub_paths(client.failure.message),
                    "error": public_error(client.failure)}
        if link_guard["decision"] is not None:  # its reasons name crash reports by path
            body = {**body, "link_guard": _scrubbed(link_guard["decision"])}
        if adaptive_guard:
            body = {**body, "adaptive_guard": dict(adaptive_guard)}
        return JSONResponse(body, status_code=status)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> ModelCard:
        max_len = client.info.max_model_len if client.info else None
        return ModelCard(id=settings.model_names[0], max_model_len=max_len)

    @app.get("/v1/models", dependencies=[Depends(authorize)], responses=_pick(401))
    async def models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorize)], responses=_pick(401, 404))
    async def model(model_id: str) -> ModelCard:
        if model_id not in settings.model_names:
            raise ModelNotFound(f"The model `{model_id}` does not exist; this server serves "
                                f"{', '.join(settings.model_names)}", evidence={"param": "model"})
        return model_card()

    @app.post("/v1/completions", dependencies=[Depends(authorize)], response_model=None,
              responses={200: {"model": CompletionResponse}, **_ERRORS})
    async def completions(req: CompletionRequest, request: Request) -> Response:
        run = await start_completion(ctx, req, request)
        return await completion_response(ctx, req, run)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)], response_model=None,
              responses={200: {"model": ChatCompletionResponse}, **_ERRORS})
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        run = await start_chat(ctx, req, request)
        return await chat_response(ctx, req, run)

    install_responses(app, ctx, authorize, _ERRORS)

    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _guard_for(config: EngineConfig, window_s: float) -> dict[str, Any] | None:
    """The startup link guard's decision for `config` (a restarted engine's), or None when it
    makes none or cannot read the model now."""
    from ftrs.guard.startup import apply_link_guard

    try:
        _, decision = apply_link_guard(config, explicit_max_prefill=True, window_s=window_s)
    except FtrsError as err:
        logger.warning("link guard: not re-run for the restarted engine: %s", err.message)
        return None
    return None if decision is None else decision.to_dict()


def _scrubbed(value: Any) -> Any:
    """`value` (JSON) with absolute paths in its strings cut to their last component."""
    if isinstance(value, str):
        return scrub_paths(value)
    if isinstance(value, dict):
        return {k: _scrubbed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_scrubbed(v) for v in value]
    return value


def _pick(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: _ERRORS[s] for s in statuses}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, with validation errors documented as the 400 they really are."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for op in path.values():
                responses = op.get("responses", {})
                if responses.pop("422", None) is not None and "400" not in responses:
                    responses["400"] = {
                        "description": "Invalid request (the `param` names the field)",
                        "content": {"application/json": {
                            "schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
                    }
        components = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def _swagger_page(spec: dict[str, Any]) -> str:
    """Swagger UI with the document inlined, so the page needs no second authorized fetch."""
    inline = json.dumps(spec).replace("</", "<\\/")
    return f"""<!doctype html><html><head><title>ftrs API</title>
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({{spec: {inline}, dom_id: "#swagger-ui"}});</script></body></html>"""


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def answer(request: Request, err: FtrsError) -> JSONResponse:
        if request.method == "POST" and request.url.path.startswith("/v1/"):
            metrics.request_failed(err.http_status)
        return error_response(err)

    @app.exception_handler(FtrsError)
    async def ftrs_error(request: Request, exc: FtrsError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def refused_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def refused_request(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return answer(request, http_error(exc))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error: %s", exc)
        return answer(request, FtrsError(f"internal server error: {type(exc).__name__}"))


__all__ = ["ServeSettings", "create_app"]
