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
