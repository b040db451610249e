"""Logits and greedy continuations against Hugging Face transformers on the same checkpoint (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ftrs.llm import LLM
from ftrs.quant.matmul import use_kernels
from ftrs.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

TOL = 1e-4
IDS = [3, 17, 250, 41, 99, 500, 7, 8, 311, 42, 42, 42, 130, 64, 255, 1, 300, 12, 77, 5]


def hf_model(path: Path, **kw: object) -> torch.nn.Module:
    m = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kw)
    m.generation_config.eos_token_id = None  # continue past EOS, as ftrs' ignore_eos does
    return m.eval()


def greedy(n: int) -> object:
    """Exactly n greedy tokens, EOS neither stopping nor suppressed (as ftrs' ignore_eos)."""
    return transformers.GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None,
                                         pad_token_id=0)


@pytest.mark.parametrize("kernels", ["cpu", "torch"])  # the Rust ops and the torch references
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mixtral", "qwen3_moe"])
def test_tiny_logits_match_transformers(tiny_models: dict[str, Path], arch: str,
                                        kernels: str) -> None:
    llm = LLM(str(tiny_models[arch]), kv_tokens=1024, dtype="float32", device="cpu",
              kernels=kernels)
    assert llm.engine.kernels == kernels
    ours = llm.logits(IDS)
    with torch.no_grad():
        ref = hf_model(tiny_models[arch])(torch.tensor([IDS])).logits[0].float()
    assert ours.shape == ref.shape == (len(IDS), 512)
    assert (ours - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_tiny_greedy_continuation_matches_transformers(tiny_models: dict[str, Path], arch: str) -> None:
    # a small token budget forces chunked prefill; a batch of prompts shares every step
    llm = LLM(str(tiny_models[arch]), kv_tokens=2048, max_prefill_length=7)
    prompts = [IDS, IDS[:5], IDS[3:17]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    m = hf_model(tiny_models[arch])
    for prompt, out in zip(prompts, outs):
        ref = m.generate(torch.tensor([prompt]), generation_config=greedy(24))
        assert out.token_ids == ref[0, len(prompt):].tolist()


def test_gguf_logits_match_transformers(smollm_gguf: Path) -> None:
    # The reference path: the Q4_1 weights dequantized, then fp32 matmuls, as transformers
    # computes them. The Rust kernels sum in another order; tests/models/test_quant_gguf.py
    # holds them to the reference path.
    with use_kernels(False):
        _check_gguf_against_transformers(smollm_gguf)


def _check_gguf_against_transformers(smollm_gguf: Path) -> None:
    llm = LLM(str(smollm_gguf), kv_tokens=2048)
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. Paris is")
    ours = llm.logits(ids)
    m = hf_model(smollm_gguf.parent, gguf_file=smollm_gguf.name)
    with torch.no_grad():
        ref = m(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() <= TOL

    prompts = ["What is the capital of France?", "Write a haiku about the sea.",
               "List three primary colors.", "def fibonacci(n):", "Explain photosynthesis briefly."]
    chat = [llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
    outs = llm.generate(chat, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for text, out in zip(chat, outs):
        ids = llm.tokenizer.encode(text)
        ref = m.generate(torch.tensor([ids]), generation_config=greedy(32))
        assert out.token_ids == ref[0, len(ids):].tolist(), text


def test_gguf_tokenizer_matches_transformers(smollm_gguf: Path) -> None:
    from ftrs.models.gguf_loader import _reader, gguf_metadata
    from ftrs.models.tokenizer import Tokenizer

    ours = Tokenizer.from_gguf_fields(gguf_metadata(_reader(smollm_gguf)), str(smollm_gguf))
    ref = transformers.AutoTokenizer.from_pretrained(str(smollm_gguf.parent),
                                                     gguf_file=smollm_gguf.name)
    texts = ["Hello, world!", "<|im_start|>user\nhi there<|im_end|>\n", "  spaces   and\ttabs",
             "naïve café — déjà vu", "The year 2024 had 366 days."]
    for t in texts:
        assert ours.encode(t) == ref.encode(t, add_special_tokens=False), t
        assert ours.decode(ours.encode(t), skip_special_tokens=False) == t


def test_demo_moe_equals_dense_and_transformers(demo_model: Path, smollm_gguf: Path) -> None:
    moe = LLM(str(demo_model), kv_tokens=2048)
    dense = LLM(str(smollm_gguf), kv_tokens=2048)
    ids = moe.tokenizer.encode("Upcycled experts must agree with the dense model they came from.")
    ours = moe.logits(ids)
    assert moe.engine.spec.num_experts == 8 and moe.engine.spec.top_k == 2
    # The upcycling is exact, so the dense file on its reference path (dequantize, fp32 matmul)
    # is the oracle; its kernel path rounds the activations to 15-bit integers (tests/quant).
    with use_kernels(False):
        dense_ref = dense.logits(ids)
    assert (ours - dense_ref).abs().max().item() <= TOL
    with torch.no_grad():
        ref = hf_model(demo_model)(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() <= TOL
