"""check_program_types: each parameter and result of a program against the manifest and the weights file, the
first disagreement named with its position, its tensor and both types (and a hint when the shape is reversed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereid.backends.xla.bundle import ProgramKey
from nereid.backends.xla.conformance import check_program_types
from nereid.backends.xla.manifest import Manifest, load_manifest
from nereid.backends.xla.program import ProgramSignature, read_program
from nereid.dtypes import DType
from nereid.errors import ConfigError

# x [n, 3] and a weight w [3, 2] in, y [n, 2] out, compiled at batch size 4.
MANIFEST = """format_version: "2.1"
executable_inputs:
  - {name: x, dtype: f32, shape: an, dims: {a: 3}}
executable_outputs:
  - {name: y, dtype: f32, shape: an, dims: {a: 2}}
batching: {compiled_batch_sizes: [4]}
"""
# The same with x's row length variable, compiled at 4 and 8 (variants 1 and 2), and y's too.
VARIANTS = MANIFEST.replace("dims: {a: 3}", "dims: {a: -1}").replace("dims: {a: 2}", "dims: {a: -1}") + \
    "input_shapes: [[4], [8]]\n"
WEIGHTS = [("w", (3, 2), DType.FP32)]
B4 = ProgramKey(None, 4)
WHERE = "model.b4.mlir"


def manifest(tmp_path: Path, text: str = MANIFEST) -> Manifest:
    (tmp_path / "manifest.yaml").write_text(text)
    return load_manifest(tmp_path / "manifest.yaml")


def program(x: str, w: str | None = "tensor<3x2xf32>", results: tuple[str, ...] = ("tensor<4x2xf32>",)
            ) -> ProgramSignature:
    """A program of these parameter and result types (its results are constants: only the types matter)."""
    parameters = ", ".join(f"%arg{i}: {t}" for i, t in enumerate(t for t in (x, w) if t is not None))
    constants = "\n".join(f"  %r{i} = stablehlo.constant dense<{'0.0' if 'xf' in t else '0'}> : {t}"
                          for i, t in enumerate(results))
    returned = ", ".join(f"%r{i}" for i in range(len(results)))
    types = ", ".join(results)
    text = f"func.func @main({parameters}) -> ({types}) {{\n{constants}\n  return {returned} : {types}\n}}"
    return read_program(text, WHERE)


def refusal(tmp_path: Path, signature: ProgramSignature, weights=WEIGHTS, legacy_weights: bool = False,
            key: ProgramKey = B4, text: str = MANIFEST) -> str:
    with pytest.raises(ConfigError) as caught:
        check_program_types(WHERE, signature, key, manifest(tmp_path, text), weights, legacy_weights)
    return str(caught.value)


def test_a_program_that_conforms_passes(tmp_path) -> None:
    assert check_program_types(WHERE, program("tensor<4x3xf32>"), B4, manifest(tmp_path), WEIGHTS) is None


def test_an_input_of_another_size_names_the_parameter_the_input_and_both_types(tmp_path) -> None:
    assert refusal(tmp_path, program("tensor<4x5xf32>")) == (
        "model.b4.mlir: parameter 0 (input 'x', manifest shape 'an') is tensor<4x5xf32> in the program but the "
        "bundle declares tensor<4x3xf32>")


def test_an_input_the_manifest_wrote_row_major_gets_the_column_major_hint(tmp_path) -> None:
    assert refusal(tmp_path, program("tensor<3x4xf32>")).endswith(
        "is tensor<3x4xf32> in the program but the bundle declares tensor<4x3xf32> (the shapes are reversed: "
        "manifest shapes are column-major, batch axis last, and the program sees them reversed)")


def test_a_weight_of_another_dtype_is_the_weights_file_s_not_the_manifest_s(tmp_path) -> None:
    assert refusal(tmp_path, program("tensor<4x3xf32>", "tensor<3x2xf16>")) == (
        "model.b4.mlir: parameter 1 (weight 'w') is tensor<3x2xf16> in the program but the weights file holds "
        "tensor<3x2xf32>")


@pytest.mark.parametrize("legacy_weights, hint", [
    (False, "the weights file, in the program's axis order, holds this weight transposed; export it again"),
    (True, "this weights file's __metadata__ lacks axis_order: xla, so it is read in the legacy layout, its shapes "
           "column-major; export it again, or migrate its weights"),
])
def test_a_transposed_weight_gets_the_hint_of_its_file_s_layout(tmp_path, legacy_weights, hint) -> None:
    assert refusal(tmp_path, program("tensor<4x3xf32>", "tensor<2x3xf32>"), legacy_weights=legacy_weights) == (
        "model.b4.mlir: parameter 1 (weight 'w') is tensor<2x3xf32> in the program but the weights file holds "
        f"tensor<3x2xf32> (the shapes are reversed: {hint})")


def test_a_result_count_or_type_that_differs_is_named(tmp_path) -> None:
    assert refusal(tmp_path, program("tensor<4x3xf32>", results=("tensor<4x2xf32>", "tensor<i32>"))) == (
        "model.b4.mlir: the program returns 2 result(s) but the manifest declares 1 executable output(s) (y)")
    assert refusal(tmp_path, program("tensor<4x3xf32>", results=("tensor<4x2xi32>",))) == (
        "model.b4.mlir: result 0 (output 'y', manifest shape 'an') is tensor<4x2xi32> in the program but the bundle "
        "declares tensor<4x2xf32>")


def test_a_dynamic_shape_is_refused_asking_for_one_program_per_size(tmp_path) -> None:
    assert refusal(tmp_path, program("tensor<?x3xf32>")) == (
        "model.b4.mlir: parameter 0 (input 'x', manifest shape 'an') has a dynamic shape tensor<?x3xf32>; bundles "
        "need static shapes (export one program per size)")


def test_a_variant_s_program_is_checked_at_that_variant_s_sizes_its_variable_outputs_at_any(tmp_path) -> None:
    variants = manifest(tmp_path, VARIANTS)
    second = ProgramKey(2, 4)
    assert check_program_types(WHERE, program("tensor<4x8xf32>", None, ("tensor<4x8xf32>",)), second, variants,
                               []) is None
    assert check_program_types(WHERE, program("tensor<4x4xf32>", None, ("tensor<4x4xf32>",)), ProgramKey(1, 4),
                               variants, []) is None
    assert refusal(tmp_path, program("tensor<4x4xf32>", None, ("tensor<4x4xf32>",)), [], key=second,
                   text=VARIANTS).endswith("is tensor<4x4xf32> in the program but the bundle declares tensor<4x8xf32>")
