"""OpenAI's Responses API (`POST /v1/responses`) over the shared generation path.

A translator at both ends of `serving.start_chat`, as the Anthropic adapter is:
`responses_api_protocol.to_chat` makes the chat request, and `ItemEncoder` turns the run's
`ChoiceEvent`s into output items, one open at a time: reasoning → a `reasoning` item (its text
as one `reasoning_text` part), text → an assistant `message` item (one `output_text` part), each
tool call → a `function_call` item whose `arguments` arrive as deltas. The same encoder builds
the streamed events (`response.created`, `response.in_progress`, the items' `added`/`delta`/
`done` events, then `response.completed`, or `response.incomplete` when `max_output_tokens`
ran out; every event numbered by `sequence_number`) and the non-stream body, so the two agree:
the body, and the response of the stream's last event, keep only the calls the parser
completed (a call it found malformed, or one the limit cut, was streamed as an item but is not
in them). Errors are the OpenAI routes' (`{"error":
...}`), a field named as in the Responses request; an error after the stream started is an
`error` event, then `response.failed`. `usage.output_tokens_details.reasoning_tokens` counts the
tokens of the steps that produced reasoning and nothing else (a step's tokens are not split).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from ftrs.server.errors import as_ftrs_error, error_body
from ftrs.server.responses_api_protocol import ResponsesRequest, Translation, to_chat
from ftrs.server.serving import ChatRun, ChoiceEvent, ServeContext, start_adapted


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ItemEncoder:
    """One choice's `ChoiceEvent`s as output-item events; `output` is the items so far."""

    def __init__(self, sealed: bool = False) -> None:
        self.sealed = sealed  # reasoning items carry their text as `encrypted_content` too
        self.output: list[dict[str, Any]] = []
        self.reasoning_tokens = 0
        self._kind: str | None = None  # "reasoning" | "message" | "function_call" (open item)
        self._call: int | None = None  # the open function_call's call index

    def feed(self, e: ChoiceEvent) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if e.reasoning and not (e.text or e.tool_calls):
            self.reasoning_tokens += len(e.token_ids)
        if e.reasoning:
            out += self._open("reasoning", {"type": "reasoning", "id": _id("rs"), "summary": [],
                                            "content": [], "status": "in_progress"},
                              {"type": "reasoning_text", "text": ""})
            out.append(self._text_delta("response.reasoning_text.delta", e.reasoning))
        if e.text:
            out += self._open("message", {"type": "message", "id": _id("msg"), "role": "assistant",
                                          "status": "in_progress", "content": []},
                              {"type": "output_text", "text": "", "annotations": []})
            out.append(self._text_delta("response.output_text.delta", e.text) | {"logprobs": []})
        for call in e.tool_calls:
            if self._kind != "function_call" or call.index != self._call:
                out += self._open("function_call", {
                    "type": "function_call", "id": _id("fc"), "call_id": call.id or _id("call"),
                    "name": call.name or "", "arguments": "", "status": "in_progress"}, None,
                    force=True)
                self._call = call.index
            if call.arguments:
                item = self.output[-1]
                item["arguments"] += call.arguments
                out.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                            "output_index": len(self.output) - 1, "delta": call.arguments})
        return out

    def close(self, cut: bool = False) -> list[dict[str, Any]]:
        """Close the open item (at the end of the choice, or when another opens). `cut`: the
        choice ended at `max_output_tokens`, so the item it was writing is `incomplete`."""
        if self._kind is None:
            return []
        item, index = self.output[-1], len(self.output) - 1
        where = {"item_id": item["id"], "output_index": index}
        out: list[dict[str, Any]] = []
        if self._kind == "function_call":
            out.append({"type": "response.function_call_arguments.done", **where,
                        "name": item["name"], "arguments": item["arguments"]})
        else:
            part = item["content"][-1]
            done = "response.reasoning_text.done" if self._kind == "reasoning" \
                else "response.output_text.done"
            extra: dict[str, Any] = {} if self._kind == "reasoning" else {"logprobs": []}
            out.append({"type": done, **where, "content_index": 0, "text": part["text"], **extra})
            out.append({"type": "response.content_part.done", **where, "content_index": 0,
                        "part": dict(part)})
        item["status"] = "incomplete" if cut else "completed"
        if self._kind == "reasoning" and self.sealed:
            item["encrypted_content"] = item["content"][-1]["text"]
        out.append({"type": "response.output_item.done", "output_index": index,
                    "item": json.loads(json.dumps(item))})
        self._kind, self._call = None, None
        return out

    def keep_calls(self, calls: list[Any]) -> None:
        """Keep the function_call items of the complete calls (`toolcalls.ToolCall`), with the
        parsed arguments; a call the parser found malformed came back as text."""
        complete = {c.id: c for c in calls}
        self.output = [i for i in self.output
                       if i["type"] != "function_call" or i["call_id"] in complete]
        for item in self.output:
            if item["type"] == "function_call":
                item["arguments"] = complete[item["call_id"]].arguments

    def _open(self, kind: str, item: dict[str, Any], part: dict[str, Any] | None,
              force: bool = False) -> list[dict[str, Any]]:
        if self._kind == kind and not force:
            return []
        out = self.close()
        self.output.append(item)
        self._kind = kind
        index = len(self.output) - 1
        out.append({"type": "response.output_item.added", "output_index": index,
                    "item": json.loads(json.dumps(item))})
        if part is not None:
            item["content"].append(part)
            out.append({"type": "response.content_part.added", "item_id": item["id"],
                        "output_index": index, "content_index": 0, "part": dict(part)})
        return out

    def _text_delta(self, kind: str, text: str) -> dict[str, Any]:
        item = self.output[-1]
        item["content"][-1]["text"] += text
        return {"type": kind, "item_id": item["id"], "output_index": len(self.output) - 1,
                "content_index": 0, "delta": text}


def _response(resp_id: str, req: ResponsesRequest, tr: Translation, created: int,
              status: str, output: list[dict[str, Any]], run: ChatRun | None = None,
              reasoning_tokens: int = 0, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The response object (`status`: in_progress, completed, incomplete or failed)."""
    chat = tr.chat
    body: dict[str, Any] = {
        "id": resp_id, "object": "response", "created_at": created, "status": status,
        "error": error, "model": req.model, "output": output,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {}, "parallel_tool_calls": chat.parallel_tool_calls is not False,
        "previous_response_id": None, "store": False, "temperature": req.temperature,
        "top_p": req.top_p, "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
        "truncation": "disabled", "usage": None,
    }
    if run is not None and status != "in_progress":
        u = run.usage()
        cached = (u.prompt_tokens_details or {}).get("cached_tokens", 0)
        body["usage"] = {"input_tokens": u.prompt_tokens,
                         "input_tokens_details": {"cached_tokens": cached},
                         "output_tokens": u.completion_tokens,
                         "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                         "total_tokens": u.total_tokens}
    return body


def install_responses(app: FastAPI, ctx: ServeContext,
                      authorize: Callable[[Request], Coroutine[Any, Any, None]],
                      errors: dict[int | str, dict[str, Any]]) -> None:
    """Register `POST /v1/responses` on `app`, behind the OpenAI routes' `authorize`."""

    @app.post("/v1/responses", dependencies=[Depends(authorize)], response_model=None,
              responses=errors)
    async def responses(req: ResponsesRequest, request: Request) -> Response:
        tr = to_chat(req)
        run, events = await start_adapted(ctx, tr.chat, request, "resp", tr.rename)
        resp_id = "resp_" + run.request_id.removeprefix("resp-")
        created = run.created  # whole seconds, as OpenAI writes `created_at`
        if req.stream:
            return _stream(ctx, req, tr, run, events, resp_id, created)
        items = ItemEncoder(_sealed(req))
        async for e in events:
            items.feed(e)
        status = "incomplete" if run.finish_reason(0) == "length" else "completed"
        items.close(cut=status == "incomplete")
        items.keep_calls(run.calls(0))
        body = _response(resp_id, req, tr, created, status, items.output, run, items.reasoning_tokens)
        return Response(json.dumps(body, ensure_ascii=False), media_type="application/json")


def _sealed(req: ResponsesRequest) -> bool:
    return "reasoning.encrypted_content" in (req.include or [])


def _sse(event: dict[str, Any], seq: list[int]) -> str:
    event["sequence_number"] = seq[0]
    seq[0] += 1
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def _stream(ctx: ServeContext, req: ResponsesRequest, tr: Translation, run: ChatRun,
            events: AsyncIterator[ChoiceEvent], resp_id: str, created: int) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        seq = [0]
        items = ItemEncoder(_sealed(req))
        try:
            start = _response(resp_id, req, tr, created, "in_progress", [])
            yield _sse({"type": "response.created", "response": start}, seq)
            yield _sse({"type": "response.in_progress", "response": start}, seq)
            async for e in events:
                for event in items.feed(e):
                    yield _sse(event, seq)
        except Exception as exc:
            err = as_ftrs_error(exc)
            ctx.metrics.request_failed(err.http_status)
            detail = error_body(err)["error"]
            yield _sse({"type": "error", "code": detail["code"], "message": detail["message"],
                        "param": detail["param"]}, seq)
            failed = _response(resp_id, req, tr, created, "failed", items.output, run,
                               items.reasoning_tokens,
                               error={"code": detail["code"], "message": detail["message"]})
            yield _sse({"type": "response.failed", "response": failed}, seq)
            return
        status = "incomplete" if run.finish_reason(0) == "length" else "completed"
        for event in items.close(cut=status == "incomplete"):
            yield _sse(event, seq)
        items.keep_calls(run.calls(0))  # the final response is the non-stream body
        final = _response(resp_id, req, tr, created, status, items.output, run,
                          items.reasoning_tokens)
        yield _sse({"type": f"response.{status}", "response": final}, seq)

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


__all__ = ["ItemEncoder", "install_responses"]
