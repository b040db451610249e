"""`read_gguf_file` against `gguf.GGUFReader`, the oracle: the same metadata values
(`contents()`), the same tensors (type, dims, offset, array dtype, shape and bytes), on the real
SmolLM2 GGUF and on files written by `gguf.GGUFWriter` with every value type; the files it
leaves to the oracle (the other byte order, arrays of arrays) still open; bad files fail.
Quantized experts land in the pool as the file holds them (`fill_from_file`), and a split GGUF
opens from any of its shards as the unsplit file (same tensors, same logits bit for bit); a
missing, misnamed or misnumbered shard is a `ModelLoadError` naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as GT  # noqa: E402
from gguf import GGUFValueType as VT  # noqa: E402

from ftrs.errors import ModelLoadError  # noqa: E402
from ftrs.models.gguf_file import Unsupported, _read, read_gguf_file  # noqa: E402
from ftrs.models.gguf_loader import _reader, gguf_metadata  # noqa: E402
from ftrs.quant.fixtures import random_blocks  # noqa: E402


def assert_same_as_gguf(path: Path, fast: bool = True) -> None:
    """`fast`: read by this module's own parser (not handed to gguf's reader)."""
    ours = _read(path) if fast else read_gguf_file(path)
    ref = gguf.GGUFReader(str(path))
    want = gguf_metadata(ref)
    assert list(ours.metadata) == list(want)
    for key, value in want.items():
        got = ours.metadata[key]
        assert got == value and type(got) is type(value), key
        if isinstance(value, list) and value:
            assert type(got[0]) is type(value[0]), key
    assert ours.data_offset == ref.data_offset
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
               (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert a.data.tobytes() == b.data.tobytes(), a.name


def write_every_type(path: Path, endian: Any = None, alignment: int | None = None,
                     nested: bool = False) -> Path:
    kw = {} if endian is None else {"endianess": endian}
    w = gguf.GGUFWriter(str(path), "llama", **kw)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    scalars = [(VT.UINT8, 200), (VT.INT8, -7), (VT.UINT16, 60000), (VT.INT16, -300),
               (VT.UINT32, 4_000_000_000), (VT.INT32, -5), (VT.FLOAT32, 0.1),
               (VT.UINT64, 2**63 + 5), (VT.INT64, -(2**40)), (VT.FLOAT64, 1e-300),
               (VT.BOOL, True), (VT.STRING, "héllo ☃")]
    for vt, v in scalars:
        w.add_key_value(f"test.scalar.{vt.name.lower()}", v, vt)
    for vt, v in scalars:
        w.add_key_value(f"test.array.{vt.name.lower()}", [v, v, v], VT.ARRAY, sub_type=vt)
    w.add_array("test.tokens", [f"tok{i}" for i in range(3000)] + ["", "\n", "ü"])
    if nested:
        w.add_key_value("test.nested", [[1, 2], [3]], VT.ARRAY, sub_type=VT.ARRAY)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32))
    w.add_tensor("vec", rng.standard_normal(9).astype(np.float32))
    for qtype in ("Q4_K", "Q8_0"):
        blocks = random_blocks(qtype, 4, 256, rng)
        w.add_tensor(f"{qtype.lower()}", blocks, raw_shape=blocks.shape, raw_dtype=GT[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_real_smollm2_gguf_reads_as_gguf_reads_it(smollm_gguf: Path) -> None:
    assert_same_as_gguf(smollm_gguf)


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_and_tensor_type_reads_as_gguf_reads_it(tmp_path: Path,
                                                            alignment: int | None) -> None:
    assert_same_as_gguf(write_every_type(tmp_path / "all.gguf", alignment=alignment))


def test_a_string_array_that_is_not_utf8_is_left_out_as_gguf_leaves_it(tmp_path: Path) -> None:
    path = write_every_type(tmp_path / "bad_utf8.gguf")
    raw = bytearray(path.read_bytes())
    at = raw.index(b"tok2999")
    raw[at:at + 3] = b"\xff\xfe\xfd"  # one element of test.tokens stops being UTF-8
    path.write_bytes(bytes(raw))
    assert "test.tokens" not in read_gguf_file(path).metadata
    assert_same_as_gguf(path)


@pytest.mark.parametrize("case", ["big-endian", "nested-array"])
def test_files_left_to_gguf_still_open_with_the_same_values(tmp_path: Path, case: str) -> None:
    path = tmp_path / f"{case}.gguf"
    if case == "big-endian":
        write_every_type(path, endian=gguf.GGUFEndian.BIG)
    else:
        write_every_type(path, nested=True)
    with pytest.raises(Unsupported):
        _read(path)
    assert_same_as_gguf(path, fast=False)


@pytest.mark.parametrize("cut", ["header", "tensors"])
def test_a_cut_file_is_a_model_load_error(tmp_path: Path, cut: str) -> None:
    path = write_every_type(tmp_path / "whole.gguf")
    raw = path.read_bytes()
    keep = raw.index(b"test.tokens") + 40 if cut == "header" else len(raw) - 100
    short = tmp_path / "short.gguf"
    short.write_bytes(raw[:keep])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        _reader(short)


def test_not_a_gguf_is_a_model_load_error(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ModelLoadError, match="magic"):
        _reader(path)


def write_moe(path: Path, **kw: Any) -> None:
    """The tiny qwen3_moe of `quant_models` with every block type of a Q4_K_M-like mix."""
    from ftrs.models.gguf_write import write_gguf
    from ftrs.models.tiny import tiny_tensors, tiny_tokenizer
    from quant_models import QWEN3MOE_TYPES, _mixed, quant_config

    cfg = quant_config("qwen3_moe")
    write_gguf(path, cfg, tiny_tensors(cfg, 1), _mixed(QWEN3MOE_TYPES, 1), tiny_tokenizer(512),
               dequantized=False, **kw)


def pool_matches_file(path: Path, files: list[Path], fuse: bool = False) -> None:
    """Every expert tensor in the pool equals its bytes in `files` (gguf's reader)."""
    import torch

    from ftrs.models.load import load_model

    m = load_model(str(path), torch.device("cpu"), torch.float32, progress=False)
    assert m.experts is not None
    views = m.experts.views(m.experts.host_bytes())
    file = {t.name: np.asarray(t.data) for f in files for t in gguf.GGUFReader(str(f)).tensors}
    for layer in m.spec.moe_layers:
        for e in range(m.spec.num_experts):
            if fuse:
                rows = file[f"blk.{layer}.ffn_gate_up_exps.weight"][e]
                half = rows.shape[0] // 2
                want = [rows[:half], rows[half:]]
            else:
                want = [file[f"blk.{layer}.ffn_{n}_exps.weight"][e] for n in ("gate", "up")]
            want.append(file[f"blk.{layer}.ffn_down_exps.weight"][e])
            for got, w in zip(views[layer][e], want, strict=True):
                assert np.array_equal(got.data.numpy(), w.reshape(-1)), (layer, e)


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused-gate-up"])
def test_quantized_experts_are_copied_from_the_file_byte_for_byte(
        tmp_path: Path, fuse: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from ftrs.models.experts import HostExperts

    path = tmp_path / "moe.gguf"
    write_moe(path, fuse_gate_up=fuse)

    def refuse(*_: Any) -> None:
        raise AssertionError("a quantized expert went through the per-tensor write")

    monkeypatch.setattr(HostExperts, "write", refuse)  # every one comes from fill_from_file
    pool_matches_file(path, [path], fuse)


def test_a_split_gguf_opens_from_any_shard_as_the_whole_file(tmp_path: Path) -> None:
    import torch

    from ftrs.llm import LLM

    whole = tmp_path / "whole" / "moe.gguf"
    whole.parent.mkdir()
    write_moe(whole)
    split_dir = tmp_path / "split"
    split_dir.mkdir()
    write_moe(split_dir / "moe.gguf", split_max_tensors=9)
    shards = sorted(split_dir.glob("moe-*-of-*.gguf"))
    assert len(shards) >= 3 and not (split_dir / "moe.gguf").exists()
    assert [s.name for s in shards][:2] == [f"moe-0000{i}-of-{len(shards):05d}.gguf"
                                            for i in (1, 2)]
    one = read_gguf_file(whole)
    for start in (shards[0], shards[-1]):  # any shard names the set
        got = _reader(start)
        assert got.path == shards[0] and len(got.shards) == len(shards)
        assert [t.name for t in got.tensors] == [t.name for t in one.tensors]
        for a, b in zip(got.tensors, one.tensors, strict=True):
            assert a.data.tobytes() == b.data.tobytes() and a.tensor_type == b.tensor_type
        keys = {k for k in got.metadata if not k.startswith(("split.", "GGUF."))}
        assert keys == {k for k in one.metadata if not k.startswith("GGUF.")}
    pool_matches_file(shards[1], shards)
    from ftrs.models.load import resolve_model

    assert resolve_model(str(shards[-1])) == shards[0]  # one name for the model, whichever shard
    ids = list(range(3, 40))
    logits = []
    for path in (whole, shards[0]):
        llm = LLM(str(path), kv_tokens=256, dtype="float32", device="cpu")
        try:
            logits.append(llm.logits(ids))
        finally:
            llm.close()
    assert torch.equal(logits[0], logits[1])


def test_a_broken_split_set_is_a_model_load_error_naming_the_shard(tmp_path: Path) -> None:
    write_moe(tmp_path / "moe.gguf", split_max_tensors=9)
    shards = sorted(tmp_path.glob("moe-*-of-*.gguf"))
    n = len(shards)
    gone = shards[1].rename(tmp_path / "elsewhere.gguf")
    with pytest.raises(ModelLoadError, match=f"moe-00002-of-{n:05d}.gguf not found"):
        _reader(shards[0])
    gone.rename(shards[1])
    renamed = tmp_path / "model.gguf"  # a shard whose name no longer says the set
    shards[0].rename(renamed)
    with pytest.raises(ModelLoadError, match="cannot be found"):
        _reader(renamed)
    renamed.rename(shards[0])
    shards[2].rename(tmp_path / "x.gguf")  # two shards swapped: their split.no says so
    shards[1].rename(shards[2])
    (tmp_path / "x.gguf").rename(shards[1])
    with pytest.raises(ModelLoadError, match="says it is shard 2 of"):
        _reader(shards[0])
