"""From an OpenAI request to what the engine runs: prompt ids and `SamplingParams`.

`prepare_completion` and `prepare_chat` turn a validated request into a `Plan` (one prompt, one
`SamplingParams` per choice), raising typed errors for what the protocol allows but ftrs refuses,
each naming its field as `messages[0].content`. They tokenize and render the chat template, so
they run in a worker thread, never on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ftrs.errors import ContextLengthExceeded, FtrsError, InvalidRequest
from ftrs.sampling import SEED_MAX, SamplingParams
from ftrs.server.errors import ModelNotFound
from ftrs.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields


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


@dataclass(frozen=True)
class Plan:
    """One request as the engine runs it: one prompt, one `SamplingParams` per choice."""

    prompt_ids: list[int]
    params: tuple[SamplingParams, ...]


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
        logit_bias=_logit_bias(req),
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
        ids = list(_require_tokenizer(tokenizer, param).encode(prompt, add_special_tokens=True))
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


def render_chat(req: ChatCompletionRequest, tokenizer: Any) -> list[int]:
    """The prompt ids of a chat request: its messages through the model's chat template."""
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
    return list(tokenizer.encode(text, add_special_tokens=False))


def prepare_chat(req: ChatCompletionRequest, tokenizer: Any, limits: Limits) -> Plan:
    """The plan of a chat request. Without `max_tokens`/`max_completion_tokens` the request may
    generate `limits.default_max_tokens`, or what is left of the context if less."""
    _common_checks(req, limits)
    _unsupported_chat_fields(req)
    ids = render_chat(req, tokenizer)
    if req.top_logprobs is not None and not req.logprobs:
        raise _bad("top_logprobs", "requires logprobs to be true")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise _bad("top_logprobs", f"must be in [0, 20], got {req.top_logprobs}")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if requested is None:
        max_tokens = max(min(limits.default_max_tokens, limits.max_model_len - len(ids)), 1)
    else:
        max_tokens = requested
    params = _params(req, max_tokens, logprobs, limits.vocab_size)
    _check_context(len(ids), max_tokens, limits.max_model_len, "messages")
    return Plan(ids, _choices(req, params))


__all__ = ["Limits", "Plan", "check_model", "choice_seed", "prepare_chat", "prepare_completion", "render_chat"]
