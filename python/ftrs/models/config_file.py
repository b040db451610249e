"""A checkpoint directory's `config.json`, read for `arch.load_arch`.

What is wrong with the file itself is said here, naming it: no such file (with the GGUF file to
pass instead where the directory holds GGUF files), not JSON, a shape field that is not an
integer (`"hidden_size": "64"` would otherwise be cast, or fail later as a traceback), a size
or count that is not at least 1 (`POSITIVE_FIELDS`: zero heads would end in a
ZeroDivisionError, zero layers in a model that fails on its first step). ModelOpt
exports name their quantization in `hf_quant_config.json`, merged in as `quantization_config`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ftrs.errors import ModelLoadError

#: fields read as integers (None, HF's spelling of "not set", is allowed: the reader's default)
INT_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings",
    "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "decoder_sparse_step", "shared_expert_intermediate_size", "sliding_window",
    "full_attention_interval", "linear_num_key_heads", "linear_num_value_heads",
    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
    "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_routed_experts", "n_shared_experts", "n_group", "topk_group", "first_k_dense_replace",
    "moe_layer_freq", "rotary_dim",
)

#: of `INT_FIELDS`, the shape fields that must be at least 1 where they are set
POSITIVE_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
    "max_position_embeddings",
)


def check_int_fields(cfg: dict[str, Any], source: str) -> None:
    """ModelLoadError naming the first of `INT_FIELDS` in `cfg` (or its `text_config`) whose
    value is neither an integer nor null (a bool is no integer here), or the first of
    `POSITIVE_FIELDS` below 1."""
    text = cfg.get("text_config")
    for part in (cfg, text) if isinstance(text, dict) else (cfg,):
        for key in INT_FIELDS:
            v = part.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise ModelLoadError(source, f"field {key!r} must be an integer, got "
                                     f"{json.dumps(v)}")
            if v is not None and key in POSITIVE_FIELDS and v < 1:
                raise ModelLoadError(source, f"field {key!r} must be >= 1, got {v}")


def _gguf_hint(model_dir: Path) -> str:
    """Where a directory without config.json holds GGUF files: which one to pass (a split
    model's first shard)."""
    from ftrs.models.gguf_file import SHARD_NAME

    files = sorted(p for p in model_dir.glob("*.gguf") if p.is_file())
    if not files:
        return ""
    first = next((p for p in files if (m := SHARD_NAME.match(p.name)) and int(m["no"]) == 1),
                 files[0])
    return f"; {model_dir} holds GGUF files; pass one of them: {first}"


def read_config(model_dir: Path) -> dict[str, Any]:
    """The parsed config.json of `model_dir` (ModelLoadError naming the file otherwise)."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(str(path), "config.json not found" + _gguf_hint(model_dir))
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(str(path), f"cannot parse: {e}") from e
    if not isinstance(cfg, dict):
        raise ModelLoadError(str(path), "not a JSON object")
    check_int_fields(cfg, str(path))
    hq = model_dir / "hf_quant_config.json"
    if "quantization_config" not in cfg and hq.is_file():
        # ModelOpt's exports name their quantization there, not in config.json
        try:
            q = json.loads(hq.read_text()).get("quantization")
        except (OSError, json.JSONDecodeError, AttributeError) as e:
            raise ModelLoadError(str(hq), f"cannot parse: {e}") from e
        if not isinstance(q, dict):
            raise ModelLoadError(str(hq), "no \"quantization\" object")
        cfg["quantization_config"] = {"quant_method": "modelopt", **q}
    return cfg
