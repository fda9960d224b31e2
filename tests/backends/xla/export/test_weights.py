"""read_bundle_weights: a bundle's weights read back in argument order and program shape, whatever their layout."""

from __future__ import annotations

import numpy as np
import pytest

from nereid.backends.xla.export import IOSpec, examples, read_bundle_weights, write_bundle
from nereid.backends.xla.safetensors import read_header
from nereid.errors import ConfigError

IDENTITY = "func.func @main(%x: tensor<3xf32>) -> tensor<3xf32> { return %x : tensor<3xf32> }"


def as_written(weights: list[tuple[str, np.ndarray]]) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    return [(name, array.dtype.name, array.shape, array.tobytes()) for name, array in weights]


@pytest.mark.parametrize("bundle", ["mlp_bundle", "mlp_legacy", "mlp_sharded"])
def test_every_layout_reads_back_the_exported_arrays_in_argument_order(pristine, bundle) -> None:
    """One file in the program's axis order, the legacy column-major file, or shards and their index: the same
    (name, array) pairs the exporter was given."""
    assert as_written(read_bundle_weights(pristine(bundle))) == as_written(list(examples.mlp_weights().items()))


def test_the_legacy_file_holds_reversed_shapes_yet_reads_back_in_the_program_s_shape(pristine) -> None:
    folder = pristine("mlp_legacy")
    header = read_header(folder / "weights.safetensors")
    w1 = examples.mlp_weights()["w1"]
    assert header.legacy and header.tensors[0].shape == w1.shape[::-1]
    name, array = read_bundle_weights(folder)[0]
    assert name == "w1" and array.shape == w1.shape and np.array_equal(array, w1)


def test_a_bundle_without_weights_reads_back_none(tmp_path) -> None:
    folder = write_bundle(tmp_path / "identity", "identity", [IOSpec("x", "f32", (3,))], [IOSpec("y", "f32", (3,))],
                          IDENTITY, {})
    assert read_bundle_weights(folder) == []  # an empty weights file
    (folder / "weights.safetensors").unlink()
    assert read_bundle_weights(folder) == []  # no weights file at all


def test_a_folder_that_is_no_bundle_is_a_config_error_naming_it(tmp_path) -> None:
    with pytest.raises(ConfigError, match=rf"^{tmp_path}: missing manifest.yaml"):
        read_bundle_weights(tmp_path)
