"""Weights files: both layouts load to identical arrays; every header mistake is refused before reading."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from nereid.backends.xla.safetensors import (encode_header, load_weights, read_entry, read_header, read_tensors,
                                             write_safetensors)
from nereid.dtypes import DType
from nereid.errors import ConfigError


def sample_weights() -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        ("w", rng.standard_normal((3, 5, 7)).astype(np.float32)),
        ("scalar", np.array(2.5, dtype=np.float64)),
        ("ids", np.arange(12, dtype=np.int64).reshape(4, 3)),
        ("half", rng.standard_normal((2, 3)).astype(ml_dtypes.bfloat16)),
        ("fp8", rng.standard_normal((4, 2)).astype(ml_dtypes.float8_e4m3fn)),
        ("mask", np.array([[True, False], [False, True]])),
        ("empty", np.zeros((0, 4), dtype=np.float32)),
    ]


def raw_file(path: Path, header: dict, data: bytes = b"", length: int | None = None) -> Path:
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded) if length is None else length) + encoded + data)
    return path


def test_both_layouts_load_to_identical_arrays(tmp_path) -> None:
    weights = sample_weights()
    write_safetensors(tmp_path / "xla.safetensors", weights)
    write_safetensors(tmp_path / "legacy.safetensors", weights, legacy=True)
    xla = load_weights(tmp_path / "xla.safetensors")
    legacy = load_weights(tmp_path / "legacy.safetensors")
    assert [n for n, _ in xla] == [n for n, _ in legacy] == [n for n, _ in weights]
    for (name, expected), (_, a), (_, b) in zip(weights, xla, legacy):
        assert a.shape == b.shape == expected.shape and a.dtype == b.dtype == expected.dtype, name
        assert a.tobytes() == b.tobytes() == expected.tobytes(), name  # byte for byte (NaNs, signed zeros)
        assert a.flags.c_contiguous and b.flags.c_contiguous


def test_legacy_headers_hold_the_reversed_shape(tmp_path) -> None:
    weights = [("w", np.arange(6, dtype=np.float32).reshape(2, 3))]
    write_safetensors(tmp_path / "legacy.safetensors", weights, legacy=True)
    header = read_header(tmp_path / "legacy.safetensors")
    assert header.legacy and header.tensors[0].shape == (3, 2)
    assert header.program_shape(header.tensors[0]) == (2, 3)
    write_safetensors(tmp_path / "xla.safetensors", weights)
    header = read_header(tmp_path / "xla.safetensors")
    assert not header.legacy and header.metadata["axis_order"] == "xla" and header.tensors[0].shape == (2, 3)


def test_every_array_read_starts_on_a_64_byte_boundary_in_both_layouts(tmp_path) -> None:
    # jaxlib's CPU client takes only such an array as the device buffer itself; any other it copies, and the
    # copied-from array lingered until jax's next garbage collection (the weights held twice). The large
    # tensor is one numpy's own allocation never aligns so (malloc gives it 16 bytes past a page).
    weights = [*sample_weights(), ("large", np.arange(1 << 18, dtype=np.float32).reshape(512, 512))]
    for legacy in (False, True):
        path = tmp_path / f"legacy_{legacy}.safetensors"
        write_safetensors(path, weights, legacy=legacy)
        header = read_header(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            entries = [(entry.name, read_entry(fd, entry, path)) for entry in header.tensors]
        finally:
            os.close(fd)
        for (name, expected), (_, array) in zip(weights, load_weights(path, threads=4, chunk_bytes=4097)):
            assert array.tobytes() == expected.tobytes() and array.flags.c_contiguous, (legacy, name)
            # (an empty tensor has no data to align)
            assert array.nbytes == 0 or array.ctypes.data % 64 == 0, (legacy, name, array.ctypes.data % 64)
        for name, array in entries:
            assert array.nbytes == 0 or array.ctypes.data % 64 == 0, ("read_entry", legacy, name)


def test_chunked_parallel_reads_match_sequential_ones(tmp_path) -> None:
    weights = [("big", np.random.default_rng(1).standard_normal(50_000).astype(np.float32)),
               ("small", np.arange(3, dtype=np.int32))]
    write_safetensors(tmp_path / "w.safetensors", weights)
    header = read_header(tmp_path / "w.safetensors")
    chunked = read_tensors(header, threads=4, chunk_bytes=4097)  # odd size: chunks end mid-element
    sequential = read_tensors(header, threads=1)
    for (_, a), (_, b), (_, c) in zip(chunked, sequential, weights):
        assert np.array_equal(a, c) and np.array_equal(b, c)


def test_load_weights_reads_the_data_through_the_open_its_header_was_read_through(tmp_path, monkeypatch) -> None:
    """A file replaced right after its header was read (an atomic redeploy) is read whole as it was: the data
    was read through a second open, at the old header's offsets in the new file (the replicas hunt)."""
    from nereid.backends.xla import safetensors

    path = tmp_path / "w.safetensors"
    weights = sample_weights()
    write_safetensors(path, weights, legacy=True)
    read_header_fd = safetensors.read_header_fd

    def then_replaced(fd: int, where: Path):
        header = read_header_fd(fd, where)
        # Another layout and a longer header: every tensor's data lies elsewhere in the new file.
        write_safetensors(tmp_path / "new.safetensors", [(n, a[..., None]) for n, a in weights],
                          metadata={"note": "x" * 300})
        os.replace(tmp_path / "new.safetensors", path)
        return header

    monkeypatch.setattr(safetensors, "read_header_fd", then_replaced)
    loaded = load_weights(path, threads=4, chunk_bytes=7)
    assert [(n, a.shape, a.tobytes()) for n, a in loaded] == [(n, a.shape, a.tobytes()) for n, a in weights]
    monkeypatch.undo()
    assert [a.shape for _, a in load_weights(path)] == [a[..., None].shape for _, a in weights]  # the new one

def test_argument_order_comes_from_the_metadata(tmp_path) -> None:
    a, b = np.zeros(2, np.float32), np.ones(3, np.float32)
    header = {"__metadata__": {"argument_order": json.dumps(["b", "a"])},
              "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [3], "data_offsets": [8, 20]}}
    path = raw_file(tmp_path / "w.safetensors", header, a.tobytes() + b.tobytes())
    loaded = load_weights(path)
    assert [n for n, _ in loaded] == ["b", "a"] and np.array_equal(loaded[0][1], b)
    del header["__metadata__"]  # without it: the order of the data in the file
    header = {"b": header["b"], "a": header["a"]}
    assert [n for n, _ in load_weights(raw_file(path, header, a.tobytes() + b.tobytes()))] == ["a", "b"]


GOOD = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}

# (header, data, what the message must name)
HEADER_MISTAKES = [
    ({"w": {"dtype": "F33", "shape": [2, 2], "data_offsets": [0, 16]}}, 16, "w.dtype: unknown safetensors dtype"),
    ({"w": {"dtype": "F32", "shape": [2, -2], "data_offsets": [0, 16]}}, 16, "w.shape: must be a list of non-neg"),
    ({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 32]}}, 16, "w.data_offsets: must lie inside the "
                                                                           "16-byte data region"),
    ({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 4]}}, 16, "w.data_offsets: must lie inside"),
    ({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}, 16, "w.data_offsets: holds 12 bytes but "
                                                                           "F32 [2, 2] needs 16"),
    ({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0]}}, 16, "w.data_offsets: must be [begin, end]"),
    ({"w": {"dtype": "F32", "shape": [2, 2]}}, 16, "w: must be an object with dtype, shape and data_offsets"),
    ({**GOOD, "v": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, 16,
     "v.data_offsets: overlaps tensor 'w'"),
    ({**GOOD, "__metadata__": {"axis_order": "julia"}}, 16, "__metadata__.axis_order: unknown weights layout"),
    ({**GOOD, "__metadata__": {"n": 1}}, 16, "__metadata__: must map names to strings"),
    ({**GOOD, "__metadata__": {"argument_order": "w"}}, 16, "argument_order: must be a JSON list"),
    # Found by a bug hunt: a RecursionError, naming neither the file nor the key.
    ({**GOOD, "__metadata__": {"argument_order": "[" * 100_000 + "]" * 100_000}}, 16,
     "argument_order: must be a JSON list"),
    ({**GOOD, "__metadata__": {"argument_order": '["w", "w"]'}}, 16, "names ['w'] twice"),
    ({**GOOD, "__metadata__": {"argument_order": '["w", "x"]'}}, 16, "names ['x'], which the file does not hold"),
    ({**GOOD, "v": {"dtype": "F32", "shape": [0], "data_offsets": [16, 16]},
      "__metadata__": {"argument_order": '["w"]'}}, 16, "omits ['v']"),
]


@pytest.mark.parametrize("header, data_len, problem", HEADER_MISTAKES, ids=[m[2][:40] for m in HEADER_MISTAKES])
def test_header_mistakes_are_refused(tmp_path, header, data_len, problem) -> None:
    path = raw_file(tmp_path / "w.safetensors", header, bytes(data_len))
    with pytest.raises(ConfigError) as caught:
        read_header(path)
    assert str(caught.value).startswith(f"{path}: ") and problem in str(caught.value), str(caught.value)


def test_file_level_mistakes(tmp_path) -> None:
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(ConfigError, match="file is 2 bytes, shorter than the 8-byte header length"):
        read_header(short)
    with pytest.raises(ConfigError, match=r"header length field does not give a length from 1 to \d+ bytes") as info:
        read_header(raw_file(tmp_path / "long.safetensors", GOOD, bytes(16), length=1_000_000))
    assert "1000000" not in str(info.value)  # sizes, never the file's contents
    with pytest.raises(ConfigError, match="header length field does not give a length"):
        read_header(raw_file(tmp_path / "zero.safetensors", GOOD, bytes(16), length=0))
    bad_json = tmp_path / "json.safetensors"
    bad_json.write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(ConfigError, match="header: not valid JSON"):
        read_header(bad_json)
    duplicate = tmp_path / "dup.safetensors"
    text = b'{"__metadata__": {}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "__metadata__": {}}'
    duplicate.write_bytes(struct.pack("<Q", len(text)) + text + bytes(4))
    with pytest.raises(ConfigError, match="__metadata__ appears twice"):
        read_header(duplicate)
    with pytest.raises(ConfigError, match="must be a JSON object"):
        read_header(raw_file(tmp_path / "list.safetensors", [1, 2]))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cannot read"):
        read_header(tmp_path / "absent.safetensors")


def test_truncation_after_validation_is_reported(tmp_path) -> None:
    path = tmp_path / "w.safetensors"
    write_safetensors(path, [("w", np.zeros(1000, np.float32))])
    header = read_header(path)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    with pytest.raises(ConfigError, match="file ended at byte"):
        read_tensors(header)


def test_a_file_that_is_not_safetensors_is_described_by_its_size_not_its_contents(tmp_path) -> None:
    """A weights symlink to /etc/passwd leaked the file's first 8 bytes (as the header length)."""
    secret = tmp_path / "passwd"
    secret.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
    with pytest.raises(ConfigError) as info:
        read_header(secret)
    message = str(info.value)
    leaked = str(struct.unpack("<Q", b"root:x:0")[0])
    assert "not a safetensors file" in message and "the file is 32 bytes" in message
    assert leaked not in message and "root" not in message.replace(str(tmp_path), "")


def test_deeply_nested_header_names_the_file_and_the_problem(tmp_path) -> None:
    """A deeply nested JSON header gave a bare 'maximum recursion depth exceeded'."""
    header = b"[" * 100_000 + b"]" * 100_000
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ConfigError, match=r"deep.safetensors: header: JSON nested too deeply"):
        read_header(path)


def test_a_long_argument_order_is_checked_in_linear_time(tmp_path) -> None:
    """A 100k-entry argument_order took 66 s (a names.count per name); 30k would take over 5 s."""
    names = [f"t{i}" for i in range(30_000)]
    header = {name: {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i, name in enumerate(names)}
    header["__metadata__"] = {"argument_order": json.dumps(names[::-1] + ["t0"])}
    path = raw_file(tmp_path / "w.safetensors", header, bytes(len(names)))
    started = time.thread_time()  # (CPU time: a loaded machine's waits do not count)
    with pytest.raises(ConfigError, match=r"names \['t0'\] twice") as info:
        read_header(path)
    assert time.thread_time() - started < 5
    assert len(str(info.value)) <= 4096


def test_a_tensor_named_metadata_is_refused(tmp_path) -> None:
    # Its header entry would replace the file's metadata (argument order, axis order).
    path = tmp_path / "meta.safetensors"
    with pytest.raises(ValueError, match="cannot be named '__metadata__'"):
        write_safetensors(path, [("w", np.ones(2, np.float32)), ("__metadata__", np.ones(2, np.float32))])
    assert not path.exists()
    with pytest.raises(ValueError, match="cannot be named '__metadata__'"):
        encode_header([("__metadata__", DType.FP32, (2,), 8)], {})
    # A name given twice: the later header entry would replace the earlier (encode_header serves the migration too).
    with pytest.raises(ValueError, match=r"duplicate weight names in \['w', 'w'\]"):
        write_safetensors(path, [("w", np.ones(2, np.float32)), ("w", np.ones(2, np.float32))])
    assert not path.exists()
    with pytest.raises(ValueError, match="duplicate weight names"):
        encode_header([("w", DType.FP32, (2,), 8), ("w", DType.FP32, (2,), 8)], {})
