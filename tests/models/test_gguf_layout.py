"""A GGUF file's tensor data where llama.cpp's `gguf_init_from_file` wants it: at a multiple of
`general.alignment` from the data section, no two tensors over the same bytes
(`gguf_file.check_layout`). An edited offset is refused, naming the tensor, instead of loading
weights shifted by a few bytes that then answer garbage."""

from __future__ import annotations

from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

from test_gguf_file import write_every_type  # noqa: E402

from ftrs.errors import ModelLoadError  # noqa: E402
from ftrs.models.gguf_loader import _reader  # noqa: E402


def _moved(path: Path, name: str, to: str) -> Path:
    """`path` with tensor `name`'s data offset (relative to the data section) moved: one byte
    on ("misaligned"), or onto the first tensor's ("overlap")."""
    r = gguf.GGUFReader(str(path), "r+")
    t = next(t for t in r.tensors if t.name == name)
    first = r.tensors[0]
    at = t.data_offset - r.data_offset
    t.field.parts[5][0] = at + 1 if to == "misaligned" else first.data_offset - r.data_offset
    r.data.flush()
    return path


@pytest.mark.parametrize("endian", [None, "big"])
def test_a_misaligned_tensor_is_refused_by_name(tmp_path: Path, endian: str | None) -> None:
    order = gguf.GGUFEndian.BIG if endian else None  # big-endian: read by gguf's own reader
    path = _moved(write_every_type(tmp_path / "m.gguf", endian=order), "f16", "misaligned")
    with pytest.raises(ModelLoadError, match=r"tensor f16: data offset \d+ is not a multiple "
                       r"of general\.alignment 32") as e:
        _reader(path)
    assert e.value.path == str(path)


def test_a_misaligned_tensor_is_measured_against_the_files_own_alignment(tmp_path: Path) -> None:
    path = write_every_type(tmp_path / "a64.gguf", alignment=64)
    r = gguf.GGUFReader(str(path), "r+")
    t = next(t for t in r.tensors if t.name == "i32")
    t.field.parts[5][0] = t.data_offset - r.data_offset + 32  # aligned to 32, not to 64
    r.data.flush()
    del r
    with pytest.raises(ModelLoadError, match=r"tensor i32: .* general\.alignment 64"):
        _reader(path)


def test_tensors_over_the_same_bytes_are_refused(tmp_path: Path) -> None:
    path = _moved(write_every_type(tmp_path / "o.gguf"), "vec", "overlap")
    with pytest.raises(ModelLoadError, match=r"tensor (vec|f32): data \[0, \d+\) overlaps "
                       r"tensor (f32|vec)'s"):
        _reader(path)
