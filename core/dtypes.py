"""The one table of element types: wire string, numpy dtype, manifest token, contract name.

Every translation between representations goes through :class:`DType`, so a
datatype is spelled in exactly one place:

* ``kserve`` — the KServe V2 / Triton wire string (``"FP32"``), also the spelling
  of ``data_type`` in ``model_inference.textproto``;
* ``numpy`` — the numpy dtype of host arrays (``ml_dtypes`` for bfloat16 / fp8);
* ``token`` — the bundle manifest token (``"f32"``);
* ``contract`` — the name used by the subprocess tensor contract
  (``NEREID_INPUT_DTYPE`` and output headers, e.g. ``"float32"``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class _DTypeInfo:
    kserve: str | None  # None: not allowed on the wire (fp8)
    token: str
    numpy: np.dtype
    contract: str
    contents_field: str | None  # InferTensorContents field carrying it, None: raw only


class DType(enum.Enum):
    """An element type; ``value`` is its row of the translation table."""

    BOOL = _DTypeInfo("BOOL", "bool", np.dtype(np.bool_), "bool", "bool_contents")
    UINT8 = _DTypeInfo("UINT8", "u8", np.dtype(np.uint8), "uint8", "uint_contents")
    UINT16 = _DTypeInfo("UINT16", "u16", np.dtype(np.uint16), "uint16", "uint_contents")
    UINT32 = _DTypeInfo("UINT32", "u32", np.dtype(np.uint32), "uint32", "uint_contents")
    UINT64 = _DTypeInfo("UINT64", "u64", np.dtype(np.uint64), "uint64", "uint64_contents")
    INT8 = _DTypeInfo("INT8", "i8", np.dtype(np.int8), "int8", "int_contents")
    INT16 = _DTypeInfo("INT16", "i16", np.dtype(np.int16), "int16", "int_contents")
    INT32 = _DTypeInfo("INT32", "i32", np.dtype(np.int32), "int32", "int_contents")
    INT64 = _DTypeInfo("INT64", "i64", np.dtype(np.int64), "int64", "int64_contents")
    FP16 = _DTypeInfo("FP16", "f16", np.dtype(np.float16), "float16", None)
    FP32 = _DTypeInfo("FP32", "f32", np.dtype(np.float32), "float32", "fp32_contents")
    FP64 = _DTypeInfo("FP64", "f64", np.dtype(np.float64), "float64", "fp64_contents")
    BF16 = _DTypeInfo("BF16", "bf16", np.dtype(ml_dtypes.bfloat16), "bfloat16", None)
    BYTES = _DTypeInfo("BYTES", "bytes", np.dtype(object), "bytes", "bytes_contents")
    F8E5M2 = _DTypeInfo(None, "f8e5m2", np.dtype(ml_dtypes.float8_e5m2), "float8_e5m2", None)
    F8E4M3 = _DTypeInfo(None, "f8e4m3", np.dtype(ml_dtypes.float8_e4m3fn), "float8_e4m3", None)

    # Each member copies its row into plain attributes once, at class creation:
    # dtype lookups sit on every request's path, and enum's ``value`` is slow.
    def __init__(self, info: _DTypeInfo) -> None:
        self._kserve = info.kserve
        self.numpy: np.dtype = info.numpy
        """The numpy dtype of host arrays of this type (object for BYTES)."""
        self.little_endian: np.dtype = info.numpy.newbyteorder("<")
        """The numpy dtype of this type's wire bytes (little-endian, whatever the host)."""
        self.token: str = info.token
        """The bundle manifest token, e.g. ``f32``."""
        self.contract: str = info.contract
        """The subprocess-contract name, e.g. ``float32``."""
        self.itemsize: int | None = None if info.numpy == np.dtype(object) else info.numpy.itemsize
        """Bytes per element, or None for variable-size BYTES."""
        self.contents_field: str | None = info.contents_field
        """The ``InferTensorContents`` field for typed contents, None if raw only."""

    @property
    def kserve(self) -> str:
        """The wire string; raises ValueError for types that have none (fp8)."""
        if self._kserve is None:
            raise ValueError(f"{self.name} has no KServe wire datatype")
        return self._kserve

    @classmethod
    def from_kserve(cls, name: str) -> DType:
        """Look up a wire string (``"FP32"``); ValueError names the valid ones."""
        return _lookup(_BY_KSERVE, name, "datatype")

    @classmethod
    def from_token(cls, token: str) -> DType:
        """Look up a manifest token (``"f32"``)."""
        return _lookup(_BY_TOKEN, token, "dtype token")

    @classmethod
    def from_contract(cls, name: str) -> DType:
        """Look up a subprocess-contract name (``"float32"``)."""
        return _lookup(_BY_CONTRACT, name, "dtype")

    @classmethod
    def of(cls, array: np.ndarray) -> DType:
        """The DType of a numpy array (object arrays are BYTES)."""
        try:
            return _BY_NUMPY[array.dtype]
        except KeyError:
            raise ValueError(f"numpy dtype {array.dtype} has no nereid datatype") from None


def _lookup(table: dict[str, DType], key: str, what: str) -> DType:
    try:
        return table[key]
    except KeyError:
        valid = ", ".join(sorted(table))
        raise ValueError(f"unknown {what} {key!r} (expected one of {valid})") from None


_BY_KSERVE = {d.value.kserve: d for d in DType if d.value.kserve is not None}
_BY_TOKEN = {d.token: d for d in DType}
_BY_CONTRACT = {d.contract: d for d in DType}
_BY_NUMPY = {d.numpy: d for d in DType}
