"""A GGUF file's header in one pass: its metadata as Python values and its tensors as numpy
views of the mapped file, what `gguf.GGUFReader` gives, without its cost.

`gguf.GGUFReader` makes a numpy view per value of every metadata array: about 40 µs each,
so the demo's 49,152-token vocabulary and its merges take 4 s to open, and a 150k-token
vocabulary three times that, on every start and again for the link guard's fetch model. Here
the header is read with `struct` over one `mmap` (strings sliced and decoded, numeric arrays one
`numpy.frombuffer` each); the values are what `ReaderField.contents()` returns, the tensors'
arrays what `ReaderTensor.data` is (dtype, shape, bytes), and the `gguf` package's tables say
each type's block size (`tests/models/test_gguf_file.py` holds the two readers equal on every
fixture). A file this reader does not take (the other byte order, arrays of arrays) is read by
`gguf.GGUFReader` and converted, so every file `gguf` reads opens here too.

Tensor data is laid out as llama.cpp's `gguf_init_from_file` demands (`check_layout`): in
header order, each tensor where the one before it ends, padded to `general.alignment` (the
first at the data section's start), so no two overlap and none leaves a gap. A file edited off
that layout (an offset moved, a tensor retyped so that its size no longer fills its slot) is
refused (`LayoutError`) rather than read as shifted, garbage weights. A split GGUF's shards
are each checked against their own data section.

`read_gguf_set` opens a split GGUF (llama.cpp's `gguf-split` output, how files past 50 GB are
published) from any of its shards: the first shard's metadata, every shard's tensors, each
shard's mapping (`Mapped`) so the expert pool is filled from each file by its offsets.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY, BOOL = 8, 9, 7
# GGUFValueType -> (struct format, numpy dtype) of the fixed-size scalar types
SCALARS: dict[int, tuple[str, Any]] = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}
# ggml types whose arrays `gguf` gives as elements (the rest: bytes, last dim in bytes)
ELEMENT_TYPES: dict[str, Any] = {"F16": np.float16, "F32": np.float32, "F64": np.float64,
                                 "I8": np.int8, "I16": np.int16, "I32": np.int32,
                                 "I64": np.int64}


class Unsupported(Exception):
    """A valid file this reader leaves to `gguf.GGUFReader`."""


class TensorInfo(NamedTuple):
    """`gguf.ReaderTensor`'s fields that the loader reads."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # uint64 dims, innermost first (the file's order)
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray  # a view of the mapped file


class Mapped(NamedTuple):
    """A mapped file: a view's file offset is its address minus `base_address`."""

    path: Path
    base_address: int
    size: int


@dataclass
class GGUFFile:
    """The header of `path`: `metadata` (key -> value, `GGUF.version`, `GGUF.tensor_count` and
    `GGUF.kv_count` included, as `gguf` lists them) and `tensors` in file order; of a split
    file (`read_gguf_set`), the first shard's metadata and every shard's tensors, in shard order."""

    path: Path
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_offset: int
    shards: list[Mapped]  # the files the tensors' arrays are views of

    def file_offset(self, view: np.ndarray) -> tuple[Path, int] | None:
        """(file, offset) of a C-contiguous view of one of the mapped files (a tensor's data,
        one expert of it); None for anything else."""
        return file_offset(self.shards, view)


def file_offset(shards: list[Mapped], view: np.ndarray) -> tuple[Path, int] | None:
    """`GGUFFile.file_offset` over `shards`."""
    if not view.flags.c_contiguous:
        return None
    address = int(view.ctypes.data)
    for m in shards:
        at = address - m.base_address
        if 0 <= at <= m.size - view.nbytes:
            return m.path, at
    return None


class LayoutError(ValueError):
    """Tensor data off llama.cpp's layout: misaligned, overlapping another tensor's, or not
    where the tensor before it ends."""


def check_layout(tensors: list[TensorInfo], data_offset: int, alignment: int) -> None:
    """LayoutError naming the first tensor (by offset) whose data does not start at a multiple
    of `alignment` from `data_offset`, or starts before the previous tensor's data ends; then
    the first, in header order, that does not start where the one before it ends, padded to
    `alignment` (the first at 0), as `gguf_init_from_file` demands. A gap is where a retyped
    tensor no longer fills its slot: its declared type is not what was written there."""
    end, last = 0, ""
    for t in sorted(tensors, key=lambda t: (t.data_offset, t.n_bytes)):
        at = t.data_offset - data_offset
        if at % alignment:
            raise LayoutError(f"tensor {t.name}: data offset {at} is not a multiple of "
                              f"general.alignment {alignment}")
        if at < end:
            raise LayoutError(f"tensor {t.name}: data [{at}, {at + t.n_bytes}) overlaps tensor "
                              f"{last}'s, which ends at {end}")
        end, last = at + t.n_bytes, t.name
    end, last = 0, ""
    for t in tensors:
        at, want = t.data_offset - data_offset, -(-end // alignment) * alignment
        if at != want:
            where = (f"where tensor {last} before it ends ({end}) padded to general.alignment "
                     f"{alignment}" if last else "the data section's start")
            raise LayoutError(f"tensor {t.name}: data offset {at}, expected {want}, {where}: a "
                              "wrong type, shape or offset in the header")
        end, last = at + t.n_bytes, t.name


class ShardError(ValueError):
    """A split GGUF whose shards do not make one set (missing, misnamed, out of order)."""


SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def read_gguf_set(path: Path) -> GGUFFile:
    """`path`, or the whole set when it is one shard of a split GGUF (llama.cpp's `gguf-split`
    and `gguf.GGUFWriter` write `<name>-00001-of-0000N.gguf`, ..., the model's metadata in the
    first, `split.no` / `split.count` in each): any shard's path opens the set. ValueError for
    a bad file, `ShardError` for a bad set."""
    one = read_gguf_file(path)
    count = int(one.metadata.get("split.count") or 0)
    if count <= 1:
        return one
    m = SHARD_NAME.match(path.name)
    if m is None or int(m["count"]) != count:
        raise ShardError(f"{path.name} is shard {one.metadata.get('split.no', '?')} of a "
                         f"{count}-file split GGUF, but its name is not "
                         f"<name>-NNNNN-of-{count:05d}.gguf, so the others cannot be found")
    paths = [path.with_name(f"{m['stem']}-{i + 1:05d}-of-{count:05d}.gguf") for i in range(count)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ShardError(f"split GGUF of {count} files: {', '.join(missing)} not found beside "
                         f"{path.name}")
    files = [one if p == path else read_gguf_file(p) for p in paths]
    names: set[str] = set()
    for i, f in enumerate(files):
        no, n = f.metadata.get("split.no"), f.metadata.get("split.count")
        if (no, n) != (i, count):
            raise ShardError(f"{paths[i].name} says it is shard {no} of {n}, expected {i} of "
                             f"{count}")
        dup = names & {t.name for t in f.tensors}
        if dup:
            raise ShardError(f"tensor {sorted(dup)[0]} is in more than one shard")
        names |= {t.name for t in f.tensors}
    want = files[0].metadata.get("split.tensors.count")
    if want is not None and want != len(names):
        raise ShardError(f"the shards hold {len(names)} tensors, the first says {want}")
    return GGUFFile(paths[0], files[0].metadata, [t for f in files for t in f.tensors],
                    files[0].data_offset, [s for f in files for s in f.shards])


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.at = buf, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buf):
            raise ValueError(f"header runs past the end of the file at byte {self.at}")
        (v,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += size
        return v

    def raw_string(self) -> bytes:
        n = self.take("<Q")
        if self.at + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        s = bytes(self.buf[self.at:self.at + n])
        self.at += n
        return s

    def string(self) -> str:
        return self.raw_string().decode("utf-8")

    def array(self) -> Any:
        """An array value; a string array's element that is not UTF-8 fails the field (as
        `contents()` fails), reported by the caller."""
        itype, n = self.take("<I"), self.take("<Q")
        if itype == STRING:
            return [self.raw_string() for _ in range(n)]
        if itype == ARRAY:
            raise Unsupported("an array of arrays")
        if itype not in SCALARS:
            raise ValueError(f"unknown array element type {itype}")
        fmt, dtype = SCALARS[itype]
        size = struct.calcsize(fmt) * n
        if self.at + size > len(self.buf):
            raise ValueError(f"an array of {n} values runs past the end of the file")
        values = np.frombuffer(self.buf, dtype=np.dtype(dtype).newbyteorder("<"), count=n,
                               offset=self.at).tolist()
        self.at += size
        return values

    def value(self, vtype: int) -> Any:
        if vtype == STRING:
            return self.raw_string()
        if vtype == ARRAY:
            return self.array()
        if vtype not in SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.take(SCALARS[vtype][0])


def _text(v: Any) -> Any:
    """Strings as `contents()` gives them: decoded (strict UTF-8)."""
    if isinstance(v, bytes):
        return v.decode("utf-8")
    if isinstance(v, list) and v and isinstance(v[0], bytes):
        return [s.decode("utf-8") for s in v]
    return v


def read_gguf_file(path: Path) -> GGUFFile:
    """The header of `path`; ValueError for a file that is not GGUF or is cut short,
    `LayoutError` for tensor data off llama.cpp's layout."""
    try:
        return _read(path)
    except Unsupported:
        return _from_gguf_reader(path)


def _read(path: Path) -> GGUFFile:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise ValueError(f"{size} bytes: too short for a GGUF header")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(memoryview(mm))
    if bytes(cur.buf[:4]) != MAGIC:
        raise ValueError("GGUF magic invalid")
    cur.at = 4
    version = cur.take("<I")
    if version & 0xFFFF == 0:
        raise Unsupported("the other byte order")
    if version not in VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (2, 3)")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors,
                            "GGUF.kv_count": n_kv}
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key = cur.string()
        if key in meta:
            raise KeyError(f"Duplicate {key} already in list")
        vtype = cur.take("<I")
        value = cur.value(vtype)
        if key == "general.alignment":
            if vtype != 4 or value == 0 or value & (value - 1):
                raise ValueError("general.alignment must be a power of two as a uint32")
            alignment = value
        try:
            meta[key] = _text(value)
        except UnicodeDecodeError:  # a field `contents()` cannot render: left out, as gguf's
            continue
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
        infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
    data_offset = -(-cur.at // alignment) * alignment
    tensors, seen = [], set()
    arr = np.frombuffer(mm, dtype=np.uint8)
    for name, dims, raw_type, offset in infos:
        if name in seen:
            raise ValueError(f"Found duplicated tensor with name {name}")
        seen.add(name)
        qtype = GGMLQuantizationType(raw_type)
        n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elems * type_size // block
        start = data_offset + offset
        if start + n_bytes > size:
            raise ValueError(f"tensor {name} ([{start}, +{n_bytes})) runs past the end of the "
                             f"file ({size} bytes)")
        np_dims = tuple(reversed(dims))
        dtype = ELEMENT_TYPES.get(qtype.name)
        if dtype is None:
            data = arr[start:start + n_bytes].reshape(quant_shape_to_byte_shape(np_dims, qtype))
        else:
            data = arr[start:start + n_bytes].view(dtype).reshape(np_dims)
        tensors.append(TensorInfo(name, qtype, np.array(dims, dtype=np.uint64), n_elems, n_bytes,
                                  start, data))
    check_layout(tensors, data_offset, alignment)
    return GGUFFile(path, meta, tensors, data_offset, [Mapped(path, int(arr.ctypes.data), size)])


def _from_gguf_reader(path: Path) -> GGUFFile:
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = reader_metadata(reader)
    tensors = [TensorInfo(t.name, t.tensor_type, t.shape, t.n_elements, t.n_bytes,
                          t.data_offset, t.data) for t in reader.tensors]
    check_layout(tensors, int(reader.data_offset), int(reader.alignment))
    return GGUFFile(path, meta, tensors, int(reader.data_offset),
                    [Mapped(path, int(reader.data.ctypes.data), int(reader.data.nbytes))])


def reader_metadata(reader: Any) -> dict[str, Any]:
    """Key -> value of a `gguf.GGUFReader`'s fields, as `contents()` renders them (a field it
    cannot render left out)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception:  # a field type the package cannot render: not one we use
            continue
    return meta
