"""``write_bundle``: the low-level bundle writer.

It takes the executable IOSpecs, the StableHLO modules (one per batch size,
optionally one set per ``input_shapes`` variant; MLIR text or serialized
portable artifacts) and the weights in program order, checks that every
program takes exactly inputs + weights arguments of the declared types, and
only then writes ``manifest.yaml``, ``model[.v{i}][.b{N}].mlir``,
``weights.safetensors`` (``axis_order: xla``, or the legacy layout on request),
an optional ``model.py`` and, for a dirty work tree, ``working_tree.patch``.
"""

from __future__ import annotations

import json
import numbers
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, Union

import numpy as np
import yaml

from nereid.backends.xla.arity import arity_mismatch
from nereid.backends.xla.bundle import DEFAULT_WEIGHTS_FILE, MODEL_PY, ProgramKey, module_candidates
from nereid.backends.xla.conformance import check_program_types
from nereid.backends.xla.manifest import (CURRENT_FORMAT_VERSION, LEGACY_FORMAT_VERSION, MANIFEST_NAME,
                                          parse_manifest)
from nereid.backends.xla.program import read_program, to_portable_artifact
from nereid.backends.xla.safetensors import METADATA_KEY, write_safetensors
from nereid.backends.xla.weights import INDEX_FILE
from nereid.dtypes import DType
from nereid.errors import ConfigError
from nereid.backends.xla.export.iospec import IOSpec, as_dtype
from nereid.backends.xla.export.provenance import PATCH_FILE, Provenance
from nereid.files import staged_write, temporary_name

Module = Union[bytes, str]
Modules = Union[Module, Mapping[int, Module]]
LAYOUTS = ("xla", "legacy")


class ExportError(ValueError):
    """The exporter refused to write a bundle; the message says why."""


def write_bundle(directory: Path | str, name: str, inputs: Sequence[IOSpec], outputs: Sequence[IOSpec],
                 modules: Modules | Sequence[Modules], weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
                 *, batch_sizes: Sequence[int] | None = None,
                 input_shapes: Sequence[Sequence[int]] | None = None,
                 client_inputs: Sequence[IOSpec] | None = None, client_outputs: Sequence[IOSpec] | None = None,
                 layout: str = "xla", model_py: str | os.PathLike | None = None,
                 provenance: Provenance | Mapping[str, Any] | None = None, description: str = "",
                 shard_bytes: int | None = None) -> Path:
    """Check and write a bundle; returns its directory.

    ``modules`` is one module (an unbatched program, or the single size in
    ``batch_sizes``), a mapping batch size -> module, or, with ``input_shapes``,
    a sequence of those, one per variant (variant ``i`` is written as
    ``model.v{i+1}...``). ``weights`` are in program order (that order becomes
    the safetensors ``argument_order``). ``model_py`` is the source text (a str)
    or the path (a ``pathlib.Path``) of the bundle's hooks file; it must
    compile. The directory's basename must equal ``name``: the directory name
    is the model name.

    ``shard_bytes`` writes the weights as shards instead of one file:
    ``weights-00001-of-0000N.safetensors``, each closed once it holds at
    least that many bytes (a tensor is never split), and
    ``weights.safetensors.index.json`` with the ``weight_map`` and the whole
    ``argument_order``.

    Raises ExportError before writing or removing anything when the bundle
    would not be servable: a program whose argument count disagrees with
    inputs + weights (both numbers named), or whose types disagree with the
    specs, a weight name given twice or named ``__metadata__``, or a
    ``model_py`` that cannot be read or does not compile (a str that looks like
    a file name included). The weights are written to temporary files before
    the earlier export's files are replaced, so a failed write leaves them as
    they were.
    """
    directory = Path(directory)
    if directory.name != name:
        raise ExportError(f"the bundle directory's name must be the model name: {directory} is not named {name!r}")
    if layout not in LAYOUTS:
        raise ExportError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if shard_bytes is not None and (isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int)
                                    or shard_bytes < 1):
        raise ExportError(f"shard_bytes must be a positive number of bytes, got {shard_bytes!r}")
    ordered_weights = weight_pairs(weights)
    model_py_source = _model_py_source(model_py)
    programs = _programs(modules, batch_sizes, input_shapes)
    sizes = sorted({k.batch_size for k in programs if k.batch_size is not None})
    has_model_py = model_py is not None or (directory / MODEL_PY).is_file()
    if (client_inputs is not None or client_outputs is not None) and not has_model_py:
        raise ExportError("client_inputs / client_outputs need a model.py (pass model_py=...) that transforms "
                          "between client and executable tensors")
    document = _manifest_document(name, inputs, outputs, sizes, input_shapes, client_inputs, client_outputs,
                                  layout, provenance, description)
    manifest_path = directory / MANIFEST_NAME
    try:
        manifest = parse_manifest(document, manifest_path)
    except ConfigError as err:
        raise ExportError(f"the specs do not make a valid manifest: {err}") from None
    single = len(sizes) <= 1
    files: dict[str, bytes] = {}
    weight_types = [(n, a.shape, as_dtype(a.dtype)) for n, a in ordered_weights]
    for key, module in sorted(programs.items()):
        file_name = module_candidates(key, single)[-1 if single and key.batch_size is not None else 0]
        artifact = _artifact(module, file_name)
        program = _read(artifact, file_name)
        mismatch = arity_mismatch(file_name, program, len(inputs), len(ordered_weights), DEFAULT_WEIGHTS_FILE)
        if mismatch:
            raise ExportError(f"refusing to write {directory}: {mismatch}")
        try:
            check_program_types(file_name, program, key, manifest, weight_types)
        except ConfigError as err:
            raise ExportError(f"refusing to write {directory}: {err}") from None
        files[file_name] = artifact
    manifest_text = _manifest_text(document)
    _write_files(directory, files, ordered_weights, layout, model_py_source, provenance, manifest_text, shard_bytes)
    return directory


def weight_pairs(weights: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[tuple[str, np.ndarray]]:
    """The weights as (name, array) pairs in program order; raises ExportError for what no bundle can hold.

    Checked here, before tracing or writing anything: a name, a value that is
    not an array (a str, None, a function, a nested dict of parameters) or an
    array of a dtype nereid cannot store would otherwise fail inside jax with
    a message naming no weight, or only once the files are being replaced.
    """
    items = list(weights.items()) if isinstance(weights, Mapping) else _listed_pairs(weights)
    for index, (name, _) in enumerate(items):
        if not isinstance(name, str):
            raise ExportError(f"weights: weight {index}'s name must be a string, got {_described(name)}")
    pairs = [(name, _weight_array(index, name, value)) for index, (name, value) in enumerate(items)]
    _check_weight_names([name for name, _ in pairs])
    return pairs


# What a program can take and return, and safetensors can store: every nereid dtype but BYTES.
SUPPORTED_DTYPES: tuple[DType, ...] = tuple(d for d in DType if d is not DType.BYTES)


def supported_dtype(dtype: Any, what: str) -> DType:
    """The nereid DType of a numpy / jax ``dtype``; ExportError naming ``what`` (role, index and name), the
    dtype and the supported ones otherwise (int4, complex64, str and object arrays)."""
    try:
        dtype = np.dtype(dtype)
        found = as_dtype(dtype.newbyteorder("="))  # (either byte order is the type: the bundle stores it little-endian)
    except (TypeError, ValueError):
        found = None
    if found is None or found not in SUPPORTED_DTYPES:
        supported = ", ".join(d.numpy.name for d in SUPPORTED_DTYPES)
        raise ExportError(f"{what} has dtype {dtype}, which nereid does not support "
                          f"(supported: {supported})")
    return found


def _weight_array(index: int, name: str, value: Any) -> np.ndarray:
    """One weight as a numpy array of a supported dtype; ExportError naming the weight otherwise."""
    what = f"weights: weight {index} ({name!r})"
    if isinstance(value, Mapping):
        # A JAX pytree of parameters: the bundle holds one named array per program argument.
        keys = [str(k) for k in list(value)[:3]]
        shown = ", ".join(map(repr, keys)) + (", ..." if len(value) > 3 else "")
        raise ExportError(f"{what} is a nested {type(value).__name__} (keys {shown or 'none'}), not an array: "
                          "flatten nested parameters to one dotted name per array (e.g. "
                          f"{name + '.' + (keys[0] if keys else 'w')!r}, from jax.tree_util.tree_flatten_with_path) "
                          "and take them as separate arguments")
    described = "None" if value is None else _described(value)
    if value is None or isinstance(value, (str, bytes)) or (callable(value) and not _is_array(value)):
        raise ExportError(f"{what} is {described}, not an array")
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as err:  # a ragged list, say
        raise ExportError(f"{what} is {described}, not an array: {err}") from None
    if not _is_array(value) and array.dtype.kind in "OSUV":  # numpy wrapped an arbitrary object
        raise ExportError(f"{what} is {described}, not an array")
    supported_dtype(array.dtype, what)
    # Native byte order for jax, which traces the program with the weights' dtypes (a big-endian float32 was
    # refused as no supported dtype; the export hunt).
    return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


_WEIGHTS_FORM = "weights must be a mapping of names to arrays or a list of (name, array) pairs"


def _listed_pairs(weights: Any) -> list[tuple[Any, Any]]:
    """The (name, array) pairs of a non-mapping ``weights``; raises ExportError for anything else.

    Checked item by item because unpacking would otherwise accept a bare
    2-element array as a pair (a scalar weight named after its first value).
    """
    if _is_array(weights) or isinstance(weights, (str, bytes)) or not isinstance(weights, Iterable):
        raise ExportError(f"{_WEIGHTS_FORM}; got {_described(weights)}")
    items = list(weights)
    for index, item in enumerate(items):
        if _is_array(item) or not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ExportError(f"{_WEIGHTS_FORM}; got a {type(weights).__name__} whose item {index} is "
                              f"{_described(item)}")
    return [(name, array) for name, array in items]


def _is_array(value: Any) -> bool:
    """Whether ``value`` is an array (numpy, jax or alike), which is never a (name, array) pair."""
    return isinstance(value, np.ndarray) or (hasattr(value, "shape") and hasattr(value, "dtype"))


def _described(value: Any) -> str:
    """A short description of a value for a message: an array by dtype and shape, anything else by type and repr."""
    if _is_array(value):
        return f"a {value.dtype} array of shape {tuple(value.shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


def _check_weight_names(names: Sequence[str]) -> None:
    """Raise ExportError for a weight name given twice (safetensors keys are unique) or named ``__metadata__``."""
    first: dict[str, int] = {}
    for index, name in enumerate(names):
        if name == METADATA_KEY:
            # The safetensors header keeps the file's metadata under this key: the
            # weight's entry would replace it and the bundle would not load.
            raise ExportError(f"weights: weight {index} is named {name!r}, the key safetensors reserves for the "
                              "file's metadata; rename it")
        if name in first:
            raise ExportError(f"weights: duplicate weight name {name!r} (weights {first[name]} and {index}); "
                              "each weight needs a name of its own")
        first[name] = index


def _model_py_source(model_py: str | os.PathLike | None) -> str | None:
    """The hooks file's source text: ``model_py`` itself, or the file a path object names, read now so a bad
    path is refused before the bundle is touched. Either must compile: a file that cannot would make a
    bundle that ``bundle check`` calls servable and that never loads."""
    if model_py is None:
        return None
    if isinstance(model_py, os.PathLike):
        try:
            source = Path(model_py).read_text()
        except (OSError, UnicodeDecodeError) as err:
            reason = err.strerror if isinstance(err, OSError) and err.strerror else err
            raise ExportError(f"model_py: cannot read {os.fspath(model_py)!r}: {reason}") from None
        where = os.fspath(model_py)
    elif isinstance(model_py, str):
        if "\n" not in model_py.strip() and model_py.strip().endswith(".py"):
            # A str is the source text; a file name given as one was written as the hooks file itself.
            raise ExportError(f"model_py: {model_py.strip()!r} looks like a file name, but a str is the source "
                              f"text; pass pathlib.Path({model_py.strip()!r}) to copy that file")
        source, where = model_py, "the model_py source"
    else:
        raise ExportError(f"model_py must be the source text (str) or a path (pathlib.Path), "
                          f"got {type(model_py).__name__}")
    try:
        compile(source, MODEL_PY, "exec")
    except (SyntaxError, ValueError) as err:
        line = f" (line {err.lineno})" if getattr(err, "lineno", None) else ""
        raise ExportError(f"model_py: {where} is not valid Python{line}: {getattr(err, 'msg', None) or err}") from None
    return source


def checked_batch_sizes(batch_sizes: Sequence[int] | None) -> list[int] | None:
    """``batch_sizes`` as a sorted list of ints, or None when not given; raises ExportError naming a bad value.

    Each size must be a positive integer (a bool is not one, and a float is
    refused rather than truncated), given once, and the list must not be
    empty: an empty list would otherwise read as an unbatched program.
    """
    if batch_sizes is None:
        return None
    if isinstance(batch_sizes, (str, bytes, Mapping)) or not isinstance(batch_sizes, Iterable):
        raise ExportError(f"batch_sizes must be a list of positive integers, got {batch_sizes!r}")
    given = list(batch_sizes)
    if not given:
        raise ExportError("batch_sizes is empty: give at least one batch size, or leave batch_sizes out (None) "
                          "for an unbatched program")
    sizes = [_batch_size(value, f"batch_sizes {given!r}") for value in given]
    repeated = sorted({size for size in sizes if sizes.count(size) > 1})
    if repeated:
        raise ExportError(f"batch_sizes lists {', '.join(map(str, repeated))} more than once: {given!r}")
    return sorted(sizes)


def _batch_size(value: Any, where: str) -> int:
    """One batch size as an int; raises ExportError unless it is a positive integer (numpy integers included)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < 1:
        raise ExportError(f"{where}: batch sizes must be positive integers, got {value!r}")
    return int(value)


def _programs(modules: Modules | Sequence[Modules], batch_sizes: Sequence[int] | None,
              input_shapes: Sequence[Sequence[int]] | None) -> dict[ProgramKey, Module]:
    batch_sizes = checked_batch_sizes(batch_sizes)
    if input_shapes is not None:
        if isinstance(modules, (bytes, str, Mapping)) or len(modules) != len(input_shapes):
            raise ExportError(f"with input_shapes, modules must be a sequence of {len(input_shapes)} module "
                              "set(s), one per variant")
        variants = list(modules)
    else:
        variants = [modules]
    programs: dict[ProgramKey, Module] = {}
    shared_sizes: set[int] | None = None
    for index, entry in enumerate(variants):
        variant = index + 1 if input_shapes is not None else None
        if isinstance(entry, (bytes, str)):
            sizes = list(batch_sizes) if batch_sizes is not None else [None]
            if len(sizes) != 1:
                raise ExportError(f"one module was given for batch sizes {list(batch_sizes or [])}: give a "
                                  "mapping batch size -> module")
            per_size: dict[int | None, Module] = {sizes[0]: entry}
        elif isinstance(entry, Mapping):
            per_size = {_batch_size(k, "modules"): v for k, v in entry.items()}
            if batch_sizes is not None and sorted(per_size) != batch_sizes:
                raise ExportError(f"modules are given for batch sizes {sorted(per_size)} but batch_sizes is "
                                  f"{batch_sizes}")
        else:
            raise ExportError(f"modules: expected bytes, str or a mapping batch size -> module, got "
                              f"{type(entry).__name__}")
        these = {s for s in per_size if s is not None}
        if shared_sizes is not None and these != shared_sizes:
            raise ExportError("every input_shapes variant must be compiled for the same batch sizes")
        shared_sizes = these
        for size, module in per_size.items():
            programs[ProgramKey(variant, size)] = module
    return programs


def _manifest_document(name: str, inputs: Sequence[IOSpec], outputs: Sequence[IOSpec], sizes: list[int],
                       input_shapes: Sequence[Sequence[int]] | None, client_inputs: Sequence[IOSpec] | None,
                       client_outputs: Sequence[IOSpec] | None, layout: str,
                       provenance: Provenance | Mapping[str, Any] | None, description: str) -> dict[str, Any]:
    document: dict[str, Any] = {
        "format_version": CURRENT_FORMAT_VERSION if layout == "xla" else LEGACY_FORMAT_VERSION,
        "name": name,
    }
    if description:
        document["description"] = description
    document["executable_inputs"] = [s.manifest_entry() for s in inputs]
    document["executable_outputs"] = [s.manifest_entry() for s in outputs]
    if client_inputs is not None:
        document["client_inputs"] = [s.manifest_entry() for s in client_inputs]
    if client_outputs is not None:
        document["client_outputs"] = [s.manifest_entry() for s in client_outputs]
    if sizes:
        document["batching"] = {"compiled_batch_sizes": sizes}
    if input_shapes is not None:
        document["input_shapes"] = [[int(v) for v in variant] for variant in input_shapes]
    fields = provenance.fields if isinstance(provenance, Provenance) else dict(provenance or {})
    if fields:
        document["provenance"] = fields
    return document


def _artifact(module: Module, file_name: str) -> bytes:
    try:
        return to_portable_artifact(module)
    except (ValueError, UnicodeDecodeError) as err:
        raise ExportError(f"{file_name}: {err}") from None


def _read(artifact: bytes, file_name: str):
    try:
        return read_program(artifact, file_name)
    except ConfigError as err:
        raise ExportError(str(err)) from None


# The program and weights files an export writes (see bundle.py and _shards), and a migration's copy.
_EXPORTED_NAMES = re.compile(r"model(\.v\d+)?(\.b\d+)?\.mlir|weights(\.T|-\d{5}-of-\d{5})?\.safetensors")


def _write_files(directory: Path, files: Mapping[str, bytes], weights: list[tuple[str, np.ndarray]], layout: str,
                 model_py: str | None, provenance: Provenance | Mapping[str, Any] | None,
                 manifest_text: str, shard_bytes: int | None = None) -> None:
    """Write a checked bundle: every file to a temporary name first (the weights, the step most likely to fail on
    a full disk, then the programs, index, model.py, patch and manifest), and only once all are written replace
    the earlier export's files, the manifest last. A write that fails leaves the earlier export as it was, and
    no temporary file: it left a manifest of the earlier export beside programs of the new one, which no load
    takes, and its weights' temporary file filling the disk (the exhaustion hunt)."""
    directory.mkdir(parents=True, exist_ok=True)
    shards = _shards(weights, shard_bytes) if shard_bytes is not None else {DEFAULT_WEIGHTS_FILE: weights}
    others = dict(files)
    if shard_bytes is not None:
        index = {"metadata": {"total_size": sum(a.nbytes for _, a in weights),
                              "argument_order": [n for n, _ in weights]},
                 "weight_map": {n: file_name for file_name, part in shards.items() for n, _ in part}}
        others[INDEX_FILE] = (json.dumps(index, indent=1) + "\n").encode()
    if model_py is not None:
        others[MODEL_PY] = model_py.encode()
    if isinstance(provenance, Provenance) and provenance.patch:
        others[PATCH_FILE] = provenance.patch
    others[MANIFEST_NAME] = manifest_text.encode()  # (last: a bundle interrupted mid-rename has no new manifest)
    staged: dict[str, Path] = {}
    try:
        for file_name, part in shards.items():
            staged[file_name] = directory / temporary_name(file_name)
            write_safetensors(staged[file_name], part, legacy=layout == "legacy")
        for file_name, data in others.items():
            staged[file_name] = staged_write(directory / file_name, [data])
    except BaseException:
        for temporary in staged.values():
            temporary.unlink(missing_ok=True)
        raise
    # Program files, weights (one file, or other shards), the index and the patch of an earlier export would
    # otherwise linger beside the new ones and be served or misread. Only names an export writes: a hand-written
    # model.py's own labels.safetensors, or a model_reference.mlir, were removed with them (the exporter hunt).
    for stale in [*directory.iterdir(), directory / INDEX_FILE, directory / PATCH_FILE]:
        if stale.name not in staged and (_EXPORTED_NAMES.fullmatch(stale.name) or stale.name in (INDEX_FILE,
                                                                                                  PATCH_FILE)):
            stale.unlink(missing_ok=True)
    for file_name, temporary in staged.items():
        os.replace(temporary, directory / file_name)


def _manifest_text(document: dict[str, Any]) -> str:
    """The manifest file's text; rendered before writing so a value YAML cannot represent fails first."""
    header = ("# Written by nereid.backends.xla.export. Shapes are column-major (batch axis last);\n"
              "# clients and the program see them reversed (row-major).\n")
    try:
        return header + _yaml_text(document)
    except yaml.YAMLError as err:
        raise ExportError(f"the manifest cannot be written as YAML (provenance or description?): {err}") from None


def _shards(weights: list[tuple[str, np.ndarray]], shard_bytes: int) -> dict[str, list[tuple[str, np.ndarray]]]:
    """Consecutive runs of weights (program order), each closed once it holds ``shard_bytes`` or more."""
    parts: list[list[tuple[str, np.ndarray]]] = [[]]
    size = 0
    for name, array in weights:
        if size >= shard_bytes:
            parts.append([])
            size = 0
        parts[-1].append((name, array))
        size += array.nbytes
    count = len(parts)
    return {f"weights-{i + 1:05d}-of-{count:05d}.safetensors": part for i, part in enumerate(parts)}


class _FlowList(list):
    """A list the manifest writes on one line (sizes)."""


class _FlowDict(dict):
    """A mapping the manifest writes on one line (dims)."""


class _ManifestDumper(yaml.SafeDumper):
    """Block style overall, flow style for the short leaf collections (``dims: {c: 3}``)."""


_ManifestDumper.add_representer(_FlowList, lambda d, v: d.represent_sequence(
    "tag:yaml.org,2002:seq", v, flow_style=True))
_ManifestDumper.add_representer(_FlowDict, lambda d, v: d.represent_mapping(
    "tag:yaml.org,2002:map", v.items(), flow_style=True))


def _yaml_text(document: dict[str, Any]) -> str:
    def leafy(value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            if key == "dims":
                return _FlowDict(value)
            return {k: leafy(v, k) for k, v in value.items()}
        if isinstance(value, list):
            if all(isinstance(v, (int, float, str)) for v in value):
                return _FlowList(value)
            return [leafy(v) for v in value]
        return value

    return yaml.dump(leafy(document), Dumper=_ManifestDumper, sort_keys=False, default_flow_style=False,
                     width=100)
