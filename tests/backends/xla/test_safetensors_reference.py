"""nereid's safetensors reader against the reference, the ``safetensors`` package, both ways.

* Files the library writes load through nereid to the same arrays, and files
  nereid writes (the exporter, the writer, the migration) load through the
  library to the same arrays.
* nereid accepts a header exactly when the library does, within nereid's own
  documented limits (header size, rank, the dtypes it can hold, shapes
  numpy can allocate, the ``__metadata__.format`` rule): a hand-made corpus of edge cases and a few
  hundred seeded mutations of valid files.
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy

from nereid.backends.xla.migration import migrate_bundle
from nereid.backends.xla.safetensors import (MAX_HEADER_BYTES, NEREID_FORMAT, SAFETENSORS_DTYPES, load_weights,
                                             read_header, write_safetensors)
from nereid.errors import ConfigError

NUMPY_DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                np.uint32, np.uint64, np.bool_]


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    arrays = {f"t_{np.dtype(d).name}": (rng.standard_normal((3, 4)) * 50).astype(d) for d in NUMPY_DTYPES}
    arrays["scalar"] = np.array(1.5, np.float32)
    arrays["empty"] = np.zeros((0, 5), np.float32)
    arrays["rank5"] = np.arange(32, dtype=np.int32).reshape(2, 2, 2, 2, 2)
    return arrays


def test_files_the_library_writes_load_identically_through_nereid(tmp_path) -> None:
    arrays = _arrays()
    path = tmp_path / "lib.safetensors"
    safetensors.numpy.save_file(arrays, str(path), metadata={"axis_order": "xla"})
    loaded = dict(load_weights(path))
    assert set(loaded) == set(arrays)
    for name, expected in arrays.items():
        assert loaded[name].dtype == expected.dtype and loaded[name].shape == expected.shape, name
        assert loaded[name].tobytes() == expected.tobytes(), name


def test_bf16_and_fp8_files_the_library_writes_load_through_nereid(tmp_path) -> None:
    """numpy has no bf16/fp8, so they are written through the library's raw serializer."""
    rng = np.random.default_rng(3)
    arrays = {"b": rng.standard_normal((2, 3)).astype(ml_dtypes.bfloat16),
              "e4": rng.standard_normal(5).astype(ml_dtypes.float8_e4m3fn),
              "e5": rng.standard_normal(4).astype(ml_dtypes.float8_e5m2)}
    specs = {n: safetensors.TensorSpec(dtype=a.dtype.name, shape=list(a.shape), data_ptr=a.ctypes.data,
                                       data_len=a.nbytes) for n, a in arrays.items()}
    blob = safetensors.serialize(specs, metadata={"axis_order": "xla"})  # the arrays stay alive meanwhile
    path = tmp_path / "raw.safetensors"
    path.write_bytes(blob)
    loaded = dict(load_weights(path))
    for name, expected in arrays.items():
        assert loaded[name].dtype == expected.dtype and loaded[name].tobytes() == expected.tobytes(), name


@pytest.mark.parametrize("legacy", [False, True], ids=["xla", "legacy"])
def test_files_nereid_writes_load_identically_through_the_library(tmp_path, legacy) -> None:
    arrays = _arrays()
    path = tmp_path / "nereid.safetensors"
    write_safetensors(path, arrays.items(), legacy=legacy)
    through_library = safetensors.numpy.load_file(str(path))
    for name, expected in arrays.items():
        stored = expected.transpose() if legacy else expected  # legacy headers hold the reversed shape
        assert through_library[name].shape == stored.shape and through_library[name].dtype == expected.dtype
        assert np.array_equal(through_library[name], stored), name
    with safetensors.safe_open(str(path), "np") as f:
        assert f.metadata()["format"] == NEREID_FORMAT


def test_the_exported_bundle_and_its_migrated_weights_load_through_the_library(pristine, tmp_path) -> None:
    import shutil

    bundle = shutil.copytree(pristine("mlp_legacy"), tmp_path / "mlp_legacy")
    program = dict(load_weights(bundle / "weights.safetensors"))
    exported = safetensors.numpy.load_file(str(bundle / "weights.safetensors"))
    assert {n: a.transpose().tobytes() for n, a in exported.items()} == {n: a.tobytes() for n, a in program.items()}
    migrate_bundle(bundle, "replace")
    assert not read_header(bundle / "weights.safetensors").legacy
    migrated = safetensors.numpy.load_file(str(bundle / "weights.safetensors"))
    assert {n: a.tobytes() for n, a in migrated.items()} == {n: a.tobytes() for n, a in program.items()}


# -- acceptance: nereid accepts exactly what the library accepts --------------------------------------------

T = b'"dtype":"F32","shape":[2],"data_offsets":[0,8]'


def _file(header: bytes, data: bytes = bytes(8)) -> bytes:
    return struct.pack("<Q", len(header)) + header + data


CORPUS: dict[str, bytes] = {
    "plain": _file(b'{"a":{' + T + b'}}'),
    "gap at the start": _file(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}', bytes(16)),
    "a byte after the last tensor": _file(b'{"a":{' + T + b'}}', bytes(9)),
    "a gap between tensors": _file(b'{"a":{' + T + b'},"b":{"dtype":"U8","shape":[1],"data_offsets":[9,10]}}',
                                   bytes(10)),
    "overlap": _file(b'{"a":{' + T + b'},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}'),
    "unsorted but contiguous": _file(b'{"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},"a":{' + T + b'}}',
                                     bytes(16)),
    "zero-size tensors share an offset": _file(
        b'{"z":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"y":{"dtype":"I8","shape":[3,0],'
        b'"data_offsets":[0,0]},"a":{' + T + b'}}'),
    "an unknown field in an entry": _file(b'{"a":{' + T + b',"x":{"y":[1,2,"z"]}}}'),
    "a repeated unknown field": _file(b'{"a":{' + T + b',"x":1,"x":2}}'),
    "a repeated dtype field": _file(b'{"a":{"dtype":"F32",' + T + b'}}'),
    "a repeated tensor name, the last fits": _file(
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{' + T + b'}}'),
    "a repeated tensor name, the last leaves a tail": _file(
        b'{"a":{' + T + b'},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'),
    "__metadata__ twice": _file(b'{"__metadata__":{},"a":{' + T + b'},"__metadata__":{}}'),
    "a repeated metadata key": _file(b'{"__metadata__":{"k":"1","k":"2"},"a":{' + T + b'}}'),
    # serde types every occurrence of a repeated key before the last one wins: an invalid earlier one is refused.
    "a repeated tensor name, the first no entry": _file(b'{"a":"junk","a":{' + T + b'}}'),
    "a repeated tensor name, the first of an unknown dtype": _file(b'{"a":{"dtype":"BAD"},"a":{' + T + b'}}'),
    "a repeated tensor name, the first missing a field": _file(b'{"a":{"dtype":"F32","shape":[2]},"a":{' + T + b'}}'),
    "a repeated tensor name, the first with a float dimension": _file(
        b'{"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]},"a":{' + T + b'}}'),
    "a repeated tensor name, the first with three offsets": _file(
        b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]},"a":{' + T + b'}}'),
    "a repeated tensor name, the first with a repeated field": _file(
        b'{"a":{"dtype":"F32",' + T + b'},"a":{' + T + b'}}'),
    "a repeated tensor name, the first an array": _file(b'{"a":["F32",[2],[0,8]],"a":{' + T + b'}}'),
    "a repeated tensor name, the first of a dtype only the library holds": _file(
        b'{"a":{"dtype":"C64","shape":[9],"data_offsets":[5,5]},"a":{' + T + b'}}'),
    "a repeated tensor name, the first with a lone surrogate": _file(
        b'{"a":{' + T + b',"x":"\\ud800"},"a":{' + T + b'}}'),
    "a repeated tensor name three times, the middle invalid": _file(
        b'{"a":{' + T + b'},"a":{"dtype":"BAD"},"a":{' + T + b'}}'),
    "a repeated metadata key, the first null": _file(
        b'{"__metadata__":{"format":null,"format":"pt"},"a":{' + T + b'}}'),
    "a repeated metadata key, the first a number": _file(b'{"__metadata__":{"k":1,"k":"2"},"a":{' + T + b'}}'),
    "a repeated metadata key, the first another format": _file(
        b'{"__metadata__":{"format":"tf","format":"pt"},"a":{' + T + b'}}'),
    "null metadata": _file(b'{"__metadata__":null,"a":{' + T + b'}}'),
    "a number in the metadata": _file(b'{"__metadata__":{"k":1},"a":{' + T + b'}}'),
    "metadata a list": _file(b'{"__metadata__":[],"a":{' + T + b'}}'),
    "an entry as a 3-element array": _file(b'{"a":["F32",[2],[0,8]]}'),
    "an entry as a 4-element array": _file(b'{"a":["F32",[2],[0,8],1]}'),
    "a dtype as a map": _file(b'{"a":{"dtype":{"F32":null},"shape":[2],"data_offsets":[0,8]}}'),
    "a dtype as a map with a value": _file(b'{"a":{"dtype":{"F32":[]},"shape":[2],"data_offsets":[0,8]}}'),
    "a lower-case dtype": _file(b'{"a":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}}'),
    "a float dimension": _file(b'{"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}'),
    "an exponent dimension": _file(b'{"a":{"dtype":"F32","shape":[2e0],"data_offsets":[0,8]}}'),
    "a -0 dimension": _file(b'{"a":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}', b""),
    "a -0 in an unknown field": _file(b'{"a":{' + T + b',"x":-0}}'),
    "a huge integer in an unknown field": _file(b'{"a":{' + T + b',"x":1' + b'0' * 40 + b'}}'),
    "an infinite float in an unknown field": _file(b'{"a":{' + T + b',"x":1e400}}'),
    "NaN in an unknown field": _file(b'{"a":{' + T + b',"x":NaN}}'),
    "an offset of 2**64": _file(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551616]}}'),
    "an element count overflowing 64 bits before a 0": _file(
        b'{"a":{"dtype":"F32","shape":[9223372036854775808,9223372036854775808,0],"data_offsets":[0,0]}}', b""),
    "a bit count overflowing 64 bits": _file(
        b'{"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}}', b""),
    "a large dimension times 0": _file(b'{"a":{"dtype":"F32","shape":[4294967296,0],"data_offsets":[0,0]}}', b""),
    "a lone surrogate in a name": _file(b'{"\\ud800":{' + T + b'}}'),
    "a lone surrogate in an unknown field": _file(b'{"a":{' + T + b',"x":"\\udc00"}}'),
    "a surrogate pair in a name": _file(b'{"\\ud83d\\ude00":{' + T + b'}}'),
    "an escaped NUL in a name": _file(b'{"a\\u0000":{' + T + b'}}'),
    "a raw control character": _file(b'{"a\x01":{' + T + b'}}'),
    "nesting 127 deep": _file(b'{"a":{' + T + b',"x":' + b'[' * 125 + b']' * 125 + b'}}'),
    "nesting 128 deep": _file(b'{"a":{' + T + b',"x":' + b'[' * 126 + b']' * 126 + b'}}'),
    "leading and trailing whitespace": _file(b' \n\t{"a":{' + T + b'}} \r\n'),
    "a UTF-8 byte order mark": _file(b'\xef\xbb\xbf{"a":{' + T + b'}}'),
    "a trailing NUL": _file(b'{"a":{' + T + b'}}\x00'),
    "invalid UTF-8": _file(b'{"\xff":{' + T + b'}}'),
    "an empty header object": _file(b'{}', b""),
    "an empty header object and a byte": _file(b'{}', b"\x00"),
    "a top-level array": _file(b'[]', b""),
    "an empty name": _file(b'{"":{' + T + b'}}'),
    "format pt": _file(b'{"__metadata__":{"format":"pt"},"a":{' + T + b'}}'),
    "a missing field": _file(b'{"a":{"dtype":"F32","shape":[2]}}'),
    "three offsets": _file(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}}'),
    "a header length past the end": struct.pack("<Q", 100) + b'{}',
    "a zero header length": struct.pack("<Q", 0),
}


def _reference_accepts(blob: bytes) -> bool:
    try:
        safetensors.deserialize(blob)
    except Exception:  # SafetensorError, and the library's own panics surface as exceptions too
        return False
    return True


def _nereid_accepts(path: Path, blob: bytes) -> bool:
    path.write_bytes(blob)
    try:
        read_header(path)
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("case", list(CORPUS), ids=list(CORPUS))
def test_nereid_accepts_a_header_exactly_when_the_library_does(tmp_path, case) -> None:
    blob = CORPUS[case]
    reference = _reference_accepts(blob)
    assert _nereid_accepts(tmp_path / "x.safetensors", blob) == reference, (
        f"{case}: the library {'accepts' if reference else 'refuses'} it, nereid does not agree")
    if reference:
        _same_tensors(tmp_path / "x.safetensors", blob)


def _same_tensors(path: Path, blob: bytes) -> None:
    """Accepted by both: the same names, dtypes, shapes and bytes."""
    header = read_header(path)
    expected = {name: (info["dtype"], list(info["shape"]), bytes(info["data"]))
                for name, info in safetensors.deserialize(blob)}
    got = {}
    with open(path, "rb") as f:
        data = f.read()
    token_of = {dtype: token for token, dtype in SAFETENSORS_DTYPES.items()}
    for entry in header.tensors:
        got[entry.name] = (token_of[entry.dtype], list(entry.shape), data[entry.start:entry.end])
    assert got == expected


def _mutations(rng: random.Random) -> bytes:
    """One random small file, valid or slightly broken in one of the ways readers disagree about."""
    dtypes = {"F32": 4, "F16": 2, "U8": 1, "I64": 8, "BOOL": 1, "BF16": 2}
    count = rng.randint(0, 4)
    entries, offset = [], 0
    for index in range(count):
        dtype = rng.choice(list(dtypes))
        shape = [rng.randint(0, 3) for _ in range(rng.randint(0, 3))]
        size = int(np.prod(shape, dtype=np.int64)) * dtypes[dtype]
        entries.append([f"t{index}", dtype, shape, [offset, offset + size]])
        offset += size
    data_len = offset
    kind = rng.randrange(10)
    if kind == 0 and entries:  # shift one tensor's offsets
        shift = rng.choice([-1, 1, 2])
        entry = rng.choice(entries)
        entry[3] = [max(0, entry[3][0] + shift), max(0, entry[3][1] + shift)]
    elif kind == 1:  # bytes after the last tensor
        data_len += rng.randint(1, 3)
    elif kind == 2 and entries:  # a wrong size
        rng.choice(entries)[3][1] += rng.choice([-1, 1])
    elif kind == 3 and entries:  # a shape that no longer matches
        rng.choice(entries)[2].append(rng.randint(0, 2))
    elif kind == 4 and len(entries) > 1:  # a repeated name
        rng.choice(entries)[0] = entries[0][0]
    header: dict = {}
    if rng.random() < 0.5:
        header["__metadata__"] = {"format": rng.choice(["pt", NEREID_FORMAT]), "k": "v"}
    for name, dtype, shape, offsets in entries:
        spec = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
        if kind == 5:
            spec["extra"] = [1, {"x": None}]
        header[name] = [dtype, shape, offsets] if kind == 6 else spec
    if kind == 4 and len(entries) > 1:  # json.dumps would fold the names: spell them out
        text = "{" + ",".join(f"{json.dumps(e[0])}:{json.dumps({'dtype': e[1], 'shape': e[2], 'data_offsets': e[3]})}"
                              for e in entries) + "}"
    else:
        text = json.dumps(header)
    if kind == 7:
        text = " " * rng.randint(1, 3) + text + " " * rng.randint(0, 9)
    return _file(text.encode(), bytes(data_len))


def test_seeded_mutations_are_judged_alike(tmp_path) -> None:
    rng = random.Random(12)
    disagreements = []
    accepted = refused = 0
    for index in range(400):
        blob = _mutations(rng)
        reference = _reference_accepts(blob)
        if _nereid_accepts(tmp_path / "m.safetensors", blob) != reference:
            disagreements.append((index, reference, blob[:200]))
        elif reference:
            accepted += 1
            _same_tensors(tmp_path / "m.safetensors", blob)
        else:
            refused += 1
    assert not disagreements, disagreements[:5]
    assert accepted > 100 and refused > 50  # both sides of the line were exercised


@pytest.mark.parametrize("value", ["pt", NEREID_FORMAT])
def test_format_pt_or_nereid_is_accepted(tmp_path, value) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(_file(b'{"__metadata__":{"format":"' + value.encode() + b'"},"a":{' + T + b'}}'))
    assert read_header(path).metadata["format"] == value


@pytest.mark.parametrize("value", ["tf", "np", "PT", ""])
def test_any_other_format_is_refused_naming_the_value(tmp_path, value) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(_file(b'{"__metadata__":{"format":"' + value.encode() + b'"},"a":{' + T + b'}}'))
    with pytest.raises(ConfigError) as caught:
        read_header(path)
    assert f"{path}: __metadata__.format: must be 'pt' or 'nereid' when present, got {value!r}" == str(caught.value)


def test_nereids_own_limits_are_named(tmp_path) -> None:
    """Where nereid is stricter than the library, on purpose, the message says which limit."""
    path = tmp_path / "w.safetensors"
    path.write_bytes(_file(b'{"a":{"dtype":"F32","shape":[' + b",".join([b"1"] * 40) + b'],"data_offsets":[0,4]}}',
                           bytes(4)))
    assert _reference_accepts(path.read_bytes())
    with pytest.raises(ConfigError, match="a.shape: has 40 dims; at most 32 are supported"):
        read_header(path)
    path.write_bytes(_file(b'{"a":{"dtype":"F8_E8M0","shape":[1],"data_offsets":[0,1]}}', bytes(1)))
    assert _reference_accepts(path.read_bytes())
    with pytest.raises(ConfigError, match="a.dtype: a safetensors dtype nereid cannot load"):
        read_header(path)
    path.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 1) + bytes(16))
    with pytest.raises(ConfigError, match="nereid reads headers of up to 16777216 bytes, the safetensors library "
                                          "up to 100,000,000"):
        read_header(path)


def test_a_valid_header_over_nereids_limit_is_called_too_long_not_corrupt(tmp_path) -> None:
    """Found by a README check: a header of 17 MiB, which the library reads, was called "not a safetensors file"
    (sending the user to look for corruption); its length is quoted now, with nereid's limit."""
    path = tmp_path / "w.safetensors"
    header = json.dumps({"__metadata__": {"pad": "x" * MAX_HEADER_BYTES}, "a": {"dtype": "F32", "shape": [2],
                                                                              "data_offsets": [0, 8]}}).encode()
    path.write_bytes(_file(header))
    assert _reference_accepts(path.read_bytes())
    with pytest.raises(ConfigError) as caught:
        read_header(path)
    assert str(caught.value) == (f"{path}: its header is {len(header):,} bytes, over nereid's limit of 16 MiB "
                                 "(16,777,216 bytes; the safetensors library allows up to 100,000,000)")


@pytest.mark.parametrize("shape", [[0, 2 ** 64 - 1], [0, 2 ** 40, 2 ** 40], [2 ** 61, 0]])
def test_an_empty_tensor_numpy_cannot_allocate_is_refused_naming_it(tmp_path, shape) -> None:
    """The library accepts these (0 elements, no overflow left to right); nereid accepted them too, then np.empty
    raised a bare ValueError ("Maximum allowed dimension exceeded", "array is too big") naming no file or tensor."""
    path = tmp_path / "w.safetensors"
    path.write_bytes(_file(b'{"a":{' + T + b'},"z":{"dtype":"F32","shape":' + json.dumps(shape).encode()
                           + b',"data_offsets":[8,8]}}'))
    assert _reference_accepts(path.read_bytes())
    with pytest.raises(ConfigError) as caught:
        load_weights(path)
    assert str(caught.value).startswith(f"{path}: z.shape: F32 {shape} is past what nereid can hold: its non-zero "
                                        "dimensions span ")
    assert str(caught.value).endswith("numpy sizes an array (even an empty one) in a signed 64-bit integer, at most "
                                      f"{2 ** 63 - 1}")


def test_the_largest_empty_tensor_numpy_can_allocate_loads(tmp_path) -> None:
    path = tmp_path / "w.safetensors"
    largest = (2 ** 63 - 1) // 4  # F32: 4 bytes an element
    path.write_bytes(_file(b'{"__metadata__":{"axis_order":"xla"},"a":{' + T + b'},"z":{"dtype":"F32","shape":['
                           + str(largest).encode() + b',0],"data_offsets":[8,8]}}'))
    assert dict(load_weights(path))["z"].shape == (largest, 0)


def test_the_migrations_second_read_is_the_librarys_and_follows_the_open_file(tmp_path) -> None:
    """The proof's independent read goes through the library, and reads the open original even after a
    new file took its name (as during the replace step)."""
    import os

    from nereid.backends.xla.migration import _ReferenceRead, make_copy

    rng = np.random.default_rng(5)
    weights = [("w", rng.standard_normal((3, 2)).astype(np.float32)),
               ("h", rng.standard_normal((2, 5)).astype(ml_dtypes.bfloat16))]  # through the raw deserializer
    original = tmp_path / "weights.safetensors"
    write_safetensors(original, weights, legacy=True)
    header = read_header(original)
    fd = os.open(original, os.O_RDONLY)
    try:
        write_safetensors(tmp_path / "other.safetensors", [(n, a * 0) for n, a in weights], legacy=True)
        os.replace(tmp_path / "other.safetensors", original)
        with _ReferenceRead(fd, original) as reference:
            for entry, (_, expected) in zip(header.tensors, weights):
                assert reference.program_bytes(entry) == expected.tobytes()
    finally:
        os.close(fd)
    write_safetensors(original, weights, legacy=True)
    make_copy(original, tmp_path / "weights.T.safetensors")  # proved by both reads, bf16 included
    assert [a.tobytes() for _, a in load_weights(tmp_path / "weights.T.safetensors")] == [
        a.tobytes() for _, a in weights]
