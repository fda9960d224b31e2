"""The core's DType table: one row per type, consistent in every direction."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from nereid.dtypes import DType

WIRE_TYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
              "FP16", "FP32", "FP64", "BF16", "BYTES"]


@pytest.mark.parametrize("wire", WIRE_TYPES)
def test_every_wire_type_round_trips(wire: str) -> None:
    dtype = DType.from_kserve(wire)
    assert dtype.kserve == wire and dtype.on_wire
    assert DType.of(np.empty(1, dtype=dtype.numpy)) is dtype


def test_fp8_is_executable_internal_only() -> None:
    assert DType.F8E5M2.numpy == np.dtype(ml_dtypes.float8_e5m2)
    assert not DType.F8E5M2.on_wire and not DType.F8E4M3.on_wire
    with pytest.raises(ValueError, match="no KServe wire datatype"):
        DType.F8E4M3.kserve
    with pytest.raises(ValueError, match="unknown datatype 'F8E4M3'"):
        DType.from_kserve("F8E4M3")


def test_sizes() -> None:
    assert (DType.FP16.itemsize, DType.BF16.itemsize, DType.BYTES.itemsize) == (2, 2, None)
