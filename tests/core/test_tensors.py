"""Tensor bytes: little-endian row-major wire form, without a copy when an array views whole bytes."""

from __future__ import annotations

import numpy as np
import pytest

from nereid.dtypes import DType
from nereid.tensors import NamedTensor, join_bytes_elements, split_bytes_elements, tensor_bytes


def test_an_array_viewing_a_whole_bytes_object_is_sent_without_a_copy() -> None:
    raw = np.arange(8, dtype="<f4").tobytes()
    view = np.frombuffer(raw, dtype=DType.FP32.little_endian).reshape(2, 4)
    assert tensor_bytes(NamedTensor("x", DType.FP32, view)) is raw


@pytest.mark.parametrize("make", [
    lambda a: a[:1],                  # part of the bytes
    lambda a: a.T,                    # not C-contiguous
    lambda a: a.astype(">f4"),        # big-endian
    lambda a: a * 2,                  # a computed array
])
def test_other_arrays_are_serialized_little_endian_row_major(make) -> None:
    raw = np.arange(8, dtype="<f4").tobytes()
    array = make(np.frombuffer(raw, dtype="<f4").reshape(2, 4))
    assert tensor_bytes(NamedTensor("x", DType.FP32, array)) == np.ascontiguousarray(array, dtype="<f4").tobytes()


def test_bytes_elements_round_trip_and_reject_truncation() -> None:
    array = np.array([b"", b"abc", "h\u00e9".encode()], dtype=object)
    raw = join_bytes_elements(array)
    assert raw[:4] == b"\x00\x00\x00\x00" and split_bytes_elements(raw) == list(array)
    with pytest.raises(ValueError, match="runs past the end"):
        split_bytes_elements(raw[:-1])
    with pytest.raises(ValueError, match="inside a 4-byte length prefix"):
        split_bytes_elements(b"\x01\x00")
