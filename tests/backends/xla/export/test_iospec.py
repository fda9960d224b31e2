"""IOSpec and as_dtype: a tensor as the exporter describes it (row-major), and its manifest entry (column-major)."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from nereid.backends.xla.export.iospec import IOSpec, as_dtype
from nereid.backends.xla.manifest import load_manifest
from nereid.dtypes import DType


def test_letters_and_explicit_batch_axis() -> None:
    spec = IOSpec("image", "f32", (224, 224, 3), batch_axis=0, letters="hwc")
    assert spec.manifest_entry() == {"name": "image", "dtype": "f32", "shape": "cwhn",
                                     "dims": {"c": 3, "w": 224, "h": 224}}
    assert IOSpec("t", "i64", (5,), batch_axis=1).manifest_entry()["shape"] == "na"
    with pytest.raises(ValueError, match="batch markers"):
        IOSpec("bad", "f32", (3,), letters="n")


def test_default_letters_start_at_the_innermost_axis_and_a_variable_axis_keeps_its_minus_one() -> None:
    assert IOSpec("image", "f32", (224, 224, 3), batch_axis=0).manifest_entry() == {
        "name": "image", "dtype": "f32", "shape": "acdn", "dims": {"a": 3, "c": 224, "d": 224}}
    assert IOSpec("tokens", "i32", (-1, 4)).manifest_entry() == {
        "name": "tokens", "dtype": "i32", "shape": "ac", "dims": {"a": 4, "c": -1}}


@pytest.mark.parametrize("batch_axis, expected", [(None, (2, 3)), (0, (5, 2, 3)), (1, (2, 5, 3)), (2, (2, 3, 5))])
def test_program_shape_puts_the_batch_where_batch_axis_says(batch_axis, expected) -> None:
    spec = IOSpec("x", "f32", (2, 3), batch_axis=batch_axis)
    assert spec.program_shape(5 if batch_axis is not None else None) == expected


def test_a_batched_spec_needs_a_batch_size() -> None:
    with pytest.raises(ValueError, match=r"^IOSpec 'x' is batched: give a batch size$"):
        IOSpec("x", "f32", (3,), batch_axis=0).program_shape(None)


@pytest.mark.parametrize("batch_axis", [0, 1, 2])
def test_the_manifest_entry_reads_back_as_the_same_program_shape(tmp_path, batch_axis) -> None:
    """What the exporter writes is what the server reads: the column-major entry, loaded, gives the spec's
    row-major program shape at every batch size."""
    spec = IOSpec("x", "u8", (6, 7), batch_axis=batch_axis)
    document = {"format_version": "2.1", "executable_inputs": [spec.manifest_entry()],
                "executable_outputs": [IOSpec("y", "f32", (), batch_axis=0).manifest_entry()],
                "batching": {"compiled_batch_sizes": [1, 4]}}
    (tmp_path / "manifest.yaml").write_text(yaml.safe_dump(document))
    (tensor,) = load_manifest(tmp_path / "manifest.yaml").executable_inputs
    assert tensor.dtype is DType.UINT8 and tensor.row_major_batch_axis == batch_axis
    for size in (1, 4):
        assert tensor.program_shape(size) == spec.program_shape(size)


@pytest.mark.parametrize("arguments, problem", [
    (("", "f32", (1,)), "IOSpec needs a name"),
    (("a", "f32", (0,)), "IOSpec 'a': sizes must be positive or -1 (variable), got (0,)"),
    (("a", "f32", (-2,)), "IOSpec 'a': sizes must be positive or -1 (variable), got (-2,)"),
    (("a", "f32", (3,), 2), "IOSpec 'a': batch_axis 2 is outside 0..1"),
    (("a", "f32", (3,), -1), "IOSpec 'a': batch_axis -1 is outside 0..1"),
    (("a", "f32", (3, 4), None, "a"), "IOSpec 'a': letters 'a' must name each of the 2 non-batch axes"),
    (("a", "f32", (3, 4), None, "aa"), "IOSpec 'a': letters 'aa' must be distinct ASCII letters other than the "
                                       "batch markers n and b"),
    (("a", "f32", (3, 4), None, "a1"), "IOSpec 'a': letters 'a1' must be distinct ASCII letters other than the "
                                       "batch markers n and b"),
    (("a", "complex", (3,)), "not a datatype nereid knows: 'complex'"),
], ids=["no-name", "zero-size", "below-minus-one", "batch-axis-past-the-end", "negative-batch-axis",
        "too-few-letters", "repeated-letter", "not-a-letter", "unknown-dtype"])
def test_each_mistake_is_a_value_error_naming_the_spec(arguments, problem) -> None:
    with pytest.raises(ValueError) as caught:
        IOSpec(*arguments)
    assert str(caught.value) == problem


@pytest.mark.parametrize("value, expected", [
    (DType.BF16, DType.BF16), ("f32", DType.FP32), ("bf16", DType.BF16), ("FP32", DType.FP32),
    ("BYTES", DType.BYTES), (np.int64, DType.INT64), (np.dtype("bool"), DType.BOOL), ("uint16", DType.UINT16),
])
def test_as_dtype_takes_a_dtype_a_manifest_token_a_kserve_name_or_a_numpy_dtype(value, expected) -> None:
    assert as_dtype(value) is expected
    assert IOSpec("x", value, (1,)).dtype is expected


def test_as_dtype_refuses_what_nereid_cannot_hold_naming_it() -> None:
    for value in ("float128x", np.complex64, object()):
        with pytest.raises(ValueError, match=r"^not a datatype nereid knows: "):
            as_dtype(value)
