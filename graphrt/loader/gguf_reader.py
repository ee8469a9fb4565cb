"""A GGUF file's metadata and tensor index, read in one pass over its memory map.

``gguf.GGUFReader`` builds a numpy view for every part of every field, which for a tokenizer's tens of
thousands of tokens and merges took most of a CPU start-up before any weight was read
(``profiles/notes_host.md``). This reader parses the same layout (GGUF v2/v3, little-endian) with ``struct`` and keeps
numeric arrays as numpy slices, and exposes the part of ``GGUFReader``'s interface graphrt uses:
``get_field(key)`` (``.types``, ``.contents()``, ``.data``) and ``tensors`` (``.name``, ``.tensor_type``,
``.shape`` in GGUF order, ``.data`` as the raw view ``gguf.quants.dequantize`` takes). Tensor data is
not touched until dequantised.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
T = gguf.GGUFValueType
#: Scalar value types: their struct format and numpy dtype (little-endian).
_SCALARS = {
    T.UINT8: ("<B", np.uint8), T.INT8: ("<b", np.int8), T.UINT16: ("<H", np.uint16), T.INT16: ("<h", np.int16),
    T.UINT32: ("<I", np.uint32), T.INT32: ("<i", np.int32), T.FLOAT32: ("<f", np.float32), T.BOOL: ("<?", np.bool_),
    T.UINT64: ("<Q", np.uint64), T.INT64: ("<q", np.int64), T.FLOAT64: ("<d", np.float64),
}


class GGUFFormatError(ValueError):
    """The bytes do not follow the GGUF layout (truncated, an unknown type, a big-endian file)."""


@dataclass
class Field:
    """One metadata entry: its value types (``[ARRAY, item type]`` for an array) and value."""

    name: str
    types: list[gguf.GGUFValueType]
    value: Any

    def contents(self) -> Any:
        """The value as Python objects: an int, float, bool or str, or a list of them."""
        return self.value

    @property
    def data(self) -> Any:
        """The value; for an array its items (``len`` counts them)."""
        return self.value


@dataclass
class TensorInfo:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    data: np.ndarray  # float32/float16 values (dims reversed), or uint8 blocks [rows, bytes a row] when quantised


class GGUFFile:
    """``path``'s fields (``fields``: name -> Field) and tensors, parsed at construction. Raises
    GGUFFormatError for a file that does not follow the layout."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._view = memoryview(self._map)
        self._offset = 0
        try:
            self.fields, self.tensors = self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, ValueError) as exc:
            if isinstance(exc, GGUFFormatError):
                raise
            raise GGUFFormatError(f"{type(exc).__name__} at byte {self._offset}: {exc}") from None

    def get_field(self, key: str) -> Field | None:
        return self.fields.get(key)

    # -- parsing -----------------------------------------------------------------------------------

    def _unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self._view, self._offset)[0]
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        end = self._offset + length
        if end > len(self._view):
            raise GGUFFormatError(f"a string of {length} bytes runs past the end of the file")
        text = str(self._view[self._offset:end], "utf-8")
        self._offset = end
        return text

    def _value(self, kind: gguf.GGUFValueType) -> tuple[list[gguf.GGUFValueType], Any]:
        if kind == T.STRING:
            return [kind], self._string()
        if kind in _SCALARS:
            return [kind], self._unpack(_SCALARS[kind][0])
        if kind != T.ARRAY:
            raise GGUFFormatError(f"unknown value type {int(kind)}")
        item = T(self._unpack("<I"))
        count = self._unpack("<Q")
        if item in _SCALARS:  # one numpy read for the whole array
            dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
            end = self._offset + count * dtype.itemsize
            if end > len(self._view):
                raise GGUFFormatError(f"an array of {count} {item.name} runs past the end of the file")
            values = np.frombuffer(self._view, dtype=dtype, count=count, offset=self._offset).tolist()
            self._offset = end
            return [T.ARRAY, item], values
        if item == T.STRING:
            return [T.ARRAY, item], [self._string() for _ in range(count)]
        parts = [self._value(item) for _ in range(count)]  # arrays of arrays
        return [T.ARRAY, *(parts[0][0] if parts else [item])], [value for _, value in parts]

    def _parse(self) -> tuple[dict[str, Field], list[TensorInfo]]:
        if bytes(self._view[:4]) != _GGUF_MAGIC:
            raise GGUFFormatError("no 'GGUF' magic bytes")
        self._offset = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            hint = " (a big-endian file?)" if swapped in (2, 3) else ""
            raise GGUFFormatError(f"unsupported GGUF version {version}{hint}")
        num_tensors, num_fields = self._unpack("<Q"), self._unpack("<Q")
        fields: dict[str, Field] = {}
        for _ in range(num_fields):
            name = self._string()
            types, value = self._value(T(self._unpack("<I")))
            fields[name] = Field(name, types, value)
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
            kind = gguf.GGMLQuantizationType(self._unpack("<I"))
            infos.append((name, tuple(dims), kind, self._unpack("<Q")))
        alignment = fields["general.alignment"].value if "general.alignment" in fields else _DEFAULT_ALIGNMENT
        start = -(-self._offset // alignment) * alignment
        return fields, [self._tensor(name, dims, kind, start + offset) for name, dims, kind, offset in infos]

    def _tensor(self, name: str, dims: tuple[int, ...], kind: gguf.GGMLQuantizationType, offset: int) -> TensorInfo:
        count = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        if dims and dims[0] % block:
            raise GGUFFormatError(f"tensor {name}: {dims[0]} values a row do not fill {block}-value blocks")
        size = count // block * block_bytes
        if offset + size > len(self._view):
            raise GGUFFormatError(f"tensor {name} runs past the end of the file")
        raw = np.frombuffer(self._view, dtype=np.uint8, count=size, offset=offset)
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            dtype = np.float32 if kind == gguf.GGMLQuantizationType.F32 else np.float16
            data = raw.view(dtype).reshape(tuple(reversed(dims)))  # row-major, as gguf's reader gives them
        else:
            data = raw.reshape(-1, dims[0] // block * block_bytes) if dims else raw
        return TensorInfo(name, kind, dims, data)
