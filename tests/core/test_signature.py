"""model_inference.textproto parsing (protobuf text_format) and request validation rules."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nereid.dtypes import DType
from nereid.errors import ConfigError, InvalidArgument
from nereid.signature import ModelSignature, TensorSpec, load_textproto_signature, validate_inputs
from nereid.tensors import NamedTensor


def parse(tmp_path: Path, text: str) -> ModelSignature:
    path = tmp_path / "model_inference.textproto"
    path.write_text(text)
    return load_textproto_signature(path)


def test_single_tensor_form_defaults_to_fp32(tmp_path: Path) -> None:
    sig = parse(tmp_path, "input_shape: [16]\noutput_shape: [1]\nmax_batch_size: 8  # comment\n")
    assert sig.inputs == (TensorSpec("input", DType.FP32, (16,)),)
    assert sig.outputs == (TensorSpec("output", DType.FP32, (1,)),)
    assert sig.max_batch_size == 8 and sig.batches and sig.single_tensor_form


def test_multi_tensor_form_keeps_declared_order(tmp_path: Path) -> None:
    sig = parse(tmp_path, '''
input  { name: "b" data_type: "INT64" dims: [2, -1] }
input  { name: "a" data_type: "FP32" dims: [3] }
output { name: "out" data_type: "BYTES" dims: [1] }
''')
    assert [s.name for s in sig.inputs] == ["b", "a"]
    assert sig.inputs[0] == TensorSpec("b", DType.INT64, (2, -1))
    assert sig.outputs[0].dtype is DType.BYTES and not sig.batches and not sig.single_tensor_form


@pytest.mark.parametrize("text, message", [
    ("input_shape: [16\n", r"model_inference.textproto:2:1 "),
    ("input_shapes: [16]\n", r":1:1 .*input_shapes"),
    ('input_shape: [4]\ndata_type: "FP33"\n', "unknown datatype 'FP33'"),
    ('input_shape: [4]\ninput { name: "a" dims: [1] }\n', "not both"),
    ("input_shape: [0]\n", r"dims must be positive or -1"),
    ("input_shape: [-2]\n", r"dims must be positive or -1"),
    ("max_batch_size: -1\ninput_shape: [1]\n", "max_batch_size must be >= 0"),
    ('input { data_type: "FP32" dims: [1] }\n', "has no name"),
    ('input { name: "a" data_type: "FP32" dims: [1] }\ninput { name: "a" data_type: "FP32" dims: [1] }\n',
     "duplicate input"),
])
def test_textproto_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(tmp_path, text)


BATCHED = ModelSignature((TensorSpec("x", DType.FP32, (4, -1)),), (TensorSpec("y", DType.FP32, (4,)),), 8)
UNBATCHED = ModelSignature((TensorSpec("x", DType.FP32, (4,)),), (TensorSpec("y", DType.FP32, (4,)),), 0)


def tensor(name: str, shape: tuple[int, ...], dtype=np.float32) -> NamedTensor:
    return NamedTensor.from_array(name, np.zeros(shape, dtype=dtype))


def test_batch_axis_is_added_when_omitted() -> None:
    result = validate_inputs("m", BATCHED, [tensor("x", (4, 3))])
    assert result.tensors[0].shape == (1, 4, 3) and result.batch_size == 1 and result.batch_axis_added


def test_batched_request_within_cap() -> None:
    result = validate_inputs("m", BATCHED, [tensor("x", (5, 4, 7))])
    assert result.batch_size == 5 and not result.batch_axis_added


@pytest.mark.parametrize("sig, tensors, message", [
    (BATCHED, [tensor("x", (9, 4, 1))], "model 'm': input 'x' has batch size 9, expected 1 to max_batch_size 8"),
    (BATCHED, [tensor("x", (2, 5, 1))], r"input 'x' has shape \[2, 5, 1\], expected \[batch, 4, -1\] or \[4, -1\]"),
    (BATCHED, [tensor("x", (4,))], r"input 'x' has shape \[4\]"),
    (UNBATCHED, [tensor("x", (1, 4))], r"input 'x' has shape \[1, 4\], expected \[4\]"),
    (UNBATCHED, [tensor("x", (4,), np.float64)], "input 'x' has datatype FP64, expected FP32"),
    (UNBATCHED, [], "missing input 'x'"),
    (UNBATCHED, [tensor("x", (4,)), tensor("z", (4,))], "unexpected input 'z'"),
    (UNBATCHED, [tensor("x", (4,)), tensor("x", (4,))], "given more than once"),
])
def test_validation_errors(sig: ModelSignature, tensors: list[NamedTensor], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        validate_inputs("m", sig, tensors)


def test_inputs_must_agree_on_batch_size() -> None:
    sig = ModelSignature((TensorSpec("a", DType.FP32, (2,)), TensorSpec("b", DType.FP32, (2,))), (), 8)
    with pytest.raises(InvalidArgument, match="disagree on the batch size"):
        validate_inputs("m", sig, [tensor("a", (3, 2)), tensor("b", (2, 2))])
    with pytest.raises(InvalidArgument, match="'b': no batch axis"):
        validate_inputs("m", sig, [tensor("a", (3, 2)), tensor("b", (2,))])
