"""A checkpoint's named chat templates (Hermes-2-Pro and Command-R ship a `default` and a
`tool_use` one): read from every place transformers and llama.cpp's converter keep them, and
chosen as transformers chooses them (its renderer is the oracle): `tool_use` when the request
offers tools, the default otherwise. Also `tool_use` when the history carries calls or results
and no tools are offered (transformers takes the default then, which cannot render them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ftrs.errors import InvalidRequest
from ftrs.models.tiny import tiny_tokenizer
from ftrs.models.tokenizer import Tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Mistral's way of offering tools and writing calls, so the tool format it implies (mistral)
# differs from what the default template implies (nothing: hermes)
TOOL_USE = ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
            "{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]"
            "{% for c in m.tool_calls %}{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}"
            "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
            "{% else %}[{{ m.role }}]{{ m.content }}{% endif %}{% endfor %}")
TOOLS = [{"type": "function", "function": {
    "name": "now", "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "What time is it?"}]
HISTORY: list[dict[str, Any]] = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "now", "arguments": {}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "noon"}]


def named(default: str | None = CHATML, **more: str) -> Tokenizer:
    tiny = tiny_tokenizer(512)
    return Tokenizer(tiny.tk, default, tiny.bos_token, tiny.eos_token, [2],
                     named_templates=more or {"tool_use": TOOL_USE})


def test_tool_use_template_is_chosen_as_transformers_chooses_it(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = named()
    tok.save(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert set(hf.chat_template) == {"default", "tool_use"}
    for messages, tools in ((ASK, None), (ASK, TOOLS), (HISTORY, TOOLS)):
        expected = hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                          add_generation_prompt=True)
        assert tok.apply_chat_template(messages, tools=tools) == expected
    assert tok.apply_chat_template(ASK).startswith("<|im_start|>user")
    assert tok.apply_chat_template(ASK, tools=TOOLS).startswith("[AVAILABLE_TOOLS]")
    # calls and results without tools offered: still the template that can render them
    assert tok.apply_chat_template(HISTORY) == (
        '[user]What time is it?[TOOL_CALLS]now{}[TOOL_RESULTS]noon[/TOOL_RESULTS]')


def test_templates_are_read_from_each_directory_form(tmp_path: Path) -> None:
    """tokenizer_config.json's list (as checkpoints ship it), and transformers' own save:
    chat_template.jinja beside additional_chat_templates/NAME.jinja."""
    from transformers import AutoTokenizer

    (tmp_path / "a").mkdir()
    named(rag="R{{ messages | length }}", tool_use=TOOL_USE).save(tmp_path / "a")
    listed = Tokenizer.from_dir(tmp_path / "a")
    assert listed.chat_template == CHATML
    assert listed.named_templates == {"rag": "R{{ messages | length }}", "tool_use": TOOL_USE}
    AutoTokenizer.from_pretrained(str(tmp_path / "a")).save_pretrained(str(tmp_path / "b"))
    assert (tmp_path / "b" / "additional_chat_templates" / "tool_use.jinja").is_file()
    saved = Tokenizer.from_dir(tmp_path / "b")
    assert (saved.chat_template, saved.named_templates) == (CHATML, listed.named_templates)


def test_templates_are_read_from_and_written_to_gguf(tmp_path: Path) -> None:
    """llama.cpp's converter (gguf-py's `add_chat_template` of the list) writes the default as
    `tokenizer.chat_template` and the others as `tokenizer.chat_template.NAME`; ftrs reads them
    back, and its own writer writes the same keys."""
    import gguf

    from ftrs.models.gguf_loader import gguf_metadata
    from ftrs.models.gguf_write import keep_f32, write_gguf
    from ftrs.models.tiny import tiny_config, tiny_tensors

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in _fields(tiny_tokenizer(512)).items():
        w.add_key_value(key, value[0], value[1])
    w.add_chat_template([{"name": "default", "template": CHATML},
                         {"name": "tool_use", "template": TOOL_USE}])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    tok = Tokenizer.from_gguf_fields(gguf_metadata(gguf.GGUFReader(str(path))), str(path))
    assert (tok.chat_template, tok.named_templates) == (CHATML, {"tool_use": TOOL_USE})

    cfg = tiny_config("qwen3_moe")
    ours = tmp_path / "ours.gguf"
    write_gguf(ours, cfg, tiny_tensors(cfg, 0), keep_f32, tokenizer=named(), dequantized=False)
    meta = gguf_metadata(gguf.GGUFReader(str(ours)))
    assert meta["tokenizer.chat_templates"] == ["tool_use"]
    assert meta["tokenizer.chat_template.tool_use"] == TOOL_USE
    assert meta["tokenizer.chat_template"] == CHATML


def _fields(tok: Tokenizer) -> dict[str, tuple[Any, Any]]:
    import gguf

    tokens = [t for t, _ in sorted(tok.tk.get_vocab(with_added_tokens=True).items(),
                                   key=lambda kv: kv[1])]
    return {"tokenizer.ggml.model": ("gpt2", gguf.GGUFValueType.STRING),
            "tokenizer.ggml.pre": ("smollm", gguf.GGUFValueType.STRING),
            "tokenizer.ggml.tokens": (tokens, gguf.GGUFValueType.ARRAY),
            "tokenizer.ggml.token_type": ([1] * len(tokens), gguf.GGUFValueType.ARRAY)}


def test_the_tool_format_is_read_from_the_template_that_renders_tools() -> None:
    from ftrs.server.prepare import Limits, chat_setup
    from ftrs.server.protocol import ChatCompletionRequest

    def setup(body: dict[str, Any]) -> Any:
        req = ChatCompletionRequest.model_validate({"model": "m", **body})
        return chat_setup(req, named(), Limits(512, 4096, 64))

    assert setup({"messages": ASK, "tools": TOOLS}).tool_parser == "mistral"
    plain = named(tool_use=CHATML.replace("<|im_start|>", "<|im_start|><tool_call>"))
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, "tools": TOOLS})
    assert chat_setup(req, plain, Limits(512, 4096, 64)).tool_parser == "hermes"
    assert setup({"messages": ASK}).tool_parser is None  # no tools: nothing is read


def test_a_request_no_template_can_render_is_refused_by_name() -> None:
    only_tools = named(None)
    assert only_tools.apply_chat_template(ASK, tools=TOOLS).startswith("[AVAILABLE_TOOLS]")
    with pytest.raises(InvalidRequest, match=r"no default chat template \(it has tool_use\)"):
        only_tools.apply_chat_template(ASK)


def test_the_api_process_rebuilds_the_named_templates() -> None:
    """The engine process sends its tokenizer to the API process as fields; the named
    templates cross too (else a tools request would render with the default there)."""
    from ftrs.server import backend

    tok = named()
    rebuilt = backend.load_tokenizer(backend.tokenizer_source(tok))
    assert rebuilt.named_templates == tok.named_templates
    assert rebuilt.apply_chat_template(ASK, tools=TOOLS) == tok.apply_chat_template(
        ASK, tools=TOOLS)
