"""A model's tensor signature and the rules that check requests against it.

The signature comes from ``model_inference.textproto`` (see
:func:`load_textproto_signature`) or from a backend's own metadata (a bundle
manifest); either way the core validates every request against it before the
request is queued.
"""

from __future__ import annotations

import difflib
import functools
import math
import re
import reprlib
import collections.abc
from collections import Counter
from dataclasses import dataclass
from itertools import islice, repeat
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from google.protobuf import text_format

from nereid._proto import model_inference_pb2
from nereid.dtypes import DType
from nereid.errors import ConfigError, InvalidArgument, ModelFailure, PublicText, cap_message
from nereid.files import read_text_file
from nereid.tensors import NamedTensor
from nereid.triton_hints import datatype_hint, textproto_hint

TEXTPROTO_NAME = "model_inference.textproto"

# What a model may declare: more is refused at load with a clear error (a 100k-input textproto
# once took 85 s to check). Requests are held to the same rank (nereid.protocol.grpc_codec).
MAX_DECLARED_TENSORS = 4096  # inputs, and outputs, each
MAX_RANK = 32
# A request's tensor (or a batch sent to a model) holds one axis more than a model declares, its batch axis:
# clients were refused a batched request to a model declaring MAX_RANK dims. (numpy 1 holds 32 dims at most, so
# under it such a model's batches cannot be made at all.)
MAX_REQUEST_RANK = min(MAX_RANK + 1, 64 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 32)
MAX_TEXTPROTO_BYTES = 1 << 20

# Tensor names of the single-tensor textproto form, which declares no names.
SINGLE_INPUT_NAME = "input"
SINGLE_OUTPUT_NAME = "output"


@dataclass(frozen=True)
class TensorSpec:
    """One declared tensor: name, datatype and dims without the batch axis (-1: any size)."""

    name: str
    dtype: DType
    dims: tuple[int, ...]


@dataclass(frozen=True)
class ModelSignature:
    """What a model takes and returns.

    ``max_batch_size`` > 0: requests carry a leading batch axis of at most that
    size (or omit it and are expanded to batch 1); 0: no batch axis.
    ``single_tensor_form`` records that the textproto used ``input_shape`` /
    ``output_shape`` (subprocess backends frame their I/O differently then).
    """

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int = 0
    single_tensor_form: bool = False

    @property
    def batches(self) -> bool:
        """True when requests carry a batch axis."""
        return self.max_batch_size > 0

    @functools.cached_property
    def input_names(self) -> list[str]:
        """The declared input names, in order."""
        return [spec.name for spec in self.inputs]

    @functools.cached_property
    def output_names(self) -> list[str]:
        """The declared output names, in order."""
        return [spec.name for spec in self.outputs]

    @functools.cached_property
    def input_datatypes(self) -> dict[str, DType]:
        """Each declared input's datatype, by name (what the wire decoders check before reading a tensor's
        elements: see :func:`check_datatype`)."""
        return {spec.name: spec.dtype for spec in self.inputs}



@dataclass(frozen=True)
class ValidatedInputs:
    """Request inputs in the signature's order, each with its batch axis present.

    ``batch_size`` is the rows along the batch axis (1 for models without one);
    ``batch_axis_added`` records that the client omitted it, so the response
    omits it too.
    """

    tensors: list[NamedTensor]
    batch_size: int
    batch_axis_added: bool


def load_textproto_signature(path: Path) -> ModelSignature:
    """Parse and check a ``model_inference.textproto``; ConfigError names the file and problem."""
    # A byte order mark (some Windows editors save one) is no part of the text: protobuf refused the invisible
    # character as the first token ("Expected identifier or number, got \ufeff").
    text = read_text_file(path, MAX_TEXTPROTO_BYTES).removeprefix("\ufeff")
    message = model_inference_pb2.ModelInference()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as err:
        problem = _parse_problem(err, text)
        hint = textproto_hint(problem, text) or unknown_field_hint(problem)
        raise ConfigError(cap_message(f"{path}:{problem}{hint}")) from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to parse") from None
    signature = _signature_from_message(message, path, _shapes_written(text))
    if not signature.outputs:  # (for every backend that reads one: a plugin's loaded READY, serving nothing)
        raise ConfigError(f"{path}: a model must declare its output (output_shape, or output {{}} blocks); this "
                          "file declares none (an empty or half-written file?)")
    return signature


def _shapes_written(text: str) -> frozenset[str]:
    """Which of ``input_shape`` / ``output_shape`` the text writes: proto3 reads ``output_shape: []`` (a scalar)
    as no field at all, and the model then had no output (or its scalar input was refused as unexpected)."""
    tokenizer = text_format.Tokenizer(text.split("\n"))  # (comments skipped, strings quoted)
    written = set()
    while not tokenizer.AtEnd():
        if tokenizer.token in ("input_shape", "output_shape"):
            written.add(tokenizer.token)
        tokenizer.NextToken()
    return frozenset(written)


# How a problem of a file cut short ends (see _parse_problem).
_CUT_SHORT = "was it cut short?"


def _parse_problem(error: text_format.ParseError, text: str) -> str:
    """ParseError's "line:column : problem", without the whole source line some of them quote.

    A load failure reaches remote clients (RepositoryIndex), so it must not
    carry the file's lines (comments and all); the offending token the problem
    names stays.
    """
    problem = str(error)
    line, column = error.GetLine(), error.GetColumn()
    # protobuf numbers lines by "\n" alone (a "\r" or a U+2028 stays in the line it quotes).
    if line is not None and 0 < line <= len(lines := text.split("\n")):
        quoted = f"{line}:{column} : '{lines[line - 1]}': "
        if problem.startswith(quoted):
            problem = f"{line}:{column} : {problem[len(quoted):]}"
        rest = "\n".join(lines[line - 1:])[max(column - 1, 0):].strip() if column is not None else None
        if rest == "":
            # At the end of the text protobuf names an empty token ("'': Couldn't parse integer: "): the file
            # was cut short, which is the news (the Triton client hunt).
            said = problem.split(" : ", 1)[-1].removeprefix("'': ").replace(" but found: ''", "").strip().rstrip(":.")
            problem = f"{line}:{column} : the file ends before this field is complete ({said}); {_CUT_SHORT}"
        elif rest is not None and _ends_inside_a_token(rest, problem):
            # The last token broken off (`inpu`, `"FP`): protobuf's complaint about the fragment hid the news.
            problem = f"{problem.rstrip('.')}; the file ends right there: {_CUT_SHORT}"
    return problem


# Fields written where another is meant, whose right name difflib cannot find: a bundle manifest's ``shape`` in an
# input {} block, or a shape at the top (of which form?).
_FIELD_MEANT = {
    ("TensorDeclaration", "shape"): "an input {} / output {} block writes its shape as dims: dims: [4]",
    ("ModelInference", "shape"): "the single-tensor form's shapes are input_shape and output_shape",
    ("ModelInference", "dims"): "dims belongs in an input {} / output {} block; the single-tensor form's shapes are "
                                "input_shape and output_shape",
}
# Where each message's fields are written, for the list of them.
_MESSAGE_PLACE = {"ModelInference": f"{TEXTPROTO_NAME}'s", "TensorDeclaration": "an input {} / output {} block's"}


def unknown_field_hint(problem: str) -> str:
    """For protobuf's ``problem`` 'Message type "nereid.X" has no field named "f"' (a typo, or another format's
    word), the field meant, or the fields there are (" (did you mean input_shape?)"); "" for any other problem, and
    for a file cut short inside that field's name (the news is the cut)."""
    found = re.search(r'Message type "nereid\.(\w+)" has no field named "(\w+)"', problem)
    if found is None or problem.endswith(_CUT_SHORT):
        return ""
    message, field = found.groups()
    descriptor = model_inference_pb2.DESCRIPTOR.message_types_by_name.get(message)
    if descriptor is None:
        return ""
    meant = _FIELD_MEANT.get((message, field))
    if meant is not None:
        return f" ({meant})"
    fields = [f.name for f in descriptor.fields]
    close = difflib.get_close_matches(field, fields, n=1)
    if close:
        return f" (did you mean {close[0]}?)"
    return f" ({_MESSAGE_PLACE.get(message, 'its')} fields are {', '.join(fields)})"


def _ends_inside_a_token(rest: str, problem: str) -> bool:
    """Whether ``rest``, the text from protobuf's error to the end, is the one token its ``problem`` refuses (a
    field name broken off, a string never closed), or ends a block never closed."""
    unknown_field = re.search(r'has no field named "(\w+)"', problem)
    if unknown_field is not None:
        return rest == unknown_field.group(1)
    if 'Expected "}"' in problem:  # a block still open at the end: protobuf points at its last field's value
        return "}" not in rest
    return "String missing ending quote" in problem and "\n" not in rest


def _signature_from_message(msg: model_inference_pb2.ModelInference, path: Path,
                            shapes_written: frozenset[str] = frozenset()) -> ModelSignature:
    single = bool(msg.input_shape or msg.output_shape or msg.data_type or shapes_written)
    multi = bool(msg.input or msg.output)
    if single and multi:
        raise ConfigError(
            f"{path}: use either input_shape/output_shape/data_type or input {{}}/output {{}} "
            "blocks, not both"
        )
    if msg.max_batch_size < 0:
        raise ConfigError(f"{path}: max_batch_size must be >= 0, got {msg.max_batch_size}")
    if multi:
        for kind, declared in (("input", msg.input), ("output", msg.output)):
            if len(declared) > MAX_DECLARED_TENSORS:
                raise ConfigError(f"{path}: declares {len(declared)} {kind}s; at most {MAX_DECLARED_TENSORS} "
                                  "are supported")
        inputs = tuple(_tensor_spec(d.name, d.data_type, d.dims, f"input {i}", path) for i, d in enumerate(msg.input))
        outputs = tuple(_tensor_spec(d.name, d.data_type, d.dims, f"output {i}", path) for i, d in enumerate(msg.output))
        for kind, specs in (("input", inputs), ("output", outputs)):
            duplicates = duplicated(spec.name for spec in specs)
            if duplicates:
                raise ConfigError(cap_message(f"{path}: duplicate {kind} name(s) {', '.join(duplicates)}"))
    else:
        data_type = msg.data_type or "FP32"
        inputs = (
            (_tensor_spec(SINGLE_INPUT_NAME, data_type, msg.input_shape, "input_shape", path),)
            if msg.input_shape or "input_shape" in shapes_written
            else ()
        )
        outputs = (
            (_tensor_spec(SINGLE_OUTPUT_NAME, data_type, msg.output_shape, "output_shape", path),)
            if msg.output_shape or "output_shape" in shapes_written
            else ()
        )
    return ModelSignature(inputs, outputs, msg.max_batch_size, single_tensor_form=not multi)


def duplicated(names: Iterable[str]) -> list[str]:
    """The names that occur more than once, sorted (one pass: linear in the number of names)."""
    return sorted(name for name, count in Counter(names).items() if count > 1)


def _tensor_spec(name: str, data_type: str, dims, where: str, path: Path) -> TensorSpec:
    if not name:
        raise ConfigError(f"{path}: {where} has no name")
    if len(dims) > MAX_RANK:
        raise ConfigError(cap_message(f"{path}: {where} ({name}): declares {len(dims)} dims; at most {MAX_RANK} "
                                      "are supported"))
    try:
        dtype = DType.from_kserve(data_type)
    except ValueError as err:
        # (Only the single form has a default, FP32: a block without data_type said "unknown datatype ''".)
        problem = "missing" + str(err).removeprefix("unknown datatype ''") if not data_type else str(err)
        hint = datatype_hint(data_type)
        raise ConfigError(f"{path}: {where} ({name}): data_type: {problem}{f'; {hint}' if hint else ''}") from None
    for dim in dims:
        if dim == 0 or dim < -1:
            raise ConfigError(
                f"{path}: {where} ({name}): dims must be positive or -1 (any size), got {list(dims)}"
            )
    return TensorSpec(name, dtype, tuple(int(d) for d in dims))


def dims_match(actual: tuple[int, ...], declared: tuple[int, ...]) -> bool:
    """True when ``actual`` has the declared rank and every fixed dim matches (-1: any)."""
    if actual == declared:
        return True  # the common case on every request: a fixed shape, sent as declared
    return len(actual) == len(declared) and all(d == -1 or d == a for a, d in zip(actual, declared))


def expected_byte_size(dtype: DType, shape: tuple[int, ...]) -> int | None:
    """Bytes a raw tensor of this type and shape must have (None for BYTES)."""
    if dtype.itemsize is None:
        return None
    return math.prod(shape) * dtype.itemsize


def validate_inputs(model: str, signature: ModelSignature, tensors: list[NamedTensor]) -> ValidatedInputs:
    """Check request tensors against the signature and return them in declared order.

    Raises InvalidArgument naming the model, the tensor, what was expected and
    what was received, for a missing, unexpected, mistyped or misshapen input or
    a batch over ``max_batch_size``; its message is a PublicText (the client's
    names echoed as sent).
    """
    specs = signature.inputs
    if [t.name for t in tensors] == signature.input_names:
        in_order = tensors  # the common case: exactly the declared inputs, in order
    else:
        by_name = _index_by_name(model, signature, tensors)
        in_order = [by_name.get(spec.name) for spec in specs]
    ordered: list[NamedTensor] = []
    sizes: list[int | None] = []  # each input's batch size; None where the client omitted the axis
    for spec, tensor in zip(specs, in_order):
        if tensor is None:
            raise _refusal(
                f"model '{model}': missing input '{spec.name}' (expected inputs: {_names([s.name for s in specs])}; "
                f"received: {', '.join(repr(t.name) for t in tensors) or 'none'})"
            )
        check_datatype(model, spec.name, tensor.dtype, spec.dtype)
        data = tensor.data
        if type(data) is not np.ndarray and not isinstance(data, np.ndarray):
            if not isinstance(data, np.generic):
                # (A meta model's sub-call, a hook's tensors: a list failed with an AttributeError, uncounted.)
                raise _refusal(f"model '{model}': input '{spec.name}' holds a {type(data).__name__}, expected a "
                               f"numpy ndarray of {spec.dtype.numpy} (NamedTensor.from_array makes one)")
            data = np.asarray(data)  # a numpy scalar (a sum passed on): the 0-d array it is, as before
            tensor = NamedTensor(tensor.name, tensor.dtype, data)
        held = data.dtype
        if held is not spec.dtype.numpy:  # the wire decoders make exactly that dtype: nothing more to ask
            if held.newbyteorder("=") != spec.dtype.numpy:
                # Data that disagrees with its tag (a meta model's or a hook's tensors): backends read it by
                # the tag or by the array, so it would fail naming no tensor or compute on reinterpreted bytes.
                raise _refusal(f"model '{model}': input '{spec.name}' is tagged {spec.dtype.kserve} but "
                               f"holds {held} data, expected a numpy ndarray of {spec.dtype.numpy}")
            if not held.isnative:
                # A big-endian array (a meta model may pass one on): in native order for every backend, as
                # the wire decoders make them; a program reading its bytes as they lie would compute garbage.
                tensor = NamedTensor(tensor.name, tensor.dtype, tensor.data.astype(held.newbyteorder("=")))
        if spec.dtype is DType.BYTES:
            tensor = _as_bytes_elements(model, spec.name, tensor)
        elif spec.dtype is DType.BOOL and (problem := bool_bytes_problem(tensor.data)) is not None:
            # (A client's are refused by the decoders already; a meta model's sub-call or a hook's come here.)
            raise _refusal(f"model '{model}': input '{spec.name}' is tagged BOOL but holds {problem}")
        shape = tensor.data.shape
        if not signature.batches:
            if not dims_match(shape, spec.dims):
                # A batch axis sent to a model without one (a client written for a batching model) is the one slip
                # a newcomer cannot read from the two shapes: said so.
                unbatched = len(shape) == len(spec.dims) + 1 and dims_match(shape[1:], spec.dims)
                raise _refusal(
                    f"model '{model}': input '{spec.name}' has shape {list(shape)}, "
                    f"expected {_shape_text(spec.dims, batched=False)}"
                    + (" (the model does not batch: max_batch_size 0)" if unbatched else "")
                )
        elif len(shape) == len(spec.dims) + 1 and dims_match(shape[1:], spec.dims):  # the usual form
            if not 1 <= shape[0] <= signature.max_batch_size:
                raise _refusal(
                    f"model '{model}': input '{spec.name}' has batch size {shape[0]}, "
                    f"expected 1 to max_batch_size {signature.max_batch_size}"
                )
            sizes.append(shape[0])
        elif dims_match(shape, spec.dims):
            tensor = NamedTensor(tensor.name, tensor.dtype, tensor.data.reshape((1, *shape)))
            sizes.append(None)
        else:
            raise _refusal(
                f"model '{model}': input '{spec.name}' has shape {list(shape)}, expected "
                f"{_shape_text(spec.dims, batched=True)} or {_shape_text(spec.dims, batched=False)}"
            )
        ordered.append(tensor)
    if len(set(sizes)) > 1:
        described = ", ".join(f"'{spec.name}': {'no batch axis' if size is None else size}"
                              for spec, size in zip(specs, sizes))
        raise _refusal(f"model '{model}': inputs disagree on the batch size ({described})")
    first = sizes[0] if sizes else None
    return ValidatedInputs(ordered, first or 1, signature.batches and first is None)


def check_datatype(model: str, name: str, dtype: Any, expected: DType) -> None:
    """InvalidArgument (a PublicText) when input ``name``, tagged ``dtype``, is declared ``expected``.

    :func:`validate_inputs` asks it of every input; the wire decoders ask it of a tensor the model declares as soon
    as its datatype is read, before any of its elements is: a BYTES tensor of 13 million 1-byte elements sent to an
    FP32 input was split into as many Python objects (4.9 s, +880 MiB) only to be refused with this message.
    """
    if dtype is not expected:
        raise _refusal(
            f"model '{model}': input '{name}' has datatype {_tag(dtype)}, expected {expected.kserve}"
            + ("" if isinstance(dtype, DType) else f" (a nereid DType: DType.{expected.name})")
        )


def check_outputs(model: str, signature: ModelSignature, outputs: Sequence[NamedTensor],
                  batch_size: int) -> list[NamedTensor]:
    """Hold a backend (or hook) to the declared outputs, so a bad one fails loudly, not on the wire; returns them
    as a list (a tuple of them is taken too, as from the hooks).

    Raises ModelFailure naming the model, the output, and what was expected.
    The data must be what its DType says (a numpy array of the DType's numpy
    dtype; BYTES: an object array of bytes or str), not only be tagged so: the
    protocol encoders trust the tag, and read other data differently (float32
    bits tagged as int32 over gRPC, their values over HTTP) or fail naming no
    model.
    """
    expected = signature.outputs
    if isinstance(outputs, tuple) and all(isinstance(item, NamedTensor) for item in outputs):
        outputs = list(outputs)  # (anything else in a tuple is described as the tuple it is)
    if not isinstance(outputs, list):
        raise ModelFailure(f"model '{model}' returned {brief_description(outputs)}, expected a "
                           f"list of NamedTensor (outputs {signature.output_names})")
    # The length first: a model that returns a huge list costs no list of its names.
    if len(outputs) != len(expected) or any(getattr(t, "name", None) != spec.name
                                            for t, spec in zip(outputs, expected)):
        # An item that is no NamedTensor (a bare array) is named as such: its "name" would read as None.
        for index, item in enumerate(islice(outputs, BRIEF_LIMIT)):
            if not isinstance(item, NamedTensor):
                raise ModelFailure(f"model '{model}' returned a list whose item {index} is "
                                   f"{brief_description(item)}, expected a list of NamedTensor "
                                   f"(outputs {signature.output_names})")
        # The names of a bounded prefix: each takes a character at least, so the message shows no more.
        names = [getattr(t, "name", None) for t in islice(outputs, BRIEF_LIMIT)]
        raise ModelFailure(f"model '{model}' returned outputs {brief_repr(names)}, "
                           f"expected {signature.output_names}")
    copied = False
    for index, (tensor, spec) in enumerate(zip(outputs, expected)):
        if not isinstance(tensor, NamedTensor):  # (named right, it passed, and failed on the wire: a bug hunt)
            raise ModelFailure(f"model '{model}' returned a list whose item {index} is {brief_description(tensor)}, "
                               f"expected a list of NamedTensor (outputs {signature.output_names})")
        if tensor.dtype is not spec.dtype:
            raise ModelFailure(f"model '{model}' returned output '{spec.name}' as "
                               f"{_tag(tensor.dtype)}, expected {spec.dtype.kserve}")
        data = tensor.data
        if isinstance(data, np.generic):
            # A numpy scalar (np.sum's result for a scalar output): the 0-d array it is, as a meta model's sub-call
            # takes it as an input; refused, a model returning one failed every request.
            data = np.asarray(data)
            if not copied:  # (the model's own list stays as it returned it)
                outputs, copied = list(outputs), True
            outputs[index] = tensor = NamedTensor(tensor.name, tensor.dtype, data)
        if type(data) is not np.ndarray and isinstance(data, np.ndarray) and not isinstance(data, np.memmap):
            # A subclass reshapes and views as its own rules say (np.matrix stays 2-D, a masked array carries a
            # mask the wire has no room for): encoded as an ndarray, its answer was corrupt, yet counted a success
            # (the plugin hunt). A memmap is an ndarray in all but where its bytes live.
            raise ModelFailure(f"model '{model}' returned output '{spec.name}' as a {type(data).__module__}."
                               f"{type(data).__qualname__}, expected a plain numpy ndarray (np.asarray makes one)")
        wanted = spec.dtype.numpy
        # ``is`` first: numpy's built-in dtypes are shared objects, so the usual case costs no comparison.
        # Either byte order is the datatype (the encoders convert a big-endian array).
        if not isinstance(data, np.ndarray) or (data.dtype is not wanted and data.dtype != wanted
                                                and data.dtype.newbyteorder("=") != wanted):
            raise ModelFailure(f"model '{model}' returned output '{spec.name}' tagged {spec.dtype.kserve} holding "
                               f"{_array_text(data)}, expected a numpy ndarray of {wanted}")
        if spec.dtype is DType.BYTES and (problem := _text_problem(data)) is not None:
            raise ModelFailure(f"model '{model}' returned output '{spec.name}' tagged {spec.dtype.kserve} "
                               f"holding {problem}")
        if spec.dtype is DType.BOOL and (problem := bool_bytes_problem(data)) is not None:
            raise ModelFailure(f"model '{model}' returned output '{spec.name}' tagged BOOL holding {problem}")
        shape = data.shape
        if signature.batches:
            ok = len(shape) == len(spec.dims) + 1 and shape[0] == batch_size and dims_match(shape[1:], spec.dims)
            expected_shape = [batch_size, *spec.dims]
        else:
            ok = dims_match(shape, spec.dims)
            expected_shape = list(spec.dims)
        if not ok:
            raise ModelFailure(f"model '{model}' returned output '{spec.name}' with shape "
                               f"{list(shape)}, expected {expected_shape}")
    return outputs


# How many characters of a model's wrong value a message quotes.
BRIEF_LIMIT = 100


def brief_repr(value: object, limit: int = BRIEF_LIMIT) -> str:
    """``repr(value)`` cut to ``limit`` characters, built from a bounded part of ``value``.

    A model may return a huge wrong object (a list of ten million elements, a
    string of a gigabyte); its full repr, cut only afterwards, cost seconds and
    gigabytes on the way to a message of 100 characters (and a repr that raises,
    nests too deeply or holds an int of more than 4300 digits raised in its place).
    A value whose repr fits in ``limit`` characters reads as ``repr`` writes it.
    """
    return _BoundedRepr(limit).repr(value)[:limit]


def brief_description(value: object, limit: int = BRIEF_LIMIT) -> str:
    """``value``'s type and :func:`brief_repr`, on one line, for a message about a wrong result: ``tuple ('y', 1)``.

    Where that repr would be cut (a dict or tuple of tensors, whose arrays
    alone take more), it reads as the value's shape instead: a numpy array's
    dtype and shape, a mapping's keys, a collection's length and the types of
    its first items (``dict with 1 key(s) 'input'``, ``tuple of 2 item(s):
    ndarray, ndarray``): a repr cut mid-token says less. Never raises.
    """
    kind = type(value).__name__
    text = brief_repr(value, limit)
    # numpy writes an array's rows on lines of their own: a message is one line (a str's repr has no line break).
    flat = _LINE_BREAK.sub(" ", text)
    if len(text) < limit:  # (limit characters: possibly cut)
        return f"{kind} {flat}"
    try:
        if isinstance(value, np.ndarray):
            return f"{kind} of {value.dtype} with shape {list(value.shape)}"
        if isinstance(value, collections.abc.Mapping):
            keys = list(islice(value, _SHOWN_ITEMS + 1))
            shown = ", ".join(brief_repr(key, 40) for key in keys[:_SHOWN_ITEMS])
            return f"{kind} with {len(value)} key(s) {shown}{', ...' if len(keys) > _SHOWN_ITEMS else ''}"
        if isinstance(value, collections.abc.Collection) and not isinstance(value, (str, bytes, bytearray)):
            items = list(islice(value, _SHOWN_ITEMS + 1))
            shown = ", ".join(type(item).__name__ for item in items[:_SHOWN_ITEMS])
            return f"{kind} of {len(value)} item(s): {shown}{', ...' if len(items) > _SHOWN_ITEMS else ''}"
    except Exception:  # a container whose len() or iteration fails: quoted as any other value
        pass
    return f"{kind} {flat}"


# How many keys or item types of a wrong container :func:`brief_description` names.
_SHOWN_ITEMS = 8
_LINE_BREAK = re.compile(r"\s*\n\s*")


class _BoundedRepr(reprlib.Repr):
    """reprlib's repr, its limits raised so that a repr that fits in ``limit`` characters is left whole.

    Each element costs at least one character, so no more than ``limit`` calls
    are made: past them an element is ``...`` (a structure that shares its lists,
    ``[[0] * 50] * 50`` nested a few levels, would otherwise take ``50**levels``).
    One per call: the count is its own (models fail on many threads at once).
    """

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxlevel = self.maxtuple = self.maxlist = self.maxarray = self.maxdict = limit
        self.maxset = self.maxfrozenset = self.maxdeque = self.maxstring = self.maxlong = self.maxother = limit
        self._calls_left = limit

    def repr1(self, x: Any, level: int) -> str:
        self._calls_left -= 1
        return self.fillvalue if self._calls_left < 0 else super().repr1(x, level)

    # Slices before its repr as a str does (reprlib would repr the whole bytes).
    repr_bytes = repr_bytearray = reprlib.Repr.repr_str

    def repr_int(self, x: int, level: int) -> str:
        # int -> str takes time quadratic in the digits, and is refused past 4300 of them.
        if x.bit_length() > 4 * self.maxlong:
            return f"<int of {x.bit_length()} bits>"
        return super().repr_int(x, level)

    # In the order repr writes them: reprlib sorts a dict's keys and a set's elements.
    def repr_dict(self, x: dict, level: int) -> str:
        if not x or level <= 0:
            return "{" + (self.fillvalue if x else "") + "}"
        pieces = [f"{self.repr1(key, level - 1)}: {self.repr1(value, level - 1)}"
                  for key, value in islice(x.items(), self.maxdict)]
        return "{" + ", ".join(pieces + [self.fillvalue] * (len(x) > self.maxdict)) + "}"

    def repr_set(self, x: set, level: int) -> str:
        return self._repr_iterable(x, level, "{", "}", self.maxset) if x else "set()"

    def repr_frozenset(self, x: frozenset, level: int) -> str:
        return self._repr_iterable(x, level, "frozenset({", "})", self.maxfrozenset) if x else "frozenset()"

    def repr_instance(self, x: Any, level: int) -> str:
        # reprlib finds its methods by the type's name: a subclass of a container or of a string (OrderedDict,
        # defaultdict, UserList, numpy's str_) comes here, where it would call the whole repr. Quoted as its base
        # type is, bounded, under its own type's name.
        name = type(x).__name__
        if isinstance(x, (str, bytes, bytearray)):
            return f"{name}({self.repr_str(x, level)})"
        if isinstance(x, collections.abc.Mapping):
            return f"{name}({self.repr_dict(x, level)})"
        if isinstance(x, (collections.abc.Sequence, collections.abc.Set)):
            return f"{name}({self._repr_iterable(x, level, '[', ']', self.maxlist)})"
        return super().repr_instance(x, level)


# What a BYTES element may be (nereid.tensors.join_bytes_elements encodes str as UTF-8).
_TEXT = (bytes, str)


def _tag(dtype: Any) -> str:
    """A tensor's DType as its wire string; anything else (a string where a DType belongs) as its repr."""
    return dtype.name if isinstance(dtype, DType) else brief_repr(dtype)


def _array_text(data: Any) -> str:
    """What an output's data is, for a message: its type and dtype (``a numpy ndarray of int64``)."""
    kind = type(data)
    name = "numpy ndarray" if kind is np.ndarray else f"{kind.__module__}.{kind.__qualname__}"
    dtype = getattr(data, "dtype", None)
    return f"a {name}" + (f" of {dtype}" if dtype is not None else "")


def _as_bytes_elements(model: str, name: str, tensor: NamedTensor) -> NamedTensor:
    """A BYTES input whose elements are all bytes: ``tensor`` itself, or a copy with its str elements UTF-8
    encoded; refused when an element is neither, or a str UTF-8 cannot encode.

    The wire decoders make bytes elements (one C-level pass finds them so); a
    meta model's sub-call or a preprocess hook may pass anything. Queued, such
    an element failed its whole batch, other clients' requests with it, and was
    blamed on the model that received it. A str reached the model as a str,
    where a client's request always brings bytes: a model (or hook) written for
    its clients' requests failed on a pipeline's (``element.decode()``).
    """
    data = tensor.data
    flat = data.ravel()
    if all(map(isinstance, flat, repeat(bytes))):  # (a client's: one C-level pass)
        return tensor
    problem = _text_problem(data)
    if problem is not None:
        raise _refusal(f"model '{model}': input '{name}' is tagged BYTES but holds {problem}")
    encoded = np.empty(data.shape, dtype=object)
    encoded.ravel()[:] = [e.encode("utf-8") if isinstance(e, str) else e for e in flat]
    return NamedTensor(tensor.name, tensor.dtype, encoded)


def bool_bytes_problem(data: np.ndarray) -> str | None:
    """What is wrong with a BOOL array's bytes (after "holding"); None when each is 0 or 1.

    numpy makes bools of any byte it is handed (a native library's buffer, a framed tensor read back): such a
    byte is no bool. The decoders refuse it in a request; an output must not send clients what nereid itself
    would refuse, nor hand it to the next model of a pipeline (reading it as a C++ bool is undefined); nor may a
    bundle's weight hold one (XLA read it as true for one operation and false for another).
    """
    octets = data.view(np.uint8)  # (one byte each: a view of any strides)
    if not octets.size or octets.max() <= 1:
        return None
    index = int(np.argmax(octets.ravel() > 1))
    return f"byte {int(octets.ravel()[index])} at element {index}; each element must be 0 (false) or 1 (true)"


def _text_problem(data: np.ndarray) -> str | None:
    """What is wrong with a BYTES array's elements, for a message (after "holding"); None when each is bytes, or
    str that UTF-8 can encode (what every encoder writes)."""
    flat = data.ravel()
    if all(map(isinstance, flat, repeat(bytes))):  # bytes only (the wire decoders', subprocess models'): no more
        return None
    if not all(map(isinstance, flat, repeat(_TEXT))):
        return f"{_first_non_text(data)}, expected bytes or str elements"
    unencodable = _first_unencodable(data)
    if unencodable is not None:
        return f"{unencodable}, which UTF-8 cannot encode (a lone surrogate): expected bytes, or str that is text"
    return None


def _first_non_text(data: np.ndarray) -> str:
    """The first element of an object array that is neither bytes nor str, for a message."""
    index, element = next((i, e) for i, e in enumerate(data.ravel()) if not isinstance(e, _TEXT))
    return f"element {index} of type {type(element).__name__} ({brief_repr(element, 60)})"


def _first_unencodable(data: np.ndarray) -> str | None:
    """The first str element UTF-8 cannot encode (one holding a lone surrogate), for a message; None when none.

    Every encoder (the gRPC and binary HTTP wire, JSON) writes str as UTF-8: such an element would fail there,
    past the checks, as a bare UnicodeEncodeError naming no model.
    """
    for index, element in enumerate(data.ravel()):
        if isinstance(element, str) and not element.isascii():
            try:
                element.encode("utf-8")
            except UnicodeEncodeError:
                return f"element {index} ({brief_repr(element, 60)})"
    return None


def _refusal(message: str) -> InvalidArgument:
    """The InvalidArgument of a request that does not fit the signature: ``message`` as a PublicText.

    Built from the request (its model and tensor names, datatypes, shapes) and
    the model's declared names, which ModelMetadata shows as they are, it
    carries no server path: scrubbing paths out of it rewrote a client's input
    name such as "/opt/nereid/core/x" into "<nereid>/x", telling the client
    which absolute paths are the server's.
    """
    return InvalidArgument(PublicText(message))


def _index_by_name(model: str, signature: ModelSignature, tensors: list[NamedTensor]) -> dict[str, NamedTensor]:
    check_input_names(model, [tensor.name for tensor in tensors], [spec.name for spec in signature.inputs])
    return {tensor.name: tensor for tensor in tensors}


def check_input_names(model: str, names: list[str], declared: list[str]) -> None:
    """InvalidArgument when a request's input ``names`` repeat one, or name one the model does not ``declared``
    (in its declared order): the refusal of the signature check, for a protocol to make before it builds the
    tensors (see grpc_codec)."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise _refusal(f"model '{model}': input '{name}' is given more than once")
        seen.add(name)
    unexpected = sorted(seen - set(declared))
    if unexpected:
        raise _refusal(f"model '{model}': unexpected input '{unexpected[0]}' (expected inputs: {_names(declared)})")


def _names(names: list[str]) -> str:
    return ", ".join(f"'{name}'" for name in names) or "none"


def _shape_text(dims: tuple[int, ...], *, batched: bool) -> str:
    text = ", ".join("-1" if d == -1 else str(d) for d in dims)
    return f"[batch, {text}]" if batched and dims else ("[batch]" if batched else f"[{text}]")
