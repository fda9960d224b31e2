"""Bundles served from s3:// (moto on the loopback): weights streamed by ranged GETs, never on local disk."""

from __future__ import annotations

import json
import re
import shutil
import struct
import textwrap
from pathlib import Path

import jax
import numpy as np
import obstore
import pytest
import tritonclient.grpc as triton

from moto_s3 import bucket_state, iter_files, upload_folder
from nereid.backend import ModelContext
from nereid.backends.xla.model import create_model
from nereid.errors import ConfigError
from nereid.backends.xla.export import examples
from nereid.plugins import make_plugin_manager, streamed_files
from nereid.settings import ModelSettings, load_settings
from nereid.storage import materialize_model_folder
from nereid.dtypes import DType
from nereid.tensors import NamedTensor

SHARDS = ["weights-00001-of-00003.safetensors", "weights-00002-of-00003.safetensors",
          "weights-00003-of-00003.safetensors"]


def _settings(tmp_path: Path, url: str):
    config = tmp_path / "nereid.yaml"
    config.write_text(textwrap.dedent(f'''\
        server:
          bind_addr: "127.0.0.1:0"
          metrics_addr: ""
          http_addr: ""
          ml_backends_path: "{url}"
          cache_dir: "{tmp_path / 'cache'}"
        '''))
    return config, load_settings(config).server


def _uploaded(s3, pristine, *names: str, edit=None) -> None:
    for name in names:
        source = pristine(name)
        if edit is not None:
            copy = Path(str(source) + "-edited")
            shutil.rmtree(copy, ignore_errors=True)
            source = Path(shutil.copytree(source, copy))
            edit(source)
        upload_folder(s3.store, source, f"{s3.prefix}/{name}")


def _materialized(server, name: str) -> Path:
    """The model folder ``name`` fetched as a server's load fetches it: but for the files the backends stream."""
    return materialize_model_folder(server, name, streamed_files(make_plugin_manager(load_entry_points=False), name))


def _load(server, name: str, **runtime):
    folder = _materialized(server, name)
    model = create_model(ModelContext(name, folder, ModelSettings(name, runtime=runtime), folder.parent))
    model.load()
    return model


def _mlp_check(model, rows: int = 3) -> None:
    x = np.random.default_rng(rows).standard_normal((rows, 16)).astype(np.float32)
    (out,) = model.infer([NamedTensor("input", DType.FP32, x)])
    expected = np.asarray(jax.jit(examples.mlp)(x, *examples.mlp_weights().values()))
    np.testing.assert_allclose(out.data, expected, rtol=1e-6, atol=1e-6)


def test_a_bundle_is_served_from_s3_with_its_weights_streamed(s3, serve, pristine, tmp_path) -> None:
    _uploaded(s3, pristine, "mlp_bundle")
    before = bucket_state(s3.store, s3.prefix)
    config, _ = _settings(tmp_path, s3.url())
    server = serve(config)
    client = server.client
    assert client.is_model_ready("mlp_bundle")
    x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    tensor = triton.InferInput("input", [5, 16], "FP32")
    tensor.set_data_from_numpy(x)
    served = client.infer("mlp_bundle", [tensor]).as_numpy("output")
    expected = np.asarray(jax.jit(examples.mlp)(x, *examples.mlp_weights().values()))
    np.testing.assert_allclose(served, expected, rtol=1e-6, atol=1e-6)
    # The weights were read by ranged GETs (the header first), never fetched whole or written locally.
    ranges = s3.gets("/mlp_bundle/weights.safetensors")
    assert ranges and all(r is not None and r.startswith("bytes=") for r in ranges), ranges
    assert ranges[0] == "bytes=0-" + str(min(64 * 1024, before[f"{s3.prefix}/mlp_bundle/weights.safetensors"][0]) - 1)
    cache = tmp_path / "cache"
    assert not [p for p in iter_files(cache) if p.suffix == ".safetensors"]
    folder = server.server.settings.server.ml_backends_path / "mlp_bundle"
    # The executables are cached locally, under the same keys as a local bundle's .cache/.
    assert sorted(p.name.split(".")[0] + "." + p.name.split(".")[1] for p in (folder / ".cache").glob("*.xlaexe"))
    assert bucket_state(s3.store, s3.prefix) == before  # nothing written into the bucket


def test_a_second_load_compiles_nothing_and_reads_the_weights_again(s3, pristine, tmp_path) -> None:
    _uploaded(s3, pristine, "mlp_bundle")
    _, server = _settings(tmp_path, s3.url())
    first = _load(server, "mlp_bundle", weights_chunk_bytes=500, weights_concurrency=4)
    assert first.report.cache.compiled == 3 and first.report.cache.hits == 0
    first.unload()
    second = _load(server, "mlp_bundle", weights_chunk_bytes=500, weights_concurrency=4)
    assert second.report.cache.hits == 3 and second.report.cache.compiled == 0
    _mlp_check(second)
    second.unload()
    # Each load: the header, then ranges of at most 500 bytes tiling the data region, w1's 2048 bytes in
    # 5 of them, and small neighbours sharing one (w1's tail with b1, w2's tail with b2): 7, not 9.
    ranges = s3.gets("/mlp_bundle/weights.safetensors")
    assert len(ranges) == 16 and sorted(ranges[:8]) == sorted(ranges[8:]), ranges  # (in flight in any order)
    spans = sorted(tuple(int(v) for v in r.removeprefix("bytes=").split("-")) for r in ranges[1:8])
    assert all(last - first + 1 <= 500 for first, last in spans)
    assert all(b[0] == a[1] + 1 for a, b in zip(spans, spans[1:]))
    size = bucket_state(s3.store, s3.prefix)[f"{s3.prefix}/mlp_bundle/weights.safetensors"][0]
    assert spans[-1][1] == size - 1 and spans[0][1] - spans[0][0] + 1 == 500


def test_a_sharded_bundle_and_a_legacy_one_are_served_from_s3(s3, pristine, tmp_path) -> None:
    _uploaded(s3, pristine, "mlp_sharded", "mlp_legacy")
    _, server = _settings(tmp_path, s3.url())
    for name in ("mlp_sharded", "mlp_legacy"):
        model = _load(server, name, batch_sizes="largest")
        _mlp_check(model)
        model.unload()
    for shard in SHARDS:
        assert s3.gets(f"/mlp_sharded/{shard}")
    assert not [p for p in iter_files(tmp_path / "cache") if p.suffix == ".safetensors"]


def test_weights_files_named_otherwise_than_safetensors_load_from_s3_as_locally(s3, pristine, tmp_path) -> None:
    """Found by a bug hunt: a manifest's ``weights_file: weights.bin`` or an index naming a shard ``part-1.st``
    loaded locally, but from a bucket failed "no weights file 'weights.bin' in the model folder (files: none)":
    only names ending in .safetensors are streamed, and the loader looked for the weights among those alone."""
    def renamed(folder: Path) -> None:
        (folder / "weights.safetensors").rename(folder / "weights.bin")
        manifest = folder / "manifest.yaml"
        manifest.write_text(manifest.read_text() + "weights_file: weights.bin\n")

    def one_shard_renamed(folder: Path) -> None:  # the other two still streamed: both ways in one load
        (folder / SHARDS[1]).rename(folder / "part-2.st")
        index = json.loads((folder / "weights.safetensors.index.json").read_text())
        index["weight_map"] = {k: "part-2.st" if v == SHARDS[1] else v for k, v in index["weight_map"].items()}
        (folder / "weights.safetensors.index.json").write_text(json.dumps(index))

    _uploaded(s3, pristine, "mlp_bundle", edit=renamed)
    _uploaded(s3, pristine, "mlp_sharded", edit=one_shard_renamed)
    _, server = _settings(tmp_path, s3.url())
    for name in ("mlp_bundle", "mlp_sharded"):
        model = _load(server, name, batch_sizes="largest")
        _mlp_check(model)
        model.unload()
    assert s3.gets(f"/mlp_sharded/{SHARDS[0]}") and s3.gets(f"/mlp_sharded/{SHARDS[2]}")
    # Fetched whole with the folder's other files, as the README says of a name without the suffix.
    assert sorted(p.name for p in iter_files(tmp_path / "cache") if p.name in ("weights.bin", "part-2.st")) == [
        "part-2.st", "weights.bin"]


def test_a_tensor_missing_from_its_shard_names_the_tensor_and_the_url(s3, pristine, tmp_path) -> None:
    def edit(folder: Path) -> None:
        index = json.loads((folder / "weights.safetensors.index.json").read_text())
        index["weight_map"]["b2"] = SHARDS[0]
        (folder / "weights.safetensors.index.json").write_text(json.dumps(index))

    _uploaded(s3, pristine, "mlp_sharded", edit=edit)
    _, server = _settings(tmp_path, s3.url())
    with pytest.raises(ConfigError) as caught:
        _load(server, "mlp_sharded")
    assert str(caught.value) == (f"{s3.url('mlp_sharded', SHARDS[0])}: has no tensor 'b2', which "
                                 "weights.safetensors.index.json places in it (the file holds 1 tensor(s))")


def test_a_corrupt_header_names_the_url(s3, pristine, tmp_path) -> None:
    def edit(folder: Path) -> None:
        path = folder / "weights.safetensors"
        data = bytearray(path.read_bytes())
        data[8:9] = b"["  # the JSON header no longer parses
        path.write_bytes(bytes(data))

    _uploaded(s3, pristine, "mlp_bundle", edit=edit)
    _, server = _settings(tmp_path, s3.url())
    with pytest.raises(ConfigError) as caught:
        _load(server, "mlp_bundle")
    assert str(caught.value).startswith(f"{s3.url('mlp_bundle', 'weights.safetensors')}: header: not valid JSON")


@pytest.mark.parametrize("content, problem", [(b"", "file is 0 bytes, shorter than the 8-byte header length"),
                                              (b"12345", "file is 5 bytes, shorter than the 8-byte header length")])
def test_a_file_too_short_for_a_header_is_named_as_on_disk(s3, pristine, tmp_path, content, problem) -> None:
    # An empty object used to be asked for the range 0 to -1, retried and reported as "bytes 0--1".
    _uploaded(s3, pristine, "mlp_bundle", edit=lambda folder: (folder / "weights.safetensors").write_bytes(content))
    _, server = _settings(tmp_path, s3.url())
    with pytest.raises(ConfigError) as caught:
        _load(server, "mlp_bundle")
    assert str(caught.value) == f"{s3.url('mlp_bundle', 'weights.safetensors')}: {problem}"


def test_a_range_that_fails_once_is_retried(s3, pristine, tmp_path) -> None:
    _uploaded(s3, pristine, "mlp_bundle")
    _, server = _settings(tmp_path, s3.url())
    _materialized(server, "mlp_bundle")
    size = bucket_state(s3.store, s3.prefix)[f"{s3.prefix}/mlp_bundle/weights.safetensors"][0]
    data = obstore.get(s3.store, f"{s3.prefix}/mlp_bundle/weights.safetensors").bytes()
    start = 8 + struct.unpack("<Q", bytes(data[:8]))[0]  # w1, the first tensor, starts the data
    error = s3.fail("mlp_bundle/weights.safetensors", f"bytes={start}-{start + 1023}", times=1)
    short = s3.fail("mlp_bundle/weights.safetensors", f"bytes={start + 1024}-{start + 2047}", times=1, kind="short")
    model = _load(server, "mlp_bundle", weights_chunk_bytes=1024, batch_sizes="largest")
    assert error.times == 0 and short.times == 0  # both faults were met, and survived
    _mlp_check(model)
    model.unload()
    assert size > start


def test_a_range_that_keeps_failing_fails_the_load_naming_url_range_and_cause(s3, pristine, tmp_path) -> None:
    _uploaded(s3, pristine, "mlp_bundle")
    _, server = _settings(tmp_path, s3.url())
    _materialized(server, "mlp_bundle")
    data = obstore.get(s3.store, f"{s3.prefix}/mlp_bundle/weights.safetensors").bytes()
    start = 8 + struct.unpack("<Q", bytes(data[:8]))[0]
    s3.fail("mlp_bundle/weights.safetensors", f"bytes={start}-{start + 1023}", times=100)
    with pytest.raises(ConfigError) as caught:
        _load(server, "mlp_bundle", weights_chunk_bytes=1024, weights_read_retries=2, batch_sizes="largest")
    assert str(caught.value) == (
        f"{s3.url('mlp_bundle', 'weights.safetensors')}: bytes {start}-{start + 1023} (1024 bytes of tensor 'w1'): "
        "read failed after 3 attempt(s): HTTP 500 Internal Server Error InternalError: injected by the test")
    assert s3.gets("/mlp_bundle/weights.safetensors").count(f"bytes={start}-{start + 1023}") == 3  # no hidden retries


def test_a_weights_file_replaced_during_the_load_fails_it(s3, pristine, tmp_path) -> None:
    """Every ranged GET is conditional on the ETag the listing gave: no mix of two versions."""
    _uploaded(s3, pristine, "mlp_bundle")
    _, server = _settings(tmp_path, s3.url())
    folder = _materialized(server, "mlp_bundle")
    key = f"{s3.prefix}/mlp_bundle/weights.safetensors"
    original = obstore.get(s3.store, key).bytes()
    obstore.put(s3.store, key, bytes(original)[:-4] + b"\x00\x00\x80\x3f")  # same size, new ETag
    model = create_model(ModelContext("mlp_bundle", folder, ModelSettings("mlp_bundle"), folder.parent))
    with pytest.raises(ConfigError) as caught:
        model.load()
    assert str(caught.value).startswith(f"{s3.url('mlp_bundle', 'weights.safetensors')}: bytes 0-")
    assert "read failed after 1 attempt(s): HTTP 412 Precondition Failed" in str(caught.value)
    assert "the object changed in the store during the load" in str(caught.value)


def test_a_reload_reads_the_manifest_in_the_mirror_and_a_failed_read_is_the_store_s(s3, pristine, tmp_path) -> None:
    """Whether a folder is a bundle is read from its manifest.yaml before the fetch: from the mirror's copy once
    it is current there (a reload costs no request), and a store failing that read fails the fetch naming the
    URL, a StorageError (tried again), never blamed on the backend."""
    from nereid.storage import StorageError

    _uploaded(s3, pristine, "mlp_bundle")
    _, server = _settings(tmp_path, s3.url())
    _materialized(server, "mlp_bundle")
    asked = len(s3.gets("/mlp_bundle/manifest.yaml"))
    assert asked == 2  # read, then fetched
    _materialized(server, "mlp_bundle")
    assert len(s3.gets("/mlp_bundle/manifest.yaml")) == asked
    key = f"{s3.prefix}/mlp_bundle/manifest.yaml"
    obstore.put(s3.store, key, bytes(obstore.get(s3.store, key).bytes()) + b"# changed\n")
    s3.fail("mlp_bundle/manifest.yaml", times=100)  # past the store client's own retries
    with pytest.raises(StorageError, match=rf"^{re.escape(s3.url('mlp_bundle', 'manifest.yaml'))}: cannot fetch: "
                                           ".*500"):
        _materialized(server, "mlp_bundle")
