"""``manifest.yaml``: the parsed and validated description of a bundle.

Shapes keep the bundle format's column-major convention: an einsum-style string
of single ASCII letters, one per axis, batch axis last (``"chwn"``), with a
``dims`` map giving the size of every non-batch letter. The row-major shape that
clients and the XLA program see is that shape reversed; :class:`ManifestTensor`
offers both views.

:func:`load_manifest` only parses and checks the file's own contents, so it is
usable without a bundle directory (a client deriving a model's I/O offline); the
checks that need the bundle's other files live in :mod:`.bundle`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

import yaml

from nereid.config_document import KeyedReader, load_yaml, quoting_hint
from nereid.dtypes import DType
from nereid.files import decode_text, read_text_file
from nereid.settings import INT32_MAX
from nereid.signature import MAX_DECLARED_TENSORS, MAX_RANK

from nereid.backends.xla.dtype_tokens import dtype_of_token, token_of

MANIFEST_NAME = "manifest.yaml"
# A manifest is a few kilobytes; provenance included, far below this.
MAX_MANIFEST_BYTES = 1 << 20

# The writer stamps "2.1" ("2.0" for the legacy weights layout). 2.1 exists so
# that servers which would misread program-order weights refuse such bundles.
FORMAT_VERSIONS: tuple[str, ...] = ("2.1", "2.0", "2")
CURRENT_FORMAT_VERSION = "2.1"
LEGACY_FORMAT_VERSION = "2.0"

BATCH_MARKERS = frozenset("nb")

# The provenance field naming the platform the exporter lowered the programs for (jax.export's ``platforms``:
# cpu, cuda, rocm, tpu). It lives in provenance, the one block the bundle format leaves open to a writer's own
# fields, so that other servers still read nereid's bundles.
EXPORT_PLATFORM = "export_platform"

_TOP_KEYS = frozenset({
    "format_version", "name", "description", "executable_inputs", "executable_outputs",
    "client_inputs", "client_outputs", "batching", "input_shapes", "weights_file", "provenance",
    "meta", "depends_on",  # a meta model: a model.py orchestrating other models (nereid.backends.meta)
})
# What only a bundle with a program has: a meta model declaring one of these is refused.
_PROGRAM_KEYS = ("executable_inputs", "executable_outputs", "input_shapes", "weights_file")
_TENSOR_KEYS = frozenset({"name", "dtype", "shape", "dims"})
_BATCHING_KEYS = frozenset({"compiled_batch_sizes"})
# Triton's config.pbtxt fields written in a manifest, and where nereid takes what they say (an unknown key's
# refusal adds it: `dynamic_batching` was told "did you mean 'batching'?", the manifest's compiled sizes).
_TRITON_KEY_HINTS = {
    "dynamic_batching": "dynamic batching is nereid.yaml's: models[].batching (max_queue_delay_ms, "
                        "preferred_batch_sizes); a manifest's batching: says what the bundle is compiled for",
    "max_batch_size": "a bundle's max_batch_size is its largest compiled batch size: batching: "
                      "{compiled_batch_sizes: [...]} (a meta model's batching: {max_batch_size: N})",
    "instance_group": "instances and the device are nereid.yaml's: models[].instances, models[].device",
}


class DimKind(enum.Enum):
    """What one axis is: a fixed size, the batch axis, or a variable (data-dependent) axis."""

    FIXED = "fixed"
    BATCH = "batch"
    VARIABLE = "variable"


@dataclass(frozen=True)
class Dim:
    """One axis. ``size`` is meaningful only for FIXED dims (0 otherwise)."""

    kind: DimKind
    size: int = 0
    letter: str = ""

    @property
    def client_size(self) -> int:
        """The size as a signature reports it: FIXED sizes, -1 for batch and variable axes."""
        return self.size if self.kind is DimKind.FIXED else -1


@dataclass(frozen=True)
class ManifestTensor:
    """One tensor of a manifest: name, element type and its axes in manifest (column-major) order."""

    name: str
    dtype: DType
    shape: tuple[Dim, ...]

    @property
    def batch_axis(self) -> int | None:
        """0-based position of the batch axis in manifest order, or None when unbatched."""
        return next((i for i, d in enumerate(self.shape) if d.kind is DimKind.BATCH), None)

    @property
    def row_major(self) -> tuple[Dim, ...]:
        """The axes as clients and the program see them: manifest order reversed."""
        return tuple(reversed(self.shape))

    @property
    def row_major_batch_axis(self) -> int | None:
        """Position of the batch axis in the row-major shape (0 when the manifest puts it last)."""
        axis = self.batch_axis
        return None if axis is None else len(self.shape) - 1 - axis

    @property
    def shape_string(self) -> str:
        """The manifest's einsum-style shape string."""
        return "".join(d.letter for d in self.shape)

    def program_shape(self, batch_size: int | None, variable_sizes: tuple[int, ...] = ()) -> tuple[int, ...]:
        """The concrete row-major shape for a batch size and this tensor's variable sizes.

        ``variable_sizes`` lists this tensor's variable axes in manifest order.
        """
        sizes = iter(variable_sizes)
        concrete: list[int] = []
        for dim in self.shape:
            if dim.kind is DimKind.FIXED:
                concrete.append(dim.size)
            elif dim.kind is DimKind.BATCH:
                if batch_size is None:
                    raise ValueError(f"tensor '{self.name}' has a batch axis but no batch size was given")
                concrete.append(batch_size)
            else:
                try:
                    concrete.append(next(sizes))
                except StopIteration:
                    raise ValueError(f"tensor '{self.name}': too few variable-axis sizes") from None
        return tuple(reversed(concrete))

    @property
    def variable_axes(self) -> tuple[int, ...]:
        """Manifest-order positions of the variable (-1) axes."""
        return tuple(i for i, d in enumerate(self.shape) if d.kind is DimKind.VARIABLE)


@dataclass(frozen=True)
class BatchingSpec:
    """The batch sizes the bundle was compiled for, ascending."""

    compiled_batch_sizes: tuple[int, ...]

    @property
    def largest(self) -> int:
        """The largest compiled size."""
        return self.compiled_batch_sizes[-1]


def smallest_fitting(sizes: tuple[int, ...], rows: int) -> int | None:
    """The smallest of the ascending batch ``sizes`` that holds ``rows`` rows, or None when none does."""
    return next((size for size in sizes if size >= rows), None)


@dataclass(frozen=True)
class Manifest:
    """A parsed, structurally valid ``manifest.yaml``.

    ``client_inputs`` / ``client_outputs`` are None unless the manifest declares
    them (allowed only with a ``model.py``). ``input_shapes`` enumerates the
    compiled variants of the executable inputs' variable axes: each variant lists
    the sizes in (input, manifest axis) order. ``name`` is informational: the
    bundle directory's name is the model name.
    """

    path: Path
    format_version: str
    executable_inputs: tuple[ManifestTensor, ...]
    executable_outputs: tuple[ManifestTensor, ...]
    client_inputs: tuple[ManifestTensor, ...] | None = None
    client_outputs: tuple[ManifestTensor, ...] | None = None
    batching: BatchingSpec | None = None
    input_shapes: tuple[tuple[int, ...], ...] | None = None
    weights_file: str | None = None
    name: str | None = None
    description: str = ""
    provenance: Mapping[str, Any] = field(default_factory=dict)
    meta: bool = False
    depends_on: tuple[str, ...] = ()

    @property
    def is_meta(self) -> bool:
        """True for a meta model (``meta: true``): a model.py orchestrating other models, no program."""
        return self.meta

    @property
    def has_client_specs(self) -> bool:
        """True when the manifest declares client_inputs or client_outputs."""
        return self.client_inputs is not None or self.client_outputs is not None

    @property
    def export_platform(self) -> str | None:
        """The platform the programs were lowered for (``provenance.export_platform``); None when not recorded."""
        value = self.provenance.get(EXPORT_PLATFORM)
        return value if isinstance(value, str) else None

    def variant_sizes(self, variant: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """Split one ``input_shapes`` variant into per-input variable sizes (manifest order)."""
        sizes = iter(variant)
        return tuple(tuple(next(sizes) for _ in t.variable_axes) for t in self.executable_inputs)


def load_manifest(path: Path | str) -> Manifest:
    """Parse and check a manifest file; ConfigError names the file, the key and the value.

    Only the manifest's own contents are checked (no bundle directory needed).
    """
    path = Path(path)
    return parse_manifest_text(read_text_file(path, MAX_MANIFEST_BYTES), path)


def parse_manifest_text(text: str, path: Path) -> Manifest:
    """Parse manifest YAML text as if it were the file at ``path``."""
    return parse_manifest(load_yaml(text, path), path, source=text)


def parse_manifest(document: Any, path: Path, source: str | None = None) -> Manifest:
    """Check an already-loaded YAML document as if it came from ``path``.

    ``source``: the YAML text the document was loaded from, which an unquoted
    ``format_version`` is read from as written (YAML's number has lost the
    spelling: ``2.10`` and ``2.1`` are one float). Without it (a document built
    in Python) a number is read as Python writes it.
    """
    reader = KeyedReader(path)
    top = reader.mapping(document, "", _TOP_KEYS, _TRITON_KEY_HINTS)
    version = _format_version(reader, top, source)
    meta, depends_on = _meta(reader, top)
    executable_inputs = _tensors(reader, top, "executable_inputs", required=not meta, executable=True) or ()
    executable_outputs = _tensors(reader, top, "executable_outputs", required=not meta, executable=True) or ()
    if not executable_outputs and not meta:
        reader.fail("executable_outputs", "must list at least one tensor", top.get("executable_outputs"))
    client_inputs = _tensors(reader, top, "client_inputs", required=meta, executable=False)
    client_outputs = _tensors(reader, top, "client_outputs", required=meta, executable=False)
    _check_wire_dtypes(reader, "executable_inputs", executable_inputs, client_inputs, "client_inputs")
    _check_wire_dtypes(reader, "executable_outputs", executable_outputs, client_outputs, "client_outputs")
    if meta and not client_outputs:
        reader.fail("client_outputs", "must list at least one tensor (what the meta model answers)",
                    top.get("client_outputs"))
    if meta:
        batching = _meta_batching(reader, top, (client_inputs or ()) + (client_outputs or ()))
    else:
        batching = _batching(reader, top, executable_inputs + executable_outputs)
    input_shapes = _input_shapes(reader, top, executable_inputs, executable_outputs)
    weights_file = _weights_file(reader, top)
    name = _informational_text(reader, top, "name")
    description = _informational_text(reader, top, "description") or ""
    provenance = top.get("provenance", {})
    if provenance is None:  # (`provenance:` with nothing under it: none; an empty list or string is a mistake)
        provenance = {}
    if not isinstance(provenance, dict):
        reader.fail("provenance", "must be a mapping", provenance)
    platform = provenance.get(EXPORT_PLATFORM)
    if EXPORT_PLATFORM in provenance and (not isinstance(platform, str) or not platform.strip()):
        reader.fail(f"provenance.{EXPORT_PLATFORM}", "must name the platform the programs were exported for, "
                                                    "such as cpu or cuda", platform)
    return Manifest(path, version, executable_inputs, executable_outputs, client_inputs, client_outputs,
                    batching, input_shapes, weights_file, name, description, provenance, meta, depends_on)


def _informational_text(reader: KeyedReader, top: dict[str, Any], key: str) -> str | None:
    """``name`` or ``description`` as text: any YAML scalar (an unquoted ``name: 2024`` is a number, and the
    field only informs); None when absent or null."""
    value = top.get(key)
    if value is None:
        return None
    if isinstance(value, (dict, list)):
        reader.fail(key, "must be a string (informational text), not a mapping or a list", value)
    return value if isinstance(value, str) else str(value)


def declares_meta(path: Path) -> bool:
    """True when the manifest at ``path`` says ``meta: true`` (False when it cannot be read or parsed).

    For claiming folders: the backend that claims the folder reports any error in full when it loads.
    """
    try:
        text = read_text_file(path, MAX_MANIFEST_BYTES)
    except Exception:  # reported by whichever backend claims the folder, when it loads it
        return False
    return text_declares_meta(text, path)


def text_declares_meta(text: str | bytes | None, path: Path | str = MANIFEST_NAME) -> bool:
    """:func:`declares_meta` of a manifest's ``text`` (UTF-8 bytes too; None, a manifest that could not be read,
    is no meta model's), read from ``path``: for a manifest in an object store, read before it is fetched."""
    if text is None:
        return False
    try:
        document = load_yaml(text if isinstance(text, str) else decode_text(text, Path(path)), Path(path))
    except Exception:  # reported by whichever backend claims the folder, when it loads it
        return False
    return isinstance(document, dict) and document.get("meta") is True


def _meta(reader: KeyedReader, top: dict[str, Any]) -> tuple[bool, tuple[str, ...]]:
    """``meta`` and ``depends_on``, and the keys a meta model must and must not have."""
    meta = top.get("meta", False)
    if not isinstance(meta, bool):
        reader.fail("meta", "must be true or false", meta)
    raw = top.get("depends_on")
    if raw is not None and not meta:
        reader.fail("depends_on", "lists the models a meta model calls; only a manifest with meta: true has it", raw)
    if not meta:
        return False, ()
    for key in _PROGRAM_KEYS:
        if key in top:
            reader.fail(key, "a meta model runs no program of its own (its model.py calls other models); "
                             "declare its wire tensors under client_inputs / client_outputs", top[key])
    if raw is None:
        raw = []
    if not isinstance(raw, list) or len(raw) > MAX_DECLARED_TENSORS:
        reader.fail("depends_on", "must be a list of model names", raw)
    names: list[str] = []
    for index, name in enumerate(raw):
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            reader.fail(f"depends_on[{index}]", "must be a model name (a folder name in ml_backends_path)"
                        f"{quoting_hint(name)}", name)
        if name in names:
            reader.fail(f"depends_on[{index}]", "is listed twice", name)
        names.append(name)
    return True, tuple(names)


# Past it, the model would load READY and then fail every gRPC ModelConfig call.
_MAX_BATCH_SIZE_FIELD = "ModelConfig's max_batch_size is an int32"


def _meta_batching(reader: KeyedReader, top: dict[str, Any],
                   tensors: tuple[ManifestTensor, ...]) -> BatchingSpec | None:
    """A meta model's ``batching: {max_batch_size: N}``: the most rows a request may carry."""
    batched = [t for t in tensors if t.batch_axis is not None]
    if "batching" not in top or top["batching"] is None:
        if batched:
            reader.fail("batching", f"is required: tensor '{batched[0].name}' has a batch axis "
                                    f"({batched[0].shape_string!r}); give batching: {{max_batch_size: N}}", None)
        return None
    section = reader.mapping(top["batching"], "batching", frozenset({"max_batch_size"}))
    size = section.get("max_batch_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        reader.fail("batching.max_batch_size", "must be a positive integer (a meta model compiles nothing, so it "
                                               "has no compiled_batch_sizes)", size)
    if size > INT32_MAX:
        reader.fail("batching.max_batch_size", f"must be at most {INT32_MAX} ({_MAX_BATCH_SIZE_FIELD})", size)
    if not batched:
        reader.fail("batching.max_batch_size", "no client tensor has a batch axis (n or b)", size)
    unbatched = [t for t in tensors if t.batch_axis is None]
    if unbatched:
        # As Triton has it (max_batch_size > 0 batches every tensor): with one tensor unbatched, the model was
        # served with max_batch_size 0, the batch a free dimension, and this cap silently never applied.
        reader.fail("batching.max_batch_size", f"tensor '{unbatched[0].name}' ({unbatched[0].shape_string!r}) has "
                                               "no batch axis (n or b): a meta model that batches needs one in "
                                               "every client tensor; add it, or drop the batch axes and batching",
                    size)
    return BatchingSpec((size,))


# ModelMetadata's and ModelConfig's dims are int64: a larger size loaded READY, then failed every such call.
INT64_MAX = 2 ** 63 - 1
_DIMS_FIELD = "ModelMetadata's and ModelConfig's dims are int64"


def _parse_shape(text: Any, dims: Any, where: str, reader: KeyedReader) -> tuple[Dim, ...]:
    """Parse an einsum-style shape string and its ``dims`` map into Dims."""
    if not isinstance(text, str):
        reader.fail(f"{where}.shape", "must be a string of axis letters such as \"chwn\"", text)
    if len(text) > MAX_RANK:  # (as a model_inference.textproto's and a weights file's tensors)
        reader.fail(f"{where}.shape", f"has {len(text)} axes; at most {MAX_RANK} are supported", text)
    seen: set[str] = set()
    markers = [c for c in text if c in BATCH_MARKERS]
    for letter in text:
        if not (letter.isascii() and letter.isalpha()):
            reader.fail(f"{where}.shape", f"axes must be single ASCII letters, found {letter!r}", text)
        if letter in seen:
            reader.fail(f"{where}.shape", f"letter {letter!r} appears twice (letters are unique within a shape)",
                        text)
        seen.add(letter)
    if len(markers) > 1:
        reader.fail(f"{where}.shape", "has more than one batch marker (n or b; at most one per tensor)", text)
    if dims is None:
        dims = {}
    if not isinstance(dims, dict):
        reader.fail(f"{where}.dims", "must be a mapping from axis letter to size", dims)
    for letter, size in dims.items():
        if letter in BATCH_MARKERS and isinstance(letter, str) and letter in text:
            reader.fail(f"{where}.dims.{letter}", f"'{letter}' is the batch axis; its size comes from "
                                                  "batching.compiled_batch_sizes", size)
        # One letter: a longer key such as 'hw' is in the shape string, but names no one axis.
        if not isinstance(letter, str) or len(letter) != 1 or letter not in text:
            reader.fail(f"{where}.dims.{letter}", f"names no axis of shape {text!r} (each key is one of its "
                                                  "letters)", size)
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            reader.fail(f"{where}.dims.{letter}", "must be a positive integer or -1 (variable)", size)
        if size > INT64_MAX:
            reader.fail(f"{where}.dims.{letter}", f"must be at most {INT64_MAX} ({_DIMS_FIELD})", size)
    result: list[Dim] = []
    for letter in text:
        if letter in BATCH_MARKERS:
            result.append(Dim(DimKind.BATCH, 0, letter))
        elif letter not in dims:
            reader.fail(f"{where}.dims", f"has no size for axis {letter!r} of shape {text!r}", dims)
        elif dims[letter] == -1:
            result.append(Dim(DimKind.VARIABLE, 0, letter))
        else:
            result.append(Dim(DimKind.FIXED, dims[letter], letter))
    return tuple(result)


def _format_version(reader: KeyedReader, top: dict[str, Any], source: str | None) -> str:
    if "format_version" not in top:
        reader.fail("format_version", f"is required (one of {', '.join(FORMAT_VERSIONS)})", None)
    raw = top["format_version"]
    text = raw if isinstance(raw, str) else None
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        # YAML reads an unquoted 2.1 as a float and 2 as an int: accepted as written, and only so. Read by its
        # value, 2.10 was 2.1 and 0x2 was 2, so a newer format's bundle would pass for one this server reads.
        text = _written_scalar(source, "format_version") if source is not None else repr(raw)
    if text not in FORMAT_VERSIONS:
        reader.fail("format_version", f"unsupported bundle format (this server reads {', '.join(FORMAT_VERSIONS)})",
                    raw if text is None else text)
    return text


def _written_scalar(source: str, key: str) -> str | None:
    """The text of the top-level scalar ``key`` as ``source`` writes it; None when it is not written there as one.

    Only composed (nodes, no values), from text that has already loaded.
    """
    try:
        node = yaml.compose(source, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    if not isinstance(node, yaml.MappingNode):
        return None
    for key_node, value_node in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.value == key and isinstance(value_node, yaml.ScalarNode):
            return value_node.value
    return None


def _tensors(reader: KeyedReader, top: dict[str, Any], key: str, *, required: bool,
             executable: bool) -> tuple[ManifestTensor, ...] | None:
    if key not in top:
        if required:
            reader.fail(key, "is required", None)
        return None
    raw = top[key]
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        reader.fail(key, "must be a list of tensors", raw)
    if len(raw) > MAX_DECLARED_TENSORS:
        reader.fail(key, f"lists {len(raw)} tensors; at most {MAX_DECLARED_TENSORS} are supported", len(raw))
    tensors: list[ManifestTensor] = []
    names: set[str] = set()  # a set, not a scan of the list per tensor: linear in the tensors
    for index, entry in enumerate(raw):
        where = f"{key}[{index}]"
        entry = reader.mapping(entry, where, _TENSOR_KEYS)
        for needed in ("name", "dtype", "shape"):
            if needed not in entry:
                reader.fail(f"{where}.{needed}", "is required", None)
        name = entry["name"]
        if not isinstance(name, str) or not name:
            reader.fail(f"{where}.name", f"must be a non-empty string{quoting_hint(name)}", name)
        if name in names:
            reader.fail(f"{where}.name", f"is used twice in {key}", name)
        names.add(name)
        dtype = _dtype(reader, entry["dtype"], f"{where}.dtype", executable)
        shape = _parse_shape(entry["shape"], entry.get("dims"), where, reader)
        _check_row_bytes(reader, where, dtype, shape, entry.get("dims"))
        tensors.append(ManifestTensor(name, dtype, shape))
    return tuple(tensors)


def _check_row_bytes(reader: KeyedReader, where: str, dtype: DType, shape: tuple[Dim, ...], dims: Any) -> None:
    """The fixed axes' bytes must fit a signed 64-bit integer, which numpy and XLA size every array in."""
    elements = math.prod(d.size for d in shape if d.kind is DimKind.FIXED)
    itemsize = dtype.numpy.itemsize  # (BYTES: an object array, a pointer per element)
    if elements * itemsize > INT64_MAX:
        reader.fail(f"{where}.dims", f"its fixed sizes make {elements} {token_of(dtype)} elements, "
                                     f"{elements * itemsize} bytes, past {INT64_MAX} (numpy and XLA size an "
                                     "array's bytes in a signed 64-bit integer)", dims)


def _dtype(reader: KeyedReader, token: Any, where: str, executable: bool) -> DType:
    if not isinstance(token, str):
        reader.fail(where, "must be a dtype token such as f32", token)
    try:
        dtype = dtype_of_token(token)
    except ValueError as err:
        reader.fail(where, str(err), token)
    if executable and dtype is DType.BYTES:
        reader.fail(where, "XLA programs have no string type; BYTES is allowed only on client tensors", token)
    if not executable and not dtype.on_wire:
        reader.fail(where, f"{dtype.name} has no KServe wire datatype, so it may appear only on "
                           "executable tensors", token)
    return dtype


def _check_wire_dtypes(reader: KeyedReader, key: str, executable: tuple[ManifestTensor, ...],
                       client: tuple[ManifestTensor, ...] | None, client_key: str) -> None:
    """Without ``client_key`` the executable tensors are the client's too, so each needs a wire datatype."""
    if client is not None:
        return
    for index, tensor in enumerate(executable):
        if not tensor.dtype.on_wire:
            reader.fail(f"{key}[{index}].dtype", f"{tensor.dtype.name} has no KServe wire datatype, and without "
                                                 f"{client_key} this tensor is also the client's: declare "
                                                 f"{client_key} with a wire dtype and convert in model.py",
                        token_of(tensor.dtype))


def _batching(reader: KeyedReader, top: dict[str, Any], tensors: tuple[ManifestTensor, ...]) -> BatchingSpec | None:
    batched = [t for t in tensors if t.batch_axis is not None]
    if "batching" not in top or top["batching"] is None:
        if batched:
            reader.fail("batching", f"is required: tensor '{batched[0].name}' has a batch axis "
                                    f"({batched[0].shape_string!r}) but no compiled batch sizes are listed", None)
        return None
    section = reader.mapping(top["batching"], "batching", _BATCHING_KEYS)
    sizes = section.get("compiled_batch_sizes")
    if not isinstance(sizes, list) or not sizes:
        reader.fail("batching.compiled_batch_sizes", "must be a non-empty list of positive integers", sizes)
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            reader.fail("batching.compiled_batch_sizes", f"must hold positive integers, found {size!r}", sizes)
    if any(size > INT32_MAX for size in sizes):  # the largest is the model's max_batch_size
        reader.fail("batching.compiled_batch_sizes", f"must hold sizes of at most {INT32_MAX} "
                                                     f"({_MAX_BATCH_SIZE_FIELD})", sizes)
    if len(set(sizes)) != len(sizes):
        reader.fail("batching.compiled_batch_sizes", "lists a size twice", sizes)
    if not batched:
        reader.fail("batching.compiled_batch_sizes", "no executable tensor has a batch axis (n or b)", sizes)
    return BatchingSpec(tuple(sorted(sizes)))


def _input_shapes(reader: KeyedReader, top: dict[str, Any], inputs: tuple[ManifestTensor, ...],
                  outputs: tuple[ManifestTensor, ...]) -> tuple[tuple[int, ...], ...] | None:
    variable = [(i, t, axis) for i, t in enumerate(inputs) for axis in t.variable_axes]
    raw = top.get("input_shapes")
    if raw is None:
        for kind, tensors in (("executable_inputs", inputs), ("executable_outputs", outputs)):
            for i, tensor in enumerate(tensors):
                if tensor.variable_axes:
                    letter = tensor.shape[tensor.variable_axes[0]].letter
                    reader.fail(f"{kind}[{i}].dims.{letter}",
                                "a variable (-1) axis on an executable tensor needs an input_shapes block "
                                "enumerating the compiled variants (a program's shapes are static; declare "
                                "data-dependent results under client_outputs with a model.py)", -1)
        return None
    if not variable:
        reader.fail("input_shapes", "no executable input has a variable (-1) axis", raw)
    if not isinstance(raw, list) or not raw:
        reader.fail("input_shapes", "must be a non-empty list of variants (lists of sizes)", raw)
    described = ", ".join(f"{t.name}.{t.shape[axis].letter}" for _, t, axis in variable)
    variants: list[tuple[int, ...]] = []
    for index, variant in enumerate(raw):
        where = f"input_shapes[{index}]"
        if not isinstance(variant, list) or len(variant) != len(variable):
            reader.fail(where, f"must list {len(variable)} size(s), one per variable input axis ({described})",
                        variant)
        for size in variant:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                reader.fail(where, f"sizes must be positive integers, found {size!r}", variant)
        if tuple(variant) in variants:
            reader.fail(where, "repeats an earlier variant", variant)
        variants.append(tuple(variant))
    return tuple(variants)


def _weights_file(reader: KeyedReader, top: dict[str, Any]) -> str | None:
    raw = top.get("weights_file")
    if raw is None:
        return None
    if not isinstance(raw, str) or not raw:
        reader.fail("weights_file", "must be a file name inside the bundle", raw)
    relative = PurePosixPath(raw)
    if relative.is_absolute() or ".." in relative.parts or raw.startswith("\\"):
        reader.fail("weights_file", "must name a file inside the bundle (no absolute path, no '..')", raw)
    return raw
