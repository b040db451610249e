"""From an OpenAI request to what the engine runs: prompt ids and `SamplingParams`.

`prepare_completion` and `prepare_chat` turn a validated request into a `Plan` (one prompt, one
`SamplingParams` per choice), raising typed errors for what the protocol allows but ftrs refuses,
each naming its field as `messages[0].content`. They tokenize and render the chat template, so
they run in a worker thread, never on the event loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from ftrs.errors import ContextLengthExceeded, FtrsError, InvalidRequest
from ftrs.sampling import SEED_MAX, ReasoningBudget, SamplingParams, StructuredSpec
from ftrs.server.errors import ModelNotFound
from ftrs.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    MessageToolCall,
    _SamplingFields,
    lone_surrogate_at,
)
from ftrs.server.reasoning import (
    CLOSE,
    OPEN,
    choose_reasoning_parser,
    opens_reasoning,
)
from ftrs.server.structured import check_grammar, check_tool_schemas, structured_spec
from ftrs.server.toolcalls import choose_tool_parser


def _bad(param: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {why}", evidence={"param": param})


def _require_tokenizer(tokenizer: Any, param: str) -> Any:
    if tokenizer is None:
        raise _bad(param, "this model has no tokenizer: send token ids to /v1/completions")
    return tokenizer


@dataclass(frozen=True)
class Limits:
    """What a request may ask for on this server: the engine's sizes and the serve options."""

    vocab_size: int
    max_model_len: int
    default_max_tokens: int  # of a chat request without max_tokens
    max_n: int = 1
    tool_parser: str | None = None  # `--tool-parser`; None: chosen from the chat template
    reasoning_parser: str | None = None  # `--reasoning-parser`; None: chosen from the template


@dataclass(frozen=True)
class Plan:
    """One request as the engine runs it: one prompt, one `SamplingParams` per choice."""

    prompt_ids: list[int]
    params: tuple[SamplingParams, ...]
    tools: list[dict[str, Any]] | None = None  # read tool calls from the output with these
    tool_parser: str | None = None  # TOOL_PARSERS key (with `tools`)
    parallel_tool_calls: bool = True  # false: only the first call counts
    reasoning_parser: str | None = None  # REASONING_PARSERS key
    starts_in_reasoning: bool | None = None  # the prompt opened `<think>`; None: the parser's default


def check_model(req: _SamplingFields, served: tuple[str, ...]) -> None:
    if req.model not in served:
        raise ModelNotFound(
            f"The model `{req.model}` does not exist; this server serves {', '.join(served)}",
            evidence={"param": "model"},
        )


def _common_checks(req: _SamplingFields, limits: Limits) -> None:
    if req.n is not None and not 1 <= req.n <= limits.max_n:
        raise _bad("n", f"must be in [1, {limits.max_n}] (the server's --max-n), got {req.n}")
    if req.stream_options is not None and not req.stream:
        raise _bad("stream_options", "only allowed when stream is true")


def _logit_bias(req: _SamplingFields) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` map as (id, bias) pairs; ranges are checked by
    `SamplingParams.validate` (ids below the vocabulary, bias in [-100, 100])."""
    pairs: list[tuple[int, float]] = []
    for key, bias in (req.logit_bias or {}).items():
        try:
            tok = int(key)
        except ValueError:
            raise _bad("logit_bias", f"keys must be token ids, got {key!r}") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise _bad("logit_bias", f"the bias of token {key} must be a number, got {bias!r}")
        pairs.append((tok, float(bias)))
    return tuple(pairs)


def _unsupported_chat_fields(req: ChatCompletionRequest) -> None:
    """Fields that would change the output but are not served: a 400 naming the field."""
    if req.functions:
        raise _bad("functions", "the deprecated `functions` are not supported: send `tools`")
    if req.function_call not in (None, "none"):
        raise _bad("function_call", "the deprecated `function_call` is not supported: send `tool_choice`")
    if req.audio is not None:
        raise _bad("audio", "audio output is not supported")
    if req.modalities not in (None, [], ["text"]):
        raise _bad("modalities", 'only ["text"] is supported')


def _params(req: _SamplingFields, max_tokens: int, logprobs: int | None, vocab: int,
            structured: StructuredSpec | None = None) -> SamplingParams:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if isinstance(req.stop, list):  # named by its index, as the request holds it
        for i, s in enumerate(req.stop):
            if not s:
                raise _bad(f"stop[{i}]", "a stop string must not be empty")
    params = SamplingParams(
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
        logit_bias=_logit_bias(req),
        structured=structured,
    )
    try:
        return params.validate(vocab)
    except InvalidRequest as e:  # max_tokens came from max_completion_tokens: name that
        if (e.evidence.get("param") != "max_tokens"
                or getattr(req, "max_completion_tokens", None) is None):
            raise
        raise _bad("max_completion_tokens", e.message.split(": ", 1)[-1]) from None


def _too_long(max_model_len: int, has: str, param: str, **evidence: int) -> ContextLengthExceeded:
    return ContextLengthExceeded(
        f"This model's maximum context length is {max_model_len} tokens; the prompt has {has}",
        evidence={"param": param, **evidence, "max_model_len": max_model_len})


def _check_context(prompt_len: int, max_tokens: int, max_model_len: int, prompt_param: str) -> None:
    if prompt_len == 0:
        raise _bad("prompt", "the prompt is empty")
    if prompt_len >= max_model_len:
        raise _too_long(max_model_len, f"{prompt_len} tokens", prompt_param, prompt_tokens=prompt_len)
    if prompt_len + max_tokens > max_model_len:
        raise _too_long(max_model_len, f"{prompt_len} tokens and max_tokens is {max_tokens}",
                        "max_tokens", prompt_tokens=prompt_len)


def check_fits(text: str, tokenizer: Any, max_model_len: int, param: str) -> None:
    """Refuse, untokenized, a text that is more than `max_model_len` tokens whatever it holds:
    longer than that many of the tokenizer's longest tokens (`max_chars_per_token`). The same
    400 as `_check_context`'s, saying how many tokens the prompt has at least."""
    per_token = getattr(tokenizer, "max_chars_per_token", None)
    if per_token is None or len(text) <= max_model_len * per_token:
        return
    least = -(-len(text) // per_token)  # > max_model_len
    raise _too_long(max_model_len, f"at least {least} tokens", param, prompt_tokens_at_least=least)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded with `seed`: seed + index, or, past the
    top of the seed range, seed - index (still distinct from every seed + j with j < index)."""
    return seed + index if seed + index <= SEED_MAX else seed - index


def _choices(req: _SamplingFields, params: SamplingParams) -> tuple[SamplingParams, ...]:
    """One `SamplingParams` per choice: choice i of a seeded request gets `choice_seed(seed, i)`;
    unseeded choices each draw their own randomness in the engine."""
    n = req.n or 1
    if params.seed is None:
        return (params,) * n
    return tuple(replace(params, seed=choice_seed(params.seed, i)) for i in range(n))


def prepare_completion(req: CompletionRequest, tokenizer: Any, limits: Limits) -> Plan:
    """The plan of a /v1/completions request; `max_tokens` defaults to 16 (OpenAI)."""
    _common_checks(req, limits)
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
        check_fits(prompt, _require_tokenizer(tokenizer, param), limits.max_model_len, "prompt")
        ids = list(tokenizer.encode(prompt, add_special_tokens=True))
    else:
        ids = [int(t) for t in prompt]
        if any(not 0 <= t < limits.vocab_size for t in ids):
            raise _bad(param, f"token ids must be in [0, {limits.vocab_size})")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise _bad("logprobs", f"must be in [0, 20], got {req.logprobs}")
    params = _params(req, max_tokens, req.logprobs, limits.vocab_size)
    _check_context(len(ids), max_tokens, limits.max_model_len, "prompt")
    return Plan(ids, _choices(req, params))


_RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token",
                                     "eos_token"})


@dataclass(frozen=True)
class ChatSetup:
    """How a chat request is rendered and how its output is read."""

    tools: list[dict[str, Any]] | None  # given to the template and the tool parser; None: no tools
    tool_choice: str | dict[str, Any]  # "none" | "auto" | "required" | a named function
    parallel: bool  # parallel_tool_calls
    tool_parser: str | None  # TOOL_PARSERS key when tools are read from the output
    reasoning_parser: str | None  # REASONING_PARSERS key, or None
    template_kwargs: dict[str, Any]


def chat_setup(req: ChatCompletionRequest, tokenizer: Any, options: Limits) -> ChatSetup:
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    check_tool_schemas(tools, tokenizer)  # each one's parameters a compilable object schema
    choice: str | dict[str, Any]
    if req.tool_choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(req.tool_choice, str):
        choice = req.tool_choice
    else:
        choice = req.tool_choice.model_dump()
    if choice != "none" and not tools:
        raise _bad("tool_choice", f"{json.dumps(choice)} needs `tools`")
    if isinstance(choice, dict) and choice["function"]["name"] not in {t["function"]["name"] for t in tools}:
        raise _bad("tool_choice", f"no tool is named {choice['function']['name']!r}")
    use_tools = choice != "none"
    # the template the prompt is rendered with: a checkpoint's `tool_use` one when tools are
    # offered or the history holds calls and results (it then tells the tool format)
    turns = any(m.tool_calls or m.role == "tool" for m in req.messages)
    template_for = getattr(tokenizer, "template_for", None)
    template = (template_for(use_tools or turns) if template_for is not None
                else getattr(tokenizer, "chat_template", None))
    kwargs = dict(req.chat_template_kwargs or {})
    clash = sorted(_RESERVED_TEMPLATE_VARS & set(kwargs))
    if clash:
        raise _bad("chat_template_kwargs", f"may not set {', '.join(clash)}")
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    return ChatSetup(
        tools=tools if use_tools else None,
        tool_choice=choice,
        parallel=req.parallel_tool_calls is not False,
        tool_parser=choose_tool_parser(options.tool_parser, template) if use_tools else None,
        reasoning_parser=choose_reasoning_parser(options.reasoning_parser, template),
        template_kwargs=kwargs,
    )


def _template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as chat templates take them (OpenAI shape, arguments as objects)."""
    messages: list[dict[str, Any]] = []
    known: set[str] = set()  # the ids of the calls of the assistant turns so far
    unanswered: set[str] = set()  # ... and those no tool message has answered yet
    for i, m in enumerate(req.messages):
        if m.has_non_text_parts():
            raise _bad(f"messages[{i}].content", "only text content parts are supported")
        # `developer` is OpenAI's newer name for `system`; chat templates know only the latter.
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": m.text()}
        if m.tool_calls:
            if role != "assistant":
                raise _bad(f"messages[{i}].tool_calls", "only assistant messages carry tool calls")
            msg["tool_calls"] = [_history_call(i, j, c) for j, c in enumerate(m.tool_calls)]
            turn: set[str] = set()
            for j, c in enumerate(msg["tool_calls"]):
                if c["id"] in turn:  # its results could not say which call they answer
                    raise _bad(f"messages[{i}].tool_calls[{j}].id",
                               f"tool call ids must be unique in a turn: {c['id']!r} is used before")
                turn.add(c["id"])
            known |= turn
            unanswered |= turn  # an id reused by a later turn (call_0 each turn) opens again
        if role == "assistant" and m.reasoning_content:
            # An earlier turn's reasoning, for templates that show it again in a tool loop:
            # Qwen3, GLM-4.5 and MiniMax-M2 read `reasoning_content`; gpt-oss reads `thinking`
            # and refuses it beside content on a turn with calls (it takes the content then).
            msg["reasoning_content"] = m.reasoning_content
            if not (m.tool_calls and msg["content"]):
                msg["thinking"] = m.reasoning_content
        if role != "tool" and m.tool_call_id is not None:
            raise _bad(f"messages[{i}].tool_call_id", "only tool messages carry a tool_call_id")
        if role == "tool":  # a result answers a call of an earlier turn, as OpenAI requires
            if m.tool_call_id is None:
                raise _bad(f"messages[{i}].tool_call_id", "required in a tool message")
            if m.tool_call_id not in known:
                raise _bad(f"messages[{i}].tool_call_id",
                           f"no earlier assistant tool call has the id {m.tool_call_id!r}")
            if m.tool_call_id not in unanswered:
                raise _bad(f"messages[{i}].tool_call_id",
                           f"the tool call {m.tool_call_id!r} has a result before")
            unanswered.discard(m.tool_call_id)
            msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
        messages.append(msg)
    return messages


def _history_call(i: int, j: int, call: MessageToolCall) -> dict[str, Any]:
    args: Any = call.function.arguments
    param = f"messages[{i}].tool_calls[{j}].function.arguments"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as exc:
            raise _bad(param, f"not valid JSON: {exc}") from None
        except RecursionError:  # nested deeper than the decoder's stack
            raise _bad(param, "not valid JSON: nested too deeply") from None
    if not isinstance(args, dict):
        raise _bad(param, "must be a JSON object")
    where = lone_surrogate_at(args)
    if where is not None:  # JSON text's escapes can carry one the request's own check missed
        raise _bad(param, f"invalid Unicode: a lone surrogate in {where}")
    return {"id": call.id or f"call_{i}_{j}", "type": "function",
            "function": {"name": call.function.name, "arguments": args}}


def render_chat(req: ChatCompletionRequest, tokenizer: Any, options: Limits,
                setup: ChatSetup | None = None, fit: bool = False) -> tuple[list[int], str]:
    """The prompt (ids, text) of a chat request: its messages, tools and `chat_template_kwargs`
    through the model's chat template; with `fit`, a text that cannot fit the context is refused
    before it is tokenized (`check_fits`)."""
    _require_tokenizer(tokenizer, "messages")
    setup = setup or chat_setup(req, tokenizer, options)
    messages = _template_messages(req)
    extra: dict[str, Any] = dict(setup.template_kwargs)
    if setup.tools is not None:
        extra["tools"] = setup.tools
    if options.tool_parser is not None and getattr(tokenizer, "tool_parser", None) != options.tool_parser:
        # The format a template without tools is taught them in (models/tokenizer.py).
        tokenizer.tool_parser = options.tool_parser
    prefill = _final_prefill(req, messages)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=prefill is None,
                                             **extra)
    except FtrsError:
        raise
    except Exception as exc:  # a template error is the request's fault (roles, order)
        raise _bad("messages", f"chat template failed: {exc}") from exc
    if prefill is not None:
        # the prompt ends where the final assistant text ends (its end-of-turn cut off)
        at = text.rfind(prefill)
        if at < 0:
            raise _bad("continue_final_message", "the chat template does not render the final "
                       "assistant message as sent, so it cannot be continued")
        text = text[:at + len(prefill)]
    if fit:
        check_fits(text, tokenizer, options.max_model_len, "messages")
    return list(tokenizer.encode(text, add_special_tokens=False)), text


def _final_prefill(req: ChatCompletionRequest, messages: list[dict[str, Any]]) -> str | None:
    """With `continue_final_message`: the final assistant message's text (trailing whitespace
    off, as templates strip it), which the output continues; None otherwise."""
    if not req.continue_final_message:
        return None
    last = messages[-1]
    if last["role"] != "assistant" or last.get("tool_calls"):
        raise _bad("continue_final_message", "the last message must be an assistant message "
                   "with text and no tool calls")
    text = str(last.get("content") or "").rstrip()
    if not text:
        raise _bad("continue_final_message", "the final assistant message has no text")
    return text


def prepare_chat(req: ChatCompletionRequest, tokenizer: Any, options: Limits) -> Plan:
    """The plan of a chat request. Without `max_tokens`/`max_completion_tokens` the request may
    generate `options.default_max_tokens`, or what is left of the context if less."""
    _common_checks(req, options)
    _unsupported_chat_fields(req)
    _require_tokenizer(tokenizer, "messages")
    setup = chat_setup(req, tokenizer, options)
    ids, text = render_chat(req, tokenizer, options, setup, fit=True)
    if req.top_logprobs is not None and not req.logprobs:
        raise _bad("top_logprobs", "requires logprobs to be true")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise _bad("top_logprobs", f"must be in [0, 20], got {req.top_logprobs}")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if requested is None:
        max_tokens = max(min(options.default_max_tokens, options.max_model_len - len(ids)), 1)
    else:
        max_tokens = requested
    structured = structured_spec(req, setup, tokenizer, text)
    params = _params(req, max_tokens, logprobs, options.vocab_size, structured)
    _check_context(len(ids), max_tokens, options.max_model_len, "messages")
    if structured is not None:
        check_grammar(structured, tokenizer, setup)
    # A grammar governs the whole output: none of it is reasoning, unless it leads with some.
    reasoning = setup.reasoning_parser if structured is None or structured.lead else None
    opened = bool(reasoning) and opens_reasoning(text)
    budget = _reasoning_budget(req.thinking_token_budget, reasoning, tokenizer, opened)
    if budget is not None:
        params = replace(params, reasoning_budget=budget)
    return Plan(ids, _choices(req, params), tools=setup.tools, tool_parser=setup.tool_parser,
                parallel_tool_calls=setup.parallel, reasoning_parser=reasoning,
                starts_in_reasoning=True if opened else None)


def _reasoning_budget(tokens: int | None, parser: str | None, tokenizer: Any,
                      opened: bool) -> ReasoningBudget | None:
    """`thinking_token_budget` as the engine enforces it: for the `<think>` parsers, when both
    tags are single tokens of the vocabulary; None otherwise (nothing to enforce it on: a model
    without reasoning, or gpt-oss's harmony channels, whose length `reasoning_effort` sets)."""
    tk = getattr(tokenizer, "tk", None)
    if tokens is None or parser not in ("qwen3", "deepseek_r1") or tk is None:
        return None
    open_id, close_id = tk.token_to_id(OPEN), tk.token_to_id(CLOSE)
    if open_id is None or close_id is None:
        return None
    end = tuple(tokenizer.encode(f"\n{CLOSE}\n\n"))  # as the templates close the block
    if close_id not in end:
        return None
    return ReasoningBudget(tokens, open_id, close_id, end, opened)


__all__ = ["ChatSetup", "Limits", "Plan", "chat_setup", "check_fits", "check_model", "choice_seed", "prepare_chat",
           "prepare_completion", "render_chat"]
