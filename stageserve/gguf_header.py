"""A GGUF file's header (metadata and tensor infos), read without the tensor data or torch.

Parsed here rather than with ``gguf.GGUFReader``: the reader decodes every tokenizer string through
numpy memmap slicing (~2 s for a 49k-token vocabulary); skipping those arrays with struct takes
~30 ms. Type codes and block sizes still come from ``gguf``. The device reads its config here;
prepare reads the sampling defaults (``general.sampling.*``) without loading what only the device needs.
Spec: ggml/docs/gguf.md.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import struct
from pathlib import Path
from typing import Any

import gguf

_SCALAR_FORMATS = {
    gguf.GGUFValueType.UINT8: "<B", gguf.GGUFValueType.INT8: "<b", gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h", gguf.GGUFValueType.UINT32: "<I", gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f", gguf.GGUFValueType.BOOL: "<?", gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q", gguf.GGUFValueType.FLOAT64: "<d",
}


class GGUFHeaderError(ValueError):
    """Not a GGUF file, or a corrupt or truncated header; the message names the file."""


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor's info: its row-major ``shape`` (GGML lists dimensions innermost first), block
    type, absolute byte ``offset`` in the file and size in bytes."""

    name: str
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType
    offset: int
    nbytes: int


class _HeaderReader:
    """Sequential little-endian reader over a GGUF header."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer, self.pos = buffer, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        self.pos += length
        return self.buffer[self.pos - length : self.pos].decode("utf-8")

    def value(self, vtype: int) -> Any:
        """Decode one value; arrays are skipped (returned as None) since no config key needs one."""
        if vtype == gguf.GGUFValueType.STRING:
            return self.string()
        if vtype == gguf.GGUFValueType.ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _SCALAR_FORMATS:
                self.pos += count * struct.calcsize(_SCALAR_FORMATS[etype])
            else:
                for _ in range(count):
                    self.value(etype)
            return None
        return self.scalar(_SCALAR_FORMATS[gguf.GGUFValueType(vtype)])


def read_gguf_header(buffer: mmap.mmap, path: Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """Parse metadata (key -> value, arrays as ``None``) and tensor infos of the GGUF file mapped in
    ``buffer``; check every tensor lies inside the file.

    Raises:
        GGUFHeaderError: bad magic, an unsupported version, a truncated header or tensor.
    """
    try:
        return _read(buffer, path)
    except GGUFHeaderError:
        raise
    except (struct.error, ValueError, KeyError, UnicodeDecodeError) as exc:
        raise GGUFHeaderError(f"{path}: corrupt or truncated GGUF header ({type(exc).__name__}: {exc})") from exc


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """The metadata of the GGUF file at ``path`` (see `read_gguf_header`). Raises GGUFHeaderError, OSError."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        return read_gguf_header(buffer, path)[0]


def _read(buffer: mmap.mmap, path: Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    reader = _HeaderReader(buffer)
    if len(buffer) < 24 or reader.scalar("<I") != gguf.GGUF_MAGIC:
        raise GGUFHeaderError(f"{path}: not a GGUF file (bad magic)")
    version = reader.scalar("<I")
    if version not in (2, 3):
        raise GGUFHeaderError(f"{path}: unsupported GGUF version {version}")
    tensor_count, kv_count = reader.scalar("<Q"), reader.scalar("<Q")
    fields = {}
    for _ in range(kv_count):
        key = reader.string()
        fields[key] = reader.value(reader.scalar("<I"))
    infos = []
    for _ in range(tensor_count):
        name = reader.string()
        dims = [reader.scalar("<Q") for _ in range(reader.scalar("<I"))]
        qtype, offset = gguf.GGMLQuantizationType(reader.scalar("<I")), reader.scalar("<Q")
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        if dims and dims[0] % block:
            raise GGUFHeaderError(f"{path}: tensor {name!r} of type {qtype.name}: rows of {dims[0]} values are not whole blocks of {block}")
        infos.append(GGUFTensor(name, tuple(reversed(dims)), qtype, offset, math.prod(dims) // block * block_bytes))
    alignment = int(fields.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    data_start = -(-reader.pos // alignment) * alignment
    infos = [dataclasses.replace(t, offset=data_start + t.offset) for t in infos]
    for t in infos:
        if t.offset + t.nbytes > len(buffer):
            raise GGUFHeaderError(f"{path}: truncated: tensor {t.name!r} needs bytes up to {t.offset + t.nbytes}, file has {len(buffer)}")
    return fields, infos
