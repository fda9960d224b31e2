"""model_inference.textproto parsing (protobuf text_format) and request validation rules."""

from __future__ import annotations

import collections
import os
import re
from pathlib import Path

import numpy as np
import pytest

import nereid
from nereid.dtypes import DType
from nereid.errors import ConfigError, InvalidArgument, ModelFailure, PublicText
from nereid.signature import ModelSignature, TensorSpec, check_outputs, load_textproto_signature, validate_inputs
from nereid.tensors import NamedTensor
from toy_backends import toy_dataplane


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
    # Defect: said "unknown datatype ''"
    ('input { name: "a" dims: [1] }\n', r"input 0 \(a\): data_type: missing \(expected one of BF16, BOOL,"),
    ('input { name: "a" data_type: "FP32" dims: [1] }\ninput { name: "a" data_type: "FP32" dims: [1] }\n',
     "duplicate input"),
])
def test_textproto_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(tmp_path, text)


@pytest.mark.parametrize("text, problem", [
    ("input_shape: [4", "1:16 : the file ends before this field is complete (Expected \",\"); was it cut short?"),
    ("output_shape: [1]\nmax_batch_size:\n\n",
     "4:1 : the file ends before this field is complete (Couldn't parse integer); was it cut short?"),
    ('output { name: "y" dims: [1] data_type: ',
     "1:41 : the file ends before this field is complete (Expected string); was it cut short?"),
    # Cut inside its last token (the operator hunt): protobuf's words for the fragment alone hid the news.
    ('output_shape: [1]\ninpu\n',
     '2:1 : Message type "nereid.ModelInference" has no field named "inpu"; the file ends right there: was it cut '
     'short?'),
    ('output { name: "y" di',
     '1:20 : Message type "nereid.TensorDeclaration" has no field named "di"; the file ends right there: was it '
     'cut short?'),
    ('output { name: "y" dims: [1] data_type: "FP',
     "1:41 : String missing ending quote: '\"FP'; the file ends right there: was it cut short?"),
    # A block still open at the end (the hunt of the cut-short note): protobuf points at its last value.
    ('input { name: "a" data_type: "FP32" dims: [2] }\noutput { name: "b" dims: [2]\n\n',
     '2:28 : Expected "}"; the file ends right there: was it cut short?'),
])
def test_a_textproto_cut_short_is_said_to_end_there(tmp_path: Path, text: str, problem: str) -> None:
    """Defect (the Triton client hunt): a file cut short was refused with protobuf's words for an empty token at
    its end, "'': Couldn't parse integer: " and nothing after it."""
    with pytest.raises(ConfigError) as caught:
        parse(tmp_path, text)
    assert str(caught.value).endswith(f"model_inference.textproto:{problem}")


def test_an_unknown_field_before_the_end_is_not_said_to_be_cut_short(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        parse(tmp_path, 'output_shape: [1]\ninpu: 3\n')
    assert str(caught.value).endswith('2:1 : Message type "nereid.ModelInference" has no field named "inpu". '
                                      '(did you mean input?)')


@pytest.mark.parametrize("text, hint", [
    ("input_shap: [4]\noutput_shape: [4]\n",
     '1:1 : Message type "nereid.ModelInference" has no field named "input_shap". (did you mean input_shape?)'),
    ('input { name: "x" dtype: "FP32" dims: [4] }\n',
     '1:19 : Message type "nereid.TensorDeclaration" has no field named "dtype". (did you mean data_type?)'),
    # A bundle manifest's word for it (the new user's hunt).
    ('input { name: "x" data_type: "FP32" shape: [4] }\n',
     '"shape". (an input {} / output {} block writes its shape as dims: dims: [4])'),
    ("shape: [4]\n", '"shape". (the single-tensor form\'s shapes are input_shape and output_shape)'),
    ("input_shape: [4]\noutput_shape: [4]\nqueue_capacity: 3\n",
     "\"queue_capacity\". (model_inference.textproto's fields are input_shape, output_shape, max_batch_size, "
     "data_type, input, output)"),
    ('output { name: "y" data_type: "FP32" dims: [1] size: 3 }\n',
     "\"size\". (an input {} / output {} block's fields are name, data_type, dims)"),
])
def test_an_unknown_field_is_told_the_field_meant_or_the_fields_there_are(tmp_path: Path, text: str,
                                                                         hint: str) -> None:
    """Defect (the new user's hunt): a typo (`input_shap`) got protobuf's bare 'has no field named', naming none
    of the fields the message has."""
    with pytest.raises(ConfigError) as caught:
        parse(tmp_path, text)
    assert str(caught.value).endswith(hint), str(caught.value)


def test_a_byte_order_mark_is_no_part_of_the_textproto(tmp_path: Path) -> None:
    """Defect: a textproto saved with a UTF-8 byte order mark (some Windows editors add one) was refused at 1:1,
    "Expected identifier or number, got" the invisible character."""
    sig = parse(tmp_path, "\ufeffinput_shape: [16]\noutput_shape: [1]\nmax_batch_size: 8\n")
    assert sig.inputs == (TensorSpec("input", DType.FP32, (16,)),) and sig.max_batch_size == 8


def test_a_textproto_error_never_quotes_the_file_s_line(tmp_path: Path) -> None:
    """Defect: protobuf quotes the whole line for some errors, comments included, and load failures reach
    remote clients (RepositoryIndex)."""
    with pytest.raises(ConfigError) as caught:
        parse(tmp_path, "input_shape: [16]  max_batch_size: 99999999999  # db_password=hunter2\n")
    assert str(caught.value).endswith("model_inference.textproto:1:36 : Value out of range: 99999999999")
    assert "hunter2" not in str(caught.value)
    # Nor with CRLF line ends, or a line separator that protobuf does not break lines at, before it.
    for text in ("# owner\r\ninput_shape: [16]\r\nmax_batch_size: abc  # hunter2\r\n",
                 "# a\u2028b\x0cc\ninput_shape: [16]\nmax_batch_size: abc  # hunter2\n"):
        with pytest.raises(ConfigError) as caught:
            parse(tmp_path, text)
        assert str(caught.value).endswith("model_inference.textproto:3:17 : Couldn't parse integer: abc")


BATCHED = ModelSignature((TensorSpec("x", DType.FP32, (4, -1)),), (TensorSpec("y", DType.FP32, (4,)),), 8)
UNBATCHED = ModelSignature((TensorSpec("x", DType.FP32, (4,)),), (TensorSpec("y", DType.FP32, (4,)),), 0)


def tensor(name: str, shape: tuple[int, ...], dtype=np.float32) -> NamedTensor:
    return NamedTensor.from_array(name, np.zeros(shape, dtype=dtype))


def test_batch_axis_is_added_when_omitted() -> None:
    result = validate_inputs("m", BATCHED, [tensor("x", (4, 3))])
    assert result.tensors[0].shape == (1, 4, 3) and result.batch_size == 1 and result.batch_axis_added


def test_a_big_endian_input_reaches_the_model_in_native_order() -> None:
    """A meta model passing on a big-endian array made an xla bundle read its bytes as they lay: garbage."""
    values = np.arange(4 * 3, dtype=">f4").reshape(1, 4, 3)
    result = validate_inputs("m", BATCHED, [NamedTensor("x", DType.FP32, values)])
    data = result.tensors[0].data
    assert data.dtype == np.dtype("=f4") and data.dtype.isnative and (data == values).all()


@pytest.mark.parametrize("data", [np.ones((1, 4, 3), np.float64), np.ones((1, 4, 3), ">f8"),
                                  np.ones((1, 4, 3), np.int32)])
def test_an_input_whose_data_disagrees_with_its_tag_is_refused(data: np.ndarray) -> None:
    """A meta model's FP32-tagged float64 array was read by its bytes by one backend, by its values by another."""
    with pytest.raises(InvalidArgument, match=rf"^model 'm': input 'x' is tagged FP32 but holds {data.dtype} data, "
                                              r"expected a numpy ndarray of float32$"):
        validate_inputs("m", BATCHED, [NamedTensor("x", DType.FP32, data)])


@pytest.mark.parametrize("data", [[[[1.0] * 3] * 4], (1.0,), memoryview(b"1234")], ids=["list", "tuple", "memoryview"])
def test_an_input_whose_data_is_no_numpy_array_is_refused(data) -> None:
    """Found by a bug hunt: a meta model's sub-call with a list for data failed with an AttributeError, counted as
    no failure of the model it called; a client's is told, as for data of the wrong dtype."""
    with pytest.raises(InvalidArgument, match=rf"^model 'm': input 'x' holds a {type(data).__name__}, expected a numpy "
                                              r"ndarray of float32 \(NamedTensor.from_array makes one\)$"):
        validate_inputs("m", BATCHED, [NamedTensor("x", DType.FP32, data)])


def test_a_numpy_scalar_is_taken_as_the_0_d_array_it_is() -> None:
    # (The review of the change: the refusal above took numpy scalars too, which a 0-d input had accepted.)
    scalar = ModelSignature((TensorSpec("x", DType.FP32, ()),), (TensorSpec("y", DType.FP32, ()),), 0)
    result = validate_inputs("m", scalar, [NamedTensor("x", DType.FP32, np.float32(2.5))])
    data = result.tensors[0].data
    assert isinstance(data, np.ndarray) and data.shape == () and data.dtype == np.float32 and float(data) == 2.5


def test_a_numpy_scalar_output_is_taken_as_the_0_d_array_it_is_and_the_model_s_list_is_left_alone() -> None:
    """Found by the outputs hunt: a model returning np.sum's result (a numpy scalar) for a scalar output failed
    every request, where a meta model's sub-call takes the same value as an input."""
    from nereid.signature import check_outputs

    scalar = ModelSignature((TensorSpec("x", DType.FP32, ()),), (TensorSpec("y", DType.FP32, ()),), 0)
    returned = [NamedTensor("y", DType.FP32, np.float32(2.5))]
    checked = check_outputs("m", scalar, returned, 1)
    data = checked[0].data
    assert isinstance(data, np.ndarray) and data.shape == () and data.dtype == np.float32 and float(data) == 2.5
    assert isinstance(returned[0].data, np.float32)  # (the model's own list, as it returned it)
    with pytest.raises(ModelFailure, match=r"returned output 'y' tagged FP32 holding .*int64"):
        check_outputs("m", scalar, [NamedTensor("y", DType.FP32, np.int64(2))], 1)


def test_batched_request_within_cap() -> None:
    result = validate_inputs("m", BATCHED, [tensor("x", (5, 4, 7))])
    assert result.batch_size == 5 and not result.batch_axis_added


@pytest.mark.parametrize("sig, tensors, message", [
    (BATCHED, [tensor("x", (9, 4, 1))], "model 'm': input 'x' has batch size 9, expected 1 to max_batch_size 8"),
    (BATCHED, [tensor("x", (2, 5, 1))], r"input 'x' has shape \[2, 5, 1\], expected \[batch, 4, -1\] or \[4, -1\]"),
    (BATCHED, [tensor("x", (4,))], r"input 'x' has shape \[4\]"),
    # A batch axis sent to a model without one is said to be that (the new user's hunt), only where it is all.
    (UNBATCHED, [tensor("x", (1, 4))],
     r"input 'x' has shape \[1, 4\], expected \[4\] \(the model does not batch: max_batch_size 0\)$"),
    (UNBATCHED, [tensor("x", (3, 4))], r"has shape \[3, 4\], expected \[4\] \(the model does not batch: "),
    (UNBATCHED, [tensor("x", (1, 5))], r"input 'x' has shape \[1, 5\], expected \[4\]$"),
    (UNBATCHED, [tensor("x", (4,), np.float64)], "input 'x' has datatype FP64, expected FP32"),
    (UNBATCHED, [], "missing input 'x'"),
    (UNBATCHED, [tensor("x", (4,)), tensor("z", (4,))], "unexpected input 'z'"),
    (UNBATCHED, [tensor("x", (4,)), tensor("x", (4,))], "given more than once"),
])
def test_validation_errors(sig: ModelSignature, tensors: list[NamedTensor], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message) as caught:
        validate_inputs("m", sig, tensors)
    assert isinstance(str(caught.value), PublicText)  # built from the request alone: echoed, never scrubbed


def test_input_names_the_client_sent_are_echoed_as_sent_never_rewritten_by_the_path_scrubbing(tmp_path) -> None:
    # An input name starting with one of the server's private folders came back rewritten ("/opt/nereid/core/in"
    # as "<nereid>/in") while any other path came back as sent: an oracle for the server's absolute paths.
    repository = toy_dataplane(tmp_path).repository
    for folder in (repository.root.resolve(), repository.scratch_dir, Path(nereid.__file__).resolve().parent):
        name = f"{folder}{os.sep}in"
        assert repository.public_text(name) != name  # a real private prefix: scrubbed from the server's own text
        for tensors, message in (
                ([tensor(name, (4,))], f"model 'm': unexpected input '{name}' (expected inputs: 'x')"),
                ([tensor(name, (4,)), tensor(name, (4,))], f"model 'm': input '{name}' is given more than once")):
            with pytest.raises(InvalidArgument) as caught:
                validate_inputs("m", UNBATCHED, tensors)
            assert repository.public_text(str(caught.value)) == message


def test_inputs_must_agree_on_batch_size() -> None:
    sig = ModelSignature((TensorSpec("a", DType.FP32, (2,)), TensorSpec("b", DType.FP32, (2,))), (), 8)
    with pytest.raises(InvalidArgument, match="disagree on the batch size"):
        validate_inputs("m", sig, [tensor("a", (3, 2)), tensor("b", (2, 2))])
    with pytest.raises(InvalidArgument, match="'b': no batch axis"):
        validate_inputs("m", sig, [tensor("a", (3, 2)), tensor("b", (2,))])


FP32_OUT = ModelSignature((), (TensorSpec("y", DType.FP32, (2,)),), 4)
BYTES_OUT = ModelSignature((), (TensorSpec("y", DType.BYTES, (2,)),), 4)


class ArrayLike:
    """An array of another library (a jax array): a shape and a dtype, but no numpy ndarray."""

    shape = (1, 2)
    dtype = np.dtype(np.float32)


def objects(*elements: object) -> np.ndarray:
    array = np.empty((1, len(elements)), dtype=object)
    array[0, :] = elements
    return array


@pytest.mark.parametrize("sig, data", [
    (FP32_OUT, np.zeros((1, 2), np.float32)),
    (FP32_OUT, np.zeros((2, 4), np.float32)[:1, ::2]),  # a strided view is still float32
    (FP32_OUT, np.frombuffer(bytes(8), np.dtype("<f4")).reshape(1, 2)),  # as a wire decoder makes it
    (FP32_OUT, np.zeros((1, 2), ">f4")),  # big-endian: still FP32 (the encoders convert it)
    (ModelSignature((), (TensorSpec("y", DType.BF16, (2,)),), 4), np.zeros((1, 2), DType.BF16.numpy)),
    (BYTES_OUT, objects(b"a", "b")),  # str is UTF-8 encoded on the wire
    (BYTES_OUT, objects(np.bytes_(b"a"), np.str_("b"))),
])
def test_check_outputs_takes_data_that_is_what_its_dtype_says(sig: ModelSignature, data: np.ndarray) -> None:
    dtype = sig.outputs[0].dtype
    check_outputs("m", sig, [NamedTensor("y", dtype, data)], 1)


@pytest.mark.parametrize("sig, data, got", [
    (FP32_OUT, np.zeros((1, 2), np.float32).view(np.int32), "a numpy ndarray of int32"),
    (FP32_OUT, np.zeros((1, 2), np.int64), "a numpy ndarray of int64"),
    (FP32_OUT, np.zeros((1, 2), np.float64), "a numpy ndarray of float64"),
    (FP32_OUT, np.full((1, 2), "abc"), "a numpy ndarray of <U3"),
    (FP32_OUT, [[0.0, 0.0]], "a builtins.list"),
    (FP32_OUT, ArrayLike(), r"a [\w.]*test_signature.ArrayLike of float32"),
    (BYTES_OUT, np.array([[b"a", b"b"]]), "a numpy ndarray of |S1"),
    (BYTES_OUT, objects(b"a", 3), r"element 1 of type int \(3\)"),
    (BYTES_OUT, objects(None, b"a"), r"element 0 of type NoneType \(None\)"),
])
def test_check_outputs_refuses_data_that_is_not_what_its_dtype_says(sig: ModelSignature, data: object,
                                                                     got: str) -> None:
    """Defect: only the DType tag and the shape were checked, so float32 bits tagged FP32 but held as int32
    answered differently over gRPC and HTTP, and a jax array or str data failed naming no model."""
    dtype = sig.outputs[0].dtype
    with pytest.raises(ModelFailure, match=f"^model 'm' returned output 'y' tagged {dtype.kserve} holding {got}, "
                                           "expected "):
        check_outputs("m", sig, [NamedTensor("y", dtype, data)], 1)


def test_check_outputs_refuses_a_str_element_utf8_cannot_encode() -> None:
    """Defect (found by the codec property tests): a str BYTES element holding a lone surrogate passed the check,
    then every encoder failed on it with a bare UnicodeEncodeError (or orjson's TypeError) naming no model, and
    the request was counted neither as a success nor as a failure. Text, ASCII or not, and bytes pass."""
    check_outputs("m", BYTES_OUT, [NamedTensor("y", DType.BYTES, objects("ok", "né"))], 1)
    with pytest.raises(ModelFailure, match=r"^model 'm' returned output 'y' tagged BYTES holding element 1 "
                                           r"\('a\\ud800'\), which UTF-8 cannot encode \(a lone surrogate\)"):
        check_outputs("m", BYTES_OUT, [NamedTensor("y", DType.BYTES, objects(b"\xff", "a\ud800"))], 1)


def test_check_outputs_refuses_bool_bytes_other_than_0_or_1() -> None:
    """Defect (found by a bug hunt of the cxx backend): a native library filling a BOOL output with byte 2 had it
    sent to clients, bytes nereid itself refuses in a request (and hands on to a pipeline's next model)."""
    sig = ModelSignature((), (TensorSpec("y", DType.BOOL, (3,)),), 4)
    check_outputs("m", sig, [NamedTensor("y", DType.BOOL, np.array([[True, False, True]]))], 1)
    check_outputs("m", sig, [NamedTensor("y", DType.BOOL, np.zeros((0, 3), np.bool_))], 0)
    raw = np.frombuffer(b"\x00\x01\x02\x01\x00\x00", np.bool_).reshape(2, 3)
    with pytest.raises(ModelFailure, match=r"^model 'm' returned output 'y' tagged BOOL holding byte 2 at element "
                                           r"2; each element must be 0 \(false\) or 1 \(true\)$"):
        check_outputs("m", sig, [NamedTensor("y", DType.BOOL, raw)], 2)
    with pytest.raises(ModelFailure, match="byte 2 at element 0"):  # a strided view is looked at as it is
        check_outputs("m", sig, [NamedTensor("y", DType.BOOL, np.frombuffer(b"\x01\x02" * 3, np.bool_)
                                             .reshape(1, 6)[:, 1::2])], 1)


BYTES_IN = ModelSignature((TensorSpec("s", DType.BYTES, (2,)),), (), 4)


@pytest.mark.parametrize("data, got", [
    (objects(b"ab", 3), r"element 1 of type int \(3\), expected bytes or str elements"),
    (objects(None, b"a"), r"element 0 of type NoneType \(None\), expected bytes or str elements"),
    (objects(b"\xff", "a\ud800"), r"element 1 \('a\\ud800'\), which UTF-8 cannot encode \(a lone surrogate\)"),
])
def test_a_bytes_input_whose_elements_are_not_text_is_refused_before_it_is_queued(data: np.ndarray,
                                                                                   got: str) -> None:
    """Defect: a meta model's sub-call (or a preprocess hook) passing an int or None in a BYTES tensor was queued
    and batched: the whole batch failed, other clients' requests in it included, blamed on the model called."""
    with pytest.raises(InvalidArgument, match=f"^model 'm': input 's' is tagged BYTES but holds {got}"):
        validate_inputs("m", BYTES_IN, [NamedTensor("s", DType.BYTES, data)])
    # bytes (as the wire decoders make them) and text pass
    validate_inputs("m", BYTES_IN, [NamedTensor("s", DType.BYTES, objects(b"a", "né"))])


def test_str_elements_of_a_bytes_input_reach_the_model_as_utf8_bytes() -> None:
    """Found by a bug hunt: a meta model's sub-call passing str elements handed them to the model as str, where
    its clients' requests always bring bytes (a model calling element.decode() failed on the pipeline's only)."""
    sent = NamedTensor("s", DType.BYTES, objects(b"a", "né"))
    received, = validate_inputs("m", BYTES_IN, [sent]).tensors
    assert received.data.tolist() == [[b"a", "né".encode()]] and received.data.shape == (1, 2)
    assert sent.data[0, 1] == "né"  # the caller's own array is left as it was
    client = NamedTensor("s", DType.BYTES, objects(b"a", b"b"))
    assert validate_inputs("m", BYTES_IN, [client]).tensors[0] is client  # bytes only: passed on as it is


def test_a_bool_input_holding_other_bytes_than_0_or_1_is_refused_before_it_is_queued() -> None:
    """Found by a bug hunt: a meta model's sub-call passing a BOOL tensor that holds byte 2 reached the model
    called, where a client's same bytes are refused (the README: a sub-call's data is checked as a client's)."""
    sig = ModelSignature((TensorSpec("b", DType.BOOL, (3,)),), (), 4)
    raw = np.frombuffer(b"\x00\x01\x02", np.bool_).reshape(1, 3)
    with pytest.raises(InvalidArgument, match=r"^model 'm': input 'b' is tagged BOOL but holds byte 2 at element 2; "
                                              r"each element must be 0 \(false\) or 1 \(true\)$"):
        validate_inputs("m", sig, [NamedTensor("b", DType.BOOL, raw)])
    validate_inputs("m", sig, [NamedTensor("b", DType.BOOL, np.array([[True, False, True]]))])


def test_check_outputs_names_a_tag_that_is_no_dtype() -> None:
    with pytest.raises(ModelFailure, match="^model 'm' returned output 'y' as 'FP32', expected FP32$"):
        check_outputs("m", FP32_OUT, [NamedTensor("y", "FP32", np.zeros((1, 2), np.float32))], 1)


class CountedRepr:
    """An element of a model's wrong output that counts how often its repr is taken."""

    calls = 0

    def __repr__(self) -> str:
        CountedRepr.calls += 1
        return "e"


def test_a_bare_array_among_the_outputs_is_named_as_what_it_is() -> None:
    """Defect: a plugin returning [ndarray] was told it "returned outputs [None]" (its name, read as None)."""
    outputs = [np.zeros((1, 2), np.float32)]
    with pytest.raises(ModelFailure, match=r"^model 'm' returned a list whose item 0 is ndarray "
                                           r"array\(\[\[0\., 0\.\]\], dtype=float32\), expected a list of "
                                           r"NamedTensor \(outputs \['y'\]\)$"):
        check_outputs("m", FP32_OUT, outputs, 1)


def test_an_output_that_only_looks_like_a_named_tensor_is_named_as_what_it_is() -> None:
    """Found by a bug hunt: an item with the right name, dtype and data passed, then failed on the wire with an
    AttributeError naming no model (HTTP 500, gRPC INTERNAL), counted as neither a success nor a failure."""
    import types
    outputs = [types.SimpleNamespace(name="y", dtype=DType.FP32, data=np.zeros((1, 2), np.float32))]
    with pytest.raises(ModelFailure, match=r"^model 'm' returned a list whose item 0 is SimpleNamespace .*, expected "
                                           r"a list of NamedTensor \(outputs \['y'\]\)$"):
        check_outputs("m", FP32_OUT, outputs, 1)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # (numpy's of np.matrix)
@pytest.mark.parametrize("make", [lambda: np.matrix([[1.0, 2.0]], np.float32),
                                  lambda: np.ma.masked_array(np.ones((1, 2), np.float32), mask=[[0, 1]])],
                         ids=["matrix", "masked"])
def test_an_output_of_an_ndarray_subclass_is_refused_naming_it(make) -> None:
    """Found by the plugin hunt: an np.matrix output (right dtype and shape) was encoded as a flat array would
    be, the answer corrupt (gRPC: "Exception deserializing response!") and counted a success."""
    data = make()
    with pytest.raises(ModelFailure, match=r"^model 'm' returned output 'y' as a numpy\.\S+, expected a plain "
                                           r"numpy ndarray \(np\.asarray makes one\)$"):
        check_outputs("m", FP32_OUT, [NamedTensor("y", DType.FP32, data)], 1)


def test_a_memmap_output_is_taken_as_the_ndarray_it_is(tmp_path) -> None:
    data = np.memmap(tmp_path / "y.bin", np.float32, "w+", shape=(1, 2))
    assert check_outputs("m", FP32_OUT, [NamedTensor("y", DType.FP32, data)], 1)[0].data is data


def test_an_input_tagged_with_a_string_is_told_what_its_datatype_should_be() -> None:
    """Found by a bug hunt: a meta model's sub-call input NamedTensor("x", "FP32", ...) failed with AttributeError:
    'str' object has no attribute 'kserve', naming neither the input nor what was expected."""
    with pytest.raises(InvalidArgument) as caught:
        validate_inputs("m", BATCHED, [NamedTensor("x", "FP32", np.zeros((4, 3), np.float32))])
    assert str(caught.value) == "model 'm': input 'x' has datatype 'FP32', expected FP32 (a nereid DType: DType.FP32)"


# Each output made by its test, not at collection: every xdist worker collects every test, and would otherwise
# build (and keep through the run, slowing each full garbage collection) 400,000 objects.
@pytest.mark.parametrize("make_outputs, quoted", [
    # Not a list: its repr would be cut, so its length and the types of its first items.
    (lambda: tuple(CountedRepr() for _ in range(100_000)), "returned tuple of 100000 item(s): CountedRepr, "),
    (lambda: [CountedRepr() for _ in range(100_000)], "returned a list whose item 0 is CountedRepr e, expected a "
                                                      "list of NamedTensor"),  # a list of no NamedTensor
    (lambda: [NamedTensor("y", DType.BYTES, objects(b"a", *(CountedRepr() for _ in range(3))))],
     "holding element 1 of type CountedRepr (e)"),
    # Subclasses of the containers, which reprlib would quote with their whole repr.
    (lambda: collections.OrderedDict((i, CountedRepr()) for i in range(100_000)),
     "returned OrderedDict with 100000 key(s) 0, 1, 2, 3, 4, 5, 6, 7, ..., expected"),
    (lambda: collections.UserList(CountedRepr() for _ in range(100_000)),
     "returned UserList of 100000 item(s): CountedRepr, "),
], ids=["tuple", "list", "bytes-tensor-element", "OrderedDict", "UserList"])
def test_a_huge_wrong_output_is_quoted_from_a_bounded_part_of_it(make_outputs, quoted: str) -> None:
    """Defect: the message took the full repr of a model's wrong output before cutting it to 100 characters:
    seconds and gigabytes for a list of ten million elements."""
    outputs = make_outputs()
    CountedRepr.calls = 0
    with pytest.raises(ModelFailure) as caught:
        check_outputs("m", BYTES_OUT, outputs, 1)
    message = str(caught.value)
    assert message.startswith("model 'm' ") and quoted in message and len(message) < 300, message[:300]
    assert CountedRepr.calls <= 100


@pytest.mark.parametrize("make", [lambda: "x" * 50_000_000, lambda: b"x" * 50_000_000,
                                  lambda: [NamedTensor("x" * 50_000_000, DType.FP32, np.zeros((1, 2), np.float32))]])
def test_a_huge_string_in_a_wrong_output_is_not_copied_for_the_message(make) -> None:
    import tracemalloc

    outputs = make()
    tracemalloc.start()
    try:
        with pytest.raises(ModelFailure,
                           match=r"^model 'm' returned (str 'x+\.\.\.x+'|bytes b'x+\.\.\.x+'|outputs \['x+\.\.\.x+), "):
            check_outputs("m", FP32_OUT, outputs, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated for a message of 100 characters"


def test_an_element_or_tag_whose_repr_cannot_be_written_still_fails_as_the_model_s() -> None:
    # An int of more than 4300 digits (int -> str refuses it), a repr that raises, a tuple nested past the
    # recursion limit: each raised its own error from the message, in place of the ModelFailure naming the model.
    class NoRepr:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")
    nested: tuple = ()
    for _ in range(100_000):
        nested = (nested,)
    with pytest.raises(ModelFailure, match=r"element 1 of type int \(<int of 16610 bits>\)"):
        check_outputs("m", BYTES_OUT, [NamedTensor("y", DType.BYTES, objects(b"a", 10**5000))], 1)
    with pytest.raises(ModelFailure, match=r"^model 'm' returned output 'y' as <NoRepr instance at 0x"):
        check_outputs("m", FP32_OUT, [NamedTensor("y", NoRepr(), np.zeros((1, 2), np.float32))], 1)
    with pytest.raises(ModelFailure, match=r"^model 'm' returned tuple of 1 item\(s\): tuple, expected"):
        check_outputs("m", FP32_OUT, nested, 1)


@pytest.mark.parametrize("value", [
    ("y", 1), {"b": [1, 2], "a": {3: (4,)}}, {"s", "t"}, frozenset({2, 1}), b"\x00'a", "say \"it's\"", None,
    tuple(range(40)), "x" * 200, np.zeros((2, 2), np.float32), 10**120, ([],) * 3, bytearray(b"ab")])
def test_a_small_wrong_output_reads_as_before(value: object) -> None:
    """The bounded message quotes what the full repr cut to 100 characters quoted, for any value that fits
    (any but a list, which is taken for the outputs: see the test below), on one line."""
    with pytest.raises(ModelFailure) as caught:
        check_outputs("m", FP32_OUT, value, 1)
    if len(repr(value)) < 100:
        one_line = re.sub(r"\s*\n\s*", " ", repr(value))
        assert str(caught.value) == (f"model 'm' returned {type(value).__name__} {one_line}, expected a list of "
                                     "NamedTensor (outputs ['y'])")
    elif isinstance(value, tuple):  # a long container: its length and item types (see the test below)
        assert str(caught.value).startswith(f"model 'm' returned tuple of {len(value)} item(s): int, int, ")
    else:  # a long one is cut as before, to 100 characters
        assert str(caught.value).startswith(f"model 'm' returned {type(value).__name__} {repr(value)[:40]}")
    tag = value if isinstance(value, str) else repr(value)
    with pytest.raises(ModelFailure) as caught:
        check_outputs("m", FP32_OUT, [NamedTensor("y", tag, np.zeros((1, 2), np.float32))], 1)
    assert str(caught.value).startswith(f"model 'm' returned output 'y' as {tag!r:.40}")


@pytest.mark.parametrize("make_outputs, described", [
    (lambda: (np.full((3, 2), 5, np.float32), np.full((3, 2), 6, np.float32)),
     "tuple of 2 item(s): ndarray, ndarray"),
    (lambda: {"y": NamedTensor("y", DType.FP32, np.linspace(0, 1, 64, dtype=np.float32).reshape(32, 2))},
     "dict with 1 key(s) 'y'"),
    (lambda: np.linspace(0, 1, 64, dtype=np.float32).reshape(32, 2), "ndarray of float32 with shape [32, 2]"),
], ids=["tuple of arrays", "dict of tensors", "array"])
def test_a_container_of_arrays_is_named_by_its_type_not_a_cut_printout(make_outputs, described: str) -> None:
    """Found by a README check: a plugin's infer returning a tuple (or a hook a dict) got a message holding
    numpy's printout of its arrays, over several lines and cut mid-token ("5., 5.]],\n      dtype=float32), ")."""
    with pytest.raises(ModelFailure) as caught:
        check_outputs("m", FP32_OUT, make_outputs(), 1)
    assert str(caught.value) == f"model 'm' returned {described}, expected a list of NamedTensor (outputs ['y'])"


def test_a_bare_array_among_the_outputs_is_quoted_on_one_line() -> None:
    outputs = [np.zeros((2, 2), np.float32)]
    with pytest.raises(ModelFailure) as caught:
        check_outputs("m", FP32_OUT, outputs, 2)
    assert str(caught.value) == ("model 'm' returned a list whose item 0 is ndarray array([[0., 0.], [0., 0.]], "
                                 "dtype=float32), expected a list of NamedTensor (outputs ['y'])")


def test_a_short_list_of_wrong_outputs_is_named_as_before() -> None:
    names = [NamedTensor(name, DType.FP32, np.zeros((1, 2), np.float32)) for name in ("a", "b")]
    with pytest.raises(ModelFailure, match=r"^model 'm' returned outputs \['a', 'b'\], expected \['y'\]$"):
        check_outputs("m", FP32_OUT, names, 1)


@pytest.mark.parametrize("text, scalar", [("input_shape: [4]\noutput_shape: []\n", "output"),
                                          ("input_shape: []  # one number\noutput_shape: [1]\n", "input")])
def test_an_empty_shape_in_the_single_tensor_form_is_a_scalar(tmp_path: Path, text: str, scalar: str) -> None:
    """Found by a bug hunt: proto3 reads `output_shape: []` as no field at all: the model was refused for
    declaring no output (and `input_shape: []` left it with no input, a client's scalar refused as unexpected)."""
    path = tmp_path / "model_inference.textproto"
    path.write_text(text)
    signature = load_textproto_signature(path)
    declared = {"input": signature.inputs, "output": signature.outputs}
    assert [(spec.name, spec.dims) for spec in declared[scalar]] == [(scalar, ())]
    assert len(signature.inputs) == len(signature.outputs) == 1
    path.write_text("# output_shape: []\ninput_shape: [4]\n")  # a comment writes nothing
    with pytest.raises(ConfigError, match="a model must declare its output"):
        load_textproto_signature(path)


@pytest.mark.parametrize("text", ["", "# nothing yet\n", "input_shape: [4]\n", 'input { name: "x" data_type: "FP32" '
                                  "dims: [4] }\n"])
def test_a_textproto_declaring_no_output_is_refused_for_every_backend(tmp_path: Path, text: str) -> None:
    """Found by the plugin hunt: an empty model_inference.textproto loaded a plugin's model READY with no tensors
    (the python and cxx backends refused it themselves; a plugin using load_textproto_signature did not)."""
    path = tmp_path / "model_inference.textproto"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_textproto_signature(path)
    assert str(refused.value) == (f"{path}: a model must declare its output (output_shape, or output {{}} blocks); "
                                  "this file declares none (an empty or half-written file?)")
