"""The bundle directory: program files per batch size and variant, the weights file, files that are not files."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from nereid.backend import ModelContext
from nereid.backends.xla.arity import check_bundle
from nereid.backends.xla.bundle import ProgramKey, open_bundle
from nereid.backends.xla.model import XlaModel
from nereid.backends.xla.safetensors import load_weights, write_safetensors
from nereid.errors import ConfigError
from nereid.settings import ModelSettings
from nereid.tensors import NamedTensor


def test_program_files_per_batch_size(tmp_path, add_bundle) -> None:
    layout = open_bundle(add_bundle(tmp_path, "mlp_bundle"))
    assert {k: p.name for k, p in layout.modules.items()} == {
        ProgramKey(None, 1): "model.b1.mlir", ProgramKey(None, 8): "model.b8.mlir",
        ProgramKey(None, 32): "model.b32.mlir"}
    assert layout.weights_path.name == "weights.safetensors" and layout.model_py is None
    largest = open_bundle(layout.folder, largest_only=True)
    assert list(largest.modules) == [ProgramKey(None, 32)] and largest.batch_sizes == (32,)


def test_variant_files(tmp_path, add_bundle) -> None:
    layout = open_bundle(add_bundle(tmp_path, "variants"))
    assert sorted(p.name for p in layout.modules.values()) == [
        "model.v1.b1.mlir", "model.v1.b2.mlir", "model.v2.b1.mlir", "model.v2.b2.mlir"]


def test_missing_program_file_is_named(tmp_path, add_bundle) -> None:
    folder = add_bundle(tmp_path, "mlp_bundle")
    (folder / "model.b8.mlir").unlink()
    with pytest.raises(ConfigError, match=r"missing model.b8.mlir, the program for batch size 8 "
                                          r"\(program files present: model.b1.mlir, model.b32.mlir\)"):
        open_bundle(folder)
    assert open_bundle(folder, largest_only=True).batch_sizes == (32,)  # only the largest is needed then


def test_single_size_may_use_model_mlir(tmp_path, add_bundle) -> None:
    folder = add_bundle(tmp_path, "mlp_bundle")
    manifest = folder / "manifest.yaml"
    manifest.write_text(manifest.read_text().replace("[1, 8, 32]", "[8]"))
    (folder / "model.b8.mlir").rename(folder / "model.mlir")
    assert open_bundle(folder).modules == {ProgramKey(None, 8): folder / "model.mlir"}


def test_weights_file_key(tmp_path, add_bundle) -> None:
    folder = add_bundle(tmp_path, "mlp_bundle")
    shutil.move(folder / "weights.safetensors", folder / "weights.T.safetensors")
    manifest = folder / "manifest.yaml"
    assert open_bundle(folder).weights_path is None  # no weights: the arity check will say so
    manifest.write_text(manifest.read_text() + "weights_file: weights.T.safetensors\n")
    assert open_bundle(folder).weights_path == folder / "weights.T.safetensors"
    manifest.write_text(manifest.read_text().replace("weights.T.safetensors", "other.safetensors"))
    with pytest.raises(ConfigError, match=r"manifest.yaml: weights_file: no such file .*got 'other.safetensors'"):
        open_bundle(folder)


def test_a_weights_file_in_a_sub_folder_is_the_one_served(tmp_path, add_bundle) -> None:
    """Found by a bug hunt: ``weights_file: v2/weights.safetensors`` served the top-level weights.safetensors (the
    other version's weights, without a word), and without one failed naming a path nobody wrote."""
    folder = add_bundle(tmp_path, "mlp_bundle")
    (folder / "v2").mkdir()
    weights = load_weights(folder / "weights.safetensors")
    write_safetensors(folder / "v2" / "weights.safetensors", [(name, np.zeros_like(array)) for name, array in weights])
    manifest = folder / "manifest.yaml"
    manifest.write_text(manifest.read_text() + "weights_file: v2/weights.safetensors\n")
    x = np.random.default_rng(3).standard_normal((2, 16)).astype(np.float32)
    for top_level in (True, False):
        if not top_level:
            (folder / "weights.safetensors").unlink()
        model = XlaModel(ModelContext("mlp", folder, ModelSettings("mlp"), tmp_path, "t"))
        model.load()
        try:
            assert model.infer([NamedTensor.from_array("input", x)])[0].data.tolist() == [[0.0] * 4] * 2
        finally:
            model.unload()
        report, problem = check_bundle(folder)  # the check reads the same file (it failed without the other)
        assert report.servable and problem is None, report.line()


def test_a_model_py_or_program_that_is_not_a_file_is_named(tmp_path, add_bundle) -> None:
    """A folder named model.py was skipped (served without hooks); a FIFO model.b8.mlir fell back to model.mlir."""
    folder = add_bundle(tmp_path, "mlp_bundle")
    (folder / "model.py").mkdir()
    with pytest.raises(ConfigError) as info:
        open_bundle(folder)
    assert str(info.value) == (f"{folder / 'model.py'}: is a directory, not a regular file "
                               "(a bundle's model.py holds its hooks)")
    (folder / "model.py").rmdir()
    manifest = folder / "manifest.yaml"
    manifest.write_text(manifest.read_text().replace("[1, 8, 32]", "[8]"))
    shutil.copy(folder / "model.b8.mlir", folder / "model.mlir")
    (folder / "model.b8.mlir").unlink()
    os.mkfifo(folder / "model.b8.mlir")
    with pytest.raises(ConfigError) as info:
        open_bundle(folder)
    assert str(info.value) == (f"{folder / 'model.b8.mlir'}: is a FIFO, not a regular file "
                               "(the program for batch size 8)")
