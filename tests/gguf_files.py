"""Edits of GGUF files for tests: the same file with tensors dropped or added and metadata
changed, written back with the `gguf` package."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from ftrs.models.gguf_write import add_field


def rewrite(src: Path, dst: Path, drop: str | tuple[str, ...] = "",
            fields: dict[str, object] | None = None, extra: dict[str, np.ndarray] | None = None,
            drop_fields: tuple[str, ...] = ()) -> Path:
    """`src` again without the tensors whose names contain `drop` (or any of them), with
    `fields` changed (typed as `gguf_write.add_field` types them), `drop_fields` left out and
    the F32 tensors `extra` added."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    changed = fields or {}
    for key, field in reader.fields.items():
        if (key.startswith("GGUF.") or key == "general.architecture" or key in changed
                or key in drop_fields):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, field.contents(), vtype)
    for key, value in changed.items():
        add_field(w, key, value)
    for t in reader.tensors:
        if any(d and d in t.name for d in ((drop,) if isinstance(drop, str) else drop)):
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


def llama_cpp_logits(path: Path, ids: list[int], tmp: Path) -> torch.Tensor:
    """llama.cpp's logits of every position of `ids` on the file (the `llama_cpp` package of
    `llama-cpp-python`; an fp32 KV cache, one thread)."""
    import llama_cpp

    peer = llama_cpp.Llama(model_path=str(with_merges(path, tmp / "peer.gguf")), n_ctx=128,
                           n_batch=128, logits_all=True, verbose=False, n_threads=1, type_k=0,
                           type_v=0)
    peer.eval(ids)
    return torch.tensor(np.array(peer.scores[:len(ids)], dtype=np.float32))
