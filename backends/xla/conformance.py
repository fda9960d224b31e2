"""Does a program take and return what the manifest and the weights file say?

Checked once per program before the model is ready, so a bundle whose manifest
disagrees with its program fails to load with the tensor, the position and both
types named, rather than failing every request later.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

from nereid.backends.xla.bundle import ProgramKey
from nereid.backends.xla.dtype_tokens import token_of
from nereid.backends.xla.manifest import DimKind, Manifest, ManifestTensor
from nereid.backends.xla.program import ELEMENT_TYPES, ProgramSignature, ProgramTensor
from nereid.backends.xla.safetensors import ARGUMENT_ORDER_KEY
from nereid.dtypes import DType
from nereid.errors import ConfigError


def check_program_types(where: str, program: ProgramSignature, key: ProgramKey, manifest: Manifest,
                        weights: Sequence[tuple[str, tuple[int, ...], DType]], legacy_weights: bool = False) -> None:
    """Raise ConfigError at the first parameter or result that disagrees (arity is checked before).
    ``legacy_weights``: the weights file has no ``axis_order: xla`` (the hint for a reversed weight names it)."""
    variant = manifest.input_shapes[key.variant - 1] if key.variant is not None and manifest.input_shapes else ()
    per_input = manifest.variant_sizes(variant) if variant else tuple(() for _ in manifest.executable_inputs)
    for index, (tensor, sizes) in enumerate(zip(manifest.executable_inputs, per_input)):
        expected = tensor.program_shape(key.batch_size, sizes)
        _compare(where, f"parameter {index} (input '{tensor.name}', manifest shape {tensor.shape_string!r})",
                 program.parameters[index], expected, tensor.dtype, manifest_order=tuple(reversed(expected)))
    offset = len(manifest.executable_inputs)
    for index, (name, shape, dtype) in enumerate(weights):
        _compare(where, f"parameter {offset + index} (weight '{name}')", program.parameters[offset + index],
                 shape, dtype, manifest_order=tuple(reversed(shape)), declared_by="the weights file holds",
                 reversed_hint=_LEGACY_WEIGHTS_REVERSED if legacy_weights else _WEIGHTS_REVERSED,
                 other_hint=functools.partial(_order_hint, program.parameters[offset + index], weights, index))
    outputs = manifest.executable_outputs
    if len(program.results) != len(outputs):
        raise ConfigError(f"{where}: the program returns {len(program.results)} result(s) but the manifest "
                          f"declares {len(outputs)} executable output(s) ({', '.join(t.name for t in outputs)})")
    for index, tensor in enumerate(outputs):
        expected = _output_shape(tensor, key.batch_size)
        _compare(where, f"result {index} (output '{tensor.name}', manifest shape {tensor.shape_string!r})",
                 program.results[index], expected, tensor.dtype,
                 manifest_order=tuple(reversed(expected)))


def _output_shape(tensor: ManifestTensor, batch_size: int | None) -> tuple[int, ...]:
    # -1 for a variable axis: its size follows from the variant's input sizes.
    sizes = [d.size if d.kind is DimKind.FIXED else (batch_size if d.kind is DimKind.BATCH else -1)
             for d in tensor.shape]
    return tuple(reversed(sizes))


# A weight's shape is the weights file's, never the manifest's (the config hunt: blamed on the manifest's order).
_LEGACY_WEIGHTS_REVERSED = (" (the shapes are reversed: this weights file's __metadata__ lacks axis_order: xla, so "
                            "it is read in the legacy layout, its shapes column-major; export it again, or migrate "
                            "its weights)")
# (A file in the program's order that holds a weight transposed: the README walkthrough found the legacy hint given
# of one that has axis_order: xla, whose migration does nothing.)
_WEIGHTS_REVERSED = (" (the shapes are reversed: the weights file, in the program's axis order, holds this weight "
                     "transposed; export it again)")
_MANIFEST_REVERSED = (" (the shapes are reversed: manifest shapes are column-major, batch axis last, and the "
                      "program sees them reversed)")


def _order_hint(parameter: ProgramTensor, weights: Sequence[tuple[str, tuple[int, ...], DType]], index: int) -> str:
    """What a weight's refusal adds when another weight of the file is of ``parameter``'s type: the file's weights
    are likely in another order than the program's (the bundle hunt: safetensors' save_file writes them sorted by
    dtype and name, not in its dict's order, and the refusal said nothing of order)."""
    fit = next((name for other, (name, shape, dtype) in enumerate(weights)
                if other != index and shape == parameter.shape and dtype is parameter.dtype), None)
    if fit is None:
        return ""
    return (f" (weight '{fit}' of the file is of that type: the weights go to the program in the order of their "
            f"data in the file, or of its metadata's {ARGUMENT_ORDER_KEY}, a JSON list of their names in the "
            "program's order; safetensors' save_file writes them sorted by dtype and name, so give it "
            f"{ARGUMENT_ORDER_KEY}, or write the file with nereid.backends.xla.export.write_safetensors)")


def _compare(where: str, what: str, actual: ProgramTensor, expected: tuple[int, ...], dtype: DType,
             manifest_order: tuple[int, ...], declared_by: str = "the bundle declares",
             reversed_hint: str = _MANIFEST_REVERSED, other_hint: Callable[[], str] | None = None) -> None:
    # (other_hint is made only for a refusal: made for every weight of every program, it cost 0.8 s a load of 3,000
    # weights; the review.)
    if any(d < 0 for d in actual.shape):
        raise ConfigError(f"{where}: {what} has a dynamic shape {actual.describe()}; bundles need static "
                          "shapes (export one program per size)")
    shape_ok = len(actual.shape) == len(expected) and all(e == -1 or a == e for a, e in zip(actual.shape,
                                                                                            expected))
    if shape_ok and actual.dtype is dtype:
        return
    wanted = ProgramTensor(expected, _element_type(dtype)).describe()
    reversed_shape = not shape_ok and actual.shape == manifest_order and expected != manifest_order
    raise ConfigError(f"{where}: {what} is {actual.describe()} in the program but {declared_by} "
                      f"{wanted}{reversed_hint if reversed_shape else other_hint() if other_hint else ''}")


def _element_type(dtype: DType) -> str:
    return next((name for name, d in ELEMENT_TYPES.items() if d is dtype), token_of(dtype))
