"""The int8 KV cache (`--kv-cache-dtype int8`, `kvcache/quant.py`): the row format against a
numpy rendering of its definition, the attention layer on an int8 cache against the same layer
on a plain cache holding those rows' values, and whole models against their plain-cache selves."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ftrs.errors import ConfigError
from ftrs.kvcache import quant as kvquant
from ftrs.layers.attention import AttnMetadata, PrefillSpan, paged_attention


def _numpy_rows(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The format as its docstring defines it: s = max|x| / 127, q = round-half-even(x / s)."""
    a = x.double().numpy()
    s = np.abs(a).max(axis=-1) / 127.0
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(s[..., None] > 0, np.rint(a / s[..., None]), 0.0)
    return q.astype(np.int8), s


def test_rows_are_the_format() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, 24, generator=g) * torch.logspace(-3, 3, 40).view(40, 1, 1)
    x[5, 1] = 0.0  # a zero row: scale 0, values 0
    x[6, 0, 3] = 1e-30  # a tiny row
    q, s = kvquant.quantize_rows(x)
    want_q, want_s = _numpy_rows(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (40, 3)
    np.testing.assert_allclose(s.numpy(), want_s, rtol=1e-6)
    # a value on a half step may round either way under fp32 against fp64: at most one code
    assert np.abs(q.numpy().astype(int) - want_q.astype(int)).max() <= 1
    assert (q.numpy() == want_q).mean() > 0.999
    assert s[5, 1] == 0 and not q[5, 1].any()
    back = kvquant.dequantize_rows(q, s, torch.float32)
    # each value within half a step of its row, plus fp32 rounding of the product
    err = (back - x).abs()
    assert bool((err <= s.unsqueeze(-1) * (0.5 + 1e-5) + 1e-37).all())
    assert q.abs().max() == 127  # every nonzero row reaches the end of the range


def test_write_and_gather() -> None:
    g = torch.Generator().manual_seed(1)
    cache = torch.zeros(16, 2, 8, dtype=torch.int8)
    scale = torch.zeros(16, 2)
    x = torch.randn(3, 2, 8, generator=g)
    slots = torch.tensor([9, 2, 14])
    kvquant.write(cache, scale, slots, x)
    got = kvquant.gather(cache, scale, torch.tensor([[14, 2], [9, 9]]), torch.bfloat16)
    assert got.shape == (2, 2, 2, 8) and got.dtype == torch.bfloat16
    q, s = _numpy_rows(x)
    deq = torch.from_numpy(q.astype(np.float32) * s[..., None].astype(np.float32))
    torch.testing.assert_close(got[0, 0].float(), deq[2].bfloat16().float())
    torch.testing.assert_close(got[1, 1].float(), deq[0].bfloat16().float())
    plain = torch.zeros(16, 2, 8)
    kvquant.write(plain, None, slots, x)
    assert torch.equal(kvquant.gather(plain, None, slots, torch.float32), x)


def test_the_cpu_write_is_the_torch_rendering_bit_for_bit() -> None:
    """`write` on CPU fp32 rows goes to one Rust call; it stores what `quantize_rows` computes
    (codes and scales), halves-to-even and zero rows included, and leaves other slots alone."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 3, 24, generator=g) * torch.logspace(-4, 4, 7).view(7, 1, 1)
    x[2, 1] = 0.0
    x[4, 0, :4] = torch.tensor([127.0, 0.5, -0.5, 1.5])  # s = 1: three exact halves
    slots = torch.tensor([11, 0, 5, 7, 3, 12, 1])
    cache, scale = torch.full((13, 3, 24), 9, dtype=torch.int8), torch.full((13, 3), 9.0)
    kvquant.write(cache, scale, slots, x)
    q, s = kvquant.quantize_rows(x)
    assert torch.equal(cache[slots], q) and torch.equal(scale[slots], s)
    assert q[4, 0, :4].tolist() == [127, 0, 0, 2]
    untouched = torch.ones(13, dtype=torch.bool)
    untouched[slots] = False
    assert (cache[untouched] == 9).all() and (scale[untouched] == 9).all()
    # a strided x (not contiguous) takes the torch path, to the same values
    wide = torch.zeros(7, 3, 48)
    wide[..., ::2] = x
    cache2, scale2 = torch.zeros_like(cache), torch.zeros_like(scale)
    kvquant.write(cache2, scale2, slots, wide[..., ::2])
    assert torch.equal(cache2[slots], q) and torch.equal(scale2[slots], s)


def _meta() -> AttnMetadata:
    """Two decode rows (contexts 6 and 3) and one prefill chunk of 3 after 2 cached tokens."""
    ctx = [torch.arange(10, 16), torch.tensor([3, 4, 7])]
    new = torch.tensor([15, 7, 20, 21, 22])  # the decode rows' last keys, then the chunk's
    gather = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
    for i, c in enumerate(ctx):
        gather[i, : c.numel()] = c
        mask[i, 0, 0, : c.numel()] = True
    span = PrefillSpan(2, 3, torch.tensor([30, 31, 20, 21, 22]))
    return AttnMetadata(new, torch.tensor([0, 1]), gather, mask, [span])


@pytest.mark.parametrize("sinks", [False, True], ids=["sdpa", "sinks"])
@pytest.mark.parametrize("window", [0, 3])
def test_layer_reads_the_rows_it_wrote(sinks: bool, window: int) -> None:
    """The layer over an int8 cache = the layer over a plain cache of the rows' values (prior
    keys and this step's alike), decode rows and a prefill chunk, sliding and sink layers."""
    g = torch.Generator().manual_seed(2)
    heads, kvh, d = 4, 2, 16
    prior_k, prior_v = torch.randn(32, kvh, d, generator=g), torch.randn(32, kvh, d, generator=g)
    q = torch.randn(5, heads, d, generator=g)
    k, v = torch.randn(5, kvh, d, generator=g), torch.randn(5, kvh, d, generator=g)
    sink = torch.randn(heads, generator=g) if sinks else None

    def values(x: torch.Tensor) -> torch.Tensor:
        qx, sx = _numpy_rows(x)
        return torch.from_numpy(qx.astype(np.float32) * sx[..., None].astype(np.float32))

    kq, ks = kvquant.quantize_rows(prior_k)
    vq, vs = kvquant.quantize_rows(prior_v)
    got = paged_attention(q, k, v, kq, vq, _meta(), 0.25, sinks=sink, window=window,
                          k_scale=ks, v_scale=vs)
    want = paged_attention(q, values(k), values(v), values(prior_k), values(prior_v), _meta(),
                           0.25, sinks=sink, window=window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = paged_attention(q, k, v, prior_k.clone(), prior_v.clone(), _meta(), 0.25,
                            sinks=sink, window=window)
    assert not torch.equal(got, plain)  # the int8 rows were read, not the plain ones


def _logits(path: Path, kv: str, ids: list[int], chunk: int) -> torch.Tensor:
    from ftrs.llm import LLM

    llm = LLM(str(path), device="cpu", dtype="float32", kv_tokens=512, kv_cache_dtype=kv,
              max_prefill_length=chunk)
    try:
        return llm.logits(ids)
    finally:
        llm.close()


def _agree(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(share of positions with the same top token, mean error over the logits' spread)."""
    top = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    return top, float((got - want).abs().mean() / want.std())


def test_tiny_models_stay_close(tiny_models: dict[str, Path], deepseek_models: dict[str, Path],
                                hybrid_models: dict[str, Path]) -> None:
    """A GQA MoE, an MLA model (keys and values one latent row) and qwen3_next (gated
    attention beside DeltaNet layers) in chunks of 7 over 40 tokens: every chunk reads the rows
    the earlier ones wrote. Measured mean error over the spread: 0.005, 0.005, 0.039 (the
    random hybrid turns its ~0.8 % row errors into larger logit changes; a wrong scale or row
    would be of the order of 1)."""
    ids = [(i * 37 + 11) % 250 + 3 for i in range(40)]
    for path in (tiny_models["qwen3_moe"], deepseek_models["q_lora"], hybrid_models["qwen3_next"]):
        want = _logits(path, "auto", ids, 7)
        got = _logits(path, "int8", ids, 7)
        top, err = _agree(got, want)
        assert top >= 0.85 and 0 < err < 0.1, (path.name, top, err)


def test_demo_model_predicts_as_before(demo_model: Path) -> None:
    """The real SmolLM2 weights over a paragraph of English (71 tokens, chunks of 32): the
    plain cache's next-token choice at nearly every position, and its distribution within a
    small KL (measured: mean 0.0007, largest 0.003 nats)."""
    from ftrs.models.tokenizer import Tokenizer

    text = ("The history of the printing press begins in the fifteenth century, when Johannes "
            "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted "
            "from those used for wine. Within fifty years presses were at work in more than two "
            "hundred cities across Europe, and the price of books fell so far that reading "
            "spread from monasteries and universities to merchants and craftsmen.")
    ids = Tokenizer.from_dir(demo_model).encode(text)[:96]
    want = _logits(demo_model, "auto", ids, 32)
    got = _logits(demo_model, "int8", ids, 32)
    top, _ = _agree(got, want)
    lp, lq = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    assert top >= 0.95 and 0 < float(kl.mean()) < 0.005 and float(kl.max()) < 0.02, (top, kl)


def test_int8_cache_bytes(tiny_models: dict[str, Path]) -> None:
    """Per token and kv head: d bytes and a 4-byte scale against 4d bytes of fp32."""
    import json

    from ftrs.llm import LLM

    cfg = json.loads((tiny_models["qwen3_moe"] / "config.json").read_text())
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]

    sizes = {}
    for kv in ("auto", "int8"):
        llm = LLM(str(tiny_models["qwen3_moe"]), device="cpu", dtype="float32", kv_tokens=256,
                  kv_cache_dtype=kv)
        try:
            sizes[kv] = llm.engine.kv_cache_bytes()
        finally:
            llm.close()
    assert sizes["int8"] * 4 * d == sizes["auto"] * (d + 4)


def test_unknown_kv_dtype_is_a_config_error() -> None:
    from ftrs.config import EngineConfig

    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp4")
