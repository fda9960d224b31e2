"""write_bundle: the manifest it writes, the layouts, weights in shards, and what it refuses to write."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import safetensors.numpy
import yaml
from jax import export as jax_export

from nereid.backends.xla.manifest import load_manifest
from nereid.backends.xla.safetensors import read_header
from nereid.backends.xla.weights import INDEX_FILE
from nereid.backends.xla.export import ExportError, IOSpec, examples, read_bundle_weights, write_bundle


def affine(x, w, b):
    return x @ w + b


def module(batch: int, fn=affine, n_weights: int = 2) -> bytes:
    structs = [jax.ShapeDtypeStruct((batch, 3), np.float32), jax.ShapeDtypeStruct((3, 2), np.float32),
               jax.ShapeDtypeStruct((2,), np.float32)][:1 + n_weights]
    return jax_export.export(jax.jit(fn, keep_unused=True), platforms=["cpu"])(*structs).mlir_module_serialized


WEIGHTS = {"w": np.arange(6, dtype=np.float32).reshape(3, 2), "b": np.array([1.0, -1.0], np.float32)}
INPUTS = [IOSpec("x", "f32", (3,), batch_axis=0)]
OUTPUTS = [IOSpec("y", "f32", (2,), batch_axis=0)]
# The shards the exporter writes of the MLP's weights at shard_bytes=600 (the conftest's mlp_sharded).
SHARDS = ["weights-00001-of-00003.safetensors", "weights-00002-of-00003.safetensors",
          "weights-00003-of-00003.safetensors"]


def test_writes_a_column_major_manifest(tmp_path) -> None:
    directory = write_bundle(tmp_path / "affine", "affine", INPUTS, OUTPUTS, {1: module(1), 4: module(4)}, WEIGHTS,
                             description="x @ w + b")
    assert sorted(p.name for p in directory.iterdir()) == [
        "manifest.yaml", "model.b1.mlir", "model.b4.mlir", "weights.safetensors"]
    document = yaml.safe_load((directory / "manifest.yaml").read_text())
    assert document["format_version"] == "2.1"
    assert document["executable_inputs"] == [{"name": "x", "dtype": "f32", "shape": "an", "dims": {"a": 3}}]
    assert document["batching"] == {"compiled_batch_sizes": [1, 4]}
    manifest = load_manifest(directory / "manifest.yaml")
    assert manifest.executable_inputs[0].program_shape(4) == (4, 3)
    header = read_header(directory / "weights.safetensors")
    assert header.metadata["axis_order"] == "xla" and [t.name for t in header.tensors] == ["w", "b"]
    assert [(n, a.tolist()) for n, a in read_bundle_weights(directory)] == [
        (n, a.tolist()) for n, a in WEIGHTS.items()]


def test_legacy_layout(tmp_path) -> None:
    directory = write_bundle(tmp_path / "affine", "affine", INPUTS, OUTPUTS, {2: module(2)}, WEIGHTS,
                             layout="legacy")
    assert load_manifest(directory / "manifest.yaml").format_version == "2.0"
    header = read_header(directory / "weights.safetensors")
    assert header.legacy and header.tensors[0].shape == (2, 3)  # the reversed (column-major) shape
    assert (directory / "model.mlir").is_file()  # one batch size: model.mlir
    assert all(np.array_equal(a, WEIGHTS[n]) for n, a in read_bundle_weights(directory))


def test_refuses_a_program_whose_arity_disagrees(tmp_path) -> None:
    target = tmp_path / "affine"
    with pytest.raises(ExportError) as caught:
        write_bundle(target, "affine", INPUTS, OUTPUTS, {1: module(1)}, {"w": WEIGHTS["w"]})
    message = str(caught.value)
    assert "takes 3 argument(s)" in message and "supplies 2" in message and "1 input(s)" in message
    assert not target.exists()  # nothing written
    extra = {**WEIGHTS, "unused": np.zeros(2, np.float32)}
    with pytest.raises(ExportError, match=r"takes 3 argument\(s\).*supplies 4.*keep_unused=True"):
        write_bundle(target, "affine", INPUTS, OUTPUTS, {1: module(1)}, extra)


def test_refuses_types_that_disagree(tmp_path) -> None:
    with pytest.raises(ExportError, match=r"parameter 0 \(input 'x'.*tensor<1x3xf32> in the program but the "
                                          r"bundle declares tensor<1x4xf32>"):
        write_bundle(tmp_path / "affine", "affine", [IOSpec("x", "f32", (4,), batch_axis=0)], OUTPUTS,
                     {1: module(1)}, WEIGHTS)
    with pytest.raises(ExportError, match=r"result 0 \(output 'y'.*declares tensor<1x2xi32>"):
        write_bundle(tmp_path / "affine", "affine", INPUTS, [IOSpec("y", "i32", (2,), batch_axis=0)],
                     {1: module(1)}, WEIGHTS)


def test_identity_and_model_py_rules(tmp_path) -> None:
    with pytest.raises(ExportError, match="must be the model name"):
        write_bundle(tmp_path / "folder", "other", INPUTS, OUTPUTS, {1: module(1)}, WEIGHTS)
    with pytest.raises(ExportError, match="need a model.py"):
        write_bundle(tmp_path / "affine", "affine", INPUTS, OUTPUTS, {1: module(1)}, WEIGHTS,
                     client_outputs=[IOSpec("label", "i64", (), batch_axis=0)])
    directory = write_bundle(tmp_path / "affine", "affine", INPUTS, OUTPUTS, {1: module(1)}, WEIGHTS,
                             client_outputs=[IOSpec("label", "i64", (), batch_axis=0)],
                             model_py="import nereid\nnereid.register_model()\n")
    assert (directory / "model.py").is_file()
    assert load_manifest(directory / "manifest.yaml").client_outputs[0].shape_string == "n"


def test_rewriting_removes_stale_program_files(tmp_path) -> None:
    directory = write_bundle(tmp_path / "affine", "affine", INPUTS, OUTPUTS, {1: module(1), 4: module(4)}, WEIGHTS)
    # (Found by the exporter hunt: files of the bundle's own, not an export's, went too.)
    (directory / "labels.safetensors").write_bytes(b"a hand-written model.py's data")
    (directory / "model_reference.mlir").write_text("a reference kept beside it")
    write_bundle(directory, "affine", INPUTS, OUTPUTS, {2: module(2)}, WEIGHTS)
    assert sorted(p.name for p in directory.glob("model*.mlir")) == ["model.mlir", "model_reference.mlir"]
    assert (directory / "labels.safetensors").is_file()


def test_text_modules_are_stored_as_portable_artifacts(tmp_path) -> None:
    text = """
    func.func @main(%x: tensor<3xf32>, %w: tensor<3xf32>) -> tensor<3xf32> {
      %0 = stablehlo.multiply %x, %w : tensor<3xf32>
      return %0 : tensor<3xf32>
    }
    """
    directory = write_bundle(tmp_path / "mul", "mul", [IOSpec("x", "f32", (3,))], [IOSpec("y", "f32", (3,))],
                             text, {"w": np.ones(3, np.float32)})
    assert (directory / "model.mlir").read_bytes()[:4] == b"ML\xefR"
    with pytest.raises(ExportError, match="not a StableHLO module"):
        write_bundle(tmp_path / "mul", "mul", [IOSpec("x", "f32", (3,))], [IOSpec("y", "f32", (3,))],
                     "not mlir", {"w": np.ones(3, np.float32)})


def snapshot(directory) -> dict[str, bytes]:
    """Every file of a folder (hidden ones too), by name."""
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_a_refused_rewrite_leaves_the_bundle_as_it_was(tmp_path) -> None:
    directory = write_bundle(tmp_path / "affine", "affine", INPUTS, OUTPUTS, {1: module(1), 2: module(2)}, WEIGHTS)
    before = snapshot(directory)
    three = [("a", WEIGHTS["w"]), ("a", WEIGHTS["b"])]
    with pytest.raises(ExportError, match=r"weights: duplicate weight name 'a' \(weights 0 and 1\)"):
        write_bundle(directory, "affine", INPUTS, OUTPUTS, {4: module(4)}, three)
    assert snapshot(directory) == before
    with pytest.raises(ExportError, match=r"model_py: cannot read '.*missing\.py': No such file"):
        write_bundle(directory, "affine", INPUTS, OUTPUTS, {4: module(4)}, WEIGHTS, model_py=tmp_path / "missing.py")
    assert snapshot(directory) == before
    # A str is the source text: a file name given as one was written as the hooks file itself, and a
    # model.py that does not compile made a bundle that bundle check called servable and never loaded.
    with pytest.raises(ExportError, match=r"'hooks/model\.py' looks like a file name.*pathlib\.Path"):
        write_bundle(directory, "affine", INPUTS, OUTPUTS, {4: module(4)}, WEIGHTS, model_py="hooks/model.py")
    broken = tmp_path / "broken.py"
    broken.write_text("import nereid\ndef preprocess(inputs:\n")
    with pytest.raises(ExportError, match=r"model_py: .*broken\.py is not valid Python \(line 2\)"):
        write_bundle(directory, "affine", INPUTS, OUTPUTS, {4: module(4)}, WEIGHTS, model_py=broken)
    assert snapshot(directory) == before
    with pytest.raises(ExportError, match="cannot be written as YAML"):
        write_bundle(directory, "affine", INPUTS, OUTPUTS, {4: module(4)}, WEIGHTS, provenance={"when": object()})
    assert snapshot(directory) == before
    # Nor is a new folder created for a refused bundle.
    with pytest.raises(ExportError, match="duplicate weight name"):
        write_bundle(tmp_path / "fresh", "fresh", INPUTS, OUTPUTS, {4: module(4)}, three)
    assert not (tmp_path / "fresh").exists()


def test_weights_that_fail_to_write_leave_the_bundle_as_it_was(tmp_path, monkeypatch) -> None:
    from nereid.backends.xla.export import writer

    directory = write_bundle(tmp_path / "affine", "affine", INPUTS, OUTPUTS, {1: module(1), 2: module(2)}, WEIGHTS)
    before = snapshot(directory)

    def disk_full(path, tensors, **kwargs) -> None:
        path.write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "write_safetensors", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_bundle(directory, "affine", INPUTS, OUTPUTS, {4: module(4)}, WEIGHTS)
    assert snapshot(directory) == before  # the partial file is gone too


@pytest.mark.parametrize("failing", ["model.b4.mlir", "model.py", "manifest.yaml"])
def test_any_file_that_fails_to_write_leaves_the_bundle_as_it_was(tmp_path, monkeypatch, failing) -> None:
    """Found by the exhaustion hunt: a disk that filled after the weights were written left the earlier export's
    manifest beside the new export's programs and weights (a bundle no load takes), and the weights' temporary
    file filling the disk."""
    from nereid.backends.xla.export import writer

    directory = write_bundle(tmp_path / "affine", "affine", INPUTS, OUTPUTS, {1: module(1), 2: module(2)}, WEIGHTS)
    before = snapshot(directory)
    real = writer.staged_write

    def disk_full(path, parts, **kwargs):
        if path.name == failing:
            raise OSError(28, "No space left on device")
        return real(path, parts, **kwargs)

    monkeypatch.setattr(writer, "staged_write", disk_full)
    other = {name: array + 1 for name, array in WEIGHTS.items()}
    with pytest.raises(OSError, match="No space left"):
        write_bundle(directory, "affine", INPUTS, OUTPUTS, {1: module(1), 4: module(4)}, other,
                     model_py="def preprocess(inputs):\n    return inputs\n")
    assert snapshot(directory) == before


def test_a_weight_named_metadata_is_refused(tmp_path) -> None:
    weights = {"__metadata__": WEIGHTS["w"], "b": WEIGHTS["b"]}
    with pytest.raises(ExportError, match=r"weights: weight 0 is named '__metadata__', the key safetensors reserves"):
        write_bundle(tmp_path / "affine", "affine", INPUTS, OUTPUTS, {1: module(1)}, weights)
    assert not (tmp_path / "affine").exists()


def test_batch_size_mistakes_are_refused(tmp_path) -> None:
    target = tmp_path / "affine"
    with pytest.raises(ExportError, match=r"batch_sizes lists 1 more than once: \[1, 1\]"):
        write_bundle(target, "affine", INPUTS, OUTPUTS, {1: module(1)}, WEIGHTS, batch_sizes=[1, 1])
    with pytest.raises(ExportError, match="batch_sizes is empty"):
        write_bundle(target, "affine", INPUTS, OUTPUTS, module(1), WEIGHTS, batch_sizes=[])
    with pytest.raises(ExportError, match=r"modules: batch sizes must be positive integers, got 1.5"):
        write_bundle(target, "affine", INPUTS, OUTPUTS, {1.5: module(1)}, WEIGHTS)
    with pytest.raises(ExportError, match=r"modules: batch sizes must be positive integers, got 0"):
        write_bundle(target, "affine", INPUTS, OUTPUTS, {0: module(1)}, WEIGHTS)
    assert not target.exists()


@pytest.mark.parametrize("weights, problem", [
    # A 2-element array used to unpack as a pair: a scalar weight named '0.0'.
    ([np.array([0.0, 1.0], np.float32)], "got a list whose item 0 is a float32 array of shape (2,)"),
    ([WEIGHTS["w"], WEIGHTS["b"]], "got a list whose item 0 is a float32 array of shape (3, 2)"),
    (WEIGHTS["w"], "got a float32 array of shape (3, 2)"),
    ([("w", WEIGHTS["w"], "extra")], "got a list whose item 0 is tuple ('w', array("),
    ("wb", "got str 'wb'"),
    ([(0, WEIGHTS["w"])], "weights: weight 0's name must be a string, got int 0"),
])
def test_weights_in_another_form_are_refused(tmp_path, weights, problem) -> None:
    with pytest.raises(ExportError) as caught:
        write_bundle(tmp_path / "affine", "affine", INPUTS, OUTPUTS, {1: module(1)}, weights)
    message = str(caught.value)
    assert problem in message
    if "name must be a string" not in problem:
        assert message.startswith("weights must be a mapping of names to arrays or a list of (name, array) pairs; ")
    assert not (tmp_path / "affine").exists()


def test_weights_as_pairs_from_any_iterable(tmp_path) -> None:
    directory = write_bundle(tmp_path / "affine", "affine", INPUTS, OUTPUTS, {1: module(1)},
                             ((name, array) for name, array in WEIGHTS.items()))
    assert [n for n, _ in read_bundle_weights(directory)] == ["w", "b"]
    directory = write_bundle(tmp_path / "affine", "affine", INPUTS, OUTPUTS, {1: module(1)},
                             [["w", WEIGHTS["w"]], ["b", WEIGHTS["b"]]])
    assert [n for n, _ in read_bundle_weights(directory)] == ["w", "b"]


@pytest.mark.parametrize("value, problem", [
    ("relu", "weights: weight 1 ('b') is str 'relu', not an array"),
    (None, "weights: weight 1 ('b') is None, not an array"),
    ({"w": WEIGHTS["b"]}, "weights: weight 1 ('b') is a nested dict (keys 'w'), not an array: flatten nested "
                          "parameters to one dotted name per array (e.g. 'b.w', from "
                          "jax.tree_util.tree_flatten_with_path)"),
    (np.array(["relu", "gelu"]), "weights: weight 1 ('b') has dtype <U4, which nereid does not support "
                                 "(supported: bool, uint8,"),
    (WEIGHTS["b"].astype(np.complex64), "weights: weight 1 ('b') has dtype complex64, which nereid does not "
                                        "support (supported: bool, uint8,"),
])
def test_weights_that_are_not_arrays_of_a_known_dtype_are_refused_by_name(tmp_path, value, problem) -> None:
    """A str weight gave "ValueError: not a datatype nereid knows: dtype('<U4')", naming no weight."""
    with pytest.raises(ExportError) as caught:
        write_bundle(tmp_path / "affine", "affine", INPUTS, OUTPUTS, {1: module(1)}, {"w": WEIGHTS["w"], "b": value})
    assert str(caught.value).startswith(problem), caught.value
    assert not (tmp_path / "affine").exists()


def test_the_exporter_writes_shards_and_an_index(sharded) -> None:
    assert sorted(p.name for p in sharded.glob("*.safetensors")) == SHARDS
    assert not (sharded / "weights.safetensors").exists()
    index = json.loads((sharded / INDEX_FILE).read_text())
    assert index["weight_map"] == {"w1": SHARDS[0], "b1": SHARDS[1], "w2": SHARDS[1], "b2": SHARDS[2]}
    assert index["metadata"] == {"total_size": 2048 + 128 + 512 + 16, "argument_order": ["w1", "b1", "w2", "b2"]}
    # Each shard is a plain safetensors file the reference library reads.
    merged = {}
    for shard in SHARDS:
        merged.update(safetensors.numpy.load_file(str(sharded / shard)))
    assert {n: a.tobytes() for n, a in merged.items()} == {n: a.tobytes() for n, a in examples.mlp_weights().items()}
    assert [n for n, _ in read_bundle_weights(sharded)] == ["w1", "b1", "w2", "b2"]


def test_re_exporting_removes_the_other_form(sharded) -> None:
    """Shards over a single file, and back: no stale weights are left to be read."""
    examples_weights = examples.mlp_weights()
    from nereid.backends.xla.export import export_bundle

    export_bundle(examples.mlp, [np.zeros((1, 16), np.float32)], examples_weights, directory=sharded,
                  batch_sizes=(1, 8), input_names=["input"], output_names=["output"], provenance=False)
    assert sorted(p.name for p in sharded.glob("*.safetensors")) == ["weights.safetensors"]
    assert not (sharded / INDEX_FILE).exists()
