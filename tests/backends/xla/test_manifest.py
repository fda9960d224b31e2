"""manifest.yaml parsing: the shape encoding, and an error naming manifest, key and value for each mistake."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from nereid.backends.xla.manifest import DimKind, load_manifest, smallest_fitting
from nereid.dtypes import DType
from nereid.errors import ConfigError

BASE: dict[str, Any] = {
    "format_version": "2.1",
    "name": "net",
    "executable_inputs": [{"name": "image", "dtype": "f32", "shape": "chwn", "dims": {"c": 3, "h": 4, "w": 5}}],
    "executable_outputs": [{"name": "logits", "dtype": "bf16", "shape": "kn", "dims": {"k": 10}}],
    "batching": {"compiled_batch_sizes": [8, 1]},
}


def write(tmp_path: Path, document: Any, raw: str | None = None) -> Path:
    path = tmp_path / "manifest.yaml"
    path.write_text(raw if raw is not None else yaml.safe_dump(document))
    return path


def test_parses_the_column_major_encoding(tmp_path) -> None:
    manifest = load_manifest(write(tmp_path, BASE))
    assert manifest.format_version == "2.1" and manifest.name == "net"
    image = manifest.executable_inputs[0]
    assert image.dtype is DType.FP32 and image.shape_string == "chwn"
    assert [d.kind for d in image.shape] == [DimKind.FIXED] * 3 + [DimKind.BATCH]
    assert image.batch_axis == 3 and image.row_major_batch_axis == 0
    assert image.program_shape(8) == (8, 5, 4, 3)  # reversed: row-major for clients and the program
    assert manifest.batching.compiled_batch_sizes == (1, 8)
    assert smallest_fitting(manifest.batching.compiled_batch_sizes, 3) == 8
    assert manifest.executable_outputs[0].dtype is DType.BF16
    assert manifest.client_inputs is None and manifest.client_outputs is None


@pytest.mark.parametrize("version", ["2.1", "2.0", "2", 2.1, 2.0, 2])
def test_accepted_format_versions(tmp_path, version) -> None:
    document = {**BASE, "format_version": version}
    assert load_manifest(write(tmp_path, document)).format_version in ("2.1", "2.0", "2")


@pytest.mark.parametrize("written", ["2.1", "2.0", "2", '"2.1"', "'2.0'", "!!float 2.1"])
def test_format_versions_are_read_as_written(tmp_path, written) -> None:
    text = yaml.safe_dump({k: v for k, v in BASE.items() if k != "format_version"})
    manifest = load_manifest(write(tmp_path, None, raw=f"format_version: {written}\n{text}"))
    assert manifest.format_version == written.strip("'\"").removeprefix("!!float ")


@pytest.mark.parametrize("written", ["2.10", "2.100", "2.00", "02", "0x2", "0o2", "+2", "2.0e0", "20e-1", '"2.10"'])
def test_other_spellings_of_a_format_version_are_refused_as_written(tmp_path, written) -> None:
    """Read by its value, an unquoted 2.10 was 2.1 and 0x2 was 2: a bundle of a newer format (which this server
    may misread) passed for one it reads."""
    text = yaml.safe_dump({k: v for k, v in BASE.items() if k != "format_version"})
    path = write(tmp_path, None, raw=f"format_version: {written}\n{text}")
    with pytest.raises(ConfigError) as caught:
        load_manifest(path)
    assert str(caught.value) == (f"{path}: format_version: unsupported bundle format (this server reads 2.1, 2.0, "
                                 f"2), got {written.strip(chr(34))!r}")


@pytest.mark.parametrize("written, read", [("2024", "2024"), ("1.5", "1.5"), ("true", "True"), ("null", None),
                                           ("'net'", "net")])
def test_name_and_description_take_any_scalar(tmp_path, written, read) -> None:
    """An unquoted name: 2024 (a folder named 2024, or a YAML writer that leaves numbers unquoted) made the bundle
    UNAVAILABLE, though the name is informational."""
    text = yaml.safe_dump({k: v for k, v in BASE.items() if k != "name"})
    manifest = load_manifest(write(tmp_path, None, raw=f"name: {written}\ndescription: {written}\n{text}"))
    assert manifest.name == read and manifest.description == (read or "")


def test_variable_axes_and_variants(tmp_path) -> None:
    document = copy.deepcopy(BASE)
    document["executable_inputs"][0]["dims"] = {"c": 3, "h": -1, "w": -1}
    document["input_shapes"] = [[224, 224], [320, 240]]
    manifest = load_manifest(write(tmp_path, document))
    image = manifest.executable_inputs[0]
    assert [d.kind for d in image.shape][1:3] == [DimKind.VARIABLE, DimKind.VARIABLE]
    assert image.variable_axes == (1, 2)
    assert manifest.variant_sizes((320, 240)) == ((320, 240),)
    assert image.program_shape(1, (320, 240)) == (1, 240, 320, 3)


def test_client_specs_allow_bytes_and_variable_axes(tmp_path) -> None:
    document = {**BASE, "client_inputs": [{"name": "jpeg", "dtype": "bytes", "shape": "n"}],
                "client_outputs": [{"name": "boxes", "dtype": "f32", "shape": "cd", "dims": {"c": 4, "d": -1}}]}
    manifest = load_manifest(write(tmp_path, document))
    assert manifest.client_inputs[0].dtype is DType.BYTES
    assert manifest.client_outputs[0].row_major[0].client_size == -1


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def mutate(document: dict) -> None:
        *parents, last = path.split(".")
        target = document
        for part in parents:
            target = target[int(part)] if part.isdigit() else target[part]
        if value is _DELETE:
            del target[last]
        else:
            target[int(last) if last.isdigit() else last] = value
    return mutate


_DELETE = object()


def _both(*mutations: Callable[[dict], None]) -> Callable[[dict], None]:
    def mutate(document: dict) -> None:
        for mutation in mutations:
            mutation(document)
    return mutate

# (mutation, key named in the message, fragment of the problem)
MISTAKES = [
    (_set("format_version", "3.0"), "format_version", "unsupported bundle format"),
    (_set("format_version", _DELETE), "format_version", "is required"),
    (_set("surprise", 1), "surprise", "unknown key"),
    (_set("executable_inputs", _DELETE), "executable_inputs", "is required"),
    (_set("executable_inputs", {"name": "x"}), "executable_inputs", "must be a list"),
    (_set("executable_outputs", []), "executable_outputs", "at least one tensor"),
    (_set("executable_inputs.0.name", ""), "executable_inputs[0].name", "non-empty string"),
    (_set("executable_inputs.0.dtype", "f33"), "executable_inputs[0].dtype", "unknown dtype token 'f33'"),
    (_set("executable_inputs.0.dtype", "bytes"), "executable_inputs[0].dtype", "no string type"),
    (_set("executable_inputs.0.shape", ["c", "n"]), "executable_inputs[0].shape", "string of axis letters"),
    (_set("executable_inputs.0.shape", "chw1"), "executable_inputs[0].shape", "single ASCII letters"),
    (_set("executable_inputs.0.shape", "chcn"), "executable_inputs[0].shape", "appears twice"),
    (_set("executable_inputs.0.shape", "chwnb"), "executable_inputs[0].shape", "more than one batch marker"),
    (_set("executable_inputs.0.dims", {"c": 3, "h": 4}), "executable_inputs[0].dims", "no size for axis 'w'"),
    (_set("executable_inputs.0.dims.z", 2), "executable_inputs[0].dims.z", "names no axis"),
    (_set("executable_inputs.0.dims.n", 2), "executable_inputs[0].dims.n", "is the batch axis"),
    # A key that is part of the shape string but not one letter of it (it was ignored).
    (_set("executable_inputs.0.dims.hw", 5), "executable_inputs[0].dims.hw", "names no axis of shape 'chwn'"),
    (_set("executable_inputs.0.dims.chwn", 5), "executable_inputs[0].dims.chwn", "names no axis of shape 'chwn'"),
    (_set("executable_inputs.0.dims.", 5), "executable_inputs[0].dims.", "names no axis of shape 'chwn'"),
    # Past int64 it loaded READY, then every ModelMetadata and ModelConfig call failed INTERNAL.
    (_set("client_outputs", [{"name": "c", "dtype": "f32", "shape": "cd", "dims": {"c": 99999999999999999999,
                                                                                   "d": -1}}]),
     "client_outputs[0].dims.c", "must be at most 9223372036854775807 (ModelMetadata's and ModelConfig's dims "
                                 "are int64)"),
    (_set("executable_inputs.0.dims.c", 2 ** 63), "executable_inputs[0].dims.c", "must be at most"),
    (_set("executable_inputs.0.dims.c", 2 ** 57), "executable_inputs[0].dims",  # 2**57 x 4 x 5 f32
     "its fixed sizes make 2882303761517117440 f32 elements, 11529215046068469760 bytes, past 9223372036854775807"),
    (_set("executable_inputs.0.shape", "abcdefghijklmopqrstuvwxyzABCDEFGH"), "executable_inputs[0].shape",
     "has 33 axes; at most 32 are supported"),
    (_set("executable_inputs.0.dims.c", 0), "executable_inputs[0].dims.c", "positive integer or -1"),
    (_set("executable_inputs.0.dims.c", "3"), "executable_inputs[0].dims.c", "positive integer or -1"),
    (_set("executable_inputs.0.dims.c", -1), "executable_inputs[0].dims.c", "needs an input_shapes block"),
    (_set("executable_outputs.0.dims.k", -1), "executable_outputs[0].dims.k", "needs an input_shapes block"),
    (_set("executable_inputs.0.extra", 1), "executable_inputs[0].extra", "unknown key"),
    (_set("executable_outputs.0.name", _DELETE), "executable_outputs[0].name", "is required"),
    (_set("client_outputs", [{"name": "a", "dtype": "f8e4m3", "shape": "x", "dims": {"x": 1}}]),
     "client_outputs[0].dtype", "no KServe wire datatype"),
    # Without client_* the executable tensors are the client's: FP8 has no wire datatype there either.
    (_set("executable_outputs.0.dtype", "f8e5m2"), "executable_outputs[0].dtype",
     "F8E5M2 has no KServe wire datatype, and without client_outputs this tensor is also the client's"),
    (_set("executable_inputs.0.dtype", "f8e4m3"), "executable_inputs[0].dtype", "declare client_inputs"),
    (_set("client_inputs", [{"name": "a", "dtype": "f32", "shape": "x", "dims": {"x": 1}},
                            {"name": "a", "dtype": "f32", "shape": "x", "dims": {"x": 1}}]),
     "client_inputs[1].name", "used twice"),
    (_set("batching", _DELETE), "batching", "is required"),
    (_set("batching.compiled_batch_sizes", []), "batching.compiled_batch_sizes", "non-empty list"),
    (_set("batching.compiled_batch_sizes", [1, 0]), "batching.compiled_batch_sizes", "positive integers"),
    (_set("batching.compiled_batch_sizes", [2, 2]), "batching.compiled_batch_sizes", "lists a size twice"),
    (_set("batching.max", 4), "batching.max", "unknown key"),
    (_set("input_shapes", [[2]]), "input_shapes", "no executable input has a variable"),
    (_set("weights_file", "../weights.safetensors"), "weights_file", "inside the bundle"),
    (_set("weights_file", "/abs/weights.safetensors"), "weights_file", "inside the bundle"),
    (_set("weights_file", 3), "weights_file", "file name"),
    (_set("description", ["x"]), "description", "must be a string"),
    (_set("provenance", []), "provenance", "must be a mapping"),  # (the config hunt: [] passed, [1] did not)
    (_set("name", ["net"]), "name", "must be a string"),
    (_set("name", {"net": 1}), "name", "must be a string"),
    (_set("executable_inputs.0", "image"), "executable_inputs[0]", "must be a mapping"),
    (_set("executable_inputs.0.dims", [3, 4, 5]), "executable_inputs[0].dims", "must be a mapping"),
    (_set("executable_inputs.0.dtype", 32), "executable_inputs[0].dtype", "dtype token such as f32"),
    (_set("batching", [1, 8]), "batching", "must be a mapping"),
    (_both(_set("executable_inputs.0.dims.c", -1), _set("input_shapes", {"c": 3})), "input_shapes",
     "must be a non-empty list of variants"),
    (_both(_set("executable_inputs.0.dims.c", -1), _set("input_shapes", [[1.5]])), "input_shapes[0]",
     "sizes must be positive integers"),
    (_set("provenance", "git"), "provenance", "must be a mapping"),
    (_set("provenance", {"export_platform": ["cpu"]}), "provenance.export_platform",
     "must name the platform the programs were exported for, such as cpu or cuda"),
    (_set("provenance", {"export_platform": " "}), "provenance.export_platform", "such as cpu or cuda"),
]


def test_fp8_executable_tensors_are_fine_behind_client_specs(tmp_path) -> None:
    document = copy.deepcopy(BASE)
    document["executable_outputs"][0]["dtype"] = "f8e5m2"
    document["client_outputs"] = [{"name": "logits", "dtype": "f32", "shape": "kn", "dims": {"k": 10}}]
    assert load_manifest(write(tmp_path, document)).executable_outputs[0].dtype.name == "F8E5M2"


@pytest.mark.parametrize("mutate, key, problem", MISTAKES, ids=[f"{m[1]}:{m[2]}" for m in MISTAKES])
def test_each_mistake_names_the_manifest_key_and_value(tmp_path, mutate, key, problem) -> None:
    document = copy.deepcopy(BASE)
    mutate(document)
    path = write(tmp_path, document)
    with pytest.raises(ConfigError) as caught:
        load_manifest(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: {key}: "), message
    assert problem in message and ", got " in message, message


def test_batch_sizes_past_modelconfigs_int32_are_refused(tmp_path) -> None:
    """3000000000 was accepted: the model was READY, then every gRPC ModelConfig failed INTERNAL "Value out of
    range" (max_batch_size, the largest compiled size, is an int32 there)."""
    document = copy.deepcopy(BASE)
    document["batching"]["compiled_batch_sizes"] = [1, 3000000000]
    path = write(tmp_path, document)
    with pytest.raises(ConfigError) as caught:
        load_manifest(path)
    assert str(caught.value) == (f"{path}: batching.compiled_batch_sizes: must hold sizes of at most 2147483647 "
                                 "(ModelConfig's max_batch_size is an int32), got [1, 3000000000]")
    document["batching"]["compiled_batch_sizes"] = [1, 2 ** 31 - 1]
    assert load_manifest(write(tmp_path, document)).batching.compiled_batch_sizes == (1, 2 ** 31 - 1)


@pytest.mark.parametrize("key, hint", [
    ("dynamic_batching", "(dynamic batching is nereid.yaml's: models[].batching (max_queue_delay_ms, "
                         "preferred_batch_sizes); a manifest's batching: says what the bundle is compiled for)"),
    ("max_batch_size", "(a bundle's max_batch_size is its largest compiled batch size: batching: "
                       "{compiled_batch_sizes: [...]} (a meta model's batching: {max_batch_size: N}))"),
    ("instance_group", "(instances and the device are nereid.yaml's: models[].instances, models[].device)"),
])
def test_a_triton_field_in_a_manifest_is_told_where_nereid_takes_it(tmp_path, key, hint) -> None:
    """The hunt of this session's changes: `dynamic_batching` in a manifest was told "did you mean 'batching'?",
    the manifest's compiled sizes, where Triton's batching settings are nereid.yaml's; `max_batch_size` got no
    hint."""
    document = copy.deepcopy(BASE)
    document[key] = {"count": 1} if key != "max_batch_size" else 8
    path = write(tmp_path, document)
    with pytest.raises(ConfigError) as caught:
        load_manifest(path)
    assert f"{path}: {key}: unknown key (allowed: " in str(caught.value)
    assert f") {hint}, got " in str(caught.value), str(caught.value)


def test_a_meta_models_max_batch_size_past_modelconfigs_int32_is_refused(tmp_path) -> None:
    document = {"format_version": "2.1", "meta": True, "depends_on": ["net"],
                "client_inputs": [{"name": "x", "dtype": "f32", "shape": "an", "dims": {"a": 2}}],
                "client_outputs": [{"name": "y", "dtype": "f32", "shape": "an", "dims": {"a": 2}}],
                "batching": {"max_batch_size": 2 ** 31}}
    path = write(tmp_path, document)
    with pytest.raises(ConfigError) as caught:
        load_manifest(path)
    assert str(caught.value) == (f"{path}: batching.max_batch_size: must be at most 2147483647 (ModelConfig's "
                                 "max_batch_size is an int32), got 2147483648")
    document["batching"]["max_batch_size"] = 2 ** 31 - 1
    assert load_manifest(write(tmp_path, document)).batching.largest == 2 ** 31 - 1


def test_batch_sizes_without_any_batch_axis(tmp_path) -> None:
    document = copy.deepcopy(BASE)
    document["executable_inputs"][0]["shape"] = "chw"
    document["executable_outputs"][0]["shape"] = "k"
    with pytest.raises(ConfigError, match=r"batching.compiled_batch_sizes: no executable tensor has a batch axis"):
        load_manifest(write(tmp_path, document))


def test_variant_length_must_match_the_variable_axes(tmp_path) -> None:
    document = copy.deepcopy(BASE)
    document["executable_inputs"][0]["dims"]["h"] = -1
    document["input_shapes"] = [[224], [224, 1]]
    with pytest.raises(ConfigError, match=r"input_shapes\[1\]: must list 1 size\(s\).*image.h.*got \[224, 1\]"):
        load_manifest(write(tmp_path, document))
    document["input_shapes"] = [[224], [224]]
    with pytest.raises(ConfigError, match=r"input_shapes\[1\]: repeats an earlier variant"):
        load_manifest(write(tmp_path, document))


def test_file_level_mistakes(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_manifest(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_manifest(write(tmp_path, None, raw="format_version: [\n"))
    with pytest.raises(ConfigError, match="duplicate key 'name'"):
        load_manifest(write(tmp_path, None, raw="name: a\nname: b\n"))
    with pytest.raises(ConfigError, match="top level: must be a mapping of keys to values, got a list of 1 item$"):
        load_manifest(write(tmp_path, None, raw="- 1\n"))
    # Described, never quoted (the security hunt: a key file in a manifest's place came back whole, 512 characters
    # of it, in the load's reason that RepositoryIndex shows every client).
    secret = "-----BEGIN PRIVATE KEY----- MIGHAgEAMBMGByqGSM49 -----END PRIVATE KEY-----"
    with pytest.raises(ConfigError) as refused:
        load_manifest(write(tmp_path, None, raw=secret + "\n"))
    assert str(refused.value).endswith(f"manifest.yaml: top level: must be a mapping of keys to values, got a string "
                                       f"of {len(secret)} characters")
    with pytest.raises(ConfigError) as refused:
        load_manifest(write(tmp_path, None, raw="- secret1\n- secret2\n"))
    assert "secret" not in str(refused.value)


def test_load_manifest_needs_no_bundle_directory(tmp_path) -> None:
    # Only the file: no program, no weights, a client spec without model.py.
    document = {**BASE, "client_outputs": [{"name": "label", "dtype": "i64", "shape": "n"}]}
    manifest = load_manifest(write(tmp_path, document))
    assert manifest.client_outputs[0].name == "label"


def test_the_export_platform_is_read_from_the_provenance(tmp_path) -> None:
    """What the exporter records for the server's check that a bundle runs on the platform it was lowered for."""
    assert load_manifest(write(tmp_path, BASE)).export_platform is None  # another writer, or an older export
    document = {**BASE, "provenance": {"git_dirty": False, "export_platform": "cuda"}}
    assert load_manifest(write(tmp_path, document)).export_platform == "cuda"
