"""XlaModel called directly (no server): padding to compiled sizes, and the PadsBatches capability."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nereid.backend import ModelContext, PadsBatches
from nereid.settings import ModelSettings
from nereid.tensors import NamedTensor

from nereid.backends.xla.model import XlaModel


def load(folder: Path, tmp_path: Path) -> XlaModel:
    model = XlaModel(ModelContext(folder.name, folder, ModelSettings(folder.name), tmp_path, "test"))
    model.load()
    return model


def test_padded_rows_name_the_compiled_size_and_a_prepadded_batch_gives_the_same_rows(tmp_path, add_bundle) -> None:
    model = load(add_bundle(tmp_path, "mlp_bundle"), tmp_path)  # compiled for 1, 8 and 32 rows
    try:
        assert isinstance(model, PadsBatches)
        assert [model.padded_rows(rows) for rows in (1, 2, 8, 9, 32, 33)] == [1, 8, 8, 32, 32, 33]
        x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
        padded = np.zeros((8, 16), np.float32)
        padded[:5] = x
        own = model.infer([NamedTensor.from_array("input", x)])[0].data  # the model pads it itself
        given = model.infer([NamedTensor.from_array("input", padded)])[0].data
        assert own.shape == (5, 4) and given.shape == (8, 4)
        np.testing.assert_array_equal(own, given[:5])
    finally:
        model.unload()


def _image_sums(img, w):
    import jax.numpy as jnp

    return jnp.sum(img * w, axis=(1, 2))


def test_a_shape_no_variant_fits_is_named_row_major_with_the_tensor(tmp_path) -> None:
    """The message listed the variable axes in manifest (column-major) order and named no tensor: a client that
    sent H=6, W=4 read that it sent [4, 6] and that [6, 4] was compiled."""
    import jax
    import pytest
    from jax import export as jax_export

    from nereid.backends.xla.export import IOSpec, write_bundle
    from nereid.errors import InvalidArgument

    variants_hw = [(4, 6), (8, 2)]  # (H, W), row-major; input_shapes lists them in manifest order (W, H)
    modules = [{1: jax_export.export(jax.jit(_image_sums, keep_unused=True), platforms=["cpu"])(
        jax.ShapeDtypeStruct((1, h, w, 3), np.float32), jax.ShapeDtypeStruct((3,), np.float32)).mlir_module_serialized}
        for h, w in variants_hw]
    folder = write_bundle(tmp_path / "img", "img", [IOSpec("img", "f32", (-1, -1, 3), batch_axis=0, letters="hwc")],
                          [IOSpec("s", "f32", (3,), batch_axis=0)], modules, {"w": np.ones(3, np.float32)},
                          batch_sizes=[1], input_shapes=[[w, h] for h, w in variants_hw])
    model = load(folder, tmp_path)
    try:
        assert model.infer([NamedTensor.from_array("img", np.ones((1, 4, 6, 3), np.float32))])[0].data.shape == (1, 3)
        with pytest.raises(InvalidArgument) as caught:
            model.infer([NamedTensor.from_array("img", np.ones((1, 6, 4, 3), np.float32))])
        assert str(caught.value) == ("model 'img': input 'img' has shape [1, 6, 4, 3]; the bundle is compiled for "
                                     "[-1, 4, 6, 3], [-1, 8, 2, 3] (input_shapes in manifest.yaml)")
    finally:
        model.unload()
