"""`ftrs models demo --quant q4_k_m` / `--quant q8_0`: the demo MoE as a quantized GGUF still
answers "Paris"."""

from __future__ import annotations

import pytest

from ftrs.llm import LLM
from ftrs.models.gguf_loader import open_gguf
from ftrs.sampling import SamplingParams


@pytest.mark.slow
def test_q4_k_m_demo_answers_paris() -> None:
    from ftrs.models.demo import ensure_demo_quant

    path = ensure_demo_quant("q4_k_m")
    ck = open_gguf(path)
    assert {g.qtype for grp in ck.experts.values() for g in grp.values()} == {"Q5_1", "Q4_K",
                                                                             "Q6_K"}
    llm = LLM(str(path), kv_tokens=1024)
    chat = llm.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate([chat], SamplingParams(max_tokens=12, temperature=0))[0]
    assert "Paris" in llm.tokenizer.decode(out.token_ids)
    llm.close()


@pytest.mark.slow
def test_q8_0_demo_keeps_every_expert_in_q8_0_and_answers_paris() -> None:
    from ftrs.models.demo import ensure_demo_quant

    path = ensure_demo_quant("q8_0")
    ck = open_gguf(path)
    assert {g.qtype for grp in ck.experts.values() for g in grp.values()} == {"Q8_0"}
    llm = LLM(str(path), kv_tokens=1024)
    chat = llm.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate([chat], SamplingParams(max_tokens=12, temperature=0))[0]
    assert "Paris" in llm.tokenizer.decode(out.token_ids)
    llm.close()
