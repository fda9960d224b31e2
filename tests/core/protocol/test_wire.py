"""The checks both codecs share: datatype names, shapes, raw bytes and the request parameters they decode."""

from __future__ import annotations

import numpy as np
import pytest

from nereid.dtypes import DType
from nereid.errors import InvalidArgument
from nereid.protocol.wire import (MAX_EMPTY_EXTENT, class_count, decode_raw, refuse_shared_memory,
                                  timeout_deadline_ns, wire_dtype, wire_shape)
from nereid.signature import MAX_RANK, MAX_REQUEST_RANK
from nereid.tensors import join_bytes_elements

WHERE = "model 'm', input 'x'"


def test_a_datatype_is_read_by_its_wire_name_and_an_unknown_one_names_the_tensor():
    assert wire_dtype(WHERE, "FP32") is DType.FP32 and wire_dtype(WHERE, "BYTES") is DType.BYTES
    with pytest.raises(InvalidArgument, match=r"^model 'm', input 'x': .*FLOAT32"):
        wire_dtype(WHERE, "FLOAT32")


@pytest.mark.parametrize("shape, count", [((), 1), ((2, 3), 6), ((0, 5), 0), ((4, 0, 2 ** 40), 0)])
def test_a_shape_gives_its_element_count_with_empty_dimensions_allowed(shape, count):
    assert wire_shape(WHERE, shape) == count


def test_a_request_to_a_model_declaring_the_most_dims_may_carry_its_batch_axis():
    """Found by the correctness hunt: a model declaring MAX_RANK dims with max_batch_size > 0 loaded, and its
    metadata showed [-1, *dims], but every batched request was refused at the wire as having too many dims."""
    from nereid.dtypes import DType
    from nereid.signature import ModelSignature, TensorSpec, validate_inputs
    from nereid.tensors import NamedTensor

    assert MAX_REQUEST_RANK == MAX_RANK + 1  # (numpy 2: up to 64 dims)
    shape = (2,) + (1,) * MAX_RANK
    assert wire_shape(WHERE, shape) == 2
    signature = ModelSignature((TensorSpec("x", DType.FP32, (-1,) * MAX_RANK),),
                               (TensorSpec("y", DType.FP32, (1,)),), max_batch_size=4)
    validated = validate_inputs("m", signature, [NamedTensor("x", DType.FP32, np.zeros(shape, np.float32))])
    assert validated.batch_size == 2 and not validated.batch_axis_added


@pytest.mark.parametrize("shape, message", [
    ((1,) * (MAX_REQUEST_RANK + 1), f"shape has {MAX_REQUEST_RANK + 1} dimensions; at most {MAX_REQUEST_RANK} "
                                    "are supported"),
    ((2, -1), r"shape \[2, -1\] has a negative dimension"),
    ((0, MAX_EMPTY_EXTENT, 2), "is too large"),
])
def test_a_shape_numpy_cannot_hold_is_refused_naming_the_tensor(shape, message):
    with pytest.raises(InvalidArgument, match=rf"^{WHERE}: .*{message}"):
        wire_shape(WHERE, shape)


def test_raw_bytes_decode_as_a_read_only_view_without_a_copy():
    raw = np.arange(6, dtype="<f4").tobytes()
    array = decode_raw(WHERE, DType.FP32, (2, 3), raw)
    assert array.tolist() == [[0, 1, 2], [3, 4, 5]] and not array.flags.writeable
    assert np.shares_memory(array, np.frombuffer(raw, np.uint8))


def test_raw_bytes_of_the_wrong_size_are_refused_with_the_arithmetic():
    with pytest.raises(InvalidArgument) as caught:
        decode_raw(WHERE, DType.FP32, (2, 3), b"\0" * 20)
    assert str(caught.value) == f"{WHERE}: raw contents are 20 bytes, expected 24 (FP32 [2, 3] = 6 x 4 bytes)"


def test_a_bool_byte_other_than_0_or_1_is_refused_at_its_element():
    assert decode_raw(WHERE, DType.BOOL, (3,), b"\x00\x01\x01").tolist() == [False, True, True]
    with pytest.raises(InvalidArgument, match=r"BOOL raw contents hold byte 2 at element 1; each element must be 0"):
        decode_raw(WHERE, DType.BOOL, (3,), b"\x00\x02\x01")


def test_bytes_elements_decode_in_kserve_framing_and_a_wrong_count_is_refused():
    raw = join_bytes_elements(np.array([b"a", b"", b"xyz"], dtype=object))
    assert decode_raw(WHERE, DType.BYTES, (1, 3), raw).tolist() == [[b"a", b"", b"xyz"]]
    with pytest.raises(InvalidArgument, match=r"raw contents hold 3 BYTES elements, expected 4 for shape \[4\]"):
        decode_raw(WHERE, DType.BYTES, (4,), raw)
    with pytest.raises(InvalidArgument, match=r"raw contents hold more than the 2 BYTES element\(s\) the shape allows"):
        decode_raw(WHERE, DType.BYTES, (2,), raw)  # (split no further than one past the shape's count)
    with pytest.raises(InvalidArgument, match=rf"^{WHERE}: "):
        decode_raw(WHERE, DType.BYTES, (1,), raw[:-1])  # a frame cut short


def test_the_earliest_timeout_budget_is_the_deadline_and_none_means_no_deadline():
    assert timeout_deadline_ns(1_000, [500, 200]) == 1_200
    assert timeout_deadline_ns(1_000, []) == 0


def test_a_classification_count_must_be_a_non_negative_integer():
    assert class_count(WHERE, 3) == 3 and class_count(WHERE, 0) == 0
    for value in (-1, True, 1.5, "2", [1] * 1000):
        with pytest.raises(InvalidArgument, match="parameter 'classification' must be a non-negative integer count"):
            class_count(WHERE, value)


def test_shared_memory_is_refused_naming_the_tensor():
    refusal = refuse_shared_memory(WHERE)
    assert isinstance(refusal, InvalidArgument) and str(refusal).startswith(WHERE)
