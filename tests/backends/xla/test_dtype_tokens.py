"""The bundle manifest's dtype tokens: every element type has one, and it reads back."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from nereid.dtypes import DType

from nereid.backends.xla.dtype_tokens import dtype_of_token, token_of


@pytest.mark.parametrize("dtype", list(DType))
def test_every_type_has_a_token_that_reads_back(dtype: DType) -> None:
    assert dtype_of_token(token_of(dtype)) is dtype


def test_fp8_tokens_name_executable_internal_types_and_unknown_tokens_are_refused() -> None:
    assert dtype_of_token("f8e5m2").numpy == np.dtype(ml_dtypes.float8_e5m2)
    with pytest.raises(ValueError, match=r"unknown dtype token 'float32' \(expected one of bf16, bool"):
        dtype_of_token("float32")
