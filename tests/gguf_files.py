"""Edits of GGUF files for tests: the same file with tensors dropped or added and metadata
changed, written back with the `gguf` package."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def rewrite(src: Path, dst: Path, drop: str = "", fields: dict[str, object] | None = None,
            extra: dict[str, np.ndarray] | None = None) -> Path:
    """`src` again without the tensors whose names contain `drop`, with `fields` changed (ints
    as uint32, floats as float32, strings, lists) and the F32 tensors `extra` added."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    changed = fields or {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in changed:
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, field.contents(), vtype)
    for key, value in changed.items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, float(value))  # type: ignore[arg-type]
    for t in reader.tensors:
        if drop and drop in t.name:
            continue
        data = np.asarray(t.data)
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    for name, arr in (extra or {}).items():
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def with_merges(src: Path, dst: Path) -> Path:
    """`src` with a one-entry merges list: llama.cpp refuses a BPE vocabulary without one (the
    tiny test tokenizers have none; the tests feed token ids)."""
    tokens = gguf.GGUFReader(str(src)).fields["tokenizer.ggml.tokens"].contents()
    return rewrite(src, dst, fields={"tokenizer.ggml.merges": [f"{tokens[3]} {tokens[4]}"]})
