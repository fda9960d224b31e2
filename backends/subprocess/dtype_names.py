"""The subprocess tensor contract's element-type names (``NEREID_INPUT_DTYPE`` and frame headers).

The seed's contract spells types as numpy does (``float32``); the cxx backend's
C ABI uses the same names.
"""

from __future__ import annotations

from nereid.dtypes import DType, lookup_spelling

CONTRACT_NAMES: dict[DType, str] = {
    DType.BOOL: "bool", DType.UINT8: "uint8", DType.UINT16: "uint16", DType.UINT32: "uint32",
    DType.UINT64: "uint64", DType.INT8: "int8", DType.INT16: "int16", DType.INT32: "int32", DType.INT64: "int64",
    DType.FP16: "float16", DType.FP32: "float32", DType.FP64: "float64", DType.BF16: "bfloat16",
    DType.BYTES: "bytes", DType.F8E5M2: "float8_e5m2", DType.F8E4M3: "float8_e4m3",
}
_BY_NAME = {name: dtype for dtype, name in CONTRACT_NAMES.items()}
# The names a model's textproto can give its tensors a type of (fp8 has no KServe datatype, so none can): the
# only ones worth listing to a model's author. fp8 frames still read back, as they are written.
_DECLARABLE = {name: dtype for name, dtype in _BY_NAME.items() if dtype.on_wire}


def contract_name(dtype: DType) -> str:
    """The contract's name for ``dtype``, e.g. ``float32``."""
    return CONTRACT_NAMES[dtype]


def dtype_of_contract_name(name: str) -> DType:
    """The element type a contract name names; ValueError lists the names a textproto can declare (and says the
    contract's name for a datatype spelled as the textproto spells it, ``FP32``)."""
    dtype = _BY_NAME.get(name)
    if dtype is not None:
        return dtype
    try:
        return lookup_spelling(_DECLARABLE, name, "dtype")
    except ValueError as err:
        meant = _meant(name)
        if meant is None:
            raise
        raise ValueError(f"{err}; write {contract_name(meant)} (the subprocess contract's name for "
                         f"{meant.kserve}, as in the README's dtype table)") from None


def _meant(name: str) -> DType | None:
    """The element type ``name`` names in another spelling: KServe's (``FP32``, as a textproto declares it),
    Triton's (``TYPE_FP32``, ``STRING``) or the contract's in capitals (``FLOAT32``); None otherwise."""
    if name.lower() in _DECLARABLE:
        return _DECLARABLE[name.lower()]
    bare = name.upper().removeprefix("TYPE_")
    try:
        return DType.BYTES if bare == "STRING" else DType.from_kserve(bare)
    except ValueError:
        return None
