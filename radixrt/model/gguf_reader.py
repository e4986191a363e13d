"""A GGUF file's header and tensors, read without parsing its large metadata arrays.

`gguf.GGUFReader` turns every metadata value into numpy views, the tokenizer's ~100k vocabulary
and merge strings included: 6 s for SmolLM2-135M on a 2-core Zen 1, on every model load. The
weights need only the scalar metadata and the tensor table, so this reader walks the header once
with `struct`, steps over arrays by their lengths (string arrays one length at a time, numeric
arrays in one jump) and maps tensor data from the file as `gguf.GGUFReader` shapes it:
F32/F16/F64/I8-I64 as their numpy type, shaped outermost-first; every block type as `uint8`
rows of its byte size (`gguf.quant_shape_to_byte_shape`). Data views share the file's memory map
(read-only); the file stays mapped while any view is alive.

Format (GGUF v2 and v3; v1's 32-bit counts are refused): magic `GGUF`, u32 version, u64 tensor
count, u64 metadata count, metadata key/value pairs, tensor infos (name, u32 n_dims, u64 dims
innermost-first, u32 GGML type, u64 offset), then data from the next multiple of
`general.alignment` (default 32). Both byte orders are read (the version tells which).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> struct format of one scalar (strings and arrays handled apart)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}
_STRING, _ARRAY = 8, 9
_PLAIN_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFArrayInfo:
    """A metadata array left unparsed: its element type code, length and byte offset."""

    item_type: int
    count: int
    offset: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor: `shape` innermost dimension first (GGUF's order, as `gguf.ReaderTensor`);
    `data` a read-only view of the file shaped as `gguf.GGUFReader` shapes it."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFHeaderReader:
    """Scalar metadata (`fields`, arrays as `GGUFArrayInfo`) and the tensor table of a GGUF file.

    Raises ValueError naming the file for a wrong magic, an unsupported version, an unknown
    value or tensor type, duplicate tensor names, or data past the end of the file.
    """

    def __init__(self, path: str | Path):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != _MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        version = struct.unpack_from("<I", buf, 4)[0]
        self.byte_order = "<"
        if version & 0xFFFF == 0:  # written big-endian
            version = struct.unpack_from(">I", buf, 4)[0]
            self.byte_order = ">"
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        self.version = version
        bo = self.byte_order
        n_tensors, n_kv = struct.unpack_from(bo + "QQ", buf, 8)
        pos = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            vtype = struct.unpack_from(bo + "I", buf, pos)[0]
            value, pos = self._value(vtype, pos + 4, key)
            self.fields[key] = value
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            n_dims = struct.unpack_from(bo + "I", buf, pos)[0]
            dims = struct.unpack_from(bo + "Q" * n_dims, buf, pos + 4)
            pos += 4 + 8 * n_dims
            raw_type, offset = struct.unpack_from(bo + "IQ", buf, pos)
            pos += 12
            infos.append((name, dims, raw_type, offset))
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment {alignment} is not a power of two")
        start = -(-pos // alignment) * alignment
        self.data_offset = start
        self.tensors: list[GGUFTensorInfo] = []
        seen: set[str] = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise ValueError(f"{self.path}: duplicate tensor {name!r}")
            seen.add(name)
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise ValueError(f"{self.path}: tensor {name!r} has unknown GGML type "
                                 f"{raw_type}") from None
            n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_bytes = n_elems * type_size // block
            shape = tuple(reversed(dims))
            item = _PLAIN_TYPES.get(qtype.name)
            if item is None:
                if shape[-1] % block:
                    raise ValueError(f"{self.path}: tensor {name!r} row of {shape[-1]} is not a "
                                     f"multiple of {qtype.name}'s block of {block}")
                np_type: Any = np.uint8
                count = n_bytes
                shape = (*shape[:-1], shape[-1] // block * type_size)
            else:
                np_type = np.dtype(item).newbyteorder(bo)
                count = n_elems
            begin = start + offset
            if begin + n_bytes > len(buf):
                raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file")
            data = np.frombuffer(buf, dtype=np_type, count=count, offset=begin).reshape(shape)
            self.tensors.append(GGUFTensorInfo(name, qtype, tuple(dims), n_elems, n_bytes,
                                               begin, data))

    def _string(self, pos: int) -> tuple[str, int]:
        n = struct.unpack_from(self.byte_order + "Q", self._map, pos)[0]
        end = pos + 8 + n
        return bytes(self._map[pos + 8:end]).decode("utf-8"), end

    def _value(self, vtype: int, pos: int, key: str) -> tuple[Any, int]:
        if vtype in _SCALAR:
            fmt = self.byte_order + _SCALAR[vtype]
            return struct.unpack_from(fmt, self._map, pos)[0], pos + struct.calcsize(fmt)
        if vtype == _STRING:
            return self._string(pos)
        if vtype == _ARRAY:
            item_type, count = struct.unpack_from(self.byte_order + "IQ", self._map, pos)
            pos += 12
            info = GGUFArrayInfo(item_type, count, pos)
            if item_type in _SCALAR:
                return info, pos + count * struct.calcsize("<" + _SCALAR[item_type])
            if item_type == _STRING:
                unpack = struct.Struct(self.byte_order + "Q").unpack_from
                buf = self._map
                for _ in range(count):
                    pos += 8 + unpack(buf, pos)[0]
                return info, pos
            for _ in range(count):  # arrays of arrays: rare, walked one by one
                _, pos = self._value(item_type, pos, key)
            return info, pos
        raise ValueError(f"{self.path}: metadata {key!r} has unknown value type {vtype}")

    def string_field(self, key: str, default: str = "") -> str:
        """A string metadata value (`default` if absent); ValueError if it is not a string."""
        value = self.fields.get(key, default)
        if not isinstance(value, str):
            raise ValueError(f"{self.path}: metadata {key!r} is not a string")
        return value
