"""``export_bundle``: trace a JAX function with ``jax.export`` at each batch size and write a bundle.

The function is called as ``fn(*inputs, *weights)`` and returns one array or a
tuple of arrays, exactly the calling convention the server uses
(``executable(inputs..., weights...)``). It is jitted with ``keep_unused=True``
so that an argument the program never reads still counts (jax would otherwise
drop it and the bundle would be unservable).
"""

from __future__ import annotations

import numbers
import operator
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NoReturn, Sequence

import numpy as np

from nereid.backends.xla.export.iospec import IOSpec, as_dtype
from nereid.backends.xla.manifest import EXPORT_PLATFORM
from nereid.backends.xla.export.provenance import Provenance, collect_provenance
from nereid.backends.xla.export.writer import (ExportError, checked_batch_sizes, supported_dtype, weight_pairs,
                                                write_bundle)


# The PJRT platforms jax lowers a program for.
EXPORT_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def export_bundle(fn: Callable[..., Any], example_inputs: Sequence[Any],
                  weights: Mapping[str, Any] | Iterable[tuple[str, Any]], *, directory: Path | str,
                  name: str | None = None, batch_sizes: Sequence[int] | None = None,
                  input_names: Sequence[str] | None = None, output_names: Sequence[str] | None = None,
                  input_batch_axes: Sequence[int | None] | None = None,
                  output_batch_axes: Sequence[int | None] | None = None, platform: str = "cpu",
                  client_inputs: Sequence[IOSpec] | None = None, client_outputs: Sequence[IOSpec] | None = None,
                  model_py: str | Path | None = None, layout: str = "xla",
                  provenance: Provenance | Mapping[str, Any] | bool | None = True, description: str = "",
                  x64: bool | None = None, shard_bytes: int | None = None, check_rows: bool = True) -> Path:
    """Export ``fn(*inputs, *weights)`` as a bundle at ``directory``; returns the directory.

    ``example_inputs`` give each input's dtype and row-major shape; with
    ``batch_sizes``, each batched input's batch axis (``input_batch_axes``,
    default 0 for every input; None opts one out) is resized to every size in
    turn and the function traced once per size. Outputs are batched along
    ``output_batch_axes`` (default 0 when batching; None opts one out).
    ``weights`` are ``name -> array`` in the order ``fn`` takes them.
    ``platform`` is the PJRT platform the artifact is lowered for (``cpu``,
    ``cuda``), recorded as ``provenance.export_platform`` in the manifest (also
    with ``provenance=False``) so that the server can tell a program lowered
    for another platform than it runs on. ``provenance=True`` records :func:`collect_provenance` of the
    working directory, ``directory`` itself left out of it. ``x64`` enables
    64-bit types while tracing (default: when the session has ``jax_enable_x64`` on or any input or weight is
    64-bit; ``x64=False`` traces in 32 bits whatever the session says).
    ``shard_bytes`` splits the weights into shards of about that size (see
    :func:`write_bundle`). ``check_rows`` (where a batch size above 1 is
    compiled) runs ``fn`` on the CPU at the largest batch size three times:
    random rows, every row but the first changed, only the first changed; it
    refuses a function of which a row of a batched output changes with another
    row (it mixes rows across the batch axis); ``False`` skips it.
    """
    import jax
    from jax import export as jax_export

    # Checked before tracing: jax would fail on a bad size with an error that names no argument.
    batch_sizes = checked_batch_sizes(batch_sizes)
    if platform not in EXPORT_PLATFORMS:  # (jax lowers for a misspelt one too, and the server then warned of it)
        raise ExportError(f"platform must be one of {', '.join(EXPORT_PLATFORMS)}, got {platform!r}")
    directory = Path(directory)
    name = name or directory.name
    in_names = _names(input_names, len(example_inputs), "input")
    if x64 is None:
        # Decided first, from the values that carry a dtype of their own: a Python number narrowed to jax's 32 bits
        # before a 64-bit example turned x64 on served numbers no jax run gives (the exporter hunt).
        x64 = _default_x64(jax, _carried_dtypes(example_inputs, weights))
    elif not x64 and (wide := _first_64_bit(example_inputs, in_names, weights)) is not None:
        # Traced in 32 bits, the value narrowed to 32 while the bundle declared it 64: the refusal came from the
        # bundle's own check, "parameter 0 ... is tensor<1x4xf32> in the program but the bundle declares
        # tensor<1x4xf64>", naming neither x64 nor the value (the exporter hunt).
        raise ExportError(f"x64=False, but {wide} is 64-bit: traced in 32 bits it would be narrowed; pass 32-bit "
                          "arrays, or x64=True (or leave x64 out: a 64-bit value turns it on)")
    # A Python number or list takes jax's width for it: 64 bits under x64.
    examples = [_shape_dtype(x, f"example input {i} ({n!r})", x64)
                for i, (x, n) in enumerate(zip(example_inputs, in_names))]
    # A Python number is weakly typed in jax too: it takes the other operand's type (0.5 * a bfloat16 stays one).
    typed_weights, weak = _python_values_as_jax_types(weights, x64)
    weight_items = weight_pairs(typed_weights)
    sizes: list[int | None] = list(batch_sizes) if batch_sizes is not None else [None]
    in_axes = _axes(input_batch_axes, len(examples), batch_sizes is not None, "input_batch_axes")
    _check_input_axes(in_names, examples, in_axes)
    weight_structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=name in weak) for name, a in weight_items]
    jitted = jax.jit(fn, keep_unused=True)
    modules: dict[int | None, bytes] = {}
    out_avals_by_size: dict[int | None, Sequence[Any]] = {}
    with jax.enable_x64(x64):
        for size in sizes:
            structs = [jax.ShapeDtypeStruct(_resized(shape, axis, size), dtype)
                       for (shape, dtype), axis in zip(examples, in_axes)]
            exported = _export(jax_export, jitted, platform, [*structs, *weight_structs], size)
            _check_exported(exported, len(structs) + len(weight_structs), size)
            if not out_avals_by_size:  # checked after the first trace: the others would fail alike
                out_names = _output_names(jax, exported.out_tree, output_names)
                _check_output_dtypes(exported.out_avals, out_names)
            modules[size] = exported.mlir_module_serialized
            out_avals_by_size[size] = exported.out_avals
        probe = _probe_size(batch_sizes, output_batch_axes)
        if probe is not None:
            out_avals_by_size[probe] = _probe_avals(jax, jitted, examples, in_axes, weight_structs, probe)
    n_outputs = len(next(iter(out_avals_by_size.values())))
    out_axes = _axes(output_batch_axes, n_outputs, batch_sizes is not None, "output_batch_axes")
    inputs = [IOSpec(n, as_dtype(d), _without(shape, axis), axis)
              for n, (shape, d), axis in zip(in_names, examples, in_axes)]
    outputs = _output_specs(out_names, out_avals_by_size, out_axes, probe)
    if check_rows and batch_sizes is not None and max(batch_sizes) > 1:
        with jax.enable_x64(x64):
            _check_rows_independent(jax, fn, examples, in_axes, weight_items, out_names, out_axes, max(batch_sizes))
    if provenance is True:
        # The bundle's own folder is no part of the exporting code: left out, a re-export does not record
        # the previous export as an uncommitted change (nor copy it into working_tree.patch).
        provenance = collect_provenance(exclude=[directory])
    elif provenance is False:
        provenance = None
    provenance = _with_platform(provenance, platform)
    module_arg: Any = modules[None] if batch_sizes is None else modules
    return write_bundle(directory, name, inputs, outputs, module_arg, weight_items,
                        batch_sizes=batch_sizes,
                        client_inputs=client_inputs, client_outputs=client_outputs, layout=layout,
                        model_py=model_py, provenance=provenance, description=description,
                        shard_bytes=shard_bytes)


def _check_rows_independent(jax: Any, fn: Callable[..., Any], examples: Sequence[tuple[tuple[int, ...], Any]],
                            in_axes: Sequence[int | None], weight_items: Sequence[tuple[str, Any]],
                            out_names: Sequence[str], out_axes: Sequence[int | None], size: int) -> None:
    """ExportError naming the first batched output, and its row, that depends on another row of the batch.

    The server pads a batch with rows of its own and batches requests of
    several clients together, so a function that mixes rows (``x -
    x.mean(axis=0)``, BatchNorm in training mode, ``jnp.cumsum(x, axis=0)``,
    a scan over the batch axis) answers each client with numbers that depend
    on the others. ``fn`` runs three times on the CPU, at ``size`` rows: random
    rows; every row but the first redrawn (the first row must not change);
    only the first row redrawn (no other row may change). The second run
    catches a first row that reads other rows (a mean, a sort), the third any
    row that reads the first (a running total, a scan, ``x - x[0]``, a shift
    along the batch), which the second cannot see: the first row of a prefix
    reads no other row. Unbatched inputs and the weights stay unchanged; each
    row compared stays at its position, so the same program computes it the
    same way (a permutation of the rows would catch more, but moves rows to
    where the compiled program may round them otherwise).
    """
    if all(axis is None for axis in in_axes) or all(axis is None for axis in out_axes):
        return
    rng = np.random.default_rng(0)
    base = [_random_array(rng, _resized(shape, axis, size), dtype) for (shape, dtype), axis in zip(examples, in_axes)]
    others_redrawn = [_rows_redrawn(rng, array, axis, slice(1, None)) for array, axis in zip(base, in_axes)]
    first_redrawn = [_rows_redrawn(rng, array, axis, slice(0, 1)) for array, axis in zip(base, in_axes)]
    weights = [np.asarray(a) for _, a in weight_items]  # on the host: a jax array on a GPU would run there
    try:
        with jax.default_device(jax.devices("cpu")[0]):
            run = jax.jit(fn)  # one compile: the three runs share the shapes
            before, after_others, after_first = (
                [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(run(*arrays, *weights))]
                for arrays in (base, others_redrawn, first_redrawn))
    except Exception as error:
        raise ExportError(f"the row check (the function run on the CPU at batch size {size} on random rows) failed: "
                          f"{type(error).__name__}: {error}; pass check_rows=False to export without it") from error
    for index, (name, axis) in enumerate(zip(out_names, out_axes)):
        if axis is None:
            continue
        if _changed_row(before[index], after_others[index], axis, range(1)) is not None:
            _refuse_mixed_rows(index, name, size, "its first row changed when only the other rows of the batch did",
                               "mixes rows across the batch axis (as x - x.mean(axis=0) or BatchNorm in training "
                               "mode do)")
        row = _changed_row(before[index], after_first[index], axis, range(1, size))
        if row is not None:
            _refuse_mixed_rows(index, name, size, f"its row {row} (counting from 0) changed when only the first "
                               "row of the batch did", "carries rows along the batch axis (as jnp.cumsum(x, axis=0), "
                               "a jax.lax.scan over it or x - x[0] do)")


def _random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Random values of ``dtype``: small non-negative integers (valid indices into most tables), booleans, normals."""
    kind = np.dtype(dtype).kind
    if kind == "b":
        return rng.random(shape) < 0.5
    if kind in "iu":
        return rng.integers(0, 8, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _rows_redrawn(rng: np.random.Generator, array: np.ndarray, axis: int | None, rows: slice) -> np.ndarray:
    """``array`` with ``rows`` of its batch axis redrawn, every value in them changed; unbatched, ``array`` itself.

    Changed, not just redrawn: a boolean or small-integer row drawn again would often come out the same (a
    one-element boolean row, half the time), and a row that did not change shows no dependency on it.
    """
    if axis is None:
        return array
    redrawn = array.copy()
    old = np.moveaxis(array, axis, 0)[rows]
    kind = array.dtype.kind
    if kind == "b":
        new = ~old
    elif kind in "iu":  # another value in 0..7, as _random_array draws them
        new = ((old.astype(np.int64) + rng.integers(1, 8, old.shape)) % 8).astype(array.dtype)
    else:
        new = _random_array(rng, old.shape, array.dtype)
    np.moveaxis(redrawn, axis, 0)[rows] = new
    return redrawn


def _changed_row(before: np.ndarray, after: np.ndarray, axis: int, rows: Iterable[int]) -> int | None:
    """The first of ``rows`` (along the batch ``axis``) that differs between two runs' output; None if none does."""
    return next((row for row in rows if not _same_row(np.take(before, row, axis), np.take(after, row, axis))), None)


def _refuse_mixed_rows(index: int, name: str, size: int, change: str, cause: str) -> NoReturn:
    """The row check's ExportError for output ``index``: which row changed (``change``), and how ``fn`` mixes."""
    raise ExportError(
        f"output {index} ({name!r}): {change} (batch size {size}, random rows): the function {cause}, so a served "
        "answer would depend on the server's padding and on other requests batched with it; the batch axis must be "
        "row-independent, or export without batching (input_batch_axes=[None, ...] or batch_sizes=[1]); "
        "check_rows=False skips this check")


def _same_row(before: np.ndarray, after: np.ndarray) -> bool:
    """Whether two runs gave one row alike: exactly for integers and booleans, to a few ulps for floats.

    The same program at the same shape is deterministic on the CPU in practice, but a last-bit difference (a
    threaded reduction) must not refuse a legitimate model; a function that mixes rows moves the row by far more
    than a few ulps on random rows.
    """
    import jax.numpy as jnp

    if not jnp.issubdtype(before.dtype, jnp.floating):  # (jnp's test knows bfloat16 and float8, numpy's does not)
        return bool(np.array_equal(before, after))
    tolerance = 16 * float(jnp.finfo(before.dtype).eps)
    return bool(np.allclose(before.astype(np.float64), after.astype(np.float64), rtol=tolerance, atol=tolerance,
                            equal_nan=True))


def _with_platform(provenance: Provenance | Mapping[str, Any] | None, platform: str) -> Provenance:
    """``provenance`` with the platform the programs were lowered for: a fact of this export, so it wins over a
    value the caller's provenance holds."""
    if isinstance(provenance, Provenance):
        return Provenance({**provenance.fields, EXPORT_PLATFORM: platform}, provenance.patch)
    return Provenance({**dict(provenance or {}), EXPORT_PLATFORM: platform})


def _export(jax_export: Any, jitted: Any, platform: str, structs: Sequence[Any], size: int | None) -> Any:
    """``jax.export`` of ``jitted`` at ``structs``; ExportError for a function that calls back into Python."""
    try:
        return jax_export.export(jitted, platforms=[platform])(*structs)
    except NotImplementedError as error:
        if "host_callbacks" not in str(error):
            raise
        where = f"batch size {size}" if size is not None else "the program"
        raise ExportError(f"{where}: the function calls back into Python (jax.pure_callback, io_callback or "
                          f"jax.debug.print; jax: {error}), which a bundle cannot hold: the server runs the program "
                          "alone; remove the callback from the exported function") from error


def _check_input_axes(names: Sequence[str], examples: Sequence[tuple[tuple[int, ...], Any]],
                      axes: Sequence[int | None]) -> None:
    """ExportError naming the first input whose batch axis is not one of its axes (a scalar, by default), or that
    has an empty axis besides its batch axis (which a bundle's shapes cannot declare)."""
    for index, (name, (shape, _), axis) in enumerate(zip(names, examples, axes)):
        if axis is not None and not 0 <= axis < len(shape):
            suggestion = [None if i == index else a for i, a in enumerate(axes)]
            raise ExportError(f"example input {index} ({name!r}) has shape {shape}: its batch axis {axis} is outside "
                              f"it; an input without a batch axis (a scalar) takes None in input_batch_axes, e.g. "
                              f"input_batch_axes={suggestion}")
        empty = [position for position, size in enumerate(shape) if size == 0 and position != axis]
        if empty:
            # (It was IOSpec's bare ValueError, after tracing, naming no example; the export hunt.)
            raise ExportError(f"example input {index} ({name!r}) has shape {shape}: axis {empty[0]} is empty, and a "
                              "bundle's tensors declare sizes of 1 or more besides the batch axis: give an example "
                              "of the size the program takes")


def _shape_dtype(value: Any, what: str, wide: bool = False) -> tuple[tuple[int, ...], Any]:
    """One example input's static row-major shape and supported dtype; ExportError naming it otherwise.

    A symbolic (shape-polymorphic) axis is refused here: jax would fail on it
    deep in tracing, naming no input, and a bundle holds one static program per
    batch size anyway.
    """
    if isinstance(value, Mapping):
        raise ExportError(f"{what} is a dict (keys {', '.join(map(repr, value))}), not an array: pass each array as "
                          "its own input (the function then takes them as separate arguments)")
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        shape, dtype = tuple(value.shape), value.dtype
        _refuse_typed_key(dtype, what)
    else:
        array = _in_jax_width(np.asarray(value), wide, what)  # (a Python number or list: weakly typed in jax)
        shape, dtype = array.shape, array.dtype
    sizes = [_static_size(d) for d in shape]
    symbolic = [axis for axis, size in enumerate(sizes) if size is None]
    if symbolic:
        concrete = tuple(1 if size is None else size for size in sizes)
        axis = symbolic[0]
        raise ExportError(f"{what}: axis {axis} has the symbolic size {shape[axis]} (shape "
                          f"({', '.join(map(str, shape))})); bundles need static example shapes: give a concrete "
                          f"example, such as one of shape {concrete}, and the batch sizes to compile as "
                          "batch_sizes=[...] (a variable non-batch axis needs one program per size: write_bundle's "
                          "input_shapes)")
    supported_dtype(dtype, what)
    if isinstance(dtype, np.dtype) and not dtype.isnative:  # (a big-endian example: jax traces native types)
        dtype = dtype.newbyteorder("=")
    return tuple(int(size) for size in sizes), dtype


def _refuse_typed_key(dtype: Any, what: str) -> None:
    """ExportError for a typed PRNG key (``jax.random.key``): a bundle's tensors hold numbers, so pass its data."""
    import jax

    try:
        typed_key = jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    except TypeError:
        return
    if typed_key:
        raise ExportError(f"{what} is a typed PRNG key ({dtype}), which a bundle cannot hold: pass "
                          "jax.random.key_data(key) (uint32) and rebuild the key in the function with "
                          "jax.random.wrap_key_data")


def _static_size(size: Any) -> int | None:
    """``size`` as an int, or None for a symbolic dimension (jax's shape polymorphism)."""
    if isinstance(size, numbers.Integral):
        return int(size)
    try:
        return operator.index(size)
    except Exception:  # jax raises its own InconclusiveDimensionOperation for a symbolic size
        return None


def _in_jax_width(array: np.ndarray, wide: bool, what: str) -> np.ndarray:
    """The array of a Python number or list (numpy makes it float64 or int64) in the width jax gives such a value:
    32 bits unless ``wide`` (x64 asked for, or the session's). Counted as 64-bit, a weight written ``0.5`` made the
    whole bundle x64, serving FP64 where ``jax.jit`` of the same function gives float32 (the export hunt). An
    integer 32 bits cannot hold is refused naming ``what``, as jax refuses it (it was stored wrapped around)."""
    if wide or array.dtype.itemsize != 8 or array.dtype.kind not in "iuf":
        return array
    narrow = array.astype({"f": np.float32, "i": np.int32, "u": np.uint32}[array.dtype.kind])
    if array.dtype.kind in "iu" and not np.array_equal(narrow, array):
        raise ExportError(f"{what} holds an integer that 32 bits cannot hold ({array.min()} to {array.max()}), "
                          "where a Python number takes jax's 32-bit width: pass np.int64(...) and export with "
                          "x64=True (or in a session with jax_enable_x64)")
    return narrow


def _python_values_as_jax_types(weights: Any, wide: bool) -> tuple[Any, set[str]]:
    """``weights`` with each Python number or list (a value without a dtype of its own) in jax's width for it (see
    :func:`_in_jax_width`), anything else as it is, for :func:`weight_pairs` to judge and name; and the names of
    those given as Python numbers (int or float, not bool), which jax types weakly: traced so, a bundle's output
    has the type ``jax.jit`` of the same function gives (a float weight times a bfloat16 input made float32, or
    float64 under x64; the review hunt)."""
    weak: set[str] = set()

    def narrowed(name: object, value: Any) -> Any:
        # (type: numpy's float64 is a float, typed strongly; a jax array of a number, jnp.array(0.5), is weak too:
        # the exporter hunt.)
        if (type(value) in (int, float) or getattr(value, "weak_type", False) is True) and isinstance(name, str):
            weak.add(name)
        if hasattr(value, "dtype") or isinstance(value, bool) or not isinstance(value, (int, float, list, tuple)):
            return value
        try:
            array = np.asarray(value)
        except (TypeError, ValueError, OverflowError):  # (a ragged list: refused naming the weight)
            return value
        return value if array.dtype.kind in "OSUV" else _in_jax_width(array, wide, f"weights: weight {name!r}")

    if isinstance(weights, Mapping):
        return {name: narrowed(name, value) for name, value in weights.items()}, weak
    if isinstance(weights, (list, tuple)):
        return [(item[0], narrowed(item[0], item[1])) if isinstance(item, (tuple, list)) and len(item) == 2 else item
                for item in weights], weak
    return weights, weak


def _carried_dtypes(example_inputs: Sequence[Any], weights: Any) -> list[Any]:
    """The dtypes of the example inputs and weights that carry one (arrays; not Python numbers or lists, whose
    width follows x64), for :func:`_default_x64`."""
    values = [*example_inputs, *(value for _, value in _named_weights(weights))]
    dtypes = []
    for value in values:
        dtype = getattr(value, "dtype", None)
        try:
            dtypes.append(np.dtype(dtype)) if dtype is not None else None
        except TypeError:  # (a dtype numpy does not know, a typed key: refused later, naming it)
            continue
    return dtypes


def _named_weights(weights: Any) -> list[tuple[Any, Any]]:
    """The (name, value) pairs of a weights argument in either accepted form (a mapping, or pairs), before
    :func:`weight_pairs` checks it: what is neither is left for that check to refuse."""
    pairs = weights.items() if isinstance(weights, Mapping) else weights if isinstance(weights, (list, tuple)) else []
    return [(item[0], item[1]) for item in pairs if isinstance(item, (tuple, list)) and len(item) == 2]


def _first_64_bit(example_inputs: Sequence[Any], in_names: Sequence[str], weights: Any) -> str | None:
    """The first example input or weight that carries a 64-bit dtype, described ("example input 0 ('x')
    float64"); None when there is none."""
    named = [(f"example input {i} ({n!r})", x) for i, (x, n) in enumerate(zip(example_inputs, in_names))]
    named += [(f"weight {name!r}", value) for name, value in _named_weights(weights)]
    for what, value in named:
        dtypes = _carried_dtypes([value], None)
        if dtypes and _is_64_bit(dtypes[0]):
            return f"{what} ({dtypes[0]})"
    return None


def _is_64_bit(dtype: Any) -> bool:
    """True for the 64-bit integer and float dtypes that x64 governs."""
    return np.dtype(dtype).itemsize == 8 and np.dtype(dtype).kind in "iuf"


def _default_x64(jax: Any, dtypes: Sequence[Any]) -> bool:
    """x64 for an export that does not say: the session's ``jax_enable_x64``, or any 64-bit input or weight.

    The session's setting is never turned off: ``with jax.enable_x64(False)`` traced a function written for x64
    (a float64 accumulator) in 32 bits, so the bundle served other numbers and float32 where jax gives float64.
    A 64-bit example turns it on even in a session without x64 (unlike ``jax.jit``, which would truncate it).
    """
    if jax.config.read("jax_enable_x64"):
        return True
    return any(_is_64_bit(d) for d in dtypes)


def _output_names(jax: Any, out_tree: Any, output_names: Sequence[str] | None) -> list[str]:
    """The outputs' names in the program's order, from what ``fn`` returns (``out_tree``) and ``output_names``.

    One array, or a flat tuple or list of arrays: named by ``output_names`` in
    order (or the default names). A flat dict of arrays: named by its keys, in
    the order jax flattens it (sorted keys, not the order it was written in, so
    naming its outputs by position gave each the wrong tensor). Anything else
    (nested, None) is refused: its outputs have no order a client could name.
    """
    structure = jax.tree_util.tree_unflatten(out_tree, range(out_tree.num_leaves))
    if isinstance(structure, int):
        return _names(output_names, 1, "output")
    if isinstance(structure, (tuple, list)) and structure and all(isinstance(v, int) for v in structure):
        return _names(output_names, len(structure), "output")
    if (isinstance(structure, dict) and structure and all(isinstance(k, str) and k for k in structure)
            and all(isinstance(v, int) for v in structure.values())):
        keys = [key for key, _ in sorted(structure.items(), key=lambda item: item[1])]
        if output_names is not None and sorted(output_names) != sorted(keys):
            raise ExportError(f"output_names {list(output_names)} are not the keys of the dict the function "
                              f"returns ({keys}): a dict's outputs are named by its keys; give the same names "
                              "(in any order) or leave output_names out")
        return keys
    raise ExportError(f"the function returns {out_tree} ({out_tree.num_leaves} array(s)), which a bundle cannot "
                      "name: return one array, a flat tuple or list of arrays (named by output_names), or a flat "
                      "dict of arrays (named by its keys); flatten a nested result, e.g. with "
                      "jax.tree_util.tree_leaves")


def _check_output_dtypes(avals: Sequence[Any], names: Sequence[str]) -> None:
    """ExportError naming the first output of a dtype nereid does not support (complex64, int4)."""
    for index, (aval, name) in enumerate(zip(avals, names)):
        supported_dtype(aval.dtype, f"output {index} ({name!r})")


def _axes(axes: Sequence[int | None] | None, count: int, batched: bool, what: str) -> list[int | None]:
    if axes is None:
        return [0 if batched else None] * count
    axes = list(axes)
    if len(axes) != count:
        raise ExportError(f"{what} has {len(axes)} entries for {count} tensor(s)")
    if not batched and any(a is not None for a in axes):
        raise ExportError(f"{what} is given but batch_sizes is not")
    for index, axis in enumerate(axes):
        if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int) or axis < 0):
            # (-1 for the last axis went through Python's indexing to a garbled shape, or a suggestion of None.)
            raise ExportError(f"{what}[{index}] is {axis!r}: a batch axis is an int counted from 0 (the last axis "
                              "of a rank-2 tensor is 1), or None for a tensor without one")
    return axes


def _resized(shape: tuple[int, ...], axis: int | None, size: int | None) -> tuple[int, ...]:
    if axis is None or size is None:
        return shape
    if not 0 <= axis < len(shape):
        raise ExportError(f"batch axis {axis} is outside an input of shape {shape}")
    return (*shape[:axis], size, *shape[axis + 1:])


def _without(shape: tuple[int, ...], axis: int | None) -> tuple[int, ...]:
    return shape if axis is None else (*shape[:axis], *shape[axis + 1:])


def _names(names: Sequence[str] | None, count: int, stem: str) -> list[str]:
    if names is not None:
        if len(names) != count:
            raise ExportError(f"{stem}_names has {len(names)} names for {count} {stem}(s)")
        for index, name in enumerate(names):
            if not isinstance(name, str) or not name:  # (IOSpec's own ValueError came after every trace)
                raise ExportError(f"{stem}_names[{index}] is {name!r}: each {stem} needs a non-empty name")
        return list(names)
    return [stem] if count == 1 else [f"{stem}_{i}" for i in range(count)]


def _check_exported(exported: Any, n_arguments: int, size: int | None) -> None:
    where = f"batch size {size}" if size is not None else "the program"
    if exported.nr_devices != 1:
        raise ExportError(f"{where}: the function is sharded over {exported.nr_devices} devices; bundles run on one")
    if exported.ordered_effects or exported.unordered_effects:
        raise ExportError(f"{where}: the function has side effects ({exported.ordered_effects or ''}"
                          f"{exported.unordered_effects or ''}), which a bundle cannot serve")
    if len(exported.module_kept_var_idx) != n_arguments:
        dropped = sorted(set(range(n_arguments)) - set(exported.module_kept_var_idx))
        raise ExportError(f"{where}: jax dropped unused argument(s) {dropped} from the program")


def _probe_size(batch_sizes: Sequence[int] | None, output_batch_axes: Sequence[int | None] | None) -> int | None:
    """The batch size to trace once more, abstractly, to tell the outputs' batch axes; None when not needed.

    With one batch size, an unbatched output whose length happens to equal it (a per-class table of 4 at
    batch_sizes=[4]) looked batched, and was served cut to the request's rows; traced at another size too, its
    length does not follow. Output axes the caller gives are taken as said.
    """
    if batch_sizes is None or len(batch_sizes) != 1 or output_batch_axes is not None:
        return None
    return batch_sizes[0] + 1


def _probe_avals(jax: Any, jitted: Any, examples: Sequence[tuple[tuple[int, ...], Any]],
                 in_axes: Sequence[int | None], weight_structs: Sequence[Any], size: int) -> list[Any]:
    """The outputs' shapes and dtypes at ``size`` rows, from ``jax.eval_shape`` (traced, not lowered)."""
    structs = [jax.ShapeDtypeStruct(_resized(shape, axis, size), dtype) for (shape, dtype), axis in zip(examples,
                                                                                                      in_axes)]
    try:
        return jax.tree_util.tree_leaves(jax.eval_shape(jitted, *structs, *weight_structs))
    except Exception as error:
        raise ExportError(f"with a single batch size the function is traced once more, at batch size {size}, to tell "
                          f"its outputs' batch axes, and that failed ({type(error).__name__}: {error}); pass "
                          "output_batch_axes (None for an unbatched output) to say which they are") from error


def _output_specs(names: list[str], avals_by_size: Mapping[int | None, Sequence[Any]],
                  axes: list[int | None], probe: int | None = None) -> list[IOSpec]:
    """The outputs' IOSpecs; ExportError for an output whose batch axis does not follow the batch size.

    ``probe`` is a batch size traced only to tell the batch axes (see :func:`_probe_size`), named so in errors.
    """
    specs: list[IOSpec] = []
    for index, (name, axis) in enumerate(zip(names, axes)):
        shapes = {}
        for size, avals in avals_by_size.items():
            shape = tuple(int(d) for d in avals[index].shape)
            if axis is not None:
                if axis >= len(shape) or shape[axis] != size:
                    traced = ("" if size != probe else
                              " (traced there only to tell the batch axes, as there is a single batch size)")
                    raise ExportError(f"output {index} ({name}) has shape {shape} at batch size {size}{traced}: axis "
                                      f"{axis} is not its batch axis; pass output_batch_axes (None for an unbatched "
                                      "output)")
                shape = _without(shape, axis)
            shapes[size] = shape
        if len(set(shapes.values())) != 1:
            raise ExportError(f"output {index} ({name}) changes shape with the batch size beyond its batch axis: "
                              f"{shapes}")
        dtype = as_dtype(np.dtype(avals_by_size[next(iter(avals_by_size))][index].dtype))
        specs.append(IOSpec(name, dtype, next(iter(shapes.values())), axis))
    return specs
