"""gpt_oss against transformers on tiny random checkpoints (`tests/gpt_oss_models.py`).

Oracles: transformers' own forward (fp32) for logits, prefill and every decode step; the same
engine run one sequence at a time for batching, preemption and prefix caching; the resident
strategy, bit for bit, for offload; transformers on the MXFP4 weights dequantized by
transformers' own converter for the MXFP4 checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import gpt_oss_models
from ftrs.errors import ModelLoadError
from ftrs.layers.attention import AttnMetadata, PrefillSpan, prefill_mask
from ftrs.llm import LLM
from ftrs.models.load import load_model
from ftrs.quant import QuantTensor, dequantize, use_kernels
from ftrs.quant.matmul import kernel_types
from ftrs.sampling import SamplingParams
from quant_models import spy_kernel_types

transformers = pytest.importorskip("transformers")

TOL = 1e-4
# bf16 weights and activations against the fp32 reference, max |diff| over the 57x512 logits
# (|logits| up to ~4): measured 0.60 (position 0 the worst; 0.04-0.23 elsewhere); transformers'
# own bf16 run measured 0.52 from its fp32. Bounded with headroom for other CPUs' summation
# orders, and held to within twice transformers' own bf16 error.
BF16_TOL = 1.0
IDS = torch.randint(3, gpt_oss_models.VOCAB, (57,),
                    generator=torch.Generator().manual_seed(7)).tolist()
GREEDY = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
PROMPTS = [IDS[:23], IDS[5:8], IDS, [9] * 30]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gpt_oss_models.build(tmp_path_factory.mktemp("gpt_oss") / "m", seed=1)


@pytest.fixture(scope="module")
def reference(model: Path) -> torch.Tensor:
    """transformers' logits of every position of IDS, fp32."""
    m = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    with torch.no_grad():
        return m.eval()(torch.tensor([IDS])).logits[0].float()


def test_logits_match_transformers(model: Path, reference: torch.Tensor) -> None:
    ours = LLM(str(model), kv_tokens=1024, dtype="float32").logits(IDS)
    assert ours.shape == reference.shape == (57, gpt_oss_models.VOCAB)
    assert (ours - reference).abs().max().item() <= TOL


def test_the_window_and_the_sinks_change_the_logits(model: Path, reference: torch.Tensor) -> None:
    # the checks above could not fail if the prompt never left the window or the sinks were
    # negligible: transformers without either disagrees with itself by far more than TOL
    for change in ({"layer_types": ["full_attention"] * 3}, {"sinks": True}):
        m = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
        if "layer_types" in change:
            m = transformers.AutoModelForCausalLM.from_pretrained(
                str(model), dtype=torch.float32, layer_types=change["layer_types"])
        else:
            for layer in m.model.layers:
                layer.self_attn.sinks.data.fill_(-1e4)
        with torch.no_grad():
            other = m.eval()(torch.tensor([IDS])).logits[0]
        assert (other - reference).abs().max().item() > 100 * TOL, change


def _step_meta(rows: list[tuple[int, int]], slots: torch.Tensor) -> AttnMetadata:
    """Metadata of one sequence's step: (start, end) positions computed now, of one sequence
    whose position p lives in cache slot `slots[p]`."""
    (start, end), = rows
    if end - start == 1:
        return AttnMetadata(slot_mapping=slots[start:end], decode_rows=torch.tensor([0]),
                            decode_gather=slots[None, :end], decode_mask=None,
                            decode_only=True)
    return AttnMetadata(slot_mapping=slots[start:end], decode_rows=torch.zeros(0, dtype=torch.long),
                        decode_gather=torch.zeros(0, 1, dtype=torch.long), decode_mask=None,
                        prefills=[PrefillSpan(0, end - start, slots[:end],
                                              prefill_mask(end - start, end, torch.device("cpu")))])


@pytest.mark.parametrize("chunks", [(40,), (23, 17)], ids=["prefill", "chunked-prefill"])
def test_incremental_decode_matches_the_full_forward(model: Path, reference: torch.Tensor,
                                                     chunks: tuple[int, ...]) -> None:
    llm = LLM(str(model), kv_tokens=1024, dtype="float32")
    rt = llm.engine.rt
    slots = torch.randperm(1024, generator=torch.Generator().manual_seed(3))[:57]  # scattered
    ids = torch.tensor(IDS)
    steps = [(sum(chunks[:i]), sum(chunks[:i + 1])) for i in range(len(chunks))]
    steps += [(t, t + 1) for t in range(40, 57)]
    for start, end in steps:
        meta = _step_meta([(start, end)], slots)
        hidden = rt.decoder.forward(ids[start:end], torch.arange(start, end), meta, rt.kv)
        got = rt.decoder.logits(hidden)
        err = (got - reference[start:end]).abs().max().item()
        assert err <= TOL, f"positions {start}..{end}: {err}"


def _alone(llm: LLM) -> list[list[int]]:
    return [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


def test_continuous_batching_equals_each_sequence_alone(model: Path) -> None:
    ref = _alone(LLM(str(model), kv_tokens=2048, dtype="float32"))
    assert len({tuple(r) for r in ref}) == len(ref)  # different continuations: a real check
    # chunked prefill mixed with decode rows, sequences of different lengths
    for opts in ({"max_prefill_length": 5}, {"max_prefill_length": 1, "page_size": 4}):
        llm = LLM(str(model), kv_tokens=2048, dtype="float32", **opts)
        assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == ref, opts
    # preemption and resumption: 12 pages of 8 cannot hold the four at once
    llm = LLM(str(model), kv_tokens=96, page_size=8, dtype="float32")
    assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == ref
    assert llm.engine.scheduler.kv_usage() == 0.0
    # prefix-cache hits: the long prompt again, then a prompt sharing its first 48 tokens
    llm = LLM(str(model), kv_tokens=2048, page_size=8, dtype="float32")
    first = llm.generate([IDS], GREEDY)[0]
    again, shared = llm.generate([IDS, [*IDS[:50], 4, 5, 6]], GREEDY)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 56
    assert shared.num_cached_tokens == 48
    assert again.token_ids == first.token_ids == ref[2]
    solo = LLM(str(model), kv_tokens=2048, dtype="float32")
    assert shared.token_ids == solo.generate([[*IDS[:50], 4, 5, 6]], GREEDY)[0].token_ids


def _record(llm: LLM) -> tuple[torch.Tensor, list[torch.Tensor], list[list[int]]]:
    """Prompt logits, every engine step's logits of a batched greedy run, the tokens."""
    prefill = llm.logits(IDS)
    steps: list[torch.Tensor] = []
    decoder = llm.engine.rt.decoder
    plain = decoder.logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        out = plain(hidden)
        steps.append(out.detach().clone())
        return out

    decoder.logits = recording  # type: ignore[method-assign]
    try:
        outs = llm.generate(PROMPTS, GREEDY)
    finally:
        del decoder.logits
    return prefill, steps, [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def resident_run(model: Path) -> tuple[torch.Tensor, list[torch.Tensor], list[list[int]]]:
    return _record(LLM(str(model), moe_strategy="resident", **STRATEGY_OPTS))


STRATEGY_OPTS: dict[str, Any] = {"kv_tokens": 2048, "dtype": "float32", "max_prefill_length": 7}


@pytest.mark.parametrize("strategy", ["offload", "hybrid"])
def test_offload_at_a_quarter_of_the_experts_equals_resident(
        model: Path, resident_run: tuple[torch.Tensor, list[torch.Tensor], list[list[int]]],
        strategy: str) -> None:
    # the expert biases travel in the pool block: every strategy sees them
    ref = resident_run
    llm = LLM(str(model), moe_strategy=strategy, moe_cache_rate=0.25, **STRATEGY_OPTS)
    got = _record(llm)
    assert llm.engine.rt.moe is not None
    s = llm.engine.rt.moe.stats()
    # experts did come from the host pool: over the link, or computed there (hybrid)
    assert s["misses"] > 0 if strategy == "offload" else s["fetched"] + s["cpu_computed"] > 0
    assert torch.equal(got[0], ref[0])
    assert len(got[1]) == len(ref[1])
    for a, b in zip(got[1], ref[1], strict=True):
        assert torch.equal(a, b)
    assert got[2] == ref[2]
    llm.close()


def test_bf16_logits_within_the_measured_tolerance(model: Path, reference: torch.Tensor) -> None:
    ours = LLM(str(model), kv_tokens=1024, dtype="bfloat16").logits(IDS)
    err = (ours - reference).abs().max().item()
    m = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16)
    with torch.no_grad():
        theirs = (m.eval()(torch.tensor([IDS])).logits[0].float() - reference).abs().max().item()
    assert TOL < err <= BF16_TOL  # bf16 does differ (the run is bf16), within the bound
    assert err <= 2 * theirs


@pytest.fixture(scope="module")
def mxfp4(model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mxfp4")
    return gpt_oss_models.quantize_mxfp4(model, root / "mxfp4", root / "dequantized")


def test_mxfp4_logits_match_the_dequantized_weights(mxfp4: tuple[Path, Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # the reference path: the torch dequantizer, then F.linear
    q_dir, ref_dir = mxfp4
    seen = spy_kernel_types(monkeypatch)
    with use_kernels(False):
        ours = LLM(str(q_dir), kv_tokens=1024, dtype="float32").logits(IDS)
    assert "MXFP4" not in seen
    m = transformers.AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32)
    with torch.no_grad():
        ref = m.eval()(torch.tensor([IDS])).logits[0].float()
    assert (ours - ref).abs().max().item() <= TOL


def test_mxfp4_kernel_path_greedy_agrees_with_reference(mxfp4: tuple[Path, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # the Rust MXFP4 kernel rounds activations per 32-block (its bound: tests/quant): the same
    # greedy tokens as the reference path, as for the GGUF types (test_quant_gguf.py)
    assert "MXFP4" in kernel_types()
    llm = LLM(str(mxfp4[0]), kv_tokens=1024, dtype="float32")
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    seen = spy_kernel_types(monkeypatch)
    with use_kernels(False):
        ref = llm.generate([IDS], params)[0].token_ids
    assert "MXFP4" not in seen
    with use_kernels(True):
        ours = llm.generate([IDS], params)[0].token_ids
    assert "MXFP4" in seen
    same = sum(a == b for a, b in zip(ours, ref))
    assert len(ours) == len(ref) == 64
    assert same >= 0.95 * 64, (same, ours, ref)
    llm.close()


def test_mxfp4_experts_stay_mxfp4_in_the_pool(mxfp4: tuple[Path, Path]) -> None:
    q_dir, ref_dir = mxfp4
    m = load_model(str(q_dir), torch.device("cpu"), torch.float32, progress=False)
    assert m.experts is not None
    gate, up, down, *biases = m.experts.views(m.experts.host_bytes())[2][5]
    assert all(isinstance(w, QuantTensor) and w.qtype == "MXFP4" for w in (gate, up, down))
    assert m.experts.exact_bytes(2, 0) == 64 * 96 // 32 * 17  # 17 bytes per 32 values
    assert m.experts.exact_bytes(2, 2) == 96 * 64 // 32 * 17
    # the pool's bytes decode to exactly what transformers dequantized; biases as shipped
    from safetensors.torch import load_file

    ref = load_file(str(ref_dir / "model.safetensors"))
    p = "model.layers.2.mlp.experts."
    gu = ref[p + "gate_up_proj"][5].t()
    assert torch.equal(dequantize(gate), gu[0::2]) and torch.equal(dequantize(up), gu[1::2])
    assert torch.equal(dequantize(down), ref[p + "down_proj"][5].t())
    assert torch.equal(biases[0].reshape(-1), ref[p + "gate_up_proj_bias"][5, 0::2])
    assert torch.equal(biases[2].reshape(-1), ref[p + "down_proj_bias"][5])


@pytest.mark.parametrize("strategy", ["offload", "hybrid"])
def test_mxfp4_offload_equals_resident(mxfp4: tuple[Path, Path], strategy: str) -> None:
    # the MXFP4 bytes cross the link and are decoded in the slot, or (hybrid) are computed in
    # the pool by the same kernel: the same logits as resident
    opts: dict[str, Any] = {"kv_tokens": 2048, "dtype": "float32"}
    ref = LLM(str(mxfp4[0]), moe_strategy="resident", **opts).logits(IDS)
    llm = LLM(str(mxfp4[0]), moe_strategy=strategy, moe_cache_rate=0.25, **opts)
    assert torch.equal(llm.logits(IDS), ref)
    llm.close()


def _edit_config(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text()) | changes
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(("changes", "match"), [
    ({"layer_types": ["full_attention", "chunked_attention", "full_attention"]},
     "unsupported layer type 'chunked_attention'"),
    ({"layer_types": ["full_attention"]}, "layer_types must list 3"),
    ({"sliding_window": None}, "sliding_window >= 1"),
])
def test_bad_layer_kinds_are_refused(model: Path, tmp_path: Path, changes: dict[str, Any],
                                     match: str) -> None:
    d = _edit_config(model, tmp_path / "m", **changes)
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(d), torch.device("cpu"), torch.float32, progress=False)


def test_a_missing_expert_bias_is_refused(model: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    d = shutil.copytree(model, tmp_path / "m")
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.1.mlp.experts.down_proj_bias"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"layer 1: no mlp\.experts\.down_proj_bias"):
        load_model(str(d), torch.device("cpu"), torch.float32, progress=False)


@pytest.mark.parametrize("window", [0, 4, 9, 64])
def test_paged_attention_with_a_window_and_sinks_is_the_definition(window: int) -> None:
    """A mixed batch (two padded decode rows, one of them shorter than the window, and a
    prefill chunk ending a longer context) against attention written out per query."""
    from ftrs.layers.attention import paged_attention

    g = torch.Generator().manual_seed(11)
    heads, kv_heads, d, slots = 4, 2, 8, 128
    lens, chunk, ctx = [5, 20], 6, 30  # decode contexts; the prefill chunk ends a 30-key context
    perm = torch.randperm(slots, generator=g)
    places = [perm[:5], perm[5:25], perm[25:55]]  # each sequence's slots, position order
    k_cache, v_cache = torch.randn(slots, kv_heads, d, generator=g), torch.randn(
        slots, kv_heads, d, generator=g)
    tokens = 2 + chunk
    q = torch.randn(tokens, heads, d, generator=g)
    k, v = torch.randn(tokens, kv_heads, d, generator=g), torch.randn(tokens, kv_heads, d, generator=g)
    sinks = torch.randn(heads, generator=g)
    gather = torch.zeros(2, 20, dtype=torch.long)
    gather[0, :5], gather[1] = places[0], places[1]
    real = torch.arange(20) < torch.tensor(lens)[:, None]
    meta = AttnMetadata(
        slot_mapping=torch.cat([places[0][4:5], places[1][19:20], places[2][ctx - chunk:]]),
        decode_rows=torch.tensor([0, 1]), decode_gather=gather, decode_mask=real[:, None, None, :],
        prefills=[PrefillSpan(2, chunk, places[2], prefill_mask(chunk, ctx, torch.device("cpu")))])
    out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.3, sinks=sinks, window=window)

    def one(row: int, seq: int, pos: int) -> torch.Tensor:  # (heads, d)
        lo = max(0, pos - window + 1) if window else 0
        keys = k_cache[places[seq][lo:pos + 1]]  # (n, kv_heads, d)
        vals = v_cache[places[seq][lo:pos + 1]]
        res = torch.empty(heads, d)
        for h in range(heads):
            kh = h // (heads // kv_heads)
            s = keys[:, kh] @ q[row, h] * 0.3
            e = torch.exp(torch.cat([s, sinks[h:h + 1]]) - torch.cat([s, sinks[h:h + 1]]).max())
            res[h] = (e[:-1] / e.sum()) @ vals[:, kh]
        return res

    want = [one(0, 0, 4), one(1, 1, 19)] + [one(2 + i, 2, ctx - chunk + i) for i in range(chunk)]
    torch.testing.assert_close(out, torch.stack(want), rtol=1e-5, atol=1e-5)
