"""DeepSeek-V2/V3 GGUF files (llama.cpp's `deepseek2`) against transformers.

The files are the tiny checkpoints of `tests/deepseek_models.py` (conftest's `deepseek_models`:
V3 with and without q_lora, V3 with YaRN, V2-Lite's shape, V2's group-limited routing) written as
llama.cpp's converter writes them (`models.gguf_deepseek`): MLA as one wide MQA head, kv_b cut
per head into k_b (transposed) and v_b, the router's correction bias as `exp_probs_b.bias`, the
routing in `expert_*` fields, YaRN's mscale as its log multiplier. The oracle is transformers on
the source checkpoint, within 1e-4 as in `test_deepseek.py`; with Q8_0 experts, transformers on
the experts' dequantized values. llama.cpp (`llama-cpp-python`, where installed) is the peer.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import deepseek_models
from ftrs.errors import ModelLoadError
from ftrs.llm import LLM
from ftrs.models.gguf_loader import open_gguf
from ftrs.models.gguf_write import gguf_quantizer, keep_f32, write_gguf
from ftrs.models.load import load_model
from ftrs.models.tokenizer import Tokenizer
from ftrs.quant import QuantTensor, use_kernels
from gguf_files import llama_cpp_logits, rewrite

pytest.importorskip("transformers.models.deepseek_v3")
TOL = 1e-4
PEER_TOL = 1e-4  # measured: see docs/models.md
IDS = [(i * 37 + 11) % 509 + 3 for i in range(57)]
VARIANTS = ["q_lora", "no_q_lora", "yarn", "v2_lite", "v2_grouped", "glm_lite"]
#: the config fields a deepseek2 file carries, as transformers wrote them
FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
          "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
          "intermediate_size", "first_k_dense_replace", "routed_scaling_factor",
          "norm_topk_prob", "num_attention_heads", "num_hidden_layers", "hidden_size")


def _write(src: Path, out: Path, quantize: object = keep_f32) -> dict[str, torch.Tensor]:
    cfg = json.loads((src / "config.json").read_text())
    return write_gguf(out, cfg, load_file(str(src / "model.safetensors")), quantize,  # type: ignore[arg-type]
                      Tokenizer.from_dir(src))


@pytest.fixture(scope="module")
def files(deepseek_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
          ) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek_gguf")
    for name, src in deepseek_models.items():
        _write(src, root / f"{name}.gguf")
    return {name: root / f"{name}.gguf" for name in deepseek_models}


def _ref(src: Path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return deepseek_models.hf_model(src)(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(files: dict[str, Path], deepseek_models: dict[str, Path],
                                   variant: str) -> None:
    llm = LLM(str(files[variant]), kv_tokens=1024, dtype="float32")
    ours = llm.logits(IDS)
    ref = _ref(deepseek_models[variant], IDS)
    assert ref.abs().max().item() > 1.0
    assert (ours - ref).abs().max().item() <= TOL
    llm.close()


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_config_comes_from_the_metadata(files: dict[str, Path],
                                            deepseek_models: dict[str, Path], variant: str) -> None:
    src = json.loads((deepseek_models[variant] / "config.json").read_text())
    ck = open_gguf(files[variant])
    cfg = ck.config
    # GLM-4.7-Flash's file is deepseek2 with sigmoid gating: deepseek_v3, its design
    assert cfg["model_type"] == src["model_type"].replace("glm4_moe_lite", "deepseek_v3")
    assert {k: cfg[k] for k in FIELDS} == {k: src[k] for k in FIELDS}
    assert (cfg["n_group"], cfg["topk_group"]) == (src["n_group"] or 1, src["topk_group"] or 1)
    assert cfg["topk_method"] == src.get("topk_method", "noaux_tc")
    scaling = src["rope_parameters"]
    if scaling["rope_type"] == "yarn":
        assert {k: cfg["rope_scaling"][k] for k in ("factor", "mscale", "mscale_all_dim")} == {
            k: scaling[k] for k in ("factor", "mscale", "mscale_all_dim")}
    else:
        assert "rope_scaling" not in cfg
    # kv_b is rebuilt from the file's k_b (transposed) and v_b to the source's values exactly
    tensors = load_file(str(deepseek_models[variant] / "model.safetensors"))
    for layer in range(src["num_hidden_layers"]):
        name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        assert torch.equal(ck.dense[name].to_float(), tensors[name])
    assert not any(".k_b_proj" in n or ".v_b_proj" in n for n in ck.dense)


def test_a_file_from_before_the_kv_b_split_runs_the_same(files: dict[str, Path],
                                                          deepseek_models: dict[str, Path],
                                                          tmp_path: Path) -> None:
    # llama.cpp's converter wrote one attn_kv_b and the real head sizes in key_length /
    # value_length until it split kv_b for its absorbed attention; such files are common
    src = json.loads((deepseek_models["q_lora"] / "config.json").read_text())
    tensors = load_file(str(deepseek_models["q_lora"] / "model.safetensors"))
    kv_b = {f"blk.{i}.attn_kv_b.weight": tensors[f"model.layers.{i}.self_attn.kv_b_proj.weight"]
            .numpy() for i in range(src["num_hidden_layers"])}
    old = rewrite(files["q_lora"], tmp_path / "old.gguf", drop=("attn_k_b", "attn_v_b"),
                  extra=kv_b, drop_fields=("deepseek2.attention.key_length_mla",
                                           "deepseek2.attention.value_length_mla"),
                  fields={"deepseek2.attention.key_length": 20,
                          "deepseek2.attention.value_length": 10})
    assert "deepseek2.attention.key_length_mla" not in gguf.GGUFReader(str(old)).fields
    ours = LLM(str(old), kv_tokens=1024, dtype="float32").logits(IDS)
    assert torch.equal(ours, LLM(str(files["q_lora"]), kv_tokens=1024, dtype="float32").logits(IDS))


def test_q8_experts_match_transformers_on_their_values(tmp_path: Path) -> None:
    # rows of 64 and 32 values: Q8_0's 32-blocks fit the experts' gate/up and down
    src = deepseek_models.build(tmp_path / "src", seed=4, hidden_size=64,
                                moe_intermediate_size=32, intermediate_size=64)

    def experts_q8(name: str, w: np.ndarray) -> tuple[str, np.ndarray]:
        return gguf_quantizer("Q8_0", min_dims=3)(name, w) if w.ndim == 3 else keep_f32(name, w)

    held = _write(src, tmp_path / "q8.gguf", experts_q8)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (ref_dir / f.name).write_bytes(f.read_bytes())
    save_file({k: v.contiguous() for k, v in held.items()}, str(ref_dir / "model.safetensors"))
    source = load_file(str(src / "model.safetensors"))
    name = "model.layers.1.mlp.experts.2.gate_proj.weight"
    assert not torch.equal(held[name], source[name])  # the reference sees the Q8_0 values

    llm = LLM(str(tmp_path / "q8.gguf"), kv_tokens=1024, dtype="float32")
    with use_kernels(False):  # the Rust kernels round activations to int8 digits
        assert (llm.logits(IDS) - _ref(ref_dir, IDS)).abs().max().item() <= TOL
    m = load_model(str(tmp_path / "q8.gguf"), torch.device("cpu"), torch.float32, progress=False)
    assert m.experts is not None
    gate = m.experts.views(m.experts.host_bytes())[1][2][0]  # layer 1 (the first MoE one), expert 2
    assert isinstance(gate, QuantTensor) and gate.qtype == "Q8_0"
    off = LLM(str(tmp_path / "q8.gguf"), kv_tokens=1024, dtype="float32", moe_strategy="offload",
              moe_cache_rate=0.25)
    assert torch.equal(off.logits(IDS), llm.logits(IDS))
    off.close()
    llm.close()


def test_a_file_that_cannot_be_run_is_refused_by_name(files: dict[str, Path],
                                                      tmp_path: Path) -> None:
    no_v_b = rewrite(files["q_lora"], tmp_path / "a.gguf", drop="blk.2.attn_v_b")
    with pytest.raises(ModelLoadError, match=r"blk\.2\.attn_k_b\.weight without its attn_v_b"):
        open_gguf(no_v_b)
    gating = rewrite(files["q_lora"], tmp_path / "b.gguf",
                     fields={"deepseek2.expert_gating_func": 3})
    with pytest.raises(ModelLoadError, match="expert_gating_func 3"):
        open_gguf(gating)
    no_router = rewrite(files["q_lora"], tmp_path / "c.gguf", drop="blk.3.ffn_gate_inp")
    with pytest.raises(ModelLoadError, match=r"routers .* in layers \[1, 2\], expected 1..3"):
        open_gguf(no_router)


#: V2 with q_lora and one group: llama.cpp reads a file without `attention.q_lora_rank` as
#: V2-Lite only when it has V2-Lite's 26 or 27 layers, and scores groups unlike V2 (below)
V2_PEER = {"arch": "deepseek_v2", "n_group": None, "topk_group": None, "topk_method": "greedy",
           "routed_scaling_factor": 1.0, "norm_topk_prob": False}


@pytest.mark.parametrize("variant", ["q_lora", "yarn", "v2"])
def test_llama_cpp_computes_the_same_model(files: dict[str, Path], variant: str,
                                           tmp_path: Path) -> None:
    """The peer on the F32 files (fp32 KV cache), where `llama-cpp-python` is installed. V2's
    group-limited routing is left out: llama.cpp scores every file's groups by their top two
    experts, V2 by its best one (transformers and ftrs)."""
    pytest.importorskip("llama_cpp")
    path = files.get(variant)
    if path is None:
        path = tmp_path / "v2.gguf"
        _write(deepseek_models.build(tmp_path / "src", seed=3, **V2_PEER), path)
    theirs = llama_cpp_logits(path, IDS, tmp_path)
    ours = LLM(str(path), kv_tokens=1024, dtype="float32").logits(IDS)
    assert (ours - theirs).abs().max().item() <= PEER_TOL
