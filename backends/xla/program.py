"""What a StableHLO portable artifact's entry function takes and returns.

The number of arguments a bundle's program wants lives only inside
``model*.mlir``, a serialized VHLO artifact rather than text, so it is read by
deserializing the artifact with jaxlib's MLIR bindings (no compilation). This
is also where the mapping between XLA element types and nereid's DType lives:
it is the backend's business, not the core table's.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import re
from dataclasses import dataclass
from typing import Iterator, Mapping

from nereid.dtypes import DType
from nereid.errors import ConfigError, cap_message

# MLIR bytecode starts with these bytes; anything else is treated as MLIR text.
BYTECODE_MAGIC = b"ML\xefR"
ENTRY_FUNCTION = "main"

ELEMENT_TYPES: Mapping[str, DType] = {
    "i1": DType.BOOL, "ui8": DType.UINT8, "ui16": DType.UINT16, "ui32": DType.UINT32, "ui64": DType.UINT64,
    "i8": DType.INT8, "i16": DType.INT16, "i32": DType.INT32, "i64": DType.INT64,
    "f16": DType.FP16, "f32": DType.FP32, "f64": DType.FP64, "bf16": DType.BF16,
    "f8E5M2": DType.F8E5M2, "f8E4M3FN": DType.F8E4M3,
}


@dataclass(frozen=True)
class ProgramTensor:
    """One parameter or result: row-major shape (-1 for a dynamic axis) and element type."""

    shape: tuple[int, ...]
    element_type: str

    @property
    def dtype(self) -> DType | None:
        """nereid's DType for the element type, None when it has none."""
        return ELEMENT_TYPES.get(self.element_type)

    def describe(self) -> str:
        """``tensor<8x16xf32>``-style text for messages."""
        dims = "x".join("?" if d < 0 else str(d) for d in self.shape)
        return f"tensor<{dims + 'x' if dims else ''}{self.element_type}>"


@dataclass(frozen=True)
class ProgramSignature:
    """The entry function's parameters and results, in order."""

    parameters: tuple[ProgramTensor, ...]
    results: tuple[ProgramTensor, ...]
    # The parameters whose buffers the program may take over (tf.aliasing_output, jax.buffer_donor: an export
    # with donate_argnums): after one run such a buffer is gone.
    donated: tuple[int, ...] = ()

    @property
    def arity(self) -> int:
        """How many arguments the program takes."""
        return len(self.parameters)


def is_bytecode(module: bytes) -> bool:
    """True when ``module`` is MLIR bytecode (a portable artifact) rather than text."""
    return module[:4] == BYTECODE_MAGIC


def _stablehlo():
    try:
        from jaxlib.mlir.dialects import stablehlo
    except ImportError as err:
        raise ConfigError(f"reading StableHLO needs jaxlib, which cannot be imported ({err}); pip install jax") \
            from None
    return stablehlo


def to_portable_artifact(module: bytes | str) -> bytes:
    """A StableHLO portable artifact from MLIR text, or the artifact itself when already one."""
    if isinstance(module, bytes) and is_bytecode(module):
        return module
    if not module.strip():
        raise ValueError("the module is empty")
    stablehlo = _stablehlo()
    try:
        text = module.decode("utf-8") if isinstance(module, bytes) else module
    except UnicodeDecodeError as err:
        raise ValueError(f"neither MLIR bytecode (which starts with {BYTECODE_MAGIC!r}) nor UTF-8 MLIR text "
                         f"({err})") from None
    context = _text_context(stablehlo)
    if context is None:
        try:
            return stablehlo.serialize_portable_artifact_str(text, stablehlo.get_current_version())
        except Exception as err:  # jaxlib raises ValueError / MLIRError
            raise ValueError(f"not a StableHLO module: {err}") from None
    from jaxlib.mlir import ir

    # Parsed and serialized here rather than by serialize_portable_artifact_str, which prints the
    # reason ("3:31: use of undeclared SSA value name") to stderr and raises only "failed to
    # serialize module": here the reasons are collected and quoted.
    parsed = None
    with _collected_diagnostics(context, ir) as diagnostics:
        try:
            with context:
                parsed = ir.Module.parse(text)
                return stablehlo.serialize_portable_artifact(parsed, stablehlo.get_current_version())
        except Exception as err:
            reason = "; ".join(diagnostics) or str(err).replace("Unable to parse module assembly:", "")
            reason = cap_message(" ".join(reason.replace('"-":', "line ").split()), 512)
            if parsed is not None:  # it parsed: the serialization to a portable artifact failed
                raise ValueError(f"not a portable StableHLO module ({reason}): it holds operations outside "
                                 "StableHLO (chlo or mhlo ones, say); lower them to StableHLO first, as "
                                 "nereid.backends.xla.export does") from None
            raise ValueError(f"not a StableHLO module: {reason}") from None


def _text_context(stablehlo):
    """An MLIR context that parses what JAX writes (func, stablehlo, chlo, ...), or None without one.

    It registers the dialects through jaxlib's ``_jax_mlir_ext``, which is not a
    stable API: when it is missing, text goes through
    ``serialize_portable_artifact_str`` instead, whose parse errors only say
    that serialization failed.
    """
    try:
        from jaxlib.mlir import ir
        from jaxlib.mlir._mlir_libs import _jax_mlir_ext

        registry = ir.DialectRegistry()
        _jax_mlir_ext.register_dialects(registry)
        context = ir.Context()
        context.append_dialect_registry(registry)
        context.load_all_available_dialects()
        stablehlo.register_dialect(context)
    except Exception:  # (ImportError, or a changed signature)
        return None
    _register_jax_dialects(context)
    return context


def _register_jax_dialects(context) -> None:
    """Register in ``context`` what JAX's own contexts register besides StableHLO, so that any module JAX
    writes parses there too (an export for cuda carries Shardy's ``sdy`` attributes, for one)."""
    for module, register in (("chlo", "register_dialect"), ("mhlo", "register_mhlo_dialect"),
                             ("sdy", "register_dialect")):
        try:
            getattr(importlib.import_module(f"jaxlib.mlir.dialects.{module}"), register)(context)
        except Exception:  # absent from this jaxlib: modules using it fail to parse, naming it
            pass


def read_program(module: bytes | str, where: str) -> ProgramSignature:
    """The entry function's signature; ConfigError naming ``where`` when it cannot be read."""
    stablehlo = _stablehlo()
    from jaxlib.mlir import ir

    try:
        artifact = to_portable_artifact(module)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None
    context = ir.Context()  # one per call: MLIR contexts are not shared across threads
    # Reading needs none of its thread pool, whose start at a process limit aborted the server ("LLVM ERROR:
    # pthread_create failed"; the exhaustion hunt).
    context.enable_multithreading(False)
    stablehlo.register_dialect(context)
    _register_jax_dialects(context)
    # The reader's own reasons ("attempting to parse 130 bytes when only 5 remain") go into the
    # error instead of to the server's stderr, where MLIR would print them.
    with _collected_diagnostics(context, ir) as diagnostics:
        try:
            with context:
                parsed = stablehlo.deserialize_portable_artifact(context, artifact)
                return _entry_signature(parsed, where, ir)
        except ConfigError:
            raise
        except Exception as err:
            reasons = "; ".join(diagnostics) or f"{type(err).__name__}: {err}"
            raise ConfigError(f"{where}: not a readable StableHLO portable artifact ({cap_message(reasons, 512)}): "
                              "the file is damaged or cut short, or was written by a newer StableHLO than this "
                              f"jaxlib reads ({stablehlo.get_current_version()})") from None


@contextlib.contextmanager
def _collected_diagnostics(context, ir) -> Iterator[list[str]]:
    """The error diagnostics ``context`` emits meanwhile, collected instead of printed to stderr."""
    diagnostics: list[str] = []

    def collect(diagnostic) -> bool:
        if diagnostic.severity == ir.DiagnosticSeverity.ERROR:
            location = str(diagnostic.location)  # loc("-":3:31) for text; nothing useful for bytecode
            where = location[4:-1].replace('"-":', "line ") + ": " if location.startswith('loc("-":') else ""
            diagnostics.append(f"{where}{diagnostic.message}")
        return True  # handled: not printed

    handler = context.attach_diagnostic_handler(collect)
    try:
        yield diagnostics
    finally:
        handler.detach()


def _entry_signature(module, where: str, ir) -> ProgramSignature:
    functions = {}
    for op in module.body.operations:
        if op.operation.name == "func.func":
            functions[ir.StringAttr(op.attributes["sym_name"]).value] = op
    entry = functions.get(ENTRY_FUNCTION)
    if entry is None:
        raise ConfigError(f"{where}: the module has no '{ENTRY_FUNCTION}' function "
                          f"(functions: {', '.join(sorted(functions)) or 'none'})")
    # XLA's conversion looks for a public main only: a private one would fail to compile with an MLIR dump.
    visibility = (ir.StringAttr(entry.attributes["sym_visibility"]).value
                  if "sym_visibility" in entry.attributes else "public")  # (absent: public, MLIR's default)
    if visibility != "public":
        raise ConfigError(f"{where}: the entry function '{ENTRY_FUNCTION}' is {visibility} "
                          f'(sym_visibility = "{visibility}"); it must be public')
    function_type = ir.FunctionType(ir.TypeAttr(entry.attributes["function_type"]).value)
    parameters = tuple(_tensor(t, where, f"parameter {i}", ir) for i, t in enumerate(function_type.inputs))
    results = tuple(_tensor(t, where, f"result {i}", ir) for i, t in enumerate(function_type.results))
    # (Large constants elided: a program with weights inlined as dense<> would print them whole.)
    _refuse_unsizable_tensors(module.operation.get_asm(large_elements_limit=16), where)
    _refuse_custom_parameter_layouts(entry, parameters, where, ir)
    return ProgramSignature(parameters, results, _donated(entry, ir))


def _refuse_custom_parameter_layouts(entry, parameters: tuple[ProgramTensor, ...], where: str, ir) -> None:
    """ConfigError for a parameter exported with a layout of its own (``mhlo.layout_mode = "{0,1}"``: jax.jit's
    ``in_shardings`` with a ``Layout``): nereid passes every argument row-major, which such a program reads as its
    own layout, answering wrong numbers without a word (a bug hunt). ``"default"`` and ``"auto"`` are the
    compiler's to choose; what it chose is checked once compiled (see ``parameter_layout_problem``)."""
    if "arg_attrs" not in entry.attributes:
        return
    for index, attributes in enumerate(ir.ArrayAttr(entry.attributes["arg_attrs"])):
        named = {attribute.name: attribute.attr for attribute in ir.DictAttr(attributes)}
        if LAYOUT_MODE not in named:
            continue
        try:
            mode = ir.StringAttr(named[LAYOUT_MODE]).value
        except (TypeError, ValueError):  # (not a string attribute: shown as MLIR prints it)
            mode = str(named[LAYOUT_MODE])
        shape = parameters[index].shape if index < len(parameters) else ()
        if mode not in ("default", "auto") and not _is_row_major(mode, shape):
            described = parameters[index].describe() if index < len(parameters) else "?"
            raise ConfigError(f"{where}: parameter {index} ({described}) was exported with a layout of its own "
                              f"({LAYOUT_MODE} = {cap_message(mode, 64)}), but nereid passes every argument in the "
                              "default row-major layout, which the program would read wrongly: export it without a "
                              "custom input layout (no Layout in jax.jit's in_shardings)")


def parameter_layout_problem(where: str, program: ProgramSignature, executable, client, device) -> str | None:
    """Why ``executable`` cannot take row-major arguments (None: it can): a parameter compiled for another layout
    than ``client``'s default for its shape on ``device``, as a program's ``"auto"`` layout may be on a GPU."""
    try:
        layouts = executable.get_parameter_layouts()
    except Exception:  # (an executable without layouts to tell: nothing to compare)
        return None
    for index, (tensor, layout) in enumerate(zip(program.parameters, layouts)):
        if tensor.dtype is None or any(d < 0 for d in tensor.shape):
            continue
        default = client.get_default_layout(tensor.dtype.numpy, tensor.shape, device)
        # (Equal up to axes of one element: XLA keeps {0,1} for a 4x1 tensor, the same bytes as {1,0}.)
        if layout != default and not _is_row_major(str(layout), tensor.shape):
            return (f"{where}: parameter {index} ({tensor.describe()}) was compiled for the layout {layout}, not "
                    f"the default {default} in which nereid passes its arguments, so the program would read them "
                    "wrongly: export it without a custom or automatic input layout")
    return None


def _is_row_major(mode: str, shape: tuple[int, ...]) -> bool:
    """Whether the layout ``mode`` (``"{1,0}"``: minor to major) lays ``shape`` out as row-major does: the same
    order of its dimensions of more than one element (an older exporter writes the default layout out: the hunt
    of this check)."""
    match = re.fullmatch(r"\{\s*((?:\d+\s*,\s*)*\d+)?\s*\}", mode)
    if match is None:
        return False
    minor_to_major = [int(d) for d in (match.group(1) or "").replace(" ", "").split(",") if d]
    if sorted(minor_to_major) != list(range(len(shape))):
        return False
    row_major = list(range(len(shape)))[::-1]
    kept = [d for d in minor_to_major if shape[d] != 1]
    return kept == [d for d in row_major if shape[d] != 1]


# The argument attribute with which a jax export fixes a parameter's layout ("default", "auto", or "{0,1}").
LAYOUT_MODE = "mhlo.layout_mode"


# A tensor type as MLIR prints it, its static dimensions and element type's name: tensor<3x?x4xf32> (a scalar,
# tensor<f32>, has no dimensions).
_TENSOR_TYPE = re.compile(r"tensor<((?:(?:\d+|\?)x)+)(\w+)")


def _refuse_unsizable_tensors(program_text: str, where: str) -> None:
    """ConfigError when any tensor of the program, its intermediates included, is too large for XLA to size: its
    compiler would abort the whole server (a signature's tensors are checked, with their names, first)."""
    for dimensions, element in set(_TENSOR_TYPE.findall(program_text)):
        elements = math.prod(int(d) for d in dimensions.split("x") if d and d != "?")
        if elements * 16 > MAX_TENSOR_BYTES:  # (16: the widest element; a bound, not the exact size)
            raise ConfigError(f"{where}: the program holds tensor<{dimensions}{element}>: {elements} elements, past "
                              "what XLA can size (its bytes in a signed 64-bit integer)")


def _donated(entry, ir) -> tuple[int, ...]:
    """The entry function's parameters that carry a donation attribute."""
    if "arg_attrs" not in entry.attributes:
        return ()
    donated = []
    for index, attributes in enumerate(ir.ArrayAttr(entry.attributes["arg_attrs"])):
        names = {named.name for named in ir.DictAttr(attributes)}
        if names & DONATION_ATTRIBUTES:
            donated.append(index)
    return tuple(donated)


# The argument attributes with which a program takes over a parameter's buffer.
DONATION_ATTRIBUTES = frozenset({"tf.aliasing_output", "jax.buffer_donor"})
# XLA sizes a tensor's bytes in a signed 64-bit integer; past it, its compiler aborts the whole process.
MAX_TENSOR_BYTES = 2 ** 63 - 1
# The custom calls through which a program calls back into Python (jax.pure_callback, io_callback,
# jax.debug.print): the function they call is no part of the bundle, and calling it crashes the server.
_PYTHON_CALLBACKS = re.compile(rb"xla(?:_ffi)?_python_(?:cpu|gpu)_callback(?![\w.])")


def python_callback_problem(program: bytes) -> str | None:
    """Why ``program`` (text or bytecode) cannot be served because it calls back into Python; None if it does not."""
    calls = sorted({name.decode() for name in _PYTHON_CALLBACKS.findall(program)})
    if not calls:
        return None
    return (f"the program calls back into Python ({', '.join(calls)}: jax.pure_callback, io_callback or "
            "jax.debug.print), whose function is no part of the bundle; remove the callback before exporting")


def _tensor(mlir_type, where: str, what: str, ir) -> ProgramTensor:
    try:
        ranked = ir.RankedTensorType(mlir_type)
    except ValueError:  # the binding refuses the cast for tokens, tuples and unranked tensors
        raise ConfigError(f"{where}: {what} is {mlir_type}, not a ranked tensor (a program with side "
                          "effects or tokens cannot be served)") from None
    shape = tuple(-1 if ranked.is_dynamic_dim(i) else ranked.shape[i] for i in range(ranked.rank))
    tensor = ProgramTensor(shape, str(ranked.element_type))
    elements = math.prod(d for d in shape if d > 0)
    if elements * 16 > MAX_TENSOR_BYTES:  # (16: the widest element; a bound, not the exact size)
        raise ConfigError(f"{where}: {what} is {tensor.describe()}: {elements} elements, past what XLA can size "
                          "(its bytes in a signed 64-bit integer)")
    return tensor
