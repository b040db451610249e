"""Tokenizer and chat template, from `tokenizer.json`/`tokenizer_config.json` or GGUF metadata.

Built on `tokenizers` and `jinja2` only; transformers is never needed at run time. GGUF files
carry a byte-level BPE vocabulary and merges; the pre-tokenizer follows llama.cpp's `pre` name
(for `smollm`: single digits, then the GPT-2 byte-level split, as the original tokenizer does;
for `llama-bpe`, `qwen2`, `qwen35`, `gpt-4o`, `deepseek-v3`, `glm4` and `minimax-m2`: the split pattern(s) of that
tokenizer's own `tokenizer.json`, then the byte-level mapping); a name it does not know is refused, not guessed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ftrs.errors import InvalidRequest, ModelLoadError
from ftrs.models.token_bound import max_chars_per_token

_CONTROL = 3  # llama.cpp token type of special tokens such as <|im_start|>
_USER_DEFINED = 4  # of added tokens that are text (Qwen3's <think>, <tool_call>): one token each
_STOP_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
              "tokenizer.ggml.eom_token_id")
_HARMONY_STOPS = ("<|return|>", "<|call|>", "<|endoftext|>")

_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")  # digits one by one
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # Qwen2's, with combining marks inside words
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_O200K = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
#: Kimi-K2's (and Moonlight's) tiktoken pattern: o200k's words with the Han ideographs taken
#: out of the letters, a run of them split first
_NOT_HAN = "&&[^\\p{Han}]"
_KIMI_K2 = (r"[\p{Han}]+"
            rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER[:-1]}{_NOT_HAN}]*{_LOWER[:-1]}{_NOT_HAN}]+{_CONTRACTIONS}?"
            rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER[:-1]}{_NOT_HAN}]+{_LOWER[:-1]}{_NOT_HAN}]*{_CONTRACTIONS}?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
#: DeepSeek-V3's three splits, one after the other: digits in threes, runs of CJK ideographs and
#: kana, then words (an ASCII punctuation mark joins the ASCII letters after it)
_DEEPSEEK_V3 = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
#: DeepSeek-LLM's letters (the cased letters of an older Unicode, as its tokenizer lists them),
#: as code point ranges
_DEEPSEEK_LLM_LETTERS = (
    (0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA),
    (0x1BC, 0x1BF), (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x377),
    (0x37B, 0x37D), (0x37F, 0x37F), (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C),
    (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481), (0x48A, 0x52F), (0x531, 0x556),
    (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA), (0x1CBD, 0x1CBF),
    (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15), (0x1F18, 0x1F1D),
    (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B),
    (0x1F5D, 0x1F5D), (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE),
    (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC),
    (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102), (0x2107, 0x2107), (0x210A, 0x2113),
    (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124), (0x2126, 0x2126), (0x2128, 0x2128),
    (0x212A, 0x212D), (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149),
    (0x214E, 0x214E), (0x2183, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE),
    (0x2CF2, 0x2CF3), (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787),
    (0xA78B, 0xA78E), (0xAB70, 0xABBF), (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A),
    (0xFF41, 0xFF5A), (0x10400, 0x1044F), (0x104B0, 0x104D3), (0x104D8, 0x104FB),
    (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF), (0x1E900, 0x1E943))


def _char_class(ranges: tuple[tuple[int, int], ...]) -> str:
    """A regex character class of code point ranges, written as \\x{..} escapes."""
    return "[" + "".join(f"\\x{{{a:x}}}" if a == b else f"\\x{{{a:x}}}-\\x{{{b:x}}}"
                         for a, b in ranges) + "]"


#: DeepSeek-LLM's (V2, V2-Lite, Coder-V2-Lite) six splits, one after the other: newlines,
#: words of its letters, runs of ASCII, full-width and CJK punctuation, trailing whitespace,
#: runs of U+0800..U+9FA5 and Hangul, digits
_DEEPSEEK_LLM = ("[\r\n]", r"\s?" + _char_class(_DEEPSEEK_LLM_LETTERS) + "+",
                 r"\s?[!-/:-~\x{ff01}-\x{ff0f}\x{ff1a}-\x{ff5e}\x{2018}-\x{201f}\x{3000}-\x{3002}]+",
                 r"\s+$", r"[\x{4e00}-\x{9fa5}\x{800}-\x{4e00}\x{ac00}-\x{d7ff}]+", r"\p{N}+")
#: llama.cpp's `tokenizer.ggml.pre` names -> the split pattern(s) of the tokenizer each names
_PRE_SPLIT: dict[str, str | tuple[str, ...]] = {
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2, "qwen35": _QWEN35, "gpt-4o": _O200K, "llama4": _O200K,
    "deepseek-v3": _DEEPSEEK_V3, "deepseek-llm": _DEEPSEEK_LLM, "glm4": _LLAMA3, "chatglm-bpe": _LLAMA3, "minimax-m2": _O200K,
    "kimi-k2": _KIMI_K2}
_GPT2_PRE = (None, "default", "gpt-2", "gpt2")  # ByteLevel's own split


def split_pattern_named(pre: str) -> str:
    """The one split pattern of a `tokenizer.ggml.pre` name (KeyError: none, or several)."""
    pattern = _PRE_SPLIT[pre]
    if not isinstance(pattern, str):
        raise KeyError(pre)
    return pattern


def gguf_pre_tokenizer(pre: str | None, source: str) -> Any:
    """The `tokenizers` pre-tokenizer of a GGUF file's `tokenizer.ggml.pre`."""
    # the byte-level step splits with GPT-2's pattern itself unless a split pattern came first
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _PRE_SPLIT)
    if pre in _GPT2_PRE:
        return byte_level
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _PRE_SPLIT:
        patterns = _PRE_SPLIT[pre]
        splits = [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False)
                  for p in ((patterns,) if isinstance(patterns, str) else patterns)]
        return pre_tokenizers.Sequence([*splits, byte_level])
    known = sorted(k for k in (*_PRE_SPLIT, "smollm", *_GPT2_PRE) if k)
    raise ModelLoadError(source, f"unsupported GGUF pre-tokenizer {pre!r} "
                         f"(supported: {', '.join(known)})")


# Names the renderer sets itself; `chat_template_kwargs` may not override them.
_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def _raise(message: str) -> None:
    raise InvalidRequest(f"chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Templates are written for this `tojson` (plain json.dumps, non-ASCII kept), not for
    jinja's HTML-safe one that escapes `<`, `>`, `&` and `'`."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _text(content: Any) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _bad_message(param: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {why}", evidence={"param": param})


def _with_dict_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `messages` whose tool calls carry their arguments as a dict (templates write
    them with `tojson`; some test `is string` first, which a dict passes too). Arguments given
    as JSON text must be a JSON object."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for j, call in enumerate(calls):
                fn = dict(call.get("function") or {})
                param = f"messages[{i}].tool_calls[{j}].function.arguments"
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError as e:
                        raise _bad_message(param, f"not valid JSON ({e})") from None
                elif args is None:
                    args = {}
                if not isinstance(args, dict):
                    raise _bad_message(param, "must be a JSON object")
                fn["arguments"] = args
                fixed.append({**call, "function": fn})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def gguf_stop_ids(meta: dict[str, Any], vocab: dict[str, int]) -> list[int]:
    """The ids that end a generation of a GGUF file's model: its EOS, end-of-turn and
    end-of-message tokens; for a harmony vocabulary (gpt-oss) `<|return|>`, `<|call|>` and
    `<|endoftext|>`, as its checkpoint's generation config lists them (a GGUF names only one
    EOS), and never `<|end|>`, which closes a message within the answer."""
    ids = {meta[k] for k in _STOP_KEYS if isinstance(meta.get(k), int)}
    if all(t in vocab for t in _HARMONY_STOPS):
        ids = (ids | {vocab[t] for t in _HARMONY_STOPS}) - {vocab.get("<|end|>")}
    return sorted(ids)


def _dir_templates(model_dir: Path, conf_template: Any) -> tuple[str | None, dict[str, str]]:
    """A checkpoint directory's chat templates, (default, {name: text}), from wherever
    transformers keeps them: `tokenizer_config.json`'s `chat_template` (one text, or a list of
    named ones), else `chat_template.jinja` (or `chat_template.json`) and the named ones in
    `additional_chat_templates/NAME.jinja`."""
    named: dict[str, str] = {}
    default: str | None = None
    if isinstance(conf_template, list):
        named = {t["name"]: t["template"] for t in conf_template
                 if isinstance(t, dict) and isinstance(t.get("template"), str)}
        default = named.pop("default", None)
    elif isinstance(conf_template, str):
        default = conf_template
    if default is None and (model_dir / "chat_template.jinja").is_file():
        default = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    elif default is None and (model_dir / "chat_template.json").is_file():
        found = json.loads((model_dir / "chat_template.json").read_text(encoding="utf-8"))
        default = found.get("chat_template") if isinstance(found, dict) else None
    extra = model_dir / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            named.setdefault(f.name.removesuffix(".jinja"), f.read_text(encoding="utf-8"))
    return default, named


class Tokenizer:
    """Encode, decode, and render chat messages into a prompt."""

    def __init__(self, tk: HFTokenizer, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None, eos_token_ids: Sequence[int], add_bos: bool = False,
                 named_templates: Mapping[str, str] | None = None) -> None:
        self.tk = tk
        self.chat_template = chat_template
        #: the checkpoint's further templates by name (`tool_use`, `rag`, ...) beside the
        #: default one; `tool_use` renders the requests that offer tools or carry tool turns
        self.named_templates = dict(named_templates or {})
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self.add_bos = add_bos
        self.bos_token_id = tk.token_to_id(bos_token) if bos_token else None
        #: no token stands for more characters of a text than this; None: no bound holds
        self.max_chars_per_token = max_chars_per_token(tk)
        #: the tool-call format (a `ftrs.server.toolcalls` parser name) that a template without
        #: tools is taught in a system message; None: the one the template suggests.
        self.tool_parser: str | None = None
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        # every template compiled now, so a broken one fails the load and not a request;
        # each with whether it renders `tools` itself (real tool-calling templates do)
        self._templates: dict[str | None, tuple[jinja2.Template, bool]] = {
            name: (env.from_string(text),
                   "tools" in jinja2.meta.find_undeclared_variables(env.parse(text)))
            for name, text in ((None, chat_template), *self.named_templates.items()) if text}
        self.template_knows_tools = None in self._templates and self._templates[None][1]

    def template_for(self, tools: bool) -> str | None:
        """The text of the template a request is rendered with: the checkpoint's `tool_use`
        one when the request offers tools (or its messages carry calls and results) and the
        checkpoint has one, else the default; None when there is none."""
        name = "tool_use" if tools and "tool_use" in self.named_templates else None
        return self.named_templates[name] if name else self.chat_template

    @property
    def vocab_size(self) -> int:
        return int(self.tk.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # `encode` holds the GIL throughout (seconds for a megabyte); a batch of one releases it
        batch = getattr(self.tk, "encode_batch_fast", self.tk.encode_batch)
        ids = batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return list(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True,
               keep: frozenset[int] = frozenset()) -> str:
        """Text of `ids`; with `skip_special_tokens`, special tokens are dropped except those in
        `keep` (a tool parser's tags such as Mistral's `[TOOL_CALLS]`), which stay as their text."""
        ids = list(ids)
        if not skip_special_tokens or not keep.intersection(ids):
            return str(self.tk.decode(ids, skip_special_tokens=skip_special_tokens))
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in keep:
                out.append(str(self.tk.decode(run, skip_special_tokens=True)) if run else "")
                out.append(str(self.tk.decode([i], skip_special_tokens=False)))
                run = []
            else:
                run.append(i)
        if run:
            out.append(str(self.tk.decode(run, skip_special_tokens=True)))
        return "".join(out)

    def special_ids(self, texts: Sequence[str]) -> frozenset[int]:
        """The ids of those of `texts` that are single special tokens of this vocabulary."""
        found = set()
        for t in texts:
            i = self.tk.token_to_id(t)
            if i is not None and str(self.tk.decode([i], skip_special_tokens=True)) == "":
                found.add(int(i))
        return frozenset(found)

    def apply_chat_template(self, messages: list[dict[str, Any]], /,
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            **template_kwargs: Any) -> str:
        """The prompt text of `messages` (OpenAI-shaped dicts: assistant `tool_calls` with
        arguments as JSON text or a dict, `role: "tool"` results) offering `tools` (OpenAI tool
        dicts); `template_kwargs` are further template variables (`enable_thinking`, ...).
        A template that does not render `tools` gets them, the calls and the results written in
        the `tool_parser` format into the messages (`_inline_tools`)."""
        clash = sorted(_RESERVED & template_kwargs.keys())
        if clash:
            raise _bad_message("chat_template_kwargs", f"may not set {', '.join(clash)}")
        turns = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
        name = "tool_use" if (tools or turns) and "tool_use" in self._templates else None
        if name not in self._templates:
            known = ", ".join(sorted(str(k) for k in self._templates))
            raise InvalidRequest("this model has no chat template; use /v1/completions" if not known
                                 else f"this model has no default chat template (it has {known})")
        template, knows_tools = self._templates[name]
        messages = _with_dict_arguments(messages)
        if not knows_tools:
            messages = self._inline_tools(messages, tools or [])
        try:
            return str(template.render(
                **template_kwargs, messages=messages, tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or ""))
        except (jinja2.TemplateError, TypeError) as e:  # TypeError: a value of another type
            raise InvalidRequest(f"chat template failed: {e}") from e

    def _inline_tools(self, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """For a template without tools: the tools described in the (first) system message,
        each assistant turn's calls appended to its text, and each run of tool results as one
        user turn, all in the format of the tool parser, so the model can be asked for calls."""
        if not tools and not any(m.get("tool_calls") or m.get("role") == "tool"
                                 for m in messages):
            return messages
        from ftrs.server.toolcalls import TOOL_PARSERS, choose_tool_parser

        fmt = TOOL_PARSERS[self.tool_parser or choose_tool_parser(None, self.template_for(True))]
        out: list[dict[str, Any]] = []
        results: list[str] = []
        for m in messages:
            if m.get("role") == "tool":
                results.append(_text(m.get("content")))
                continue
            if results:
                out.append({"role": "user", "content": fmt.format_results(results)})
                results = []
            text = _text(m.get("content"))
            calls = [(c["function"].get("name", ""), c["function"]["arguments"])
                     for c in m.get("tool_calls") or []]
            if calls:
                text = (text + "\n" if text else "") + fmt.format_calls(calls)
            out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": text})
        if results:
            out.append({"role": "user", "content": fmt.format_results(results)})
        if tools:
            described = fmt.describe_tools(tools)
            if out and out[0].get("role") == "system":
                out[0] = out[0] | {"content": out[0]["content"] + "\n\n" + described}
            else:
                out.insert(0, {"role": "system", "content": described})
        return out

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def from_dir(cls, model_dir: Path) -> Tokenizer:
        """From `tokenizer.json`, or else a `tiktoken.model` (`models/tiktoken_bpe.py`), and
        `tokenizer_config.json`."""
        tj = model_dir / "tokenizer.json"
        conf: dict[str, Any] = {}
        tc = model_dir / "tokenizer_config.json"
        if tc.is_file():
            conf = json.loads(tc.read_text())
        if not tj.is_file() and (model_dir / "tiktoken.model").is_file():
            from ftrs.models.tiktoken_bpe import tiktoken_tokenizer

            tk = tiktoken_tokenizer(model_dir, conf)
        elif not tj.is_file():
            raise ModelLoadError(str(tj), "tokenizer.json not found")
        else:
            try:
                tk = HFTokenizer.from_file(str(tj))
            except Exception as e:
                raise ModelLoadError(str(tj), f"cannot parse tokenizer: {e}") from e

        def tok(v: Any) -> str | None:
            return v.get("content") if isinstance(v, dict) else v

        bos, eos = tok(conf.get("bos_token")), tok(conf.get("eos_token"))
        eos_ids: set[int] = set()
        eos_id = tk.token_to_id(eos) if eos else None
        if eos_id is not None:
            eos_ids.add(int(eos_id))
        for name in ("generation_config.json", "config.json"):
            p = model_dir / name
            if p.is_file():
                found = json.loads(p.read_text()).get("eos_token_id")
                if isinstance(found, list):
                    eos_ids |= {int(i) for i in found}
                elif isinstance(found, int):
                    eos_ids.add(found)
        template, named = _dir_templates(model_dir, conf.get("chat_template"))
        return cls(tk, template, bos, eos, sorted(eos_ids), bool(conf.get("add_bos_token", False)),
                   named_templates=named)

    @classmethod
    def from_gguf_fields(cls, meta: dict[str, Any], source: str) -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        if kind is None:
            raise ModelLoadError(source, "has no tokenizer (tokenizer.ggml.model missing)")
        if kind != "gpt2":
            raise ModelLoadError(source, f"unsupported GGUF tokenizer {kind!r} (supported: gpt2)")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        vocab = {t: i for i, t in enumerate(tokens)}
        tk = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        tk.pre_tokenizer = gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"), source)
        tk.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type") or []
        tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                               for t, ty in zip(tokens, types) if ty == _CONTROL])
        # matched whole wherever they stand in a text, as llama.cpp does and the checkpoint's
        # tokenizer.json (added, not special) did; shown in decoded text
        tk.add_tokens([AddedToken(t, special=False, normalized=False)
                       for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

        def name(key: str) -> str | None:
            i = meta.get(key)
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

        named = {n: meta[f"tokenizer.chat_template.{n}"] for n in meta.get("tokenizer.chat_templates") or []
                 if isinstance(meta.get(f"tokenizer.chat_template.{n}"), str)}
        return cls(tk, meta.get("tokenizer.chat_template"), name("tokenizer.ggml.bos_token_id"),
                   name("tokenizer.ggml.eos_token_id"), gguf_stop_ids(meta, vocab),
                   bool(meta.get("tokenizer.ggml.add_bos_token", False)), named_templates=named)

    def save(self, out_dir: Path) -> None:
        """Write tokenizer.json and tokenizer_config.json, readable by `from_dir` and by HF."""
        self.tk.save(str(out_dir / "tokenizer.json"))
        template: Any = self.chat_template
        if self.named_templates:  # transformers' list form, the default first
            template = [{"name": n, "template": t} for n, t in (
                ("default", self.chat_template), *self.named_templates.items()) if t is not None]
        conf = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos_token,
                "eos_token": self.eos_token, "add_bos_token": self.add_bos,
                "chat_template": template}
        (out_dir / "tokenizer_config.json").write_text(json.dumps(conf, indent=2))
