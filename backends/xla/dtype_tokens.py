"""The bundle manifest's element-type tokens (``f32``, ``bf16``, ...): the xla backend's own spelling."""

from __future__ import annotations

from nereid.dtypes import DType, lookup_spelling

TOKENS: dict[DType, str] = {
    DType.BOOL: "bool", DType.UINT8: "u8", DType.UINT16: "u16", DType.UINT32: "u32", DType.UINT64: "u64",
    DType.INT8: "i8", DType.INT16: "i16", DType.INT32: "i32", DType.INT64: "i64",
    DType.FP16: "f16", DType.FP32: "f32", DType.FP64: "f64", DType.BF16: "bf16", DType.BYTES: "bytes",
    DType.F8E5M2: "f8e5m2", DType.F8E4M3: "f8e4m3",
}
_BY_TOKEN = {token: dtype for dtype, token in TOKENS.items()}


def token_of(dtype: DType) -> str:
    """The manifest token of ``dtype``, e.g. ``f32``."""
    return TOKENS[dtype]


def dtype_of_token(token: str) -> DType:
    """The element type a manifest token names; ValueError lists the valid tokens."""
    return lookup_spelling(_BY_TOKEN, token, "dtype token")
