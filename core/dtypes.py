"""The core's table of element types: wire string, numpy dtype, typed-contents field.

Every translation the core makes goes through :class:`DType`:

* ``kserve`` — the KServe V2 / Triton wire string (``"FP32"``), also the spelling
  of ``data_type`` in ``model_inference.textproto``;
* ``numpy`` — the numpy dtype of host arrays (``ml_dtypes`` for bfloat16 / fp8);
* ``contents_field`` — the ``InferTensorContents`` field that carries it.

Backends keep their own spellings beside their code: the bundle manifest's
tokens in ``nereid.backends.xla.dtype_tokens``, the subprocess contract's names
in ``nereid.backends.subprocess.dtype_names``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class _DTypeInfo:
    kserve: str | None  # None: not allowed on the wire (fp8)
    numpy: np.dtype
    contents_field: str | None  # InferTensorContents field carrying it, None: raw only


class DType(enum.Enum):
    """An element type; ``value`` is its row of the translation table."""

    BOOL = _DTypeInfo("BOOL", np.dtype(np.bool_), "bool_contents")
    UINT8 = _DTypeInfo("UINT8", np.dtype(np.uint8), "uint_contents")
    UINT16 = _DTypeInfo("UINT16", np.dtype(np.uint16), "uint_contents")
    UINT32 = _DTypeInfo("UINT32", np.dtype(np.uint32), "uint_contents")
    UINT64 = _DTypeInfo("UINT64", np.dtype(np.uint64), "uint64_contents")
    INT8 = _DTypeInfo("INT8", np.dtype(np.int8), "int_contents")
    INT16 = _DTypeInfo("INT16", np.dtype(np.int16), "int_contents")
    INT32 = _DTypeInfo("INT32", np.dtype(np.int32), "int_contents")
    INT64 = _DTypeInfo("INT64", np.dtype(np.int64), "int64_contents")
    FP16 = _DTypeInfo("FP16", np.dtype(np.float16), None)
    FP32 = _DTypeInfo("FP32", np.dtype(np.float32), "fp32_contents")
    FP64 = _DTypeInfo("FP64", np.dtype(np.float64), "fp64_contents")
    BF16 = _DTypeInfo("BF16", np.dtype(ml_dtypes.bfloat16), None)
    BYTES = _DTypeInfo("BYTES", np.dtype(object), "bytes_contents")
    F8E5M2 = _DTypeInfo(None, np.dtype(ml_dtypes.float8_e5m2), None)
    F8E4M3 = _DTypeInfo(None, np.dtype(ml_dtypes.float8_e4m3fn), None)

    # Each member copies its row into plain attributes once, at class creation:
    # dtype lookups sit on every request's path, and enum's ``value`` is slow.
    def __init__(self, info: _DTypeInfo) -> None:
        self._kserve = info.kserve
        self.numpy: np.dtype = info.numpy
        """The numpy dtype of host arrays of this type (object for BYTES)."""
        self.little_endian: np.dtype = info.numpy.newbyteorder("<")
        """The numpy dtype of this type's wire bytes (little-endian, whatever the host)."""
        self.itemsize: int | None = None if info.numpy == np.dtype(object) else info.numpy.itemsize
        """Bytes per element, or None for variable-size BYTES."""
        self.contents_field: str | None = info.contents_field
        """The ``InferTensorContents`` field for typed contents, None if raw only."""

    @property
    def on_wire(self) -> bool:
        """Whether clients can send and receive this type (it has a KServe wire datatype; fp8 has none)."""
        return self._kserve is not None

    @property
    def kserve(self) -> str:
        """The wire string; raises ValueError for types that have none (fp8)."""
        if self._kserve is None:
            raise ValueError(f"{self.name} has no KServe wire datatype")
        return self._kserve

    @classmethod
    def from_kserve(cls, name: str) -> DType:
        """Look up a wire string (``"FP32"``); ValueError names the valid ones."""
        return lookup_spelling(_BY_KSERVE, name, "datatype")

    @classmethod
    def of(cls, array: np.ndarray) -> DType:
        """The DType of a numpy array (object arrays are BYTES)."""
        try:
            return _BY_NUMPY[array.dtype]
        except KeyError:
            raise ValueError(f"numpy dtype {array.dtype} has no nereid datatype") from None


def lookup_spelling(table: dict[str, DType], key: str, what: str) -> DType:
    """``table[key]``; ValueError naming ``what`` and listing the valid spellings otherwise.

    For every spelling table of element types: the wire's here, and the ones
    backends keep beside their code (manifest tokens, contract names).
    """
    try:
        return table[key]
    except KeyError:
        valid = ", ".join(sorted(table))
        raise ValueError(f"unknown {what} {key!r} (expected one of {valid})") from None


_BY_KSERVE = {d.value.kserve: d for d in DType if d.value.kserve is not None}
_BY_NUMPY = {d.numpy: d for d in DType}
