"""The subprocess contract's dtype names: every element type has one, and it reads back."""

from __future__ import annotations

import pytest

from nereid.dtypes import DType

from nereid.backends.subprocess.dtype_names import contract_name, dtype_of_contract_name


@pytest.mark.parametrize("dtype", list(DType))
def test_every_type_has_a_name_that_reads_back(dtype: DType) -> None:
    assert dtype_of_contract_name(contract_name(dtype)) is dtype


def test_names_follow_numpy_and_unknown_names_list_the_valid_ones() -> None:
    assert [contract_name(d) for d in (DType.FP32, DType.BF16, DType.BYTES)] == ["float32", "bfloat16", "bytes"]
    with pytest.raises(ValueError, match=r"unknown dtype 'f32' \(expected one of bfloat16, bool, bytes"):
        dtype_of_contract_name("f32")


def test_unknown_names_list_only_the_types_a_textproto_can_declare() -> None:
    """Found by a bug hunt: the list named float8_e4m3 and float8_e5m2, which no textproto can declare (they have
    no KServe datatype) and the README's table does not list."""
    with pytest.raises(ValueError) as caught:
        dtype_of_contract_name("f32")
    assert str(caught.value) == ("unknown dtype 'f32' (expected one of bfloat16, bool, bytes, float16, float32, "
                                 "float64, int16, int32, int64, int8, uint16, uint32, uint64, uint8)")


def test_a_name_of_no_spelling_gets_no_hint() -> None:
    with pytest.raises(ValueError) as caught:
        dtype_of_contract_name("floaty")
    assert "write" not in str(caught.value)
