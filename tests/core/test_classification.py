"""Triton's classification extension: top classes as "<value>:<index>" strings."""

from __future__ import annotations

import numpy as np
import pytest

from nereid.classification import check_classifiable, classify
from nereid.dtypes import DType
from nereid.errors import InvalidArgument
from nereid.tensors import NamedTensor


def strings(tensor: NamedTensor) -> list:
    return [[e.decode() for e in row] for row in tensor.data] if tensor.data.ndim == 2 else \
        [e.decode() for e in tensor.data]


def test_each_batch_item_gets_its_top_classes_in_descending_order():
    scores = NamedTensor.from_array("probs", np.array([[0.1, 0.75, 0.15], [0.5, 0.2, 0.3]], np.float32))
    top = classify(scores, 2, batched=True)
    assert (top.name, top.dtype, top.shape) == ("probs", DType.BYTES, (2, 2))
    assert strings(top) == [["0.750000:1", "0.150000:2"], ["0.500000:0", "0.300000:2"]]


def test_without_a_batch_axis_the_whole_tensor_is_one_item_and_indices_are_flat():
    grid = NamedTensor.from_array("grid", np.array([[1, 9], [7, 3]], np.int32))
    assert strings(classify(grid, 3, batched=False)) == ["9:1", "7:2", "3:3"]


def test_a_count_beyond_the_classes_returns_them_all_and_ties_keep_the_lower_index_first():
    tied = NamedTensor.from_array("t", np.array([[2, 5, 5, 2]], np.uint8))
    assert strings(classify(tied, 10, batched=True)) == [["5:1", "5:2", "2:0", "2:3"]]


def test_unsigned_and_64_bit_extremes_are_ordered_and_printed_exactly():
    values = np.array([[0, 2**64 - 1, 1]], np.uint64)
    assert strings(classify(NamedTensor.from_array("u", values), 2, batched=True)) == \
        [["18446744073709551615:1", "1:2"]]
    negatives = np.array([[-(2**63), -1, 2**63 - 1]], np.int64)
    assert strings(classify(NamedTensor.from_array("i", negatives), 3, batched=True)) == \
        [["9223372036854775807:2", "-1:1", "-9223372036854775808:0"]]


def test_float_scores_tie_by_index_and_a_nan_comes_last():
    """Found by a bug hunt: a NaN score was put first ("nan:1" above 2.0), since the descending order read an
    ascending sort (which puts NaN last) backwards; it is no score at all."""
    scores = np.array([[0.5, np.nan, 2.0, -1.0, 0.5, -np.inf, np.nan]], np.float64)
    assert strings(classify(NamedTensor.from_array("s", scores), 7, batched=True)) == [
        ["2.000000:2", "0.500000:0", "0.500000:4", "-1.000000:3", "-inf:5", "nan:1", "nan:6"]]


def test_only_integer_and_fp32_fp64_outputs_can_be_classified():
    check_classifiable("m", "out", DType.FP64)
    for dtype in (DType.FP16, DType.BF16, DType.BOOL, DType.BYTES):
        with pytest.raises(InvalidArgument, match=rf"model 'm': output 'out' is {dtype.name}; classification needs"):
            check_classifiable("m", "out", dtype)
