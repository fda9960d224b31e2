"""Sharded weights in a local bundle (weights.py): the index's weight map, the fallback rules, reads that hold
the files they resolved."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from nereid.backend import ModelContext
from nereid.backends.xla.model import create_model
from nereid.backends.xla.safetensors import write_safetensors
from nereid.backends.xla.weights import INDEX_FILE, LocalBundleFiles, read_local_weights, resolve_weights
from nereid.errors import ConfigError
from nereid.backends.xla.export import bundle_arity_report, examples, read_bundle_weights
from nereid.settings import ModelSettings
from nereid.tensors import NamedTensor
from nereid.dtypes import DType

SHARDS = ["weights-00001-of-00003.safetensors", "weights-00002-of-00003.safetensors",
          "weights-00003-of-00003.safetensors"]


def _serve_once(folder: Path, rows: int = 3) -> np.ndarray:
    model = create_model(ModelContext(folder.name, folder, ModelSettings(folder.name), folder.parent))
    model.load()
    try:
        x = np.random.default_rng(rows).standard_normal((rows, 16)).astype(np.float32)
        (out,) = model.infer([NamedTensor("input", DType.FP32, x)])
        return x, out.data
    finally:
        model.unload()


def test_a_sharded_bundle_serves_exactly_as_the_single_file_one(sharded) -> None:
    import jax

    x, served = _serve_once(sharded)
    expected = np.asarray(jax.jit(examples.mlp)(x, *examples.mlp_weights().values()))
    np.testing.assert_allclose(served, expected, rtol=1e-6, atol=1e-6)


def test_a_tensor_the_map_names_but_its_file_lacks_fails_naming_both(sharded) -> None:
    index = json.loads((sharded / INDEX_FILE).read_text())
    index["weight_map"]["b2"] = SHARDS[0]
    (sharded / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ConfigError) as caught:
        resolve_weights(LocalBundleFiles(sharded))
    assert str(caught.value) == (f"{sharded / SHARDS[0]}: has no tensor 'b2', which {INDEX_FILE} places in it "
                                 "(the file holds 1 tensor(s))")
    report = bundle_arity_report(sharded)
    assert not report.servable and "has no tensor 'b2'" in report.error
    with pytest.raises(ConfigError, match="has no tensor 'b2'"):
        _serve_once(sharded)


def test_a_shard_the_map_names_that_is_not_there_fails(sharded) -> None:
    (sharded / SHARDS[2]).unlink()
    with pytest.raises(ConfigError, match=rf"weight_map: tensor 'b2' is in '{SHARDS[2]}', which is not a file"):
        resolve_weights(LocalBundleFiles(sharded))


@pytest.mark.parametrize("with_index", [True, False])
@pytest.mark.parametrize("kind", ["FIFO", "directory"])
def test_a_folder_or_fifo_where_a_shard_should_be_is_named_as_such(sharded, with_index: bool, kind: str) -> None:
    """Found by the config hunt: a FIFO or folder in a shard's place was said to be "not a file of the bundle" with
    an index, and skipped without a word without one (then the program's argument count failed, with a hint
    about captured constants)."""
    import os
    (sharded / SHARDS[2]).unlink()
    os.mkfifo(sharded / SHARDS[2]) if kind == "FIFO" else (sharded / SHARDS[2]).mkdir()
    if not with_index:
        (sharded / INDEX_FILE).unlink()
    with pytest.raises(ConfigError, match=rf"{SHARDS[2]}: is a {kind}, not a regular file"):
        resolve_weights(LocalBundleFiles(sharded))


@pytest.mark.parametrize("index_text", ["{not json", '{"metadata": {}}', "\xff"],
                         ids=["undecodable", "no weight_map", "not UTF-8"])
def test_an_undecodable_index_falls_back_to_the_files_in_name_order(sharded, caplog, index_text) -> None:
    (sharded / INDEX_FILE).write_bytes(index_text.encode("latin-1"))
    with caplog.at_level(logging.WARNING):
        weight_set = resolve_weights(LocalBundleFiles(sharded))
    assert [w.entry.name for w in weight_set.weights] == ["w1", "b1", "w2", "b2"]
    assert weight_set.files == tuple(SHARDS) and weight_set.index is None
    assert "reading every *.safetensors file in name order instead" in caplog.text
    _serve_once(sharded)


def test_without_an_index_the_first_occurrence_of_a_name_wins(sharded) -> None:
    (sharded / INDEX_FILE).unlink()
    weights = examples.mlp_weights()
    # A later file repeating b2 with other values: the first occurrence (in the third shard) is kept.
    write_safetensors(sharded / "weights-00004-extra.safetensors", [("b2", weights["b2"] * 100)])
    weight_set = resolve_weights(LocalBundleFiles(sharded))
    assert [w.entry.name for w in weight_set.weights] == ["w1", "b1", "w2", "b2"]
    assert weight_set.weights[-1].file == SHARDS[2]
    loaded = dict(read_bundle_weights(sharded))
    assert loaded["b2"].tobytes() == weights["b2"].tobytes()


def test_the_index_argument_order_decides_the_program_order(sharded) -> None:
    index = json.loads((sharded / INDEX_FILE).read_text())
    index["metadata"]["argument_order"] = ["b2", "w1", "b1", "w2"]
    (sharded / INDEX_FILE).write_text(json.dumps(index))
    assert [w.entry.name for w in resolve_weights(LocalBundleFiles(sharded)).weights] == ["b2", "w1", "b1", "w2"]
    # The program takes w1 first: a wrong order is caught before serving, naming the tensor.
    with pytest.raises(ConfigError, match="b2"):
        _serve_once(sharded)
    index["metadata"]["argument_order"] = ["w1", "b1", "w2"]
    (sharded / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"metadata.argument_order: must name every tensor .* omitted: \['b2'\]"):
        resolve_weights(LocalBundleFiles(sharded))
    # Found by a bug hunt: as a JSON string nested past the parser's depth, a RecursionError naming nothing.
    index["metadata"]["argument_order"] = "[" * 100_000 + "]" * 100_000
    (sharded / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"index.json: metadata.argument_order: must be a list of tensor names"):
        resolve_weights(LocalBundleFiles(sharded))


def test_shards_must_share_one_layout(sharded) -> None:
    weights = examples.mlp_weights()
    write_safetensors(sharded / SHARDS[2], [("b2", weights["b2"])], legacy=True)
    with pytest.raises(ConfigError, match="the weight files mix layouts"):
        resolve_weights(LocalBundleFiles(sharded))


def test_a_single_weights_file_still_wins_over_stray_files_without_an_index(tmp_path) -> None:
    bundle = examples.write_mlp(tmp_path, provenance=False)
    write_safetensors(bundle / "a-stray.safetensors", [("zz", np.zeros(1, np.float32))])
    weight_set = resolve_weights(LocalBundleFiles(bundle))
    assert weight_set.files == ("weights.safetensors",) and weight_set.describe() == "weights.safetensors"


def _replace_atomically(path: Path, tensors: list[tuple[str, np.ndarray]]) -> None:
    """Write another file over ``path`` as a deploy (or a migration) does: a temporary name, then one rename.
    Its longer header moves every tensor's data to other offsets."""
    temporary = path.with_name(f".{path.name}.deploy")
    write_safetensors(temporary, tensors, metadata={"note": "redeployed " * 40})
    os.replace(temporary, path)


def _descriptors_into(folder: Path) -> list[str]:
    """What this process's open descriptors lead to inside ``folder`` (a replaced file: its old path, deleted)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # (the listing's own descriptor, closed by now)
            continue
        if target.startswith(str(folder)):
            found.append(target)
    return found


def test_a_weights_file_replaced_after_its_header_was_read_is_read_whole_as_it_was(tmp_path) -> None:
    """Found by the replicas hunt: the header was read through one open of the file and the data through
    another, so a file replaced between the two (a migration's replace on another server, an atomic redeploy)
    had the old header's offsets applied to the new bytes: garbage weights, served 200 OK."""
    bundle = examples.write_mlp(tmp_path, provenance=False)
    weights = examples.mlp_weights()
    weight_set = resolve_weights(LocalBundleFiles(bundle))
    _replace_atomically(bundle / "weights.safetensors", [(n, a * 7 + 1) for n, a in weights.items()])
    loaded = read_bundle_weights_of(bundle, weight_set)
    assert {n: a.tobytes() for n, a in loaded} == {n: a.tobytes() for n, a in weights.items()}
    assert _descriptors_into(bundle) == []  # the old file, unlinked, was held only until its data was read
    # The next load reads the new file, whole.
    assert {n: a.tobytes() for n, a in read_bundle_weights(bundle)} == {
        n: (a * 7 + 1).tobytes() for n, a in weights.items()}


def test_shards_replaced_after_their_headers_were_read_are_each_read_whole_as_they_were(sharded) -> None:
    weights = examples.mlp_weights()
    weight_set = resolve_weights(LocalBundleFiles(sharded))
    for shard in SHARDS:
        names = [w.entry.name for w in weight_set.weights if w.file == shard]
        _replace_atomically(sharded / shard, [(n, weights[n] - 5) for n in names])
    loaded = read_bundle_weights_of(sharded, weight_set)
    assert [n for n, _ in loaded] == ["w1", "b1", "w2", "b2"]
    assert {n: a.tobytes() for n, a in loaded} == {n: a.tobytes() for n, a in weights.items()}
    assert _descriptors_into(sharded) == []


def test_a_resolution_that_fails_after_reading_headers_leaves_no_file_open(sharded) -> None:
    weights = examples.mlp_weights()
    write_safetensors(sharded / SHARDS[2], [("b2", weights["b2"])], legacy=True)
    with pytest.raises(ConfigError, match="the weight files mix layouts"):
        resolve_weights(LocalBundleFiles(sharded))
    assert _descriptors_into(sharded) == []


def read_bundle_weights_of(folder: Path, weight_set) -> list[tuple[str, np.ndarray]]:
    """The weights of a set resolved earlier, read as a load reads them (in parallel, small chunks)."""
    return read_local_weights(folder, weight_set, threads=4, chunk_bytes=64)
