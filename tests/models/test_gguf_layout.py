"""A GGUF file's tensor data where llama.cpp's `gguf_init_from_file` wants it: at a multiple of
`general.alignment` from the data section, no two tensors over the same bytes, each where the
one before it in the header ends, padded (`gguf_file.check_layout`). An edited offset, or a
retyped tensor that no longer fills its slot, is refused, naming the tensor, instead of loading
weights shifted by a few bytes (or read in the wrong type) that then answer garbage."""

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


def _set(path: Path, name: str, **parts: int) -> Path:
    """`path` with tensor `name`'s header fields changed: `qtype` (its type code), `at` (its
    data offset relative to the data section)."""
    r = gguf.GGUFReader(str(path), "r+")
    t = next(t for t in r.tensors if t.name == name)
    if "qtype" in parts:
        t.field.parts[4][0] = parts["qtype"]
    if "at" in parts:
        t.field.parts[5][0] = parts["at"]
    r.data.flush()
    return path


def test_a_retyped_tensor_that_no_longer_fills_its_slot_is_refused(tmp_path: Path) -> None:
    """Q4_K -> MXFP4 in the header: 4 x 256 values declare 544 bytes where 576 were written, so
    the next tensor no longer starts where this one ends (ggml's reader refuses the file; read
    anyway, the weights are garbage and the logits NaN)."""
    path = write_every_type(tmp_path / "t.gguf")
    r = gguf.GGUFReader(str(path))
    q4k, q80 = (next(t for t in r.tensors if t.name == n) for n in ("q4_k", "q8_0"))
    start, nxt = q4k.data_offset - r.data_offset, q80.data_offset - r.data_offset
    del r
    _set(path, "q4_k", qtype=int(gguf.GGMLQuantizationType.MXFP4))
    end = start + 4 * 256 // 32 * 17
    assert end % 32 == 0 and end < nxt  # a gap, not an overlap
    with pytest.raises(ModelLoadError) as e:
        _reader(path)
    assert str(e.value) == (f"{path}: tensor q8_0: data offset {nxt}, expected {end}, where "
                            f"tensor q4_k before it ends ({end}) padded to general.alignment "
                            "32: a wrong type, shape or offset in the header")


def test_tensors_out_of_header_order_or_after_a_gap_are_refused(tmp_path: Path) -> None:
    """Aligned, not overlapping, yet off ggml's layout: two tensors' offsets swapped, or the
    last tensor one alignment further on than where the one before it ends."""
    path = write_every_type(tmp_path / "s.gguf")
    r = gguf.GGUFReader(str(path))
    f16, i32 = (next(t for t in r.tensors if t.name == n).data_offset - r.data_offset
                for n in ("f16", "i32"))
    del r
    _set(_set(path, "f16", at=i32), "i32", at=f16)
    with pytest.raises(ModelLoadError, match=rf"tensor f16: data offset {i32}, expected {f16}, "
                       r"where tensor f32 before it ends \(60\) padded"):
        _reader(path)
    first = write_every_type(tmp_path / "g.gguf")
    r = gguf.GGUFReader(str(first))
    last = r.tensors[-1]
    gap_at, room = last.data_offset - r.data_offset, len(r.data) - last.data_offset
    del r
    assert room >= last.n_bytes
    with open(first, "ab") as f:  # room for the last tensor one alignment on
        f.write(bytes(32))
    _set(first, "q8_0", at=gap_at + 32)
    with pytest.raises(ModelLoadError, match=rf"tensor q8_0: data offset {gap_at + 32}, "
                       rf"expected {gap_at}, where tensor q4_k before it ends"):
        _reader(first)


def test_every_file_the_writers_lay_out_passes(tmp_path: Path) -> None:
    """gguf's writer, big-endian and at another alignment included, lays tensors out as ggml
    does: none is refused."""
    for i, kw in enumerate([{}, {"endian": gguf.GGUFEndian.BIG}, {"alignment": 64}]):
        assert len(_reader(write_every_type(tmp_path / f"w{i}.gguf", **kw)).tensors) == 6
